//! The same-host transport: Rust peers on one host copy host memory directly, negotiated out of
//! band so the published metadata stays exactly NIXL's.
//!
//! Each connector listens on an abstract Unix socket named from its agent name
//! ([`socket_name`]), which scopes it to this host's network namespace. An active side that finds
//! the socket named by a metadata's agent connects, hands over a sealed slot table ([`slots`]),
//! and asks for access to the operation by its notification key ([`proto`]). The passive side
//! checks everything against its live operation: the peer's uid (`SO_PEERCRED`), the key, every
//! range inside the operation's descriptors, the direction, one writer at a time; access ends when
//! the operation completes, is cancelled or dropped (a replayed metadata string is refused).
//!
//! The side whose memory is written copies, pulling with `process_vm_readv` ([`cma`]): the reader
//! for a read, the passive side for a write. So each process writes only its own memory, and the
//! owner of the source can revoke a grant at any instant without waiting (see [`slots`]). Device
//! memory (feature `cuda`) goes the same way through CUDA IPC (`ipc`): the source's owner exports
//! it, the destination's owner opens it and copies on its own stream. No socket, a peer on another
//! host, another user, a kernel that forbids cross-memory attach, host memory into device memory,
//! or no CUDA where device memory is involved: the operation goes to NIXL instead
//! ([`Event::Declined`]).

mod auth;
mod client;
pub(crate) mod cma;
mod conn;
mod copies;
mod device;
#[cfg(feature = "cuda")]
pub(crate) mod ipc;
pub(crate) mod proto;
mod records;
mod server;
pub(crate) mod slots;
mod sys;

use std::collections::{HashMap, HashSet};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use self::auth::KeyId;
use self::conn::Conn;
pub(crate) use self::device::device_path_refusal;
use self::device::uniform;
use self::proto::Msg;
use self::records::{refused, Act, Expect, Exports, Finished, Outstanding, Phase};
use self::server::Scope;
pub(crate) use self::sys::listen;
use self::sys::{timerfd, uid};
use super::poller::{hung_up, Registrar, Waker};
use super::stats::EngineStats;
use super::transport::{ActiveSpec, Event, Exposure, OpId, PassiveSpec, Polling, Transport};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::state::TransferPath;

/// The token of the listening socket in the engine's poller.
const LISTENER: u64 = 0;
/// The poller token of the timer that re-arms the listener after running out of descriptors.
const ACCEPT_TIMER: u64 = u64::MAX - 1; // u64::MAX is the poller's own wake-up
/// How long the listener rests after `accept` ran out of descriptors or memory.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);
/// Connections this connector serves at once (same-host peers beyond it are refused and use NIXL).
const MAX_SERVED: usize = 1024;
/// Connections it serves at once to one process.
const MAX_SERVED_PER_PID: usize = 64;
/// The most read grants one connection holds at once (a well-behaved client has at most one per
/// slot of its table); past it, requests take NIXL.
const MAX_GRANTS_PER_CONN: usize = slots::SLOTS;
/// How long a peer with no same-host socket is not asked again.
const NEGATIVE_TTL: Duration = Duration::from_secs(2);
/// Negative answers remembered.
const MAX_NEGATIVE: usize = 4096;

/// A connection's id (also its token in the engine's poller); never reused.
type ConnId = u64;

/// Why a request for a key this side has no live operation for is refused.
const NOT_LIVE: &str = "no live operation has this notification key: it completed, was cancelled \
                        or dropped (a replayed metadata string?)";

/// The same-host transport of one connector.
pub(crate) struct LocalTransport {
    enabled: bool,
    listener: Option<OwnedFd>,
    reg: Registrar,
    waker: Waker,
    uid: libc::uid_t,
    conns: HashMap<ConnId, Conn>,
    next_conn: ConnId,
    by_peer: HashMap<Arc<str>, ConnId>,
    negative: HashMap<Arc<str>, Instant>,
    scopes: HashMap<Arc<str>, Scope>,
    /// The key of each live scope by its key id (the name requests use on the wire).
    key_ids: HashMap<KeyId, Arc<str>>,
    /// Fingerprints of this connector's exposers' connection metadata.
    identities: HashSet<u64>,
    acts: HashMap<OpId, Act>,
    finished: Finished,
    exports: Exports,
    outstanding: Arc<Outstanding>,
    refused_peers: u64,
    /// A timer (made up front: there may be no descriptor left when it is needed) that re-arms
    /// the listener after `accept` ran out of descriptors, instead of spinning on it.
    accept_timer: Option<OwnedFd>,
    /// [`Self::stop_copies`] ran (the drop does not wait again).
    stopped: bool,
}

impl Drop for LocalTransport {
    fn drop(&mut self) {
        if !self.stopped {
            self.stop_copies(None);
        }
    }
}

impl LocalTransport {
    /// A transport serving on `listener` (none: this connector cannot be reached on this path)
    /// and, when `enabled`, trying it for active operations.
    pub(crate) fn new(enabled: bool, listener: Option<OwnedFd>, reg: Registrar, waker: Waker) -> Self {
        if let Some(l) = &listener {
            if let Err(e) = reg.add(l.as_raw_fd(), LISTENER, true, false) {
                tracing::warn!(error = %e, "cannot watch the same-host socket");
            }
        }
        let accept_timer = listener.as_ref().and_then(|_| {
            let t = timerfd().ok()?;
            reg.add(t.as_raw_fd(), ACCEPT_TIMER, true, false).ok()?;
            Some(t)
        });
        Self {
            enabled,
            listener,
            reg,
            waker,
            uid: uid(),
            conns: HashMap::new(),
            next_conn: 1,
            by_peer: HashMap::new(),
            negative: HashMap::new(),
            scopes: HashMap::new(),
            key_ids: HashMap::new(),
            identities: HashSet::new(),
            acts: HashMap::new(),
            finished: Arc::new(Mutex::new(Vec::new())),
            exports: Arc::new(Mutex::new(Vec::new())),
            outstanding: Arc::new(Outstanding::default()),
            refused_peers: 0,
            accept_timer,
            stopped: false,
        }
    }

    fn handle(&mut self, i: ConnId, m: Msg, out: &mut Vec<Event>) {
        let client = self.conns.get(&i).is_some_and(|c| c.client);
        match (client, m) {
            (
                false,
                Msg::Hello {
                    version,
                    key_id,
                    nonce,
                },
            ) => self.on_hello(i, version, key_id, nonce),
            (true, Msg::Welcome { proof }) => self.on_welcome(i, proof, out),
            (false, Msg::Trusted) => self.on_trusted(i),
            (true, Msg::Reject { reason }) if self.conns.get(&i).is_some_and(|c| !c.ready) => {
                let c = self.conns.get_mut(&i).expect("live");
                c.dead = true;
                let peer = c.peer.clone();
                self.decline_queued(i, &reason, out);
                self.negative.insert(peer, Instant::now());
            }
            (
                false,
                Msg::Req {
                    slot,
                    gen,
                    write,
                    ident,
                    key_id,
                    mac,
                    device,
                    remote,
                    local,
                    sources,
                },
            ) => {
                if self.identities.contains(&ident) {
                    let Some(key) = self.proven_key(i, slot, gen, write, &key_id, &mac) else {
                        return;
                    };
                    self.on_req(i, slot, gen, write, &key, device, remote, local, sources, out)
                } else if let Some(c) = self.conns.get_mut(&i) {
                    // Metadata of an agent of the same name elsewhere (another host, an earlier
                    // process): not this connector's to refuse; NIXL will sort it out.
                    c.send(&Msg::Fallback {
                        slot,
                        gen,
                        reason: "the metadata names another agent of the same name".into(),
                    });
                }
            }
            (true, Msg::Grant { slot, gen }) if self.expects(i, slot, gen, Expect::Grant) => {
                self.on_grant(i, slot, gen, None, out)
            }
            (true, Msg::GrantIpc { slot, gen, sources }) if self.expects(i, slot, gen, Expect::Grant) => {
                self.on_grant(i, slot, gen, Some(sources), out)
            }
            (
                true,
                Msg::Refuse {
                    slot,
                    gen,
                    code,
                    reason,
                },
            ) if self.expects(i, slot, gen, Expect::Answer) => {
                if let Some((id, a)) = self.take_act(i, slot, gen) {
                    let peer = a.spec.peer.to_string();
                    self.free_slot(i, slot, gen);
                    if !matches!(a.phase, Phase::Abandoned) {
                        out.push(Event::ActiveEnded {
                            id,
                            result: Err(refused(peer, code, reason)),
                        });
                    }
                }
            }
            (true, Msg::Fallback { slot, gen, reason }) if self.expects(i, slot, gen, Expect::Answer) => {
                if let Some((_, a)) = self.take_act(i, slot, gen) {
                    self.free_slot(i, slot, gen);
                    if !matches!(a.phase, Phase::Abandoned) {
                        out.push(Event::Declined {
                            spec: a.spec,
                            reason: reason.into(),
                        });
                    }
                }
            }
            (
                true,
                Msg::Done {
                    slot,
                    gen,
                    ok,
                    reason,
                },
            ) if self.expects(i, slot, gen, Expect::WriteDone) => {
                // The passive side finished copying our write.
                if let Some((id, a)) = self.take_act(i, slot, gen) {
                    let peer = a.spec.peer.to_string();
                    self.free_slot(i, slot, gen);
                    if !matches!(a.phase, Phase::Abandoned) {
                        out.push(Event::ActiveEnded {
                            id,
                            result: if ok {
                                Ok(())
                            } else {
                                Err(Error::Transfer {
                                    agent: peer,
                                    reason,
                                    source: None,
                                })
                            },
                        });
                    }
                }
            }
            (false, Msg::Done { slot, gen, ok, .. }) => self.on_read_done(i, slot, gen, ok, out),
            // Anything else breaks the protocol (a frame out of order, for an operation in another
            // phase, or for none): the connection is closed; copies already running end on their
            // own and nothing of theirs is released before that.
            (_, other) => {
                tracing::debug!(?other, "unexpected same-host frame; closing the connection");
                if let Some(c) = self.conns.get_mut(&i) {
                    c.dead = true;
                }
            }
        }
    }
}

impl Transport for LocalTransport {
    fn expose(&mut self, spec: &PassiveSpec, out: &mut Exposure) -> Result<()> {
        if self.listener.is_none() {
            return Ok(());
        }
        self.identities.insert(out.identity);
        let mut ranges = spec.ranges.clone();
        ranges.sort_by_key(|r| r.addr);
        self.key_ids.insert(auth::key_id(&spec.key), spec.key.clone());
        self.scopes.insert(
            spec.key.clone(),
            Scope {
                kind: spec.kind,
                device: spec.ranges.first().map_or(Device::Host, |r| r.device),
                ranges,
                state: spec.state.clone(),
                grants: HashSet::new(),
                writer: None,
            },
        );
        Ok(())
    }

    fn unexpose(&mut self, key: &str) {
        self.release_writer(key);
        let Some(s) = self.scopes.remove(key) else { return };
        self.key_ids.remove(&auth::key_id(key));
        for (i, slot, gen) in s.grants {
            if let Some(t) = self.conns.get(&i).and_then(|c| c.slots.as_ref()) {
                t.revoke(slot, gen);
            }
            self.ungrant(i);
        }
        if s.writer.is_none() {
            s.state.mark_released();
        }
    }

    fn begin(&mut self, spec: ActiveSpec, out: &mut Vec<Event>) {
        if !self.enabled {
            out.push(Event::Declined {
                spec,
                reason: "the same-host path is off for this connector".into(),
            });
            return;
        }
        let (local, remote) = (uniform(&spec.local), uniform(&spec.remote));
        let device = match (local, remote) {
            (Some(Device::Host), Some(Device::Host)) => false,
            (Some(l), Some(r)) => {
                let (src, dst) = if spec.write { (l, r) } else { (r, l) };
                if let Some(refusal) = device_path_refusal(src, dst) {
                    out.push(Event::Declined {
                        spec,
                        reason: refusal.into(),
                    });
                    return;
                }
                true
            }
            _ => {
                out.push(Event::Declined {
                    spec,
                    reason: "the descriptors mix kinds of memory".into(),
                });
                return;
            }
        };
        let i = match self.connect(&spec.peer, &spec.key) {
            Ok(i) => i,
            Err(reason) => {
                out.push(Event::Declined { spec, reason });
                return;
            }
        };
        let c = self.conns.get_mut(&i).expect("connected");
        let Some(slot) = c.free_slots.pop() else {
            out.push(Event::Declined {
                spec,
                reason: "too many operations in flight to this peer on the same-host path".into(),
            });
            return;
        };
        c.gens[slot as usize] += 1;
        let gen = c.gens[slot as usize];
        if let Some(t) = &c.slots {
            t.arm(slot, gen);
        }
        spec.state.set_path(TransferPath::Local);
        let id = spec.id;
        let ready = c.ready;
        if !ready {
            c.queued.push(id);
        }
        self.acts.insert(
            id,
            Act {
                spec,
                conn: i,
                slot,
                gen,
                phase: Phase::Queued,
                cancel: Arc::new(AtomicBool::new(false)),
                pidfd: None,
                device,
                sources: Vec::new(),
            },
        );
        if ready {
            self.request(id, out);
        } else {
            self.flush(i);
        }
    }

    fn abandon(&mut self, id: OpId, _hard: bool, out: &mut Vec<Event>) {
        let Some(a) = self.acts.get_mut(&id) else { return };
        let table = self.conns.get(&a.conn).and_then(|c| c.slots.clone());
        match a.phase {
            Phase::Copying => {
                // Our own copy thread writes our memory: stop it; its end releases the memory.
                a.cancel.store(true, Ordering::Relaxed);
            }
            Phase::Abandoned => {}
            Phase::Queued | Phase::Exporting | Phase::Requested => {
                // Nothing of ours is being written: a write's source is only read by the peer, and
                // revoking its slot makes the peer discard what it read. Release at once.
                if let Some(t) = table {
                    t.revoke(a.slot, a.gen);
                }
                let was_queued = matches!(a.phase, Phase::Queued);
                a.phase = Phase::Abandoned;
                let conn = a.conn;
                if was_queued {
                    if let Some(c) = self.conns.get_mut(&conn) {
                        c.queued.retain(|q| *q != id);
                    }
                    let a = self.acts.remove(&id).expect("present");
                    self.free_slot(conn, a.slot, a.gen);
                }
                out.push(Event::ActiveEnded {
                    id,
                    result: Err(Error::Cancelled),
                });
            }
        }
    }

    fn progress(&mut self, ready: &[(u64, u32)], out: &mut Vec<Event>) -> bool {
        let mut event = self.reap(out);
        for &(token, ev) in ready {
            if token == LISTENER {
                self.accept();
                event = true;
                continue;
            }
            if token == ACCEPT_TIMER {
                self.resume_accepting();
                event = true;
                continue;
            }
            let i: ConnId = token;
            if !self.conns.contains_key(&i) {
                continue;
            }
            event = true;
            if ev & libc::EPOLLOUT as u32 != 0 {
                self.flush(i);
            }
            if ev & libc::EPOLLIN as u32 != 0 || hung_up(ev) {
                self.read(i);
            }
            while let Some(c) = self.conns.get_mut(&i) {
                match Msg::decode(&c.rbuf) {
                    Ok(Some((m, used))) => {
                        c.rbuf.drain(..used);
                        self.handle(i, m, out);
                    }
                    Ok(None) => break,
                    Err(e) => {
                        tracing::debug!(error = e, "malformed same-host frame; closing the connection");
                        c.dead = true;
                        break;
                    }
                }
            }
            self.flush(i);
            if self.conns.get(&i).is_some_and(|c| c.dead) {
                self.close(i, out);
            }
        }
        // Answers queued while handling other connections.
        let pending: Vec<ConnId> = self
            .conns
            .iter()
            .filter(|(_, c)| !c.wbuf.is_empty() && !c.writing)
            .map(|(i, _)| *i)
            .collect();
        for i in pending {
            self.flush(i);
        }
        event |= self.reap(out);
        event
    }

    fn polling(&self) -> Polling {
        Polling::EveryTurn
    }

    fn has_pending(&self) -> bool {
        self.has_finished()
    }

    fn stop(&mut self, within: Option<Duration>) -> bool {
        self.stop_copies(within)
    }

    fn add_stats(&self, stats: &mut EngineStats, completed: u64) {
        stats.local_transfers += completed;
        stats.local_refused_peers += self.refused_peers;
    }
}
