//! CUDA device memory (feature `cuda`), through [cudarc] loaded at run time: the crate builds, and
//! its tests run, on machines with no CUDA installed; [`device_count`] then reports why there is
//! no GPU instead of aborting.
//!
//! Descriptors over device memory come from cudarc allocations ([`Descriptor::from_cuda`] owns a
//! `CudaSlice`, [`Descriptor::from_cuda_ref`] / [`Descriptor::from_cuda_mut`] borrow one) or from
//! raw device pointers ([`Descriptor::from_raw_cuda`]). Every one is checked against the pointer's
//! own attributes (`cuPointerGetAttribute`): memory on `cuda:0` claimed as `cuda:1`, or device
//! memory claimed as `cpu`, is [`Error::DeviceMismatch`].
#![allow(unsafe_code)]

use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::{sys, CudaSlice, DevicePtr, DeviceRepr};

use crate::descriptor::{Descriptor, OwnedMemory};
use crate::device::Device;
use crate::error::{Error, Result};

pub use cudarc::driver::{CudaContext, CudaStream};

/// True when the CUDA driver library (`libcuda.so.1`) can be loaded (looked for once: a failed
/// `dlopen` walks the library path, milliseconds that every raw descriptor would otherwise pay).
pub fn driver_available() -> bool {
    static PRESENT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    // SAFETY: only tries to dlopen the driver library by its usual names; nothing is called.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
}

/// True when this process has loaded the CUDA driver library already (somebody uses CUDA here).
fn driver_loaded() -> bool {
    // SAFETY: RTLD_NOLOAD only looks the library up among those already loaded (nothing is loaded
    // or initialised); a handle it returns is closed at once, which leaves the library loaded.
    unsafe {
        let h = libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
        if h.is_null() {
            false
        } else {
            libc::dlclose(h);
            true
        }
    }
}

/// The number of CUDA devices.
///
/// # Errors
/// [`Error::CudaUnavailable`] when there is no driver library or the driver fails to initialise.
pub fn device_count() -> Result<usize> {
    if !driver_available() {
        return Err(Error::CudaUnavailable(
            "the CUDA driver library (libcuda.so.1) is not installed".into(),
        ));
    }
    cudarc::driver::result::init().map_err(|e| Error::CudaUnavailable(format!("cuInit failed: {e}")))?;
    CudaContext::device_count()
        .map(|n| n.max(0) as usize)
        .map_err(|e| Error::CudaUnavailable(format!("cuDeviceGetCount failed: {e}")))
}

/// Where the driver says `ptr` lives: `Some(ordinal)` for device memory, `None` for host memory.
///
/// Never loads or initialises CUDA: in a process that has not loaded the driver, or has not
/// initialised it, no memory can be device memory, and a host-only worker must stay free of CUDA
/// (its initialisation costs time, and CUDA does not survive into the children of `fork()`).
pub(crate) fn locate(ptr: usize) -> Result<Option<u32>> {
    if !driver_loaded() || !driver_available() {
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
        return Err(Error::CudaUnavailable(format!(
            "cannot query the device of pointer {ptr:#x}: {r:?}"
        )));
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
            actual: actual.map_or("host memory".to_string(), |m| format!("memory on cuda:{m}")),
        })
    }
}

/// An owned cudarc allocation with its device pointer.
struct Owned<T> {
    _slice: CudaSlice<T>,
    ptr: usize,
    len: usize,
}

// SAFETY (Sync): Owned is only read for its (ptr, len); the slice itself is never accessed
// through a shared reference.
unsafe impl<T: Send> Sync for Owned<T> {}

impl<T: Send + 'static> crate::descriptor::sealed::Sealed for Owned<T> {}
impl<T: Send + 'static> OwnedMemory for Owned<T> {
    fn raw(&self) -> (usize, usize) {
        (self.ptr, self.len)
    }
    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any> {
        self
    }
}

/// The slice's device pointer, once the work queued on its stream so far has finished: a transfer
/// of the descriptor (NIXL or CUDA IPC, on other streams or other processes) must not overtake a
/// kernel still writing or reading the memory. Work queued after the descriptor is made is the
/// caller's to finish before starting an operation (docs/GPU.md).
fn ptr_of<T>(slice: &CudaSlice<T>, stream: &Arc<CudaStream>) -> Result<usize> {
    let p = {
        // The guard orders `stream` after the slice's pending writes (and records this use when
        // dropped); both are on the slice's own stream here.
        let (p, _sync) = slice.device_ptr(stream);
        p as usize
    };
    stream
        .synchronize()
        .map_err(|e| Error::CudaUnavailable(format!("synchronising the slice's stream failed: {e}")))?;
    Ok(p)
}

impl Descriptor<'static> {
    /// A descriptor owning a cudarc device allocation (freed when the descriptor is dropped).
    ///
    /// Waits (blocking) for the work queued on the slice's stream so far, so that no transfer of
    /// the descriptor overtakes it; make descriptors after the kernels that fill the memory.
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`] if the driver places the memory elsewhere than the slice's context;
    /// [`Error::CudaUnavailable`] if synchronising its stream fails.
    pub fn from_cuda<T: DeviceRepr + Send + 'static>(slice: CudaSlice<T>) -> Result<Self> {
        let stream = slice.stream().clone();
        let device = Device::Cuda(stream.context().ordinal() as u32);
        let ptr = ptr_of(&slice, &stream)?;
        let len = slice.len() * std::mem::size_of::<T>();
        verify(ptr, device)?;
        Ok(Descriptor::owned_on(
            Box::new(Owned {
                _slice: slice,
                ptr,
                len,
            }),
            device,
        ))
    }

    /// A descriptor over raw device memory, checked against the pointer's attributes.
    ///
    /// # Safety
    /// As [`Descriptor::from_raw_parts`].
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`] when `ptr` is not memory on `device`.
    pub unsafe fn from_raw_cuda(ptr: u64, len: usize, device: Device) -> Result<Self> {
        verify(ptr as usize, device)?;
        // SAFETY: the caller upholds from_raw_parts's contract.
        Ok(unsafe { Descriptor::from_raw_parts(ptr as *mut u8, len, device) })
    }
}

impl<'a> Descriptor<'a> {
    /// A read-only descriptor borrowing a cudarc allocation.
    ///
    /// # Errors
    /// As [`Descriptor::from_cuda`].
    pub fn from_cuda_ref<T: DeviceRepr>(slice: &'a CudaSlice<T>) -> Result<Self> {
        Self::borrow_cuda(slice, false)
    }

    /// A writable descriptor borrowing a cudarc allocation.
    ///
    /// # Errors
    /// As [`Descriptor::from_cuda`].
    pub fn from_cuda_mut<T: DeviceRepr>(slice: &'a mut CudaSlice<T>) -> Result<Self> {
        Self::borrow_cuda(slice, true)
    }

    fn borrow_cuda<T: DeviceRepr>(slice: &CudaSlice<T>, writable: bool) -> Result<Self> {
        let stream = slice.stream().clone();
        let device = Device::Cuda(stream.context().ordinal() as u32);
        let ptr = ptr_of(slice, &stream)?;
        verify(ptr, device)?;
        Ok(Descriptor::borrowed_raw(
            ptr,
            slice.len() * std::mem::size_of::<T>(),
            device,
            writable,
            PhantomData,
        ))
    }
}
