//! The initiator: the agent that posts this connector's reads and writes, the peers loaded into
//! it (once per distinct metadata string, forgotten when idle or stale), its prepared descriptor
//! lists and its transfers in flight.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use super::ffi::{NixlAgent, Prepared, Transfer};
use super::registry::Registry;
use super::{MAX_IDLE_PEERS, MAX_LOADED, MAX_LOADED_BYTES};
use crate::engine::transport::{ActiveSpec, OpId};
use crate::error::{Error, ErrorSource, Result};
use crate::reg::{Range, RegToken};
use crate::stats::EngineStats;

pub(super) struct Peer {
    pub(super) refs: usize,
    pub(super) last_used: Instant,
    /// A transfer to it failed or its metadata went stale: forgotten once `refs` reaches 0
    /// (invalidating a peer with transfers in flight would make NIXL report them gone while
    /// UCX may still be moving their bytes).
    pub(super) stale: bool,
}

pub(super) struct Inflight {
    pub(super) id: OpId,
    pub(super) peer: Arc<str>,
    pub(super) transfer: Transfer,
    pub(super) _tokens: Vec<RegToken>,
    /// Host memory of at most [`WAIT_SPIN_MAX_BYTES`](crate::WAIT_SPIN_MAX_BYTES): a caller's
    /// watch may poll it (a poll progresses the initiator's UCX worker, which sends what there is
    /// to send).
    pub(super) small: bool,
}

pub(super) struct Initiator {
    pub(super) agent: NixlAgent,
    pub(super) regs: Registry,
    pub(super) peers: HashMap<Arc<str>, Peer>,
    /// Metadata strings already loaded, and the peer each named.
    pub(super) loaded: HashMap<Arc<str>, Arc<str>>,
    /// Bytes of agent metadata (and of the strings kept in `loaded`) loaded since the last shed.
    pub(super) loaded_bytes: usize,
    pub(super) local_prep: HashMap<Vec<Range>, Prepared>,
    pub(super) remote_prep: HashMap<(Arc<str>, Vec<Range>), Prepared>,
    pub(super) inflight: Vec<Inflight>,
    /// Transfers a caller's watch saw end whose end the engine thread completes (a failure,
    /// which forgets the peer; or a peer forgotten meanwhile, which NIXL must invalidate), with
    /// what the poll said.
    pub(super) ended: Vec<(Inflight, std::result::Result<bool, ErrorSource>)>,
}

impl Drop for Initiator {
    fn drop(&mut self) {
        // Requests, then prepared lists, then registrations, then the agent: destroying the agent's
        // UCX worker ends every transfer still running, so nothing touches the memory afterwards.
        self.inflight.clear();
        self.ended.clear();
        self.local_prep.clear();
        self.remote_prep.clear();
        self.regs.map.clear();
    }
}

impl Initiator {
    /// Forgets a peer: at once if no transfer to it is in flight, otherwise when the last one
    /// ends. Either way no new transfer uses what was loaded for it.
    pub(super) fn forget_peer(&mut self, name: &str) {
        self.loaded.retain(|_, n| &**n != name);
        self.remote_prep.retain(|(n, _), _| &**n != name);
        match self.peers.get_mut(name) {
            Some(p) if p.refs > 0 => p.stale = true,
            Some(_) => {
                self.peers.remove(name);
                self.agent.invalidate_remote(name);
            }
            None => {}
        }
    }

    /// Forgets every peer no transfer uses, and every loaded string: NIXL frees what it kept of
    /// those peers (peers in use stay loaded; their strings are loaded again if they come back).
    pub(super) fn shed(&mut self) {
        let idle: Vec<Arc<str>> = self
            .peers
            .iter()
            .filter(|(_, p)| p.refs == 0)
            .map(|(n, _)| n.clone())
            .collect();
        for name in idle {
            self.forget_peer(&name);
        }
        self.loaded.clear();
        self.loaded_bytes = 0;
    }

    /// A transfer to `name` has ended.
    pub(super) fn unref(&mut self, name: &str) {
        if let Some(p) = self.peers.get_mut(name) {
            p.refs = p.refs.saturating_sub(1);
            if p.refs == 0 && p.stale {
                self.peers.remove(name);
                self.agent.invalidate_remote(name);
            }
        }
    }

    pub(super) fn evict_idle(&mut self) {
        while self.peers.values().filter(|p| p.refs == 0).count() > MAX_IDLE_PEERS {
            let Some(name) = self
                .peers
                .iter()
                .filter(|(_, p)| p.refs == 0)
                .min_by_key(|(_, p)| p.last_used)
                .map(|(n, _)| n.clone())
            else {
                break;
            };
            self.forget_peer(&name);
        }
    }

    /// Makes sure the peer's metadata string is loaded; returns its agent name.
    pub(super) fn load(&mut self, spec: &ActiveSpec, stats: &mut EngineStats) -> Result<Arc<str>> {
        if let Some(n) = self.loaded.get(&spec.peer.published) {
            return Ok(n.clone());
        }
        if self.peers.get(&spec.peer.name).is_some_and(|p| p.stale) {
            return Err(Error::Transfer {
                agent: spec.peer.name.to_string(),
                reason: "an earlier transfer with this peer failed and others are still in flight; \
                         start the operation again once they have ended"
                    .into(),
                source: None,
            });
        }
        let size = spec.peer.reach.len() + spec.peer.published.len();
        if self.loaded_bytes + size > MAX_LOADED_BYTES {
            self.shed();
        }
        let mut r = self.agent.load_remote(&spec.peer.reach);
        if r.is_err() {
            match self.peers.get(&spec.peer.name) {
                // A peer restarted under the same name, or its metadata changed in a way NIXL
                // does not merge: forget it entirely and load afresh (a failed load must never be
                // retried without invalidating first).
                Some(p) if p.refs == 0 => {
                    self.forget_peer(&spec.peer.name.clone());
                    r = self.agent.load_remote(&spec.peer.reach);
                }
                // Transfers to it are in flight: it cannot be invalidated now.
                Some(_) => {
                    return Err(Error::Transfer {
                        agent: spec.peer.name.to_string(),
                        reason: "the peer's metadata changed (it restarted or registered the same \
                                 memory again) while transfers to it are in flight; start the \
                                 operation again once they have ended"
                            .into(),
                        source: None,
                    });
                }
                None => {}
            }
        }
        let name: Arc<str> = match r {
            Ok(n) => n.into(),
            Err(e) => {
                self.agent.invalidate_remote(&spec.peer.name);
                self.peers.remove(&spec.peer.name);
                return Err(Error::RemoteGone {
                    agent: spec.peer.name.to_string(),
                    reason: "NIXL could not connect to the agent its metadata names: the peer has \
                         exited, or the metadata belongs to another host's network"
                        .into(),
                    source: Some(e),
                });
            }
        };
        stats.remote_loads += 1;
        self.loaded_bytes += size;
        if self.loaded.len() >= MAX_LOADED {
            self.loaded.clear();
        }
        self.loaded.insert(spec.peer.published.clone(), name.clone());
        self.peers.entry(name.clone()).or_insert(Peer {
            refs: 0,
            last_used: Instant::now(),
            stale: false,
        });
        self.evict_idle();
        Ok(name)
    }
}
