//! The NIXL transport: what pairs with Python Dynamo workers and with peers on other hosts.
//!
//! Two NIXL agents per connector, both owned by the engine thread:
//!
//! - the **exposer** registers passive operations' memory, publishes per-operation metadata (its
//!   connection information plus the sections of exactly that operation's registrations, so the
//!   metadata's size and cost stay flat as registrations grow and a peer loads each registration
//!   once), and receives the peers' completion notifications. Its name is the connector's name.
//! - the **initiator** posts this connector's reads and writes. It is created on first use, and
//!   destroyed and recreated when an operation's memory must be released while a peer does not
//!   answer: NIXL cannot cancel a posted transfer, and destroying the agent's UCX worker is the
//!   only thing that ends it for sure (see `../../../docs/SOUNDNESS.md`). Exposed memory and
//!   published metadata are unaffected, since they belong to the exposer.
//!
//! Peers' agent metadata is loaded into the initiator once per distinct string and merged by NIXL
//! (a peer's later registrations add sections); prepared descriptor lists are cached per range
//! list. A transfer that fails makes the initiator forget that peer.

pub(crate) mod ffi;
pub(crate) mod md;

use std::collections::{BTreeMap, HashMap};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use self::ffi::{NixlAgent, PostError, Prepared, Registration, Transfer};
use super::poller::Waker;
use super::transport::{ActiveSpec, Event, Exposure, OpId, PassiveSpec, Polling, Transport};
use super::{Cmd, EngineStats, Hold, Range, RegInner, RegToken, Side};
use crate::error::{Error, Result};
use crate::metadata::encode_agent_metadata;
use crate::operation::TransferPath;

/// Peers kept loaded in the initiator with no transfer using them.
pub(crate) const MAX_IDLE_PEERS: usize = 64;
/// Distinct metadata strings remembered as loaded.
const MAX_LOADED: usize = 4096;
/// Prepared descriptor lists kept per side before the cache is cleared.
const MAX_PREPARED: usize = 1024;
/// Per-operation metadata strings kept for reuse.
const MAX_MD_CACHE: usize = 4096;
/// How often an exposer with memory registered but no operation live is progressed.
pub(crate) const EXPOSED_POLL: Duration = Duration::from_millis(5);
/// A progress call longer than this did work in UCX (an idle one takes a few microseconds).
const ACTIVITY: Duration = Duration::from_micros(25);

/// Registrations of one agent, by address range.
struct Registry {
    side: Side,
    gen: u64,
    map: BTreeMap<(u8, u32, usize), RegEntry>,
    next_id: u64,
}

struct RegEntry {
    range: Range,
    id: u64,
    token: Weak<RegInner>,
    _reg: Registration,
}

fn key_of(r: &Range) -> (u8, u32, usize) {
    let (k, id) = match r.device {
        crate::Device::Host => (0, 0),
        crate::Device::Cuda(n) => (1, n),
        crate::Device::Xpu(n) => (2, n),
    };
    (k, id, r.addr)
}

impl Registry {
    fn new(side: Side, gen: u64) -> Self {
        Self {
            side,
            gen,
            map: BTreeMap::new(),
            next_id: 1,
        }
    }

    /// A live registration containing `r`, or a new one of exactly `r`.
    fn get(
        &mut self,
        agent: &NixlAgent,
        r: Range,
        tx: &Sender<Cmd>,
        waker: &Waker,
        stats: &mut EngineStats,
    ) -> Result<(RegToken, Range)> {
        let k = key_of(&r);
        let lo = (k.0, k.1, 0);
        // The registrations starting at or before r, nearest first: one of them contains r if any
        // does (registrations of one device never overlap partially in practice; 16 is plenty).
        for (_, e) in self.map.range(lo..=k).rev().take(16) {
            if e.range.addr + e.range.len >= r.addr + r.len {
                if let Some(t) = e.token.upgrade() {
                    return Ok((RegToken(t), e.range));
                }
            }
        }
        // A dead entry's deregistration may still be queued: replace it now (the queued command
        // then finds another id and does nothing).
        self.map.remove(&k);
        let reg = agent.register(r)?;
        let id = self.next_id;
        self.next_id += 1;
        let tok = Arc::new(RegInner {
            tx: tx.clone(),
            waker: waker.clone(),
            side: self.side,
            gen: self.gen,
            range: r,
            id,
        });
        self.map.insert(
            k,
            RegEntry {
                range: r,
                id,
                token: Arc::downgrade(&tok),
                _reg: reg,
            },
        );
        stats.registrations += 1;
        Ok((RegToken(tok), r))
    }

    fn deregister(&mut self, gen: u64, range: Range, id: u64) -> bool {
        let k = key_of(&range);
        if gen == self.gen && self.map.get(&k).is_some_and(|e| e.id == id) {
            self.map.remove(&k);
            return true;
        }
        false
    }
}

struct Exposer {
    agent: NixlAgent,
    regs: Registry,
    /// The connection part of this agent's metadata (`getLocalPartialMD` of no descriptors).
    conn_md: Vec<u8>,
    /// Encoded metadata by the exact registrations it describes.
    md_cache: HashMap<Vec<Range>, Arc<str>>,
    /// Live passive operations: their keys and registrations.
    live: HashMap<Arc<str>, Vec<RegToken>>,
}

struct Peer {
    refs: usize,
    last_used: Instant,
}

struct Inflight {
    id: OpId,
    peer: Arc<str>,
    transfer: Transfer,
    _tokens: Vec<RegToken>,
}

struct Initiator {
    agent: NixlAgent,
    regs: Registry,
    peers: HashMap<Arc<str>, Peer>,
    /// Metadata strings already loaded, and the peer each named.
    loaded: HashMap<Arc<str>, Arc<str>>,
    local_prep: HashMap<Vec<Range>, Prepared>,
    remote_prep: HashMap<(Arc<str>, Vec<Range>), Prepared>,
    inflight: Vec<Inflight>,
}

impl Drop for Initiator {
    fn drop(&mut self) {
        // Requests, then prepared lists, then registrations, then the agent: destroying the agent's
        // UCX worker ends every transfer still running, so nothing touches the memory afterwards.
        self.inflight.clear();
        self.local_prep.clear();
        self.remote_prep.clear();
        self.regs.map.clear();
    }
}

impl Initiator {
    fn forget_peer(&mut self, name: &str) {
        self.loaded.retain(|_, n| &**n != name);
        self.remote_prep.retain(|(n, _), _| &**n != name);
        if self.peers.remove(name).is_some() {
            self.agent.invalidate_remote(name);
        }
    }

    fn evict_idle(&mut self) {
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
    fn load(&mut self, spec: &ActiveSpec, stats: &mut EngineStats) -> Result<Arc<str>> {
        if let Some(n) = self.loaded.get(&spec.remote_md) {
            return Ok(n.clone());
        }
        let mut r = self.agent.load_remote(&spec.remote_raw);
        if r.is_err() && self.peers.contains_key(&spec.peer) {
            // A peer restarted under the same name, or its metadata changed in a way NIXL does not
            // merge: forget it entirely and load afresh (a failed load must never be retried
            // without invalidating first).
            self.forget_peer(&spec.peer.clone());
            r = self.agent.load_remote(&spec.remote_raw);
        }
        let name: Arc<str> = match r {
            Ok(n) => n.into(),
            Err(e) => {
                self.agent.invalidate_remote(&spec.peer);
                self.peers.remove(&spec.peer);
                return Err(Error::RemoteGone {
                    agent: spec.peer.to_string(),
                    reason: format!(
                        "NIXL could not connect to the agent its metadata names ({e}): the peer has \
                         exited, or the metadata belongs to another host's network"
                    ),
                });
            }
        };
        stats.remote_loads += 1;
        if self.loaded.len() >= MAX_LOADED {
            self.loaded.clear();
        }
        self.loaded.insert(spec.remote_md.clone(), name.clone());
        self.peers.entry(name.clone()).or_insert(Peer {
            refs: 0,
            last_used: Instant::now(),
        });
        self.evict_idle();
        Ok(name)
    }
}

/// The NIXL transport of one connector.
pub(crate) struct NixlTransport {
    name: String,
    params: Vec<(String, String)>,
    tx: Sender<Cmd>,
    waker: Waker,
    exposer: Exposer,
    initiator: Option<Initiator>,
    initiator_gen: u64,
    deregister_on_completion: bool,
    notif_buf: Vec<(String, Vec<u8>)>,
    pub(crate) stats: EngineStats,
    /// Memory that was exposed and has been given up, held until the exposer is destroyed.
    /// Declared after the agents: fields drop in order, so the UCX workers that could reach it
    /// are gone before it is freed.
    quarantine: Vec<Hold>,
}

impl NixlTransport {
    /// Creates the exposer agent named `name`.
    pub(crate) fn new(
        name: &str,
        params: Vec<(String, String)>,
        deregister_on_completion: bool,
        tx: Sender<Cmd>,
        waker: Waker,
    ) -> Result<Self> {
        let agent = NixlAgent::new(name, &params)?;
        let conn_md = agent.partial_metadata(&[])?;
        md::parse(&conn_md)?;
        Ok(Self {
            name: name.to_string(),
            params,
            tx,
            waker,
            exposer: Exposer {
                agent,
                regs: Registry::new(Side::Exposer, 0),
                conn_md,
                md_cache: HashMap::new(),
                live: HashMap::new(),
            },
            initiator: None,
            initiator_gen: 0,
            deregister_on_completion,
            notif_buf: Vec::new(),
            quarantine: Vec::new(),
            stats: EngineStats::default(),
        })
    }

    /// Handles a registration token's drop.
    pub(crate) fn deregister(&mut self, side: Side, gen: u64, range: Range, id: u64) {
        match side {
            Side::Exposer => {
                if self.exposer.regs.deregister(gen, range, id) {
                    self.exposer.md_cache.retain(|k, _| !k.contains(&range));
                }
            }
            Side::Initiator => {
                if let Some(i) = &mut self.initiator {
                    if i.regs.deregister(gen, range, id) {
                        i.local_prep.retain(|k, _| {
                            !k.iter()
                                .any(|r| r.addr < range.addr + range.len && range.addr < r.addr + r.len)
                        });
                    }
                }
            }
        }
    }

    /// Holds exposed memory that was given up until no peer can reach it through the exposer.
    pub(crate) fn hold(&mut self, keep: Hold, bytes: usize) {
        self.stats.quarantined_bytes += bytes as u64;
        self.quarantine.push(keep);
    }

    pub(crate) fn live_registrations(&self) -> usize {
        self.exposer.regs.map.len() + self.initiator.as_ref().map_or(0, |i| i.regs.map.len())
    }

    fn initiator(&mut self) -> Result<&mut Initiator> {
        if self.initiator.is_none() {
            self.initiator_gen += 1;
            let name = format!("{}.i{}", self.name, self.initiator_gen);
            let agent = NixlAgent::new(&name, &self.params)?;
            self.initiator = Some(Initiator {
                agent,
                regs: Registry::new(Side::Initiator, self.initiator_gen),
                peers: HashMap::new(),
                loaded: HashMap::new(),
                local_prep: HashMap::new(),
                remote_prep: HashMap::new(),
                inflight: Vec::new(),
            });
        }
        Ok(self.initiator.as_mut().expect("just made"))
    }

    /// Metadata for the registrations `regs` (sorted, deduplicated): cached, or made now.
    fn metadata_for(&mut self, regs: Vec<Range>) -> Result<Arc<str>> {
        if let Some(md) = self.exposer.md_cache.get(&regs) {
            return Ok(md.clone());
        }
        let sections = self.exposer.agent.partial_metadata(&regs)?;
        let raw = md::splice(&self.exposer.conn_md, &sections)?;
        let md: Arc<str> = encode_agent_metadata(&raw).into();
        if self.exposer.md_cache.len() >= MAX_MD_CACHE {
            self.exposer.md_cache.clear();
        }
        self.exposer.md_cache.insert(regs, md.clone());
        Ok(md)
    }

    fn start(&mut self, spec: &ActiveSpec) -> Result<(Option<Inflight>, Vec<RegToken>)> {
        let (tx, waker) = (self.tx.clone(), self.waker.clone());
        let stats = &mut self.stats;
        let init = match self.initiator.as_mut() {
            Some(i) => i,
            None => return Err(Error::EngineStopped),
        };
        let mut tokens = Vec::with_capacity(spec.local.len());
        for r in &spec.local {
            tokens.push(init.regs.get(&init.agent, *r, &tx, &waker, stats)?.0);
        }
        let name = init.load(spec, stats)?;
        if init.local_prep.len() > MAX_PREPARED {
            init.local_prep.clear();
        }
        if init.remote_prep.len() > MAX_PREPARED {
            init.remote_prep.clear();
        }
        if !init.local_prep.contains_key(&spec.local) {
            let p = init.agent.prepare(None, &spec.local)?;
            init.local_prep.insert(spec.local.clone(), p);
        }
        let rkey = (name.clone(), spec.remote.clone());
        if !init.remote_prep.contains_key(&rkey) {
            let p = init.agent.prepare(Some(&name), &rkey.1)?;
            init.remote_prep.insert(rkey.clone(), p);
        }
        let (lp, rp) = (&init.local_prep[&spec.local], &init.remote_prep[&rkey]);
        let posted = init.agent.post_prepared(spec.write, lp, rp, spec.key.as_bytes());
        if !matches!(posted, Err(PostError::Local(_))) {
            stats.transfers += 1;
        }
        match posted {
            Ok(None) => Ok((None, tokens)),
            Ok(Some(t)) => {
                if let Some(p) = init.peers.get_mut(&name) {
                    p.refs += 1;
                    p.last_used = Instant::now();
                }
                Ok((
                    Some(Inflight {
                        id: spec.id,
                        peer: name,
                        transfer: t,
                        _tokens: tokens.clone(),
                    }),
                    tokens,
                ))
            }
            Err(PostError::Local(e)) => Err(e),
            Err(PostError::Transfer(e)) => {
                init.forget_peer(&name);
                Err(transfer_failed(&name, &e))
            }
        }
    }

    /// Destroys the initiator: every transfer it posted ends now (`id` as cancelled, the others
    /// as interrupted).
    fn reset_initiator(&mut self, id: OpId, out: &mut Vec<Event>) {
        let Some(init) = self.initiator.take() else { return };
        tracing::warn!(
            agent = %init.agent.name(),
            in_flight = init.inflight.len(),
            "destroying the NIXL initiator agent to end transfers to an unresponsive peer"
        );
        let ended: Vec<(OpId, Arc<str>)> = init.inflight.iter().map(|f| (f.id, f.peer.clone())).collect();
        drop(init); // releases requests, lists and registrations, then destroys the UCX worker
        self.stats.resets += 1;
        for (op, peer) in ended {
            let result = if op == id {
                Err(Error::Cancelled)
            } else {
                Err(Error::Interrupted {
                    agent: peer.to_string(),
                    reason: "the connector reset its NIXL initiator to cut off an unresponsive peer; \
                             start the operation again"
                        .into(),
                })
            };
            out.push(Event::ActiveEnded { id: op, result });
        }
    }
}

fn transfer_failed(peer: &str, e: &str) -> Error {
    Error::RemoteGone {
        agent: peer.to_string(),
        reason: format!(
            "the transfer failed in UCX ({e}): the peer's process exited or its connection broke"
        ),
    }
}

impl Transport for NixlTransport {
    fn path(&self) -> TransferPath {
        TransferPath::Nixl
    }

    fn expose(&mut self, spec: &PassiveSpec, out: &mut Exposure) -> Result<()> {
        let mut regs = Vec::with_capacity(spec.ranges.len());
        let mut tokens = Vec::with_capacity(spec.ranges.len());
        for r in &spec.ranges {
            let (t, reg) =
                self.exposer
                    .regs
                    .get(&self.exposer.agent, *r, &self.tx, &self.waker, &mut self.stats)?;
            tokens.push(t);
            regs.push(reg);
        }
        regs.sort_by_key(key_of);
        regs.dedup();
        let md = self.metadata_for(regs)?;
        self.exposer.live.insert(spec.key.clone(), tokens.clone());
        out.tokens.extend(tokens);
        out.nixl_metadata = Some(md);
        Ok(())
    }

    fn unexpose(&mut self, key: &str) {
        if let Some(tokens) = self.exposer.live.remove(key) {
            if self.deregister_on_completion {
                // Deregister now, whoever else holds the tokens (the memory's cache included).
                for t in &tokens {
                    self.deregister(Side::Exposer, t.0.gen, t.0.range, t.0.id);
                }
            }
        }
    }

    fn begin(&mut self, spec: ActiveSpec, out: &mut Vec<Event>) {
        spec.state.set_path(TransferPath::Nixl);
        if let Err(e) = self.initiator() {
            out.push(Event::ActiveEnded {
                id: spec.id,
                result: Err(e),
            });
            return;
        }
        let r = contain("start transfer", || self.start(&spec));
        if let Ok((_, tokens)) = &r {
            out.push(Event::Registered {
                id: spec.id,
                tokens: tokens.clone(),
            });
        }
        match r {
            Ok((None, _)) => out.push(Event::ActiveEnded {
                id: spec.id,
                result: Ok(()),
            }),
            Ok((Some(f), _)) => self.initiator.as_mut().expect("made above").inflight.push(f),
            Err(e) => out.push(Event::ActiveEnded {
                id: spec.id,
                result: Err(e),
            }),
        }
    }

    fn abandon(&mut self, id: OpId, hard: bool, out: &mut Vec<Event>) {
        let in_flight = self
            .initiator
            .as_ref()
            .is_some_and(|i| i.inflight.iter().any(|f| f.id == id));
        if in_flight && hard {
            self.reset_initiator(id, out);
        }
    }

    fn progress(&mut self, _ready: &[(u64, u32)], out: &mut Vec<Event>) -> bool {
        // NIXL does not say whether UCX did any work in a progress call (serving a peer's read
        // over TCP, receiving fragments of a transfer): a call that took long did, and counts as
        // an event, so the engine keeps spinning while data flows instead of backing off.
        let t0 = Instant::now();
        let mut event = false;
        if let Some(init) = &mut self.initiator {
            let mut i = 0;
            while i < init.inflight.len() {
                match init.agent.poll(&init.inflight[i].transfer) {
                    Ok(false) => i += 1,
                    done => {
                        let f = init.inflight.swap_remove(i);
                        let (id, peer) = (f.id, f.peer.clone());
                        drop(f); // releases the request
                        if let Some(p) = init.peers.get_mut(&peer) {
                            p.refs = p.refs.saturating_sub(1);
                        }
                        let result = match done {
                            Ok(_) => Ok(()),
                            Err(e) => {
                                init.forget_peer(&peer);
                                Err(transfer_failed(&peer, &e))
                            }
                        };
                        out.push(Event::ActiveEnded { id, result });
                        event = true;
                    }
                }
            }
        }
        if self.polling() != Polling::Never {
            let mut buf = std::mem::take(&mut self.notif_buf);
            if let Err(e) = self.exposer.agent.notifications(&mut buf) {
                tracing::warn!(error = %e, "draining NIXL notifications failed");
            }
            for (from, msg) in buf.drain(..) {
                event = true;
                let key = String::from_utf8_lossy(&msg);
                match self.exposer.live.get_key_value(&*key) {
                    Some((k, _)) => out.push(Event::PassiveCompleted { key: k.clone() }),
                    None => {
                        tracing::debug!(from = %from, key = %key, "notification for no live operation")
                    }
                }
            }
            self.notif_buf = buf;
        }
        event || t0.elapsed() > ACTIVITY
    }

    fn polling(&self) -> Polling {
        if self.initiator.as_ref().is_some_and(|i| !i.inflight.is_empty()) {
            Polling::Busy
        } else if !self.exposer.live.is_empty() {
            // Passive operations wait for their notification.
            Polling::Watching
        } else if !self.exposer.regs.map.is_empty() || !self.quarantine.is_empty() {
            // Peers may need this side to act for memory they can still reach (to serve a read
            // over TCP, even of memory given up): keep progressing, slowly when idle.
            Polling::Every(EXPOSED_POLL)
        } else {
            Polling::Never
        }
    }
}

/// Runs `f`, turning a panic inside it (nixl-sys unwraps, for example on a remote agent name that
/// is not UTF-8) into an error for the one caller instead of a dead engine.
fn contain<T>(op: &'static str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|p| {
        let msg = p
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        Err(Error::Nixl {
            op,
            status: format!("panicked inside the NIXL bindings: {msg}"),
        })
    })
}
