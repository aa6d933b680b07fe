use super::*;

#[test]
fn sync_fnv1a_matches_the_reference_vectors() {
    assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
    assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
    assert_eq!(fnv1a(b"foobar"), 0x8594_4171_f739_67e8);
}

#[test]
fn sync_watched_wakes_a_waiter_and_bounds_the_wait() {
    use std::sync::Arc;
    use std::time::Duration;
    let w = Arc::new(Watched::new(0u32));
    let t0 = Instant::now();
    assert!(!w.wait_until(|v| *v > 0, Some(t0 + Duration::from_millis(20))));
    assert!(t0.elapsed() >= Duration::from_millis(20));
    let w2 = w.clone();
    let waiter = std::thread::spawn(move || w2.wait_until(|v| *v == 3, None));
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(5));
        w.update(|v| *v += 1);
    }
    assert!(waiter.join().unwrap());
    assert_eq!(w.read(|v| *v), 3);
    assert!(w.wait_until(|v| *v == 3, Some(Instant::now())));
}

#[test]
fn sync_lock_takes_over_a_poisoned_mutex() {
    let m = std::sync::Arc::new(Mutex::new(1));
    let m2 = m.clone();
    let _ = std::thread::spawn(move || {
        let _g = m2.lock().unwrap();
        panic!("poison it");
    })
    .join();
    assert!(m.is_poisoned());
    *lock(&m) += 1;
    assert_eq!(*lock(&m), 2);
}
