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

pub use active::{ReadOperation, WriteOperation};
pub use passive::{ReadableOperation, WritableOperation};

use crate::engine::OpState;
use crate::error::{Error, Result};

/// The status of an operation, as Python's `OperationStatus`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
#[non_exhaustive]
pub enum OperationStatus {
    /// Not yet set up.
    Uninitialized = 0,
    /// Set up and waiting for its peer (passive operations).
    Initialized = 1,
    /// Data is moving (active operations).
    InProgress = 2,
    /// Done: the data has arrived.
    Complete = 3,
    /// Cancelled by `cancel()` or drop.
    Cancelled = 4,
    /// Failed; `wait_for_completion` returns the error.
    Errored = 5,
}

impl OperationStatus {
    pub(crate) fn from_u8(v: u8) -> Self {
        match v {
            1 => Self::Initialized,
            2 => Self::InProgress,
            3 => Self::Complete,
            4 => Self::Cancelled,
            5 => Self::Errored,
            _ => Self::Uninitialized,
        }
    }

    /// True for `Complete`, `Cancelled` and `Errored`.
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Complete | Self::Cancelled | Self::Errored)
    }
}

impl std::fmt::Display for OperationStatus {
    /// Python's short names: `INIT`, `PROC`, `DONE`, `STOP`, `ERR`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Uninitialized => "<invalid>",
            Self::Initialized => "INIT",
            Self::InProgress => "PROC",
            Self::Complete => "DONE",
            Self::Cancelled => "STOP",
            Self::Errored => "ERR",
        })
    }
}

/// Waits for `state` to end, or for `timeout`.
///
/// Short operations end within microseconds, so the waiter first spins (yielding its core) for up
/// to [`WAITER_SPIN`](crate::engine::WAITER_SPIN) before parking its task.
async fn wait(state: &Arc<OpState>, timeout: Option<Duration>) -> Result<()> {
    let t0 = std::time::Instant::now();
    while !state.status().is_terminal() && t0.elapsed() < crate::engine::WAITER_SPIN {
        std::thread::yield_now();
    }
    let fut = async {
        loop {
            let notified = state.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            match state.status() {
                OperationStatus::Complete => return Ok(()),
                OperationStatus::Cancelled => return Err(Error::Cancelled),
                OperationStatus::Errored => return Err(state.error().unwrap_or(Error::EngineStopped)),
                _ => notified.await,
            }
        }
    };
    match timeout {
        None => fut.await,
        Some(t) => tokio::time::timeout(t, fut)
            .await
            .map_err(|_| Error::TimedOut(t))?,
    }
}
