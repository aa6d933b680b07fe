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
