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
mod state;

use std::sync::Arc;
use std::time::Duration;

pub use active::{ReadOperation, WriteOperation};
pub use passive::{ReadableOperation, WritableOperation};
pub(crate) use state::OpState;

use crate::error::{Error, Result};

/// Which path moved an operation's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
#[non_exhaustive]
pub enum TransferPath {
    /// NIXL (UCX): Python peers, other hosts, device memory.
    Nixl = 1,
    /// The same-host path: a Rust peer on this host, host memory copied directly.
    Local = 2,
}

impl TransferPath {
    pub(crate) fn from_u8(v: u8) -> Option<Self> {
        match v {
            1 => Some(Self::Nixl),
            2 => Some(Self::Local),
            _ => None,
        }
    }
}

impl std::fmt::Display for TransferPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Nixl => "nixl",
            Self::Local => "local",
        })
    }
}

/// Which paths a connector's active operations may take
/// ([`ConnectorBuilder::path`](crate::ConnectorBuilder::path)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum PathPolicy {
    /// The same-host path when the peer is a Rust connector on this host, NIXL otherwise.
    #[default]
    Auto,
    /// NIXL only; the connector does not listen for same-host peers either.
    Nixl,
    /// The same-host path only: an operation it cannot take fails with
    /// [`Error::PathUnavailable`](crate::Error::PathUnavailable) (for benchmarks and tests).
    Local,
}

impl std::str::FromStr for PathPolicy {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(Self::Auto),
            "nixl" => Ok(Self::Nixl),
            "local" => Ok(Self::Local),
            other => Err(Error::InvalidArgument(format!(
                "path {other:?} is not one of auto, nixl, local"
            ))),
        }
    }
}

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

/// Waits for `state` to end, or for `timeout` (then [`Error::TimedOut`] naming `peer`).
async fn wait(state: &Arc<OpState>, timeout: Option<Duration>, peer: Option<&str>) -> Result<()> {
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
        Some(t) => tokio::time::timeout(t, fut).await.map_err(|_| Error::TimedOut {
            after: t,
            peer: peer.map(str::to_owned),
        })?,
    }
}
