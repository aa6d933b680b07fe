//! Descriptors over CUDA device memory (feature `cuda`): cudarc allocations owned or borrowed,
//! each checked against the pointer's own attributes ([`crate::cuda`] holds the driver calls).
#![allow(unsafe_code)]

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
    /// [`Error::DeviceMismatch`](crate::Error::DeviceMismatch) if the driver places the memory elsewhere than the slice's context.
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

    /// A descriptor over raw device memory, checked against the pointer's attributes.
    ///
    /// Operations over it wait for no stream: finish the work that fills or uses the memory first,
    /// or name its stream with [`Descriptor::ordered_after`].
    ///
    /// # Safety
    /// As [`Descriptor::from_raw_parts`].
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`](crate::Error::DeviceMismatch) when `ptr` is not memory on `device`.
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

    /// Names the CUDA stream that produces (or last uses) this descriptor's device memory: an
    /// operation over the descriptor starts once the work queued on `stream` before the operation
    /// was created is done, and waits for nothing else on the device (not for other streams of the
    /// context, unlike a context-wide synchronisation). `stream` is a `CUstream` of the primary
    /// context of the descriptor's device; `0` or `1` is the legacy default stream, `2` the
    /// per-thread one (a torch tensor's `torch.cuda.current_stream().cuda_stream`, CUDA array
    /// interface's `stream`). Host descriptors ignore it.
    ///
    /// # Safety
    /// `stream` must stay a valid stream of that context for as long as operations over the
    /// descriptor may be created.
    pub unsafe fn ordered_after(mut self, stream: u64) -> Self {
        if let Device::Cuda(ordinal) = self.device() {
            self.set_producer(Producer::Raw {
                stream: stream as usize,
                ordinal,
            });
        }
        self
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
        // SAFETY: the memory stays allocated and mapped while `buf` is borrowed, which the
        // descriptor's lifetime ties it to.
        unsafe { Descriptor::from_raw_cuda(buf.ptr(), buf.len(), buf.device()) }
    }
}
