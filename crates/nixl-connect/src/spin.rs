//! Staying awake by yielding the core, and stopping while the host is oversubscribed.
//!
//! Several threads of this crate spin for a short while instead of sleeping, so that a small
//! operation pays no wake-up: the engine after an event, a kept copy thread after a copy, a wait
//! for an operation's end, and the Python module's wait at the call. Each turn of such a spin
//! gives its core away once (`sched_yield`), so that a thread of ours sharing the core runs.
//!
//! That is cheap while the host has a core to spare: a yield comes back within microseconds. On
//! an oversubscribed host it is not. Linux's scheduler (EEVDF) moves a yielding thread's deadline
//! a whole slice on, so a yield beside a thread that does not yield back (any CPU-bound process)
//! returns only after that thread's slice, up to a scheduler tick (4 ms at 250 Hz). A spin that
//! meant to save 30 us then costs milliseconds on every operation, and a thread that spins is
//! runnable, so a command sent to it meanwhile does not wake it either: it waits out the slice.
//! Measured on the 2-core VM beside two `yes` processes: a Python exposure took 4.0 ms (the
//! median) where it took 29 us alone, and 43 us under the same load with no spin at all.
//!
//! So every spin here yields through [`yield_core`], which times the yield. A yield that took
//! longer than [`YIELD_OVERRUN`] overran: some thread held the core meanwhile. That alone is no
//! reason to stop. A thread of our own doing work on that core overruns yields too (the engine
//! handling 64 operations or 1,000 descriptors: 0.2 to 1.3 ms on the 2-core VM, a few times a
//! second), and a spin that ended there would cost those benchmarks a third of their speed, as a
//! first version that stopped after three overruns within 100 ms did. What marks an
//! oversubscribed core is how much of the time its yields lose: once overrun yields of one thread
//! have lost [`LOST_TO_STOP`] within [`OVERRUN_WINDOW`] (a fifth of it; beside a CPU-bound process
//! each yield loses a whole slice, so that takes five yields at 250 Hz), [`worthwhile`] says no on
//! that thread for [`CONTENDED_FOR`]. Its spins then sleep (or hand their wait to the event loop)
//! at once and are woken as after a spin that ran out; after that time its next spin tries again.
//! A host that stays oversubscribed costs each spinning thread about two percent of a core's
//! time a second in lost slices (what it would lose anyway beside the hogs); a thread that
//! stops being oversubscribed spins again within a second.
//!
//! The state is per thread: a core is what a yield finds busy, and a thread mostly stays on its
//! core, while another thread of the process may have one to itself.

use std::cell::Cell;
use std::time::{Duration, Instant};

/// A yield that takes longer than this gave the core to a thread that did not give it back soon
/// (a yield to our own spinning threads, or with a core to spare, takes a few microseconds).
pub const YIELD_OVERRUN: Duration = Duration::from_micros(200);

/// How long one thread's overrun yields may take within [`OVERRUN_WINDOW`] before its spins stop.
pub const LOST_TO_STOP: Duration = Duration::from_millis(20);

/// The time over which a thread's overrun yields are added up.
pub const OVERRUN_WINDOW: Duration = Duration::from_millis(100);

/// How long a thread's spins stay off once its yields lost [`LOST_TO_STOP`] within
/// [`OVERRUN_WINDOW`].
pub const CONTENDED_FOR: Duration = Duration::from_secs(1);

/// What this thread's yields have shown.
#[derive(Clone, Copy)]
struct Seen {
    /// What the overrun yields since `since` took, together.
    lost: Duration,
    /// When the first overrun counted in `lost` ended.
    since: Option<Instant>,
    /// Until when spinning is off on this thread.
    off_until: Option<Instant>,
}

thread_local! {
    static SEEN: Cell<Seen> = const {
        Cell::new(Seen {
            lost: Duration::ZERO,
            since: None,
            off_until: None,
        })
    };
}

/// Whether a spin of this thread should start (or go on) now: false for [`CONTENDED_FOR`] after
/// its overrun yields lost [`LOST_TO_STOP`] within [`OVERRUN_WINDOW`]. It reads the clock only
/// then.
pub fn worthwhile() -> bool {
    let seen = SEEN.get();
    match seen.off_until {
        None => true,
        Some(t) if Instant::now() < t => false,
        Some(_) => {
            SEEN.set(Seen {
                off_until: None,
                ..seen
            });
            true
        }
    }
}

/// Gives this thread's core away once (`sched_yield`), as a spinning thread's turn does, and
/// times it. Returns whether spinning is still [`worthwhile`]: false when this yield's overrun
/// turned this thread's spins off, and the caller should stop spinning.
pub fn yield_core() -> bool {
    let start = Instant::now();
    std::thread::yield_now();
    let back = Instant::now();
    let took = back.saturating_duration_since(start);
    if took <= YIELD_OVERRUN {
        return true;
    }
    note_overrun(back, took);
    worthwhile()
}

/// Records a yield of this thread that overran: it took `took` and ended `at`.
fn note_overrun(at: Instant, took: Duration) {
    let mut seen = SEEN.get();
    match seen.since {
        Some(t) if at.saturating_duration_since(t) <= OVERRUN_WINDOW => seen.lost += took,
        _ => {
            seen.since = Some(at);
            seen.lost = took;
        }
    }
    if seen.lost >= LOST_TO_STOP {
        seen = Seen {
            lost: Duration::ZERO,
            since: None,
            off_until: Some(at + CONTENDED_FOR),
        };
    }
    SEEN.set(seen);
}

#[cfg(test)]
mod tests {
    use super::*;

    // Each test runs on a thread of its own, so each sees its own state.

    #[test]
    fn spin_time_lost_within_a_window_turns_a_threads_spins_off_for_a_while() {
        assert!(worthwhile());
        let t0 = Instant::now();
        let burst = Duration::from_micros(700); // an engine of ours busy on the same core
        for _ in 0..(LOST_TO_STOP.as_micros() / burst.as_micros()) {
            note_overrun(t0, burst);
        }
        assert!(
            worthwhile(),
            "overruns that lost less than the bound turn nothing off"
        );
        // Overruns further apart than the window start the sum again.
        let later = t0 + OVERRUN_WINDOW + Duration::from_millis(1);
        note_overrun(later, burst);
        assert!(worthwhile(), "an overrun after the window starts a new sum");
        let slice = Duration::from_millis(4); // a CPU-bound process's slice at 250 Hz
        for _ in 1..(LOST_TO_STOP.as_micros() / slice.as_micros()) {
            note_overrun(later, slice);
        }
        assert!(worthwhile());
        note_overrun(later, slice);
        assert!(
            !worthwhile(),
            "{LOST_TO_STOP:?} lost within the window turns spinning off"
        );
        // Once the time is over, spinning is worthwhile again, and the sum starts from nothing.
        SEEN.set(Seen {
            off_until: Some(Instant::now()),
            ..SEEN.get()
        });
        assert!(worthwhile());
        note_overrun(Instant::now(), slice);
        assert!(worthwhile());
    }

    #[test]
    fn spin_yields_beside_a_hog_on_one_core_turn_spinning_off() {
        // A thread that never yields, held on the same core as this one: it runs out its slice
        // before each of our yields comes back.
        use nix::sched::{sched_getaffinity, sched_setaffinity, CpuSet};
        use nix::unistd::Pid;
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::Arc;
        let mine = sched_getaffinity(Pid::from_raw(0)).unwrap();
        let cpu = (0..CpuSet::count())
            .find(|&c| mine.is_set(c).unwrap_or(false))
            .unwrap();
        let mut one = CpuSet::new();
        one.set(cpu).unwrap();
        sched_setaffinity(Pid::from_raw(0), &one).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let hog = std::thread::spawn({
            let stop = stop.clone();
            move || {
                sched_setaffinity(Pid::from_raw(0), &one).unwrap();
                while !stop.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            }
        });
        let mut yields = 0;
        while worthwhile() && yields < 100_000 {
            yield_core();
            yields += 1;
        }
        stop.store(true, Ordering::Relaxed);
        hog.join().unwrap();
        sched_setaffinity(Pid::from_raw(0), &mine).unwrap();
        assert!(
            !worthwhile(),
            "{yields} yields beside a hog on one core never lost {LOST_TO_STOP:?} within {OVERRUN_WINDOW:?}"
        );
    }
}
