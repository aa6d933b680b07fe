use super::*;
use std::sync::mpsc::sync_channel;
use std::time::Duration;

/// A close that never returns (here: until the test lets it) holds one thread of its pool:
/// the next close handed to the same pool is made meanwhile, on another thread.
#[test]
fn closer_a_blocked_close_holds_only_its_own_thread() {
    let (release, blocked) = sync_channel::<()>(0);
    let (entered, wait_entered) = sync_channel::<()>(1);
    hand(
        2,
        "nixl-connect-closer-pipes",
        Box::new(move || {
            entered.send(()).unwrap();
            let _ = blocked.recv();
        }),
    );
    wait_entered.recv_timeout(Duration::from_secs(10)).unwrap();
    let (done, was_done) = sync_channel::<()>(1);
    hand(
        2,
        "nixl-connect-closer-pipes",
        Box::new(move || done.send(()).unwrap()),
    );
    was_done
        .recv_timeout(Duration::from_secs(10))
        .expect("the second close waited behind the blocked one");
    release.send(()).unwrap();
}

/// Two closes handed at once beside one idle thread: the first blocks, and the second still
/// runs (a thread is started when more closes wait than threads are idle, not only when none
/// is idle: the idle one was about to take the first).
#[test]
fn closer_two_closes_handed_at_once_both_run_when_the_first_blocks() {
    // One idle thread at least (in pool 1, kept for this test and for peers' descriptors).
    let (warm, warmed) = sync_channel::<()>(1);
    hand(
        1,
        "nixl-connect-closer-passed",
        Box::new(move || warm.send(()).unwrap()),
    );
    warmed.recv_timeout(Duration::from_secs(10)).unwrap();
    let (release, blocked) = sync_channel::<()>(0);
    let (done, was_done) = sync_channel::<()>(1);
    hand(
        1,
        "nixl-connect-closer-passed",
        Box::new(move || {
            let _ = blocked.recv();
        }),
    );
    hand(
        1,
        "nixl-connect-closer-passed",
        Box::new(move || done.send(()).unwrap()),
    );
    was_done
        .recv_timeout(Duration::from_secs(10))
        .expect("the second close waited behind the blocked one");
    release.send(()).unwrap();
}
