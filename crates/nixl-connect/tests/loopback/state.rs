//! The operations' and the engine's state machines over the in-process loopback transport
//! (feature `testing`): no NIXL library, no socket, no sleep; each step waits for the engines to
//! act ([`testing::settle`]). The same behaviours are tested over real NIXL and the same-host
//! path by the `integration` tests.

use std::time::Duration;

use nixl_connect::{
    testing, Connector, Descriptor, Error, OperationStatus, ReadOperation, ReadableOperation,
};

const T: Option<Duration> = Some(Duration::from_secs(5));

fn pair() -> (Connector, Connector) {
    let a = Connector::builder().build_loopback().unwrap();
    let b = Connector::builder().build_loopback().unwrap();
    (a, b)
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn stall(c: &Connector, on: bool) {
    assert!(testing::stall(c, on), "a live loopback node");
}

/// Lets each engine act on what was sent to it and run its transports once (a stalled transfer
/// stays where it is meanwhile): a deterministic step, no sleep.
async fn settle(conns: &[&Connector]) {
    for c in conns {
        testing::settle(c).await.unwrap();
    }
}

/// A readable of `seed`'s pattern on `a`, and `b`'s read of it held in flight (`b` stalled).
async fn read_in_flight(
    a: &Connector,
    b: &Connector,
    seed: u8,
) -> (ReadableOperation<'static>, ReadOperation<'static>) {
    let r = a
        .create_readable(Descriptor::from(pattern(4096, seed)))
        .await
        .unwrap();
    stall(b, true);
    let op = b
        .begin_read(r.metadata(), Descriptor::from(vec![0u8; 4096]))
        .await
        .unwrap();
    settle(&[b]).await;
    (r, op)
}

#[tokio::test]
async fn loopback_read_completes_both_sides_exactly_once() {
    let (a, b) = pair();
    let r = a
        .create_readable(Descriptor::from(pattern(8192, 1)))
        .await
        .unwrap();
    let op = b
        .begin_read(r.metadata(), Descriptor::from(vec![0u8; 8192]))
        .await
        .unwrap();
    op.wait_for_completion(T).await.unwrap();
    r.wait_for_completion(T).await.unwrap();
    // A second wait sees the same ending; nothing completes twice.
    op.wait_for_completion(T).await.unwrap();
    assert_eq!(op.status(), OperationStatus::Complete);
    assert_eq!(r.status(), OperationStatus::Complete);
    let got = op.into_descriptors().ok().unwrap();
    assert_eq!(got[0].as_slice().unwrap(), &pattern(8192, 1)[..]);
    assert_eq!(b.stats().await.unwrap().transfers, 1);
}

#[tokio::test]
async fn loopback_write_completes_both_sides() {
    let (a, b) = pair();
    let w = a
        .create_writable(Descriptor::from(vec![0u8; 4096]))
        .await
        .unwrap();
    let op = b
        .begin_write(Descriptor::from(pattern(4096, 7)), w.metadata())
        .await
        .unwrap();
    op.wait_for_completion(T).await.unwrap();
    w.wait_for_completion(T).await.unwrap();
    let d = w.into_descriptors();
    assert_eq!(d[0].as_slice().unwrap(), &pattern(4096, 7)[..]);
}

#[tokio::test]
async fn loopback_replay_after_completion_is_refused() {
    let (a, b) = pair();
    let c = Connector::builder().build_loopback().unwrap();
    let r = a
        .create_readable(Descriptor::from(pattern(4096, 2)))
        .await
        .unwrap();
    let md = r.metadata().clone();
    let op = b
        .begin_read(&md, Descriptor::from(vec![0u8; 4096]))
        .await
        .unwrap();
    op.wait_for_completion(T).await.unwrap();
    r.wait_for_completion(T).await.unwrap();
    // The same connector refuses metadata it completed; another one finds no live operation.
    for (who, conn) in [("the same connector", &b), ("another connector", &c)] {
        let op = conn
            .begin_read(&md, Descriptor::from(vec![0u8; 4096]))
            .await
            .unwrap();
        let e = op.wait_for_completion(T).await.unwrap_err();
        assert!(
            matches!(e, Error::Refused { refusal: r, .. } if r.is_replay()),
            "{who}: {e}"
        );
    }
}

/// Found in review (issue 40): a read's copy released the owner's map before the key was marked
/// done, so a second reader on another connector, begun before the owner's engine applied the
/// completion, was served too. One readable serves one read, whichever connectors race for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loopback_concurrent_readers_one_succeeds() {
    for round in 0..50u8 {
        let (a, b) = pair();
        let c = Connector::builder().build_loopback().unwrap();
        let r = a
            .create_readable(Descriptor::from(pattern(4096, round)))
            .await
            .unwrap();
        let md = r.metadata().clone();
        let (x, y) = tokio::join!(
            b.begin_read(&md, Descriptor::from(vec![0u8; 4096])),
            c.begin_read(&md, Descriptor::from(vec![0u8; 4096]))
        );
        let (x, y) = (x.unwrap(), y.unwrap());
        let (x, y) = tokio::join!(x.wait_for_completion(T), y.wait_for_completion(T));
        let ok = usize::from(x.is_ok()) + usize::from(y.is_ok());
        assert_eq!(ok, 1, "round {round}: {x:?} {y:?}");
        for e in [x, y].into_iter().filter_map(Result::err) {
            assert!(
                matches!(e, Error::Refused { refusal: r, .. } if r.is_replay()),
                "{e}"
            );
        }
        r.wait_for_completion(T).await.unwrap();
    }
}

#[tokio::test]
async fn loopback_wrong_pairing_fails_before_any_transfer() {
    let (a, b) = pair();
    let r = a
        .create_readable(Descriptor::from(vec![1u8; 4096]))
        .await
        .unwrap();
    let e = b
        .begin_write(Descriptor::from(vec![0u8; 4096]), r.metadata())
        .await
        .unwrap_err();
    assert!(matches!(e, Error::WrongPairing { .. }), "{e}");
    let e = b
        .begin_read(r.metadata(), Descriptor::from(vec![0u8; 100]))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::DescriptorMismatch(_)), "{e}");
    assert_eq!(b.stats().await.unwrap().transfers, 0);
    assert_eq!(r.status(), OperationStatus::Initialized);
}

#[tokio::test]
async fn loopback_deadline_passes_then_the_operation_completes() {
    let (a, b) = pair();
    let r = a
        .create_readable(Descriptor::from(pattern(4096, 3)))
        .await
        .unwrap();
    stall(&b, true);
    let op = b
        .begin_read(r.metadata(), Descriptor::from(vec![0u8; 4096]))
        .await
        .unwrap();
    let e = op
        .wait_for_completion(Some(Duration::from_millis(30)))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::TimedOut { peer: Some(_), .. }), "{e}");
    // Still live: a later wait sees it through.
    assert_eq!(op.status(), OperationStatus::InProgress);
    stall(&b, false);
    op.wait_for_completion(T).await.unwrap();
    r.wait_for_completion(T).await.unwrap();
}

#[tokio::test]
async fn loopback_cancel_in_flight_moves_nothing() {
    let (a, b) = pair();
    let (r, op) = read_in_flight(&a, &b, 4).await;
    op.cancel();
    let e = op.wait_for_completion(T).await;
    assert_eq!(op.status(), OperationStatus::Cancelled, "{e:?}");
    stall(&b, false);
    settle(&[&b, &a]).await;
    // The readable never saw a completion and still serves another reader, once.
    assert_eq!(r.status(), OperationStatus::Initialized);
    let c = Connector::builder().build_loopback().unwrap();
    let op = c
        .begin_read(r.metadata(), Descriptor::from(vec![0u8; 4096]))
        .await
        .unwrap();
    op.wait_for_completion(T).await.unwrap();
    r.wait_for_completion(T).await.unwrap();
}

#[tokio::test]
async fn loopback_drop_at_every_point_completes_nothing() {
    let (a, b) = pair();
    let r = a
        .create_readable(Descriptor::from(pattern(4096, 5)))
        .await
        .unwrap();
    // Dropped before its first poll: nothing reached the engine.
    drop(b.begin_read(r.metadata(), Descriptor::from(vec![0u8; 4096])));
    // Dropped while in flight (stalled), then the transfers released.
    stall(&b, true);
    for _ in 0..3 {
        let op = b
            .begin_read(r.metadata(), Descriptor::from(vec![0u8; 4096]))
            .await
            .unwrap();
        settle(&[&b]).await;
        drop(op);
    }
    // A drop reaches the engine as a command: it is handled before the transfers are released
    // (the stall is no command, so without this the engine could release them first).
    settle(&[&b]).await;
    stall(&b, false);
    settle(&[&b, &a]).await;
    assert_eq!(r.status(), OperationStatus::Initialized);
    assert_eq!(
        b.stats().await.unwrap().transfers,
        0,
        "a dropped operation's transfer ran"
    );
    // Dropped right after starting, unstalled: it may or may not have moved, but the readable
    // completes at most once and the engine stays consistent.
    let op = b
        .begin_read(r.metadata(), Descriptor::from(vec![0u8; 4096]))
        .await
        .unwrap();
    drop(op);
    settle(&[&b, &a]).await;
    let s = r.status();
    assert!(
        matches!(s, OperationStatus::Initialized | OperationStatus::Complete),
        "{s:?}"
    );
}

#[tokio::test]
async fn loopback_passive_dropped_in_flight_refuses_the_late_transfer() {
    let (a, b) = pair();
    let (r, op) = read_in_flight(&a, &b, 6).await;
    drop(r);
    settle(&[&a]).await;
    stall(&b, false);
    let e = op.wait_for_completion(T).await.unwrap_err();
    assert!(
        matches!(e, Error::Refused { refusal: r, .. } if r.is_replay()),
        "{e}"
    );
    let got = op.into_descriptors().ok().unwrap();
    assert!(
        got[0].as_slice().unwrap().iter().all(|&x| x == 0),
        "nothing was copied"
    );
}

#[tokio::test]
async fn loopback_peer_gone_is_remote_gone() {
    let (a, b) = pair();
    let r = a
        .create_readable(Descriptor::from(vec![9u8; 4096]))
        .await
        .unwrap();
    let md = r.metadata().clone();
    drop(r);
    drop(a); // its engine stops (the drop joins its thread) and leaves the hub
    let op = b
        .begin_read(&md, Descriptor::from(vec![0u8; 4096]))
        .await
        .unwrap();
    let e = op.wait_for_completion(T).await.unwrap_err();
    assert!(matches!(e, Error::RemoteGone { .. }), "{e}");
}
