//! The four operations and their shared status machine.
//!
//! | passive (exposes memory, publishes metadata) | active (consumes metadata, moves data) |
//! |---|---|
//! | [`ReadableOperation`]: the peer reads it | [`ReadOperation`]: reads a readable |
//! | [`WritableOperation`]: the peer writes it | [`WriteOperation`]: writes a writable |
//!
//! Status moves `Initialized` (passive) or `InProgress` (active) to exactly one of `Complete`,
//! `Cancelled` or `Errored`, and never leaves a terminal status.

mod active;
mod passive;

use std::sync::Arc;
use std::time::Duration;

pub(crate) use crate::state::OpState;
pub use crate::state::{Mechanism, OperationStatus, PathPolicy, TransferPath};
pub use active::{ReadOperation, WriteOperation};
pub use passive::{ReadableOperation, WritableOperation};

use crate::engine::Engine;
use crate::error::{Error, Result};

/// The most bytes an operation moves, in all, for its wait to spin before it parks
/// ([`ConnectorBuilder::wait_spin`](crate::ConnectorBuilder::wait_spin)): past it the copy's own
/// time dwarfs a wake-up, and a waiter spinning beside the copy would take a core from it (64 MiB
/// reads went 4% slower with a 100 us spin on the 2-core VM).
pub const WAIT_SPIN_MAX_BYTES: usize = 64 << 10;

/// How a wait over `descs` may spin: the engine (whose waits spinning at once are bounded) and
/// its wait spin for a small operation; none for a large one.
fn spin_for<'e>(engine: &'e Engine, descs: &[crate::Descriptor<'_>]) -> Option<(&'e Engine, Duration)> {
    let bytes: usize = descs.iter().map(crate::Descriptor::size).sum();
    let spin = engine.wait_spin();
    (bytes <= WAIT_SPIN_MAX_BYTES && !spin.is_zero()).then_some((engine, spin))
}

/// Waits for `state` to end, or for `timeout` (then [`Error::TimedOut`] naming `peer`).
///
/// With `spin` (the engine and how long), and a place among the engine's waits that spin free
/// ([`Engine::spin_slot`]), the wait first stays awake for up to that long
/// ([`ConnectorBuilder::wait_spin`](crate::ConnectorBuilder::wait_spin)): each turn looks at
/// the status, gives the thread's core away (`sched_yield`, so an engine thread sharing the core
/// runs: on every turn, or at most once per [`crate::spin::YIELD_GAP`] where the wait took the
/// engine's turn itself; on an oversubscribed core, where a yield takes a time slice, the
/// thread's waits stop spinning, and a wait that drives ends its spin beside another thread that
/// spins on the same core: see [`crate::spin`]) and yields to the runtime (so its other tasks
/// run), instead of parking the task until the engine wakes it. The engine's wake-up is
/// registered on every turn too, so an executor that never runs the runtime's deferred wake-ups
/// (a `block_on` inside a tokio task) still sees the end.
async fn wait(
    state: &Arc<OpState>,
    timeout: Option<Duration>,
    peer: Option<&str>,
    spin: Option<(&Engine, Duration)>,
) -> Result<()> {
    let fut = async {
        let mut spinning = match spin {
            Some((engine, d)) if !state.status().is_terminal() && crate::spin::worthwhile() => engine
                .spin_slot()
                .map(|slot| (slot, std::time::Instant::now() + d)),
            _ => None,
        };
        if let Some((engine, _)) = spin {
            if !spinning.as_ref().is_some_and(|(slot, _)| slot.drives()) {
                // This wait will not drive: a NIXL transfer its caller posted must not wait for
                // the engine's alarm.
                engine.attend();
            }
        }
        // The first turn does not yield: the operation has just been begun or exposed.
        let mut last_yield = std::time::Instant::now();
        loop {
            let notified = state.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let status = state.status();
            if status.is_terminal() {
                if let Some((slot, _)) = &mut spinning {
                    // Nothing of the operation is left for the engine to take over.
                    slot.finished();
                }
            }
            match status {
                OperationStatus::Complete => return Ok(()),
                OperationStatus::Cancelled => return Err(Error::Cancelled),
                OperationStatus::Errored => return Err(state.error().unwrap_or(Error::EngineStopped)),
                _ => {}
            }
            let now = std::time::Instant::now();
            match &spinning {
                Some((_, until)) if now < *until => {
                    // The engine stands down while this wait spins: its turns are taken here.
                    let drove = spin.is_some_and(|(engine, _)| engine.drive());
                    // A wait that drives yields at most once per `YIELD_GAP`, and ends its spin
                    // beside another thread spinning on this core; one that does not (the
                    // engine thread does the work) yields on every turn, so the engine runs.
                    let go_on = if !drove {
                        last_yield = now;
                        crate::spin::yield_core()
                    } else if now.saturating_duration_since(last_yield) >= crate::spin::YIELD_GAP {
                        last_yield = now;
                        crate::spin::yield_driving()
                    } else {
                        true
                    };
                    if !go_on {
                        // The host is oversubscribed, or another thread spins on this core: the
                        // place goes back; the next turn parks.
                        spinning = None;
                    }
                    tokio::select! {
                        biased;
                        () = &mut notified => {}
                        () = tokio::task::yield_now() => {}
                    }
                }
                _ => {
                    // Spun out (or never spun): the place goes back before the task parks.
                    spinning = None;
                    notified.await
                }
            }
        }
    };
    match timeout {
        None => fut.await,
        Some(t) => tokio::time::timeout(t, fut).await.map_err(|_| {
            state.timed_out();
            Error::TimedOut {
                after: t,
                peer: peer.map(str::to_owned),
            }
        })?,
    }
}

/// An operation's `tracing` span (`nixl_connect.operation`, at DEBUG): the operation, side, id
/// (active side), bytes and descriptors at its start; the path, mechanism and status recorded
/// as they are known. Never the notification key (it is the capability to complete).
fn span(
    kind: crate::metadata::OperationKind,
    side: &'static str,
    id: Option<u64>,
    bytes: u64,
    descriptors: usize,
) -> tracing::Span {
    let op = match kind {
        crate::metadata::OperationKind::Read => "read",
        crate::metadata::OperationKind::Write => "write",
    };
    tracing::debug_span!(
        "nixl_connect.operation",
        op,
        side,
        id,
        bytes,
        descriptors,
        path = tracing::field::Empty,
        mechanism = tracing::field::Empty,
        status = tracing::field::Empty,
    )
}

/// Waits until the work queued so far on the descriptors' producer streams is done (stream order;
/// nothing else on the device is waited for). Without the `cuda` feature there is none.
///
/// # Cancel safety
/// Cancel safe: nothing has started yet.
async fn producers_done(descs: &[crate::descriptor::Descriptor<'_>]) -> Result<()> {
    #[cfg(feature = "cuda")]
    crate::cuda::after(descs.iter().filter_map(|d| d.producer())).await?;
    #[cfg(not(feature = "cuda"))]
    let _ = descs;
    Ok(())
}
