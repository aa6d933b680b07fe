//! [`DeviceBuffer`]: device memory this crate allocates, shareable with peers in other PID
//! namespaces (pods).

use std::sync::Arc;

use cudarc::driver::CudaContext;

use super::failed;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::sys::cuda::Allocation;

/// Device memory allocated by this crate as one VMM allocation (`cuMemCreate`) whose handle type
/// is a POSIX descriptor: the same-host path moves it between processes that share no PID or
/// IPC namespace (two pods on one node) by passing that descriptor (`op.mechanism()` says
/// `cuda-vmm`), where memory from `cuMemAlloc` (legacy CUDA IPC) cannot cross. A peer given it
/// sees this allocation alone, never another.
///
/// Its size is rounded up to the device's allocation granularity (2 MiB on current GPUs);
/// [`len`](Self::len) is the size asked for. The memory is zeroed when allocated.
///
/// ```no_run
/// # fn main() -> nixl_connect::Result<()> {
/// use nixl_connect::{cuda::DeviceBuffer, Device};
/// let mut buf = DeviceBuffer::new(Device::Cuda(0), 64 << 20)?;
/// buf.copy_from_host(&vec![7u8; 64 << 20])?;
/// let descriptor = nixl_connect::Descriptor::try_from(&mut buf)?; // expose it, or read into it
/// # drop(descriptor);
/// # Ok(())
/// # }
/// ```
pub struct DeviceBuffer {
    /// Dropped first: freed with the context bound (`Drop`), while the context is still held.
    alloc: Allocation,
    ctx: Arc<CudaContext>,
    len: usize,
    device: Device,
}

fn bind(ctx: &CudaContext) -> Result<()> {
    ctx.bind_to_thread()
        .map_err(|e| Error::cuda_unavailable("cannot bind the device's context", Some(Arc::new(e))))
}

impl DeviceBuffer {
    /// Allocates `len` bytes on `device` (a `cuda:N` device), zeroed.
    ///
    /// # Errors
    /// [`Error::CudaUnavailable`] without a driver or that device, or when the driver refuses the
    /// allocation (out of memory, no VMM support); [`Error::InvalidArgument`] for a device that
    /// is not CUDA.
    pub fn new(device: Device, len: usize) -> Result<Self> {
        let Device::Cuda(ordinal) = device else {
            return Err(Error::InvalidArgument(format!(
                "a DeviceBuffer lives on a CUDA device, not {device}"
            )));
        };
        if ordinal as usize >= super::device_count()? {
            return Err(Error::cuda_unavailable(
                format!("there is no device {device}"),
                None,
            ));
        }
        let ctx = CudaContext::new(ordinal as usize)
            .map_err(|e| Error::cuda_unavailable(format!("no context on {device}"), Some(Arc::new(e))))?;
        bind(&ctx)?;
        let gran = Allocation::granularity(ordinal).map_err(failed)?;
        let size =
            len.max(1).div_ceil(gran).checked_mul(gran).ok_or_else(|| {
                Error::InvalidArgument(format!("a DeviceBuffer of {len} bytes is too large"))
            })?;
        let alloc = Allocation::new(ordinal, size).map_err(failed)?;
        Ok(DeviceBuffer {
            alloc,
            ctx,
            len,
            device,
        })
    }

    /// Its device address.
    pub fn ptr(&self) -> u64 {
        self.alloc.ptr()
    }

    /// Its length in bytes (as asked for).
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a buffer of no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device it lives on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Copies `src` to the start of the buffer (synchronous).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `src` is longer than the buffer; [`Error::CudaUnavailable`]
    /// when the copy fails.
    pub fn copy_from_host(&mut self, src: &[u8]) -> Result<()> {
        if src.len() > self.len {
            return Err(Error::InvalidArgument(format!(
                "{} bytes do not fit a DeviceBuffer of {}",
                src.len(),
                self.len
            )));
        }
        bind(&self.ctx)?;
        self.alloc.copy_from_host(src).map_err(failed)
    }

    /// Copies the start of the buffer into `dst` (synchronous).
    ///
    /// # Errors
    /// As [`copy_from_host`](Self::copy_from_host).
    pub fn copy_to_host(&self, dst: &mut [u8]) -> Result<()> {
        if dst.len() > self.len {
            return Err(Error::InvalidArgument(format!(
                "{} bytes are more than a DeviceBuffer of {} holds",
                dst.len(),
                self.len
            )));
        }
        bind(&self.ctx)?;
        self.alloc.copy_to_host(dst).map_err(failed)
    }
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("device", &self.device)
            .field("ptr", &format_args!("{:#x}", self.ptr()))
            .field("len", &self.len)
            .finish()
    }
}

/// The allocation is freed (by its own `Drop`, right after this) with the buffer's context bound.
impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
    }
}
