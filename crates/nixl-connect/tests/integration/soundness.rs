//! Soundness under cancellation, drop, replay and peer failure (real NIXL; TCP where a transfer
//! must really be in flight, the same-host path otherwise). Each race has its own test.
//!
//! Cases that need NIXL over TCP (`UCX_TLS=tcp`, where UCX serves reads in the owner's process
//! and transfers stay in flight for milliseconds) run in a fresh process of this binary; peers
//! are `support_sound_peer` processes driven over stdin/stdout.

use std::time::{Duration, Instant};

use nixl_connect::{
    Connector, Descriptor, Error, HostBuffer, OperationStatus, PathPolicy, RdmaMetadata, TransferPath,
};

use super::support::{all_bytes, pattern, run_support, runtime, tcp_tls, Peer, PEER_ENV, T};

pub(crate) const PEER: &str = "soundness::support_sound_peer";
const MIB: usize = 1 << 20;

/// Runs the support test `name` in a fresh process once over NIXL (TCP) and once with the
/// same-host path allowed; each run must print `ok`.
pub(crate) fn on_both_paths(name: &str, ok: &str) {
    for (path, tls) in [("nixl", tcp_tls()), ("auto", "")] {
        let mut env: Vec<(&str, &std::ffi::OsStr)> = vec![("NIXL_CONNECT_TEST_PATH", path.as_ref())];
        if !tls.is_empty() {
            env.push(("UCX_TLS", tls.as_ref()));
        }
        let text = run_support(name, &env);
        assert!(text.contains(ok), "{path}: {text}");
    }
}

/// The path policy a support process was started with.
pub(crate) fn policy_from_env() -> PathPolicy {
    std::env::var("NIXL_CONNECT_TEST_PATH")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(PathPolicy::Auto)
}

/// A peer that serves and uses operations on command (see `support_sound_peer`).
pub(crate) fn sound_peer() -> Peer {
    Peer::spawn(PEER, "peer", &[])
}

/// Drops `fut` after polling it once (`None`) or after `d` (a timeout that may fire at any point).
pub(crate) async fn drop_at<F: std::future::Future>(fut: F, d: Option<Duration>) {
    match d {
        None => {
            let mut f = std::pin::pin!(fut);
            let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
            let _ = f.as_mut().poll(&mut cx);
        }
        Some(d) => {
            let _ = tokio::time::timeout(d, fut).await;
        }
    }
}

pub(crate) const DROP_POINTS: [Option<Duration>; 10] = [
    None,
    Some(Duration::ZERO),
    Some(Duration::from_micros(1)),
    Some(Duration::from_micros(5)),
    Some(Duration::from_micros(20)),
    Some(Duration::from_micros(50)),
    Some(Duration::from_micros(100)),
    Some(Duration::from_micros(200)),
    Some(Duration::from_micros(300)),
    Some(Duration::from_micros(500)),
];

fn canary_intact(c: &[u8]) -> bool {
    all_bytes(c, 0xA5)
}

#[test]
fn cancel_begin_future_dropped_at_every_point() {
    on_both_paths("soundness::support_cancel_begin", "CANCEL-BEGIN-OK");
}

#[test]
#[ignore = "run by cancel_begin_future_dropped_at_every_point in a fresh process"]
fn support_cancel_begin() {
    let Ok(_) = std::env::var(PEER_ENV) else { return };
    runtime().block_on(async {
        let conn = Connector::builder().path(policy_from_env()).build().unwrap();
        let mut peer = sound_peer();
        let len = 64 * MIB;
        for (i, d) in DROP_POINTS.iter().enumerate() {
            for write in [false, true] {
                let kind = if write { "writable" } else { "readable" };
                peer.say(&format!("expose {kind} {len} vec"));
                let md: RdmaMetadata = peer.expect("MD:").parse().unwrap();
                // Owned memory, dropped with the future at this point.
                if write {
                    drop_at(conn.begin_write(Descriptor::from(vec![1u8; len]), &md), *d).await;
                } else {
                    drop_at(conn.begin_read(&md, Descriptor::from(vec![0u8; len])), *d).await;
                }
                // A fresh allocation of the same size: where a freed destination would be reused.
                let canary = vec![0xA5u8; len];
                peer.say("wait 300");
                peer.expect("WAIT:");
                peer.say("drop");
                peer.expect("DROPPED");
                assert!(
                    canary_intact(&canary),
                    "drop point {i} ({kind}): a dropped operation's transfer wrote into freed memory"
                );
            }
            // Borrowed memory: the borrow ends (the future's drop returns) only once nothing
            // writes it.
            peer.say(&format!("expose readable {len} vec"));
            let md: RdmaMetadata = peer.expect("MD:").parse().unwrap();
            let mut dst = vec![0u8; len];
            drop_at(conn.begin_read(&md, Descriptor::from(&mut dst[..])), *d).await;
            dst.fill(0xA5);
            peer.say("wait 300");
            peer.expect("WAIT:");
            peer.say("drop");
            peer.expect("DROPPED");
            assert!(
                canary_intact(&dst),
                "drop point {i}: a borrowed destination was written after its drop"
            );
            // Passive creation dropped at this point: no leak of a live exposure, no crash.
            drop_at(conn.create_readable(Descriptor::from(vec![0u8; len])), *d).await;
            drop_at(conn.create_writable(Descriptor::from(vec![0u8; len])), *d).await;
        }
        // The connector still works.
        peer.say(&format!("expose readable {} vec", 4096));
        let md: RdmaMetadata = peer.expect("MD:").parse().unwrap();
        let op = conn
            .begin_read(&md, Descriptor::from(vec![0u8; 4096]))
            .await
            .unwrap();
        op.wait_for_completion(T).await.unwrap();
        println!("CANCEL-BEGIN-OK stats {:?}", conn.stats().await.unwrap());
    });
}

#[test]
fn drop_passive_mid_transfer_never_crashes_owner() {
    let text = run_support(
        "soundness::support_drop_passive",
        &[("UCX_TLS", tcp_tls().as_ref())],
    );
    assert!(text.contains("OWNER-OK"), "{text}");
}

#[test]
#[ignore = "run by drop_passive_mid_transfer_never_crashes_owner with UCX_TLS=tcp"]
fn support_drop_passive() {
    let Ok(_) = std::env::var(PEER_ENV) else { return };
    runtime().block_on(async {
        // This process owns the memory; over TCP its own UCX serves the peer's reads from it.
        let conn = Connector::new().unwrap();
        let mut peer = sound_peer();
        // A read the owner breaks may only end at its deadline: 5 s, far above what an unbroken
        // one takes (the test's point is the owner, not how the reader's read ends).
        peer.say("deadline 5000");
        peer.expect("DEADLINE");
        let len = 256 * MIB;
        for busy in [false, true] {
            // "Busy": another readable keeps this engine progressing NIXL all the time.
            let other = if busy {
                Some(
                    conn.create_readable(Descriptor::from(vec![1u8; 4096]))
                        .await
                        .unwrap(),
                )
            } else {
                None
            };
            for round in 0..3 {
                let mut buf = HostBuffer::new(len).unwrap();
                buf.fill(0x5A);
                let r = conn.create_readable(Descriptor::from(buf)).await.unwrap();
                peer.say("read nixl");
                peer.say(&r.metadata().to_json());
                peer.expect("STARTED");
                drop(r); // the readable and its HostBuffer, mid-transfer
                let got = peer.expect("READ:");
                println!("busy={busy} round {round}: the reader saw: {got}");
            }
            drop(other);
        }
        // Alive, and still serving.
        let r = conn
            .create_readable(Descriptor::from(pattern(4096, 9)))
            .await
            .unwrap();
        peer.say("read nixl");
        peer.say(&r.metadata().to_json());
        peer.expect("STARTED");
        assert!(peer.expect("READ:").starts_with("ok"));
        r.wait_for_completion(T).await.unwrap();
        let s = conn.stats().await.unwrap();
        assert!(
            s.quarantined_bytes > 0 || s.rotations > 0,
            "dropped exposed memory went to quarantine (and was released by a rotation): {s:?}"
        );
        println!("OWNER-OK {s:?}");
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_after_completion_and_drop_is_refused_or_harmless() {
    // The same-host path: the owner refuses a replay, after completion and after drop.
    let owner = Connector::new().unwrap();
    let reader = Connector::new().unwrap();
    let other = Connector::new().unwrap();
    let mut buf = HostBuffer::new(4096).unwrap();
    buf.fill(3);
    let r = owner.create_readable(Descriptor::from(&buf)).await.unwrap();
    let md = r.metadata().clone();
    let op = reader
        .begin_read(&md, Descriptor::from(vec![0u8; 4096]))
        .await
        .unwrap();
    op.wait_for_completion(T).await.unwrap();
    r.wait_for_completion(T).await.unwrap();
    assert_eq!(op.path(), Some(TransferPath::SameHost));
    for (who, conn) in [("another connector", &other), ("the same connector", &reader)] {
        let mut dst = vec![0u8; 4096];
        let op = conn
            .begin_read(&md, Descriptor::from(&mut dst[..]))
            .await
            .unwrap();
        let e = op.wait_for_completion(T).await.unwrap_err();
        assert!(
            matches!(e, Error::Refused { refusal: r, .. } if r.is_replay()),
            "{who}: {e}"
        );
        drop(op);
        assert!(all_bytes(&dst, 0), "{who}: nothing was copied");
    }
    drop(r);
    let op = other
        .begin_read(&md, Descriptor::from(vec![0u8; 4096]))
        .await
        .unwrap();
    let e = op.wait_for_completion(T).await.unwrap_err();
    assert!(
        matches!(e, Error::Refused { refusal: r, .. } if r.is_replay()),
        "after drop: {e}"
    );

    // NIXL over TCP: a replay cannot be refused there (UCX checks nothing at the target), but it
    // is harmless: dropped memory the library owned stays mapped and holds no data.
    let text = run_support(
        "soundness::support_replay_nixl",
        &[("UCX_TLS", tcp_tls().as_ref())],
    );
    assert!(text.contains("REPLAY-OK"), "{text}");
}

#[test]
#[ignore = "run by replay_after_completion_and_drop_is_refused_or_harmless with UCX_TLS=tcp"]
fn support_replay_nixl() {
    let Ok(_) = std::env::var(PEER_ENV) else { return };
    runtime().block_on(async {
        let conn = Connector::new().unwrap();
        let mut peer = sound_peer();
        let len = 64 * MIB;
        // A HostBuffer readable, read, then dropped with its buffer.
        let mut buf = HostBuffer::new(len).unwrap();
        buf.fill(0x77);
        let r = conn.create_readable(Descriptor::from(buf)).await.unwrap();
        let md = r.metadata().to_json();
        peer.say("read nixl");
        peer.say(&md);
        peer.expect("STARTED");
        assert!(peer.expect("READ:").starts_with("ok"));
        r.wait_for_completion(T).await.unwrap();
        drop(r);
        // Fresh memory that must not be reachable through the old metadata.
        let canary = vec![0xA5u8; len];
        peer.say("read nixl fresh");
        peer.say(&md);
        peer.expect("STARTED");
        let got = peer.expect("READ:");
        println!("replay after drop: {got}");
        // The dropped buffer is held whole until its exposer is destroyed (releasing its pages
        // would let a read in flight at the drop complete with zeros): a replay reads the bytes
        // its metadata was published for, or fails; never this process's later memory.
        assert!(
            !got.contains("first=165"),
            "a replay after drop read memory allocated after the drop: {got}"
        );
        assert!(canary_intact(&canary));
        // An owned Vec readable dropped after completion: held, not freed, so the replay reads
        // memory that still belongs to the library, never a later allocation.
        let r = conn
            .create_readable(Descriptor::from(vec![0x33u8; len]))
            .await
            .unwrap();
        let md = r.metadata().to_json();
        peer.say("read nixl");
        peer.say(&md);
        peer.expect("STARTED");
        assert!(peer.expect("READ:").starts_with("ok"));
        r.wait_for_completion(T).await.unwrap();
        drop(r);
        let canary = vec![0xA5u8; len];
        peer.say("read nixl fresh");
        peer.say(&md);
        peer.expect("STARTED");
        println!("replay of a dropped Vec readable: {}", peer.expect("READ:"));
        assert!(canary_intact(&canary));
        // And the same reader connector refuses to replay metadata it completed.
        peer.say("read nixl");
        peer.say(&md);
        peer.expect("STARTED");
        let got = peer.expect("READ:");
        assert!(got.contains("single-use"), "{got}");
        println!("REPLAY-OK");
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_write_after_completion() {
    let owner = Connector::new().unwrap();
    let w1 = Connector::new().unwrap();
    let w2 = Connector::new().unwrap();
    let mut dst = HostBuffer::new(4096).unwrap();
    let writable = owner.create_writable(Descriptor::from(&mut dst)).await.unwrap();
    let md = writable.metadata().clone();
    let op = w1
        .begin_write(Descriptor::from(vec![1u8; 4096]), &md)
        .await
        .unwrap();
    op.wait_for_completion(T).await.unwrap();
    writable.wait_for_completion(T).await.unwrap();
    assert_eq!(writable.status(), OperationStatus::Complete);
    for (who, conn) in [("another writer", &w2), ("the same writer", &w1)] {
        let op = conn
            .begin_write(Descriptor::from(vec![2u8; 4096]), &md)
            .await
            .unwrap();
        let e = op.wait_for_completion(T).await.unwrap_err();
        assert!(
            matches!(e, Error::Refused { refusal: r, .. } if r.is_replay()),
            "{who}: {e}"
        );
    }
    drop(writable);
    assert!(
        all_bytes(&dst, 1),
        "the completed writable's memory did not change"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writers() {
    let owner = Connector::new().unwrap();
    let writers = [Connector::new().unwrap(), Connector::new().unwrap()];
    let len = 64 * MIB;
    for _ in 0..3 {
        let mut dst = HostBuffer::new(len).unwrap();
        let writable = owner.create_writable(Descriptor::from(&mut dst)).await.unwrap();
        let md = writable.metadata().clone();
        let a = writers[0].begin_write(Descriptor::from(vec![1u8; len]), &md);
        let b = writers[1].begin_write(Descriptor::from(vec![2u8; len]), &md);
        let (a, b) = tokio::join!(a, b);
        let (a, b) = (a.unwrap(), b.unwrap());
        let (ra, rb) = tokio::join!(a.wait_for_completion(T), b.wait_for_completion(T));
        writable.wait_for_completion(T).await.unwrap();
        let winners = [&ra, &rb].iter().filter(|r| r.is_ok()).count();
        assert_eq!(winners, 1, "exactly one writer wins: {ra:?} {rb:?}");
        for r in [&ra, &rb].into_iter().filter_map(|r| r.as_ref().err()) {
            assert!(matches!(r, Error::Refused { .. }), "the other is refused: {r}");
        }
        drop(writable);
        let want = if ra.is_ok() { 1 } else { 2 };
        assert!(all_bytes(&dst, want), "no interleaving: one writer's bytes only");
    }
}

/// Waits until `conn` has posted a NIXL transfer beyond `before` (or `op` ended).
pub(crate) async fn posted(conn: &Connector, before: u64, status: impl Fn() -> OperationStatus) {
    while conn.stats().await.unwrap().transfers == before && !status().is_terminal() {
        tokio::task::yield_now().await;
    }
}

#[test]
fn deadline_holds_when_peer_is_stopped() {
    let text = run_support(
        "soundness::support_deadline_stopped",
        &[("UCX_TLS", tcp_tls().as_ref())],
    );
    assert!(text.contains("STOPPED-OK"), "{text}");
}

#[test]
#[ignore = "run by deadline_holds_when_peer_is_stopped with UCX_TLS=tcp"]
fn support_deadline_stopped() {
    let Ok(_) = std::env::var(PEER_ENV) else { return };
    runtime().block_on(async {
        let grace = Duration::from_millis(500);
        let auto = Connector::builder().cancel_grace(grace).build().unwrap();
        let nixl = Connector::builder()
            .path(PathPolicy::Nixl)
            .cancel_grace(grace)
            .build()
            .unwrap();
        let mut healthy = sound_peer();
        let mut frozen = sound_peer();
        let deadline = Duration::from_secs(1);
        let margin = Duration::from_millis(900);
        let healthy_read = |conn: Connector, peer: &mut Peer| {
            peer.say("expose readable 4096 vec");
            let md: RdmaMetadata = peer.expect("MD:").parse().unwrap();
            async move {
                let t0 = Instant::now();
                let op = conn
                    .begin_read(&md, Descriptor::from(vec![0u8; 4096]))
                    .await
                    .unwrap();
                op.wait_for_completion(Some(Duration::from_secs(5)))
                    .await
                    .unwrap();
                t0.elapsed()
            }
        };

        // 1. Active side, same-host path: the owner stops after handing over its metadata.
        frozen.say(&format!("expose readable {} vec", 64 * MIB));
        let md: RdmaMetadata = frozen.expect("MD:").parse().unwrap();
        frozen.signal(libc::SIGSTOP);
        let mut dst = vec![0u8; 64 * MIB];
        let op = auto
            .begin_read(&md, Descriptor::from(&mut dst[..]))
            .await
            .unwrap();
        let t0 = Instant::now();
        let e = op.wait_for_completion(Some(deadline)).await.unwrap_err();
        let took = t0.elapsed();
        assert!(matches!(&e, Error::TimedOut { peer: Some(_), .. }), "{e}");
        assert!(took < deadline + margin, "local wait took {took:?}");
        let h = healthy_read(auto.clone(), &mut healthy).await;
        println!("local: timed out after {took:?} ({e}); a healthy peer's read meanwhile took {h:?}");
        let t0 = Instant::now();
        drop(op);
        assert!(t0.elapsed() < margin, "dropping it took {:?}", t0.elapsed());
        frozen.signal(libc::SIGCONT);
        frozen.say("drop");
        frozen.expect("DROPPED");

        // 2. Active side, NIXL over TCP, the owner stops mid-transfer; borrowed destination.
        let mut caught = false;
        for _ in 0..3 {
            frozen.say(&format!("expose readable {} host", 256 * MIB));
            let md: RdmaMetadata = frozen.expect("MD:").parse().unwrap();
            let mut big = HostBuffer::new(256 * MIB).unwrap();
            let before = nixl.stats().await.unwrap().transfers;
            let op = nixl.begin_read(&md, Descriptor::from(&mut big)).await.unwrap();
            posted(&nixl, before, || op.status()).await;
            frozen.signal(libc::SIGSTOP);
            let t0 = Instant::now();
            match op.wait_for_completion(Some(deadline)).await {
                Ok(()) => {
                    println!("nixl: the transfer finished before the stop landed; again");
                    frozen.signal(libc::SIGCONT);
                    frozen.say("drop");
                    frozen.expect("DROPPED");
                    continue;
                }
                Err(e) => {
                    let took = t0.elapsed();
                    assert!(matches!(&e, Error::TimedOut { .. }), "{e}");
                    assert!(took < deadline + margin, "nixl wait took {took:?}");
                    let h = healthy_read(nixl.clone(), &mut healthy).await;
                    println!("nixl: timed out after {took:?}; a healthy peer's read meanwhile took {h:?}");
                }
            }
            let resets = nixl.stats().await.unwrap().resets;
            let t0 = Instant::now();
            drop(op); // waits the grace, then cuts the frozen transfer off
            let took = t0.elapsed();
            assert!(
                took < grace + margin,
                "dropping a borrowed NIXL read took {took:?}"
            );
            big.fill(1); // the borrow has ended
            assert_eq!(nixl.stats().await.unwrap().resets, resets + 1);
            println!("nixl: the borrowed drop returned after {took:?} (initiator reset)");
            let h = healthy_read(nixl.clone(), &mut healthy).await;
            println!("nixl: a healthy peer's read after the reset took {h:?}");
            frozen.signal(libc::SIGCONT);
            frozen.say("drop");
            frozen.expect("DROPPED");
            caught = true;
            break;
        }
        assert!(caught, "no NIXL transfer was caught in flight by the stop");

        // 3. Passive side: the active peer stops before it reads.
        let r = auto
            .create_readable(Descriptor::from(vec![5u8; 4096]))
            .await
            .unwrap();
        frozen.signal(libc::SIGSTOP);
        let t0 = Instant::now();
        let e = r.wait_for_completion(Some(deadline)).await.unwrap_err();
        assert!(matches!(e, Error::TimedOut { .. }), "{e}");
        assert!(t0.elapsed() < deadline + margin);
        frozen.signal(libc::SIGCONT);
        println!("passive: timed out after {:?}", t0.elapsed());
        println!("STOPPED-OK");
    });
}

#[test]
fn deadline_holds_when_peer_is_killed() {
    let text = run_support(
        "soundness::support_deadline_killed",
        &[("UCX_TLS", tcp_tls().as_ref())],
    );
    assert!(text.contains("KILLED-OK"), "{text}");
}

#[test]
#[ignore = "run by deadline_holds_when_peer_is_killed with UCX_TLS=tcp"]
fn support_deadline_killed() {
    let Ok(_) = std::env::var(PEER_ENV) else { return };
    runtime().block_on(async {
        let deadline = Duration::from_secs(5);
        let mut gone = 0;
        for policy in [PathPolicy::Auto, PathPolicy::Nixl] {
            let conn = Connector::builder().path(policy).build().unwrap();
            for _ in 0..3 {
                let mut peer = sound_peer();
                peer.say(&format!("expose readable {} host", 256 * MIB));
                let md: RdmaMetadata = peer.expect("MD:").parse().unwrap();
                let mut dst = HostBuffer::new(256 * MIB).unwrap();
                let before = conn.stats().await.unwrap().transfers;
                let op = conn.begin_read(&md, Descriptor::from(&mut dst)).await.unwrap();
                if policy == PathPolicy::Nixl {
                    posted(&conn, before, || op.status()).await;
                }
                peer.signal(libc::SIGKILL);
                let t0 = Instant::now();
                match op.wait_for_completion(Some(deadline)).await {
                    Ok(()) => println!("{policy:?}: finished before the kill landed"),
                    Err(e) => {
                        assert!(
                            !matches!(e, Error::TimedOut { .. }),
                            "{policy:?}: a dead peer is an error, not a hang"
                        );
                        assert!(t0.elapsed() < deadline);
                        gone += 1;
                        println!(
                            "{policy:?}: peer killed mid-transfer: {e} after {:?}",
                            t0.elapsed()
                        );
                    }
                }
                drop(op);
            }
        }
        assert!(gone > 0, "no transfer was caught in flight by a kill");
        // Passive side: the active peer is killed before it finishes; the wait ends at its deadline.
        let conn = Connector::new().unwrap();
        let r = conn
            .create_readable(Descriptor::from(vec![5u8; 4096]))
            .await
            .unwrap();
        let peer = sound_peer();
        peer.signal(libc::SIGKILL);
        let t0 = Instant::now();
        let e = r
            .wait_for_completion(Some(Duration::from_secs(1)))
            .await
            .unwrap_err();
        assert!(matches!(e, Error::TimedOut { .. }), "{e}");
        assert!(t0.elapsed() < Duration::from_secs(2));
        println!("KILLED-OK");
    });
}

/// The seed of the peer's patterned memory (`hostpat`, `vecpat`, `write ... pat`, `check pat`).
pub(crate) const PAT: u64 = 41;

/// The peer process: one command per stdin line.
///
/// - `expose readable|writable LEN host|vec|hostpat|vecpat [again]`: prints `MD:<json>`, keeps
///   the operation (`*pat`: filled with [`pattern`] (seed [`PAT`]), else 0x5A; `again`: over the
///   memory of the last `again` readable a `wait` saw complete, if any, so that its metadata is
///   the same but for the key);
/// - `check pat|77`: prints `CHECK:true` when the writable's memory is [`pattern`] (or all 0x77);
/// - `wait MS`: waits for it, prints `WAIT:ok` or `WAIT:<error>` (an `again` readable that
///   completed then gives its memory back for the next);
/// - `drop`: drops it and its memory, prints `DROPPED`;
/// - `read auto|nixl|local [fresh]` then a metadata line: reads it (with a fresh connector when
///   `fresh`), prints `STARTED` once the transfer is under way, then
///   `READ:ok first=<byte> path=<path> mechanism=<m> same=<every byte as the first> pattern=<it is
///   [`pattern`]>` or `READ:err <error>`;
/// - `probe auto|nixl|local` then a metadata line: asks a fresh connector of that policy which
///   path an operation with that peer would take (`Connector::probe`), prints
///   `PROBE:path=<path or none> mechanism=<m or none> declined=<path: reason | ...>` or
///   `PROBE:err <error>`;
/// - `deadline MS`: the deadline of later reads and writes (20 s until then), prints `DEADLINE`;
/// - `write auto|nixl|local [pat]` then a metadata line: writes 0x77 bytes ([`pattern`]) into it, prints
///   `STARTED`, then `MECHANISM:<how the same-host path moved it, or none>` and `WRITE:ok` or
///   `WRITE:err <error>`.
#[test]
#[ignore = "run by the soundness tests as their peer"]
fn support_sound_peer() {
    let Ok(_) = std::env::var(PEER_ENV) else { return };
    use std::io::BufRead;
    runtime().block_on(async {
        let conn = Connector::new().unwrap();
        let mut readers: Vec<(PathPolicy, Connector)> = Vec::new();
        let stdin = std::io::stdin();
        let mut lines = stdin.lock().lines();
        let mut readable = None;
        let mut writable = None;
        let mut again = false;
        let mut kept: Option<Descriptor<'static>> = None;
        let mut deadline = Duration::from_secs(20);
        while let Some(Ok(line)) = lines.next() {
            let w: Vec<&str> = line.split_whitespace().collect();
            match w.first().copied() {
                Some("expose") => {
                    let len: usize = w[2].parse().unwrap();
                    again = w.get(4) == Some(&"again");
                    let d = match w[3] {
                        _ if again && w[1] == "readable" && kept.is_some() => kept.take().unwrap(),
                        "host" | "hostpat" => {
                            let mut b = HostBuffer::new(len).unwrap();
                            if w[3] == "host" {
                                b.fill(0x5A);
                            } else {
                                b.copy_from_slice(&pattern(len, PAT));
                            }
                            Descriptor::from(b)
                        }
                        "vecpat" => Descriptor::from(pattern(len, PAT)),
                        _ => Descriptor::from(vec![0x5Au8; len]),
                    };
                    let md = if w[1] == "readable" {
                        let r = conn.create_readable(d).await.unwrap();
                        let md = r.metadata().to_json();
                        readable = Some(r);
                        md
                    } else {
                        let r = conn.create_writable(d).await.unwrap();
                        let md = r.metadata().to_json();
                        writable = Some(r);
                        md
                    };
                    println!("MD:{md}");
                }
                Some("wait") => {
                    let t = Some(Duration::from_millis(w[1].parse().unwrap()));
                    let r = match (&readable, &writable) {
                        (Some(r), _) => r.wait_for_completion(t).await,
                        (_, Some(w)) => w.wait_for_completion(t).await,
                        _ => Ok(()),
                    };
                    if r.is_ok() && again {
                        kept = readable.take().map(|r| r.into_descriptors().remove(0));
                    }
                    println!("WAIT:{}", r.map_or_else(|e| e.to_string(), |()| "ok".into()));
                }
                Some("check") => {
                    let d = writable.take().map(|w| w.into_descriptors());
                    let ok = d.as_ref().and_then(|d| d[0].as_slice()).is_some_and(|b| {
                        if w[1] == "pat" {
                            b == pattern(b.len(), PAT).as_slice()
                        } else {
                            all_bytes(b, 0x77)
                        }
                    });
                    println!("CHECK:{ok}");
                }
                Some("deadline") => {
                    deadline = Duration::from_millis(w[1].parse().unwrap());
                    println!("DEADLINE");
                }
                Some("name") => println!("NAME:{}", conn.name()),
                Some("fds") => println!("FDS:{}", std::fs::read_dir("/proc/self/fd").unwrap().count()),
                Some("drop") => {
                    readable = None;
                    writable = None;
                    println!("DROPPED");
                }
                Some("read") => {
                    let policy: PathPolicy = w[1].parse().unwrap();
                    let fresh = w.get(2) == Some(&"fresh");
                    let md: RdmaMetadata = lines.next().unwrap().unwrap().parse().unwrap();
                    let c = if fresh {
                        Connector::builder().path(policy).build().unwrap()
                    } else {
                        match readers.iter().find(|(p, _)| *p == policy) {
                            Some((_, c)) => c.clone(),
                            None => {
                                let c = Connector::builder().path(policy).build().unwrap();
                                readers.push((policy, c.clone()));
                                c
                            }
                        }
                    };
                    let len: usize = md.descriptors.iter().map(|d| d.size as usize).sum();
                    let before = c.stats().await.unwrap().transfers;
                    let r = match c.begin_read(&md, Descriptor::from(vec![0u8; len])).await {
                        Ok(op) => {
                            if policy == PathPolicy::Nixl {
                                posted(&c, before, || op.status()).await;
                            }
                            println!("STARTED");
                            use std::io::Write;
                            std::io::stdout().flush().unwrap();
                            match op.wait_for_completion(Some(deadline)).await {
                                Ok(()) => {
                                    let path = op.path().map_or("?".into(), |p| p.to_string());
                                    let m = op.mechanism().map_or("none".into(), |m| m.to_string());
                                    let back = op.into_descriptors().unwrap();
                                    let bytes = back[0].as_slice().unwrap();
                                    let same = all_bytes(bytes, bytes[0]);
                                    let pat = bytes == pattern(bytes.len(), PAT).as_slice();
                                    Ok((
                                        bytes[0],
                                        format!("{path} mechanism={m} same={same} pattern={pat}"),
                                    ))
                                }
                                Err(e) => Err(e),
                            }
                        }
                        Err(e) => {
                            println!("STARTED");
                            Err(e)
                        }
                    };
                    match r {
                        Ok((first, path)) => println!("READ:ok first={first} path={path}"),
                        Err(e) => println!("READ:err {e}"),
                    }
                }
                Some("probe") => {
                    let policy: PathPolicy = w[1].parse().unwrap();
                    let md: RdmaMetadata = lines.next().unwrap().unwrap().parse().unwrap();
                    let c = Connector::builder().path(policy).build().unwrap();
                    match c.probe(&md, nixl_connect::Device::Host).await {
                        Ok(p) => {
                            let declined: Vec<String> = p
                                .declined()
                                .iter()
                                .map(|(p, why)| format!("{p}: {why}"))
                                .collect();
                            println!(
                                "PROBE:path={} mechanism={} declined={}",
                                p.path().map_or("none".into(), |p| p.to_string()),
                                p.mechanism().map_or("none".into(), |m| m.to_string()),
                                declined.join(" | ")
                            );
                        }
                        Err(e) => println!("PROBE:err {e}"),
                    }
                }
                Some("write") => {
                    let policy: PathPolicy = w[1].parse().unwrap();
                    let md: RdmaMetadata = lines.next().unwrap().unwrap().parse().unwrap();
                    let c = Connector::builder().path(policy).build().unwrap();
                    let len: usize = md.descriptors.iter().map(|d| d.size as usize).sum();
                    let src = if w.get(2) == Some(&"pat") {
                        pattern(len, PAT)
                    } else {
                        vec![0x77u8; len]
                    };
                    let r = match c.begin_write(Descriptor::from(src), &md).await {
                        Ok(op) => {
                            println!("STARTED");
                            use std::io::Write;
                            std::io::stdout().flush().unwrap();
                            let r = op.wait_for_completion(Some(deadline)).await;
                            let m = op.mechanism().map_or("none".into(), |m| m.to_string());
                            println!("MECHANISM:{m}");
                            r
                        }
                        Err(e) => {
                            println!("STARTED");
                            println!("MECHANISM:none");
                            Err(e)
                        }
                    };
                    println!(
                        "WRITE:{}",
                        r.map_or_else(|e| format!("err {e}"), |()| "ok".into())
                    );
                }
                _ => panic!("unknown command {line:?}"),
            }
            use std::io::Write;
            std::io::stdout().flush().unwrap();
        }
    });
}
