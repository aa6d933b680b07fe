//! Host memory of a peer into device memory of this process (feature `cuda`), and back.
//!
//! CUDA IPC cannot open another process's host memory, so the copier pulls the peer's bytes with
//! `process_vm_readv` (the host path's grant, ptrace rules and revocation) into pinned buffers of
//! its own and queues `cuMemcpyHtoDAsync` from each. A copy is cut in [`CHUNK`]-byte pieces shared
//! by up to [`MAX_WORKERS`] lanes on the copy pool (the peer's share), each with two buffers and a
//! stream, so one piece's pull overlaps the previous one's DMA. Pinned memory is bounded per
//! process ([`MAX_STAGING`]): a lane that finds none does not start, and a copy with no lane takes
//! NIXL. Every stream is synchronised before the copy counts as done. [`to_host`] is the other way.

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys::{self, CUresult};

use super::cma::{self, CopyError, Piece, Pull, CHUNK};
use super::ipc_error::{check, IpcError};
use crate::sync::Recover;

/// The most lanes one staged copy uses by default (half the cores up to this).
const MAX_WORKERS: usize = 8;
/// The most lanes `NIXL_CONNECT_STAGING_LANES` may ask for.
const MAX_LANES: usize = 16;
/// Pinned buffers the pool keeps between copies (each [`CHUNK`] bytes).
const KEPT_BUFFERS: usize = 2 * MAX_WORKERS;
/// The most pinned staging memory this process holds at once, in bytes (32 buffers, 256 MiB:
/// two for each of [`MAX_LANES`] lanes).
pub(crate) const MAX_STAGING: usize = 32 * CHUNK;
// Two buffers for each lane fit the process's allowance.
const _: () = assert!(2 * MAX_LANES * CHUNK <= MAX_STAGING);

type Done = Box<dyn FnOnce(Result<(), CopyError>) + Send>;

/// [`check`], a failure counted as the copy's ([`CopyError::Os`]).
fn cu(r: CUresult, call: &'static str) -> Result<(), CopyError> {
    check(r, call).map_err(|e| CopyError::Os(e.into()))
}

/// Page-locked host buffers of [`CHUNK`] bytes, usable from every context.
static POOL: Mutex<Vec<usize>> = Mutex::new(Vec::new());
/// Buffers allocated and not freed (kept in [`POOL`] or in a lane).
static HELD: AtomicUsize = AtomicUsize::new(0);

fn take_buffer() -> Result<usize, IpcError> {
    if let Some(b) = POOL.lock().recover().pop() {
        return Ok(b);
    }
    if HELD.fetch_add(1, Ordering::AcqRel) >= MAX_STAGING / CHUNK {
        HELD.fetch_sub(1, Ordering::AcqRel);
        return Err(IpcError::NoStaging);
    }
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: allocates CHUNK page-locked bytes (PORTABLE: usable from every context) into `p`;
    // the buffer goes back to the pool or is freed with cuMemFreeHost, never both.
    let r = unsafe { sys::cuMemHostAlloc(&mut p, CHUNK, sys::CU_MEMHOSTALLOC_PORTABLE) };
    if let Err(e) = check(r, "cuMemHostAlloc") {
        HELD.fetch_sub(1, Ordering::AcqRel);
        return Err(e);
    }
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
        HELD.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Starts `c` (pieces whose `local` side is device memory of this process) as lanes on the copy
/// pool; `done` runs on a copy thread once the bytes are on the device (or not). Returns the
/// revocation error at once (without calling `done`) when the grant was revoked before the copy
/// began.
pub(crate) fn spawn(c: Pull, done: Done) -> Result<(), CopyError> {
    let (pid, pieces, slot, cancel) = c.into_parts();
    let chunks = Chunks::new(pieces, CHUNK);
    let lanes = lanes_for(chunks.total);
    let shared = Arc::new(Shared {
        pid,
        chunks,
        next: AtomicUsize::new(0),
        started: AtomicUsize::new(0),
        cancel: cancel.clone(),
        stop: AtomicBool::new(false),
        ctx: OnceLock::new(),
    });
    let task = Arc::new(move || shared.lane());
    cma::spawn_tasks(pid, Some(slot), cancel, lanes, task, done)
}

/// Lanes for a copy of `chunks` chunks: at most one per chunk, and at most
/// `NIXL_CONNECT_STAGING_LANES` (1 to [`MAX_LANES`]) where set, else half the cores (the other
/// half are the peer's and the callers'), at most [`MAX_WORKERS`].
fn lanes_for(chunks: usize) -> usize {
    static MAX: OnceLock<usize> = OnceLock::new();
    let max = *MAX.get_or_init(|| {
        lanes_from(
            crate::settings::process().staging_lanes(),
            std::thread::available_parallelism().map_or(1, |n| n.get()),
        )
    });
    max.min(chunks.max(1))
}

/// The most lanes a staged copy uses, from the variable's value (if set) and the core count.
fn lanes_from(var: Option<&str>, cores: usize) -> usize {
    match var.and_then(|v| v.trim().parse::<usize>().ok()) {
        Some(n) if n > 0 => n.min(MAX_LANES),
        _ => (cores / 2).clamp(1, MAX_WORKERS),
    }
}

/// A copy's pieces, cut at `chunk` bytes as they are taken: one entry per piece (the ranges
/// a request named), never one per chunk.
struct Chunks {
    pieces: Vec<Piece>,
    /// `starts[i]`: the index of piece `i`'s first chunk.
    starts: Vec<usize>,
    total: usize,
    /// Bytes per chunk (at most [`CHUNK`], a staging buffer's size).
    chunk: usize,
}

impl Chunks {
    fn new(pieces: Vec<Piece>, chunk: usize) -> Self {
        debug_assert!(chunk > 0 && chunk <= CHUNK);
        let mut starts = Vec::with_capacity(pieces.len());
        let mut total = 0usize;
        for p in &pieces {
            starts.push(total);
            total += p.len.div_ceil(chunk);
        }
        Self {
            pieces,
            starts,
            total,
            chunk,
        }
    }

    /// Chunk `k`, if there is one.
    fn get(&self, k: usize) -> Option<Piece> {
        if k >= self.total {
            return None;
        }
        let i = self.starts.partition_point(|&s| s <= k) - 1;
        let p = self.pieces[i];
        let off = (k - self.starts[i]) * self.chunk;
        Some(Piece {
            local: p.local + off,
            remote: p.remote + off,
            len: (p.len - off).min(self.chunk),
        })
    }
}

/// What the lanes of one copy share.
struct Shared {
    pid: libc::pid_t,
    chunks: Chunks,
    next: AtomicUsize,
    /// Lanes that got their buffers.
    started: AtomicUsize,
    cancel: Arc<AtomicBool>,
    stop: AtomicBool,
    /// The destination device's primary context (as an address), found by the first lane.
    ctx: OnceLock<Result<usize, ()>>,
}

impl Shared {
    /// One lane: finds the device, takes a stream and two buffers, and moves chunks until none
    /// is left. A lane that finds no staging memory left stops at once, successfully, unless no
    /// lane started at all (then the copy takes NIXL: nothing has moved).
    fn lane(&self) -> Result<(), CopyError> {
        let Some(first) = self.chunks.get(0) else {
            return Ok(());
        };
        let ctx = *self.ctx.get_or_init(|| {
            let ordinal = crate::sys::cuda::pointer_device(first.local)
                .ok()
                .flatten()
                .ok_or(())?;
            crate::sys::cuda::primary(ordinal)
                .map(|c| c as usize)
                .map_err(|_| ())
        });
        let Ok(ctx) = ctx else {
            return Err(CopyError::Unsupported(IpcError::NoDevice.into()));
        };
        // SAFETY: makes the device's retained primary context current on this pool thread (it
        // stays retained for the life of the process).
        let set = unsafe { sys::cuCtxSetCurrent(ctx as sys::CUcontext) };
        check(set, "cuCtxSetCurrent").map_err(|e| CopyError::Unsupported(e.into()))?;
        let mut lane = match Lane::new() {
            Ok(l) => l,
            Err(_) if self.started.load(Ordering::Acquire) > 0 => return Ok(()),
            Err(e) => {
                self.stop.store(true, Ordering::Relaxed);
                return Err(CopyError::Unsupported(e.into()));
            }
        };
        self.started.fetch_add(1, Ordering::AcqRel);
        self.run(&mut lane)
    }
}

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

impl Shared {
    /// Moves chunks through `lane` until none is left (or the copy stops).
    fn run(&self, lane: &mut Lane) -> Result<(), CopyError> {
        let mut k = 0usize;
        loop {
            if self.cancel.load(Ordering::Relaxed) {
                return Err(CopyError::Revoked);
            }
            if self.stop.load(Ordering::Relaxed) {
                return Ok(()); // another thread failed and reports it
            }
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            let Some(p) = self.chunks.get(i) else { break };
            let b = k % 2;
            k += 1;
            if lane.used[b] {
                // SAFETY: waits for the DMA that last read this buffer (an event of this lane).
                let r = unsafe { sys::cuEventSynchronize(lane.events[b]) };
                cu(r, "cuEventSynchronize")?;
            }
            let staging = Piece {
                local: lane.bufs[b],
                remote: p.remote,
                len: p.len,
            };
            cma::pull(self.pid, &[staging], &self.cancel)
                .inspect_err(|_| self.stop.store(true, Ordering::Relaxed))?;
            // SAFETY: `p.local` is device memory of this process that the copy's owner keeps valid
            // until the copy ends (checked to be device memory above); the buffer holds `p.len`
            // bytes (<= CHUNK) and is not refilled before the event recorded after this copy.
            unsafe {
                cu(
                    sys::cuMemcpyHtoDAsync_v2(
                        p.local as u64,
                        lane.bufs[b] as *const c_void,
                        p.len,
                        lane.stream,
                    ),
                    "cuMemcpyHtoDAsync",
                )?;
                cu(sys::cuEventRecord(lane.events[b], lane.stream), "cuEventRecord")?;
            }
            lane.used[b] = true;
        }
        // SAFETY: waits for every DMA of this lane before the copy counts as done.
        let r = unsafe { sys::cuStreamSynchronize(lane.stream) };
        cu(r, "cuStreamSynchronize")
    }
}

/// Whether a copy's destination is pageable host memory, staged by the CPU (`memory_type`: its
/// `CU_POINTER_ATTRIBUTE_MEMORY_TYPE`): memory CUDA does not know at all, or host memory it names
/// (as with HMM) that is not page-locked. Device, managed or pinned memory, or an attribute that
/// fails otherwise, is copied by the driver.
pub(crate) fn pageable(memory_type: &Result<u32, IpcError>, ptr: u64) -> bool {
    match memory_type {
        Err(IpcError::Driver {
            result: CUresult::CUDA_ERROR_INVALID_VALUE,
            ..
        }) => true,
        Ok(t) if *t == sys::CUmemorytype::CU_MEMORYTYPE_HOST as u32 => {
            let mut flags = 0u32;
            // SAFETY: asks the driver whether `ptr` is page-locked (never dereferenced); writes
            // one u32.
            let r = unsafe { sys::cuMemHostGetFlags(&mut flags, ptr as *mut c_void) };
            r != CUresult::CUDA_SUCCESS
        }
        _ => false,
    }
}

/// Pieces of a device-to-host copy at least this long are staged (shorter ones take one
/// `cuMemcpyAsync`: starting lanes costs more than the driver's own staging saves).
pub(crate) const TO_HOST_MIN: usize = 4 << 20;
/// The bytes a staged device-to-host lane moves at a time (half a staging buffer: chunks enough
/// to keep the lanes busy, few enough that the event waits cost little).
const TO_HOST_CHUNK: usize = 4 << 20;

/// Copies `pieces` (`remote`: device memory readable in context `ctx`; `local`: pageable host
/// memory of this process, kept valid by the caller) through pinned buffers on lanes of its own
/// (a DMA into pageable memory is slow), returning once every byte is in place or the copy
/// failed (no lane runs after). `Ok(false)`: no lane could start, nothing moved, the caller
/// copies directly. A failure before any byte landed, when the operation has `begun` no other
/// copy, is `NotStarted` or `Unsupported` (it may still take NIXL).
pub(crate) fn to_host(
    ctx: sys::CUcontext,
    pieces: Vec<Piece>,
    cancel: &AtomicBool,
    begun: bool,
) -> Result<bool, CopyError> {
    let chunks = Chunks::new(pieces, TO_HOST_CHUNK);
    let lanes = lanes_for(chunks.total);
    let shared = ToHost {
        ctx: ctx as usize,
        chunks,
        next: AtomicUsize::new(0),
        started: AtomicUsize::new(0),
        landed: AtomicUsize::new(0),
        stop: AtomicBool::new(false),
        cancel,
    };
    let results: Vec<Result<(), CopyError>> = std::thread::scope(|s| {
        let running: Vec<_> = (0..lanes)
            .filter_map(|_| {
                std::thread::Builder::new()
                    .name("nixl-connect-d2h".into())
                    .spawn_scoped(s, || shared.lane())
                    .ok()
            })
            .collect();
        running
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(CopyError::Os(IpcError::Panicked("staged copy").into())))
            })
            .collect()
    });
    if shared.started.load(Ordering::Acquire) == 0 {
        return Ok(false);
    }
    let r = results.into_iter().collect::<Result<(), _>>().map(|()| true);
    if begun || shared.landed.load(Ordering::Acquire) > 0 {
        return r;
    }
    // Nothing reached the destination: as the direct path says it.
    r.map_err(|e| match e {
        CopyError::Revoked => CopyError::NotStarted,
        CopyError::Os(x) => CopyError::Unsupported(x),
        e => e,
    })
}

/// What the lanes of one device-to-host copy share.
struct ToHost<'a> {
    /// The source device's context (as an address: lanes are other threads).
    ctx: usize,
    chunks: Chunks,
    next: AtomicUsize,
    /// Lanes that got their stream and buffers.
    started: AtomicUsize,
    /// Chunks copied to the destination (any byte of it written).
    landed: AtomicUsize,
    /// Set by a lane that failed: the others stop taking chunks.
    stop: AtomicBool,
    cancel: &'a AtomicBool,
}

impl ToHost<'_> {
    /// One lane: a stream and two buffers in the source's context, then chunks until none is
    /// left. A lane that cannot start returns at once (the copy goes on with the others, or, if
    /// none started, directly).
    fn lane(&self) -> Result<(), CopyError> {
        // SAFETY: makes the source device's retained primary context current on this lane's
        // thread (the CUDA thread holds it retained for the life of the process).
        let set = unsafe { sys::cuCtxSetCurrent(self.ctx as sys::CUcontext) };
        if check(set, "cuCtxSetCurrent").is_err() {
            return Ok(());
        }
        let Ok(mut lane) = Lane::new() else {
            return Ok(());
        };
        self.started.fetch_add(1, Ordering::AcqRel);
        self.run(&mut lane)
            .inspect_err(|_| self.stop.store(true, Ordering::Relaxed))
    }

    /// Queues the DMA of each chunk into one buffer while the other's (the chunk before) is
    /// copied out, then lands the last two.
    fn run(&self, lane: &mut Lane) -> Result<(), CopyError> {
        let mut pending: [Option<Piece>; 2] = [None, None];
        let mut k = 0usize;
        loop {
            if self.cancel.load(Ordering::Relaxed) {
                return Err(CopyError::Revoked);
            }
            if self.stop.load(Ordering::Relaxed) {
                return Ok(()); // another lane failed and reports it
            }
            let Some(p) = self.chunks.get(self.next.fetch_add(1, Ordering::Relaxed)) else {
                break;
            };
            let b = k % 2;
            k += 1;
            if let Some(q) = pending[b].take() {
                lane.land(b, q)?;
                self.landed.fetch_add(1, Ordering::Release);
            }
            // SAFETY: `p.remote` is device memory readable in the current context for `p.len`
            // bytes (a mapping the CUDA thread keeps open, and checked against, until this copy
            // returns); the buffer holds CHUNK >= `p.len` bytes and is not read or refilled
            // before the event recorded after this copy has completed (land()).
            unsafe {
                cu(
                    sys::cuMemcpyDtoHAsync_v2(
                        lane.bufs[b] as *mut c_void,
                        p.remote as u64,
                        p.len,
                        lane.stream,
                    ),
                    "cuMemcpyDtoHAsync",
                )?;
                cu(sys::cuEventRecord(lane.events[b], lane.stream), "cuEventRecord")?;
            }
            pending[b] = Some(p);
        }
        // The older of the two first.
        for b in [k % 2, (k + 1) % 2] {
            if let Some(q) = pending[b].take() {
                lane.land(b, q)?;
                self.landed.fetch_add(1, Ordering::Release);
            }
        }
        Ok(())
    }
}

impl Lane {
    /// Waits for the DMA into buffer `b`, then copies its `q.len` bytes to `q.local`.
    fn land(&mut self, b: usize, q: Piece) -> Result<(), CopyError> {
        // SAFETY: waits for this lane's event recorded after the DMA into buffer `b`.
        let r = unsafe { sys::cuEventSynchronize(self.events[b]) };
        cu(r, "cuEventSynchronize")?;
        // SAFETY: the buffer holds `q.len` bytes the completed DMA wrote; `q.local` is host
        // memory of this process, `q.len` bytes long, that the copy's owner keeps valid until
        // the copy returns and nothing else writes meanwhile; the two never overlap (one is
        // this lane's pinned buffer).
        unsafe { std::ptr::copy_nonoverlapping(self.bufs[b] as *const u8, q.local as *mut u8, q.len) };
        Ok(())
    }
}

#[cfg(test)]
mod tests;
