//! Staying awake by yielding the core, and stopping while the host is oversubscribed: the floor
//! under every spin of the crate (a small operation's wait, the engine after an event, a kept copy
//! thread, the Python module's wait at the call). Why each rule is there, and the benchmark rows
//! that carry it: docs/decisions/0010-spins-on-an-oversubscribed-core.md and
//! docs/decisions/0005-who-drives.md.
//!
//! - Every spin yields its core (`sched_yield`) through [`yield_core`], which times the yield:
//!   on a free core a yield returns within microseconds; beside a thread that does not yield back
//!   (any CPU-bound process) Linux's scheduler returns it only after that thread's slice.
//! - A yield that took longer than [`YIELD_OVERRUN`] overran. Each thread keeps a balance: an
//!   overrun adds the time it took, a quick yield takes its time off. A balance of
//!   [`LOST_TO_STOP`] turns the thread's spins off ([`worthwhile`] says no) for [`CONTENDED_FOR`],
//!   doubling (up to [`MAX_OFF`]) each time the probe that follows overruns again; quick yields
//!   that pay the balance back mean the core is free again. A balance untouched for
//!   [`FORGET_AFTER`] starts again from nothing. Our own threads' bursts of work overrun yields
//!   too, and do not turn spins off: what marks an oversubscribed core is yields that lose far
//!   more time than they give back, however often they run.
//! - Two threads spinning on one core run each other's turn at every yield, while another core
//!   may idle (the scheduler keeps a thread that ran within half a millisecond where it is). So
//!   the spin of a wait that drives the engine ends once its last [`SHARED_TURNS_TO_STOP`] yields
//!   in a row each took longer than [`SHARED_TURN`] ([`yield_driving`]): its thread parks and,
//!   woken, is placed on a free core. Such a wait yields at most once per [`YIELD_GAP`]. Other
//!   spins share cores with our own threads by design and do not end on this rule.
//!
//! The state is per thread: a core is what a yield finds busy, and a thread mostly stays on its
//! core. `Seen` is the rule with no clock or thread of its own, tested with made-up times.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// A yield that takes longer than this gave the core to a thread that did not give it back soon
/// (a yield to our own spinning threads, or with a core to spare, takes a few microseconds).
const YIELD_OVERRUN: Duration = Duration::from_micros(200);

/// The balance of a thread's overrun yields (less its quick ones) that turns its spins off.
const LOST_TO_STOP: Duration = Duration::from_millis(20);

/// How long a thread's spins first stay off once its balance reached [`LOST_TO_STOP`].
const CONTENDED_FOR: Duration = Duration::from_secs(1);

/// The longest a thread's spins stay off (the time off doubles each time a probe overruns).
const MAX_OFF: Duration = Duration::from_secs(8);

/// What a probe may lose before spins turn off again: above a burst of the engine's own work on
/// the same core (64 operations or 1,000 descriptors at once), below a slice of a CPU-bound
/// process (4 ms at 250 Hz).
const PROBE_ROOM: Duration = Duration::from_millis(2);

/// A balance whose last overrun (or time off) ended longer ago than this is forgotten.
const FORGET_AFTER: Duration = Duration::from_secs(5);

/// How often the spin of a wait that drives the engine gives its core away at most
/// ([`yield_driving`] once per this long; the turns between call no `sched_yield`). A yield is a
/// system call beside a turn of a few microseconds, and a waiter that drives a NIXL transfer
/// turns to serve and see it: the row that carries it is docs/FIGURES.md, "4 KiB over TCP"
/// (against raw NIXL, yielding every turn and every 5 us). A thread of ours that shares the core
/// waits for that long more at most.
pub(crate) const YIELD_GAP: Duration = Duration::from_micros(5);

/// A yield that took longer than this ran another thread's turn on this core (a yield with the
/// core to itself takes under a microsecond). Where a bare yield
/// costs more (a system call filter, nested virtualization), every spin ends after
/// [`SHARED_TURNS_TO_STOP`] yields, some 40 us into a wait's spin: a shorter spin, nothing
/// worse. A bar set from the thread's own quickest yield was not taken: a thread whose every
/// yield so far ran another's turn would set it too high.
const SHARED_TURN: Duration = Duration::from_micros(2);

/// Yields further apart than this are not in a row: the count of shared turns starts anew (a
/// spin's yields come every [`YIELD_GAP`] or so, and beside another spinner every 10-20 us).
const SHARED_RUN_GAP: Duration = Duration::from_micros(200);

/// A spin whose last this many yields each ran another thread's turn ends (see the module's
/// docs): two threads spinning on one core.
const SHARED_TURNS_TO_STOP: u32 = 8;

/// What one thread's yields have shown: the rule, without a clock (times are passed in).
#[derive(Clone, Copy, Debug)]
struct Seen {
    /// Time lost in overrun yields, less the time of quick ones since.
    lost: Duration,
    /// When the last overrun yield ended, or the last time off will end.
    last: Option<Instant>,
    /// Until when spinning is off.
    off_until: Option<Instant>,
    /// How long the next time off lasts.
    off_for: Duration,
    /// The last yields in a row that each ran another thread's turn.
    shared: u32,
    /// When the last yield ended (for [`SHARED_RUN_GAP`]).
    last_yield: Option<Instant>,
}

impl Seen {
    const NEW: Seen = Seen {
        lost: Duration::ZERO,
        last: None,
        off_until: None,
        off_for: CONTENDED_FOR,
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
    /// same core: [`SHARED_TURNS_TO_STOP`] yields in a row ran its turns. Counting starts anew.
    fn shares_core(&mut self) -> bool {
        let shared = self.shared >= SHARED_TURNS_TO_STOP;
        if shared {
            self.shared = 0;
        }
        shared
    }

    /// Counts a yield that took `took` and ended `at`.
    fn yielded(&mut self, took: Duration, at: Instant) {
        let in_a_row = self
            .last_yield
            .is_some_and(|t| at.saturating_duration_since(t) <= SHARED_RUN_GAP + took);
        self.last_yield = Some(at);
        self.shared = match (took > SHARED_TURN, in_a_row) {
            (true, true) => self.shared.saturating_add(1),
            (true, false) => 1,
            (false, _) => 0,
        };
        if took <= YIELD_OVERRUN {
            if !self.lost.is_zero() {
                self.lost = self.lost.saturating_sub(took);
                if self.lost.is_zero() {
                    // Paid back: the core is free again.
                    self.off_for = CONTENDED_FOR;
                }
            }
            return;
        }
        if self
            .last
            .is_some_and(|t| at.saturating_duration_since(t) > FORGET_AFTER)
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
        if self.lost >= LOST_TO_STOP {
            let until = at + self.off_for;
            self.off_until = Some(until);
            self.last = Some(until);
            self.off_for = (self.off_for * 2).min(MAX_OFF);
            // The next spin probes: one more slice lost turns spins off again, while a burst of
            // our own work on the core (up to about 1.3 ms) does not.
            self.lost = LOST_TO_STOP - PROBE_ROOM;
        }
    }
}

thread_local! {
    static SEEN: Cell<Seen> = const { Cell::new(Seen::NEW) };
}

/// Set by [`keep_spinning`]: spins never turn off, nor end beside another spinning thread.
static KEEP_SPINNING: AtomicBool = AtomicBool::new(false);

/// Whether a spin of this thread should start (or go on) now: false for [`CONTENDED_FOR`] after
/// its overrun yields lost [`LOST_TO_STOP`] more than its quick ones gave back. It reads the
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

/// Gives this thread's core away once (`sched_yield`), as a spinning thread's turn does, and
/// times it. Returns whether spinning is still [`worthwhile`]: false once this thread's yields
/// have lost enough to turn its spins off, and the caller should stop spinning. For the spins of
/// threads that do the work (the engine's, the copy pool's), which share cores with our other
/// threads by design.
pub(crate) fn yield_core() -> bool {
    let mut seen = yield_timed();
    // Not this spin's rule: the count starts anew.
    seen.shared = 0;
    SEEN.set(seen);
    worthwhile()
}

/// [`yield_core`] for the spin of a wait that takes the engine's turns itself (the engine stands
/// down meanwhile), with the shared-turn rule: false also once this thread's last
/// [`SHARED_TURNS_TO_STOP`] yields each ran another thread's turn on this core (this spin ends;
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
        assert!(!seen.on(at(4) + CONTENDED_FOR - Duration::from_millis(1)));
        // Each probe that overruns turns spins off for twice as long, up to MAX_OFF.
        let mut back = at(4) + CONTENDED_FOR;
        let mut off = CONTENDED_FOR;
        for _ in 0..6 {
            assert!(seen.on(back), "spinning comes back after {off:?}");
            seen.yielded(SLICE, back);
            assert!(!seen.on(back), "a probe that overruns turns spinning off again");
            off = (off * 2).min(MAX_OFF);
            assert!(!seen.on(back + off - Duration::from_millis(1)));
            back += off;
        }
        assert_eq!(off, MAX_OFF);
        // Quick yields that pay the balance back: the core is free, the time off starts anew.
        assert!(seen.on(back));
        for _ in 0..LOST_TO_STOP.as_micros() {
            seen.yielded(Duration::from_micros(1), back);
        }
        assert_eq!(seen.lost, Duration::ZERO);
        for _ in 0..5 {
            seen.yielded(SLICE, back);
        }
        assert!(!seen.on(back + CONTENDED_FOR - Duration::from_millis(1)));
        assert!(seen.on(back + CONTENDED_FOR));
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
        seen.yielded(YIELD_OVERRUN, t0);
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
        let back = t0 + CONTENDED_FOR;
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
        let later = t0 + FORGET_AFTER + Duration::from_millis(1);
        seen.yielded(SLICE, later);
        assert!(
            seen.on(later),
            "the overruns before {FORGET_AFTER:?} no longer count"
        );
        assert_eq!(seen.lost, SLICE);
        // A time off counts as recent until it ends: the probe after it is not forgiven.
        for _ in 0..4 {
            seen.yielded(SLICE, later);
        }
        assert!(!seen.on(later));
        let probe = later + CONTENDED_FOR;
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
        for i in 1..SHARED_TURNS_TO_STOP {
            seen.yielded(turn, t0);
            assert!(!seen.shares_core(), "{i} shared turns");
        }
        seen.yielded(turn, t0);
        assert!(
            seen.shares_core(),
            "{SHARED_TURNS_TO_STOP} shared turns end the spin"
        );
        assert!(seen.on(t0), "spinning itself stays on: the next spin starts");
        assert!(!seen.shares_core(), "counting starts anew");
        // One yield with the core to itself breaks the run.
        for _ in 1..SHARED_TURNS_TO_STOP {
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
        for i in 0..SHARED_TURNS_TO_STOP {
            seen.yielded(Duration::from_micros(10), t1 + Duration::from_micros(20) * i);
        }
        assert!(seen.shares_core());
    }

    #[test]
    fn spin_two_spinning_threads_on_one_core_end_a_spin() {
        // Two threads held on one core, each spinning until its spin ends: one of them ends it
        // by the shared-turn rule (its spins stay on), long before spins could turn off.
        use nix::sched::sched_setaffinity;
        use nix::unistd::Pid;
        use std::sync::Arc;

        let _one = ONE_CORE.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let (_, one) = first_core();
        let stop = Arc::new(AtomicBool::new(false));
        let spinner = |stop: Arc<AtomicBool>| {
            std::thread::spawn(move || {
                sched_setaffinity(Pid::from_raw(0), &one).unwrap();
                let deadline = Instant::now() + Duration::from_secs(10);
                let mut yields = 0u32;
                while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                    // A turn's work between yields, as a waiter's (a turn that drives takes
                    // 1.5-2.5 us on the 2-core VM, and a wait yields every `YIELD_GAP`): so a
                    // yield that runs the other thread's turn takes more than two switches.
                    let turn = Instant::now() + YIELD_GAP;
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
            ended.iter().all(|&(yields, _)| yields >= SHARED_TURNS_TO_STOP),
            "a spin ended before {SHARED_TURNS_TO_STOP} yields: {ended:?}"
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
