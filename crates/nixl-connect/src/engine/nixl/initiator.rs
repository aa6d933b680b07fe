//! The initiator: the agent that posts this connector's reads and writes, the peers loaded into
//! it (once per distinct metadata string, forgotten when idle or stale), its prepared descriptor
//! lists and its transfers in flight.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use super::ffi::{AgentKey, NixlAgent, PostError, Prepared, Transfer};
use super::registry::{Mail, RegInner, Registry, Side};
use super::{contain, overlap, MAX_IDLE_PEERS, MAX_LOADED, MAX_LOADED_BYTES, MAX_PREPARED};
use crate::engine::cmd::Mailbox;
use crate::engine::transport::{small_host, ActiveSpec, Event, OpId};
use crate::error::{Error, ErrorSource, Result};
use crate::reg::{Range, RegToken};
use crate::state::TransferPath;
use crate::stats::EngineStats;

pub(super) struct Peer {
    refs: usize,
    last_used: Instant,
    /// A transfer to it failed or its metadata went stale: forgotten once `refs` reaches 0
    /// (invalidating a peer with transfers in flight would make NIXL report them gone while
    /// UCX may still be moving their bytes).
    stale: bool,
}

pub(super) struct Inflight {
    id: OpId,
    peer: Arc<str>,
    transfer: Transfer,
    _tokens: Vec<RegToken>,
    /// Small host memory ([`Pace::small`](crate::pace::Pace::small)): a caller's watch may poll it.
    small: bool,
}

pub(super) struct Initiator {
    agent: NixlAgent,
    regs: Registry,
    peers: HashMap<Arc<str>, Peer>,
    /// Metadata strings already loaded, and the peer each named.
    loaded: HashMap<Arc<str>, Arc<str>>,
    /// Bytes of agent metadata (and of the strings kept in `loaded`) loaded since the last shed.
    loaded_bytes: usize,
    local_prep: HashMap<Vec<Range>, Prepared>,
    remote_prep: HashMap<(Arc<str>, Vec<Range>), Prepared>,
    inflight: Vec<Inflight>,
    /// Transfers a caller's watch saw end whose end the engine thread completes (it forgets or
    /// invalidates the peer), with what the poll said.
    ended: Vec<(Inflight, std::result::Result<bool, ErrorSource>)>,
}

impl Drop for Initiator {
    fn drop(&mut self) {
        // Requests, then prepared lists, then registrations, then the agent: destroying the agent's
        // UCX worker ends every transfer still running, so nothing touches the memory afterwards.
        self.inflight.clear();
        self.ended.clear();
        self.local_prep.clear();
        self.remote_prep.clear();
        self.regs.clear();
    }
}

impl Initiator {
    /// The initiator of `agent`, of generation `gen`, with nothing registered, loaded or in
    /// flight.
    pub(super) fn new(agent: NixlAgent, gen: u64) -> Self {
        Self {
            agent,
            regs: Registry::new(Side::Initiator, gen),
            peers: HashMap::new(),
            loaded: HashMap::new(),
            loaded_bytes: 0,
            local_prep: HashMap::new(),
            remote_prep: HashMap::new(),
            inflight: Vec::new(),
            ended: Vec::new(),
        }
    }

    /// The agent's name.
    pub(super) fn name(&self) -> &str {
        self.agent.name()
    }

    /// Live registrations, and their bytes.
    pub(super) fn registered(&self) -> (usize, u64) {
        (self.regs.len(), self.regs.bytes())
    }

    /// Peers whose metadata NIXL holds.
    pub(super) fn peers_loaded(&self) -> usize {
        self.peers.len()
    }

    /// A live registration containing `r`, or a new one of exactly `r`; lists prepared over
    /// memory a registration replaced are forgotten.
    pub(super) fn register(
        &mut self,
        key: &AgentKey,
        r: Range,
        mailbox: &Mailbox<Mail>,
        stats: &mut EngineStats,
    ) -> Result<(Arc<RegInner>, Range)> {
        let mut replaced = None;
        let got = self.regs.get(key, &self.agent, r, mailbox, stats, &mut replaced);
        if let Some(old) = replaced {
            self.local_prep.retain(|k, _| !k.iter().any(|x| overlap(x, &old)));
        }
        got
    }

    /// Registration `id` of `range` (of agent generation `gen`) is given up: deregistered, and
    /// the lists prepared over its memory forgotten.
    pub(super) fn deregister(&mut self, gen: u64, range: Range, id: u64) {
        if self.regs.deregister(gen, range, id) {
            self.local_prep
                .retain(|k, _| !k.iter().any(|r| overlap(r, &range)));
        }
    }

    /// A transfer posted, to watch until it ends.
    pub(super) fn track(&mut self, f: Inflight) {
        self.inflight.push(f);
    }

    /// Transfers in flight, and ends a caller's watch saw that the engine thread completes.
    pub(super) fn busy(&self) -> bool {
        !self.inflight.is_empty() || !self.ended.is_empty()
    }

    /// Ends a caller's watch saw that the engine thread completes.
    pub(super) fn has_ended(&self) -> bool {
        !self.ended.is_empty()
    }

    /// Transfers are in flight and every one is small (a caller's watch may poll them).
    pub(super) fn only_small_in_flight(&self) -> bool {
        !self.inflight.is_empty() && self.inflight.iter().all(|f| f.small)
    }

    /// Nothing but small transfers in flight, and no end left to complete.
    pub(super) fn nothing_large(&self) -> bool {
        self.ended.is_empty() && self.inflight.iter().all(|f| f.small)
    }

    /// Operation `id` has a transfer in flight.
    pub(super) fn carries(&self, id: OpId) -> bool {
        self.inflight.iter().any(|f| f.id == id)
    }

    /// The operations in flight and their peers (those a reset interrupts).
    pub(super) fn in_flight(&self) -> Vec<(OpId, Arc<str>)> {
        self.inflight.iter().map(|f| (f.id, f.peer.clone())).collect()
    }

    /// Completes the ends a caller's watch saw.
    pub(super) fn settle(&mut self, out: &mut Vec<Event>) {
        for (f, done) in std::mem::take(&mut self.ended) {
            self.finish(f, done, out);
        }
    }

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
    pub(super) fn load(
        &mut self,
        key: &AgentKey,
        spec: &ActiveSpec,
        stats: &mut EngineStats,
    ) -> Result<Arc<str>> {
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
        let mut r = self.agent.load_remote(key, &spec.peer.reach);
        if r.is_err() {
            match self.peers.get(&spec.peer.name) {
                // A peer restarted under the same name, or its metadata changed in a way NIXL does not
                // merge: forget it and load afresh (a failed load is never retried without that).
                Some(p) if p.refs == 0 => {
                    self.forget_peer(&spec.peer.name.clone());
                    r = self.agent.load_remote(key, &spec.peer.reach);
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

    /// Starts `spec`'s transfer on the engine thread (registering, loading and preparing what is
    /// missing, then posting): the transfer in flight (none if it ended at once) and the tokens.
    pub(super) fn start(
        &mut self,
        key: &AgentKey,
        spec: &ActiveSpec,
        mailbox: &Mailbox<Mail>,
        stats: &mut EngineStats,
    ) -> std::result::Result<(Option<Inflight>, Vec<RegToken>), StartError> {
        let mut tokens = Vec::with_capacity(spec.local.len());
        for r in &spec.local {
            tokens.push(RegToken::new(self.register(key, *r, mailbox, stats)?.0));
        }
        let name = self.load(key, spec, stats)?;
        if self.local_prep.len() > MAX_PREPARED {
            self.local_prep.clear();
        }
        if self.remote_prep.len() > MAX_PREPARED {
            self.remote_prep.clear();
        }
        if !self.local_prep.contains_key(&spec.local) {
            let p = self.agent.prepare(key, None, &spec.local)?;
            self.local_prep.insert(spec.local.clone(), p);
        }
        let rkey = (name.clone(), spec.remote.clone());
        if !self.remote_prep.contains_key(&rkey) {
            let p = self.agent.prepare(key, Some(&name), &rkey.1)?;
            self.remote_prep.insert(rkey.clone(), p);
        }
        let (lp, rp) = (&self.local_prep[&spec.local], &self.remote_prep[&rkey]);
        let posted = self.agent.post_prepared(spec.write, lp, rp, spec.key.as_bytes());
        if !matches!(posted, Err(PostError::Local(_))) {
            stats.transfers += 1;
        }
        match posted {
            Ok(None) => Ok((None, tokens)),
            Ok(Some(t)) => {
                if let Some(p) = self.peers.get_mut(&name) {
                    p.refs += 1;
                    p.last_used = Instant::now();
                }
                Ok((
                    Some(Inflight {
                        id: spec.id,
                        peer: name,
                        transfer: t,
                        _tokens: tokens.clone(),
                        small: small_host(&spec.local),
                    }),
                    tokens,
                ))
            }
            Err(PostError::Local(e)) => Err(StartError::Failed(e)),
            // Part of the transfer may have been posted before the failure, and releasing the
            // request does not stop it: only destroying the initiator does (see `begin`).
            Err(PostError::Transfer(e)) => Err(StartError::Posted(transfer_failed(&name, e))),
        }
    }

    /// On a caller's turn, posts `spec`'s small host transfer if nothing is missing to post it and no
    /// end waits for the engine; else `None`. A failed post comes back with its tokens (to reset first).
    pub(super) fn post_ready(
        &mut self,
        spec: &ActiveSpec,
        stats: &mut EngineStats,
        out: &mut Vec<Event>,
    ) -> Option<std::result::Result<(), (Error, Vec<RegToken>)>> {
        if !self.ended.is_empty() {
            // A transfer's failure not yet settled may be this peer's.
            return None;
        }
        let name = self.loaded.get(&spec.peer.published).cloned()?;
        if self.peers.get(&name).is_none_or(|p| p.stale) {
            return None;
        }
        let rkey = (name.clone(), spec.remote.clone());
        let (lp, rp) = (self.local_prep.get(&spec.local)?, self.remote_prep.get(&rkey)?);
        let tokens = spec
            .local
            .iter()
            .map(|r| self.regs.covering(r).map(|(t, _)| RegToken::new(t)))
            .collect::<Option<Vec<_>>>()?;
        out.push(Event::taken(spec.id, TransferPath::Nixl));
        stats.registration_hits += tokens.len() as u64;
        // A panic inside the bindings fails this operation, as on the engine thread.
        let posted = contain("start transfer", || {
            Ok(self.agent.post_prepared(spec.write, lp, rp, spec.key.as_bytes()))
        })
        .unwrap_or_else(|e| Err(PostError::Local(e)));
        if !matches!(posted, Err(PostError::Local(_))) {
            stats.transfers += 1;
        }
        match posted {
            Ok(None) => {
                out.push(Event::Registered { id: spec.id, tokens });
                out.push(Event::ended(spec.id, Ok(())));
            }
            Ok(Some(t)) => {
                if let Some(p) = self.peers.get_mut(&name) {
                    p.refs += 1;
                    p.last_used = Instant::now();
                }
                self.inflight.push(Inflight {
                    id: spec.id,
                    peer: name,
                    transfer: t,
                    _tokens: tokens.clone(),
                    small: true,
                });
                out.push(Event::Registered { id: spec.id, tokens });
            }
            Err(PostError::Local(e)) => out.push(Event::ended(spec.id, Err(e))),
            Err(PostError::Transfer(e)) => return Some(Err((transfer_failed(&name, e), tokens))),
        }
        Some(Ok(()))
    }

    /// Polls the transfers in flight and [`finish`](Self::finish)es those that ended; a caller's turn
    /// (`by_caller`) leaves an end that must forget the peer to the engine (`ended`). True if any ended.
    pub(super) fn poll_inflight(&mut self, by_caller: bool, out: &mut Vec<Event>) -> bool {
        let mut any = false;
        let mut i = 0;
        while i < self.inflight.len() {
            match self.agent.poll(&self.inflight[i].transfer) {
                Ok(false) => i += 1,
                done => {
                    let f = self.inflight.swap_remove(i);
                    any = true;
                    let callers_end = done.is_ok() && self.peers.get(&f.peer).is_some_and(|p| !p.stale);
                    if by_caller && !callers_end {
                        self.ended.push((f, done));
                    } else {
                        self.finish(f, done, out);
                    }
                }
            }
        }
        any
    }

    /// Ends transfer `f`, which a poll saw end (`done`): releases its request; a failure forgets its peer.
    pub(super) fn finish(
        &mut self,
        f: Inflight,
        done: std::result::Result<bool, ErrorSource>,
        out: &mut Vec<Event>,
    ) {
        let (id, peer) = (f.id, f.peer.clone());
        drop(f); // releases the request
        self.unref(&peer);
        let result = match done {
            Ok(_) => Ok(()),
            Err(e) => {
                self.forget_peer(&peer);
                Err(transfer_failed(&peer, e))
            }
        };
        out.push(Event::ActiveEnded { id, result });
    }
}

/// Why a transfer did not start.
pub(super) enum StartError {
    /// Nothing was posted.
    Failed(Error),
    /// The post failed in the transport: part of it may have been posted.
    Posted(Error),
}

impl From<Error> for StartError {
    fn from(e: Error) -> Self {
        StartError::Failed(e)
    }
}

/// A transfer's failure in UCX, as the operation's error.
pub(super) fn transfer_failed(peer: &str, e: ErrorSource) -> Error {
    Error::RemoteGone {
        agent: peer.to_string(),
        reason: "the transfer failed in UCX: the peer's process exited or its connection broke".into(),
        source: Some(e),
    }
}
