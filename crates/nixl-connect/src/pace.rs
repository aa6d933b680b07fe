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
mod tests {
    use super::*;

    const SLICE: Duration = Duration::from_millis(4); // a CPU-bound process's slice at 250 Hz
    const OVERRUN: Duration = PACE.overrun;
    const LOST_TO_STOP: Duration = PACE.lost_to_stop;
    const OFF_FOR: Duration = PACE.off_for;
    const SHARED_TURN: Duration = PACE.shared_turn();
    const SHARED_TURNS: u32 = PACE.shared_turns;
    const TURN_GAP: Duration = PACE.turn_gap();

    /// Held by the tests that pin threads to this process's first core, one at a time.
    static ONE_CORE: std::sync::Mutex<()> = std::sync::Mutex::new(());

    /// The cores this thread may use, and the first of them alone.
    fn first_core() -> (nix::sched::CpuSet, nix::sched::CpuSet) {
        use nix::sched::{sched_getaffinity, CpuSet};
        let cores = sched_getaffinity(nix::unistd::Pid::from_raw(0)).unwrap();
        let cpu = (0..CpuSet::count())
            .find(|&c| cores.is_set(c).unwrap_or(false))
            .unwrap();
        let mut one = CpuSet::new();
        one.set(cpu).unwrap();
        (cores, one)
    }

    #[test]
    fn spin_overruns_beside_a_hog_turn_spins_off_however_far_apart() {
        let t0 = Instant::now();
        let mut seen = Seen::NEW;
        // One slice lost per operation, at 0.1 s from each other: the fifth turns spins off.
        let at = |i: u32| t0 + Duration::from_millis(100) * i;
        for i in 0..4 {
            seen.yielded(SLICE, at(i));
            assert!(seen.on(at(i)), "{} ms lost", (i + 1) * 4);
        }
        seen.yielded(SLICE, at(4));
        assert!(!seen.on(at(4)), "{LOST_TO_STOP:?} lost turns spinning off");
        assert!(!seen.on(at(4) + OFF_FOR - Duration::from_millis(1)));
        // Each probe that overruns turns spins off again, for as long, even one that comes a
        // little after the time off ended (the time off counts as recent until it ends).
        let late = OFF_FOR + Duration::from_millis(1);
        let mut back = at(4) + late;
        for _ in 0..6 {
            assert!(seen.on(back), "spinning comes back after {OFF_FOR:?}");
            seen.yielded(SLICE, back);
            assert!(!seen.on(back), "a probe that overruns turns spinning off again");
            assert!(!seen.on(back + OFF_FOR - Duration::from_millis(1)));
            back += late;
        }
        // Quick yields that pay the balance back: the core is free, and the balance starts anew.
        assert!(seen.on(back));
        for _ in 0..LOST_TO_STOP.as_micros() {
            seen.yielded(Duration::from_micros(1), back);
        }
        assert_eq!(seen.lost, Duration::ZERO);
        seen.yielded(SLICE, back);
        assert!(seen.on(back), "paid back: one lost slice is no probe's");
        for _ in 0..4 {
            seen.yielded(SLICE, back);
        }
        assert!(!seen.on(back + OFF_FOR - Duration::from_millis(1)));
        assert!(seen.on(back + OFF_FOR));
    }

    #[test]
    fn spin_our_own_busy_threads_turn_nothing_off() {
        // The engine busy on the same core: a 0.7 ms overrun now and then, between many quick
        // yields (a few microseconds each) that give the time back.
        let t0 = Instant::now();
        let mut seen = Seen::NEW;
        for i in 0..1_000u32 {
            let at = t0 + Duration::from_millis(10) * i;
            seen.yielded(Duration::from_micros(700), at);
            for _ in 0..300 {
                seen.yielded(Duration::from_micros(3), at);
            }
            assert!(seen.on(at), "overrun {i}: {:?} lost", seen.lost);
        }
        // Yields that overrun by less than the bound are quick.
        seen.yielded(OVERRUN, t0);
        assert_eq!(seen.lost, Duration::ZERO);
    }

    #[test]
    fn spin_a_probe_survives_our_own_bursts() {
        // Spins turned off once (a hog came and went); then only the engine's own bursts.
        let t0 = Instant::now();
        let mut seen = Seen::NEW;
        for _ in 0..5 {
            seen.yielded(SLICE, t0);
        }
        let back = t0 + OFF_FOR;
        assert!(seen.on(back));
        // The longest burst measured first, then bursts as long as the median measured, each
        // among as many quick yields as a thread that spins a tenth of the time makes.
        seen.yielded(Duration::from_micros(1_300), back);
        assert!(seen.on(back));
        for _ in 0..300 {
            seen.yielded(Duration::from_micros(3), back);
        }
        for i in 0..1_000u32 {
            let at = back + Duration::from_millis(10) * i;
            seen.yielded(Duration::from_micros(700), at);
            for _ in 0..300 {
                seen.yielded(Duration::from_micros(3), at);
            }
            assert!(seen.on(at), "burst {i}: {:?} lost", seen.lost);
        }
    }

    #[test]
    fn spin_an_old_balance_is_forgotten() {
        let t0 = Instant::now();
        let mut seen = Seen::NEW;
        for _ in 0..4 {
            seen.yielded(SLICE, t0);
        }
        let later = t0 + OFF_FOR + Duration::from_millis(1);
        seen.yielded(SLICE, later);
        assert!(seen.on(later), "the overruns before {OFF_FOR:?} no longer count");
        assert_eq!(seen.lost, SLICE);
        // A time off counts as recent until it ends: the probe after it is not forgiven.
        for _ in 0..4 {
            seen.yielded(SLICE, later);
        }
        assert!(!seen.on(later));
        let probe = later + OFF_FOR + Duration::from_millis(1);
        assert!(seen.on(probe));
        seen.yielded(SLICE, probe);
        assert!(!seen.on(probe));
    }

    #[test]
    fn spin_turn_for_turn_with_another_thread_ends_the_spin_not_spinning() {
        let t0 = Instant::now();
        let mut seen = Seen::NEW;
        // Another spinning thread's turn at each yield (ten microseconds on the 2-core VM).
        let turn = Duration::from_micros(10);
        for i in 1..SHARED_TURNS {
            seen.yielded(turn, t0);
            assert!(!seen.shares_core(), "{i} shared turns");
        }
        seen.yielded(turn, t0);
        assert!(seen.shares_core(), "{SHARED_TURNS} shared turns end the spin");
        assert!(seen.on(t0), "spinning itself stays on: the next spin starts");
        assert!(!seen.shares_core(), "counting starts anew");
        // One yield with the core to itself breaks the run.
        for _ in 1..SHARED_TURNS {
            seen.yielded(turn, t0);
        }
        seen.yielded(Duration::from_nanos(400), t0);
        seen.yielded(turn, t0);
        assert!(!seen.shares_core());
        // Yields as long as the bound are not shared turns.
        let mut quick = Seen::NEW;
        for _ in 0..1_000 {
            quick.yielded(SHARED_TURN, t0);
            assert!(!quick.shares_core());
        }
        assert_eq!(quick.lost, Duration::ZERO);
    }

    #[test]
    fn spin_shared_turns_far_apart_are_not_in_a_row() {
        // Long yields a millisecond apart (other spins, or a wait's other turns) are not two
        // spinners alternating: the count starts anew each time.
        let t0 = Instant::now();
        let mut seen = Seen::NEW;
        for i in 0..100u32 {
            seen.yielded(Duration::from_micros(10), t0 + Duration::from_millis(1) * i);
            assert!(!seen.shares_core(), "yield {i}");
        }
        // In a row again: 10 us turns every 20 us.
        let t1 = t0 + Duration::from_secs(1);
        for i in 0..SHARED_TURNS {
            seen.yielded(Duration::from_micros(10), t1 + Duration::from_micros(20) * i);
        }
        assert!(seen.shares_core());
    }

    /// One of this thread's cores that no other thread runs on now, alone, if there is one: a
    /// thread held on it yields 200 times, and a yield that takes over half a millisecond gave the
    /// core to a thread that was waiting for it (another process's, or another test's).
    fn quiet_core() -> Option<nix::sched::CpuSet> {
        use nix::sched::{sched_getaffinity, sched_setaffinity, CpuSet};
        use nix::unistd::Pid;
        let cores = sched_getaffinity(Pid::from_raw(0)).unwrap();
        (0..CpuSet::count())
            .filter(|&c| cores.is_set(c).unwrap_or(false))
            .map(|c| {
                let mut one = CpuSet::new();
                one.set(c).unwrap();
                one
            })
            .find(|&one| {
                std::thread::spawn(move || {
                    sched_setaffinity(Pid::from_raw(0), &one).unwrap();
                    (0..200).all(|_| {
                        let t = Instant::now();
                        std::thread::yield_now();
                        t.elapsed() < Duration::from_micros(500)
                    })
                })
                .join()
                .unwrap()
            })
    }

    #[test]
    fn spin_two_spinning_threads_on_one_core_end_a_spin() {
        // Two threads held on one core, each spinning until its spin ends: one of them ends it
        // by the shared-turn rule (its spins stay on), long before spins could turn off. On a
        // core where a third thread also runs, turning spins off is the right answer (see
        // `spin_yields_beside_a_hog_on_one_core_turn_spinning_off`): the test needs a core the
        // two have to themselves.
        use nix::sched::sched_setaffinity;
        use nix::unistd::Pid;
        use std::sync::Arc;

        let _one = ONE_CORE.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(one) = quiet_core() else {
            eprintln!("skipped: every core of this process runs another thread now (a busy host)");
            return;
        };
        let stop = Arc::new(AtomicBool::new(false));
        let spinner = |stop: Arc<AtomicBool>| {
            std::thread::spawn(move || {
                sched_setaffinity(Pid::from_raw(0), &one).unwrap();
                let deadline = Instant::now() + Duration::from_secs(10);
                let mut yields = 0u32;
                while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                    // A turn's work between yields, as a waiter's (a turn that drives takes
                    // 1.5-2.5 us on the 2-core VM, and a wait yields every `turn_gap`): so a
                    // yield that runs the other thread's turn takes more than two switches.
                    let turn = Instant::now() + TURN_GAP;
                    while Instant::now() < turn {
                        std::hint::spin_loop();
                    }
                    yields += 1;
                    if !yield_driving() {
                        stop.store(true, Ordering::Relaxed);
                        return Some((yields, worthwhile()));
                    }
                }
                None
            })
        };
        let (a, b) = (spinner(stop.clone()), spinner(stop.clone()));
        let ended: Vec<_> = [a.join().unwrap(), b.join().unwrap()]
            .into_iter()
            .flatten()
            .collect();
        assert!(!ended.is_empty(), "neither spin ended in 10 s beside the other");
        assert!(
            ended.iter().all(|&(yields, _)| yields >= SHARED_TURNS),
            "a spin ended before {SHARED_TURNS} yields: {ended:?}"
        );
        assert!(
            ended.iter().any(|&(_, on)| on),
            "a spin ended with spins turned off, not by the shared-turn rule: {ended:?}"
        );
    }

    #[test]
    fn spin_yields_beside_a_hog_on_one_core_turn_spinning_off() {
        // A thread that never yields, held on the same core as this one: it runs out its slice
        // before our yields come back.
        use nix::sched::{sched_setaffinity, CpuSet};
        use nix::unistd::Pid;
        use std::sync::Arc;

        /// Stops the hog and gives this thread its cores back, on every path out of the test.
        struct Hog {
            stop: Arc<AtomicBool>,
            thread: Option<std::thread::JoinHandle<()>>,
            cores: CpuSet,
        }
        impl Drop for Hog {
            fn drop(&mut self) {
                self.stop.store(true, Ordering::Relaxed);
                if let Some(t) = self.thread.take() {
                    let _ = t.join();
                }
                let _ = sched_setaffinity(Pid::from_raw(0), &self.cores);
            }
        }

        let _one = ONE_CORE.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        assert!(worthwhile(), "a new thread spins");
        let (cores, one) = first_core();
        let stop = Arc::new(AtomicBool::new(false));
        let mut hog = Hog {
            stop: stop.clone(),
            thread: None,
            cores,
        };
        sched_setaffinity(Pid::from_raw(0), &one).unwrap();
        hog.thread = Some(std::thread::spawn(move || {
            if sched_setaffinity(Pid::from_raw(0), &one).is_ok() {
                while !stop.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            }
        }));
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut yields = 0u64;
        while worthwhile() && Instant::now() < deadline {
            yield_core();
            yields += 1;
        }
        drop(hog);
        assert!(yields >= 1);
        assert!(
            !worthwhile(),
            "{yields} yields beside a hog on one core never lost {LOST_TO_STOP:?} on balance"
        );
    }
}
