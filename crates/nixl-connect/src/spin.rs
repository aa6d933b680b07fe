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
//! So every spin here yields through [`yield_core`], which times the yield. One that took longer
//! than [`YIELD_OVERRUN`] ends the spin it was part of. [`OVERRUNS_TO_STOP`] of them on one thread
//! within [`OVERRUN_WINDOW`] mark that thread's core as oversubscribed for [`CONTENDED_FOR`]
//! (not "in a row": after a thread that does not yield has run out its slice, the scheduler
//! often hands a yielding thread's next yield straight back, so overruns alternate with quick
//! yields): while it is, [`worthwhile`] says no there, and the thread's spins sleep (or
//! hand their wait to the event loop) at once, woken as after a spin that ran out. After that time
//! its next spin tries again. A host that stays oversubscribed costs each spinning thread a few
//! slices a second; a single overrun (a thread of ours busy on the same core while a connector
//! starts, say) turns nothing off.
//!
//! The state is per thread: a core is what a yield finds busy, and a thread mostly stays on its
//! core, while another thread of the process may have one to itself.

use std::cell::Cell;
use std::time::{Duration, Instant};

/// A yield that takes longer than this gave the core to a thread that did not give it back soon
/// (a yield to our own spinning threads, or with a core to spare, takes a few microseconds).
pub const YIELD_OVERRUN: Duration = Duration::from_micros(200);

/// How many overrun yields within [`OVERRUN_WINDOW`] turn a thread's spins off.
pub const OVERRUNS_TO_STOP: u32 = 3;

/// The time within which [`OVERRUNS_TO_STOP`] overruns turn a thread's spins off.
pub const OVERRUN_WINDOW: Duration = Duration::from_millis(100);

/// How long a thread's spins stay off once its yields overran [`OVERRUNS_TO_STOP`] times within
/// [`OVERRUN_WINDOW`].
pub const CONTENDED_FOR: Duration = Duration::from_secs(1);

/// What this thread's yields have shown.
#[derive(Clone, Copy)]
struct Seen {
    /// Overrun yields since `since`.
    overruns: u32,
    /// When the first overrun counted in `overruns` ended.
    since: Option<Instant>,
    /// Until when spinning is off on this thread.
    off_until: Option<Instant>,
}

thread_local! {
    static SEEN: Cell<Seen> = const { Cell::new(Seen { overruns: 0, since: None, off_until: None }) };
}

/// Whether a spin of this thread should start (or go on) now: false for [`CONTENDED_FOR`] after
/// its yields overran [`OVERRUNS_TO_STOP`] times within [`OVERRUN_WINDOW`]. It reads the clock
/// only then.
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

/// Gives this thread's core away once (`sched_yield`), as a spinning thread's turn does. Returns
/// whether the core came back within [`YIELD_OVERRUN`]; if it did not, the caller should end its
/// spin (and after [`OVERRUNS_TO_STOP`] such yields within [`OVERRUN_WINDOW`], [`worthwhile`]
/// says no for a while).
pub fn yield_core() -> bool {
    let start = Instant::now();
    std::thread::yield_now();
    let back = Instant::now();
    if back.saturating_duration_since(start) <= YIELD_OVERRUN {
        return true;
    }
    note_overrun(back);
    false
}

/// Records an overrun yield of this thread that ended `at`.
fn note_overrun(at: Instant) {
    let mut seen = SEEN.get();
    match seen.since {
        Some(t) if at.saturating_duration_since(t) <= OVERRUN_WINDOW => seen.overruns += 1,
        _ => {
            seen.since = Some(at);
            seen.overruns = 1;
        }
    }
    if seen.overruns >= OVERRUNS_TO_STOP {
        seen = Seen {
            overruns: 0,
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
    fn spin_overruns_within_a_window_turn_a_threads_spins_off_for_a_while() {
        assert!(worthwhile());
        let t0 = Instant::now();
        for _ in 1..OVERRUNS_TO_STOP {
            note_overrun(t0);
        }
        assert!(worthwhile(), "fewer overruns turn nothing off");
        // Overruns further apart than the window start the count again.
        let later = t0 + OVERRUN_WINDOW + Duration::from_millis(1);
        note_overrun(later);
        assert!(worthwhile(), "an overrun after the window starts a new count");
        for _ in 1..OVERRUNS_TO_STOP {
            note_overrun(later);
        }
        assert!(
            !worthwhile(),
            "{OVERRUNS_TO_STOP} overruns within the window turn spinning off"
        );
        // Once the time is over, spinning is worthwhile again, and the count starts from nothing.
        SEEN.set(Seen {
            off_until: Some(Instant::now()),
            ..SEEN.get()
        });
        assert!(worthwhile());
        note_overrun(Instant::now());
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
            "{yields} yields beside a hog on one core overran {YIELD_OVERRUN:?} fewer than {OVERRUNS_TO_STOP} times within {OVERRUN_WINDOW:?}"
        );
    }
}
