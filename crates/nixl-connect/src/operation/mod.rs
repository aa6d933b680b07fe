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

pub(crate) use crate::state::OpState;
pub use crate::state::{Mechanism, OperationStatus, PathPolicy, TransferPath};
pub use active::{ReadOperation, WriteOperation};
pub use passive::{ReadableOperation, WritableOperation};

use crate::error::Result;

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
    let op = ["read", "write"][kind as usize];
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
