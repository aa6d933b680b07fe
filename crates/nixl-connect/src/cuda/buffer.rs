//! [`DeviceBuffer`]: device memory this crate allocates, shareable with peers in other PID
//! namespaces (pods).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{sys, CudaContext};

use crate::device::Device;
use crate::error::{Error, Result};
use crate::sync::Recover;

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
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
    len: usize,
    size: usize,
    handle: sys::CUmemGenericAllocationHandle,
    device: Device,
}

/// Told a buffer's address as it is dropped (set by the same-host path, which then gives back
/// what it shared of it with peers, instead of keeping the memory allocated for them).
static ON_DROP: OnceLock<fn(u64)> = OnceLock::new();

/// Sets what is told of every [`DeviceBuffer`] dropped from now on (once per process).
pub(crate) fn on_drop(hook: fn(u64)) {
    let _ = ON_DROP.set(hook);
}

/// The live buffers' allocations: address -> size (what the same-host path may share with a peer
/// in another PID namespace).
static LIVE: Mutex<BTreeMap<u64, usize>> = Mutex::new(BTreeMap::new());

/// True when a live [`DeviceBuffer`] is the allocation mapped at `base`, `size` bytes.
pub(crate) fn is_device_buffer(base: u64, size: u64) -> bool {
    LIVE.lock()
        .recover()
        .get(&base)
        .is_some_and(|&s| s as u64 == size)
}

fn check(r: sys::CUresult, what: &str) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::cuda_unavailable(format!("{what} failed: {r:?}"), None))
    }
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
        ctx.bind_to_thread()
            .map_err(|e| Error::cuda_unavailable("cannot bind the device's context", Some(Arc::new(e))))?;
        let location = sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: ordinal as i32,
        };
        // SAFETY: a plain-old-data struct of the driver's, all-zero then filled in below.
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.requestedHandleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        prop.location = location;
        let mut gran = 0usize;
        // SAFETY: writes the granularity for `prop` into the local.
        let r = unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut gran,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        };
        check(r, "cuMemGetAllocationGranularity")?;
        let gran = gran.max(1);
        let size =
            len.max(1).div_ceil(gran).checked_mul(gran).ok_or_else(|| {
                Error::InvalidArgument(format!("a DeviceBuffer of {len} bytes is too large"))
            })?;
        let mut b = DeviceBuffer {
            ctx,
            ptr: 0,
            len,
            size,
            handle: 0,
            device,
        };
        let access = sys::CUmemAccessDesc {
            location,
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: creates the allocation, reserves an address range of its size, maps it there,
        // opens it to its device and zeroes it; Drop undoes whichever steps were done (a zero
        // handle or pointer is one not made).
        unsafe {
            check(sys::cuMemCreate(&mut b.handle, size, &prop, 0), "cuMemCreate")?;
            let mut ptr = 0;
            check(
                sys::cuMemAddressReserve(&mut ptr, size, 0, 0, 0),
                "cuMemAddressReserve",
            )?;
            b.ptr = ptr;
            if let Err(e) = check(sys::cuMemMap(ptr, size, 0, b.handle, 0), "cuMemMap") {
                sys::cuMemAddressFree(ptr, size);
                b.ptr = 0;
                return Err(e);
            }
            check(sys::cuMemSetAccess(ptr, size, &access, 1), "cuMemSetAccess")?;
            check(sys::cuMemsetD8_v2(ptr, 0, size), "cuMemsetD8")?;
            // The memset is asynchronous to the host: done before anyone else uses the memory.
            check(
                sys::cuStreamSynchronize(std::ptr::null_mut()),
                "cuStreamSynchronize",
            )?;
        }
        LIVE.lock().recover().insert(b.ptr, size);
        Ok(b)
    }

    /// Its device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
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
        self.bind()?;
        // SAFETY: copies `src.len()` bytes (within the buffer, checked above) from host memory,
        // then waits for the copy (from pageable memory it may return before the device has it).
        let r = unsafe { sys::cuMemcpyHtoD_v2(self.ptr, src.as_ptr().cast(), src.len()) };
        check(r, "cuMemcpyHtoD")?;
        // SAFETY: waits for the legacy stream the copy ran on.
        let r = unsafe { sys::cuStreamSynchronize(std::ptr::null_mut()) };
        check(r, "cuStreamSynchronize")
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
        self.bind()?;
        // SAFETY: copies `dst.len()` bytes (within the buffer, checked above) into host memory.
        let r = unsafe { sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), self.ptr, dst.len()) };
        check(r, "cuMemcpyDtoH")
    }

    fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| Error::cuda_unavailable("cannot bind the device's context", Some(Arc::new(e))))
    }
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("device", &self.device)
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .finish()
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.ptr != 0 {
            LIVE.lock().recover().remove(&self.ptr);
            if let Some(hook) = ON_DROP.get() {
                hook(self.ptr);
            }
        }
        let _ = self.ctx.bind_to_thread();
        // SAFETY: undoes what `new` did; no operation uses the memory any more (descriptors
        // borrow the buffer). A peer that imported the allocation keeps its own reference: the
        // memory is freed once it unmaps too.
        unsafe {
            if self.ptr != 0 {
                sys::cuMemUnmap(self.ptr, self.size);
                sys::cuMemAddressFree(self.ptr, self.size);
            }
            if self.handle != 0 {
                sys::cuMemRelease(self.handle);
            }
        }
    }
}
