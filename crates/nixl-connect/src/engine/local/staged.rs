//! Host memory of a peer into device memory of this process (feature `cuda`): cross-memory attach
//! into pinned staging buffers, each then copied to the device by DMA while the next is filled.
//!
//! CUDA IPC cannot open another process's host memory, so the side whose device memory is written
//! (the copier, as on every same-host path) pulls the peer's bytes with `process_vm_readv` (the
//! host path's grant, ptrace rules and revocation) into page-locked buffers of its own
//! (`cuMemHostAlloc`, kept in a process-wide pool) and queues `cuMemcpyHtoDAsync` from each. A copy
//! is cut in [`CHUNK`]-byte pieces shared by up to [`MAX_WORKERS`] threads; each thread has two
//! buffers and its own stream, so the pull of one piece overlaps the DMA of the one before.
//! Every stream is synchronised before the copy counts as done.
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{self, CUresult};

use super::cma::{self, Copy, CopyError, Piece, CHUNK};
use super::ipc::IpcError;
use super::slots::{ARMED, COPYING, DONE};
use crate::sync::Recover;

/// The most threads one staged copy uses.
const MAX_WORKERS: usize = 8;
/// Pinned buffers the pool keeps between copies (each [`CHUNK`] bytes).
const KEPT_BUFFERS: usize = 2 * MAX_WORKERS;

type Done = Box<dyn FnOnce(Result<(), CopyError>) + Send>;

/// Page-locked host buffers of [`CHUNK`] bytes, usable from every context.
static POOL: Mutex<Vec<usize>> = Mutex::new(Vec::new());

fn take_buffer() -> Result<usize, IpcError> {
    if let Some(b) = POOL.lock().recover().pop() {
        return Ok(b);
    }
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: allocates CHUNK page-locked bytes (PORTABLE: usable from every context) into `p`;
    // the buffer goes back to the pool or is freed with cuMemFreeHost, never both.
    let r = unsafe { sys::cuMemHostAlloc(&mut p, CHUNK, sys::CU_MEMHOSTALLOC_PORTABLE) };
    check(r, "cuMemHostAlloc")?;
    Ok(p as usize)
}

fn give_back(b: usize) {
    let mut pool = POOL.lock().recover();
    if pool.len() < KEPT_BUFFERS {
        pool.push(b);
    } else {
        drop(pool);
        // SAFETY: frees a buffer from cuMemHostAlloc that no stream uses any more (its stream was
        // synchronised) and nothing else holds.
        unsafe { sys::cuMemFreeHost(b as *mut c_void) };
    }
}

fn check(r: CUresult, call: &'static str) -> Result<(), IpcError> {
    if r == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(IpcError::Driver { call, result: r })
    }
}

/// Starts `c` (pieces whose `local` side is device memory of this process) on a thread of its
/// own; `done` runs there once the bytes are on the device (or not). Returns the revocation error
/// at once (without calling `done`) when the grant was revoked before the copy began.
pub(crate) fn spawn(c: Copy, done: Done) -> Result<(), CopyError> {
    if !c.slot.table.advance(c.slot.idx, c.slot.gen, ARMED, COPYING) {
        return Err(CopyError::NotStarted);
    }
    let done = Arc::new(Mutex::new(Some(done)));
    let d2 = done.clone();
    let (slot, cancel) = (c.slot.clone(), c.cancel.clone());
    let started = std::thread::Builder::new()
        .name("nixl-connect-staged".into())
        .spawn(move || {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(&c)))
                .unwrap_or_else(|_| Err(CopyError::Os(IpcError::Panicked("staged copy").into())));
            let r = r.and_then(|()| cma::finish(&c.slot));
            if let Some(done) = d2.lock().recover().take() {
                done(r);
            }
        });
    if started.is_err() {
        let _ = cancel;
        let _ = slot.table.advance(slot.idx, slot.gen, COPYING, DONE);
        if let Some(done) = done.lock().recover().take() {
            done(Err(CopyError::Unsupported(IpcError::NoThread.into())));
        }
    }
    Ok(())
}

/// The pieces cut at [`CHUNK`] bytes.
fn chunks(pieces: &[Piece]) -> Vec<Piece> {
    let mut out = Vec::new();
    for p in pieces {
        let mut off = 0;
        while off < p.len {
            let len = (p.len - off).min(CHUNK);
            out.push(Piece {
                local: p.local + off,
                remote: p.remote + off,
                len,
            });
            off += len;
        }
    }
    out
}

fn run(c: &Copy) -> Result<(), CopyError> {
    let work = chunks(&c.pieces);
    let Some(first) = work.first() else { return Ok(()) };
    let ordinal = match crate::cuda::locate(first.local) {
        Ok(Some(o)) => o,
        _ => return Err(CopyError::Unsupported(IpcError::NoDevice.into())),
    };
    let ctx = crate::cuda::primary(ordinal).map_err(|_| CopyError::Unsupported(IpcError::NoDevice.into()))?;
    let workers = std::thread::available_parallelism()
        .map_or(1, |n| n.get() / 2)
        .clamp(1, MAX_WORKERS)
        .min(work.len());
    let next = AtomicUsize::new(0);
    let error: Mutex<Option<CopyError>> = Mutex::new(None);
    let stop = AtomicBool::new(false);
    let shared = Shared {
        pid: c.pid,
        work: &work,
        next: &next,
        cancel: &c.cancel,
        stop: &stop,
        ctx,
    };
    let record = |r: Result<(), CopyError>| {
        if let Err(e) = r {
            stop.store(true, Ordering::Relaxed);
            error.lock().recover().get_or_insert(e);
        }
    };
    if workers == 1 {
        record(shared.worker());
    } else {
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..workers).map(|_| s.spawn(|| shared.worker())).collect();
            for h in handles {
                record(
                    h.join()
                        .unwrap_or_else(|_| Err(CopyError::Os(IpcError::Panicked("staged copy").into()))),
                );
            }
        });
    }
    match error.into_inner().recover() {
        Some(e) => Err(e),
        None if c.cancel.load(Ordering::Relaxed) => Err(CopyError::Revoked),
        None => Ok(()),
    }
}

struct Shared<'a> {
    pid: libc::pid_t,
    work: &'a [Piece],
    next: &'a AtomicUsize,
    cancel: &'a AtomicBool,
    stop: &'a AtomicBool,
    ctx: sys::CUcontext,
}

// SAFETY: (Sync) the context handle is only passed to the driver, which accepts it from any
// thread; everything else is shared through atomics or shared references to immutable data.
unsafe impl Sync for Shared<'_> {}

/// One thread's stream, buffers and the events marking each buffer's last DMA.
struct Lane {
    stream: sys::CUstream,
    bufs: [usize; 2],
    events: [sys::CUevent; 2],
    used: [bool; 2],
}

impl Lane {
    fn new() -> Result<Self, IpcError> {
        let mut lane = Lane {
            stream: std::ptr::null_mut(),
            bufs: [0; 2],
            events: [std::ptr::null_mut(); 2],
            used: [false; 2],
        };
        // SAFETY: creates a stream and two events in the current context, written into `lane`
        // and destroyed by its Drop (null handles are skipped there).
        unsafe {
            check(
                sys::cuStreamCreate(
                    &mut lane.stream,
                    sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                ),
                "cuStreamCreate",
            )?;
            for e in &mut lane.events {
                check(
                    sys::cuEventCreate(e, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32),
                    "cuEventCreate",
                )?;
            }
        }
        for b in &mut lane.bufs {
            *b = take_buffer()?;
        }
        Ok(lane)
    }
}

impl Drop for Lane {
    fn drop(&mut self) {
        // SAFETY: waits for this lane's stream (so no DMA reads a buffer after it is given back),
        // then destroys the handles this lane created.
        unsafe {
            if !self.stream.is_null() {
                sys::cuStreamSynchronize(self.stream);
            }
            for e in self.events {
                if !e.is_null() {
                    sys::cuEventDestroy_v2(e);
                }
            }
            if !self.stream.is_null() {
                sys::cuStreamDestroy_v2(self.stream);
            }
        }
        for b in self.bufs {
            if b != 0 {
                give_back(b);
            }
        }
    }
}

impl Shared<'_> {
    fn worker(&self) -> Result<(), CopyError> {
        // SAFETY: makes the device's retained primary context current on this thread.
        check(unsafe { sys::cuCtxSetCurrent(self.ctx) }, "cuCtxSetCurrent")
            .map_err(|e| CopyError::Unsupported(e.into()))?;
        let mut lane = Lane::new().map_err(|e| CopyError::Unsupported(e.into()))?;
        let mut k = 0usize;
        loop {
            if self.cancel.load(Ordering::Relaxed) {
                return Err(CopyError::Revoked);
            }
            if self.stop.load(Ordering::Relaxed) {
                return Ok(()); // another thread failed and reports it
            }
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            let Some(p) = self.work.get(i) else { break };
            let b = k % 2;
            k += 1;
            if lane.used[b] {
                // SAFETY: waits for the DMA that last read this buffer (an event of this lane).
                let r = unsafe { sys::cuEventSynchronize(lane.events[b]) };
                check(r, "cuEventSynchronize").map_err(|e| CopyError::Os(e.into()))?;
            }
            let staging = Piece {
                local: lane.bufs[b],
                remote: p.remote,
                len: p.len,
            };
            cma::pull(self.pid, &[staging], self.cancel)?;
            // SAFETY: `p.local` is device memory of this process that the copy's owner keeps valid
            // until the copy ends (checked to be device memory above); the buffer holds `p.len`
            // bytes (<= CHUNK) and is not refilled before the event recorded after this copy.
            let r = unsafe {
                check(
                    sys::cuMemcpyHtoDAsync_v2(
                        p.local as u64,
                        lane.bufs[b] as *const c_void,
                        p.len,
                        lane.stream,
                    ),
                    "cuMemcpyHtoDAsync",
                )
                .and_then(|()| check(sys::cuEventRecord(lane.events[b], lane.stream), "cuEventRecord"))
            };
            r.map_err(|e| CopyError::Os(e.into()))?;
            lane.used[b] = true;
        }
        // SAFETY: waits for every DMA of this lane before the copy counts as done.
        check(
            unsafe { sys::cuStreamSynchronize(lane.stream) },
            "cuStreamSynchronize",
        )
        .map_err(|e| CopyError::Os(e.into()))
    }
}
