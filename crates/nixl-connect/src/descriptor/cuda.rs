//! Descriptors over CUDA device memory (feature `cuda`): cudarc allocations owned or borrowed,
//! each checked against the pointer's own attributes ([`crate::cuda`] holds the driver calls).

use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DeviceRepr};

use super::{Descriptor, OwnedMemory};
use crate::cuda::{verify, DeviceBuffer, Producer};
use crate::device::Device;
use crate::error::Result;

/// An owned cudarc allocation with its device pointer.
struct Owned<T> {
    _slice: CudaSlice<T>,
    ptr: usize,
    len: usize,
}

/// The slice is dropped with its context bound to the dropping thread (an engine or copy thread
/// may be the last holder): cudarc frees pool memory on the slice's stream, which needs it, and
/// would otherwise record an error that its next call on any thread returns.
impl<T> Drop for Owned<T> {
    fn drop(&mut self) {
        let _ = self._slice.stream().context().bind_to_thread();
    }
}

impl<T: Send + 'static> super::sealed::Sealed for Owned<T> {}
impl<T: Send + 'static> OwnedMemory for Owned<T> {
    fn raw(&self) -> (usize, usize) {
        (self.ptr, self.len)
    }
}

/// The slice's device pointer. The slice's stream becomes the descriptor's producer stream
/// ([`Descriptor::ordered_after`]): an operation over the descriptor waits for the work queued
/// there before the operation is created, so no transfer (NIXL or CUDA IPC, on other streams or in
/// other processes) overtakes a kernel that fills or reads the memory.
fn ptr_of<T>(slice: &CudaSlice<T>, stream: &Arc<CudaStream>) -> usize {
    // The guard orders `stream` after the slice's pending writes on other streams (and records
    // this use when dropped).
    let (p, _sync) = slice.device_ptr(stream);
    p as usize
}

impl Descriptor<'static> {
    /// A descriptor owning a cudarc device allocation (freed when the descriptor is dropped).
    ///
    /// Never blocks: an operation over the descriptor starts once the work queued on the slice's
    /// stream before the operation was created is done (and waits for nothing else on the device).
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`](crate::Error::DeviceMismatch) if the driver places the memory
    /// elsewhere than the slice's context.
    pub fn from_cuda<T: DeviceRepr + Send + 'static>(slice: CudaSlice<T>) -> Result<Self> {
        let stream = slice.stream().clone();
        let device = Device::Cuda(stream.context().ordinal() as u32);
        let ptr = ptr_of(&slice, &stream);
        let len = slice.len() * std::mem::size_of::<T>();
        verify(ptr, device)?;
        let mut d = Descriptor::owned_on(
            Box::new(Owned {
                _slice: slice,
                ptr,
                len,
            }),
            device,
        );
        d.set_producer(Producer::Stream(stream));
        Ok(d)
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
        let ptr = ptr_of(slice, &stream);
        verify(ptr, device)?;
        let mut d = Descriptor::borrowed_raw(
            ptr,
            slice.len() * std::mem::size_of::<T>(),
            device,
            writable,
            PhantomData,
        );
        d.set_producer(Producer::Stream(stream));
        Ok(d)
    }
}

/// A descriptor over a whole [`DeviceBuffer`], borrowing it: the buffer outlives every operation
/// over it.
///
/// # Errors
/// [`Error::DeviceMismatch`](crate::Error::DeviceMismatch) should the driver place the memory
/// elsewhere (never expected).
impl<'a> TryFrom<&'a mut DeviceBuffer> for Descriptor<'a> {
    type Error = crate::Error;

    fn try_from(buf: &'a mut DeviceBuffer) -> Result<Self> {
        // The memory stays allocated and mapped while `buf` is borrowed, which the descriptor's
        // lifetime ties it to.
        verify(buf.ptr() as usize, buf.device())?;
        Ok(Descriptor::borrowed_raw(
            buf.ptr() as usize,
            buf.len(),
            buf.device(),
            true,
            PhantomData,
        ))
    }
}
