//! The engine: one thread per connector owns the transports and every operation's bookkeeping.
//!
//! Callers send [`Cmd`]s over a channel and wake the thread through its [`poller`]. The thread
//! sleeps in `epoll` on the same-host transport's sockets and its wake-up `eventfd`; it polls NIXL
//! only when NIXL needs it ([`Polling`]): often while transfers are in flight, every
//! [`nixl::EXPOSED_POLL`] while memory is exposed (a peer may need this side to act, for example to
//! serve a read over TCP), never otherwise. After any event it keeps spinning for [`SPIN`] so that
//! back-to-back operations pay no wake-up; an idle connector costs no CPU.
//!
//! Ownership: from the moment a command leaves the caller, the memory a transport may touch is
//! owned by the engine's side of the operation. Registration tokens live in the transports'
//! records, owned memory of a dropped operation is adopted ([`Cmd::Adopt`]) and freed only once
//! its transfer has ended, and exposed memory the library would free is quarantined until no peer
//! can reach it (see `docs/SOUNDNESS.md`).

pub(crate) mod local;
pub(crate) mod nixl;
mod poller;
pub(crate) mod transport;

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use self::local::LocalTransport;
use self::nixl::NixlTransport;
use self::poller::{Poller, Waker};
use self::transport::{ActiveSpec, Event, Exposure, OpId, PassiveSpec, Polling, Transport};
use crate::buffer::Quarantined;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::metadata::decode_agent_metadata;
use crate::operation::{OpState, OperationStatus, PathPolicy, TransferPath};

/// How long a dropped connector waits for its same-host copies (they end within a chunk unless a
/// peer stalls its pages) before it leaks the memory they may still write.
pub(crate) const STOP_WAIT: Duration = Duration::from_secs(10);
/// How long the engine keeps spinning after the last event before it sleeps.
pub(crate) const SPIN: Duration = Duration::from_millis(2);
/// The first back-off while transfers are in flight.
pub(crate) const MIN_PARK: Duration = Duration::from_micros(20);
/// The longest back-off while transfers are in flight.
pub(crate) const MAX_PARK: Duration = Duration::from_millis(1);
/// How often a hot engine polls NIXL for notifications of operations it watches.
pub(crate) const WATCH_GAP: Duration = Duration::from_micros(25);
/// Decoded peer metadata kept by string: at most this many strings...
const MAX_DECODED: usize = 1024;
/// ...and at most this many bytes of them (strings and decoded blobs together), so that what
/// peers send cannot pin more than this much memory here.
const MAX_DECODED_BYTES: usize = 32 << 20;
/// Completed operations' keys remembered, to refuse replaying their metadata.
const MAX_COMPLETED: usize = 65_536;

/// One memory range as the transports see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Range {
    pub(crate) addr: usize,
    pub(crate) len: usize,
    pub(crate) device: Device,
}

/// Which NIXL agent a registration belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    /// The agent that exposes passive operations' memory.
    Exposer,
    /// The agent that posts this connector's transfers.
    Initiator,
}

/// Keeps one registration alive; the last clone's drop queues its deregistration.
#[derive(Clone)]
pub(crate) struct RegToken(pub(crate) Arc<RegInner>);

pub(crate) struct RegInner {
    pub(crate) tx: Sender<Cmd>,
    pub(crate) waker: Waker,
    pub(crate) side: Side,
    pub(crate) gen: u64,
    pub(crate) range: Range,
    pub(crate) id: u64,
}

impl RegToken {
    pub(crate) fn same(&self, other: &RegToken) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// True for a registration of exposed memory (peers may have been told about it).
    pub(crate) fn exposed(&self) -> bool {
        self.0.side == Side::Exposer
    }

    /// Hands a dropped HostBuffer's mapping to this registration's engine, which holds it (pages
    /// and addresses) until no peer can reach it through its exposer. Nothing
    /// happens if the engine is gone (then nothing can).
    pub(crate) fn quarantine(&self, mapping: Arc<Quarantined>) {
        if self
            .0
            .tx
            .send(Cmd::Quarantine {
                gen: self.0.gen,
                mapping,
            })
            .is_ok()
        {
            self.0.waker.wake();
        }
    }
}

impl Drop for RegInner {
    fn drop(&mut self) {
        if self
            .tx
            .send(Cmd::Deregister {
                side: self.side,
                gen: self.gen,
                range: self.range,
                id: self.id,
            })
            .is_ok()
        {
            self.waker.wake();
        }
    }
}

/// Memory (or anything) the engine keeps alive on an operation's behalf.
pub(crate) type Hold = Box<dyn Send>;

/// Commands to the engine thread.
pub(crate) enum Cmd {
    /// Expose a passive operation's memory under its key.
    Expose {
        spec: PassiveSpec,
        reply: oneshot::Sender<Result<Exposure>>,
    },
    /// A passive operation ended (completed, cancelled or dropped): no new access; `keep` is
    /// owned memory that was exposed, to hold until no peer can reach it.
    Unexpose {
        key: Arc<str>,
        /// The generation of the exposer that exposed it.
        gen: u64,
        keep: Option<(Hold, usize)>,
    },
    /// Start an active operation (its outcome, and the registrations to keep with its memory,
    /// arrive through its state).
    Begin {
        spec: ActiveSpec,
    },
    /// Stop an active operation's transfer as soon as possible; with `hard`, even at the cost of
    /// other operations (its owner cannot wait any longer).
    Abandon {
        id: OpId,
        hard: bool,
    },
    /// Hold `keep` (a dropped operation's memory) until its transfer has ended.
    Adopt {
        id: OpId,
        keep: Hold,
    },
    /// A registration token was dropped.
    Deregister {
        side: Side,
        gen: u64,
        range: Range,
        id: u64,
    },
    /// A dropped HostBuffer's mapping that the exposer of generation `gen` exposed: release its
    /// pages, hold the addresses until no peer can reach them.
    Quarantine {
        gen: u64,
        mapping: Arc<Quarantined>,
    },
    /// Register `ranges` with the agent that posts this connector's transfers, ahead of them.
    Register {
        ranges: Vec<Range>,
        reply: oneshot::Sender<Result<Vec<RegToken>>>,
    },
    /// Report the engine's counters.
    Stats {
        reply: oneshot::Sender<EngineStats>,
    },
    Shutdown,
}

/// A peer's metadata string, decoded: its agent metadata and agent name.
#[derive(Clone)]
pub(crate) struct Decoded {
    pub(crate) md: Arc<str>,
    pub(crate) raw: Arc<[u8]>,
    pub(crate) peer: Arc<str>,
    /// The fingerprint of the agent's connection part ([`nixl::md::identity`]).
    pub(crate) ident: u64,
}

/// Decoded metadata by string, bounded in count and bytes (cleared when either would pass).
#[derive(Default)]
struct DecodedCache {
    map: HashMap<Arc<str>, Decoded>,
    bytes: usize,
}

impl DecodedCache {
    fn insert(&mut self, d: &Decoded) {
        let size = d.md.len() + d.raw.len();
        if size > MAX_DECODED_BYTES / 4 {
            return; // too big to keep: decoded again if it comes back
        }
        if self.map.len() >= MAX_DECODED || self.bytes + size > MAX_DECODED_BYTES {
            self.map.clear();
            self.bytes = 0;
        }
        if self.map.insert(d.md.clone(), d.clone()).is_none() {
            self.bytes += size;
        }
    }
}

/// Counters for tests, `bench` and `doctor`.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct EngineStats {
    /// NIXL memory registrations made so far.
    pub registrations: u64,
    /// NIXL registrations currently live.
    pub live_registrations: usize,
    /// Peer agent metadata loads into NIXL made so far.
    pub remote_loads: u64,
    /// Transfers posted through NIXL so far.
    pub transfers: u64,
    /// Active operations that took the same-host path.
    pub local_transfers: u64,
    /// Same-host connections refused because the peer runs as another user.
    pub local_refused_peers: u64,
    /// Times the NIXL initiator was destroyed to cut off an unresponsive peer.
    pub resets: u64,
    /// Times the NIXL exposer was replaced to release quarantined memory.
    pub rotations: u64,
    /// Bytes of exposed memory held back from the allocator until no peer can reach it.
    pub quarantined_bytes: u64,
    /// Passive operations failed with [`Error::Interrupted`] because the retired NIXL agent that
    /// exposed them was destroyed to bound held memory (see
    /// [`MAX_RETIRED_EXPOSERS`](crate::MAX_RETIRED_EXPOSERS)).
    pub evicted_operations: u64,
}

static NEXT_ENGINE: AtomicU64 = AtomicU64::new(1);

/// Options the engine starts with.
#[derive(Debug, Clone)]
pub(crate) struct EngineOptions {
    pub(crate) ucx_params: Vec<(String, String)>,
    pub(crate) path: PathPolicy,
    pub(crate) cancel_grace: Duration,
    pub(crate) deregister_on_completion: bool,
    pub(crate) quarantine_limit: usize,
}

/// A handle to a connector's engine thread.
#[derive(Clone)]
pub(crate) struct Engine(Arc<Shared>);

struct Shared {
    tx: Sender<Cmd>,
    waker: Waker,
    join: Mutex<Option<JoinHandle<()>>>,
    thread: std::thread::ThreadId,
    name: String,
    next_op: AtomicU64,
    cancel_grace: Duration,
    decoded: Mutex<DecodedCache>,
}

impl Engine {
    /// Binds the same-host socket, creates the exposer agent and starts the engine thread.
    ///
    /// The agent's name is `base`, or `base-<pid>-<k>` when another connector in this network
    /// namespace already serves `base` (agent names must be unique for the same-host path).
    pub(crate) fn start(base: String, opts: EngineOptions) -> Result<Self> {
        // Fail fast (and without touching nixl-sys) when NIXL is absent.
        nixl::ffi::load()?;
        let (name, listener) = if opts.path == PathPolicy::Nixl {
            (base, None)
        } else {
            bind_unique(&base)?
        };
        let poller = Poller::new().map_err(|e| Error::Os(format!("creating the engine's poller: {e}")))?;
        let waker = poller.waker();
        let (tx, rx) = mpsc::channel();
        let (ready_tx, ready_rx) = mpsc::sync_channel(1);
        let (agent_name, self_tx, w2) = (name.clone(), tx.clone(), waker.clone());
        let o2 = opts.clone();
        let join = std::thread::Builder::new()
            .name(format!(
                "nixl-engine-{}",
                NEXT_ENGINE.fetch_add(1, Ordering::Relaxed)
            ))
            .spawn(move || {
                let nixl = match NixlTransport::new(
                    &agent_name,
                    o2.ucx_params.clone(),
                    o2.deregister_on_completion,
                    o2.quarantine_limit,
                    self_tx,
                    w2.clone(),
                ) {
                    Ok(n) => {
                        let _ = ready_tx.send(Ok(()));
                        n
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let local =
                    LocalTransport::new(o2.path != PathPolicy::Nixl, listener, poller.registrar(), w2);
                let engine = EngineLoop::new(nixl, local, rx, poller, o2.path);
                // A panic here would leave transfers, copies and peers' access to memory that the
                // unwinding would free: there is no sound way back, so the process stops instead.
                if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| engine.run())).is_err() {
                    eprintln!(
                        "nixl-connect: the engine thread panicked; aborting, since transfers may \
                         still be using memory that unwinding would free"
                    );
                    std::process::abort();
                }
            })
            .map_err(|e| Error::Os(format!("spawning the engine thread: {e}")))?;
        let thread = join.thread().id();
        ready_rx.recv().map_err(|_| Error::EngineStopped)??;
        Ok(Engine(Arc::new(Shared {
            tx,
            waker,
            join: Mutex::new(Some(join)),
            thread,
            name,
            next_op: AtomicU64::new(1),
            cancel_grace: opts.cancel_grace,
            decoded: Mutex::new(DecodedCache::default()),
        })))
    }

    pub(crate) fn name(&self) -> &str {
        &self.0.name
    }

    pub(crate) fn next_op(&self) -> OpId {
        self.0.next_op.fetch_add(1, Ordering::Relaxed)
    }

    /// How long a dropped operation with borrowed memory waits before its transport is cut off.
    pub(crate) fn cancel_grace(&self) -> Duration {
        self.0.cancel_grace
    }

    /// Decodes a peer's `nixl_metadata` (base64/hex, zlib, NIXL's serialisation) and reads its
    /// agent name; cached by string, so a peer's repeated metadata costs a lookup.
    ///
    /// # Errors
    /// [`Error::Metadata`] for anything that is not NIXL agent metadata.
    pub(crate) fn decode(&self, md: &str) -> Result<Decoded> {
        if let Some(d) = self
            .0
            .decoded
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .map
            .get(md)
        {
            return Ok(d.clone());
        }
        let raw = decode_agent_metadata(md)?;
        let peer: Arc<str> = nixl::md::parse(&raw)?.name.into();
        let d = Decoded {
            md: md.into(),
            ident: nixl::md::identity(&raw).unwrap_or(0),
            raw: raw.into(),
            peer,
        };
        self.0
            .decoded
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(&d);
        Ok(d)
    }

    pub(crate) fn send(&self, cmd: Cmd) -> Result<()> {
        self.0.tx.send(cmd).map_err(|_| Error::EngineStopped)?;
        self.0.waker.wake();
        Ok(())
    }

    /// Sends a command built around a reply channel and awaits the reply.
    ///
    /// # Cancel safety
    /// The command is sent before the first await; dropping the future only drops the reply.
    pub(crate) async fn call<T>(&self, f: impl FnOnce(oneshot::Sender<T>) -> Cmd) -> Result<T> {
        let (tx, rx) = oneshot::channel();
        self.send(f(tx))?;
        rx.await.map_err(|_| Error::EngineStopped)
    }

    pub(crate) async fn stats(&self) -> Result<EngineStats> {
        self.call(|reply| Cmd::Stats { reply }).await
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        let _ = self.tx.send(Cmd::Shutdown);
        self.waker.wake();
        if std::thread::current().id() != self.thread {
            if let Some(j) = self.join.lock().unwrap_or_else(|p| p.into_inner()).take() {
                let _ = j.join();
            }
        }
    }
}

/// Binds the same-host socket for `base`, or for `base-<pid>-<k>` if another connector has it.
fn bind_unique(base: &str) -> Result<(String, Option<std::os::fd::OwnedFd>)> {
    for k in 0..64 {
        let name = match k {
            0 => base.to_string(),
            k => format!("{base}-{}-{k}", std::process::id()),
        };
        match local::listen(&name) {
            Ok(Some(fd)) => return Ok((name, Some(fd))),
            Ok(None) => continue,
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for same-host peers; NIXL only");
                return Ok((base.to_string(), None));
            }
        }
    }
    Ok((base.to_string(), None))
}

/// Bookkeeping of one active operation in the engine.
struct Active {
    key: Arc<str>,
    state: Arc<OpState>,
    keep: Option<Hold>,
    /// The transport moving it (index into the chain), once started.
    on: usize,
}

struct EngineLoop {
    rx: Receiver<Cmd>,
    poller: Poller,
    local: LocalTransport,
    nixl: NixlTransport,
    policy: PathPolicy,
    actives: HashMap<OpId, Active>,
    passives: HashMap<Arc<str>, Arc<OpState>>,
    events: Vec<Event>,
    ready: Vec<(u64, u32)>,
    pending: Option<Cmd>,
    /// Keys of this connector's completed active operations (most recent [`MAX_COMPLETED`]).
    completed: HashSet<Arc<str>>,
    completed_order: VecDeque<Arc<str>>,
    /// Owned memory of ended exposures that a same-host copy may still be writing: handed to the
    /// NIXL transport's hold only once the operation's memory is released.
    copying: Vec<(Arc<OpState>, u64, Hold, usize)>,
}

impl EngineLoop {
    fn new(
        nixl: NixlTransport,
        local: LocalTransport,
        rx: Receiver<Cmd>,
        poller: Poller,
        policy: PathPolicy,
    ) -> Self {
        Self {
            rx,
            poller,
            local,
            nixl,
            policy,
            actives: HashMap::new(),
            passives: HashMap::new(),
            events: Vec::new(),
            ready: Vec::new(),
            pending: None,
            completed: HashSet::new(),
            completed_order: VecDeque::new(),
            copying: Vec::new(),
        }
    }

    /// The transports an active operation may take, in order of preference.
    fn chain(&self) -> &'static [usize] {
        match self.policy {
            PathPolicy::Auto => &[0, 1],
            PathPolicy::Nixl => &[1],
            PathPolicy::Local => &[0],
        }
    }

    fn transport(&mut self, i: usize) -> &mut dyn Transport {
        match i {
            0 => &mut self.local,
            _ => &mut self.nixl,
        }
    }

    fn run(mut self) {
        let mut last_event = Instant::now();
        let mut shutdown = false;
        // NIXL is progressed on its own schedule: from MIN_PARK apart just after a command or a
        // sign of activity, backing off to what `polling` allows (MAX_PARK while transfers are in
        // flight, EXPOSED_POLL while only memory is exposed).
        let mut nixl_gap = MIN_PARK;
        let mut nixl_next = Instant::now();
        loop {
            let mut event = false;
            while let Some(cmd) = self.pending.take().or_else(|| self.next_cmd()) {
                if matches!(cmd, Cmd::Shutdown) {
                    shutdown = true;
                    break;
                }
                self.handle(cmd);
                event = true;
            }
            if shutdown {
                break;
            }
            if event {
                nixl_gap = MIN_PARK;
                nixl_next = Instant::now();
            }
            let ready = std::mem::take(&mut self.ready);
            event |= self.local.progress(&ready, &mut self.events);
            self.ready = ready;
            self.ready.clear();
            if !self.copying.is_empty() {
                self.release_copied();
            }
            let polling = self.nixl.polling();
            let now = Instant::now();
            // While the engine is hot: transfers in flight are polled on every turn, operations
            // waiting for a notification every WATCH_GAP; otherwise by the back-off schedule.
            let hot = now.duration_since(last_event) < SPIN;
            let due = match polling {
                Polling::Never => false,
                Polling::Busy if hot => true,
                _ => now >= nixl_next,
            };
            if due {
                let active = self.nixl.progress(&[], &mut self.events);
                event |= active;
                nixl_gap = match polling {
                    _ if active => MIN_PARK,
                    Polling::Watching if hot => WATCH_GAP,
                    Polling::Every(t) => (nixl_gap * 2).min(t),
                    _ => (nixl_gap * 2).min(MAX_PARK),
                };
                nixl_next = now + nixl_gap;
            }
            event |= self.apply();
            if event {
                last_event = Instant::now();
                self.poller.wait(Some(Duration::ZERO), &mut self.ready);
                continue;
            }
            if last_event.elapsed() < SPIN {
                // Recently active: stay hot (yielding the core) so the next command, socket
                // message or completion is picked up without a wake-up.
                std::thread::yield_now();
                self.poller.wait(Some(Duration::ZERO), &mut self.ready);
                continue;
            }
            let timeout = match self.nixl.polling() {
                Polling::Never => None,
                _ => Some(nixl_next.saturating_duration_since(Instant::now())),
            };
            self.poller.prepare_sleep();
            if self.local.has_finished() {
                self.poller.awake();
                continue;
            }
            match self.rx.try_recv() {
                Ok(cmd) => {
                    self.poller.awake();
                    self.pending = Some(cmd);
                    continue;
                }
                Err(TryRecvError::Disconnected) => break,
                Err(TryRecvError::Empty) => {}
            }
            self.poller.wait(timeout, &mut self.ready);
        }
        self.shutdown();
    }

    /// The next command; a disconnected channel (every handle gone) reads as `Shutdown`.
    fn next_cmd(&mut self) -> Option<Cmd> {
        match self.rx.try_recv() {
            Ok(c) => Some(c),
            Err(TryRecvError::Empty) => None,
            Err(TryRecvError::Disconnected) => Some(Cmd::Shutdown),
        }
    }

    /// Ends everything: operations still waiting learn the engine is gone; the transports (and
    /// their agents) are destroyed, which ends every transfer; then held memory is freed.
    fn shutdown(mut self) {
        for (_, st) in self.passives.drain() {
            st.finish(OperationStatus::Errored, Some(Error::EngineStopped));
        }
        let mut actives: Vec<Active> = self.actives.drain().map(|(_, a)| a).collect();
        for a in &actives {
            a.state
                .finish(OperationStatus::Errored, Some(Error::EngineStopped));
        }
        let EngineLoop {
            mut local,
            nixl,
            copying,
            ..
        } = self;
        if local.stop(Some(STOP_WAIT)) {
            drop(copying);
        } else {
            // A peer stalls the pages a copy reads (nothing interrupts that copy): the memory it
            // writes is never freed. Every operation is gone (each holds the engine), so this is
            // owned memory only: the exposures' kept here, the abandoned reads' below.
            tracing::error!(
                "same-host copies still running {STOP_WAIT:?} after the connector was dropped (a \
                 peer stalls its pages): leaking the memory they may write"
            );
            std::mem::forget(copying);
            for a in &mut actives {
                std::mem::forget(a.keep.take());
            }
        }
        drop(local);
        drop(nixl); // destroys the agents, then frees the quarantined memory
        for a in actives {
            drop(a.keep);
            a.state.mark_released();
        }
    }

    fn handle(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Expose { spec, reply } => {
                let mut out = Exposure::default();
                let r = self
                    .nixl
                    .expose(&spec, &mut out)
                    .and_then(|()| self.local.expose(&spec, &mut out));
                match r {
                    Ok(()) => {
                        self.passives.insert(spec.key.clone(), spec.state.clone());
                        if let Err(Ok(_)) = reply.send(Ok(out)) {
                            // The caller's future is gone: nobody has the metadata; end it here.
                            self.end_passive(&spec.key);
                        }
                    }
                    Err(e) => {
                        self.local.unexpose(&spec.key);
                        self.nixl.unexpose(&spec.key);
                        let _ = reply.send(Err(e));
                    }
                }
            }
            Cmd::Unexpose { key, gen, keep } => {
                let state = self.passives.get(&key).cloned();
                self.end_passive(&key);
                if let Some((k, bytes)) = keep {
                    match state {
                        // A same-host copy into it stops within one chunk; its memory goes on to
                        // the hold (which may free it at once, if its exposer is gone) after that.
                        Some(st) if !st.is_released() => self.copying.push((st, gen, k, bytes)),
                        _ => self.nixl.hold(Some(gen), k, bytes),
                    }
                }
            }
            Cmd::Begin { spec } => {
                let (id, state) = (spec.id, spec.state.clone());
                if self.completed.contains(&spec.key) {
                    // Metadata is single-use: this connector already completed an operation with
                    // it. A retry after a failure is allowed; a replay after success is not.
                    state.mark_released();
                    state.finish(
                        OperationStatus::Errored,
                        Some(Error::Refused {
                            agent: spec.peer.to_string(),
                            replay: true,
                            reason: "this connector already completed an operation with this \
                                     metadata's notification key; metadata is single-use"
                                .into(),
                        }),
                    );
                    return;
                }
                self.actives.insert(
                    id,
                    Active {
                        key: spec.key.clone(),
                        state: state.clone(),
                        keep: None,
                        on: 0,
                    },
                );
                let chain = self.chain();
                self.offer(spec, chain[0], None);
                // Settle what the transports decided at once: an immediate hand-over to the next
                // transport, and registrations to keep with the memory.
                let tokens = self.settle(id);
                if !tokens.is_empty() {
                    state.keep_tokens(tokens);
                }
            }
            Cmd::Abandon { id, hard } => {
                if let Some(a) = self.actives.get(&id) {
                    let on = a.on;
                    let mut out = std::mem::take(&mut self.events);
                    self.transport(on).abandon(id, hard, &mut out);
                    self.events = out;
                }
            }
            Cmd::Adopt { id, keep } => match self.actives.get_mut(&id) {
                Some(a) => a.keep = Some(keep),
                None => drop(keep), // already released
            },
            Cmd::Deregister { side, gen, range, id } => self.nixl.deregister(side, gen, range, id),
            Cmd::Quarantine { gen, mapping } => {
                // Held whole, pages included: a NIXL read still in flight gets the buffer's own
                // bytes (or an error once the exposer is destroyed), never zeros. Retired
                // exposers are capped, so this is bounded.
                let len = mapping.len();
                self.nixl.hold(Some(gen), Box::new(mapping), len);
            }
            Cmd::Register { ranges, reply } => {
                let _ = reply.send(self.nixl.preregister(&ranges));
            }
            Cmd::Stats { reply } => {
                let mut s = self.nixl.stats.clone();
                s.live_registrations = self.nixl.live_registrations();
                s.local_refused_peers = self.local.refused_peers;
                let _ = reply.send(s);
            }
            Cmd::Shutdown => {}
        }
    }

    fn remember_completed(&mut self, key: Arc<str>) {
        if self.completed.insert(key.clone()) {
            self.completed_order.push_back(key);
            if self.completed_order.len() > MAX_COMPLETED {
                if let Some(old) = self.completed_order.pop_front() {
                    self.completed.remove(&old);
                }
            }
        }
    }

    /// Hands the memory of ended exposures whose last same-host copy has stopped to the hold.
    fn release_copied(&mut self) {
        let mut i = 0;
        while i < self.copying.len() {
            if self.copying[i].0.is_released() {
                let (_, gen, keep, bytes) = self.copying.swap_remove(i);
                self.nixl.hold(Some(gen), keep, bytes);
            } else {
                i += 1;
            }
        }
    }

    fn end_passive(&mut self, key: &Arc<str>) {
        self.passives.remove(key);
        self.local.unexpose(key);
        self.nixl.unexpose(key);
    }

    /// Handles the events of a just-offered operation `id` that are best handled now: hand-overs
    /// to the next transport, and its registrations (returned, to keep with its memory).
    fn settle(&mut self, id: OpId) -> Vec<RegToken> {
        let mut tokens = Vec::new();
        loop {
            let pos = self.events.iter().position(|e| {
                matches!(e, Event::Declined { spec, .. } if spec.id == id)
                    || matches!(e, Event::Registered { id: i, .. } if *i == id)
            });
            let Some(pos) = pos else { return tokens };
            match self.events.remove(pos) {
                Event::Registered { tokens: t, .. } => tokens.extend(t),
                Event::Declined { spec, reason } => self.hand_over(spec, reason),
                _ => unreachable!("matched above"),
            }
        }
    }

    /// Offers a declined operation to the next transport of the chain, or fails it.
    fn hand_over(&mut self, spec: ActiveSpec, reason: String) {
        let id = spec.id;
        let chain = self.chain();
        let on = self.actives.get(&id).map_or(0, |a| a.on);
        match chain.iter().position(|&t| t == on).and_then(|p| chain.get(p + 1)) {
            Some(&next) => self.offer(spec, next, Some(reason)),
            None => self.events.push(Event::ActiveEnded {
                id,
                result: Err(Error::PathUnavailable {
                    agent: spec.peer.to_string(),
                    reason,
                }),
            }),
        }
    }

    /// Offers `spec` to transport `i` of the chain (after another declined it with `why`).
    fn offer(&mut self, spec: ActiveSpec, i: usize, why: Option<String>) {
        let id = spec.id;
        if spec.state.status().is_terminal() {
            // Cancelled before any transport took it: nothing touched the memory.
            self.events.push(Event::ActiveEnded {
                id,
                result: Err(Error::Cancelled),
            });
            return;
        }
        if let Some(a) = self.actives.get_mut(&id) {
            a.on = i;
        }
        if let Some(why) = why {
            tracing::trace!(op = id, %why, "offered to the next transport");
        }
        let mut out = std::mem::take(&mut self.events);
        self.transport(i).begin(spec, &mut out);
        self.events = out;
    }

    /// Applies the transports' events to the operations.
    fn apply(&mut self) -> bool {
        let mut any = false;
        while !self.events.is_empty() {
            any = true;
            for ev in std::mem::take(&mut self.events) {
                match ev {
                    Event::ActiveEnded { id, result } => {
                        let Some(a) = self.actives.remove(&id) else {
                            continue;
                        };
                        if result.is_ok() {
                            if self.transport(a.on).path() == TransferPath::Local {
                                self.nixl.stats.local_transfers += 1;
                            }
                            self.remember_completed(a.key.clone());
                        }
                        // Released before the status is final: a waiter woken by the status may
                        // take the memory back at once.
                        drop(a.keep);
                        a.state.mark_released();
                        match result {
                            Ok(()) => a.state.finish(OperationStatus::Complete, None),
                            Err(Error::Cancelled) => a.state.finish(OperationStatus::Cancelled, None),
                            Err(e) => a.state.finish(OperationStatus::Errored, Some(e)),
                        };
                    }
                    Event::PassiveCompleted { key } => {
                        if let Some(st) = self.passives.get(&key) {
                            st.finish(OperationStatus::Complete, None);
                            self.end_passive(&key);
                        }
                    }
                    Event::PassiveFailed { key, error } => {
                        if let Some(st) = self.passives.get(&key) {
                            st.finish(OperationStatus::Errored, Some(error));
                            self.end_passive(&key);
                        }
                    }
                    Event::Declined { spec, reason } => self.hand_over(spec, reason),
                    // Tokens of an operation whose caller is no longer waiting: the transport
                    // keeps its own while it needs them.
                    Event::Registered { .. } => {}
                }
            }
        }
        any
    }
}
