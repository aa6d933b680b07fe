//! Why a step of the device path failed: the error both the direct CUDA IPC copies (`ipc`) and
//! pinned staging (`staged`) report, below both.

use std::sync::Arc;

use cudarc::driver::sys::CUresult;

use crate::error::ErrorSource;

/// Why a step of the device path failed (shared as an [`ErrorSource`] beyond the floor).
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
    /// The memory is not a VMM allocation with a POSIX-descriptor handle type, the only device
    /// memory that crosses PID namespaces.
    #[error(
        "the device memory cannot be exported as a descriptor (it is not a VMM allocation with a \
         POSIX-descriptor handle type: cuMemAlloc and PyTorch's default allocator make none; \
         allocate with nixl_connect::cuda::DeviceBuffer, or run PyTorch with \
         PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)"
    )]
    NotExportable,
    /// One operation's ranges lie in more VMM allocations than one frame may pass descriptors
    /// for.
    #[error("the ranges lie in more than {0} device allocations, more than one frame may pass")]
    TooManyAllocations(usize),
    /// A range's descriptor is not among those passed, or names allocations of different sizes.
    #[error("a device range names a descriptor that was not passed with it")]
    MissingDescriptor,
    /// VMM memory this crate did not allocate, for a peer in another PID namespace: its
    /// descriptor would give the peer the whole allocation for as long as it keeps it (a
    /// PyTorch segment's piece holds other tensors), which nothing else there could reach.
    #[error(
        "the device memory is not a nixl_connect DeviceBuffer: to a peer in another PID namespace \
         only those are shared as descriptors (the peer could keep the whole allocation, which may \
         hold other tensors); allocate with DeviceBuffer, or set NIXL_CONNECT_SHARE_VMM=1 to share \
         other VMM memory (PyTorch's expandable segments) anyway"
    )]
    NotOwned,
    /// A size this process cannot map.
    #[error("a device allocation too large to map here")]
    TooLarge,
    /// No descriptor left to copy an export's into (the process's limit).
    #[error("no file descriptor left to pass a device export (raise the open-files limit)")]
    NoDescriptor,
    /// A driver call panicked (the step is abandoned; the thread goes on).
    #[error("the CUDA {0} panicked")]
    Panicked(&'static str),
}

impl From<IpcError> for ErrorSource {
    fn from(e: IpcError) -> Self {
        Arc::new(e)
    }
}

/// `Ok` for a driver call that succeeded, else the call and its result.
pub(crate) fn check(result: CUresult, call: &'static str) -> Result<(), IpcError> {
    if result == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(IpcError::Driver { call, result })
    }
}
