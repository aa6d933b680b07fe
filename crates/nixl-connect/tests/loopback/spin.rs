//! Waits that stay awake before they park (`ConnectorBuilder::wait_spin`): the spin is
//! cooperative (the runtime's other tasks run between its turns), a deadline shorter than the
//! spin still ends the wait, and a wait dropped in the middle of its spin leaves the operation as
//! it was; a spin ends and the wait parks; large operations and waits beyond the connector's
//! bound on spinning waits park at once. Over the loopback transport, stepped by stalling and
//! releasing the reader's node; no assertion on how long anything takes (one test sleeps 100 ms
//! twice past a 1 ms spin and checks that nothing polled the parked wait meanwhile).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use nixl_connect::{
    testing, Connector, Descriptor, Error, OperationStatus, ReadOperation, ReadableOperation, MAX_WAIT_SPIN,
};

/// The most bytes a small operation moves in all, as `ConnectorBuilder::wait_spin` documents.
const SMALL: usize = 64 << 10;

const T: Option<Duration> = Some(Duration::from_secs(5));

fn spinning_pair() -> (Connector, Connector) {
    // What these tests check must not depend on how loaded the machine is.
    testing::keep_spinning();
    let a = Connector::builder().build_loopback().unwrap();
    let b = Connector::builder()
        .wait_spin(MAX_WAIT_SPIN)
        .build_loopback()
        .unwrap();
    (a, b)
}

/// Counts the polls of the future it wraps.
struct Polls<F> {
    inner: Pin<Box<F>>,
    polls: Arc<AtomicUsize>,
}

impl<F: Future> Future for Polls<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        self.polls.fetch_add(1, Ordering::Relaxed);
        self.inner.as_mut().poll(cx)
    }
}

/// A readable of `len` bytes of `seed` on `a`, and `b`'s read of it held in flight (`b` stalled).
async fn stalled_read(
    a: &Connector,
    b: &Connector,
    len: usize,
    seed: u8,
) -> (ReadableOperation<'static>, ReadOperation<'static>) {
    let r = a
        .create_readable(Descriptor::from(vec![seed; len]))
        .await
        .unwrap();
    assert!(testing::stall(b, true));
    let op = b
        .begin_read(r.metadata(), Descriptor::from(vec![0u8; len]))
        .await
        .unwrap();
    (r, op)
}

#[tokio::test(flavor = "current_thread")]
async fn loopback_wait_spin_lets_other_tasks_run() {
    let (a, b) = spinning_pair();
    let (r, op) = stalled_read(&a, &b, 4096, 5).await;
    // On this one thread, another task takes 100 turns, then releases the reader's node: the
    // read can end only after that task has run.
    let turns = Arc::new(AtomicUsize::new(0));
    let (t, b2) = (turns.clone(), b.clone());
    let other = tokio::spawn(async move {
        while t.fetch_add(1, Ordering::Relaxed) < 100 {
            tokio::task::yield_now().await;
        }
        assert!(testing::stall(&b2, false));
    });
    let polls = Arc::new(AtomicUsize::new(0));
    Polls {
        inner: Box::pin(op.wait_for_completion(T)),
        polls: polls.clone(),
    }
    .await
    .unwrap();
    other.await.unwrap();
    // A spin that held the thread would be polled twice (the spin, then the wake-up after it
    // parked); a cooperative one is polled on each of its turns, which the other task's turns
    // came between.
    assert!(
        polls.load(Ordering::Relaxed) > 2,
        "the wait was polled {} times: its spin did not yield to the runtime",
        polls.load(Ordering::Relaxed)
    );
    assert_eq!(op.status(), OperationStatus::Complete);
    r.wait_for_completion(T).await.unwrap();
    // Already ended: the wait returns without spinning.
    op.wait_for_completion(Some(Duration::ZERO)).await.unwrap();
}

#[tokio::test(flavor = "current_thread")]
async fn loopback_wait_spin_deadline_shorter_than_the_spin_times_out() {
    let (a, b) = spinning_pair();
    let (r, op) = stalled_read(&a, &b, 4096, 6).await;
    let e = op
        .wait_for_completion(Some(Duration::from_millis(1)))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::TimedOut { peer: Some(_), .. }), "{e}");
    assert_eq!(
        op.status(),
        OperationStatus::InProgress,
        "a deadline leaves the transfer live"
    );
    assert!(testing::stall(&b, false));
    op.wait_for_completion(T).await.unwrap();
    r.wait_for_completion(T).await.unwrap();
}

#[tokio::test(flavor = "current_thread")]
async fn loopback_wait_spin_dropped_mid_spin_leaves_the_operation() {
    let (a, b) = spinning_pair();
    let (r, op) = stalled_read(&a, &b, 4096, 7).await;
    // Ten turns of the runtime into the read's spin (10 ms), the wait is dropped.
    let polls = Arc::new(AtomicUsize::new(0));
    let mut wait = Polls {
        inner: Box::pin(op.wait_for_completion(T)),
        polls: polls.clone(),
    };
    for _ in 0..10 {
        tokio::select! {
            biased;
            res = &mut wait => panic!("a stalled read ended: {res:?}"),
            () = tokio::task::yield_now() => {}
        }
    }
    assert!(
        polls.load(Ordering::Relaxed) >= 10,
        "the wait was polled between the turns"
    );
    drop(wait);
    assert_eq!(
        op.status(),
        OperationStatus::InProgress,
        "dropping the wait changes nothing"
    );
    assert_eq!(r.status(), OperationStatus::Initialized);
    assert!(testing::stall(&b, false));
    op.wait_for_completion(T).await.unwrap();
    r.wait_for_completion(T).await.unwrap();
    let mut got = op.into_descriptors().unwrap();
    assert_eq!(got[0].as_slice().unwrap(), &[7u8; 4096][..], "the bytes arrived");
    got.clear();
}

#[test]
fn loopback_wait_spin_above_the_limit_is_refused() {
    let e = Connector::builder()
        .wait_spin(MAX_WAIT_SPIN + Duration::from_micros(1))
        .build_loopback()
        .expect_err("a spin above the limit is refused");
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    assert!(e.to_string().contains("wait spin"), "{e}");
}

/// A stalled read of `len` bytes from `a` into `b`, and its wait polled on its own task; returns
/// the poll counter, the readable and the task (which ends with the wait's outcome).
async fn stalled_wait(
    a: &Connector,
    b: &Connector,
    len: usize,
) -> (
    Arc<AtomicUsize>,
    ReadableOperation<'static>,
    tokio::task::JoinHandle<nixl_connect::Result<()>>,
) {
    let (r, op) = stalled_read(a, b, len, 8).await;
    let (polls, task) = spawn_wait(op);
    (polls, r, task)
}

/// `op`'s wait, polled on its own task (from the caller's next await on); returns its poll
/// counter and the task.
fn spawn_wait(
    op: ReadOperation<'static>,
) -> (
    Arc<AtomicUsize>,
    tokio::task::JoinHandle<nixl_connect::Result<()>>,
) {
    let polls = Arc::new(AtomicUsize::new(0));
    let p = polls.clone();
    let task = tokio::spawn(async move {
        Polls {
            inner: Box::pin(op.wait_for_completion(T)),
            polls: p,
        }
        .await
    });
    (polls, task)
}

#[tokio::test(flavor = "current_thread")]
async fn loopback_wait_spin_parks_once_its_spin_is_over() {
    testing::keep_spinning();
    let a = Connector::builder().build_loopback().unwrap();
    let b = Connector::builder()
        .wait_spin(Duration::from_millis(1))
        .build_loopback()
        .unwrap();
    let (polls, r, task) = stalled_wait(&a, &b, 4096).await;
    // Far past the 1 ms spin the wait has parked: nothing polls it while the read is stalled.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let parked = polls.load(Ordering::Relaxed);
    assert!(parked > 1, "the wait spun ({parked} polls)");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        polls.load(Ordering::Relaxed),
        parked,
        "a wait whose spin is over is polled only when the engine wakes it"
    );
    assert!(testing::stall(&b, false));
    task.await.unwrap().unwrap();
    r.wait_for_completion(T).await.unwrap();
}

#[tokio::test(flavor = "current_thread")]
async fn loopback_wait_spin_skips_large_operations() {
    let (a, b) = spinning_pair();
    let (polls, r, task) = stalled_wait(&a, &b, SMALL + 4096).await;
    for _ in 0..100 {
        tokio::task::yield_now().await;
    }
    assert_eq!(
        polls.load(Ordering::Relaxed),
        1,
        "a wait of more than 64 KiB parks at its first poll"
    );
    assert!(testing::stall(&b, false));
    task.await.unwrap().unwrap();
    r.wait_for_completion(T).await.unwrap();
    // At the limit, it spins.
    let (polls, r, task) = stalled_wait(&a, &b, SMALL).await;
    for _ in 0..100 {
        tokio::task::yield_now().await;
    }
    assert!(polls.load(Ordering::Relaxed) > 1, "a wait of 64 KiB spins");
    assert!(testing::stall(&b, false));
    task.await.unwrap().unwrap();
    r.wait_for_completion(T).await.unwrap();
}

#[tokio::test(flavor = "current_thread")]
async fn loopback_wait_spin_bounds_the_waits_spinning_at_once() {
    let (a, b) = spinning_pair();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let bound = (cores / 2).max(1);
    let n = bound + 3;
    // Every read first, then every wait at once: their first polls come in one turn of the
    // runtime, well inside the first one's 10 ms spin (on a loaded host, making a read can take
    // longer than that, and a spin that ran out would hand its place to the next wait).
    let mut reads = Vec::new();
    for _ in 0..n {
        reads.push(stalled_read(&a, &b, 4096, 9).await);
    }
    let waits: Vec<_> = reads
        .into_iter()
        .map(|(r, op)| {
            let (polls, task) = spawn_wait(op);
            (polls, r, task)
        })
        .collect();
    for _ in 0..100 {
        tokio::task::yield_now().await;
    }
    let spinning = waits
        .iter()
        .filter(|(polls, _, _)| polls.load(Ordering::Relaxed) > 1)
        .count();
    assert!(
        (1..=bound).contains(&spinning),
        "{spinning} of {n} waits spin; at most {bound} may ({cores} cores)"
    );
    assert!(testing::stall(&b, false));
    for (_, r, task) in waits {
        task.await.unwrap().unwrap();
        r.wait_for_completion(T).await.unwrap();
    }
    // Every place was given back: a new wait spins again.
    let (polls, r, task) = stalled_wait(&a, &b, 4096).await;
    for _ in 0..100 {
        tokio::task::yield_now().await;
    }
    assert!(polls.load(Ordering::Relaxed) > 1, "the places came back");
    assert!(testing::stall(&b, false));
    task.await.unwrap().unwrap();
    r.wait_for_completion(T).await.unwrap();
}
