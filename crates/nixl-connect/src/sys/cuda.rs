//! The CUDA driver's floor (feature `cuda`): the calls into the driver that `crate::cuda` (safe
//! code) and the same-host wing's CUDA IPC make, each `unsafe` block with its `SAFETY:` line (the
//! wing's own imports and copies are in `same_host/ipc.rs`, `vmm.rs` and `staged.rs`). Errors are
//! the driver's (`CUresult`, with the call that returned it); the layers above say what they mean.

mod allocation;

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Mutex, OnceLock};

use cudarc::driver::sys::{self, CUresult};
use cudarc::driver::{CudaContext, DriverError};
use tokio::sync::oneshot;

pub(crate) use allocation::{is_live as is_device_buffer, on_drop as on_device_buffer_drop, Allocation};

use super::loaded::LoadWatch;
use crate::sync::Recover;

/// A driver context (retained by whoever hands it out).
pub(crate) type Context = sys::CUcontext;
/// A driver stream of some context.
pub(crate) type Stream = sys::CUstream;
/// A failed driver call: its name, and what the driver answered.
pub(crate) type Failed = (&'static str, CUresult);

/// `Ok` for `CUDA_SUCCESS`, else the call's name and result.
fn check(call: &'static str, r: CUresult) -> Result<(), Failed> {
    (r == CUresult::CUDA_SUCCESS).then_some(()).ok_or((call, r))
}

/// True when the CUDA driver library (`libcuda.so.1`) can be loaded (looked for once: a failed
/// `dlopen` walks the library path, milliseconds that every raw descriptor would otherwise pay).
pub(crate) fn driver_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries to dlopen the driver library by its usual names; nothing is called.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
}

/// True when this process has loaded the CUDA driver library already (somebody uses CUDA here).
pub(crate) fn driver_loaded() -> bool {
    static DRIVER: LoadWatch = LoadWatch::new(b"libcuda.so");
    DRIVER.loaded()
}

/// Why the devices could not be counted.
pub(crate) enum NoDevices {
    /// There is no driver library to load.
    NoDriver,
    /// `cuInit` failed.
    Init(DriverError),
    /// `cuDeviceGetCount` failed.
    Count(DriverError),
}

/// The number of CUDA devices; loads and initialises the driver.
pub(crate) fn device_count() -> Result<usize, NoDevices> {
    if !driver_present() {
        return Err(NoDevices::NoDriver);
    }
    cudarc::driver::result::init().map_err(NoDevices::Init)?;
    CudaContext::device_count()
        .map(|n| n.max(0) as usize)
        .map_err(NoDevices::Count)
}

/// True when something in this process has initialised CUDA already (`cuInit`): never loads or
/// initialises it itself.
pub(crate) fn initialised() -> bool {
    if !driver_loaded() {
        return false;
    }
    let mut n: i32 = 0;
    // SAFETY: cuDeviceGetCount writes one int; before `cuInit` it only answers
    // CUDA_ERROR_NOT_INITIALIZED.
    unsafe { sys::cuDeviceGetCount(&mut n) == CUresult::CUDA_SUCCESS }
}

/// Where the driver says `ptr` lives: `Ok(Some(ordinal))` for device memory, `Ok(None)` for host
/// memory or memory CUDA does not know (or a driver not loaded or not initialised: then nothing is
/// device memory), `Err` when device memory's ordinal cannot be read. Never loads or initialises
/// CUDA.
pub(crate) fn pointer_device(ptr: usize) -> Result<Option<u32>, CUresult> {
    if !driver_loaded() {
        return Ok(None);
    }
    let mut mem_type: u32 = 0;
    // SAFETY: cuPointerGetAttribute writes one unsigned int for MEMORY_TYPE; the pointer value is
    // only inspected by the driver, never dereferenced.
    let r = unsafe {
        sys::cuPointerGetAttribute(
            (&mut mem_type as *mut u32).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            ptr as sys::CUdeviceptr,
        )
    };
    if r != CUresult::CUDA_SUCCESS || mem_type != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
        return Ok(None);
    }
    let mut ordinal: i32 = -1;
    // SAFETY: DEVICE_ORDINAL writes one int.
    let r = unsafe {
        sys::cuPointerGetAttribute(
            (&mut ordinal as *mut i32).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            ptr as sys::CUdeviceptr,
        )
    };
    if r != CUresult::CUDA_SUCCESS || ordinal < 0 {
        return Err(r);
    }
    Ok(Some(ordinal as u32))
}

/// Device `ordinal`'s primary context, retained once for the life of the process.
pub(crate) fn primary(ordinal: u32) -> Result<Context, CUresult> {
    static CTX: OnceLock<Mutex<HashMap<u32, usize>>> = OnceLock::new();
    let mut map = CTX.get_or_init(Default::default).lock().recover();
    if let Some(&c) = map.get(&ordinal) {
        return Ok(c as Context);
    }
    let (mut dev, mut ctx): (sys::CUdevice, Context) = (0, std::ptr::null_mut());
    let ok = |r: CUresult| (r == CUresult::CUDA_SUCCESS).then_some(()).ok_or(r);
    // SAFETY: driver calls writing into the locals; the context is retained and never released.
    unsafe {
        ok(sys::cuInit(0))?;
        ok(sys::cuDeviceGet(&mut dev, ordinal as i32))?;
        ok(sys::cuDevicePrimaryCtxRetain(&mut ctx, dev))?;
    }
    map.insert(ordinal, ctx as usize);
    Ok(ctx)
}

/// Runs `f` with `ctx` (a retained context) current on this thread, restoring whatever was
/// current before.
fn in_context<T>(ctx: Context, f: impl FnOnce() -> T) -> Result<T, Failed> {
    // SAFETY: pushes a retained context on this thread's stack; popped below.
    check("cuCtxPushCurrent", unsafe { sys::cuCtxPushCurrent_v2(ctx) })?;
    let out = f();
    let mut popped: Context = std::ptr::null_mut();
    // SAFETY: pops the context pushed above.
    unsafe { sys::cuCtxPopCurrent_v2(&mut popped) };
    Ok(out)
}

/// Wakes the waiter for a stream; runs on a driver thread once the stream reaches it.
unsafe extern "C" fn reached(user: *mut c_void) {
    // SAFETY: `user` is the sender leaked by `when_reached` for this host function alone, taken
    // back exactly once, here.
    let tx = unsafe { Box::from_raw(user.cast::<oneshot::Sender<()>>()) };
    let _ = tx.send(());
}

/// Where `stream` (of the retained context `ctx`, kept alive by the caller) stands: `None` when
/// its queued work is done, else a receiver woken when the driver reaches what is queued now (a
/// host function queued behind it).
pub(crate) fn when_reached(ctx: Context, stream: Stream) -> Result<Option<oneshot::Receiver<()>>, Failed> {
    in_context(ctx, || {
        // SAFETY: queries a stream of the current context (the caller keeps it alive).
        match unsafe { sys::cuStreamQuery(stream) } {
            CUresult::CUDA_SUCCESS => return Ok(None),
            CUresult::CUDA_ERROR_NOT_READY => {}
            r => return Err(("cuStreamQuery", r)),
        }
        let (tx, rx) = oneshot::channel::<()>();
        let user = Box::into_raw(Box::new(tx));
        // SAFETY: `reached` takes `user` back when the driver runs it; if queuing fails the driver
        // never will, so it is taken back here.
        let r = unsafe { sys::cuLaunchHostFunc(stream, Some(reached), user.cast()) };
        if r != CUresult::CUDA_SUCCESS {
            // SAFETY: not queued: this is the only owner of `user`.
            drop(unsafe { Box::from_raw(user) });
            return Err(("cuLaunchHostFunc", r));
        }
        Ok(Some(rx))
    })?
}

/// What `cuStreamQuery` answers for `stream` (of the retained context `ctx`, kept alive by the
/// caller): `CUDA_SUCCESS` or `CUDA_ERROR_NOT_READY` while it is healthy.
pub(crate) fn stream_state(ctx: Context, stream: Stream) -> Result<CUresult, Failed> {
    // SAFETY: queries a stream of the current context (the caller keeps it alive).
    in_context(ctx, || unsafe { sys::cuStreamQuery(stream) })
}
