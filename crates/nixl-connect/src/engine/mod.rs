//! The engine: one thread per connector owns the transports and every operation's bookkeeping.
//!
//! Callers send [`Cmd`]s over a channel and wake the thread through its [`poller`]; who drives it,
//! and when, is `driver`'s. It polls NIXL only when NIXL needs it ([`Polling`](transport::Polling)).
//!
//! Ownership: from the moment a command leaves the caller, the memory a transport may touch is
//! owned by the engine's side of the operation. Registration tokens live in the transports'
//! records, owned memory of a dropped operation is adopted ([`Cmd::Adopt`]) and freed only once
//! its transfer has ended, and exposed memory the library would free is quarantined until no peer
//! can reach it (see `docs/SOUNDNESS.md`).

mod cmd;
mod core;
mod driver;
#[cfg(any(test, feature = "testing"))]
pub(crate) mod loopback;
pub(crate) mod nixl;
mod poller;
pub(crate) mod same_host;
pub(crate) mod transport;
mod wait;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

pub(crate) use self::cmd::{Cmd, Mailbox, Probed};
pub(crate) use self::core::DEFAULT_PROGRESS_DELAY;
use self::core::{EngineCore, STOP_WAIT};
use self::driver::Drive;
use self::nixl::NixlTransport;
use self::poller::{Poller, Registrar, Waker};
use self::same_host::SameHostTransport;
use self::transport::{DecodePeer, OpId, PeerInfo, Transport, TransportId};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::metrics::families::Metrics;
pub(crate) use crate::reg::Range;
use crate::state::PathPolicy;
use crate::sync::Recover;

/// Decoded peer metadata kept by string: at most this many strings...
const MAX_DECODED: usize = 1024;
/// ...and at most this many bytes of them (strings and decoded blobs together), so that what
/// peers send cannot pin more than this much memory here.
const MAX_DECODED_BYTES: usize = 32 << 20;

/// Decoded metadata by string, bounded in count and bytes (cleared when either would pass).
#[derive(Default)]
struct DecodedCache {
    map: HashMap<Arc<str>, PeerInfo>,
    bytes: usize,
}

impl DecodedCache {
    fn insert(&mut self, d: &PeerInfo) {
        let size = d.published.len() + d.reach.len();
        if size > MAX_DECODED_BYTES / 4 {
            return; // too big to keep: decoded again if it comes back
        }
        if self.map.len() >= MAX_DECODED || self.bytes + size > MAX_DECODED_BYTES {
            self.map.clear();
            self.bytes = 0;
        }
        if self.map.insert(d.published.clone(), d.clone()).is_none() {
            self.bytes += size;
        }
    }
}

/// The transports of an engine, each with the id of the [`Seat`] it was made with (the publisher
/// of metadata first), and the ids active operations try in turn.
type Transports = (Vec<(TransportId, Box<dyn Transport>)>, Vec<TransportId>);

/// What a transport is given as it is made: its id, a mailbox to it, a registrar whose
/// descriptors are reported to it alone, and the engine's waker.
pub(crate) struct Seat {
    id: TransportId,
    tx: Sender<Cmd>,
    registrar: Registrar,
    waker: Waker,
}

impl Seat {
    /// A mailbox to this transport for its own message type `M`.
    pub(crate) fn mailbox<M: Send + 'static>(&self) -> Mailbox<M> {
        Mailbox::new(self.tx.clone(), self.waker.clone(), self.id)
    }
}

/// Hands out an engine's [`Seat`]s, in the order the engine lists its transports.
pub(crate) struct Seats<'a> {
    taken: usize,
    tx: Sender<Cmd>,
    waker: Waker,
    poller: &'a Poller,
}

impl Seats<'_> {
    /// The next transport's seat.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] past [`TransportId::MAX`] transports.
    pub(crate) fn take(&mut self) -> Result<Seat> {
        let id = TransportId::nth(self.taken).ok_or_else(|| {
            Error::InvalidArgument(format!("an engine has at most {} transports", TransportId::MAX))
        })?;
        self.taken += 1;
        Ok(Seat {
            id,
            tx: self.tx.clone(),
            registrar: self.poller.registrar_for(id),
            waker: self.waker.clone(),
        })
    }
}

static NEXT_ENGINE: AtomicU64 = AtomicU64::new(1);

/// How an engine's thread runs: how long a dropped operation's transfer is waited for, the
/// longest a transport with work waits between progress calls once idle, and where figures go.
struct Tuning {
    cancel_grace: Duration,
    progress_delay: Duration,
    wait_spin: Duration,
    metrics: Option<Metrics>,
    /// Whether waiting callers may drive the engine at all (see `driver`).
    callers_drive: bool,
}

/// Options the engine starts with.
#[derive(Debug, Clone)]
pub(crate) struct EngineOptions {
    pub(crate) backends: Vec<String>,
    pub(crate) ucx_params: Vec<(String, String)>,
    pub(crate) progress_delay: Duration,
    pub(crate) path: PathPolicy,
    pub(crate) cancel_grace: Duration,
    pub(crate) deregister_on_completion: bool,
    pub(crate) quarantine_limit: usize,
    /// A directory shared with same-host peers in other network namespaces, if any.
    pub(crate) socket_dir: Option<std::path::PathBuf>,
    /// Where the connector's figures are recorded, if anywhere.
    pub(crate) metrics: Option<Metrics>,
    /// How long an operation's wait stays awake before it parks.
    pub(crate) wait_spin: Duration,
}

/// How many of a connector's waits may spin at once: half the cores this process may use, at
/// least one.
pub(crate) fn max_spinning() -> usize {
    static MAX: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MAX.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).max(1)))
}

/// A wait's place among the waits that spin ([`Engine::spin_slot`]); dropping it gives the place
/// back and ends its driving (waking the engine unless [`SpinSlot::finished`]).
pub(crate) struct SpinSlot {
    spinning: Arc<AtomicUsize>,
    /// The engine it drives, if it may.
    drives: Option<Arc<Drive>>,
    /// The wait saw its operation end: nothing of it is left for the engine.
    finished: bool,
}

impl SpinSlot {
    /// The wait saw its operation end.
    pub(crate) fn finished(&mut self) {
        self.finished = true;
    }

    /// True when the wait drives the engine (it entered the gate).
    pub(crate) fn drives(&self) -> bool {
        self.drives.is_some()
    }
}

impl Drop for SpinSlot {
    fn drop(&mut self) {
        if let Some(d) = self.drives.take() {
            d.leave(!self.finished);
        }
        self.spinning.fetch_sub(1, Ordering::AcqRel);
    }
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
    /// How long an operation's wait stays awake before it parks (see `wait`).
    wait_spin: Duration,
    /// Waits spinning now, at most [`max_spinning`] at once (see [`Engine::spin_slot`]).
    spinning: Arc<AtomicUsize>,
    /// The engine's state, for callers that drive it (see `driver`).
    drive: Arc<Drive>,
    /// How long the engine's end waits for running copies ([`STOP_WAIT`] but for a shutdown's deadline).
    stop_wait: Mutex<Duration>,
    decoded: Mutex<DecodedCache>,
    /// The publishing transport's decoder of peers' metadata.
    decode: DecodePeer,
    /// Where operations are recorded, if anywhere.
    metrics: Option<Metrics>,
}

impl Engine {
    /// Binds the same-host socket, creates the exposer agent and starts the engine thread. The
    /// agent's name is `base` (`base-<pid>-<k>` when another connector here serves `base`), with
    /// a fresh same-host identity's advertisement appended when it serves the same-host path.
    pub(crate) fn start(base: String, opts: EngineOptions) -> Result<Self> {
        // Fail fast (and without touching nixl-sys) when NIXL is absent.
        nixl::ffi::load()?;
        let (name, listener) = if opts.path == PathPolicy::Nixl {
            (base, None)
        } else if base.contains('~') {
            // `~` starts a rotated exposer's generation in a name: an advertisement after it
            // would not be read, so such a worker id serves NIXL only.
            tracing::debug!(worker = %base, "a worker id with `~` serves no same-host socket");
            (base, None)
        } else {
            let id =
                same_host::Identity::generate().map_err(|e| Error::os("making the same-host identity", e))?;
            let (name, listener) = bind_unique(&base, &id)?;
            (name, listener.map(|l| (l, Arc::new(id))))
        };
        // The same socket as a file in the shared directory, for peers in other network
        // namespaces (it needs the identity its name is made from).
        let dir_listener = match (&opts.socket_dir, &listener) {
            (Some(dir), Some((_, id))) => same_host::listen_in(dir, &id.stem())
                .inspect(|l| tracing::debug!(path = %l.path().display(), "serving same-host peers through the socket directory"))
                .inspect_err(|e| tracing::warn!(dir = %dir.display(), error = %e, "cannot serve same-host peers through the socket directory"))
                .ok(),
            _ => None,
        };
        Self::launch(
            name,
            Tuning {
                cancel_grace: opts.cancel_grace,
                progress_delay: opts.progress_delay,
                wait_spin: opts.wait_spin,
                metrics: opts.metrics.clone(),
                // Deregistration on completion must come before the status is final, and it is
                // NIXL's work: the engine thread's (see `driver`).
                callers_drive: !opts.deregister_on_completion,
            },
            nixl::encoding::decode_peer,
            move |name, seats| {
                // Every transport exposes passive operations, in the order they are made: NIXL
                // publishes the metadata, the same-host path (which reads what NIXL published)
                // comes after it. Active operations try them in the order of `chain`.
                let (n, l) = (seats.take()?, seats.take()?);
                let nixl: Box<dyn Transport> = Box::new(NixlTransport::new(
                    name,
                    opts.backends,
                    opts.ucx_params,
                    opts.deregister_on_completion,
                    opts.quarantine_limit,
                    n.mailbox(),
                )?);
                let same_host = SameHostTransport::new(
                    opts.path != PathPolicy::Nixl,
                    listener,
                    dir_listener,
                    opts.socket_dir,
                    l.registrar,
                    l.waker,
                );
                let chain = match opts.path {
                    PathPolicy::Auto => vec![l.id, n.id],
                    PathPolicy::Nixl => vec![n.id],
                    PathPolicy::SameHost => vec![l.id],
                };
                Ok((vec![(n.id, nixl), (l.id, Box::new(same_host))], chain))
            },
        )
    }

    /// Starts an engine over the in-process [`loopback`] transport only (no NIXL, no socket).
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn start_loopback(
        name: String,
        cancel_grace: Duration,
        wait_spin: Duration,
        metrics: Option<Metrics>,
    ) -> Result<Self> {
        Self::launch(
            name,
            Tuning {
                cancel_grace,
                progress_delay: self::core::DEFAULT_PROGRESS_DELAY,
                wait_spin,
                metrics,
                callers_drive: true,
            },
            loopback::decode_peer,
            |name, seats| {
                let seat = seats.take()?;
                let t: Box<dyn Transport> = Box::new(loopback::LoopbackTransport::new(name, seat.waker));
                Ok((vec![(seat.id, t)], vec![seat.id]))
            },
        )
    }

    /// Starts the engine thread named for `name`; `make` builds its transports and chain there.
    /// Returns once they exist, or with the error that kept them from existing.
    fn launch(
        name: String,
        tuning: Tuning,
        decode: DecodePeer,
        make: impl FnOnce(&str, &mut Seats<'_>) -> Result<Transports> + Send + 'static,
    ) -> Result<Self> {
        crate::stats::set_copy_pool_probe(same_host::copy_pool_queued);
        let poller = Poller::new().map_err(|e| Error::os("creating the engine's poller", e))?;
        let waker = poller.waker();
        let (tx, rx) = mpsc::channel();
        let (ready_tx, ready_rx) = mpsc::sync_channel::<Result<Arc<Drive>>>(1);
        let (agent_name, self_tx, w2) = (name.clone(), tx.clone(), waker.clone());
        let for_core = tuning.metrics.clone();
        let n = NEXT_ENGINE.fetch_add(1, Ordering::Relaxed);
        let join = std::thread::Builder::new()
            .name(format!("nixl-engine-{n}"))
            .spawn(move || {
                let mut seats = Seats {
                    taken: 0,
                    tx: self_tx,
                    waker: w2,
                    poller: &poller,
                };
                let made = make(&agent_name, &mut seats).and_then(|(mut made, chain)| {
                    // Listed in the order of their seats: a transport's id is its place.
                    made.sort_by_key(|(id, _)| id.index());
                    let in_order = made.iter().enumerate().all(|(i, (id, _))| id.index() == i);
                    if !in_order || made.len() != seats.taken {
                        return Err(Error::InvalidArgument(
                            "every seat taken must get exactly one transport".into(),
                        ));
                    }
                    let transports = made.into_iter().map(|(_, t)| t).collect();
                    let mut core = EngineCore::new(transports, chain, tuning.progress_delay, Instant::now());
                    if let Some(m) = for_core {
                        core.record_into(m);
                    }
                    let exposures = !tuning.wait_spin.is_zero();
                    let drive = Drive::new(core, rx, &poller, tuning.callers_drive, exposures);
                    Ok(Arc::new(drive))
                });
                let drive = made.as_ref().ok().cloned();
                let _ = ready_tx.send(made);
                if let Some(drive) = drive {
                    driver::or_abort("the engine thread", || drive.run(poller));
                }
            })
            .map_err(|e| Error::os("spawning the engine thread", e))?;
        let thread = join.thread().id();
        let drive = ready_rx.recv().map_err(|_| Error::EngineStopped)??;
        Ok(Engine(Arc::new(Shared {
            tx,
            waker,
            join: Mutex::new(Some(join)),
            thread,
            name,
            next_op: AtomicU64::new(1),
            cancel_grace: tuning.cancel_grace,
            wait_spin: tuning.wait_spin,
            spinning: Arc::new(AtomicUsize::new(0)),
            drive,
            stop_wait: Mutex::new(STOP_WAIT),
            decoded: Mutex::new(DecodedCache::default()),
            decode,
            metrics: tuning.metrics,
        })))
    }

    pub(crate) fn name(&self) -> &str {
        &self.0.name
    }

    /// Where operations are recorded, if anywhere.
    pub(crate) fn metrics(&self) -> Option<&Metrics> {
        self.0.metrics.as_ref()
    }

    pub(crate) fn next_op(&self) -> OpId {
        self.0.next_op.fetch_add(1, Ordering::Relaxed)
    }

    /// Bounds the wait for copies still running when the engine ends (its last handle dropped)
    /// by `within`.
    pub(crate) fn set_stop_wait(&self, within: Duration) {
        *self.0.stop_wait.lock().recover() = within;
    }

    /// How long a dropped operation with borrowed memory waits before its transport is cut off.
    pub(crate) fn cancel_grace(&self) -> Duration {
        self.0.cancel_grace
    }

    /// Waits for `state`, an operation of this engine's moving `bytes` in all, to end, or for
    /// `timeout` (then [`Error::TimedOut`] naming `peer`).
    ///
    /// A small operation's wait first spins for up to its wait spin
    /// ([`ConnectorBuilder::wait_spin`](crate::ConnectorBuilder::wait_spin)): each turn looks at
    /// the status, drives the engine if it may (`driver`), yields its core (every turn, or at most
    /// once per [`Pace::turn_gap`](crate::pace::Pace::turn_gap) where it drove; see
    /// [`crate::pace`]) and yields to the runtime; then it parks. The engine's wake-up is
    /// registered on every turn, so a `block_on` inside a tokio task still sees the end.
    ///
    /// # Errors
    /// The operation's own error, [`Error::Cancelled`], or [`Error::TimedOut`].
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future gives back its place among the waits that spin (and the
    /// engine's turns, if it drove) and leaves the operation as it was.
    pub(crate) async fn wait(
        &self,
        state: &Arc<crate::state::OpState>,
        timeout: Option<Duration>,
        peer: Option<&str>,
        bytes: usize,
    ) -> Result<()> {
        wait::wait(self, state, timeout, peer, bytes).await
    }

    /// How long an operation's wait stays awake before it parks.
    pub(crate) fn wait_spin(&self) -> Duration {
        self.0.wait_spin
    }

    /// A place among this connector's waits that spin, if one is free: at most [`max_spinning`], so
    /// many waits cost a runtime turn each, not a `sched_yield`, and leave the engines their cores.
    pub(crate) fn spin_slot(&self) -> Option<SpinSlot> {
        let n = &self.0.spinning;
        n.fetch_update(Ordering::AcqRel, Ordering::Acquire, |k| {
            (k < max_spinning()).then_some(k + 1)
        })
        .ok()?;
        let drive = &self.0.drive;
        Some(SpinSlot {
            spinning: n.clone(),
            drives: drive.enter().then(|| drive.clone()),
            finished: false,
        })
    }

    /// Who drove this engine how: the driver's counters (see `driver`), for tests.
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn drive(&self) -> &Drive {
        &self.0.drive
    }

    /// Decodes a peer's published metadata with the publishing transport's decoder, cached.
    ///
    /// # Errors
    /// [`Error::Metadata`] for anything the publishing transport cannot read;
    /// [`Error::EngineStopped`] in a child of `fork()`.
    pub(crate) fn decode(&self, md: &str) -> Result<PeerInfo> {
        if self.0.drive.forked() {
            // The cache's lock may have been held by a thread of the parent at the fork.
            return Err(Error::EngineStopped);
        }
        if let Some(d) = self.0.decoded.lock().recover().map.get(md) {
            return Ok(d.clone());
        }
        let d = (self.0.decode)(md)?;
        self.0.decoded.lock().recover().insert(&d);
        Ok(d)
    }

    /// Sends a command, and handles it on this thread if a caller may (see `driver`); otherwise
    /// wakes the engine. [`Error::EngineStopped`] in a child of `fork()`.
    pub(crate) fn send(&self, cmd: Cmd) -> Result<()> {
        if self.0.drive.forked() {
            // Nothing here would ever handle it: the operation would wait out its deadline.
            return Err(Error::EngineStopped);
        }
        let mine = self.0.drive.takes(&cmd) && std::thread::current().id() != self.0.thread;
        self.0.tx.send(cmd).map_err(|_| Error::EngineStopped)?;
        if !mine || !self.0.drive.drive() {
            self.0.waker.wake();
        }
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

    /// What each transport of the chain would do with an operation with `peer`, in order, up to
    /// the first that would take it ([`Cmd::Probe`]).
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future drops the answer.
    pub(crate) async fn probe(
        &self,
        peer: PeerInfo,
        write: bool,
        local: Device,
        remote: Device,
        bytes: u64,
    ) -> Result<Vec<Probed>> {
        self.call(|reply| Cmd::Probe {
            peer,
            write,
            local,
            remote,
            bytes,
            reply,
        })
        .await
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        if self.drive.forked() {
            // A child of `fork()` dropping a connector its parent made: the engine thread is the
            // parent's (joining it would wait forever, waking it would wake the parent's).
            std::mem::forget(self.join.get_mut().map_or(None, Option::take));
            return;
        }
        let within = *self.stop_wait.lock().recover();
        let _ = self.tx.send(Cmd::Shutdown { within });
        self.waker.wake();
        // Not on the engine thread, nor on a caller's thread in the middle of driving it (the
        // engine thread would wait for the lock this one holds): the engine then ends on its own.
        if std::thread::current().id() != self.thread && !driver::on_a_callers_turn() {
            if let Some(j) = self.join.lock().recover().take() {
                let _ = j.join();
            }
        }
    }
}

/// Binds the same-host socket for `base`, or for `base-<pid>-<k>` if another connector has it,
/// each advertising `id` ([`same_host::Identity::advertise`]); the name is `base` as given when no
/// socket can be had (nothing is advertised then, and no peer tries this connector's socket).
fn bind_unique(base: &str, id: &same_host::Identity) -> Result<(String, Option<same_host::Tracked>)> {
    for k in 0..64 {
        let name = match k {
            0 => id.advertise(base),
            k => id.advertise(&format!("{base}-{}-{k}", std::process::id())),
        };
        match same_host::listen(&name) {
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
