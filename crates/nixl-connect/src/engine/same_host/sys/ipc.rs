//! Device memory between Rust peers of one host through CUDA IPC (feature `cuda`).
//!
//! The owner of the *source* exports it ([`export`]): on its CUDA thread it finds the allocation
//! around each range (`cuMemGetAddressRange`), its buffer id and its IPC handle
//! (`cuIpcGetMemHandle`). The side whose memory is *written* copies ([`spawn`]), as on the host
//! path: it opens the handle once and caches the mapping per (peer connection, allocation base,
//! buffer id), so a freed and reallocated address never reuses a stale mapping, copies with
//! `cuMemcpyAsync` on its own stream (device to device, or device to its own host memory) after
//! checking the range against the mapping's true size (`cuMemGetAddressRange`), and
//! synchronises that stream before the copy counts as done, so the owner learns of completion only
//! after the bytes are in place. Every copy runs under the slot protocol of [`super::slots`]: a
//! source revoked before the copy has finished makes the copier discard it.
//!
//! What an IPC handle exposes: the whole allocation (a `cudaMalloc` block, or a caching
//! allocator's segment holding other tensors), not only the operation's ranges. This library only
//! ever reads, and only the ranges of a live grant; the handle goes only to a process of the same
//! user (checked with `SO_PEERCRED`), which could read the owner's memory by other means anyway.
//! Mappings stay open after an operation (opening costs far more than a small copy) until the same
//! address shows another buffer id, the cache is full, or the peer's connection closes.
//!
//! All CUDA calls of this path run on one thread per process, `nixl-connect-cuda`, so the engine
//! thread never blocks on the device.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys::{self, CUresult};

use super::cma::{CopyError, SlotRef};
use super::slots::{ARMED, COPYING, DONE};
use crate::engine::same_host::wire::IpcSource;
use crate::error::ErrorSource;
use crate::sync::Recover;

/// Mappings kept open per process before the least recently used is closed.
const MAX_MAPPINGS: usize = 1024;

/// One piece of a device copy: `src` (the peer's export) into `dst`, an address of this process
/// (device memory, or host memory the driver copies into).
pub(crate) struct Piece {
    pub(crate) dst: u64,
    pub(crate) src: IpcSource,
}

/// A device copy to run on the CUDA thread.
pub(crate) struct Copy {
    /// The connection the sources came over (mappings are cached per connection, whose ids are
    /// never reused, so a later process with the same pid never meets an earlier one's mapping).
    pub(crate) conn: u64,
    /// The owner of the sources.
    pub(crate) pid: libc::pid_t,
    pub(crate) pieces: Vec<Piece>,
    pub(crate) slot: SlotRef,
    pub(crate) cancel: Arc<AtomicBool>,
}

/// Why a step of the device path failed (shared as an [`ErrorSource`] beyond this file).
#[derive(Debug, Clone, Copy, thiserror::Error)]
pub(crate) enum IpcError {
    /// A driver call returned an error.
    #[error("{call} failed: {result:?}")]
    Driver {
        /// The driver call.
        call: &'static str,
        /// What it returned.
        result: CUresult,
    },
    /// This process has no usable CUDA driver or device.
    #[error("no usable CUDA driver or device in this process")]
    NoDevice,
    /// The CUDA thread could not be started.
    #[error("cannot start the CUDA thread")]
    NoThread,
    /// The peer's GPU (by UUID) is not visible to this process.
    #[error("the peer's GPU is not visible to this process")]
    PeerGpuNotVisible,
    /// A range runs past the end of the allocation around it.
    #[error("a range runs past the end of its CUDA allocation")]
    PastAllocation,
    /// The peer claimed more memory than the allocation its handle maps.
    #[error("the peer claims {claimed} bytes of an allocation whose mapping holds {mapped}")]
    LargerThanMapping {
        /// The bytes the peer's export claims (allocation size, or offset + length).
        claimed: u64,
        /// The bytes the mapping really holds.
        mapped: u64,
    },
    /// The process holds as much pinned staging memory as it may
    /// ([`MAX_STAGING`](super::staged::MAX_STAGING)): the copy takes NIXL.
    #[error("this process holds its whole allowance of pinned staging memory")]
    NoStaging,
    /// A driver call panicked (the step is abandoned; the thread goes on).
    #[error("the CUDA {0} panicked")]
    Panicked(&'static str),
}

impl From<IpcError> for ErrorSource {
    fn from(e: IpcError) -> Self {
        Arc::new(e)
    }
}

type Exported = Box<dyn FnOnce(Result<Vec<IpcSource>, ErrorSource>) + Send>;
type Copied = Box<dyn FnOnce(Result<(), CopyError>) + Send>;

enum Job {
    Export(Vec<(u64, u64)>, Exported),
    Copy(Copy, Copied),
    Forget(u64),
}

/// True when this process can take part in CUDA IPC: a driver, initialised, with a device.
pub(crate) fn available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| crate::cuda::device_count().is_ok_and(|n| n > 0))
}

fn worker() -> Option<&'static Mutex<Sender<Job>>> {
    static TX: OnceLock<Option<Mutex<Sender<Job>>>> = OnceLock::new();
    TX.get_or_init(|| {
        let (tx, rx) = channel::<Job>();
        std::thread::Builder::new()
            .name("nixl-connect-cuda".into())
            .spawn(move || {
                let mut dev = Cuda::default();
                for job in rx {
                    dev.run(job);
                }
            })
            .ok()?;
        Some(Mutex::new(tx))
    })
    .as_ref()
}

fn submit(job: Job) -> Result<(), Job> {
    match worker() {
        Some(tx) => tx.lock().recover().send(job).map_err(|e| e.0),
        None => Err(job),
    }
}

/// Exports `ranges` of this process's device memory; `done` runs on the CUDA thread.
pub(crate) fn export(ranges: Vec<(u64, u64)>, done: Exported) {
    if !available() {
        return done(Err(IpcError::NoDevice.into()));
    }
    if let Err(Job::Export(_, done)) = submit(Job::Export(ranges, done)) {
        done(Err(IpcError::NoThread.into()));
    }
}

/// Starts `c` on the CUDA thread; `done` runs there once the bytes are in place (or not).
/// Returns the revocation error at once (without calling `done`) when the grant was revoked
/// before the copy began.
pub(crate) fn spawn(c: Copy, done: Copied) -> Result<(), CopyError> {
    if !c.slot.table.advance(c.slot.idx, c.slot.gen, ARMED, COPYING) {
        return Err(CopyError::NotStarted);
    }
    match submit(Job::Copy(c, done)) {
        Ok(()) => Ok(()),
        Err(Job::Copy(c, done)) => {
            let _ = c.slot.table.advance(c.slot.idx, c.slot.gen, COPYING, DONE);
            done(Err(CopyError::Unsupported(IpcError::NoThread.into())));
            Ok(())
        }
        Err(_) => unreachable!("submit hands back the job it was given"),
    }
}

/// Closes the mappings opened for connection `conn` (it closed), once copies before it are done.
pub(crate) fn forget(conn: u64) {
    if available() {
        let _ = submit(Job::Forget(conn));
    }
}

fn check(result: CUresult, call: &'static str) -> Result<(), IpcError> {
    if result == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(IpcError::Driver { call, result })
    }
}

/// A device's primary context and this path's stream on it.
#[derive(Clone, Copy)]
struct Dev {
    ctx: sys::CUcontext,
    stream: sys::CUstream,
    uuid: [u8; 16],
}

/// An open mapping of a peer's allocation.
struct Mapping {
    ptr: u64,
    ctx: sys::CUcontext,
    used: u64,
}

/// State of the CUDA thread (touched by no other thread).
#[derive(Default)]
struct Cuda {
    devs: HashMap<i32, Dev>,
    /// (connection, base, buffer id, ordinal opened on) -> mapping
    maps: HashMap<(u64, u64, u64, i32), Mapping>,
    /// The buffer id last seen at (connection, base): another one means the old allocation is gone.
    ids: HashMap<(u64, u64), u64>,
    /// Every visible device's UUID, by ordinal: read once, with no context (`cuDeviceGetUuid`
    /// needs none), so that finding a peer's device makes a context on that device alone.
    uuids: Option<Vec<[u8; 16]>>,
    tick: u64,
}

impl Cuda {
    fn run(&mut self, job: Job) {
        match job {
            Job::Export(ranges, done) => {
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.export(&ranges)))
                    .unwrap_or(Err(IpcError::Panicked("export")));
                done(r.map_err(ErrorSource::from));
            }
            Job::Copy(c, done) => {
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.copy(&c)))
                    .unwrap_or_else(|_| Err(CopyError::Os(IpcError::Panicked("copy").into())));
                // Finish the slot: DONE unless the source was revoked while the copy ran.
                let r = r.and_then(|()| {
                    if c.slot.table.advance(c.slot.idx, c.slot.gen, COPYING, DONE) {
                        Ok(())
                    } else {
                        Err(CopyError::Revoked)
                    }
                });
                done(r);
            }
            Job::Forget(conn) => {
                let keys: Vec<_> = self.maps.keys().filter(|k| k.0 == conn).copied().collect();
                for k in keys {
                    self.close(k);
                }
                self.ids.retain(|k, _| k.0 != conn);
            }
        }
    }

    /// The primary context and stream of device `ordinal`, created on first use.
    fn dev(&mut self, ordinal: i32) -> Result<Dev, IpcError> {
        if let Some(d) = self.devs.get(&ordinal) {
            return Ok(*d);
        }
        let mut dev: sys::CUdevice = 0;
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        let mut stream: sys::CUstream = std::ptr::null_mut();
        let mut uuid = sys::CUuuid { bytes: [0; 16] };
        // SAFETY: plain driver calls writing into the locals above; the primary context is
        // retained for the life of the process (never released), and the stream lives on it.
        unsafe {
            check(sys::cuDeviceGet(&mut dev, ordinal), "cuDeviceGet")?;
            check(
                sys::cuDevicePrimaryCtxRetain(&mut ctx, dev),
                "cuDevicePrimaryCtxRetain",
            )?;
            check(sys::cuCtxSetCurrent(ctx), "cuCtxSetCurrent")?;
            check(
                sys::cuStreamCreate(&mut stream, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32),
                "cuStreamCreate",
            )?;
            check(sys::cuDeviceGetUuid_v2(&mut uuid, dev), "cuDeviceGetUuid")?;
        }
        let d = Dev {
            ctx,
            stream,
            uuid: uuid.bytes.map(|b| b as u8),
        };
        self.devs.insert(ordinal, d);
        Ok(d)
    }

    /// The ordinal of the device with `uuid` in this process.
    fn ordinal_of(&mut self, uuid: &[u8; 16]) -> Result<i32, IpcError> {
        if self.uuids.is_none() {
            let mut n = 0;
            // SAFETY: writes the device count into `n`.
            check(unsafe { sys::cuDeviceGetCount(&mut n) }, "cuDeviceGetCount")?;
            let mut all = Vec::with_capacity(usize::try_from(n).unwrap_or(0));
            for o in 0..n {
                let mut dev: sys::CUdevice = 0;
                let mut u = sys::CUuuid { bytes: [0; 16] };
                // SAFETY: plain driver queries writing into the locals above; they create no
                // context.
                unsafe {
                    check(sys::cuDeviceGet(&mut dev, o), "cuDeviceGet")?;
                    check(sys::cuDeviceGetUuid_v2(&mut u, dev), "cuDeviceGetUuid")?;
                }
                all.push(u.bytes.map(|b| b as u8));
            }
            self.uuids = Some(all);
        }
        self.uuids
            .as_deref()
            .and_then(|all| all.iter().position(|u| u == uuid))
            .and_then(|o| i32::try_from(o).ok())
            .ok_or(IpcError::PeerGpuNotVisible)
    }

    fn attr<T: Default>(&self, ptr: u64, a: sys::CUpointer_attribute) -> Result<T, IpcError> {
        let mut v = T::default();
        // SAFETY: each attribute asked for here writes exactly one value of the type requested by
        // its caller (ordinal: i32, buffer id: u64, memory type: u32); the pointer is inspected,
        // never dereferenced.
        let r = unsafe { sys::cuPointerGetAttribute((&mut v as *mut T).cast::<c_void>(), a, ptr) };
        check(r, "cuPointerGetAttribute")?;
        Ok(v)
    }

    fn ordinal_of_ptr(&self, ptr: u64) -> Result<i32, IpcError> {
        self.attr::<i32>(ptr, sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL)
    }

    fn export(&mut self, ranges: &[(u64, u64)]) -> Result<Vec<IpcSource>, IpcError> {
        let mut out = Vec::with_capacity(ranges.len());
        for &(addr, len) in ranges {
            // No synchronisation here: the operation waited for its producer streams when it was
            // created (crate::cuda::after), and nothing else on the device is the copy's business.
            let ordinal = self.ordinal_of_ptr(addr)?;
            let d = self.dev(ordinal)?;
            // SAFETY: makes a retained primary context current on this thread.
            check(unsafe { sys::cuCtxSetCurrent(d.ctx) }, "cuCtxSetCurrent")?;
            let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
            // SAFETY: writes the allocation's base and size into the locals.
            let r = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, addr) };
            check(r, "cuMemGetAddressRange")?;
            let buffer_id =
                self.attr::<u64>(addr, sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_BUFFER_ID)?;
            let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
            // SAFETY: writes the handle of the allocation at `base` (memory made otherwise than
            // by cuMemAlloc fails here and the operation takes NIXL).
            let r = unsafe { sys::cuIpcGetMemHandle(&mut h, base) };
            check(r, "cuIpcGetMemHandle")?;
            let offset = addr - base;
            if offset.checked_add(len).is_none_or(|e| e > size as u64) {
                return Err(IpcError::PastAllocation);
            }
            out.push(IpcSource {
                uuid: d.uuid,
                handle: h.reserved.map(|b| b as u8),
                base,
                alloc_len: size as u64,
                buffer_id,
                offset,
                len,
            });
        }
        Ok(out)
    }

    /// The mapping of `src` from connection `conn`, opened in device `ordinal`'s context if not
    /// cached.
    fn map(&mut self, conn: u64, src: &IpcSource, ordinal: i32) -> Result<u64, CopyError> {
        let key = (conn, src.base, src.buffer_id, ordinal);
        self.tick += 1;
        if let Some(m) = self.maps.get_mut(&key) {
            m.used = self.tick;
            return Ok(m.ptr);
        }
        // Another buffer id at this base: that allocation is gone; close what mapped it.
        if self
            .ids
            .insert((conn, src.base), src.buffer_id)
            .is_some_and(|old| old != src.buffer_id)
        {
            let stale: Vec<_> = self
                .maps
                .keys()
                .filter(|k| k.0 == conn && k.1 == src.base && k.2 != src.buffer_id)
                .copied()
                .collect();
            for k in stale {
                self.close(k);
            }
        }
        if self.maps.len() >= MAX_MAPPINGS {
            if let Some(&old) = self.maps.iter().min_by_key(|(_, m)| m.used).map(|(k, _)| k) {
                self.close(old);
            }
        }
        let d = self.dev(ordinal).map_err(|e| CopyError::Unsupported(e.into()))?;
        let mut ptr: sys::CUdeviceptr = 0;
        let h = sys::CUipcMemHandle {
            reserved: src.handle.map(|b| b as _),
        };
        // SAFETY: opens the peer's exported allocation in a retained context; the mapping is
        // recorded and closed exactly once (close()).
        let r = unsafe {
            check(sys::cuCtxSetCurrent(d.ctx), "cuCtxSetCurrent").and_then(|()| {
                check(
                    sys::cuIpcOpenMemHandle_v2(
                        &mut ptr,
                        h,
                        sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                    ),
                    "cuIpcOpenMemHandle",
                )
            })
        };
        r.map_err(|e| CopyError::Unsupported(e.into()))?;
        self.maps.insert(
            key,
            Mapping {
                ptr,
                ctx: d.ctx,
                used: self.tick,
            },
        );
        Ok(ptr)
    }

    fn close(&mut self, key: (u64, u64, u64, i32)) {
        if let Some(m) = self.maps.remove(&key) {
            // SAFETY: closes a mapping this thread opened and no copy uses (copies run on this
            // thread and are synchronised before the next job).
            unsafe {
                let _ = sys::cuCtxSetCurrent(m.ctx);
                let _ = sys::cuIpcCloseMemHandle(m.ptr);
            }
        }
    }

    /// Checks that `src`'s range lies inside the allocation actually mapped at `mapped` (its
    /// true extent, from `cuMemGetAddressRange`), whatever the peer claimed.
    fn within_mapping(&self, ctx: sys::CUcontext, mapped: u64, src: &IpcSource) -> Result<(), IpcError> {
        let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
        // SAFETY: makes a retained context current and writes the allocation's base and size
        // into the locals; `mapped` is only inspected.
        let r = unsafe {
            check(sys::cuCtxSetCurrent(ctx), "cuCtxSetCurrent")?;
            sys::cuMemGetAddressRange_v2(&mut base, &mut size, mapped)
        };
        check(r, "cuMemGetAddressRange")?;
        let end = src.offset.checked_add(src.len);
        if base != mapped || end.is_none_or(|e| e > size as u64) || src.alloc_len > size as u64 {
            return Err(IpcError::LargerThanMapping {
                claimed: src.alloc_len.max(end.unwrap_or(u64::MAX)),
                mapped: size as u64,
            });
        }
        Ok(())
    }

    fn copy(&mut self, c: &Copy) -> Result<(), CopyError> {
        let own = c.pid == std::process::id() as libc::pid_t;
        let mut started = false;
        let mut used: Vec<Dev> = Vec::new();
        let result = (|| {
            for p in &c.pieces {
                if c.cancel.load(Ordering::Relaxed) {
                    return Err(if started {
                        CopyError::Revoked
                    } else {
                        CopyError::NotStarted
                    });
                }
                if p.src.len == 0 {
                    continue;
                }
                // The stream of the destination's device, or of the source's for host memory.
                let dst_ordinal = match self
                    .attr::<u32>(p.dst, sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE)
                {
                    Ok(t) if t == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 => {
                        Some(self.ordinal_of_ptr(p.dst).map_err(|e| CopyError::Os(e.into()))?)
                    }
                    _ => None,
                };
                let src_ordinal = self
                    .ordinal_of(&p.src.uuid)
                    .map_err(|e| CopyError::Unsupported(e.into()))?;
                let ordinal = dst_ordinal.unwrap_or(src_ordinal);
                let src = if own {
                    // Two connectors of one process: the exporter's address is ours.
                    p.src.base
                } else {
                    self.map(c.conn, &p.src, ordinal)?
                };
                let d = self.dev(ordinal).map_err(|e| CopyError::Os(e.into()))?;
                // The peer's word on the allocation's size is checked against the mapping itself:
                // a peer claiming more than it exported never makes this process read past it.
                self.within_mapping(d.ctx, src, &p.src)
                    .map_err(|e| CopyError::Unsupported(e.into()))?;
                // SAFETY: `dst` is memory of this process the copy's owner keeps valid until the
                // copy ends (the transport waits for it before freeing); `src` is a mapping of a
                // live grant's allocation, read only, and `offset + len` lies inside it (checked
                // on decode).
                let r = unsafe {
                    check(sys::cuCtxSetCurrent(d.ctx), "cuCtxSetCurrent").and_then(|()| {
                        check(
                            sys::cuMemcpyAsync(p.dst, src + p.src.offset, p.src.len as usize, d.stream),
                            "cuMemcpyAsync",
                        )
                    })
                };
                if let Err(e) = r {
                    return Err(if started {
                        CopyError::Os(e.into())
                    } else {
                        CopyError::Unsupported(e.into())
                    });
                }
                started = true;
                if !used.iter().any(|u| u.stream == d.stream) {
                    used.push(d);
                }
            }
            Ok(())
        })();
        // Whatever happened, nothing enqueued may still run once this returns: the memory it
        // writes may be freed right after.
        let mut synced = Ok(());
        for d in used {
            // SAFETY: waits for this path's own stream.
            let r = unsafe {
                let _ = sys::cuCtxSetCurrent(d.ctx);
                sys::cuStreamSynchronize(d.stream)
            };
            if let (Err(e), true) = (check(r, "cuStreamSynchronize"), synced.is_ok()) {
                synced = Err(CopyError::Os(e.into()));
            }
        }
        result.and(synced)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first GPU's context, or `None` after saying why the test is skipped (a failure where
    /// `NIXL_CONNECT_REQUIRE_GPU` is set).
    fn gpu(test: &str) -> Option<std::sync::Arc<cudarc::driver::CudaContext>> {
        if available() {
            if let Ok(ctx) = cudarc::driver::CudaContext::new(0) {
                return Some(ctx);
            }
        }
        assert!(
            std::env::var_os("NIXL_CONNECT_REQUIRE_GPU").is_none(),
            "{test}: a GPU is required here"
        );
        eprintln!("{test}: skipped: no usable CUDA device");
        None
    }

    #[test]
    fn ipc_finding_a_peer_device_makes_no_context() {
        let Some(ctx) = gpu("ipc_finding_a_peer_device_makes_no_context") else {
            return;
        };
        ctx.bind_to_thread().unwrap();
        let mut dev: sys::CUdevice = 0;
        let mut u = sys::CUuuid { bytes: [0; 16] };
        // SAFETY: plain driver queries writing into the locals.
        unsafe {
            assert_eq!(sys::cuDeviceGet(&mut dev, 0), CUresult::CUDA_SUCCESS);
            assert_eq!(sys::cuDeviceGetUuid_v2(&mut u, dev), CUresult::CUDA_SUCCESS);
        }
        let uuid = u.bytes.map(|b| b as u8);
        let mut cuda = Cuda::default();
        assert_eq!(cuda.ordinal_of(&uuid).unwrap(), 0);
        assert!(
            cuda.devs.is_empty(),
            "no context or stream was made to compare UUIDs"
        );
        let mut unknown = uuid;
        unknown[0] ^= 0xff;
        assert!(matches!(
            cuda.ordinal_of(&unknown),
            Err(IpcError::PeerGpuNotVisible)
        ));
        assert!(cuda.devs.is_empty());
    }

    #[test]
    fn ipc_mapping_size_refuses_a_peer_claiming_more_than_it_exported() {
        let Some(ctx) = gpu("ipc_mapping_size_refuses_a_peer_claiming_more_than_it_exported") else {
            return;
        };
        ctx.bind_to_thread().unwrap();
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: allocates 1 MiB with cuMemAlloc (IPC handles need such memory, not the stream
        // pool's that cudarc allocates from); freed at the end.
        let r = unsafe { sys::cuMemAlloc_v2(&mut ptr, 1 << 20) };
        assert_eq!(r, CUresult::CUDA_SUCCESS);
        let mut cuda = Cuda::default();
        let honest = cuda.export(&[(ptr, 1 << 20)]).unwrap().remove(0);
        let d = cuda.dev(0).unwrap();
        cuda.within_mapping(d.ctx, honest.base, &honest).unwrap();
        // The peer's word: a larger allocation, and a range running past the real one.
        let mut forged = honest.clone();
        forged.alloc_len = 64 << 20;
        forged.len = 2 << 20;
        let e = cuda.within_mapping(d.ctx, forged.base, &forged).unwrap_err();
        assert!(matches!(e, IpcError::LargerThanMapping { .. }), "{e}");
        // Claiming a larger allocation alone is refused too.
        let mut bigger = honest.clone();
        bigger.alloc_len = 2 << 20;
        assert!(cuda.within_mapping(d.ctx, bigger.base, &bigger).is_err());
        ctx.bind_to_thread().unwrap();
        // SAFETY: frees the allocation made above; nothing uses it any more.
        unsafe { sys::cuMemFree_v2(ptr) };
    }
}
