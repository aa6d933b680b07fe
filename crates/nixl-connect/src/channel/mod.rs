//! Metadata channels: how a passive side's [`crate::RdmaMetadata`] reaches its peer.
//!
//! The library works with any side channel (the metadata is one JSON line); these are the ones
//! Dynamo deployments use:
//!
//! - [`http`] (feature `http`, on by default): an embedded HTTP server, one listener per process,
//!   each published operation under its own unguessable path. Good on one host or a flat network.
//! - `nats` (feature `nats`): NATS request/reply on a per-operation subject, for fleets whose
//!   workers already share a NATS server.
//! - `etcd` (feature `etcd`): a key held by a lease in the etcd a Dynamo deployment runs for
//!   discovery, for workers on many hosts.
//!
//! All unpublish when the returned publication guard is dropped: hold it as long as the
//! operation, and drop it when the operation completes (or is dropped).

#[cfg(feature = "etcd")]
pub mod etcd;
#[cfg(feature = "http")]
pub mod http;
#[cfg(feature = "nats")]
pub mod nats;
#[cfg(any(feature = "nats", feature = "etcd"))]
mod outage;
#[cfg(feature = "http")]
pub(crate) mod serve;

#[cfg(any(feature = "nats", feature = "etcd"))]
pub use outage::Outage;

#[cfg(any(feature = "http", feature = "nats", feature = "etcd"))]
use crate::error::{Error, MetadataProblem, Result};
#[cfg(any(feature = "http", feature = "nats", feature = "etcd"))]
use crate::metadata::RdmaMetadata;
#[cfg(feature = "http")]
use std::time::Duration;

/// The largest metadata document a channel accepts (16 MiB): agent metadata is a few KiB; the cap
/// keeps a hostile endpoint from exhausting memory.
pub const MAX_DOCUMENT: usize = 16 << 20;

/// Runs `fut` within `limit`: a channel that does not answer is [`Error::TimedOut`], never a hang.
#[cfg(feature = "http")]
async fn within<T>(limit: Duration, fut: impl std::future::Future<Output = Result<T>>) -> Result<T> {
    tokio::time::timeout(limit, fut)
        .await
        .map_err(|_| Error::timed_out(limit))?
}

/// A fetched metadata document (`what`, as errors name it), checked for size and parsed.
#[cfg(any(feature = "http", feature = "nats", feature = "etcd"))]
fn parse_document(what: std::fmt::Arguments<'_>, bytes: &[u8]) -> Result<RdmaMetadata> {
    if bytes.len() > MAX_DOCUMENT {
        return Err(Error::channel(format!(
            "{what} is larger than {MAX_DOCUMENT} bytes"
        )));
    }
    let text =
        std::str::from_utf8(bytes).map_err(|e| Error::metadata_from("json", MetadataProblem::NotUtf8, e))?;
    RdmaMetadata::from_json(text)
}
