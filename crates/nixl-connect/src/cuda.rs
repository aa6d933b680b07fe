//! CUDA device memory (feature `cuda`), through [cudarc] loaded at run time: the crate builds, and
//! its tests run, on machines with no CUDA installed; [`device_count`] then reports why there is
//! no GPU instead of aborting.
//!
//! Descriptors over device memory come from cudarc allocations
//! ([`Descriptor::from_cuda`](crate::Descriptor::from_cuda) owns a `CudaSlice`,
//! [`Descriptor::from_cuda_ref`](crate::Descriptor::from_cuda_ref) /
//! [`Descriptor::from_cuda_mut`](crate::Descriptor::from_cuda_mut) borrow one) or from raw device
//! pointers ([`Descriptor::from_raw_cuda`](crate::Descriptor::from_raw_cuda)); they live in
//! `descriptor/cuda.rs`, above this module. Every one is checked against the pointer's own
//! attributes (`cuPointerGetAttribute`, in this module): memory on `cuda:0` claimed as `cuda:1`,
//! or device memory claimed as `cpu`, is [`Error::DeviceMismatch`].
//!
//! [`DeviceBuffer`] is device memory this crate allocates (a VMM allocation with a POSIX
//! descriptor handle): the one kind of device memory the same-host path moves between pods.
#![allow(unsafe_code)]

use std::sync::Arc;

use cudarc::driver::sys;

use crate::device::Device;
use crate::error::{Error, Result};

pub use cudarc::driver::{CudaContext, CudaStream};

mod buffer;
mod order;
pub use buffer::DeviceBuffer;
pub(crate) use buffer::{is_device_buffer, on_drop as on_device_buffer_drop};
pub(crate) use order::{after, primary, Producer};

/// True when the CUDA driver library (`libcuda.so.1`) can be loaded (looked for once: a failed
/// `dlopen` walks the library path, milliseconds that every raw descriptor would otherwise pay).
pub fn driver_available() -> bool {
    static PRESENT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    // SAFETY: only tries to dlopen the driver library by its usual names; nothing is called.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
}

/// True when this process has loaded the CUDA driver library already (somebody uses CUDA here).
pub(crate) fn driver_loaded() -> bool {
    static DRIVER: LoadWatch = LoadWatch::new(b"libcuda.so");
    DRIVER.loaded()
}

/// Whether a library is loaded in this process, asked for every raw descriptor.
///
/// It walks the list of loaded objects in memory (`dl_iterate_phdr`) instead of asking
/// `dlopen(RTLD_NOLOAD)`, which searches the library path on disk when the library is not loaded
/// (a dozen system calls, and an `munmap` that interrupts every core this process runs on, twice
/// per operation from Python). Once seen loaded, it stays so (the library is never unloaded). A
/// "not loaded" answer is kept with the loader's count of objects added (`dlpi_adds`): while that
/// is unchanged, the first object visited answers and the walk stops there (objects removed since
/// cannot have brought the library).
struct LoadWatch {
    /// The start of the library's file name.
    prefix: &'static [u8],
    loaded: std::sync::atomic::AtomicBool,
    /// The loader's count of objects added when a whole walk last found no such library (MAX:
    /// never walked).
    absent_at: std::sync::atomic::AtomicU64,
}

/// What one walk of the loaded objects learns.
struct Walk<'w> {
    watch: &'w LoadWatch,
    first_seen: bool,
    adds: Option<u64>,
    unchanged: bool,
}

impl LoadWatch {
    const fn new(prefix: &'static [u8]) -> Self {
        Self {
            prefix,
            loaded: std::sync::atomic::AtomicBool::new(false),
            absent_at: std::sync::atomic::AtomicU64::new(u64::MAX),
        }
    }

    fn loaded(&self) -> bool {
        use std::sync::atomic::Ordering;
        if self.loaded.load(Ordering::Relaxed) {
            return true;
        }
        let mut walk = Walk {
            watch: self,
            first_seen: false,
            adds: None,
            unchanged: false,
        };
        // SAFETY: dl_iterate_phdr calls `visit` once per loaded object, with the loader's lock
        // held; `visit` reads what it is given and writes only `walk`, which outlives the call.
        let stopped =
            unsafe { libc::dl_iterate_phdr(Some(Self::visit), std::ptr::addr_of_mut!(walk).cast()) } != 0;
        let found = stopped && !walk.unchanged;
        if found {
            self.loaded.store(true, Ordering::Relaxed);
        } else if let (false, Some(adds)) = (walk.unchanged, walk.adds) {
            self.absent_at.store(adds, Ordering::Relaxed);
        }
        found
    }

    unsafe extern "C" fn visit(
        info: *mut libc::dl_phdr_info,
        size: libc::size_t,
        data: *mut libc::c_void,
    ) -> libc::c_int {
        use std::sync::atomic::Ordering;
        // SAFETY: `data` is the `Walk` that `loaded` passes, alive and not otherwise borrowed
        // during the walk.
        let walk = unsafe { &mut *data.cast::<Walk<'_>>() };
        if !walk.first_seen {
            walk.first_seen = true;
            // The count is there when the loader's structure reaches it (glibc >= 2.4).
            if size >= std::mem::offset_of!(libc::dl_phdr_info, dlpi_adds) + 8 {
                // SAFETY: the loader passes a valid dl_phdr_info of `size` bytes.
                let adds = unsafe { (*info).dlpi_adds };
                walk.adds = Some(adds);
                if walk.watch.absent_at.load(Ordering::Relaxed) == adds {
                    // Nothing was loaded since a whole walk found no such library.
                    walk.unchanged = true;
                    return 1;
                }
            }
        }
        // SAFETY: the loader passes a valid dl_phdr_info whose dlpi_name is null or a
        // NUL-terminated path, valid for the duration of this call.
        let name = unsafe { (*info).dlpi_name };
        if name.is_null() {
            return 0;
        }
        // SAFETY: as above.
        let path = unsafe { std::ffi::CStr::from_ptr(name) }.to_bytes();
        let file = path.rsplit(|&b| b == b'/').next().unwrap_or(path);
        i32::from(file.starts_with(walk.watch.prefix))
    }
}

/// The number of CUDA devices.
///
/// # Errors
/// [`Error::CudaUnavailable`] when there is no driver library or the driver fails to initialise.
pub fn device_count() -> Result<usize> {
    if !driver_available() {
        return Err(Error::cuda_unavailable(
            "the CUDA driver library (libcuda.so.1) is not installed",
            None,
        ));
    }
    cudarc::driver::result::init()
        .map_err(|e| Error::cuda_unavailable("cuInit failed", Some(Arc::new(e))))?;
    CudaContext::device_count()
        .map(|n| n.max(0) as usize)
        .map_err(|e| Error::cuda_unavailable("cuDeviceGetCount failed", Some(Arc::new(e))))
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
    let r = unsafe { sys::cuDeviceGetCount(&mut n) };
    r == sys::CUresult::CUDA_SUCCESS
}

/// Where the driver says `ptr` lives: `Some(ordinal)` for device memory, `None` for host memory.
///
/// Never loads or initialises CUDA: in a process that has not loaded the driver, or has not
/// initialised it, no memory can be device memory, and a host-only worker must stay free of CUDA
/// (its initialisation costs time, and CUDA does not survive into the children of `fork()`).
pub(crate) fn locate(ptr: usize) -> Result<Option<u32>> {
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
    if r != sys::CUresult::CUDA_SUCCESS || mem_type != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
        // Unknown to CUDA (plain host memory), host/pinned memory, or CUDA not initialised
        // (CUDA_ERROR_NOT_INITIALIZED: then nothing is device memory).
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
    if r != sys::CUresult::CUDA_SUCCESS || ordinal < 0 {
        return Err(Error::cuda_unavailable(
            format!("cannot query the device of pointer {ptr:#x}: {r:?}"),
            None,
        ));
    }
    Ok(Some(ordinal as u32))
}

/// Checks that memory at `ptr` is where `claimed` says.
pub(crate) fn verify(ptr: usize, claimed: Device) -> Result<()> {
    let actual = locate(ptr)?;
    let ok = match (claimed, actual) {
        (Device::Host, None) => true,
        (Device::Cuda(n), Some(m)) => n == m,
        // Without a driver nothing can be checked (and nothing could be transferred either).
        (Device::Cuda(_), None) => !driver_available(),
        _ => false,
    };
    if ok {
        Ok(())
    } else {
        Err(Error::DeviceMismatch {
            claimed,
            actual: actual.map_or(Device::Host, Device::Cuda),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::LoadWatch;

    /// Whether this process maps a file whose name starts with `prefix`.
    fn mapped(prefix: &str) -> bool {
        std::fs::read_to_string("/proc/self/maps")
            .unwrap()
            .lines()
            .filter_map(|l| l.rsplit('/').next())
            .any(|f| f.starts_with(prefix))
    }

    #[test]
    fn cuda_load_watch_sees_a_library_loaded_after_it_answered_no() {
        // glibc's libBrokenLocale: on every glibc system, and loaded by nothing else here (zlib
        // was the first choice, but a test that loads NIXL concurrently brings it in).
        let watch = LoadWatch::new(b"libBrokenLocale.so");
        if mapped("libBrokenLocale.so") {
            assert!(watch.loaded());
            return;
        }
        assert!(!watch.loaded(), "a whole walk finds no libBrokenLocale");
        assert!(!watch.loaded(), "the kept answer, nothing loaded since");
        // SAFETY: loading libBrokenLocale runs only its own initialisers; it is never closed.
        let lib = unsafe {
            libc::dlopen(
                c"libBrokenLocale.so.1".as_ptr(),
                libc::RTLD_NOW | libc::RTLD_LOCAL,
            )
        };
        assert!(!lib.is_null(), "glibc's libBrokenLocale is installed");
        assert!(
            watch.loaded(),
            "the loader's count moved: walked again, and found"
        );
        assert!(watch.loaded(), "once seen, kept");
    }
}
