//! Stream order: an operation over device memory starts only after the work queued on the memory's
//! producer stream before the operation was created, and never waits for anything else.
//!
//! A descriptor may name the stream that fills (or last uses) its memory ([`Producer`]): a cudarc
//! slice's own stream, or a raw `CUstream` (a torch tensor's current stream, from the Python
//! module). When an operation is created, [`after`] asks the driver about each such stream: an idle
//! stream costs one `cuStreamQuery`; a busy one gets a host function (`cuLaunchHostFunc`) queued
//! behind its work, which wakes the operation when the driver reaches it. Nothing blocks: no thread
//! waits on the device, and work on other streams of the context (a model's forward pass, a long
//! NCCL kernel) is not waited for, unlike a `cuCtxSynchronize`.
//!
//! Work queued on the producer stream *after* the operation was created may still race with the
//! transfer, as with any stream-ordered API: queue it after the operation completes.

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::sys::CUresult;

use super::{failed, CudaStream};
use crate::error::{Error, Result};
use crate::sys::cuda::{self as floor, Context, Failed, Stream};

/// How often a stream whose host function has not run yet is asked whether it failed (a host
/// function never runs once its context has failed; this turns that into an error, not a hang).
const HEALTH_CHECK: Duration = Duration::from_secs(1);

/// The stream whose earlier work produced (or still uses) a descriptor's device memory.
#[derive(Clone)]
pub(crate) enum Producer {
    /// A cudarc stream, kept alive by the descriptor.
    Stream(Arc<CudaStream>),
    /// A raw `CUstream` of device `ordinal`'s primary context (`0` or `1`: the legacy default
    /// stream, `2`: the per-thread default stream), which its owner keeps alive.
    Raw {
        /// The stream handle.
        stream: usize,
        /// The device whose primary context the stream belongs to.
        ordinal: u32,
    },
}

impl std::fmt::Debug for Producer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Producer::Stream(s) => write!(f, "Stream({:p})", s.cu_stream()),
            Producer::Raw { stream, ordinal } => write!(f, "Raw({stream:#x} on cuda:{ordinal})"),
        }
    }
}

impl Producer {
    fn key(&self) -> (usize, usize) {
        match self {
            Producer::Stream(s) => (s.cu_stream() as usize, s.context().cu_ctx() as usize),
            Producer::Raw { stream, ordinal } => (*stream, *ordinal as usize),
        }
    }

    fn context(&self) -> Result<Context> {
        match self {
            Producer::Stream(s) => Ok(s.context().cu_ctx()),
            Producer::Raw { ordinal, .. } => {
                floor::primary(*ordinal).map_err(|r| failed(("retaining the device's primary context", r)))
            }
        }
    }

    fn stream(&self) -> Stream {
        match self {
            Producer::Stream(s) => s.cu_stream(),
            Producer::Raw { stream, .. } => *stream as Stream,
        }
    }
}

/// A failed call on the producer stream.
fn on_producer((call, r): Failed) -> Error {
    Error::cuda_unavailable(format!("{call} on the producer stream failed: {r:?}"), None)
}

/// `Err` when `p` has failed (its context is broken): then its host function will never run.
fn healthy(p: &Producer) -> Result<()> {
    let Ok(ctx) = p.context() else { return Ok(()) };
    match floor::stream_state(ctx, p.stream()) {
        Ok(CUresult::CUDA_SUCCESS | CUresult::CUDA_ERROR_NOT_READY) => Ok(()),
        Ok(r) => Err(failed(("the producer stream", r))),
        Err(e) => Err(on_producer(e)),
    }
}

/// Waits until every producer's work queued so far is done (each stream once).
///
/// # Cancel safety
/// Cancel safe: dropping the future leaves at most a host function behind, which finds its
/// receiver gone and does nothing.
pub(crate) async fn after<'p>(producers: impl IntoIterator<Item = &'p Producer>) -> Result<()> {
    let mut seen = Vec::new();
    let mut waits = Vec::new();
    for p in producers {
        if seen.contains(&p.key()) {
            continue;
        }
        seen.push(p.key());
        if let Some(rx) = floor::when_reached(p.context()?, p.stream()).map_err(on_producer)? {
            waits.push((p, rx));
        }
    }
    for (p, mut rx) in waits {
        while tokio::time::timeout(HEALTH_CHECK, &mut rx).await.is_err() {
            healthy(p)?;
        }
    }
    Ok(())
}
