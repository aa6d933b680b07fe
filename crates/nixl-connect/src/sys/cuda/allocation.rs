//! [`Allocation`]: one VMM allocation of device memory with a POSIX-descriptor handle, mapped and
//! zeroed, the memory under a `DeviceBuffer`; and the process's list of the live ones.

use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock};

use cudarc::driver::sys::{self, CUresult};

use super::{check, Failed};
use crate::sync::Recover;

/// One VMM allocation (`cuMemCreate`), reserved, mapped, open to its device and zeroed; undone
/// when dropped. Every call on it needs its device's context current on the calling thread.
pub(crate) struct Allocation {
    ptr: sys::CUdeviceptr,
    size: usize,
    handle: sys::CUmemGenericAllocationHandle,
}

/// Told an allocation's address as it is dropped (set by the same-host path, which then gives
/// back what it shared of it with peers, instead of keeping the memory allocated for them).
static ON_DROP: OnceLock<fn(u64)> = OnceLock::new();

/// Sets what is told of every [`Allocation`] dropped from now on (once per process).
pub(crate) fn on_drop(hook: fn(u64)) {
    let _ = ON_DROP.set(hook);
}

/// The live allocations: address -> size (what the same-host path may share with a peer in
/// another PID namespace).
static LIVE: Mutex<BTreeMap<u64, u64>> = Mutex::new(BTreeMap::new());

/// True when a live [`Allocation`] is the one mapped at `base`, `size` bytes.
pub(crate) fn is_live(base: u64, size: u64) -> bool {
    LIVE.lock().recover().get(&base) == Some(&size)
}

impl Allocation {
    /// What such an allocation on device `ordinal` asks for, and where it lives.
    fn props(ordinal: u32) -> sys::CUmemAllocationProp {
        // SAFETY: a plain-old-data struct of the driver's, all-zero then filled in below.
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.requestedHandleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        prop.location = sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: ordinal as i32,
        };
        prop
    }

    /// The smallest allocation granularity of device `ordinal` (2 MiB on current GPUs).
    pub(crate) fn granularity(ordinal: u32) -> Result<usize, Failed> {
        let mut gran = 0usize;
        // SAFETY: writes the granularity for the allocation's properties into the local.
        let r = unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut gran,
                &Self::props(ordinal),
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        };
        check("cuMemGetAllocationGranularity", r)?;
        Ok(gran.max(1))
    }

    /// Allocates `size` bytes (a multiple of [`granularity`](Self::granularity)) on device
    /// `ordinal`, zeroed, with that device's context current.
    pub(crate) fn new(ordinal: u32, size: usize) -> Result<Self, Failed> {
        let prop = Self::props(ordinal);
        let mut a = Allocation {
            ptr: 0,
            size,
            handle: 0,
        };
        let access = sys::CUmemAccessDesc {
            location: prop.location,
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: creates the allocation, reserves an address range of its size, maps it there,
        // opens it to its device and zeroes it; Drop undoes whichever steps were done (a zero
        // handle or pointer is one not made).
        unsafe {
            check("cuMemCreate", sys::cuMemCreate(&mut a.handle, size, &prop, 0))?;
            let mut ptr = 0;
            check(
                "cuMemAddressReserve",
                sys::cuMemAddressReserve(&mut ptr, size, 0, 0, 0),
            )?;
            a.ptr = ptr;
            if let Err(e) = check("cuMemMap", sys::cuMemMap(ptr, size, 0, a.handle, 0)) {
                sys::cuMemAddressFree(ptr, size);
                a.ptr = 0;
                return Err(e);
            }
            check("cuMemSetAccess", sys::cuMemSetAccess(ptr, size, &access, 1))?;
            check("cuMemsetD8", sys::cuMemsetD8_v2(ptr, 0, size))?;
            // The memset is asynchronous to the host: done before anyone else uses the memory.
            check(
                "cuStreamSynchronize",
                sys::cuStreamSynchronize(std::ptr::null_mut()),
            )?;
        }
        LIVE.lock().recover().insert(a.ptr, size as u64);
        Ok(a)
    }

    /// Its device address.
    pub(crate) fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Copies `src` to its start and waits for the copy (from pageable memory it may return
    /// before the device has it).
    ///
    /// # Panics
    /// When `src` is longer than the allocation (the caller checks).
    pub(crate) fn copy_from_host(&mut self, src: &[u8]) -> Result<(), Failed> {
        assert!(src.len() <= self.size, "a copy past the allocation");
        // SAFETY: copies `src.len()` bytes (within the allocation, asserted above) from host
        // memory.
        let r = unsafe { sys::cuMemcpyHtoD_v2(self.ptr, src.as_ptr().cast(), src.len()) };
        check("cuMemcpyHtoD", r)?;
        // SAFETY: waits for the legacy stream the copy ran on.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(std::ptr::null_mut())
        })
    }

    /// Copies its start into `dst` (synchronous).
    ///
    /// # Panics
    /// When `dst` is longer than the allocation (the caller checks).
    pub(crate) fn copy_to_host(&self, dst: &mut [u8]) -> Result<(), Failed> {
        assert!(dst.len() <= self.size, "a copy past the allocation");
        // SAFETY: copies `dst.len()` bytes (within the allocation, asserted above) into host
        // memory.
        let r = unsafe { sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), self.ptr, dst.len()) };
        check("cuMemcpyDtoH", r)
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        if self.ptr != 0 {
            LIVE.lock().recover().remove(&self.ptr);
            if let Some(hook) = ON_DROP.get() {
                hook(self.ptr);
            }
        }
        // SAFETY: undoes what `new` did, with the device's context current (the owner binds it);
        // no operation uses the memory any more (descriptors borrow its owner). A peer that
        // imported the allocation keeps its own reference: the memory is freed once it unmaps
        // too.
        unsafe {
            if self.ptr != 0 {
                sys::cuMemUnmap(self.ptr, self.size);
                sys::cuMemAddressFree(self.ptr, self.size);
            }
            if self.handle != 0 {
                let _: CUresult = sys::cuMemRelease(self.handle);
            }
        }
    }
}
