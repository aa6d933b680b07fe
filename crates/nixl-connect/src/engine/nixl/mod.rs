//! The NIXL transport: what pairs with Python Dynamo workers and with peers on other hosts.
//!
//! Two NIXL agents per connector, both owned by the engine thread:
//!
//! - the **exposer** registers passive operations' memory, publishes per-operation metadata (its
//!   connection information plus that operation's registrations only, so its size stays flat),
//!   and receives the peers' completion notifications. Its name is the connector's name.
//! - the **initiator** posts this connector's reads and writes. It is created on first use, and
//!   recreated when an operation's memory must be released while a peer does not answer: NIXL
//!   cannot cancel a posted transfer, and destroying the UCX worker is the only thing that ends it
//!   for sure (see `../../../docs/SOUNDNESS.md`). The exposer's memory and metadata are unaffected.

pub(crate) mod encoding;
pub(crate) mod ffi;
mod initiator;
pub(crate) mod md;
mod registry;

use std::any::Any;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use self::encoding::encode as encode_agent_metadata;
use self::ffi::{AgentKey, NixlAgent};
use self::initiator::{Initiator, StartError};
use self::registry::{key_of, Mail, RegInner, Registry, Side};
use super::cmd::Mailbox;
use super::transport::{ActiveSpec, CallerPart, Event, Exposure, OpId, PassiveSpec, Polling, Transport};
use crate::engine::transport::small_host;
use crate::error::{Error, Result};
use crate::metadata::OperationKind;
use crate::pace::PACE;
use crate::reg::{Hold, Range, RegToken};
use crate::state::TransferPath;
use crate::stats::EngineStats;

/// Peers kept loaded in the initiator with no transfer using them.
pub(crate) const MAX_IDLE_PEERS: usize = 64;
/// How many replaced (retired) NIXL agents a connector keeps alive for their passive operations
/// still waiting for a peer. Past it, the oldest is destroyed: the memory it held back is
/// released and its waiting operations fail with [`Error::Interrupted`]. Held memory is thus
/// bounded by about `MAX_RETIRED_EXPOSERS + 1` times the quarantine limit
/// ([`ConnectorBuilder::quarantine_limit`](crate::ConnectorBuilder::quarantine_limit)).
pub const MAX_RETIRED_EXPOSERS: usize = 3;

/// Distinct metadata strings remembered as loaded.
const MAX_LOADED: usize = 4096;
/// Bytes of peers' agent metadata loaded into the initiator (and kept by NIXL) before every idle
/// peer is forgotten: what peers send cannot pin more than about this much here.
const MAX_LOADED_BYTES: usize = 64 << 20;
/// Prepared descriptor lists kept per side before the cache is cleared.
pub(super) const MAX_PREPARED: usize = 1024;
/// Per-operation metadata strings kept for reuse.
const MAX_MD_CACHE: usize = 4096;
/// Registration tokens that memory given up after NIXL exposed it keeps, per exposing agent: the
/// quarantine's most recent entries keep theirs, up to this many in all, so memory exposed again
/// soon finds its registration; older entries drop their tokens and their memory stays held until
/// the agent is gone (NIXL's registrations cost more the more there are).
pub const REGISTERED_QUARANTINE: usize = 4096;

/// The least time between two warnings of one kind of repeated failure ([`Throttle`]).
const WARN_GAP: Duration = Duration::from_secs(1);

/// Counts a repeated failure and says when to warn of it: the first time, then at most once per
/// [`WARN_GAP`], with the count so far.
#[derive(Default)]
struct Throttle {
    count: u64,
    warned: Option<Instant>,
}

impl Throttle {
    /// One more failure at `now`: the count so far if a warning is due.
    fn note(&mut self, now: Instant) -> Option<u64> {
        self.count += 1;
        let due = self
            .warned
            .is_none_or(|t| now.saturating_duration_since(t) >= WARN_GAP);
        due.then(|| {
            self.warned = Some(now);
            self.count
        })
    }
}

/// The CPU time this thread has used so far (zero if the clock cannot be read).
fn thread_cpu_time() -> Duration {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_THREAD_CPUTIME_ID)
        .map(Duration::from)
        .unwrap_or_default()
}

struct Exposer {
    agent: NixlAgent,
    regs: Registry,
    /// The connection part of this agent's metadata (`getLocalPartialMD` of no descriptors).
    conn_md: Vec<u8>,
    /// Encoded metadata by the exact registrations it describes (their ids, unique in this
    /// agent's registry: a range registered again gets a new id, so no entry is ever stale).
    md_cache: HashMap<Vec<u64>, Arc<str>>,
    /// Live passive operations: their keys and registrations.
    live: HashMap<Arc<str>, Vec<Arc<RegInner>>>,
    /// How many of the live operations expose more than a small operation's bytes
    /// ([`Pace::small`](crate::pace::Pace::small)): a caller's turn does not watch them.
    large: usize,
    /// The keys of the live operations that are writables: peers may be moving bytes into this
    /// process.
    writables: HashSet<Arc<str>>,
    /// Memory this agent exposed that has been given up, held until the agent is destroyed.
    /// Declared last: fields drop in order, so the agent (its UCX worker, which could still
    /// reach the memory) is gone before the memory is freed.
    quarantine: Vec<Hold>,
    quarantined: usize,
    /// The quarantine's entries before this one have released their registrations.
    deregistered: usize,
    /// Registration tokens the entries from `deregistered` on keep.
    registered_held: usize,
    /// The fingerprint of `conn_md`.
    identity: u64,
}

impl Exposer {
    fn new(
        key: &AgentKey,
        name: &str,
        backends: &[String],
        params: &[(String, String)],
        gen: u64,
    ) -> Result<Self> {
        let agent = NixlAgent::new(key, name, backends, params)?;
        let conn_md = agent.partial_metadata(key, &[])?;
        let identity = md::identity(&conn_md).ok_or_else(|| Error::Nixl {
            op: "get local metadata",
            status: "NIXL's own metadata did not parse".into(),
            source: None,
        })?;
        Ok(Self {
            identity,
            agent,
            regs: Registry::new(Side::Exposer, gen),
            conn_md,
            md_cache: HashMap::new(),
            live: HashMap::new(),
            large: 0,
            writables: HashSet::new(),
            quarantine: Vec::new(),
            quarantined: 0,
            deregistered: 0,
            registered_held: 0,
        })
    }
}

/// The NIXL transport of one connector: its [`AgentKey`] and its state, which a waiter's thread
/// reaches as the transport's [`CallerPart`] without the key.
pub(crate) struct NixlTransport {
    key: AgentKey,
    nixl: NixlState,
}

/// The NIXL transport's agents, registrations and operations.
struct NixlState {
    name: String,
    /// The NIXL backends each agent is created with (UCX first by default).
    backends: Vec<String>,
    /// UCX's extra parameters.
    params: Vec<(String, String)>,
    mailbox: Mailbox<Mail>,
    /// The current exposer (new operations) and retired ones (destroyed once their last
    /// operation has ended), by generation.
    exposer: Exposer,
    exposer_gen: u64,
    retired: BTreeMap<u64, Exposer>,
    quarantine_limit: usize,
    initiator: Option<Initiator>,
    initiator_gen: u64,
    deregister_on_completion: bool,
    notif_buf: Vec<(String, Vec<u8>)>,
    /// Keys of passive operations whose retired exposer was destroyed past the cap, to be
    /// failed on the next progress.
    evicted: Vec<Arc<str>>,
    /// The last progress call was slow with nothing to show for it: progress again at once, and
    /// count it as work if that one is slow too.
    recheck: bool,
    /// The last progress call's drain used CPU time (see [`Pace::work`](crate::pace::Pace::work))
    /// while a peer may have been writing into this process.
    slow_receiving: bool,
    /// Operations whose post failed in the transport on a caller's turn: part of each may have
    /// been posted, so the engine thread resets the initiator (see `begin`) and fails them; their
    /// registrations' tokens are kept until then (a transfer may still be using them).
    failed_posts: Vec<(OpId, Error, Vec<RegToken>)>,
    /// When a peer's notification last completed one of this connector's passive operations.
    peer_notified: Option<Instant>,
    /// Failed drains of the exposers' notifications, warned of at most once per [`WARN_GAP`]
    /// (a caller's watch may drain on every turn).
    drain_failures: Throttle,
    stats: EngineStats,
}

/// The UCX settings every agent gets unless the caller set them: `TCP_CONN_NB=y` (per agent, through
/// the UCX plugin's `engine_config`), so connecting to a blackholed peer address never blocks the
/// engine thread in `connect()`. `UCX_TCP_CONN_NB` in the environment still wins (UCX reads it first).
fn with_library_defaults(mut params: Vec<(String, String)>) -> Vec<(String, String)> {
    const CONN_NB: &str = "TCP_CONN_NB=y";
    match params.iter_mut().find(|(k, _)| k == "engine_config") {
        Some((_, v)) if v.contains("TCP_CONN_NB") => {}
        Some((_, v)) if v.is_empty() => *v = CONN_NB.into(),
        Some((_, v)) => *v = format!("{v},{CONN_NB}"),
        None => params.push(("engine_config".into(), CONN_NB.into())),
    }
    params
}

impl NixlTransport {
    /// Creates the exposer agent named `name`.
    pub(crate) fn new(
        name: &str,
        backends: Vec<String>,
        params: Vec<(String, String)>,
        deregister_on_completion: bool,
        quarantine_limit: usize,
        mailbox: Mailbox<Mail>,
    ) -> Result<Self> {
        let key = AgentKey::new();
        let params = with_library_defaults(params);
        let exposer = Exposer::new(&key, name, &backends, &params, 0)?;
        let nixl = NixlState {
            name: name.to_string(),
            backends,
            params,
            mailbox,
            exposer,
            exposer_gen: 0,
            retired: BTreeMap::new(),
            quarantine_limit,
            initiator: None,
            initiator_gen: 0,
            deregister_on_completion,
            notif_buf: Vec::new(),
            evicted: Vec::new(),
            recheck: false,
            slow_receiving: false,
            failed_posts: Vec::new(),
            peer_notified: None,
            drain_failures: Throttle::default(),
            stats: EngineStats::default(),
        };
        Ok(Self { key, nixl })
    }
}

impl NixlState {
    /// The exposer of generation `gen`, if it still exists.
    fn exposer_of(&mut self, gen: u64) -> Option<&mut Exposer> {
        if gen == self.exposer_gen {
            Some(&mut self.exposer)
        } else {
            self.retired.get_mut(&gen)
        }
    }

    /// Replaces the exposer with a new agent once the memory it holds back passes the limit, and
    /// destroys retired exposers whose operations have all ended (which frees what they hold).
    fn rotate(&mut self, key: &AgentKey) {
        if self.exposer.quarantined > self.quarantine_limit {
            let gen = self.exposer_gen + 1;
            let name = format!("{}~{gen}", self.name);
            match Exposer::new(key, &name, &self.backends, &self.params, gen) {
                Ok(fresh) => {
                    let old = std::mem::replace(&mut self.exposer, fresh);
                    self.retired.insert(self.exposer_gen, old);
                    self.exposer_gen = gen;
                    self.stats.rotations += 1;
                    tracing::debug!(gen, "rotated the NIXL exposer to release quarantined memory");
                }
                Err(e) => tracing::warn!(error = %e.report(), "could not rotate the NIXL exposer"),
            }
        }
        let before = self.retired.len();
        self.retired.retain(|_, e| !e.live.is_empty());
        // Past the cap, the oldest retired exposer goes even though operations wait on it: held
        // memory stays bounded whatever peers do with the metadata they were given.
        while self.retired.len() > MAX_RETIRED_EXPOSERS {
            let Some((gen, old)) = self.retired.pop_first() else {
                break;
            };
            tracing::debug!(
                gen,
                waiting = old.live.len(),
                "destroyed a retired NIXL exposer past the cap; its waiting operations fail"
            );
            self.evicted.extend(old.live.keys().cloned());
            // Fields drop in order: the agent, then the memory it held back.
            drop(old);
        }
        if self.retired.len() != before {
            self.recount();
        }
    }

    /// The current exposer, then the retired ones.
    fn exposers(&self) -> impl Iterator<Item = &Exposer> {
        std::iter::once(&self.exposer).chain(self.retired.values())
    }

    fn recount(&mut self) {
        self.stats.quarantined_bytes = self.exposers().map(|e| e.quarantined).sum::<usize>() as u64;
    }

    /// Handles a registration token's drop.
    fn deregister(&mut self, side: Side, gen: u64, range: Range, id: u64) {
        match side {
            Side::Exposer => {
                if let Some(e) = self.exposer_of(gen) {
                    if e.regs.deregister(gen, range, id) {
                        // Metadata of this registration alone can never be asked for again (ids
                        // are not reused); entries of several registrations age out with the
                        // cache's bound.
                        e.md_cache.remove(&[id][..]);
                    }
                }
            }
            Side::Initiator => {
                if let Some(i) = &mut self.initiator {
                    i.deregister(gen, range, id);
                }
            }
        }
    }

    /// Holds exposed memory that was given up (`bytes` of it) until no peer can reach it through
    /// the exposer of generation `gen`; freed at once if that exposer is already gone.
    fn quarantine(&mut self, key: &AgentKey, gen: u64, keep: Hold, bytes: usize) {
        match self.exposer_of(gen) {
            Some(e) => {
                e.registered_held += keep.registrations();
                e.quarantine.push(keep);
                e.quarantined += bytes;
                // The memory stays held until the agent is gone (a peer's late access still
                // reaches only it), but the oldest entries' registrations end: see
                // REGISTERED_QUARANTINE.
                while e.registered_held > REGISTERED_QUARANTINE && e.deregistered < e.quarantine.len() {
                    let oldest = &mut e.quarantine[e.deregistered];
                    e.registered_held -= oldest.registrations();
                    oldest.release_registrations();
                    e.deregistered += 1;
                }
            }
            None => drop(keep),
        }
        self.recount();
        self.rotate(key);
    }

    /// The generation of the exposer that serves `key`.
    fn exposer_gen_of(&self, key: &str) -> Option<u64> {
        if self.exposer.live.contains_key(key) {
            return Some(self.exposer_gen);
        }
        self.retired
            .iter()
            .find(|(_, e)| e.live.contains_key(key))
            .map(|(g, _)| *g)
    }

    /// Drains every exposer's notifications: a live operation's completes it. True if any came.
    fn drain_notifications(&mut self, out: &mut Vec<Event>) -> bool {
        let mut event = false;
        let mut buf = std::mem::take(&mut self.notif_buf);
        for e in std::iter::once(&self.exposer).chain(self.retired.values()) {
            if let Err(err) = e.agent.notifications(&mut buf) {
                if let Some(failures) = self.drain_failures.note(Instant::now()) {
                    tracing::warn!(
                        error = %err,
                        failures,
                        "draining NIXL notifications failed (warned at most once a second; \
                         `failures` counts every failure so far)"
                    );
                }
            }
            for (from, msg) in buf.drain(..) {
                event = true;
                let key = String::from_utf8_lossy(&msg);
                match e.live.get_key_value(&*key) {
                    Some((k, _)) => {
                        out.push(Event::PassiveCompleted {
                            key: k.clone(),
                            path: TransferPath::Nixl,
                        });
                        self.peer_notified = Some(Instant::now());
                    }
                    None => {
                        tracing::debug!(from = %from, key = %key, "notification for no live operation")
                    }
                }
            }
        }
        self.notif_buf = buf;
        event
    }

    /// Forgets an exposure (any exposer's): it no longer receives notifications, and its
    /// registrations' tokens are returned. Bookkeeping only (a caller's turn may do it).
    fn forget(&mut self, key: &str) -> Option<Vec<Arc<RegInner>>> {
        let gen = self.exposer_gen_of(key)?;
        self.exposer_of(gen).and_then(|e| {
            e.writables.remove(key);
            let regs = e.live.remove(key)?;
            e.large -= usize::from(large(&regs));
            Some(regs)
        })
    }

    /// Live registrations, and the bytes they cover.
    fn registered(&self) -> (usize, u64) {
        let mine = self.initiator.as_ref().map_or((0, 0), Initiator::registered);
        self.exposers()
            .fold(mine, |(n, b), e| (n + e.regs.len(), b + e.regs.bytes()))
    }

    fn initiator(&mut self, key: &AgentKey) -> Result<&mut Initiator> {
        if self.initiator.is_none() {
            self.initiator_gen += 1;
            let name = format!("{}.i{}", self.name, self.initiator_gen);
            let agent = NixlAgent::new(key, &name, &self.backends, &self.params)?;
            self.initiator = Some(Initiator::new(agent, self.initiator_gen));
        }
        Ok(self.initiator.as_mut().expect("just made"))
    }

    /// Registers `ranges` with the initiator ahead of the transfers that will use them (an
    /// active operation over memory inside a live registration reuses it). Nothing of the
    /// initiator's registrations is ever published to a peer.
    fn register_ahead(&mut self, key: &AgentKey, ranges: &[Range]) -> Result<Vec<RegToken>> {
        let mailbox = self.mailbox.clone();
        self.initiator(key)?;
        let stats = &mut self.stats;
        let init = self.initiator.as_mut().expect("made above");
        let mut tokens = Vec::with_capacity(ranges.len());
        for r in ranges {
            let got = contain("register memory", || init.register(key, *r, &mailbox, stats))?;
            tokens.push(RegToken::new(got.0));
        }
        Ok(tokens)
    }

    /// Metadata for the registrations `regs` (their ranges and ids, sorted, deduplicated): cached
    /// by their ids, or made now.
    fn metadata_for(&mut self, key: &AgentKey, regs: &[(Range, u64)]) -> Result<Arc<str>> {
        let ids: Vec<u64> = regs.iter().map(|&(_, id)| id).collect();
        if let Some(md) = self.exposer.md_cache.get(&ids) {
            return Ok(md.clone());
        }
        let ranges: Vec<Range> = regs.iter().map(|&(r, _)| r).collect();
        let sections = self.exposer.agent.partial_metadata(key, &ranges)?;
        let raw = md::splice(&self.exposer.conn_md, &sections)?;
        let md: Arc<str> = encode_agent_metadata(&raw).into();
        if self.exposer.md_cache.len() >= MAX_MD_CACHE {
            self.exposer.md_cache.clear();
        }
        self.exposer.md_cache.insert(ids, md.clone());
        Ok(md)
    }

    /// What an exposure leaves: the registrations' tokens (one per range, in order) in `out`
    /// and in the exposer's live operations, and the metadata to publish.
    fn record_exposure(
        &mut self,
        spec: &PassiveSpec,
        regs: Vec<Arc<RegInner>>,
        md: Arc<str>,
        out: &mut Exposure,
    ) {
        out.tokens.extend(regs.iter().map(|t| RegToken::new(t.clone())));
        self.exposer.large += usize::from(large(&regs));
        if let Some(old) = self.exposer.live.insert(spec.key.clone(), regs) {
            self.exposer.large -= usize::from(large(&old));
        }
        if spec.kind == OperationKind::Write {
            self.exposer.writables.insert(spec.key.clone());
        }
        out.published = Some(md);
        out.exposer_gen = self.exposer_gen;
        out.identity = self.exposer.identity;
    }

    /// The transport's progress (see [`Transport::progress`]): evicted exposures failed, what
    /// callers' turns left settled, transfers polled, notifications drained. True if anything
    /// happened, or two slow calls in a row did work.
    fn progress(&mut self, out: &mut Vec<Event>) -> bool {
        // NIXL does not say whether UCX did any work in a progress call (serving a peer's read
        // over TCP, receiving fragments of a transfer): two slow calls in a row did, and count as
        // an event, so the engine keeps spinning while data flows instead of backing off.
        let t0 = Instant::now();
        let mut event = false;
        for key in self.evicted.drain(..) {
            self.stats.evicted_operations += 1;
            out.push(Event::PassiveFailed {
                key,
                error: Error::Interrupted {
                    agent: self.name.clone(),
                    reason: format!(
                        "more than {MAX_RETIRED_EXPOSERS} replaced NIXL agents were waiting for \
                         their operations, so the oldest, which exposed this operation, was \
                         destroyed to release the memory it held back; expose the memory again \
                         (a larger `quarantine_limit` makes this rarer)"
                    ),
                },
            });
            event = true;
        }
        event |= self.settle_callers(out);
        if let Some(init) = &mut self.initiator {
            event |= init.poll_inflight(false, out);
        }
        self.slow_receiving = false;
        if self.polling() != Polling::Never {
            // Only a writable's bytes come in at the peer's pace, so only then does a short
            // schedule pay (a readable's owner sends faster over TCP when progressed less often),
            // and only then is this thread's CPU clock read (a system call).
            let receiving = self.exposers().any(|e| !e.writables.is_empty());
            let cpu0 = receiving.then(thread_cpu_time);
            event |= self.drain_notifications(out);
            // CPU time, not the wall clock: a drain preempted, or run cold after a sleep, is not
            // work, and taking it for work would keep an idle writable's engine waking often.
            self.slow_receiving = cpu0.is_some_and(|c| thread_cpu_time().saturating_sub(c) > PACE.work());
        }
        // One slow call alone is as often a thread preempted or woken cold as work: two in a row.
        let slow = t0.elapsed() > PACE.work();
        let busy = event || (slow && self.recheck);
        self.recheck = slow && !busy;
        busy
    }

    /// How soon it needs polling (see [`Transport::polling`]).
    fn polling(&self) -> Polling {
        if !self.evicted.is_empty()
            || !self.failed_posts.is_empty()
            || self.initiator.as_ref().is_some_and(Initiator::busy)
        {
            Polling::Busy
        } else if self.exposures_watched() && self.peer_notified.is_some_and(|t| t.elapsed() < PACE.hot_for())
        {
            // Small passive operations wait, and NIXL peers completed one within the hot spell (they
            // are likely to go on): every turn, as a peer spinning on NIXL would (over TCP this
            // side's progress also serves a peer's read).
            Polling::Busy
        } else if !self.exposer.live.is_empty() || !self.retired.is_empty() {
            // Passive operations wait for their notification.
            Polling::Watching
        } else if !self.exposer.regs.is_empty() || !self.exposer.quarantine.is_empty() {
            // Peers may need this side to act for memory they can still reach (to serve a read
            // over TCP, even of memory given up): keep progressing, slowly when idle.
            Polling::Every(PACE.exposed_poll())
        } else {
            Polling::Never
        }
    }

    /// True when operations are exposed and every live one is small: a caller's turn may watch
    /// the exposers (see its `CallerPart::watch`).
    fn exposures_watched(&self) -> bool {
        !(self.exposer.live.is_empty() && self.retired.is_empty()) && self.exposers().all(|e| e.large == 0)
    }

    /// The engine thread's part of what callers' turns left: the ends of transfers a watch saw
    /// end that need it, then, if a post failed, the initiator's reset and those operations'
    /// failures. True if anything ended.
    fn settle_callers(&mut self, out: &mut Vec<Event>) -> bool {
        let before = out.len();
        if let Some(init) = &mut self.initiator {
            init.settle(out);
        }
        if !self.failed_posts.is_empty() {
            let failed = std::mem::take(&mut self.failed_posts);
            self.reset_initiator(None, out);
            for (id, e, tokens) in failed {
                drop(tokens); // the transfer ended with the initiator
                out.push(Event::ActiveEnded { id, result: Err(e) });
            }
        }
        out.len() > before
    }

    /// Destroys the initiator: every transfer it posted ends now (`id` as cancelled, the others
    /// as interrupted).
    fn reset_initiator(&mut self, id: Option<OpId>, out: &mut Vec<Event>) {
        let Some(mut init) = self.initiator.take() else {
            return;
        };
        init.settle(out);
        let ended = init.in_flight();
        tracing::warn!(
            agent = %init.name(),
            in_flight = ended.len(),
            "destroying the NIXL initiator agent to end transfers to an unresponsive peer"
        );
        drop(init); // releases requests, lists and registrations, then destroys the UCX worker
        self.stats.resets += 1;
        for (op, peer) in ended {
            let result = if Some(op) == id {
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

pub(super) fn overlap(a: &Range, b: &Range) -> bool {
    a.device == b.device && a.addr < b.addr + b.len && b.addr < a.addr + a.len
}

/// True when an exposure's registrations cover more than a small operation's bytes in all
/// ([`Pace::small`](crate::pace::Pace::small)).
fn large(regs: &[Arc<RegInner>]) -> bool {
    !PACE.small(
        regs.iter()
            .map(|t| t.range.len)
            .fold(0usize, usize::saturating_add),
    )
}

/// The registrations' ranges and ids, sorted and deduplicated: what their metadata is made from
/// and cached by.
fn ranges_and_ids(regs: &[Arc<RegInner>]) -> Vec<(Range, u64)> {
    let mut v: Vec<(Range, u64)> = regs.iter().map(|t| (t.range, t.id)).collect();
    v.sort_by_key(|(r, id)| (key_of(r), *id));
    v.dedup();
    v
}

/// NIXL is the engine thread's (not [`any_thread`](Transport::any_thread)); a waiter's thread
/// reaches only its [`CallerPart`], the state without the [`AgentKey`].
impl Transport for NixlTransport {
    fn expose(&mut self, spec: &PassiveSpec, out: &mut Exposure) -> Result<()> {
        let (key, n) = (&self.key, &mut self.nixl);
        let mut regs = Vec::with_capacity(spec.ranges.len());
        let e = &mut n.exposer;
        for r in &spec.ranges {
            // A replaced dead registration needs no cache purge: metadata is cached by ids.
            regs.push(
                e.regs
                    .get(key, &e.agent, *r, &n.mailbox, &mut n.stats, &mut None)?
                    .0,
            );
        }
        let md = n.metadata_for(key, &ranges_and_ids(&regs))?;
        n.record_exposure(spec, regs, md, out);
        Ok(())
    }

    fn unexpose(&mut self, key: &str) {
        let n = &mut self.nixl;
        let removed = n.forget(key);
        n.rotate(&self.key);
        if let Some(tokens) = removed.filter(|_| n.deregister_on_completion) {
            // Deregister now, whoever else holds the tokens (the memory's cache included).
            for t in &tokens {
                n.deregister(Side::Exposer, t.gen, t.range, t.id);
            }
        }
    }

    fn begin(&mut self, spec: ActiveSpec, out: &mut Vec<Event>) {
        let n = &mut self.nixl;
        // A post that failed on a caller's turn resets the initiator before anything new uses it.
        n.settle_callers(out);
        out.push(Event::taken(spec.id, TransferPath::Nixl));
        if let Err(e) = n.initiator(&self.key) {
            out.push(Event::ended(spec.id, Err(e)));
            return;
        }
        // A panic inside the bindings fails this operation instead of the engine.
        let (key, mailbox, stats) = (&self.key, &n.mailbox, &mut n.stats);
        let init = n.initiator.as_mut().expect("made above");
        let r = contain("start transfer", || Ok(init.start(key, &spec, mailbox, stats)))
            .unwrap_or_else(|e| Err(StartError::Failed(e)));
        if let Ok((_, tokens)) = &r {
            out.push(Event::Registered {
                id: spec.id,
                tokens: tokens.clone(),
            });
        }
        let result = match r {
            Ok((Some(f), _)) => return n.initiator.as_mut().expect("made above").track(f),
            Ok((None, _)) => Ok(()),
            Err(StartError::Posted(e)) => {
                n.reset_initiator(None, out);
                Err(e)
            }
            Err(StartError::Failed(e)) => Err(e),
        };
        out.push(Event::ended(spec.id, result));
    }

    fn abandon(&mut self, id: OpId, hard: bool, out: &mut Vec<Event>) {
        let n = &mut self.nixl;
        let in_flight = n.initiator.as_ref().is_some_and(|i| i.carries(id));
        if in_flight && hard {
            n.reset_initiator(Some(id), out);
        }
    }

    fn progress(&mut self, _ready: &[(u64, u32)], out: &mut Vec<Event>) -> bool {
        self.nixl.progress(out)
    }

    fn did_work(&self) -> bool {
        self.nixl.slow_receiving
    }

    fn has_pending(&self) -> bool {
        let n = &self.nixl;
        n.recheck
            || !n.evicted.is_empty()
            || !n.failed_posts.is_empty()
            || n.initiator.as_ref().is_some_and(Initiator::has_ended)
    }

    fn on_mail(&mut self, msg: Box<dyn Any + Send>) {
        match msg.downcast::<Mail>().map(|m| *m) {
            Ok(Mail::Deregister { side, gen, range, id }) => self.nixl.deregister(side, gen, range, id),
            Ok(Mail::Quarantine { gen, memory, bytes }) => {
                self.nixl.quarantine(&self.key, gen, memory, bytes)
            }
            Err(other) => drop(other),
        }
    }

    fn hold(&mut self, gen: u64, keep: Hold, bytes: usize) -> Option<Hold> {
        self.nixl.quarantine(&self.key, gen, keep, bytes);
        None
    }

    fn preregister(&mut self, ranges: &[Range]) -> Result<Vec<RegToken>> {
        self.nixl.register_ahead(&self.key, ranges)
    }

    fn path(&self) -> TransferPath {
        TransferPath::Nixl
    }

    fn add_stats(&self, stats: &mut EngineStats, _completed: u64) {
        let n = &self.nixl;
        let s = &n.stats;
        stats.registrations += s.registrations;
        let (live, bytes) = n.registered();
        stats.live_registrations += live;
        stats.registered_bytes += bytes;
        stats.registration_hits += s.registration_hits;
        stats.peers_loaded += n.initiator.as_ref().map_or(0, Initiator::peers_loaded);
        stats.remote_loads += s.remote_loads;
        stats.transfers += s.transfers;
        stats.resets += s.resets;
        stats.rotations += s.rotations;
        stats.quarantined_bytes += s.quarantined_bytes;
        stats.evicted_operations += s.evicted_operations;
    }

    fn polling(&self) -> Polling {
        self.nixl.polling()
    }

    fn caller(&mut self) -> Option<&mut dyn CallerPart> {
        Some(&mut self.nixl)
    }
}

/// What a waiter's thread may do with NIXL: no [`AgentKey`] here, so nothing is created,
/// registered, described, loaded or prepared.
impl CallerPart for NixlState {
    /// An exposure of memory that earlier exposures registered and made metadata for: lookups and
    /// bookkeeping, no call into NIXL. Otherwise `None`, nothing done.
    fn expose(&mut self, spec: &PassiveSpec, out: &mut Exposure) -> Option<Result<()>> {
        let regs = spec
            .ranges
            .iter()
            .map(|r| self.exposer.regs.exposed(r))
            .collect::<Option<Vec<_>>>()?;
        let ids: Vec<u64> = ranges_and_ids(&regs).iter().map(|&(_, id)| id).collect();
        let md = self.exposer.md_cache.get(&ids)?.clone();
        self.stats.registration_hits += regs.len() as u64;
        self.record_exposure(spec, regs, md, out);
        Some(Ok(()))
    }

    /// The exposure's registrations let go at once (memory reallocated at the same address is
    /// never published under the old one); the rest waits for [`unexpose`](Transport::unexpose).
    fn unexpose(&mut self, key: &str) {
        if !self.deregister_on_completion {
            // A last token's drop posts its deregistration to the engine thread.
            drop(self.forget(key));
        }
    }

    /// Posts a small transfer of host memory whose peer is loaded, memory registered and lists
    /// prepared; a failed post's reset is left to the engine thread (`settle_callers`).
    fn begin(&mut self, spec: ActiveSpec, out: &mut Vec<Event>) -> Option<ActiveSpec> {
        if !self.starts() || !self.failed_posts.is_empty() || !small_host(&spec.local) {
            return Some(spec);
        }
        let Some(init) = self.initiator.as_mut() else {
            return Some(spec);
        };
        match init.post_ready(&spec, &mut self.stats, out) {
            None => return Some(spec),
            Some(Ok(())) => {}
            Some(Err((e, tokens))) => self.failed_posts.push((spec.id, e, tokens)),
        }
        None
    }

    /// Polls the initiator's transfers and drains the exposers' notifications, each only while all
    /// are small (a large transfer would run on the caller's thread); UCX alone (see
    /// `ffi::Prepared`'s `Send`). Ends that must forget a peer go to `settle_callers`.
    fn watch(&mut self, out: &mut Vec<Event>) -> bool {
        if !self.starts() {
            return false;
        }
        let before = out.len();
        let mut ended = false;
        if let Some(init) = self.initiator.as_mut() {
            if init.only_small_in_flight() {
                ended = init.poll_inflight(true, out);
            }
        }
        if self.exposures_watched() {
            self.drain_notifications(out);
        }
        ended || out.len() > before
    }

    /// With UCX as the one backend (see [`watch`](CallerPart::watch)).
    fn starts(&self) -> bool {
        self.backends.iter().all(|b| b == "UCX")
    }

    /// With UCX alone, while everything in flight is small and nothing waits for the engine.
    fn sees_every_end(&self) -> bool {
        self.starts()
            && self.exposers().all(|e| e.large == 0)
            && self.failed_posts.is_empty()
            && self.evicted.is_empty()
            && self.initiator.as_ref().is_none_or(|i| i.nothing_large())
    }
}

/// Runs `f`, turning a panic inside it (nixl-sys unwraps, for example on a remote agent name that
/// is not UTF-8) into an error for the one caller instead of a dead engine.
pub(super) fn contain<T>(op: &'static str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|p| {
        let msg = p
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        Err(Error::Nixl {
            op,
            status: format!("panicked inside the NIXL bindings: {msg}"),
            source: None,
        })
    })
}

#[cfg(test)]
mod tests;
