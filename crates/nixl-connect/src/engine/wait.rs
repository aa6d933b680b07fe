//! Who waits how: an operation's wait, which decides whether its thread spins, drives the
//! engine or parks.
//!
//! The operation layer calls [`Engine::wait`](super::Engine::wait) with the bytes the operation
//! moves; everything else is decided here and in the pieces this file names:
//! - a small operation ([`Pace::small`](crate::pace::Pace::small)) with a wait spin
//!   ([`ConnectorBuilder::wait_spin`](crate::ConnectorBuilder::wait_spin)) takes a place among
//!   the waits that spin ([`Engine::spin_slot`]: at most [`max_spinning`](super::max_spinning)),
//!   if spinning is worthwhile on this core ([`pace::worthwhile`]);
//! - a spinning wait that entered the engine's gate drives it (`driver`): it takes the engine's
//!   turns itself while the engine thread stands down, and yields its core at most once per
//!   [`Pace::turn_gap`](crate::pace::Pace::turn_gap), ending its spin beside another spinner on its core
//!   ([`pace::yield_driving`]); one that does not drive yields every turn ([`pace::yield_core`]);
//! - anything else, or a spin run out, parks until the engine wakes the operation.
//!
//! The slot is a guard: dropping it gives the place back and, for a driving wait, hands the
//! engine's turns back to its thread (`driver::Drive::leave`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Engine;
use crate::error::{Error, Result};
use crate::pace::{self, PACE};
use crate::state::{OpState, OperationStatus};

/// How a wait over `bytes` may spin: the engine (whose waits spinning at once are bounded) and
/// its wait spin for a small operation; none for a large one.
fn spin_for(engine: &Engine, bytes: usize) -> Option<(&Engine, Duration)> {
    let spin = engine.wait_spin();
    (PACE.small(bytes) && !spin.is_zero()).then_some((engine, spin))
}

/// Waits for `state` to end, or for `timeout` (then [`Error::TimedOut`] naming `peer`).
///
/// For a small operation with a wait spin, and a place among the engine's waits that spin free
/// ([`Engine::spin_slot`]), the wait first stays awake for up to that long
/// ([`ConnectorBuilder::wait_spin`](crate::ConnectorBuilder::wait_spin)): each turn looks at
/// the status, gives the thread's core away (`sched_yield`, so an engine thread sharing the core
/// runs: on every turn, or at most once per [`Pace::turn_gap`](crate::pace::Pace::turn_gap) where the wait took the
/// engine's turn itself; on an oversubscribed core, where a yield takes a time slice, the
/// thread's waits stop spinning, and a wait that drives ends its spin beside another thread that
/// spins on the same core: see [`crate::pace`]) and yields to the runtime (so its other tasks
/// run), instead of parking the task until the engine wakes it. The engine's wake-up is
/// registered on every turn too, so an executor that never runs the runtime's deferred wake-ups
/// (a `block_on` inside a tokio task) still sees the end.
pub(super) async fn wait(
    engine: &Engine,
    state: &Arc<OpState>,
    timeout: Option<Duration>,
    peer: Option<&str>,
    bytes: usize,
) -> Result<()> {
    let may_spin = spin_for(engine, bytes);
    let fut = async {
        let mut spinning = match may_spin {
            Some((engine, d)) if !state.status().is_terminal() && pace::worthwhile() => {
                engine.spin_slot().map(|slot| (slot, Instant::now() + d))
            }
            _ => None,
        };
        if let Some((engine, _)) = may_spin {
            if !spinning.as_ref().is_some_and(|(slot, _)| slot.drives()) {
                // This wait will not drive: a NIXL transfer its caller posted must not wait for
                // the engine's alarm.
                engine.attend();
            }
        }
        // The first turn does not yield: the operation has just been begun or exposed.
        let mut last_yield = Instant::now();
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
            let now = Instant::now();
            match &spinning {
                Some((_, until)) if now < *until => {
                    // The engine stands down while this wait spins: its turns are taken here.
                    let drove = may_spin.is_some_and(|(engine, _)| engine.drive());
                    // A wait that drives yields at most once per `Pace::turn_gap`, and ends its spin
                    // beside another thread spinning on this core; one that does not (the
                    // engine thread does the work) yields on every turn, so the engine runs.
                    let go_on = if !drove {
                        last_yield = now;
                        pace::yield_core()
                    } else if now.saturating_duration_since(last_yield) >= PACE.turn_gap() {
                        last_yield = now;
                        pace::yield_driving()
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
