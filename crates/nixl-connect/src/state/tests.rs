use super::*;

/// The same-host path's old name still compiles, names the same path, and prints as
/// Python and the metrics name it.
#[test]
#[allow(deprecated)]
fn state_transfer_path_local_is_same_host() {
    assert_eq!(TransferPath::Local, TransferPath::SameHost);
    assert!(matches!(TransferPath::SameHost, TransferPath::Local));
    assert_eq!(TransferPath::SameHost.to_string(), "local");
    assert_eq!(TransferPath::from_u8(2), Some(TransferPath::SameHost));
}

/// The same-host-only policy's old name still compiles and is the same policy; `local` parses
/// to it.
#[test]
#[allow(deprecated)]
fn state_path_policy_local_is_same_host() {
    assert_eq!(PathPolicy::Local, PathPolicy::SameHost);
    assert!(matches!(PathPolicy::SameHost, PathPolicy::Local));
    assert_eq!("local".parse::<PathPolicy>().unwrap(), PathPolicy::SameHost);
}

#[test]
fn state_error_is_visible_with_the_status() {
    for _ in 0..200 {
        let s = OpState::new(OperationStatus::InProgress);
        let s2 = s.clone();
        let t = std::thread::spawn(move || {
            s2.finish(
                OperationStatus::Errored,
                Some(Error::Nixl {
                    op: "x",
                    status: "y".into(),
                    source: None,
                }),
            )
        });
        loop {
            if s.status() == OperationStatus::Errored {
                assert!(s.error().is_some(), "an Errored status always has its error");
                break;
            }
            std::hint::spin_loop();
        }
        assert!(t.join().unwrap());
        assert!(
            !s.finish(OperationStatus::Complete, None),
            "terminal states are final"
        );
    }
}

#[test]
fn state_mechanisms_listed_in_code_order() {
    for (i, m) in Mechanism::ALL.iter().enumerate() {
        assert_eq!(Mechanism::from_u8(i as u8 + 1), Some(*m), "{m}");
    }
}

/// Counts what it is told.
struct Counting(Arc<std::sync::atomic::AtomicUsize>, Arc<AtomicU8>);

impl Observe for Counting {
    fn started(&self, _: TransferPath) {}
    fn timed_out(&self) {}
    fn ended(&self, e: Ended) {
        self.0.fetch_add(1, Ordering::SeqCst);
        self.1.store(e.status as u8, Ordering::SeqCst);
    }
}

#[test]
fn state_observer_told_once_when_cancel_races_completion() {
    for _ in 0..200 {
        let s = OpState::new(OperationStatus::InProgress);
        let (n, last) = (
            Arc::new(std::sync::atomic::AtomicUsize::new(0)),
            Arc::new(AtomicU8::new(0)),
        );
        s.observe(Box::new(Counting(n.clone(), last.clone())));
        let s2 = s.clone();
        let t = std::thread::spawn(move || s2.finish(OperationStatus::Cancelled, None));
        let won = s.finish(OperationStatus::Complete, None);
        let other = t.join().unwrap();
        assert!(won ^ other, "exactly one finish wins");
        assert_eq!(n.load(Ordering::SeqCst), 1, "the observer is told once");
        assert_eq!(
            last.load(Ordering::SeqCst),
            s.status() as u8,
            "of the status that won"
        );
    }
}

#[test]
fn state_release_wait_is_bounded() {
    let s = OpState::new(OperationStatus::InProgress);
    s.mark_in_use();
    let t0 = Instant::now();
    assert!(!s.wait_released(Some(Duration::from_millis(30))));
    assert!(t0.elapsed() >= Duration::from_millis(30));
    s.mark_released();
    assert!(s.wait_released(Some(Duration::ZERO)));
}
