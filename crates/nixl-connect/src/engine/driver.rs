//! Who drives the engine: its own thread, or a caller waiting for a small operation.
//!
//! The engine's state ([`Driven`]) sits behind one lock, and whoever holds it drives; every decision
//! is still the core's. The engine thread sleeps in `epoll` ([`Poller`]); after any event it spins
//! for [`Pace::hot_for`](crate::pace::Pace::hot_for) so that back-to-back operations pay no wake-up
//! (unless the host is oversubscribed, see [`crate::pace`], or callers drive); an idle connector
//! costs no CPU.
//!
//! A caller drives ([`Drive::drive`]) only while the engine sleeps and few operations are in flight
//! ([`Pace::drive_max`](crate::pace::Pace::drive_max)): right after it sends a command (so a small
//! operation starts with no wake-up), and on each turn of a small operation's wait spin (so its
//! frames are read where the answer is awaited). While a wait spins, the engine stands down: it
//! does not spin beside the caller, and its sleep no longer sees the sockets ([`Gate`]), so a frame
//! the caller will read wakes nobody. On a 2-core host that takes each process from two spinning
//! threads to one (docs/decisions/0005-who-drives.md).
//!
//! What a caller's turn may touch is the core's ([`EngineCore::turn_as_caller`],
//! [`EngineCore::for_a_caller`]); a transfer it posted is progressed by the wait that follows, or
//! the engine is woken ([`Drive::attend`]). Callers never drive:
//! - a connector that has seen device memory (CUDA's current context is a thread's);
//! - one that starts on NIXL where its waits do not spin, or where NIXL has a non-UCX backend;
//! - one that deregisters memory on completion (that must come before the status is final);
//! - a child of `fork()` (the epoll instances are the parent's too);
//! - with `cuda`, one started where whether CUDA works is not yet known (`Transport::any_thread`).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::cmd::Cmd;
use super::core::{EngineCore, STOP_WAIT};
use super::poller::{Alarm, DriverPoll, Gate, Poller, Ready, Waker};
use crate::pace::{self, PACE};
use crate::sync::Recover;

thread_local! {
    /// Set while this thread takes a caller's turn of an engine.
    static CALLER_TURN: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// True while this thread takes a caller's turn of an engine: a connector's last handle dropped
/// on one does not wait for its engine thread (which would wait for the lock this one holds).
pub(crate) fn on_a_callers_turn() -> bool {
    CALLER_TURN.get()
}

/// Marks this thread as taking a caller's turn until dropped (then as it was before: a turn
/// that drives another connector's engine inside one keeps the outer mark).
struct CallerTurn(bool);

impl Drop for CallerTurn {
    fn drop(&mut self) {
        CALLER_TURN.set(self.0);
    }
}

/// The engine's state, held by whoever drives.
pub(crate) struct Driven {
    core: EngineCore,
    rx: Receiver<Cmd>,
    /// A command taken from the channel that must be handled before the rest.
    pending: Option<Cmd>,
    /// Set once [`Cmd::Shutdown`] (or the last handle's drop) was seen: how long copies may take.
    stop: Option<Duration>,
    /// A driving caller's look at the sockets.
    poll: DriverPoll,
    ready: Vec<Ready>,
    /// Something happened since the counters were last published with force.
    unpublished: bool,
}

/// What the engine thread and driving callers share.
pub(crate) struct Drive {
    /// `None` once the engine thread has ended.
    state: Mutex<Option<Driven>>,
    waker: Waker,
    gate: Gate,
    /// Operations in flight at the last turn, whoever took it.
    busy: AtomicUsize,
    /// False once the connector has handled a command over device memory, and from the start
    /// where callers never drive (see the module's docs).
    host_only: AtomicBool,
    /// [`sys::forks`](crate::sys::forks) when the engine started: a child of `fork()` (which shares
    /// its parent's epoll instances) does not drive.
    image: u64,
    /// Turns callers have taken (for tests that check that callers drive).
    turns: AtomicU64,
    /// Commands callers have handled on their turns (for tests that check which).
    commands: AtomicU64,
    /// Whether callers make small exposures ([`EngineCore::for_a_caller`]): only where the
    /// connector's small waits spin, and so drive; else the engine thread makes them.
    callers_expose: bool,
    /// A caller's turn with no wait driving started a NIXL transfer: until the engine's next turn,
    /// a wait that will not drive wakes it ([`attend`](Self::attend)).
    unattended: AtomicBool,
    /// When the sleeping engine wakes on its own, in nanoseconds from `epoch` (`u64::MAX`: not
    /// before something wakes it); written under the lock before it sleeps.
    planned: AtomicU64,
    /// When a caller last took a turn (or a wait that will drive began), in nanoseconds from
    /// `epoch`: the engine stands down only while callers actually drive.
    last_driven: AtomicU64,
    epoch: Instant,
    alarm: Alarm,
    /// When the alarm rings, in nanoseconds from `epoch` (`u64::MAX`: not armed since the engine
    /// last woke); its lock orders the settings, which only bring it forward between two wakes.
    alarm_at: Mutex<u64>,
}

impl Drive {
    /// The engine's state, before its thread runs; `callers`: whether callers may drive it at
    /// all (false where the connector deregisters memory on completion).
    /// `exposures`: whether callers make small exposures (the connector's waits spin).
    pub(crate) fn new(
        mut core: EngineCore,
        rx: Receiver<Cmd>,
        poller: &Poller,
        callers: bool,
        exposures: bool,
    ) -> Self {
        // Where waits spin, callers' turns call into NIXL too: they watch it, and begin small
        // transfers on it (a NIXL-only connector's waits then drive).
        core.let_callers_reach(exposures);
        let callers = callers && core.callers_may_begin();
        Self {
            state: Mutex::new(Some(Driven {
                core,
                rx,
                pending: None,
                stop: None,
                poll: poller.driver_poll(),
                ready: Vec::new(),
                unpublished: true,
            })),
            waker: poller.waker(),
            gate: poller.gate(),
            busy: AtomicUsize::new(0),
            host_only: AtomicBool::new(callers),
            image: crate::sys::forks(),
            turns: AtomicU64::new(0),
            commands: AtomicU64::new(0),
            callers_expose: exposures,
            unattended: AtomicBool::new(false),
            planned: AtomicU64::new(u64::MAX),
            last_driven: AtomicU64::new(0),
            epoch: Instant::now(),
            alarm: poller.alarm(),
            alarm_at: Mutex::new(u64::MAX),
        }
    }

    /// `at` in nanoseconds from the epoch.
    fn nanos(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.epoch).as_nanos()).unwrap_or(u64::MAX - 1)
    }

    /// After a caller's turn: if it left work due before the sleeping engine would wake (a
    /// transport's deadline, counters to publish), the alarm brings its wake forward; while callers
    /// drive, the engine wakes within [`Pace::stand_down`](crate::pace::Pace::stand_down) (the
    /// sockets are out of its sleep).
    fn keep_the_engine_due(&self, d: &Driven, now: Instant) {
        let due = if self.gate.driven() {
            Some(PACE.stand_down())
        } else if d.pending.is_some() || d.core.transports_pending() {
            Some(Duration::ZERO)
        } else if d.core.has_deferred() || d.core.copies_released() {
            // An exposure for NIXL to forget, memory to free or hand on: within
            // `Pace::stand_down`, not now (a wake-up now would take the core from the caller
            // that is about to see its operation's end).
            Some(PACE.stand_down())
        } else if d.unpublished {
            // The counters are published when the engine goes idle: it must wake for that.
            Some(
                d.core
                    .sleep_for(now)
                    .map_or(PACE.stand_down(), |t| t.max(PACE.stand_down())),
            )
        } else {
            // What this turn started is driven by its wait: the transports' schedules may wait
            // `Pace::stand_down` (sooner would take a core from that wait for nothing).
            d.core.sleep_for(now).map(|t| t.max(PACE.stand_down()))
        };
        let Some(after) = due else { return };
        self.bring_forward(now, after);
    }

    /// Makes the sleeping engine wake `after` from `now` at the latest: sets the alarm if that is
    /// sooner than it would wake on its own and than the alarm rings already.
    fn bring_forward(&self, now: Instant, after: Duration) {
        let at = self.nanos(now + after);
        let mut armed = self.alarm_at.lock().recover();
        if at < self.planned.load(Ordering::SeqCst) && at < *armed {
            *armed = at;
            // From now: the turn that asked may have taken a while since its `now`.
            let left = at.saturating_sub(self.nanos(Instant::now()));
            self.alarm.set(Duration::from_nanos(left));
        }
    }

    fn lock(&self) -> MutexGuard<'_, Option<Driven>> {
        // A panic while driving aborts the process (`or_abort`): nobody who could go on sees a
        // poisoned lock.
        self.state.lock().recover()
    }

    /// True in a child of `fork()` of the process that started this engine (without its thread).
    pub(crate) fn forked(&self) -> bool {
        crate::sys::forks() != self.image
    }

    /// True when callers may drive this connector now: host memory only, in the process that
    /// started it.
    fn callers_may(&self) -> bool {
        self.host_only.load(Ordering::Acquire) && !self.forked()
    }

    /// Turns callers have taken of this engine.
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn turns(&self) -> u64 {
        self.turns.load(Ordering::Relaxed)
    }

    /// Callers' watches of transports they may not drive that saw something (a NIXL completion).
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn watch_events(&self) -> u64 {
        self.lock().as_ref().map_or(0, |d| d.core.watch_events())
    }

    /// Operations callers' turns started on a transport a caller may not drive (NIXL transfers
    /// they posted).
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn caller_starts(&self) -> u64 {
        self.lock().as_ref().map_or(0, |d| d.core.caller_starts())
    }

    /// Commands callers have handled on their turns of this engine.
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn commands(&self) -> u64 {
        self.commands.load(Ordering::Relaxed)
    }

    /// Waits that drive this engine now (that took the sockets out of its sleep).
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn driving_waits(&self) -> usize {
        self.gate.drivers()
    }

    /// A wait that will drive begins: the engine's sleep stops seeing the sockets. False (and
    /// nothing changed) when callers may not drive this connector.
    pub(crate) fn enter(&self) -> bool {
        if !self.callers_may() || self.busy.load(Ordering::Acquire) > PACE.drive_max() {
            return false;
        }
        self.gate.enter();
        // A wait that enters is about to drive: it counts as driving from now.
        let now = Instant::now();
        self.last_driven.store(self.nanos(now), Ordering::Release);
        // The engine may sleep without a deadline, and from now without the sockets: it must look
        // at them within `Pace::stand_down` even if this wait is never polled again (`planned`).
        self.bring_forward(now, PACE.stand_down());
        true
    }

    /// A wait that will not drive begins: if a caller's turn with no wait driving started a NIXL
    /// transfer (on the send's turn), the engine is woken now rather than at its alarm.
    pub(crate) fn attend(&self) {
        if self.unattended.swap(false, Ordering::AcqRel) {
            self.waker.wake();
        }
    }

    /// A wait that [`enter`](Self::enter)ed ends; `unfinished`: its operation goes on, and the
    /// engine is woken to take it over at once (it may sleep a whole `Pace::stand_down` else).
    pub(crate) fn leave(&self, unfinished: bool) {
        if self.forked() {
            // A child of `fork()` dropping a wait it inherited: the gate and the waker are the
            // parent's too.
            return;
        }
        self.gate.leave();
        if unfinished {
            self.waker.wake();
        }
    }

    /// One turn on the caller's thread (a wait's, or the one after its send) if the engine sleeps,
    /// few operations are in flight, only host memory was seen and nobody else drives. True if it
    /// took the turn. Never blocks.
    pub(crate) fn drive(&self) -> bool {
        let max = PACE.drive_max();
        if !self.callers_may() || self.busy.load(Ordering::Acquire) > max || !self.waker.is_sleeping() {
            return false;
        }
        let Ok(mut g) = self.state.try_lock() else {
            return false;
        };
        let Some(d) = g.as_mut() else { return false };
        // Again under the lock, which orders them: the engine may have handled device memory, or
        // taken more work, since the look above.
        if d.stop.is_some()
            || !self.host_only.load(Ordering::Acquire)
            || self.busy.load(Ordering::Acquire) > max
        {
            return false;
        }
        let _turn = CallerTurn(CALLER_TURN.replace(true));
        or_abort("a caller driving the engine", || self.driven_turn(d));
        true
    }

    /// Whether a caller's turn may handle `cmd`: [`EngineCore::for_a_caller`], and an exposure only
    /// where callers make them (see `callers_expose`).
    pub(crate) fn takes(&self, cmd: &Cmd) -> bool {
        EngineCore::for_a_caller(cmd) && (self.callers_expose || !matches!(cmd, Cmd::Expose { .. }))
    }

    /// A caller's turn: the commands it may handle, one look at the sockets, one caller turn of
    /// the core (see the module's docs).
    fn driven_turn(&self, d: &mut Driven) {
        let mut event = false;
        let mut handled = 0;
        while let Some(cmd) = d.pending.take().or_else(|| d.rx.try_recv().ok()) {
            let back = if !self.takes(&cmd) || handled == PACE.drive_max() {
                Some(cmd)
            } else {
                // An exposure NIXL must register or make metadata for comes back.
                d.core.handle_as_caller(cmd)
            };
            if let Some(cmd) = back {
                // The engine thread's: it is asleep (or about to be), so this wakes it, and the
                // lock goes back to it at once (no turn here).
                d.pending = Some(cmd);
                self.waker.wake();
                return;
            }
            handled += 1;
            self.commands.fetch_add(1, Ordering::Relaxed);
            event = true;
        }
        self.turns.fetch_add(1, Ordering::Relaxed);
        let now = Instant::now();
        self.last_driven.store(self.nanos(now), Ordering::Release);
        if event {
            d.core.wake_all(now);
        }
        d.poll.poll(&mut d.ready);
        // A turn watches NIXL only where the engine stands down for the waits that drive it (not
        // on the Python module's turns, taken with the GIL held).
        let watch = self.callers_expose && self.gate.driven();
        event |= d.core.turn_as_caller(now, &d.ready, watch);
        d.ready.clear();
        if d.core.take_callers_started() {
            // Posted here (on a send's turn, say): the wait that follows drives it, or wakes the
            // engine (`attend`).
            self.unattended.store(true, Ordering::Release);
        }
        self.busy.store(d.core.in_flight(), Ordering::Release);
        if event && d.core.records() {
            d.core.publish(now, false);
            d.unpublished = true;
        }
        if d.core.hand_over_deferred() {
            // An operation waits for the engine thread (its fallback to NIXL): now.
            self.waker.wake();
            return;
        }
        self.keep_the_engine_due(d, now);
    }

    /// The engine thread: runs until every handle is gone or [`Cmd::Shutdown`], then ends
    /// everything.
    pub(crate) fn run(&self, mut poller: Poller) {
        let mut last_event = Instant::now();
        let mut ready = Vec::new();
        loop {
            let mut g = self.lock();
            let Some(d) = g.as_mut() else { return };
            // What callers' turns left to this thread comes before the commands sent after it
            // (an operation's cancel, say).
            d.core.run_deferred();
            // This turn progresses what callers started.
            self.unattended.store(false, Ordering::Release);
            d.core.take_callers_started();
            let mut event = false;
            while let Some(cmd) = d.pending.take().or_else(|| next_cmd(&d.rx)) {
                if let Cmd::Shutdown { within } = cmd {
                    d.stop = Some(within);
                    break;
                }
                if !cmd.host_only() {
                    self.host_only.store(false, Ordering::Release);
                }
                d.core.handle(cmd);
                event = true;
            }
            if d.stop.is_some() {
                break;
            }
            let now = Instant::now();
            if event {
                d.core.wake_all(now);
            }
            // While the engine is hot: transfers in flight are progressed on every turn,
            // operations waiting for a completion every `Pace::turn_gap`; otherwise by the schedule.
            let hot = now.saturating_duration_since(last_event) < PACE.hot_for() && pace::worthwhile();
            event |= d.core.turn(now, hot, &ready);
            ready.clear();
            self.busy.store(d.core.in_flight(), Ordering::Release);
            if event {
                d.core.publish(now, false);
                d.unpublished = true;
                last_event = Instant::now();
                drop(g);
                poller.wait(Some(Duration::ZERO), &mut ready);
                continue;
            }
            // A caller drives while it waits: the engine stands down instead of spinning beside
            // it, while callers actually drive (not a wait no longer polled) and where they may.
            let stand_down = self.gate.driven()
                && d.core.in_flight() <= PACE.drive_max()
                && self.host_only.load(Ordering::Acquire)
                && !d.core.engine_bound()
                && self
                    .nanos(now)
                    .saturating_sub(self.last_driven.load(Ordering::Acquire))
                    < PACE.stand_down().as_nanos() as u64;
            if !stand_down && last_event.elapsed() < PACE.hot_for() && pace::worthwhile() {
                // Recently active: stay hot (yielding the core) so the next event needs no
                // wake-up; not while the host is oversubscribed (`pace::worthwhile`).
                drop(g);
                pace::yield_core();
                poller.wait(Some(Duration::ZERO), &mut ready);
                continue;
            }
            let now = Instant::now();
            if std::mem::take(&mut d.unpublished) {
                // Going idle: the counters as they stand.
                d.core.publish(now, true);
            }
            let mut timeout = d.core.sleep_for(now);
            poller.prepare_sleep();
            if d.core.has_pending() || d.pending.is_some() {
                poller.awake();
                continue;
            }
            if let Some(cmd) = next_cmd(&d.rx) {
                poller.awake();
                d.pending = Some(cmd);
                continue;
            }
            // Written before the gate is read: a wait that enters the gate after that read sees
            // when this sleep ends, and brings it forward (`enter`).
            self.planned.store(
                timeout.map_or(u64::MAX, |t| self.nanos(now + t)),
                Ordering::SeqCst,
            );
            if self.gate.driven() {
                // The sleep does not see the sockets: the engine wakes within `Pace::stand_down`
                // in case a driving wait is no longer polled; the rest of its schedule waits for
                // that wake (callers' turns serve it meanwhile, without losing their core).
                let cap = if stand_down {
                    PACE.stand_down()
                } else {
                    timeout.map_or(PACE.stand_down(), |t| t.min(PACE.stand_down()))
                };
                timeout = Some(cap);
                // When it wakes, exactly: a caller's turn compares its deadlines with it.
                self.planned.store(self.nanos(now + cap), Ordering::SeqCst);
            }
            if stand_down {
                // Back from standing down, the engine does not spin: the callers drove.
                last_event = now.checked_sub(PACE.hot_for()).unwrap_or(now);
            }
            drop(g);
            poller.wait(timeout, &mut ready);
            // Awake: what the alarm was set for is served by this turn.
            *self.alarm_at.lock().recover() = u64::MAX;
        }
        let ended = self.lock().take();
        if let Some(d) = ended {
            d.core.shutdown(d.stop.unwrap_or(STOP_WAIT));
        }
    }
}

/// The next command; a disconnected channel (every handle gone) reads as `Shutdown`.
fn next_cmd(rx: &Receiver<Cmd>) -> Option<Cmd> {
    match rx.try_recv() {
        Ok(c) => Some(c),
        Err(TryRecvError::Empty) => None,
        Err(TryRecvError::Disconnected) => Some(Cmd::Shutdown { within: STOP_WAIT }),
    }
}

/// Runs `f`; a panic in it aborts the process (`who` names the panicking thread): unwinding would
/// free memory that transfers, copies and peers may still use, and there is no sound way back.
pub(super) fn or_abort(who: &str, f: impl FnOnce()) {
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err() {
        eprintln!(
            "nixl-connect: {who} panicked; aborting, since transfers may still be using memory \
             that unwinding would free"
        );
        std::process::abort();
    }
}
