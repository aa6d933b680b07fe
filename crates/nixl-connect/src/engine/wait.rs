//! Who waits how: an operation's wait ([`Engine::wait`]) spins, drives the engine or parks. A small
//! operation ([`Pace::small`](crate::pace::Pace::small)) spins only from a place among the waits that
//! spin ([`Engine::spin_slot`], at most [`max_spinning`](super::max_spinning)), and only where that
//! is worthwhile ([`pace::worthwhile`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Engine;
use crate::error::{Error, Result};
use crate::pace::{self, PACE};
use crate::state::{OpState, OperationStatus};

/// [`Engine::wait`]'s body.
pub(super) async fn wait(
    engine: &Engine,
    state: &Arc<OpState>,
    timeout: Option<Duration>,
    peer: Option<&str>,
    bytes: usize,
) -> Result<()> {
    // Only a small operation's wait spins, and only with a wait spin.
    let spin = engine.wait_spin();
    let may_spin = PACE.small(bytes) && !spin.is_zero();
    let fut = async {
        let mut spinning = (may_spin && !state.status().is_terminal() && pace::worthwhile())
            .then(|| engine.spin_slot().map(|slot| (slot, Instant::now() + spin)))
            .flatten();
        if may_spin && !spinning.as_ref().is_some_and(|(slot, _)| slot.drives()) {
            // This wait will not drive: a NIXL transfer its caller posted must not wait for the
            // engine's alarm.
            engine.0.drive.attend();
        }
        // The first turn does not yield: the operation has just been begun or exposed.
        let mut last_yield = Instant::now();
        loop {
            let notified = state.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let status = state.status();
            if let (true, Some((slot, _))) = (status.is_terminal(), &mut spinning) {
                // Nothing of the operation is left for the engine to take over.
                slot.finished();
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
                    let drove = engine.0.drive.drive();
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
            let peer = peer.map(str::to_owned);
            Error::TimedOut { after: t, peer }
        })?,
    }
}
