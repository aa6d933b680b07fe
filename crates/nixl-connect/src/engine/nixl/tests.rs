use std::time::{Duration, Instant};

use super::{Throttle, WARN_GAP};

#[test]
fn nixl_repeated_failures_warn_once_per_gap_and_count_every_one() {
    let t0 = Instant::now();
    let mut th = Throttle::default();
    assert_eq!(th.note(t0), Some(1), "the first failure warns");
    for k in 1..1000u32 {
        assert_eq!(th.note(t0 + Duration::from_micros(u64::from(k) * 5)), None);
    }
    assert_eq!(
        th.note(t0 + WARN_GAP),
        Some(1001),
        "a gap later, with every failure counted"
    );
    assert_eq!(th.note(t0 + WARN_GAP), None);
}
