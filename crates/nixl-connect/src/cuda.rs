//! CUDA device memory (feature `cuda`), through [cudarc] loaded at run time: the crate builds, and
//! its tests run, on machines with no CUDA installed; [`device_count`] then reports why there is
//! no GPU instead of aborting.
//!
//! Descriptors over device memory come from cudarc allocations
//! ([`Descriptor::from_cuda`](crate::Descriptor::from_cuda) owns a `CudaSlice`,
//! [`Descriptor::from_cuda_ref`](crate::Descriptor::from_cuda_ref) /
//! [`Descriptor::from_cuda_mut`](crate::Descriptor::from_cuda_mut) borrow one) or from raw device
//! pointers ([`Descriptor::from_raw_cuda`](crate::Descriptor::from_raw_cuda)). Every one is
//! checked against the pointer's own attributes: memory on `cuda:0` claimed as `cuda:1`, or device
//! memory claimed as `cpu`, is [`Error::DeviceMismatch`].
//!
//! [`DeviceBuffer`] is device memory this crate allocates (a VMM allocation with a POSIX
//! descriptor handle): the one kind of device memory the same-host path moves between pods.

use std::sync::Arc;

use crate::device::Device;
use crate::error::{Error, Result};
use crate::sys::cuda::{self as floor, Failed, NoDevices};

pub use cudarc::driver::{CudaContext, CudaStream};

mod buffer;
mod order;
pub use buffer::DeviceBuffer;
pub(crate) use order::{after, Producer};

pub(crate) use floor::driver_loaded;

/// True when the CUDA driver library (`libcuda.so.1`) can be loaded (looked for once).
pub fn driver_available() -> bool {
    floor::driver_present()
}

/// The number of CUDA devices.
///
/// # Errors
/// [`Error::CudaUnavailable`] when there is no driver library or the driver fails to initialise.
pub fn device_count() -> Result<usize> {
    floor::device_count().map_err(|e| match e {
        NoDevices::NoDriver => {
            Error::cuda_unavailable("the CUDA driver library (libcuda.so.1) is not installed", None)
        }
        NoDevices::Init(e) => Error::cuda_unavailable("cuInit failed", Some(Arc::new(e))),
        NoDevices::Count(e) => Error::cuda_unavailable("cuDeviceGetCount failed", Some(Arc::new(e))),
    })
}

/// A failed driver call as this crate's error.
fn failed((call, r): Failed) -> Error {
    Error::cuda_unavailable(format!("{call} failed: {r:?}"), None)
}

/// Where the driver says `ptr` lives: `Some(ordinal)` for device memory, `None` for host memory.
///
/// Never loads or initialises CUDA: in a process that has not loaded the driver, or has not
/// initialised it, no memory can be device memory, and a host-only worker must stay free of CUDA
/// (its initialisation costs time, and CUDA does not survive into the children of `fork()`).
pub(crate) fn locate(ptr: usize) -> Result<Option<u32>> {
    floor::pointer_device(ptr).map_err(|r| {
        Error::cuda_unavailable(
            format!("cannot query the device of pointer {ptr:#x}: {r:?}"),
            None,
        )
    })
}

/// Checks that memory at `ptr` is where `claimed` says.
pub(crate) fn verify(ptr: usize, claimed: Device) -> Result<()> {
    let actual = locate(ptr)?;
    match (claimed, actual) {
        (Device::Host, None) => Ok(()),
        (Device::Cuda(n), Some(m)) if n == m => Ok(()),
        // Without a driver nothing can be checked (and nothing could be transferred either).
        (Device::Cuda(_), None) if !driver_available() => Ok(()),
        _ => Err(Error::DeviceMismatch {
            claimed,
            actual: actual.map_or(Device::Host, Device::Cuda),
        }),
    }
}
