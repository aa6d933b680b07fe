use super::*;

#[test]
fn poller_wakes_only_when_asleep() {
    let mut p = Poller::new().unwrap();
    let w = p.waker();
    let mut out = Vec::new();
    w.wake(); // not sleeping: no syscall, nothing pending
    p.wait(Some(Duration::ZERO), &mut out);
    assert!(out.is_empty());
    p.prepare_sleep();
    let t = std::thread::spawn(move || w.wake());
    t.join().unwrap();
    let t0 = std::time::Instant::now();
    p.wait(Some(Duration::from_secs(5)), &mut out);
    assert!(t0.elapsed() < Duration::from_secs(4), "the wake-up was not lost");
}

/// Whether the engine's sleep (the outer instance) would be woken by the descriptors now.
fn sleep_sees_descriptors(p: &Poller) -> bool {
    let mut evs = vec![NO_EVENT; 8];
    let n = poll_now(&p.outer, &mut evs);
    evs[..n].iter().any(|e| e.u64 == INNER)
}

#[test]
fn poller_a_gate_hides_the_sockets_from_the_sleep_until_the_last_driver_leaves() {
    let mut p = Poller::new().unwrap();
    let owner = TransportId::nth(0).unwrap();
    let r = p.registrar_for(owner);
    let (x, mut y) = std::os::unix::net::UnixStream::pair().unwrap();
    r.add(x.as_raw_fd(), 7, true, false).unwrap();
    std::io::Write::write_all(&mut y, b"frame").unwrap();
    let (gate, mut driver) = (p.gate(), p.driver_poll());
    let mut out = Vec::new();
    assert!(sleep_sees_descriptors(&p));
    gate.enter();
    gate.enter();
    // Two callers drive: a ready socket does not wake the engine's sleep; a driver's poll
    // sees it, and so does a hot engine's look (no wait).
    assert!(!sleep_sees_descriptors(&p), "a ready socket would wake the sleep");
    driver.poll(&mut out);
    assert_eq!(
        out.iter().map(|r| (r.owner, r.token)).collect::<Vec<_>>(),
        [(owner, 7)]
    );
    out.clear();
    p.wait(Some(Duration::ZERO), &mut out);
    assert_eq!(out.len(), 1);
    out.clear();
    // Whatever ends a sleep (here its timeout), the engine then looks at the descriptors.
    p.wait(Some(Duration::from_millis(1)), &mut out);
    assert_eq!(out.len(), 1, "the engine woke blind to a ready socket");
    out.clear();
    gate.leave();
    assert!(!sleep_sees_descriptors(&p), "one caller still drives");
    // The last one leaves: the ready socket wakes the sleep at once.
    gate.leave();
    assert!(!gate.driven());
    assert!(sleep_sees_descriptors(&p));
    p.wait(Some(Duration::from_secs(30)), &mut out);
    assert_eq!(
        out.iter().map(|r| (r.owner, r.token)).collect::<Vec<_>>(),
        [(owner, 7)]
    );
}

#[test]
fn poller_reports_a_descriptor_to_its_owner_under_its_own_token() {
    let mut p = Poller::new().unwrap();
    let (a, b) = (TransportId::nth(0).unwrap(), TransportId::nth(3).unwrap());
    let (ra, rb) = (p.registrar_for(a), p.registrar_for(b));
    let (x, y) = (
        std::os::unix::net::UnixStream::pair().unwrap(),
        std::os::unix::net::UnixStream::pair().unwrap(),
    );
    // The same token, chosen by two owners.
    ra.add(x.0.as_raw_fd(), 5, false, true).unwrap();
    rb.add(y.0.as_raw_fd(), 5, false, true).unwrap();
    assert!(ra.add(x.1.as_raw_fd(), MAX_TOKEN + 1, true, false).is_err());
    let mut out = Vec::new();
    p.wait(Some(Duration::ZERO), &mut out);
    out.sort_by_key(|r| r.owner.index());
    let owners: Vec<_> = out.iter().map(|r| (r.owner, r.token)).collect();
    assert_eq!(owners, [(a, 5), (b, 5)]);
}
