//! The engine: one thread per connector owns the NIXL agent and serialises every call to it.
//!
//! Callers send [`Cmd`]s over a channel and unpark the thread. While anything is outstanding (a
//! transfer in flight, a passive operation waiting for its notification) the thread polls NIXL:
//! it spins (yielding the core) for [`SPIN`] after the last event, then backs off with parks of
//! [`MIN_PARK`] doubling to [`MAX_PARK`]. With nothing outstanding it spins out the same [`SPIN`]
//! window (so back-to-back operations pay no wake-up) and then parks until the next command, so
//! an idle connector costs no CPU. Each completion and each notification key wakes
//! exactly the operation it belongs to; keys that arrive before their operation watches for them
//! wait in a bounded stash.
//!
//! Remote agents are loaded once per distinct metadata string and kept (reference-counted while
//! transfers use them, least recently used evicted beyond [`MAX_IDLE_REMOTES`]); registrations are
//! shared by address range (a range inside a live registration reuses it) and live as long as the
//! memory's [`RegToken`]s.

pub(crate) mod nixl;

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

use tokio::sync::{oneshot, Notify};

use crate::error::{Error, Result};
use crate::metadata::{decode_agent_metadata, encode_agent_metadata};
use crate::operation::OperationStatus;
pub(crate) use nixl::{BackendOptions, Range};
use nixl::{NixlAgent, Poll, Prepared, Registration, Transfer};

/// How long the engine keeps spinning after the last event before it starts parking.
pub(crate) const SPIN: Duration = Duration::from_millis(2);
/// The first back-off park.
pub(crate) const MIN_PARK: Duration = Duration::from_micros(20);
/// The longest back-off park while something is outstanding.
pub(crate) const MAX_PARK: Duration = Duration::from_millis(1);
/// How long a caller spins for the engine's answer or an operation's end before parking its task.
pub(crate) const WAITER_SPIN: Duration = Duration::from_micros(100);
/// Notification keys kept for operations that have not started watching yet.
const STASH: usize = 4096;
/// Remote agents kept loaded with no transfer using them.
pub(crate) const MAX_IDLE_REMOTES: usize = 64;
/// Prepared descriptor lists kept per side before the cache is cleared.
const MAX_PREPARED: usize = 256;
/// How long a shutting-down engine waits for transfers still in flight.
const DRAIN: Duration = Duration::from_secs(10);

/// Shared state of one operation: its status, its error, and the wakers of its waiters.
pub(crate) struct OpState {
    status: AtomicU8,
    error: Mutex<Option<Error>>,
    notify: Notify,
    released: Mutex<bool>,
    released_cv: Condvar,
}

impl OpState {
    pub(crate) fn new(status: OperationStatus, released: bool) -> Arc<Self> {
        Arc::new(Self {
            status: AtomicU8::new(status as u8),
            error: Mutex::new(None),
            notify: Notify::new(),
            released: Mutex::new(released),
            released_cv: Condvar::new(),
        })
    }

    pub(crate) fn status(&self) -> OperationStatus {
        OperationStatus::from_u8(self.status.load(Ordering::Acquire))
    }

    /// Moves to a terminal status unless already in one; wakes every waiter.
    pub(crate) fn finish(&self, status: OperationStatus, error: Option<Error>) -> bool {
        let mut cur = self.status.load(Ordering::Acquire);
        loop {
            if OperationStatus::from_u8(cur).is_terminal() {
                return false;
            }
            if let Some(e) = &error {
                *self.error.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.clone());
            }
            match self
                .status
                .compare_exchange(cur, status as u8, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => break,
                Err(now) => cur = now,
            }
        }
        self.notify.notify_waiters();
        true
    }

    pub(crate) fn error(&self) -> Option<Error> {
        self.error.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub(crate) fn notified(&self) -> tokio::sync::futures::Notified<'_> {
        self.notify.notified()
    }

    pub(crate) fn mark_released(&self) {
        *self.released.lock().unwrap_or_else(|p| p.into_inner()) = true;
        self.released_cv.notify_all();
    }

    pub(crate) fn is_released(&self) -> bool {
        *self.released.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Blocks the calling thread until NIXL has let go of the operation's memory.
    pub(crate) fn wait_released(&self) {
        let mut g = self.released.lock().unwrap_or_else(|p| p.into_inner());
        while !*g {
            g = self.released_cv.wait(g).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// Keeps one registration alive; the last clone's drop queues its deregistration.
#[derive(Clone)]
pub(crate) struct RegToken(Arc<RegInner>);

pub(crate) struct RegInner {
    tx: Sender<Cmd>,
    thread: Thread,
    range: Range,
    id: u64,
}

impl RegToken {
    pub(crate) fn same(&self, other: &RegToken) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Drop for RegInner {
    fn drop(&mut self) {
        if self
            .tx
            .send(Cmd::Deregister {
                range: self.range,
                id: self.id,
            })
            .is_ok()
        {
            self.thread.unpark();
        }
    }
}

/// What a passive operation gets from the engine.
pub(crate) struct PassiveReply {
    pub(crate) tokens: Vec<RegToken>,
    pub(crate) nixl_metadata: Arc<str>,
}

pub(crate) enum Cmd {
    /// Register `ranges`, encode this agent's metadata, and watch for `key`.
    Passive {
        ranges: Vec<Range>,
        key: String,
        state: Arc<OpState>,
        reply: oneshot::Sender<Result<PassiveReply>>,
    },
    /// Stop watching for `key`.
    Unwatch {
        key: String,
    },
    /// Register `local`, load the peer, post the transfer.
    Active {
        write: bool,
        local: Vec<Range>,
        remote: Vec<Range>,
        remote_md: String,
        key: String,
        state: Arc<OpState>,
        reply: oneshot::Sender<Result<Vec<RegToken>>>,
    },
    /// Hold `keep` (an operation's memory) until `state`'s transfer is released.
    Adopt {
        state: Arc<OpState>,
        keep: Box<dyn Send>,
    },
    Deregister {
        range: Range,
        id: u64,
    },
    /// Report the engine's counters.
    Stats {
        reply: oneshot::Sender<EngineStats>,
    },
    Shutdown,
}

/// Counters for tests and `doctor`.
#[derive(Debug, Clone, Default)]
pub struct EngineStats {
    /// NIXL memory registrations made so far.
    pub registrations: u64,
    /// Registrations currently live.
    pub live_registrations: usize,
    /// Remote agent metadata loads made so far.
    pub remote_loads: u64,
    /// Transfers posted so far.
    pub transfers: u64,
}

static NEXT_ENGINE: AtomicU64 = AtomicU64::new(1);

/// A handle to a connector's engine thread.
#[derive(Clone)]
pub(crate) struct Engine(Arc<EngineShared>);

struct EngineShared {
    tx: Sender<Cmd>,
    thread: Thread,
    join: Mutex<Option<JoinHandle<()>>>,
    name: String,
}

impl Engine {
    /// Starts the engine thread and creates the agent on it.
    pub(crate) fn start(name: String, opts: BackendOptions) -> Result<Self> {
        // Fail fast (and without touching nixl-sys) when NIXL is absent.
        nixl::load()?;
        let (tx, rx) = mpsc::channel();
        let (ready_tx, ready_rx) = mpsc::sync_channel(1);
        let agent_name = name.clone();
        let self_tx = tx.clone();
        let join = std::thread::Builder::new()
            .name(format!(
                "nixl-engine-{}",
                NEXT_ENGINE.fetch_add(1, Ordering::Relaxed)
            ))
            .spawn(move || {
                let agent = match NixlAgent::new(&agent_name, &opts) {
                    Ok(a) => {
                        let _ = ready_tx.send(Ok(()));
                        a
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                EngineLoop::new(agent, rx, self_tx).run();
            })
            .map_err(|e| Error::Nixl {
                op: "spawn engine thread",
                status: e.to_string(),
            })?;
        let thread = join.thread().clone();
        ready_rx.recv().map_err(|_| Error::EngineStopped)??;
        Ok(Engine(Arc::new(EngineShared {
            tx,
            thread,
            join: Mutex::new(Some(join)),
            name,
        })))
    }

    pub(crate) fn name(&self) -> &str {
        &self.0.name
    }

    pub(crate) fn send(&self, cmd: Cmd) -> Result<()> {
        self.0.tx.send(cmd).map_err(|_| Error::EngineStopped)?;
        self.0.thread.unpark();
        Ok(())
    }

    /// Sends a command built around a reply channel and awaits the reply.
    ///
    /// The engine answers most commands within microseconds, so the caller first spins (yielding
    /// its core) for up to [`WAITER_SPIN`] before parking its task; that saves a futex wake-up on
    /// each side of the hop.
    pub(crate) async fn call<T>(&self, f: impl FnOnce(oneshot::Sender<T>) -> Cmd) -> Result<T> {
        let (tx, mut rx) = oneshot::channel();
        self.send(f(tx))?;
        let t0 = Instant::now();
        loop {
            match rx.try_recv() {
                Ok(v) => return Ok(v),
                Err(oneshot::error::TryRecvError::Closed) => return Err(Error::EngineStopped),
                Err(oneshot::error::TryRecvError::Empty) if t0.elapsed() < WAITER_SPIN => {
                    std::thread::yield_now()
                }
                Err(oneshot::error::TryRecvError::Empty) => break,
            }
        }
        rx.await.map_err(|_| Error::EngineStopped)
    }

    pub(crate) async fn stats(&self) -> Result<EngineStats> {
        self.call(|reply| Cmd::Stats { reply }).await
    }
}

impl Drop for EngineShared {
    fn drop(&mut self) {
        let _ = self.tx.send(Cmd::Shutdown);
        self.thread.unpark();
        if std::thread::current().id() != self.thread.id() {
            if let Some(j) = self.join.lock().unwrap_or_else(|p| p.into_inner()).take() {
                let _ = j.join();
            }
        }
    }
}

struct Inflight {
    transfer: Option<Transfer>,
    state: Arc<OpState>,
    remote: String,
    keep: Option<Box<dyn Send>>,
}

impl Drop for Inflight {
    fn drop(&mut self) {
        // Release the NIXL request first, then let the memory go and tell any blocked dropper.
        drop(self.transfer.take());
        drop(self.keep.take());
        self.state.mark_released();
    }
}

struct RegEntry {
    id: u64,
    token: Weak<RegInner>,
    _reg: Registration,
}

struct Remote {
    name: String,
    refs: usize,
    last_used: Instant,
}

struct EngineLoop {
    agent: NixlAgent,
    rx: Receiver<Cmd>,
    tx: Sender<Cmd>,
    thread: Thread,
    inflight: Vec<Inflight>,
    watch: HashMap<String, Arc<OpState>>,
    stash: VecDeque<String>,
    stash_set: HashSet<String>,
    regs: HashMap<Range, RegEntry>,
    next_reg: u64,
    local_md: Option<Arc<str>>,
    remotes: HashMap<String, Remote>,
    remote_by_name: HashMap<String, String>,
    notif_buf: Vec<(String, Vec<u8>)>,
    stats: EngineStats,
    /// Prepared local lists by ranges; cleared when a registration goes.
    local_prep: HashMap<Vec<Range>, Prepared>,
    /// Prepared remote lists by (peer, ranges); a peer's entries go when its metadata changes.
    remote_prep: HashMap<(String, Vec<Range>), Prepared>,
}

impl EngineLoop {
    fn new(agent: NixlAgent, rx: Receiver<Cmd>, tx: Sender<Cmd>) -> Self {
        Self {
            agent,
            rx,
            tx,
            thread: std::thread::current(),
            inflight: Vec::new(),
            watch: HashMap::new(),
            stash: VecDeque::new(),
            stash_set: HashSet::new(),
            regs: HashMap::new(),
            next_reg: 1,
            local_md: None,
            remotes: HashMap::new(),
            remote_by_name: HashMap::new(),
            notif_buf: Vec::new(),
            stats: EngineStats::default(),
            local_prep: HashMap::new(),
            remote_prep: HashMap::new(),
        }
    }

    fn run(mut self) {
        let mut last_event = Instant::now();
        let mut park = MIN_PARK;
        let mut shutdown: Option<Instant> = None;
        loop {
            let mut event = false;
            loop {
                match self.rx.try_recv() {
                    Ok(Cmd::Shutdown) => shutdown = shutdown.or(Some(Instant::now())),
                    Ok(cmd) => {
                        self.handle(cmd);
                        event = true;
                    }
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        shutdown = shutdown.or(Some(Instant::now()));
                        break;
                    }
                }
            }
            if let Some(t) = shutdown {
                if self.inflight.is_empty() || t.elapsed() > DRAIN {
                    break;
                }
            }
            let busy = !self.inflight.is_empty() || !self.watch.is_empty();
            if busy {
                event |= self.progress();
            }
            if event {
                last_event = Instant::now();
                park = MIN_PARK;
                continue;
            }
            if last_event.elapsed() < SPIN {
                // Recently active: keep the core warm (yielding it) so the next command or event is
                // picked up without a futex wake.
                std::thread::yield_now();
            } else if !busy && shutdown.is_none() {
                std::thread::park();
                last_event = Instant::now();
            } else {
                std::thread::park_timeout(park);
                park = (park * 2).min(MAX_PARK);
            }
        }
        // Anything still waiting learns the engine is gone.
        for (_, st) in self.watch.drain() {
            st.finish(OperationStatus::Errored, Some(Error::EngineStopped));
        }
        for f in &self.inflight {
            f.state
                .finish(OperationStatus::Errored, Some(Error::EngineStopped));
        }
    }

    fn handle(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Passive {
                ranges,
                key,
                state,
                reply,
            } => {
                let r = contain("register memory", || self.passive(ranges, key, state));
                let _ = reply.send(r);
            }
            Cmd::Unwatch { key } => {
                self.watch.remove(&key);
            }
            Cmd::Active {
                write,
                local,
                remote,
                remote_md,
                key,
                state,
                reply,
            } => {
                let st = state.clone();
                let r = contain("start transfer", || {
                    self.active(write, local, remote, &remote_md, &key, state)
                });
                if r.is_err() {
                    st.mark_released();
                }
                let _ = reply.send(r);
            }
            Cmd::Adopt { state, keep } => {
                if let Some(f) = self.inflight.iter_mut().find(|f| Arc::ptr_eq(&f.state, &state)) {
                    f.keep = Some(keep);
                }
            }
            Cmd::Deregister { range, id } => {
                if self.regs.get(&range).is_some_and(|e| e.id == id) {
                    self.regs.remove(&range);
                    self.local_md = None;
                    self.local_prep.clear();
                }
            }
            Cmd::Stats { reply } => {
                let mut s = self.stats.clone();
                s.live_registrations = self.regs.len();
                let _ = reply.send(s);
            }
            Cmd::Shutdown => {}
        }
    }

    fn register(&mut self, ranges: &[Range]) -> Result<Vec<RegToken>> {
        let mut out = Vec::with_capacity(ranges.len());
        for r in ranges {
            if let Some(tok) = self.regs.get(r).and_then(|e| e.token.upgrade()) {
                out.push(RegToken(tok));
                continue;
            }
            // A range inside a live registration (a slice of an exposed buffer) reuses it.
            let end = r.addr + r.len;
            if let Some(tok) = self
                .regs
                .iter()
                .filter(|(k, _)| k.device == r.device && k.addr <= r.addr && end <= k.addr + k.len)
                .find_map(|(_, e)| e.token.upgrade())
            {
                out.push(RegToken(tok));
                continue;
            }
            // A dead entry's deregistration is still queued: replace it now (its id no longer
            // matches, so the queued command becomes a no-op).
            self.regs.remove(r);
            let reg = self.agent.register(*r)?;
            let id = self.next_reg;
            self.next_reg += 1;
            let tok = Arc::new(RegInner {
                tx: self.tx.clone(),
                thread: self.thread.clone(),
                range: *r,
                id,
            });
            self.regs.insert(
                *r,
                RegEntry {
                    id,
                    token: Arc::downgrade(&tok),
                    _reg: reg,
                },
            );
            self.stats.registrations += 1;
            self.local_md = None;
            out.push(RegToken(tok));
        }
        Ok(out)
    }

    fn passive(&mut self, ranges: Vec<Range>, key: String, state: Arc<OpState>) -> Result<PassiveReply> {
        let tokens = self.register(&ranges)?;
        let md = match &self.local_md {
            Some(md) => md.clone(),
            None => {
                let raw = self.agent.local_metadata()?;
                let md: Arc<str> = encode_agent_metadata(&raw).into();
                self.local_md = Some(md.clone());
                md
            }
        };
        if self.stash_set.remove(&key) {
            self.stash.retain(|k| k != &key);
            state.finish(OperationStatus::Complete, None);
        } else {
            self.watch.insert(key, state);
        }
        Ok(PassiveReply {
            tokens,
            nixl_metadata: md,
        })
    }

    fn remote(&mut self, md: &str) -> Result<String> {
        if let Some(r) = self.remotes.get_mut(md) {
            r.last_used = Instant::now();
            return Ok(r.name.clone());
        }
        let raw = decode_agent_metadata(md)?;
        let name = self.agent.load_remote(&raw)?;
        self.stats.remote_loads += 1;
        // A peer's newer metadata (more registrations) replaces its older string; NIXL updated the
        // agent in place.
        let refs = match self.remote_by_name.insert(name.clone(), md.to_string()) {
            Some(old) => {
                self.remote_prep.retain(|(n, _), _| n != &name);
                self.remotes.remove(&old).map_or(0, |r| r.refs)
            }
            None => 0,
        };
        self.remotes.insert(
            md.to_string(),
            Remote {
                name: name.clone(),
                refs,
                last_used: Instant::now(),
            },
        );
        self.evict_remotes();
        Ok(name)
    }

    fn evict_remotes(&mut self) {
        let idle = self.remotes.values().filter(|r| r.refs == 0).count();
        if idle <= MAX_IDLE_REMOTES {
            return;
        }
        if let Some(md) = self
            .remotes
            .iter()
            .filter(|(_, r)| r.refs == 0)
            .min_by_key(|(_, r)| r.last_used)
            .map(|(k, _)| k.clone())
        {
            self.forget_remote_md(&md);
        }
    }

    fn forget_remote_md(&mut self, md: &str) {
        if let Some(r) = self.remotes.remove(md) {
            self.remote_prep.retain(|(n, _), _| n != &r.name);
            if self.remote_by_name.get(&r.name).is_some_and(|m| m == md) {
                self.remote_by_name.remove(&r.name);
            }
            self.agent.invalidate_remote(&r.name);
        }
    }

    fn remote_refs(&mut self, name: &str, delta: isize) {
        if let Some(md) = self.remote_by_name.get(name) {
            if let Some(r) = self.remotes.get_mut(md) {
                r.refs = r.refs.saturating_add_signed(delta);
            }
        }
    }

    fn active(
        &mut self,
        write: bool,
        local: Vec<Range>,
        remote: Vec<Range>,
        remote_md: &str,
        key: &str,
        state: Arc<OpState>,
    ) -> Result<Vec<RegToken>> {
        let tokens = self.register(&local)?;
        let name = self.remote(remote_md)?;
        self.stats.transfers += 1;
        if self.local_prep.len() > MAX_PREPARED {
            self.local_prep.clear();
        }
        if self.remote_prep.len() > MAX_PREPARED {
            self.remote_prep.clear();
        }
        if !self.local_prep.contains_key(&local) {
            let p = self.agent.prepare(None, &local)?;
            self.local_prep.insert(local.clone(), p);
        }
        let rkey = (name.clone(), remote);
        if !self.remote_prep.contains_key(&rkey) {
            let p = self.agent.prepare(Some(&name), &rkey.1)?;
            self.remote_prep.insert(rkey.clone(), p);
        }
        let (lp, rp) = (&self.local_prep[&local], &self.remote_prep[&rkey]);
        match self.agent.post_prepared(write, lp, rp, &name, key.as_bytes()) {
            Ok(None) => {
                state.mark_released();
                state.finish(OperationStatus::Complete, None);
            }
            Ok(Some(t)) => {
                self.remote_refs(&name, 1);
                self.inflight.push(Inflight {
                    transfer: Some(t),
                    state,
                    remote: name,
                    keep: None,
                });
            }
            Err(e) => {
                if matches!(e, Error::RemoteGone { .. }) {
                    self.forget_remote_md(remote_md);
                }
                state.mark_released();
                return Err(e);
            }
        }
        Ok(tokens)
    }

    fn progress(&mut self) -> bool {
        let mut event = false;
        let mut i = 0;
        while i < self.inflight.len() {
            let f = &self.inflight[i];
            let t = f
                .transfer
                .as_ref()
                .expect("in-flight transfers hold their request");
            match self.agent.poll(t, &f.remote) {
                Poll::Pending => i += 1,
                Poll::Done => {
                    let f = self.inflight.swap_remove(i);
                    let (state, remote) = (f.state.clone(), f.remote.clone());
                    drop(f); // releases the request and marks the memory released
                    self.remote_refs(&remote, -1);
                    state.finish(OperationStatus::Complete, None);
                    event = true;
                }
                Poll::Failed(e) => {
                    let f = self.inflight.swap_remove(i);
                    let (state, remote) = (f.state.clone(), f.remote.clone());
                    drop(f);
                    self.remote_refs(&remote, -1);
                    if let Some(md) = self.remote_by_name.get(&remote).cloned() {
                        self.forget_remote_md(&md);
                    }
                    state.finish(OperationStatus::Errored, Some(e));
                    event = true;
                }
            }
        }
        let mut buf = std::mem::take(&mut self.notif_buf);
        if let Err(e) = self.agent.notifications(&mut buf) {
            tracing::warn!(error = %e, "draining NIXL notifications failed");
        }
        for (from, msg) in buf.drain(..) {
            event = true;
            let key = String::from_utf8_lossy(&msg).into_owned();
            match self.watch.remove(&key) {
                Some(st) => {
                    st.finish(OperationStatus::Complete, None);
                }
                None => {
                    tracing::trace!(from = %from, key = %key, "notification for no waiting operation; stashed");
                    if self.stash_set.insert(key.clone()) {
                        self.stash.push_back(key);
                        if self.stash.len() > STASH {
                            if let Some(old) = self.stash.pop_front() {
                                self.stash_set.remove(&old);
                            }
                        }
                    }
                }
            }
        }
        self.notif_buf = buf;
        event
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

impl Drop for EngineLoop {
    fn drop(&mut self) {
        // In-flight transfers release before the agent goes (Inflight's drop marks them released).
        self.inflight.clear();
        self.local_prep.clear();
        self.remote_prep.clear();
        self.regs.clear();
    }
}
