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
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use cudarc::driver::sys::{self, CUresult};
use tokio::sync::oneshot;

use super::CudaStream;
use crate::error::{Error, Result};
use crate::sync::Recover;

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

    fn context(&self) -> Result<sys::CUcontext> {
        match self {
            Producer::Stream(s) => Ok(s.context().cu_ctx()),
            Producer::Raw { ordinal, .. } => primary(*ordinal),
        }
    }

    fn stream(&self) -> sys::CUstream {
        match self {
            Producer::Stream(s) => s.cu_stream(),
            Producer::Raw { stream, .. } => *stream as sys::CUstream,
        }
    }
}

fn driver(call: &'static str, r: CUresult) -> Error {
    Error::cuda_unavailable(format!("{call} failed: {r:?}"), None)
}

/// Device `ordinal`'s primary context, retained once for the life of the process.
pub(crate) fn primary(ordinal: u32) -> Result<sys::CUcontext> {
    static CTX: OnceLock<Mutex<HashMap<u32, usize>>> = OnceLock::new();
    let mut map = CTX.get_or_init(Default::default).lock().recover();
    if let Some(&c) = map.get(&ordinal) {
        return Ok(c as sys::CUcontext);
    }
    let (mut dev, mut ctx): (sys::CUdevice, sys::CUcontext) = (0, std::ptr::null_mut());
    // SAFETY: driver calls writing into the locals; the context is retained and never released.
    let r = unsafe {
        match sys::cuInit(0) {
            CUresult::CUDA_SUCCESS => match sys::cuDeviceGet(&mut dev, ordinal as i32) {
                CUresult::CUDA_SUCCESS => sys::cuDevicePrimaryCtxRetain(&mut ctx, dev),
                e => e,
            },
            e => e,
        }
    };
    if r != CUresult::CUDA_SUCCESS {
        return Err(driver("retaining the device's primary context", r));
    }
    map.insert(ordinal, ctx as usize);
    Ok(ctx)
}

/// Runs `f` with `ctx` current on this thread, restoring whatever was current before.
fn in_context<T>(ctx: sys::CUcontext, f: impl FnOnce() -> T) -> Result<T> {
    // SAFETY: pushes a retained context on this thread's stack; popped below.
    let r = unsafe { sys::cuCtxPushCurrent_v2(ctx) };
    if r != CUresult::CUDA_SUCCESS {
        return Err(driver("cuCtxPushCurrent", r));
    }
    let out = f();
    let mut popped: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: pops the context pushed above.
    unsafe { sys::cuCtxPopCurrent_v2(&mut popped) };
    Ok(out)
}

/// Wakes the operation waiting for a stream; runs on a driver thread once the stream reaches it.
unsafe extern "C" fn reached(user: *mut c_void) {
    // SAFETY: `user` is the sender leaked by `queue` for this host function alone, taken back
    // exactly once, here.
    let tx = unsafe { Box::from_raw(user.cast::<oneshot::Sender<()>>()) };
    let _ = tx.send(());
}

/// Where `p` stands: `None` when its queued work is done, else a receiver woken when it is.
fn queue(p: &Producer) -> Result<Option<oneshot::Receiver<()>>> {
    let stream = p.stream();
    in_context(p.context()?, || {
        // SAFETY: queries a stream of the current context (the producer keeps it alive).
        match unsafe { sys::cuStreamQuery(stream) } {
            CUresult::CUDA_SUCCESS => return Ok(None),
            CUresult::CUDA_ERROR_NOT_READY => {}
            r => return Err(driver("cuStreamQuery on the producer stream", r)),
        }
        let (tx, rx) = oneshot::channel::<()>();
        let user = Box::into_raw(Box::new(tx));
        // SAFETY: `reached` takes `user` back when the driver runs it; if queuing fails the driver
        // never will, so it is taken back here.
        let r = unsafe { sys::cuLaunchHostFunc(stream, Some(reached), user.cast()) };
        if r != CUresult::CUDA_SUCCESS {
            // SAFETY: not queued: this is the only owner of `user`.
            drop(unsafe { Box::from_raw(user) });
            return Err(driver("cuLaunchHostFunc on the producer stream", r));
        }
        Ok(Some(rx))
    })?
}

/// Whether `p` has failed (its context is broken): then its host function will never run.
fn failed(p: &Producer) -> Option<Error> {
    let stream = p.stream();
    let ctx = p.context().ok()?;
    // SAFETY: queries a stream of the current context (the producer keeps it alive).
    match in_context(ctx, || unsafe { sys::cuStreamQuery(stream) }) {
        Ok(CUresult::CUDA_SUCCESS | CUresult::CUDA_ERROR_NOT_READY) => None,
        Ok(r) => Some(driver("the producer stream", r)),
        Err(e) => Some(e),
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
        if let Some(rx) = queue(p)? {
            waits.push((p, rx));
        }
    }
    for (p, mut rx) in waits {
        loop {
            match tokio::time::timeout(HEALTH_CHECK, &mut rx).await {
                Ok(_) => break,
                Err(_) => {
                    if let Some(e) = failed(p) {
                        return Err(e);
                    }
                }
            }
        }
    }
    Ok(())
}
