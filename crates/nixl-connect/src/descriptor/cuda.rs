//! Descriptors over CUDA device memory (feature `cuda`): cudarc allocations owned or borrowed,
//! each checked against the pointer's own attributes ([`crate::cuda`] holds the driver calls).
#![allow(unsafe_code)]

use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DeviceRepr};

use super::{Descriptor, OwnedMemory};
use crate::cuda::verify;
use crate::device::Device;
use crate::error::{Error, Result};

/// An owned cudarc allocation with its device pointer.
struct Owned<T> {
    _slice: CudaSlice<T>,
    ptr: usize,
    len: usize,
}

// SAFETY: (Sync) Owned is only read for its (ptr, len); the slice itself is never accessed
// through a shared reference.
unsafe impl<T: Send> Sync for Owned<T> {}

impl<T: Send + 'static> super::sealed::Sealed for Owned<T> {}
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
    stream.synchronize().map_err(|e| {
        Error::cuda_unavailable(
            format!("synchronising the slice's stream failed: {e}"),
            Some(Arc::new(e)),
        )
    })?;
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
