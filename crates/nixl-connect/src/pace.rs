//! Who waits how: every number that decides whether a thread spins, drives the engine or parks
//! ([`Pace`], one value: [`PACE`]), and the yields every spin of the crate makes (a small
//! operation's wait, the engine after an event, a kept copy thread, the Python module's wait at
//! the call). Why each rule is there: docs/decisions/0005-who-drives.md and
//! docs/decisions/0010-spins-on-an-oversubscribed-core.md; the benchmark row that carries each
//! number is named on its field, and docs/FIGURES.md, "Unproven on 16 cores", lists them all.
//!
//! Every spin yields its core through [`yield_core`] or [`yield_driving`], timed: beside a thread
//! that does not yield back, Linux returns it only after that thread's slice. The state is per
//! thread (a thread mostly stays on its core); `Seen` is the rule with no clock of its own.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// The numbers of the module doc, each with its docs/FIGURES.md row. Private: a connector's one
/// setting here is its wait spin ([`ConnectorBuilder::wait_spin`](crate::ConnectorBuilder::wait_spin)).
#[derive(Debug)]
pub(crate) struct Pace {
    hot_for: Duration,
    turn_gap: Duration,
    first_poll: Duration,
    drive_max: usize,
    /// The most bytes of a small operation. Row: "64 MiB".
    small: usize,
    /// A yield longer than this overran; yields further apart are not in a row. Row: "Beside CPU hogs".
    overrun: Duration,
    /// The balance of overrun yields (less quick ones) that turns a thread's spins off. Rows: "Beside
    /// CPU hogs", and "64 outstanding and 1,000 x 4 KiB" (which must not move).
    lost_to_stop: Duration,
    /// How long spins stay off after [`lost_to_stop`](Self::lost_to_stop), and how long an untouched
    /// balance is kept. Row: "Beside CPU hogs".
    off_for: Duration,
    /// A driving wait's spin whose last this many yields each ran another thread's turn ends: two
    /// threads spin on one core. Row: as [`shared_turn`](Self::shared_turn).
    shared_turns: u32,
    exposed_poll: Duration,
}

/// The crate's pace.
pub(crate) const PACE: Pace = Pace {
    hot_for: Duration::from_millis(2),
    turn_gap: Duration::from_micros(5),
    first_poll: Duration::from_micros(20),
    drive_max: 4,
    small: 64 << 10,
    overrun: Duration::from_micros(200),
    lost_to_stop: Duration::from_millis(20),
    off_for: Duration::from_secs(1),
    shared_turns: 8,
    exposed_poll: Duration::from_millis(5),
};

// A probe's balance (`lost_to_stop - hot_for`) must be a balance.
const _: () = assert!(PACE.hot_for().as_nanos() < PACE.lost_to_stop.as_nanos());

impl Pace {
    /// How long the engine thread and a kept copy thread stay awake (yielding) after their last
    /// event, and how long after a NIXL peer's last completion exposures are watched every hot
    /// turn. Row: "64 outstanding".
    pub(crate) const fn hot_for(&self) -> Duration {
        self.hot_for
    }

    /// A driving wait yields, and a caller's turn watches NIXL's exposures, at most once per this.
    /// Row: "4 KiB over TCP".
    pub(crate) const fn turn_gap(&self) -> Duration {
        self.turn_gap
    }

    /// How soon a polled transport that showed activity is polled again (the gap then doubles).
    /// Row: "1 MiB and 64 MiB over TCP".
    pub(crate) const fn first_poll(&self) -> Duration {
        self.first_poll
    }

    /// The most operations in flight for a caller to drive and the engine to stand down, and the
    /// most commands one caller's turn handles. Row: "64 outstanding".
    pub(crate) const fn drive_max(&self) -> usize {
        self.drive_max
    }

    /// How often NIXL is progressed while memory is registered but no operation is live (a peer
    /// may need this side to act). Row: "A connector's CPU while idle".
    pub(crate) const fn exposed_poll(&self) -> Duration {
        self.exposed_poll
    }

    /// While callers drive, the engine sleeps at most this long (a caller's turn within it counts
    /// as driving), and what a caller's turn leaves the engine is due no sooner:
    /// [`hot_for`](Self::hot_for). Row: "4 KiB".
    pub(crate) const fn stand_down(&self) -> Duration {
        self.hot_for
    }

    /// Whether `bytes` make a small operation: its wait may spin, drive the engine and post on a
    /// caller's turn. Row: "64 MiB".
    pub(crate) const fn small(&self, bytes: usize) -> bool {
        bytes <= self.small
    }

    /// A yield longer than this ran another thread's turn on this core (where a bare yield costs
    /// more, a driving wait's spin just ends sooner): [`turn_gap`](Self::turn_gap). Row: "4 KiB".
    const fn shared_turn(&self) -> Duration {
        self.turn_gap
    }

    /// A NIXL progress call longer than [`first_poll`](Self::first_poll) did work in UCX: twice in
    /// a row on the wall clock (one slow call is as often a preempted thread), or once in CPU time
    /// draining notifications while a writable is live. Rows: "A connector's CPU while idle", "1
    /// MiB and 64 MiB over TCP".
    pub(crate) const fn work(&self) -> Duration {
        self.first_poll
    }
}

/// What one thread's yields have shown: the rule, without a clock (times are passed in).
#[derive(Clone, Copy, Debug)]
struct Seen {
    /// Time lost in overrun yields, less the time of quick ones since.
    lost: Duration,
    /// When the last overrun yield ended, or the last time off will end.
    last: Option<Instant>,
    /// Until when spinning is off.
    off_until: Option<Instant>,
    /// The last yields in a row that each ran another thread's turn.
    shared: u32,
    /// When the last yield ended (yields further apart than an overrun are not in a row).
    last_yield: Option<Instant>,
}

impl Seen {
    const NEW: Seen = Seen {
        lost: Duration::ZERO,
        last: None,
        off_until: None,
        shared: 0,
        last_yield: None,
    };

    /// Whether spinning is on at `now` (clearing a time off that is over).
    fn on(&mut self, now: Instant) -> bool {
        match self.off_until {
            Some(t) if now < t => false,
            _ => {
                self.off_until = None;
                true
            }
        }
    }

    /// Whether the spin that made the last yields should end because another thread spins on the
    /// same core: [`Pace::shared_turns`] yields in a row ran its turns. Counting starts anew.
    fn shares_core(&mut self) -> bool {
        let shared = self.shared >= PACE.shared_turns;
        if shared {
            self.shared = 0;
        }
        shared
    }

    /// Counts a yield that took `took` and ended `at`.
    fn yielded(&mut self, took: Duration, at: Instant) {
        let in_a_row = self
            .last_yield
            .is_some_and(|t| at.saturating_duration_since(t) <= PACE.overrun + took);
        self.last_yield = Some(at);
        self.shared = match (took > PACE.shared_turn(), in_a_row) {
            (true, true) => self.shared.saturating_add(1),
            (true, false) => 1,
            (false, _) => 0,
        };
        if took <= PACE.overrun {
            // Paid back to nothing, the core is free again.
            self.lost = self.lost.saturating_sub(took);
            return;
        }
        if self
            .last
            .is_some_and(|t| at.saturating_duration_since(t) > PACE.off_for)
        {
            // The balance is forgotten; what the shared-turn rule keeps is not a balance.
            *self = Seen {
                shared: self.shared,
                last_yield: self.last_yield,
                ..Seen::NEW
            };
        }
        self.lost += took;
        self.last = Some(at);
        if self.lost >= PACE.lost_to_stop {
            let until = at + PACE.off_for;
            self.off_until = Some(until);
            self.last = Some(until);
            // The next spin probes: losing one engine spin's length turns spins off again (a
            // slice of a CPU-bound process, 4 ms at 250 Hz, does), while a burst of our own work
            // on the core (up to about 1.3 ms) does not.
            self.lost = PACE.lost_to_stop - PACE.hot_for();
        }
    }
}

thread_local! {
    static SEEN: Cell<Seen> = const { Cell::new(Seen::NEW) };
}

/// Set by [`keep_spinning`]: spins never turn off, nor end beside another spinning thread.
static KEEP_SPINNING: AtomicBool = AtomicBool::new(false);

/// Whether a spin of this thread should start (or go on) now: false for [`Pace::off_for`] after
/// its overrun yields lost [`Pace::lost_to_stop`] more than its quick ones gave back. It reads the
/// clock only while spins are off.
pub(crate) fn worthwhile() -> bool {
    let mut seen = SEEN.get();
    if seen.off_until.is_none() || KEEP_SPINNING.load(Ordering::Relaxed) {
        return true;
    }
    let on = seen.on(Instant::now());
    SEEN.set(seen);
    on
}

/// Gives this thread's core away once (`sched_yield`), timed. Returns whether spinning is still
/// [`worthwhile`] (false: stop spinning). For the spins of threads that do the work (the engine's,
/// the copy pool's), which share cores with our other threads by design.
pub(crate) fn yield_core() -> bool {
    let mut seen = yield_timed();
    // Not this spin's rule: the count starts anew.
    seen.shared = 0;
    SEEN.set(seen);
    worthwhile()
}

/// [`yield_core`] for the spin of a wait that takes the engine's turns itself (the engine stands
/// down meanwhile), with the shared-turn rule: false also once this thread's last
/// [`Pace::shared_turns`] yields each ran another thread's turn on this core (this spin ends;
/// the next may start). Either way the caller stops spinning and parks.
pub(crate) fn yield_driving() -> bool {
    let mut seen = yield_timed();
    let shared = seen.shares_core() && !KEEP_SPINNING.load(Ordering::Relaxed);
    SEEN.set(seen);
    !shared && worthwhile()
}

/// One timed `sched_yield`, counted: this thread's state after it (not yet stored).
fn yield_timed() -> Seen {
    let start = Instant::now();
    std::thread::yield_now();
    let back = Instant::now();
    let mut seen = SEEN.get();
    seen.yielded(back.saturating_duration_since(start), back);
    seen
}

/// Makes every spin of this process go on as if no yield ever overran or ran another thread's
/// turn, for tests that check how spins behave and must not depend on how loaded the machine
/// running them is.
#[cfg(any(test, feature = "testing"))]
pub(crate) fn keep_spinning() {
    KEEP_SPINNING.store(true, Ordering::Relaxed);
}

#[cfg(test)]
mod tests;
