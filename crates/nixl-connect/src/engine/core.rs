//! The engine's decisions, without its thread: every operation's bookkeeping, the transports'
//! schedules ([`Polling`]), the hand-over chain and the hold chain. [`EngineCore`] takes commands
//! and the time (`now`) and calls the transports through the seam ([`Transport`]: the publisher of
//! metadata first, and a chain that active operations try in turn). It never reads a clock, sleeps,
//! polls or receives (the [`driver`](super::driver) does), so its tests step it with a manual clock.
//!
//! **Caller turns.** A caller waiting for a small operation may drive the core on its own thread
//! ([`handle_as_caller`](EngineCore::handle_as_caller), [`turn_as_caller`](EngineCore::turn_as_caller)).
//! Such a turn touches only the transports a caller may drive ([`Transport::any_thread`]), but
//! for four things of another's that create no agent and register, load, prepare and free no memory:
//! - an exposure that is only bookkeeping ([`CallerPart::expose`]; else the command goes back);
//! - the bookkeeping of an exposure's end ([`CallerPart::unexpose`]);
//! - where callers reach it ([`let_callers_reach`](EngineCore::let_callers_reach)), a ready start
//!   ([`CallerPart::begin`]);
//! - a watch ([`CallerPart::watch`]), every turn or every [`Pace::turn_gap`](crate::pace::Pace::turn_gap).
//!
//! The rest is left to the engine thread ([`run_deferred`](EngineCore::run_deferred)), which stands
//! down only while callers' watches would see everything end ([`engine_bound`](EngineCore::engine_bound)).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::cmd::Cmd;
use super::poller::Ready;
#[cfg(doc)]
use super::transport::CallerPart;
use super::transport::{
    small, ActiveSpec, Decline, Event, Exposure, OpId, PassiveSpec, Polling, Transport, TransportId,
};
use crate::error::{Error, Result};
use crate::metrics::engine::EngineCell;
use crate::metrics::families::Metrics;
use crate::pace::PACE;
use crate::reg::{Hold, Range, RegToken};
use crate::state::{OpState, OperationStatus, TransferPath};
use crate::stats::EngineStats;

/// How long a dropped connector waits for its transports' work on memory (same-host copies end
/// within a chunk unless a peer stalls its pages) before it leaks the memory they may still write.
pub(crate) const STOP_WAIT: Duration = Duration::from_secs(10);
/// The longest back-off, by default, of a transport with work (transfers in flight, passive
/// operations waiting for a peer's completion) once the engine has gone idle: NIXL is progressed
/// at least this often then (Dynamo's `DYN_MM_NIXL_PROGRESS_DELAY_US` default, 1 ms).
pub(crate) const DEFAULT_PROGRESS_DELAY: Duration = Duration::from_millis(1);
/// The most peers [`EngineCore::warn_once`] remembers having warned of (past it, no more warnings:
/// a process that talks to this many peers on a slower path has been told).
const MAX_WARNED_PEERS: usize = 4096;
/// Completed operations' keys remembered, to refuse replaying their metadata.
const MAX_COMPLETED: usize = 65_536;
/// How often, at most, a busy engine publishes its counters to the metrics (an idle one
/// publishes before it sleeps).
const PUBLISH_GAP: Duration = Duration::from_millis(200);
/// What a debug build says when a caller's turn reaches what only the engine thread may do (a
/// command [`EngineCore::for_a_caller`] does not name, or more than a [`caller`](Transport::caller)
/// part).
const ENGINE_ONLY: &str = "a caller's turn reached what only the engine thread may do";

/// When a transport is progressed next, when its [`Polling`] asks for a schedule.
struct Schedule {
    gap: Duration,
    next: Instant,
}

/// Bookkeeping of one active operation in the engine.
struct Active {
    key: Arc<str>,
    state: Arc<OpState>,
    keep: Option<Hold>,
    /// The transport moving it, once started.
    on: TransportId,
}

/// What a caller's turn left to the engine thread (see the module's docs).
enum Deferred {
    /// An operation for a transport a caller may not drive (and whose [`CallerPart::begin`], if
    /// asked, handed it back): the chain's first, or the next after one declined it (why).
    Offer(ActiveSpec, TransportId, Option<Decline>),
    /// An ended exposure's key, for the transports a caller may not drive to forget.
    Unexpose(Arc<str>),
    /// An ended operation's adopted memory, to free.
    Free(Hold),
}

/// The engine's state and decisions (the thread, the poller and the channel are the driver's).
pub(crate) struct EngineCore {
    /// Every transport, the publisher of metadata first; exposures go to all of them in order.
    transports: Vec<Box<dyn Transport>>,
    /// Whether a caller may drive each transport ([`Transport::any_thread`]).
    drivable: Vec<bool>,
    /// Whether a caller's turn may begin operations on each transport it may not drive
    /// ([`CallerPart::starts`]).
    startable: Vec<bool>,
    /// Whether callers' turns may begin on and watch the transports they may not drive
    /// ([`let_callers_reach`](Self::let_callers_reach)).
    callers_reach: bool,
    /// True during a caller's turn.
    by_caller: bool,
    /// A caller's turn started an operation on a transport it may not drive since
    /// [`take_callers_started`](Self::take_callers_started).
    callers_started: bool,
    /// When callers' turns last watched each transport ([`CallerPart::watch`]).
    watched: Vec<Option<Instant>>,
    /// True during a caller's turn that may watch (see [`turn_as_caller`](Self::turn_as_caller)).
    watching: bool,
    /// Callers' watches that saw something (for tests that check they do).
    #[cfg(any(test, feature = "testing"))]
    watch_events: u64,
    /// Operations callers' turns started on a transport they may not drive (for tests).
    #[cfg(any(test, feature = "testing"))]
    caller_starts: u64,
    /// What callers' turns left to the engine thread, in order.
    deferred: Vec<Deferred>,
    schedules: Vec<Schedule>,
    /// The longest back-off of a transport with work once the engine is idle (progress delay).
    max_park: Duration,
    /// Active operations try these transports in turn.
    chain: Vec<TransportId>,
    /// Active operations each transport completed (for the counters).
    completions: Vec<u64>,
    actives: HashMap<OpId, Active>,
    passives: HashMap<Arc<str>, Arc<OpState>>,
    events: Vec<Event>,
    /// The ready descriptors of the transport being progressed (kept to reuse its allocation).
    mine: Vec<(u64, u32)>,
    /// Keys of this connector's completed active operations (most recent [`MAX_COMPLETED`]).
    completed: HashSet<Arc<str>>,
    completed_order: VecDeque<Arc<str>>,
    /// The peers warned of a faster path's decline (once each, at most [`MAX_WARNED_PEERS`]).
    warned: HashSet<Arc<str>>,
    /// Owned memory of ended exposures that a transport may still be writing (a same-host copy):
    /// handed to the transports' hold only once the operation's memory is released.
    copying: Vec<(Arc<OpState>, u64, Hold, usize)>,
    /// [`Cmd::Settle`] replies, sent at the end of the turn that took them.
    settles: Vec<oneshot::Sender<()>>,
    /// Where figures go, if anywhere.
    recording: Option<Recording>,
}

/// An engine's part of a connector's metrics.
struct Recording {
    metrics: Metrics,
    cell: Arc<EngineCell>,
    published: Option<Instant>,
}

impl EngineCore {
    /// Callers' watches that saw something.
    #[cfg(any(test, feature = "testing"))]
    pub(super) fn watch_events(&self) -> u64 {
        self.watch_events
    }

    /// Operations callers' turns started on a transport a caller may not drive.
    #[cfg(any(test, feature = "testing"))]
    pub(super) fn caller_starts(&self) -> u64 {
        self.caller_starts
    }

    /// A core over `transports` (the publisher of metadata first) whose active operations try
    /// the positions in `chain` in turn, each transport due at `now`.
    pub(crate) fn new(
        mut transports: Vec<Box<dyn Transport>>,
        chain: Vec<TransportId>,
        max_park: Duration,
        now: Instant,
    ) -> Self {
        Self {
            max_park,
            drivable: transports.iter().map(|t| t.any_thread()).collect(),
            startable: transports
                .iter_mut()
                .map(|t| t.caller().is_some_and(|c| c.starts()))
                .collect(),
            callers_reach: false,
            by_caller: false,
            callers_started: false,
            watched: vec![None; transports.len()],
            watching: false,
            #[cfg(any(test, feature = "testing"))]
            watch_events: 0,
            #[cfg(any(test, feature = "testing"))]
            caller_starts: 0,
            deferred: Vec::new(),
            schedules: transports
                .iter()
                .map(|_| Schedule {
                    gap: PACE.first_poll(),
                    next: now,
                })
                .collect(),
            completions: vec![0; transports.len()],
            transports,
            chain,
            actives: HashMap::new(),
            passives: HashMap::new(),
            events: Vec::new(),
            mine: Vec::new(),
            completed: HashSet::new(),
            completed_order: VecDeque::new(),
            warned: HashSet::new(),
            copying: Vec::new(),
            settles: Vec::new(),
            recording: None,
        }
    }

    /// Lets callers' turns begin operations on and watch the transports a caller may not drive, or
    /// not (the default): where the connector's waits spin (not the Python module's, whose turns
    /// hold the GIL).
    pub(crate) fn let_callers_reach(&mut self, reach: bool) {
        self.callers_reach = reach;
    }

    /// Records this engine's counters and fallbacks into `metrics` from now on.
    pub(crate) fn record_into(&mut self, metrics: Metrics) {
        self.recording = Some(Recording {
            cell: metrics.engine_cell(),
            metrics,
            published: None,
        });
    }

    /// The counters every transport keeps, summed.
    fn stats(&self) -> EngineStats {
        let mut s = EngineStats::default();
        for (t, n) in self.transports.iter().zip(&self.completions) {
            t.add_stats(&mut s, *n);
        }
        s
    }

    /// Publishes the counters to the metrics when `now` is [`PUBLISH_GAP`] past the last time,
    /// or always when `force` (before the engine sleeps, and at its end).
    pub(crate) fn publish(&mut self, now: Instant, force: bool) {
        let Some(r) = &self.recording else { return };
        let due = r
            .published
            .is_none_or(|t| now.saturating_duration_since(t) >= PUBLISH_GAP);
        if force || due {
            let s = self.stats();
            if let Some(r) = &mut self.recording {
                r.cell.publish(&s);
                r.published = Some(now);
            }
        }
    }

    /// Progresses every transport that is due: on every turn ([`Polling::EveryTurn`]), by its
    /// schedule (from [`Pace::first_poll`](crate::pace::Pace::first_poll) apart after activity,
    /// backing off), or for its own `ready` descriptors. Returns whether anything happened.
    fn progress(&mut self, now: Instant, hot: bool, ready: &[Ready]) -> bool {
        let mut event = false;
        let mut mine = std::mem::take(&mut self.mine);
        // Transports driven by the poller go first, so their ready descriptors are handled before
        // a scheduled poll of another transport adds its time to this turn.
        for driven_pass in [true, false] {
            for (i, (t, s)) in self.transports.iter_mut().zip(&mut self.schedules).enumerate() {
                if self.by_caller && !self.drivable[i] {
                    // The engine thread's, but for a watch (every `Pace::turn_gap`, or every turn
                    // while `Busy`), so a driving waiter sees a NIXL peer's completion itself.
                    let watched = &mut self.watched[i];
                    let due =
                        t.polling() == Polling::Busy || watched.is_none_or(|w| now >= w + PACE.turn_gap());
                    if self.watching && !driven_pass && due {
                        *watched = Some(now);
                        let saw = t.caller().is_some_and(|c| c.watch(&mut self.events));
                        #[cfg(any(test, feature = "testing"))]
                        {
                            self.watch_events += u64::from(saw);
                        }
                        event |= saw;
                    }
                    continue;
                }
                let polling = t.polling();
                if (polling == Polling::EveryTurn) != driven_pass {
                    continue;
                }
                mine.clear();
                mine.extend(ready.iter().filter_map(|r| r.of(i)));
                let due = !mine.is_empty()
                    || match polling {
                        Polling::EveryTurn => true,
                        Polling::Never => t.has_pending(),
                        Polling::Busy if hot => true,
                        _ => now >= s.next || t.has_pending(),
                    };
                if !due {
                    continue;
                }
                let active = t.progress(&mine, &mut self.events);
                event |= active;
                s.gap = match polling {
                    _ if active => PACE.first_poll(),
                    Polling::Watching if hot => PACE.turn_gap(),
                    _ if t.did_work() => PACE.first_poll(),
                    Polling::Every(t) => (s.gap * 2).min(t.max(self.max_park)),
                    _ => (s.gap * 2).min(self.max_park),
                };
                s.next = now + s.gap;
            }
        }
        self.mine = mine;
        event
    }

    /// How long the loop may sleep: until the earliest scheduled transport is due (`None`: until
    /// woken).
    pub(crate) fn sleep_for(&self, now: Instant) -> Option<Duration> {
        self.transports
            .iter()
            .zip(&self.schedules)
            .filter(|(t, _)| !matches!(t.polling(), Polling::Never | Polling::EveryTurn))
            .map(|(_, s)| s.next.saturating_duration_since(now))
            .min()
    }

    /// Makes every transport due at `now` (after a command or other sign of activity, so that
    /// what it started is progressed at once).
    pub(crate) fn wake_all(&mut self, now: Instant) {
        for s in &mut self.schedules {
            s.gap = PACE.first_poll();
            s.next = now;
        }
    }

    /// One turn at `now`: hands the memory of stopped copies on, progresses the transports that
    /// are due (`hot`: the engine was active within the driver's spin; `ready`: the poller's ready
    /// descriptors), applies what they reported and answers the turn's settles. Returns whether
    /// anything happened.
    pub(crate) fn turn(&mut self, now: Instant, hot: bool, ready: &[Ready]) -> bool {
        // Memory of ended exposures goes on to the holds (NIXL's among them) on the engine's
        // turns only.
        let releases = !self.by_caller && !self.copying.is_empty();
        if releases {
            self.release_copied();
        }
        let mut event = self.progress(now, hot, ready);
        if releases {
            self.release_copied();
        }
        event |= self.apply();
        for reply in self.settles.drain(..) {
            let _ = reply.send(());
        }
        event
    }

    /// A caller's turn (see the module's docs): [`turn`](Self::turn), hot, over the transports
    /// a caller may drive; `watch`: it may also watch the others ([`CallerPart::watch`]), every
    /// turn while [`Polling::Busy`], else every [`Pace::turn_gap`](crate::pace::Pace::turn_gap).
    pub(crate) fn turn_as_caller(&mut self, now: Instant, ready: &[Ready], watch: bool) -> bool {
        self.by_caller = true;
        self.watching = watch;
        let event = self.turn(now, true, ready);
        self.watching = false;
        self.by_caller = false;
        event
    }

    /// True for the commands a driving caller may handle on its own thread: a small operation's
    /// ([`Pace::small`](crate::pace::Pace::small)) over host memory [`Cmd::Begin`] and
    /// [`Cmd::Expose`] (which may still come back: [`handle_as_caller`](Self::handle_as_caller)),
    /// and an exposure's end that hands no memory on ([`Cmd::Unexpose`] without `keep`). The rest
    /// may free memory a Python object owns, or is the engine thread's for another reason.
    pub(crate) fn for_a_caller(cmd: &Cmd) -> bool {
        match cmd {
            Cmd::Begin { spec } => cmd.host_only() && small(&spec.local),
            Cmd::Expose { spec, .. } => cmd.host_only() && small(&spec.ranges),
            Cmd::Unexpose { keep, .. } => keep.is_none(),
            _ => false,
        }
    }

    /// Handles a command [`for_a_caller`](Self::for_a_caller) on a caller's thread, when
    /// [`callers_may_begin`](Self::callers_may_begin). Returns it, with nothing done, when it
    /// needs the engine thread after all ([`CallerPart::expose`] declined).
    pub(crate) fn handle_as_caller(&mut self, cmd: Cmd) -> Option<Cmd> {
        debug_assert!(Self::for_a_caller(&cmd) && self.callers_may_begin());
        self.by_caller = true;
        let back = match cmd {
            Cmd::Expose { spec, reply } => self.expose(spec, reply),
            cmd => {
                self.handle(cmd);
                None
            }
        };
        self.by_caller = false;
        back
    }

    /// Exposes a passive operation's memory on every transport, in order, and answers `reply`.
    /// On a caller's turn, only where the first is the one transport a caller may not drive
    /// ([`CallerPart::expose`]): if it declines, nothing was done and the command comes back.
    fn expose(&mut self, spec: PassiveSpec, reply: oneshot::Sender<Result<Exposure>>) -> Option<Cmd> {
        if self.by_caller && !self.drivable.iter().skip(1).all(|&d| d) {
            return Some(Cmd::Expose { spec, reply });
        }
        let mut out = Exposure::default();
        let mut r = Ok(());
        for (t, &drivable) in self.transports.iter_mut().zip(&self.drivable) {
            let done = if self.by_caller && !drivable {
                // The first transport (checked above): nothing was done yet.
                match t.caller().and_then(|c| c.expose(&spec, &mut out)) {
                    Some(done) => done,
                    None => return Some(Cmd::Expose { spec, reply }),
                }
            } else {
                t.expose(&spec, &mut out)
            };
            if let Err(e) = done {
                r = Err(e);
                break;
            }
        }
        match r {
            Ok(()) => {
                self.passives.insert(spec.key.clone(), spec.state.clone());
                if let Err(Ok(_)) = reply.send(Ok(out)) {
                    // The caller's future is gone: nobody has the metadata; end it here.
                    self.end_passive(&spec.key);
                }
            }
            Err(e) => {
                self.end_passive(&spec.key);
                let _ = reply.send(Err(e));
            }
        }
        None
    }

    /// True when a caller may begin an operation: the chain's first transport is one a caller
    /// may drive, or may begin on ([`CallerPart::starts`], where callers reach it).
    pub(crate) fn callers_may_begin(&self) -> bool {
        let first = self.chain[0].index();
        self.drivable[first] || (self.callers_reach && self.startable[first])
    }

    /// True when what is in flight needs the engine thread (it must not stand down): deferred
    /// work, or an active operation whose end callers' watches would not see
    /// ([`CallerPart::sees_every_end`]). Looks at every active operation: for few in flight.
    pub(crate) fn engine_bound(&mut self) -> bool {
        !self.deferred.is_empty()
            || self.actives.values().any(|a| {
                let i = a.on.index();
                let callers_see_it_end = self.drivable[i]
                    || (self.callers_reach
                        && self.transports[i].caller().is_some_and(|c| c.sees_every_end()));
                !callers_see_it_end
            })
    }

    /// The engine thread's part of what callers' turns left (see the module's docs), in the
    /// order they left it: hand-overs, exposures forgotten, memory freed.
    pub(crate) fn run_deferred(&mut self) {
        debug_assert!(!self.by_caller);
        for d in std::mem::take(&mut self.deferred) {
            match d {
                Deferred::Offer(spec, i, why) => self.offer_settled(spec, i, why),
                Deferred::Unexpose(key) => {
                    for (t, drivable) in self.transports.iter_mut().zip(&self.drivable) {
                        if !drivable {
                            t.unexpose(&key);
                        }
                    }
                }
                Deferred::Free(keep) => drop(keep),
            }
        }
    }

    /// True when an ended exposure's memory waits only for the engine's turn to go on to the
    /// holds (its copy stopped during a caller's turn).
    pub(crate) fn copies_released(&self) -> bool {
        self.copying.iter().any(|(st, ..)| st.is_released())
    }

    /// True when callers' turns left the engine thread an operation to begin: the engine should
    /// run now (the rest of what they leave waits for its next turn).
    pub(crate) fn hand_over_deferred(&self) -> bool {
        self.deferred.iter().any(|d| matches!(d, Deferred::Offer(..)))
    }

    /// True (once) when a caller's turn started an operation on a transport a caller may not
    /// drive ([`CallerPart::begin`]) since the last call.
    pub(crate) fn take_callers_started(&mut self) -> bool {
        std::mem::take(&mut self.callers_started)
    }

    /// True when callers' turns left the engine thread work ([`run_deferred`](Self::run_deferred)).
    pub(crate) fn has_deferred(&self) -> bool {
        !self.deferred.is_empty()
    }

    /// True when a transport has work that its next progress would pick up.
    pub(crate) fn transports_pending(&self) -> bool {
        self.transports.iter().any(|t| t.has_pending())
    }

    /// True when the engine records figures ([`record_into`](Self::record_into)).
    pub(crate) fn records(&self) -> bool {
        self.recording.is_some()
    }

    /// Operations in flight: active ones begun and not yet released, passive ones exposed.
    pub(crate) fn in_flight(&self) -> usize {
        self.actives.len() + self.passives.len()
    }

    /// True when a transport has work that its next progress would pick up, or a caller's turn
    /// left work to the engine thread: the driver must not sleep.
    pub(crate) fn has_pending(&self) -> bool {
        self.has_deferred() || self.transports_pending()
    }

    /// Ends everything: operations still waiting learn the engine is gone; the transports (and
    /// their agents) are destroyed, which ends every transfer; then held memory is freed.
    ///
    /// Copies still running (a peer stalls the pages they read) are waited for up to `within`;
    /// past it their memory is leaked, never freed under them.
    pub(crate) fn shutdown(mut self, within: Duration) {
        // The counters as they end (the transports are gone below); the gauges leave with the
        // engine.
        let cell = self.recording.take().map(|r| r.cell);
        if let Some(c) = &cell {
            c.publish(&self.stats());
        }
        for (_, st) in self.passives.drain() {
            st.finish(OperationStatus::Errored, Some(Error::EngineStopped));
        }
        let mut actives: Vec<Active> = self.actives.drain().map(|(_, a)| a).collect();
        for a in &actives {
            a.state
                .finish(OperationStatus::Errored, Some(Error::EngineStopped));
        }
        let EngineCore {
            mut transports,
            copying,
            ..
        } = self;
        // Every transport is asked to stop (none skipped: each must stop touching memory).
        let stopped = transports
            .iter_mut()
            .fold(true, |all, t| t.stop(Some(within)) & all);
        if stopped {
            drop(copying);
        } else {
            // A peer stalls the pages a copy reads (nothing interrupts that copy): the memory it
            // writes is never freed. Every operation is gone (each holds the engine), so this is
            // owned memory only: the exposures' kept here, the abandoned reads' below.
            tracing::error!(
                "transfers still running {within:?} after the connector was dropped (a peer \
                 stalls its pages): leaking the memory they may write"
            );
            std::mem::forget(copying);
            for a in &mut actives {
                std::mem::forget(a.keep.take());
            }
        }
        // In reverse order: the publisher of metadata (NIXL: destroying its agents ends every
        // transfer, then frees the memory it held back) goes last.
        transports.into_iter().rev().for_each(drop);
        for a in actives {
            drop(a.keep);
            a.state.mark_released();
        }
        if let Some(c) = cell {
            c.end();
        }
    }

    /// Acts on one command ([`Cmd::Shutdown`] is the driver's: nothing here). On the engine
    /// thread, what callers' turns left must have run first ([`run_deferred`](Self::run_deferred)):
    /// an operation's cancel must find it where its deferred hand-over put it.
    pub(crate) fn handle(&mut self, cmd: Cmd) {
        debug_assert!(
            self.by_caller || self.deferred.is_empty(),
            "a command handled before the work callers' turns left"
        );
        match cmd {
            Cmd::Expose { spec, reply } => {
                let back = self.expose(spec, reply);
                debug_assert!(back.is_none(), "the engine thread exposes whatever it takes");
            }
            Cmd::Unexpose { key, gen, keep } => {
                let state = self.passives.get(&key).cloned();
                self.end_passive(&key);
                if let Some((k, bytes)) = keep {
                    match state {
                        // A same-host copy into it stops within one chunk; its memory goes on to
                        // the hold (which may free it at once, if its exposer is gone) after that.
                        Some(st) if !st.is_released() => self.copying.push((st, gen, k, bytes)),
                        _ => self.hold(gen, k, bytes),
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
                            agent: spec.peer.name.to_string(),
                            refusal: crate::error::Refusal::AlreadyCompleted,
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
                        state,
                        keep: None,
                        on: self.chain[0],
                    },
                );
                self.offer_settled(spec, self.chain[0], None);
            }
            Cmd::Abandon { id, hard } => {
                debug_assert!(!self.by_caller, "{ENGINE_ONLY}");
                if let Some(a) = self.actives.get(&id) {
                    self.transports[a.on.index()].abandon(id, hard, &mut self.events);
                }
            }
            Cmd::Adopt { id, keep } => match self.actives.get_mut(&id) {
                Some(a) => a.keep = Some(keep),
                None => drop(keep), // already released
            },
            Cmd::Mail { to, msg } => {
                debug_assert!(!self.by_caller, "{ENGINE_ONLY}");
                if let Some(t) = self.transports.get_mut(to.index()) {
                    t.on_mail(msg);
                }
            }
            Cmd::Register { ranges, reply } => {
                debug_assert!(!self.by_caller, "{ENGINE_ONLY}");
                let _ = reply.send(self.preregister(&ranges));
            }
            #[cfg(any(test, feature = "testing"))]
            Cmd::Settle { reply } => self.settles.push(reply),
            Cmd::Stats { reply } => {
                let _ = reply.send(self.stats());
            }
            Cmd::Probe {
                peer,
                write,
                local,
                remote,
                bytes,
                reply,
            } => {
                debug_assert!(!self.by_caller, "{ENGINE_ONLY}");
                let mut answers = Vec::new();
                for i in &self.chain {
                    let t = &mut self.transports[i.index()];
                    let r = t.probe(&peer, write, local, remote, bytes);
                    let takes = r.is_ok();
                    answers.push((t.path(), r.map_err(|d| d.to_string())));
                    if takes {
                        break;
                    }
                }
                let _ = reply.send(answers);
            }
            Cmd::Shutdown { .. } => {}
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
                self.hold(gen, keep, bytes);
            } else {
                i += 1;
            }
        }
    }

    fn end_passive(&mut self, key: &Arc<str>) {
        self.passives.remove(key);
        let mut deferred = false;
        for (t, &drivable) in self.transports.iter_mut().zip(&self.drivable) {
            if self.by_caller && !drivable {
                if let Some(c) = t.caller() {
                    c.unexpose(key);
                }
                deferred = true;
            } else {
                t.unexpose(key);
            }
        }
        if deferred {
            self.deferred.push(Deferred::Unexpose(key.clone()));
        }
    }

    /// Hands memory given up after it was exposed (by the exposure of generation `gen`) to the
    /// first transport that must hold it until no peer can reach it; freed here if none must.
    fn hold(&mut self, gen: u64, mut keep: Hold, bytes: usize) {
        debug_assert!(!self.by_caller, "{ENGINE_ONLY}");
        for t in &mut self.transports {
            match t.hold(gen, keep, bytes) {
                Some(k) => keep = k,
                None => return,
            }
        }
    }

    /// Registers `ranges` with every transport that registers memory, ahead of its transfers.
    fn preregister(&mut self, ranges: &[Range]) -> Result<Vec<RegToken>> {
        let mut tokens = Vec::new();
        for t in &mut self.transports {
            tokens.extend(t.preregister(ranges)?);
        }
        Ok(tokens)
    }

    /// [`offer`](Self::offer)s `spec`, then [`settle`](Self::settle)s what the transports decided at
    /// once, keeping its registrations with the operation's memory.
    fn offer_settled(&mut self, spec: ActiveSpec, i: TransportId, why: Option<Decline>) {
        let id = spec.id;
        self.offer(spec, i, why);
        let tokens = self.settle(id);
        if let Some(a) = self.actives.get(&id).filter(|_| !tokens.is_empty()) {
            a.state.keep_tokens(tokens);
        }
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
    fn hand_over(&mut self, spec: ActiveSpec, reason: Decline) {
        let on = self.actives.get(&spec.id).map_or(self.chain[0], |a| a.on);
        let next = self
            .chain
            .iter()
            .position(|&t| t == on)
            .and_then(|p| self.chain.get(p + 1).copied());
        let from = self.transports[on.index()].path();
        let to = next.map(|n| self.transports[n.index()].path());
        if let Some(r) = &self.recording {
            r.metrics.fallback(Some(from), to);
            r.metrics.declined(from, reason.why());
        }
        if let Some(to) = to {
            spec.state.set_declined(&reason.to_string());
            self.warn_once(&spec.peer.name, from, to, &reason);
        }
        match next {
            Some(next) => self.offer(spec, next, Some(reason)),
            None => self
                .events
                .push(Event::ended(spec.id, Err(reason.into_error(&spec.peer.name)))),
        }
    }

    /// Warns, the first time for `peer` (a NIXL agent's name), that its operations take the
    /// slower path `to` because `from` declined one, and why: what a user must see before asking
    /// why a transfer is slow. Each operation's own reason is its `path_reason()`.
    fn warn_once(&mut self, peer: &Arc<str>, from: TransferPath, to: TransferPath, why: &Decline) {
        // A busy peer is a moment's: its decline uses up no warning a lasting reason would need.
        if why.expected
            || why.busy()
            || self.warned.len() >= MAX_WARNED_PEERS
            || !self.warned.insert(peer.clone())
        {
            return;
        }
        tracing::warn!(
            %peer, %from, %to, reason = %why,
            "an operation with this peer takes the {to} path: the {from} path declined it ({why}); \
             further operations with this peer are not reported here (see each operation's \
             path_reason)"
        );
    }

    /// Offers `spec` to transport `i` of the chain (after another declined it with `why`).
    fn offer(&mut self, spec: ActiveSpec, i: TransportId, why: Option<Decline>) {
        let id = spec.id;
        if spec.state.status().is_terminal() {
            // Cancelled before any transport took it: nothing touched the memory.
            self.events.push(Event::ended(id, Err(Error::Cancelled)));
            return;
        }
        if self.by_caller && !self.drivable[i.index()] {
            // The engine thread's to call, but for a start the transport can make on a caller's
            // turn (`CallerPart::begin`); else the operation waits for the engine (which the
            // driver wakes at once: `hand_over_deferred`).
            if !(self.callers_reach && self.startable[i.index()]) {
                self.deferred.push(Deferred::Offer(spec, i, why));
                return;
            }
            let span = spec.state.span().cloned();
            let was = self.actives.get_mut(&id).map(|a| std::mem::replace(&mut a.on, i));
            let back = {
                let _entered = span.as_ref().map(tracing::Span::enter);
                match self.transports[i.index()].caller() {
                    Some(c) => c.begin(spec, &mut self.events),
                    None => Some(spec),
                }
            };
            match back {
                Some(spec) => {
                    // Not taken: the operation stays where it was until the engine offers it.
                    if let (Some(a), Some(was)) = (self.actives.get_mut(&id), was) {
                        a.on = was;
                    }
                    self.deferred.push(Deferred::Offer(spec, i, why));
                }
                None => {
                    debug_assert!(
                        self.events.iter().any(|e| matches!(
                            e,
                            Event::PathTaken { id: i, .. } | Event::ActiveEnded { id: i, .. } if *i == id
                        )),
                        "a transport took an operation on a caller's turn and said nothing of it"
                    );
                    self.callers_started = true;
                    #[cfg(any(test, feature = "testing"))]
                    {
                        self.caller_starts += 1;
                    }
                    if let Some(why) = why {
                        log_offer(span.as_ref(), id, &why, self.transports[i.index()].path());
                    }
                }
            }
            return;
        }
        if let Some(a) = self.actives.get_mut(&id) {
            a.on = i;
        }
        if let Some(why) = &why {
            log_offer(spec.state.span(), id, why, self.transports[i.index()].path());
        }
        // The transport's own events about the operation go in its span.
        let span = spec.state.span().cloned();
        let _entered = span.as_ref().map(tracing::Span::enter);
        self.transports[i.index()].begin(spec, &mut self.events);
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
                            self.completions[a.on.index()] += 1;
                            self.remember_completed(a.key.clone());
                        }
                        // Released before the status is final: a waiter woken by the status may
                        // take the memory back at once. Adopted memory (its owner may be a
                        // Python object) is freed on the engine's turn, never a caller's.
                        match a.keep {
                            Some(keep) if self.by_caller => self.deferred.push(Deferred::Free(keep)),
                            keep => drop(keep),
                        }
                        a.state.mark_released();
                        match result {
                            Ok(()) => a.state.finish(OperationStatus::Complete, None),
                            Err(Error::Cancelled) => a.state.finish(OperationStatus::Cancelled, None),
                            Err(e) => a.state.finish(OperationStatus::Errored, Some(e)),
                        };
                    }
                    // Every transport forgets the key before the status is final: a waiter woken
                    // by it (or its peer, told at once) may replay the metadata, which must find
                    // nothing exposed (core_passive_end_unexposes_before_any_waiter_sees_it). On
                    // a caller's turn, those a caller may not drive (NIXL) forget it there too
                    // (`CallerPart::unexpose`), and do the rest on the engine's next turn: a late
                    // notification finds no passive operation, and NIXL's registration outlives
                    // the exposure anyway unless the connector deregisters on completion, where
                    // callers never drive.
                    Event::PassiveCompleted { key, path } => {
                        if let Some(st) = self.passives.get(&key).cloned() {
                            self.end_passive(&key);
                            st.set_path(path);
                            st.finish(OperationStatus::Complete, None);
                        }
                    }
                    Event::PassiveFailed { key, error } => {
                        if let Some(st) = self.passives.get(&key).cloned() {
                            self.end_passive(&key);
                            st.finish(OperationStatus::Errored, Some(error));
                        }
                    }
                    Event::Declined { spec, reason } => self.hand_over(spec, reason),
                    Event::PathTaken { id, path } => {
                        if let Some(a) = self.actives.get(&id) {
                            a.state.set_path(path);
                        }
                    }
                    // Tokens of an operation whose caller is no longer waiting: the transport
                    // keeps its own while it needs them.
                    Event::Registered { .. } => {}
                }
            }
        }
        any
    }
}

/// Says that operation `id` went on to the path `to` after another declined it (`why`).
fn log_offer(span: Option<&tracing::Span>, id: OpId, why: &Decline, to: TransferPath) {
    match span {
        Some(sp) => sp.in_scope(|| tracing::debug!(%why, %to, "declined; offered to the next path")),
        None => tracing::trace!(op = id, %why, %to, "offered to the next transport"),
    }
}

#[cfg(test)]
mod tests;
