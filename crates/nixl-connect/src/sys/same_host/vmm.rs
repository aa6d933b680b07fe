//! Device memory between PID namespaces (feature `cuda`): a legacy CUDA IPC handle does not open
//! in another PID namespace, but a `cuMemCreate` allocation with a POSIX-descriptor handle type
//! (a [`DeviceBuffer`](crate::cuda::DeviceBuffer), PyTorch's expandable segments) exports as a
//! descriptor that crosses any namespace over `SCM_RIGHTS`; the peer imports, maps, copies, unmaps.
//!
//! The exporter gives away the one allocation around the range, only to a same-user process that
//! proved the operation's key. The importer trusts nothing it cannot check: only an NVIDIA device's
//! descriptor (checked without asking any filesystem) reaches the driver, and the mapping is the
//! allocation's true size, every range checked against it.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use cudarc::driver::sys;

use super::ipc_error::{check, IpcError};

/// The physical allocation around `addr` (current context): its handle, retained (give it back
/// with [`release`]; while retained its value names that allocation only), and its `base` and
/// `size` here. Fails for memory that is no VMM allocation with a POSIX-descriptor handle type.
pub(crate) fn retain(addr: u64) -> Result<(sys::CUmemGenericAllocationHandle, u64, u64), IpcError> {
    let mut allowed: u64 = 0;
    // SAFETY: the attribute writes one u64 (a bit set of handle types); `addr` is inspected only.
    let r = unsafe {
        sys::cuPointerGetAttribute(
            (&mut allowed as *mut u64).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES,
            addr,
        )
    };
    check(r, "cuPointerGetAttribute")?;
    let posix = u64::from(sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR.0);
    if allowed & posix == 0 {
        return Err(IpcError::NotExportable);
    }
    let mut h: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: writes the handle of the allocation mapped at `addr` (retained: the caller releases
    // it, or it is released below on failure).
    let r = unsafe { sys::cuMemRetainAllocationHandle(&mut h, addr as *mut std::ffi::c_void) };
    check(r, "cuMemRetainAllocationHandle")?;
    let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
    // SAFETY: writes the extent of the one allocation mapped around `addr` (for VMM memory:
    // that handle's mapping).
    let r = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, addr) };
    if let Err(e) = check(r, "cuMemGetAddressRange") {
        release(h);
        return Err(e);
    }
    Ok((h, base, size as u64))
}

/// Gives back one reference to a handle from [`retain`].
pub(crate) fn release(h: sys::CUmemGenericAllocationHandle) {
    // SAFETY: drops one reference the caller holds; the allocation goes once none is left.
    unsafe { sys::cuMemRelease(h) };
}

/// A POSIX descriptor of the allocation `h` (retained by the caller), for a peer to import.
pub(crate) fn export(h: sys::CUmemGenericAllocationHandle) -> Result<OwnedFd, IpcError> {
    let mut fd: libc::c_int = -1;
    // SAFETY: writes one descriptor number, which becomes owned below.
    let r = unsafe {
        sys::cuMemExportToShareableHandle(
            (&mut fd as *mut libc::c_int).cast(),
            h,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    };
    check(r, "cuMemExportToShareableHandle")?;
    if fd < 0 {
        return Err(IpcError::NotExportable);
    }
    // SAFETY: the driver made `fd` for this call; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A peer's allocation imported and mapped into this process (device `ordinal`'s address space,
/// read and write for that device); unmapped and released when dropped.
pub(crate) struct Imported {
    ptr: sys::CUdeviceptr,
    size: usize,
    handle: sys::CUmemGenericAllocationHandle,
    reserved: bool,
    mapped: bool,
}

impl Imported {
    /// Imports `fd` (checked with [`is_cuda_export`](super::is_cuda_export) when taken) and maps
    /// all `size` bytes (the driver refuses any other size) for device `ordinal`, whose context
    /// must be current.
    pub(crate) fn map(fd: &OwnedFd, size: u64, ordinal: i32) -> Result<Self, IpcError> {
        let size = usize::try_from(size).map_err(|_| IpcError::TooLarge)?;
        let mut m = Imported {
            ptr: 0,
            size,
            handle: 0,
            reserved: false,
            mapped: false,
        };
        // SAFETY: imports the descriptor (the driver dups what it needs; ours stays ours) into a
        // handle released in Drop.
        let r = unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut m.handle,
                fd.as_raw_fd() as isize as *mut std::ffi::c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        };
        check(r, "cuMemImportFromShareableHandle")?;
        let access = sys::CUmemAccessDesc {
            location: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: ordinal,
            },
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: reserves an address range of `size` bytes, maps the imported allocation at
        // it and opens it to device `ordinal`; each step is recorded so that Drop undoes exactly
        // what was done.
        unsafe {
            check(
                sys::cuMemAddressReserve(&mut m.ptr, size, 0, 0, 0),
                "cuMemAddressReserve",
            )?;
            m.reserved = true;
            check(sys::cuMemMap(m.ptr, size, 0, m.handle, 0), "cuMemMap")?;
            m.mapped = true;
            check(sys::cuMemSetAccess(m.ptr, size, &access, 1), "cuMemSetAccess")?;
        }
        Ok(m)
    }

    /// Where the allocation is mapped in this process.
    pub(crate) fn ptr(&self) -> u64 {
        self.ptr
    }
}

impl Drop for Imported {
    fn drop(&mut self) {
        // SAFETY: undoes what `map` did, in reverse; no copy uses the mapping any more (copies
        // are synchronised before the mappings of their job are dropped).
        unsafe {
            if self.mapped {
                sys::cuMemUnmap(self.ptr, self.size);
            }
            if self.reserved {
                sys::cuMemAddressFree(self.ptr, self.size);
            }
            if self.handle != 0 {
                sys::cuMemRelease(self.handle);
            }
        }
    }
}
