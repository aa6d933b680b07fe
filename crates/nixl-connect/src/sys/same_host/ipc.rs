//! Device memory between Rust peers of one host through CUDA IPC (feature `cuda`).
//!
//! The owner of the *source* exports it ([`export`]): the allocation around each range, its buffer
//! id and its IPC handle. The side whose memory is *written* copies ([`spawn`]): it opens the
//! handle once, caches the mapping per (connection, allocation base, buffer id) so a reallocated
//! address never reuses a stale mapping, checks each range against the mapping's true size, and
//! synchronises its stream before the copy counts as done, under the slot protocol of
//! [`super::slots`].
//!
//! An IPC handle exposes the whole allocation, not only the operation's ranges: it goes only to a
//! process of the same user (`SO_PEERCRED`), which could read that memory by other means anyway.
//! Between PID namespaces, and for VMM allocations, the export is the allocation's descriptor
//! ([`super::vmm`]), kept retained per connection under an id never reused. Both sides bound what
//! they keep (least recently used first) and drop it with the connection. All CUDA calls run on
//! one thread, `nixl-connect-cuda`, never the engine thread.

use std::collections::HashMap;
use std::ffi::c_void;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys;

use super::cma::{self, CopyError, SlotRef};
use super::ipc_error::check;
pub(crate) use super::ipc_error::IpcError;
use super::slots::{ARMED, COPYING, DONE};
use super::{staged, vmm};
use crate::error::ErrorSource;
use crate::ipc_source::IpcSource;
use crate::sync::Recover;

/// Mappings kept open per process before the least recently used is closed.
const MAX_MAPPINGS: usize = 1024;
/// Allocations kept shared (retained) per connection as VMM descriptors, and their bytes, before
/// the least recently used is given back: memory the owner has freed stays allocated while kept.
const MAX_SHARED_PER_CONN: usize = 32;
const MAX_SHARED_BYTES_PER_CONN: u64 = 8 << 30;
/// Allocations kept shared in the process, over every connection: each keeps its exported
/// descriptor (exporting per operation costs far more than a dup), so this bounds those held.
const MAX_SHARED: usize = 64;
/// Peers' VMM allocations kept mapped per process, and their bytes, before the least recently
/// used is unmapped.
const MAX_IMPORTS: usize = 256;
const MAX_IMPORTED_BYTES: u64 = 32 << 30;

/// One piece of a device copy: `src` (the peer's export) into `dst`, an address of this process
/// (device memory, or host memory the driver copies into).
pub(crate) struct Piece {
    dst: u64,
    src: IpcSource,
}

impl Piece {
    /// `src` into `dst`.
    pub(crate) fn new(dst: u64, src: IpcSource) -> Self {
        Self { dst, src }
    }
}

/// A device copy to run on the CUDA thread.
pub(crate) struct DeviceCopy {
    /// The connection the sources came over (mappings are cached per connection, whose ids are
    /// never reused, so a later process with the same pid never meets an earlier one's mapping).
    conn: u64,
    /// The owner of the sources.
    pid: libc::pid_t,
    pieces: Vec<Piece>,
    /// The VMM allocations' descriptors passed with the sources (a source's `fd` is its index
    /// plus one), each checked with [`is_cuda_export`](super::is_cuda_export).
    fds: Vec<OwnedFd>,
    slot: SlotRef,
    cancel: Arc<AtomicBool>,
}

impl DeviceCopy {
    /// A copy of `pieces` from `pid`'s exports (their descriptors `fds`, passed on `conn`),
    /// guarded by `slot`, stoppable through `cancel`.
    pub(crate) fn new(
        conn: u64,
        pid: libc::pid_t,
        pieces: Vec<Piece>,
        fds: Vec<OwnedFd>,
        slot: SlotRef,
        cancel: Arc<AtomicBool>,
    ) -> Self {
        Self {
            conn,
            pid,
            pieces,
            fds,
            slot,
            cancel,
        }
    }
}

/// An export: one source per range, and the descriptors they name (none for legacy handles).
pub(crate) type Export = (Vec<IpcSource>, Vec<OwnedFd>);
/// Told, on the CUDA thread, the ids of VMM exports this side gave back on a connection
/// (evicted, or their `DeviceBuffer` dropped), so that its peer is told at once.
pub(crate) type Teller = Arc<dyn Fn(u64, Vec<u64>) + Send + Sync>;

/// Where an export goes.
pub(crate) struct ExportTo {
    /// The connection (its id is unique in the process).
    conn: u64,
    /// How its peer takes exports.
    how: ExportAs,
    /// Who is told of the exports given back on it.
    tell: Teller,
}

impl ExportTo {
    /// Exports over connection `conn`, taken `how`, with `tell` told of those given back.
    pub(crate) fn new(conn: u64, how: ExportAs, tell: Teller) -> Self {
        Self { conn, how, tell }
    }
}
type Exported = Box<dyn FnOnce(Result<Export, ErrorSource>) + Send>;
type Copied = Box<dyn FnOnce(Result<(), CopyError>) + Send>;

enum Job {
    Export(ExportTo, Vec<(u64, u64)>, Exported),
    Copy(DeviceCopy, Copied),
    Forget(u64),
    ForgetAt(u64),
    Unmap(u64, Vec<u64>),
}

/// How the peer of a connection takes this side's device exports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ExportAs {
    /// Legacy CUDA IPC handles only (the peer takes no descriptors).
    Handles,
    /// The peer takes VMM descriptors: in the same PID namespace, legacy handles where the memory
    /// has one and descriptors otherwise; in another (`other_namespace`), descriptors always
    /// (legacy handles do not open there).
    Descriptors {
        /// The peer is in another PID namespace.
        other_namespace: bool,
    },
}

/// Whether this process can take part in CUDA IPC, once asked ([`available`]).
static AVAILABLE: OnceLock<bool> = OnceLock::new();

/// True when this process can take part in CUDA IPC: a driver, initialised, with a device. The
/// first call loads the driver and initialises CUDA (100 ms or more where there is a driver):
/// never on a caller's turn, where callers drive only once the answer is known
/// ([`settled_for_callers`], which the same-host transport's `any_thread` is).
pub(crate) fn available() -> bool {
    *AVAILABLE.get_or_init(|| crate::sys::cuda::device_count().is_ok_and(|n| n > 0))
}

/// True when a caller's thread may drive a connector's same-host path (`engine::driver`) without
/// ever starting CUDA: whether CUDA IPC works is known (CUDA already started in this process, or
/// no driver library to load). Where it works, the CUDA thread is started here (the engine thread
/// asks this when it starts); where unknown, the engine thread decides the first device request.
pub(crate) fn settled_for_callers() -> bool {
    let known = match AVAILABLE.get() {
        Some(&k) => Some(k),
        // Something in this process has started CUDA already: asking starts nothing.
        None if crate::sys::cuda::initialised() => Some(available()),
        // No driver library to load: CUDA IPC cannot work here.
        None if !crate::sys::cuda::driver_present() => Some(*AVAILABLE.get_or_init(|| false)),
        None => None,
    };
    match known {
        Some(true) => worker().is_some(),
        Some(false) => true,
        None => false,
    }
}

/// The CUDA thread, once something was shared or mapped through it, or a connector started where
/// CUDA IPC works ([`settled_for_callers`]: then a device request on a caller's turn does not
/// start a thread; an idle CUDA thread costs nothing, and every `DeviceBuffer` dropped then
/// sends it a job).
static WORKER: OnceLock<Option<Mutex<Sender<Job>>>> = OnceLock::new();

/// Hands `job` to the CUDA thread if it runs: before, nothing was shared or mapped on any
/// connection, and asking `available` would start CUDA (on a caller's turn, or in a process that
/// never used it) for nothing.
fn submit_if_started(job: Job) {
    if WORKER.get().is_some_and(Option::is_some) {
        let _ = submit(job);
    }
}

fn worker() -> Option<&'static Mutex<Sender<Job>>> {
    WORKER
        .get_or_init(|| {
            let (tx, rx) = channel::<Job>();
            // A `DeviceBuffer` dropped is forgotten by every connection it was shared on.
            crate::sys::cuda::on_device_buffer_drop(forget_at);
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

/// Exports `ranges` of this process's device memory to the peer of a connection, as `to` says;
/// `done` runs on the CUDA thread.
pub(crate) fn export(to: ExportTo, ranges: Vec<(u64, u64)>, done: Exported) {
    if !available() {
        return done(Err(IpcError::NoDevice.into()));
    }
    if let Err(Job::Export(_, _, done)) = submit(Job::Export(to, ranges, done)) {
        done(Err(IpcError::NoThread.into()));
    }
}

/// Starts `c` on the CUDA thread; `done` runs there once the bytes are in place (or not).
/// Returns the revocation error at once (without calling `done`) when the grant was revoked
/// before the copy began.
pub(crate) fn spawn(c: DeviceCopy, done: Copied) -> Result<(), CopyError> {
    if !c.slot.table.advance(c.slot.idx, c.slot.gen, ARMED, COPYING) {
        // A peer's descriptors are never closed on the engine thread.
        c.fds.into_iter().for_each(super::close_elsewhere);
        return Err(CopyError::NotStarted);
    }
    match submit(Job::Copy(c, done)) {
        Ok(()) => Ok(()),
        Err(Job::Copy(c, done)) => {
            let _ = c.slot.table.advance(c.slot.idx, c.slot.gen, COPYING, DONE);
            c.fds.into_iter().for_each(super::close_elsewhere);
            done(Err(CopyError::Unsupported(IpcError::NoThread.into())));
            Ok(())
        }
        Err(_) => unreachable!("submit hands back the job it was given"),
    }
}

/// Closes the mappings opened for connection `conn` (it closed), once copies before it are done,
/// and gives back the allocations shared on it.
pub(crate) fn forget(conn: u64) {
    submit_if_started(Job::Forget(conn));
}

/// Unmaps the peer's VMM exports `ids` on connection `conn` (it gave them back).
pub(crate) fn forget_imports(conn: u64, ids: Vec<u64>) {
    submit_if_started(Job::Unmap(conn, ids));
}

/// Gives back the allocations shared with any peer that are mapped at `base` (a `DeviceBuffer`
/// being dropped): the memory goes once the peers' mappings go.
fn forget_at(base: u64) {
    let _ = submit(Job::ForgetAt(base));
}

/// Closes a legacy mapping no copy uses any more.
fn close_mapping(m: Mapping) {
    // SAFETY: closes a mapping this thread opened and no copy uses (copies run on this thread and
    // are synchronised before their replaced mappings are closed, and before the next job).
    unsafe {
        let _ = sys::cuCtxSetCurrent(m.ctx);
        let _ = sys::cuIpcCloseMemHandle(m.ptr);
    }
}

/// Queues `len` bytes from `src` to `dst` on `d`'s stream, noting the stream as used and the copy
/// as started; a failure is `Unsupported` while nothing was queued yet (the operation may take
/// NIXL), `Os` after.
///
/// # Safety
/// `dst` must be memory of this process kept valid until the copy's streams are synchronised,
/// and `src..src+len` lie inside a live mapping (or memory) readable in `d`'s context.
unsafe fn queue(
    d: Dev,
    dst: u64,
    src: u64,
    len: usize,
    started: &mut bool,
    used: &mut Vec<Dev>,
) -> Result<(), CopyError> {
    // SAFETY: the caller's contract; a retained context made current on this thread.
    let r = unsafe {
        check(sys::cuCtxSetCurrent(d.ctx), "cuCtxSetCurrent")
            .and_then(|()| check(sys::cuMemcpyAsync(dst, src, len, d.stream), "cuMemcpyAsync"))
    };
    if let Err(e) = r {
        return Err(if *started {
            CopyError::Os(e.into())
        } else {
            CopyError::Unsupported(e.into())
        });
    }
    *started = true;
    if !used.iter().any(|u| u.stream == d.stream) {
        used.push(d);
    }
    Ok(())
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
    /// Allocations shared as VMM descriptors: (connection, handle value) -> what was shared.
    shared: HashMap<(u64, u64), Shared>,
    /// The last export id given (ids are never reused).
    last_id: u64,
    /// Peers' VMM allocations mapped here: (connection, export id, ordinal) -> mapping.
    imports: HashMap<(u64, u64, i32), Import>,
    /// Who is told of the exports given back, per connection that has any.
    tellers: HashMap<u64, Teller>,
    /// Mappings replaced or evicted during the copy in progress: unmapped only once its streams
    /// are synchronised (a copy enqueued earlier in the same job may still read them).
    retired: Vec<Import>,
    retired_legacy: Vec<Mapping>,
}

/// An allocation this process shares with one peer as a VMM descriptor, retained (so that its
/// handle's value names it alone) while the peer may keep a mapping of it by `id`.
struct Shared {
    id: u64,
    handle: sys::CUmemGenericAllocationHandle,
    base: u64,
    size: u64,
    /// The exported descriptor: a copy (`dup`) of it goes with each operation.
    fd: OwnedFd,
    used: u64,
}

/// A peer's VMM allocation mapped here.
struct Import {
    map: vmm::Imported,
    len: u64,
    used: u64,
}

impl Cuda {
    fn run(&mut self, job: Job) {
        match job {
            Job::Export(to, ranges, done) => {
                if matches!(to.how, ExportAs::Descriptors { .. }) {
                    self.tellers.insert(to.conn, to.tell.clone());
                }
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    self.export_as(to.conn, &ranges, to.how)
                }))
                .unwrap_or(Err(IpcError::Panicked("export")));
                done(r.map_err(ErrorSource::from));
            }
            Job::Copy(c, done) => {
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.copy(&c)))
                    .unwrap_or_else(|_| Err(CopyError::Os(IpcError::Panicked("copy").into())));
                // Finish the slot: DONE unless the source was revoked while the copy ran.
                done(r.and_then(|()| cma::finish(&c.slot)));
            }
            Job::Forget(conn) => {
                self.maps
                    .extract_if(|k, _| k.0 == conn)
                    .for_each(|(_, m)| close_mapping(m));
                self.ids.retain(|k, _| k.0 != conn);
                self.imports.retain(|k, _| k.0 != conn);
                // The peer's mappings go with its end of the connection: nobody to tell.
                self.tellers.remove(&conn);
                self.unshare(|k, _| k.0 == conn);
            }
            Job::ForgetAt(base) => self.unshare(|_, s| s.base == base),
            Job::Unmap(conn, ids) => self.imports.retain(|k, _| k.0 != conn || !ids.contains(&k.1)),
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
                fd: 0,
            });
        }
        Ok(out)
    }

    /// Exports `ranges` as `how` says: each as a legacy handle (`fd` 0) or as its allocation's
    /// VMM descriptor (`fd` k: the k-th passed, one per allocation, at most
    /// [`MAX_LANES`](super::pipe::MAX_LANES) per operation; `buffer_id` is the
    /// export's id).
    fn export_as(&mut self, conn: u64, ranges: &[(u64, u64)], how: ExportAs) -> Result<Export, IpcError> {
        use super::pipe::MAX_LANES;
        let other = match how {
            ExportAs::Handles => return self.export(ranges).map(|s| (s, Vec::new())),
            ExportAs::Descriptors { other_namespace } => other_namespace,
        };
        let mut out = Vec::with_capacity(ranges.len());
        let mut fds: Vec<OwnedFd> = Vec::new();
        let mut ids: Vec<u64> = Vec::new();
        for &(addr, len) in ranges {
            let ordinal = self.ordinal_of_ptr(addr)?;
            let d = self.dev(ordinal)?;
            // SAFETY: makes a retained primary context current on this thread.
            check(unsafe { sys::cuCtxSetCurrent(d.ctx) }, "cuCtxSetCurrent")?;
            let legacy = !other
                && self
                    .attr::<i32>(
                        addr,
                        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
                    )
                    .is_ok_and(|v| v != 0);
            if legacy {
                out.extend(self.export(&[(addr, len)])?);
                continue;
            }
            let (id, base, size, fd) = self.share(conn, addr)?;
            // Between PID namespaces, only memory this crate allocated goes (or all VMM memory
            // where `NIXL_CONNECT_SHARE_VMM=1`): a descriptor gives the whole allocation, kept.
            if other
                && !crate::sys::cuda::is_device_buffer(base, size)
                && !crate::settings::process().share_vmm()
            {
                self.unshare(|k, s| k.0 == conn && s.id == id);
                return Err(IpcError::NotOwned);
            }
            let offset = addr - base;
            if offset.checked_add(len).is_none_or(|e| e > size) {
                // A range running from one allocation into the next (PyTorch's expandable
                // segments map 20 MiB pieces side by side): not one allocation's.
                return Err(IpcError::PastAllocation);
            }
            let k = match ids.iter().position(|&i| i == id) {
                Some(k) => k, // `fd` (another copy of the same descriptor) is closed here
                None => {
                    if fds.len() == MAX_LANES {
                        return Err(IpcError::TooManyAllocations(MAX_LANES));
                    }
                    ids.push(id);
                    fds.push(fd);
                    fds.len() - 1
                }
            };
            out.push(IpcSource {
                uuid: d.uuid,
                handle: [0; 64],
                base,
                alloc_len: size,
                buffer_id: id,
                offset,
                len,
                fd: (k + 1) as u8,
            });
        }
        Ok((out, fds))
    }

    /// The allocation around `addr` shared with the peer of `conn`: its export id, where it is
    /// mapped here, and a copy of its descriptor. Shared (retained, exported) on first use, kept
    /// within this connection's bounds.
    fn share(&mut self, conn: u64, addr: u64) -> Result<(u64, u64, u64, OwnedFd), IpcError> {
        let (h, base, size) = vmm::retain(addr)?;
        self.tick += 1;
        if let Some(s) = self.shared.get_mut(&(conn, h)) {
            vmm::release(h); // the entry holds a reference of its own
            s.used = self.tick;
            s.base = base;
            let fd = s.fd.try_clone().map_err(|_| IpcError::NoDescriptor)?;
            return Ok((s.id, base, size, fd));
        }
        let fd = match vmm::export(h) {
            Ok(fd) => fd,
            Err(e) => {
                vmm::release(h);
                return Err(e);
            }
        };
        let Ok(copy) = fd.try_clone() else {
            vmm::release(h);
            return Err(IpcError::NoDescriptor);
        };
        // Room within the connection's bounds and the process's, least recently used first.
        loop {
            let mine = self.shared.iter().filter(|(k, _)| k.0 == conn);
            let (n, bytes) = mine.fold((0usize, 0u64), |(n, b), (_, s)| (n + 1, b + s.size));
            let conn_full = n > 0 && (n >= MAX_SHARED_PER_CONN || bytes + size > MAX_SHARED_BYTES_PER_CONN);
            let all_full = self.shared.len() >= MAX_SHARED;
            if !conn_full && !all_full {
                break;
            }
            let oldest = self
                .shared
                .iter()
                .filter(|(k, _)| !conn_full || k.0 == conn)
                .min_by_key(|(_, s)| s.used)
                .map(|(k, _)| *k);
            match oldest {
                Some(k) => self.unshare(|key, _| *key == k),
                None => break,
            }
        }
        self.last_id += 1;
        let id = self.last_id;
        self.shared.insert(
            (conn, h),
            Shared {
                id,
                handle: h,
                base,
                size,
                fd,
                used: self.tick,
            },
        );
        Ok((id, base, size, copy))
    }

    /// Gives back the shared allocations `which` selects.
    fn unshare(&mut self, which: impl Fn(&(u64, u64), &Shared) -> bool) {
        let mut told: HashMap<u64, Vec<u64>> = HashMap::new();
        for (k, s) in self.shared.extract_if(|k, s| which(k, s)) {
            vmm::release(s.handle);
            told.entry(k.0).or_default().push(s.id);
        }
        for (conn, ids) in told {
            if let Some(tell) = self.tellers.get(&conn) {
                tell(conn, ids);
            }
        }
    }

    /// The mapping of the peer's VMM allocation `src` names, from connection `conn`, for device
    /// `ordinal`: kept from an earlier operation under the same export id, else imported from
    /// `fd` (passed with this operation) and kept.
    fn vmm_map(
        &mut self,
        conn: u64,
        src: &IpcSource,
        fd: &OwnedFd,
        ordinal: i32,
        ctx: sys::CUcontext,
    ) -> Result<u64, CopyError> {
        let key = (conn, src.buffer_id, ordinal);
        self.tick += 1;
        match self.imports.get_mut(&key) {
            Some(m) if m.len == src.alloc_len => {
                m.used = self.tick;
                return Ok(m.map.ptr());
            }
            Some(_) => {
                // The peer names this id with another size: not the allocation mapped. (Retired:
                // a copy enqueued earlier in this job may still read it.)
                let old = self.imports.remove(&key).expect("present");
                self.retired.push(old);
            }
            None => {}
        }
        loop {
            let bytes: u64 = self.imports.values().map(|m| m.len).sum();
            if self.imports.is_empty()
                || (self.imports.len() < MAX_IMPORTS
                    && bytes.saturating_add(src.alloc_len) <= MAX_IMPORTED_BYTES)
            {
                break;
            }
            if let Some(k) = self.imports.iter().min_by_key(|(_, m)| m.used).map(|(k, _)| *k) {
                let old = self.imports.remove(&k).expect("present");
                self.retired.push(old);
            }
        }
        // SAFETY: makes a retained context current (the mapping is made for its device).
        check(unsafe { sys::cuCtxSetCurrent(ctx) }, "cuCtxSetCurrent")
            .map_err(|e| CopyError::Os(e.into()))?;
        let map =
            vmm::Imported::map(fd, src.alloc_len, ordinal).map_err(|e| CopyError::Unsupported(e.into()))?;
        let ptr = map.ptr();
        self.imports.insert(
            key,
            Import {
                map,
                len: src.alloc_len,
                used: self.tick,
            },
        );
        Ok(ptr)
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
            let stale = self
                .maps
                .extract_if(|k, _| k.0 == conn && k.1 == src.base && k.2 != src.buffer_id);
            self.retired_legacy.extend(stale.map(|(_, m)| m));
        }
        if self.maps.len() >= MAX_MAPPINGS {
            if let Some(&old) = self.maps.iter().min_by_key(|(_, m)| m.used).map(|(k, _)| k) {
                self.retire(old);
            }
        }
        let d = self.dev(ordinal).map_err(|e| CopyError::Unsupported(e.into()))?;
        let mut ptr: sys::CUdeviceptr = 0;
        let h = sys::CUipcMemHandle {
            reserved: src.handle.map(|b| b as _),
        };
        // SAFETY: opens the peer's exported allocation in a retained context; the mapping is
        // recorded and closed exactly once (close_mapping).
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

    /// Takes mapping `key` out of use during a copy; it is closed once the copy's streams are
    /// synchronised (a copy enqueued earlier in the same job may still read it).
    fn retire(&mut self, key: (u64, u64, u64, i32)) {
        if let Some(m) = self.maps.remove(&key) {
            self.retired_legacy.push(m);
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

    fn copy(&mut self, c: &DeviceCopy) -> Result<(), CopyError> {
        let own = c.pid == std::process::id() as libc::pid_t;
        let mut started = false;
        let mut used: Vec<Dev> = Vec::new();
        // Large pieces into pageable host memory, copied through pinned staging once every
        // other piece is queued.
        let mut to_host: Vec<(Dev, cma::Piece)> = Vec::new();
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
                let dst_type =
                    self.attr::<u32>(p.dst, sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE);
                let pageable = staged::pageable(&dst_type, p.dst);
                let dst_ordinal = match dst_type {
                    Ok(t) if t == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 => {
                        Some(self.ordinal_of_ptr(p.dst).map_err(|e| CopyError::Os(e.into()))?)
                    }
                    _ => None,
                };
                let src_ordinal = self
                    .ordinal_of(&p.src.uuid)
                    .map_err(|e| CopyError::Unsupported(e.into()))?;
                let ordinal = dst_ordinal.unwrap_or(src_ordinal);
                let d = self.dev(ordinal).map_err(|e| CopyError::Os(e.into()))?;
                let src = if own {
                    // Two connectors of one process: the exporter's address is ours.
                    p.src.base
                } else if p.src.fd > 0 {
                    // A VMM allocation's descriptor (another PID namespace, or memory without a
                    // legacy handle): mapped once per export id.
                    let fd = c
                        .fds
                        .get(p.src.fd as usize - 1)
                        .ok_or_else(|| CopyError::Unsupported(IpcError::MissingDescriptor.into()))?;
                    self.vmm_map(c.conn, &p.src, fd, ordinal, d.ctx)?
                } else {
                    self.map(c.conn, &p.src, ordinal)?
                };
                // The peer's word on the allocation's size is checked against the mapping itself:
                // a peer claiming more than it exported never makes this process read past it.
                self.within_mapping(d.ctx, src, &p.src)
                    .map_err(|e| CopyError::Unsupported(e.into()))?;
                if pageable && p.src.len as usize >= staged::TO_HOST_MIN {
                    to_host.push((
                        d,
                        cma::Piece {
                            local: p.dst as usize,
                            remote: (src + p.src.offset) as usize,
                            len: p.src.len as usize,
                        },
                    ));
                    continue;
                }
                // SAFETY: `dst` is memory of this process the copy's owner keeps valid until the
                // copy ends (the transport waits for it before freeing); `src` is a mapping of a
                // live grant's allocation, read only, and `offset + len` lies inside it (checked
                // against the mapping above).
                unsafe {
                    queue(
                        d,
                        p.dst,
                        src + p.src.offset,
                        p.src.len as usize,
                        &mut started,
                        &mut used,
                    )?
                };
            }
            // One staged copy per source device (almost always one).
            to_host.sort_by_key(|(d, _)| d.ctx as usize);
            for group in to_host.chunk_by(|a, b| a.0.ctx == b.0.ctx) {
                let (d, pieces) = (group[0].0, group.iter().map(|(_, p)| *p).collect::<Vec<_>>());
                if staged::to_host(d.ctx, pieces.clone(), &c.cancel, started)? {
                    started = true;
                    continue;
                }
                // No staging memory left: the driver's own (slower) staging.
                for p in pieces {
                    // SAFETY: as for the direct copy above: `p.local` is host memory of this
                    // process kept valid until the copy ends, `p.remote` lies inside a checked
                    // mapping of a live grant.
                    unsafe { queue(d, p.local as u64, p.remote as u64, p.len, &mut started, &mut used)? };
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
        // Only now may what was replaced or evicted during this copy go.
        self.retired.clear();
        for m in std::mem::take(&mut self.retired_legacy) {
            close_mapping(m);
        }
        result.and(synced)
    }
}

#[cfg(test)]
mod tests;
