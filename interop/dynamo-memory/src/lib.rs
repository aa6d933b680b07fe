//! nixl-connect descriptors over Dynamo's Rust storage (`dynamo-memory` 1.6.1), so that memory a
//! Dynamo Rust worker already holds (`SystemStorage`, `PinnedStorage`, `DeviceStorage`: moved in,
//! [`descriptor`]; or shared as a [`Buffer`]: [`descriptor_of`], unsafe) is read and written by
//! nixl-connect operations without copying or allocating twice.
//!
//! This crate is also the proof that the two build together: `dynamo-memory` pins
//! `nixl-sys = "=1.3.2"`, and nixl-connect accepts every `nixl-sys` from 1.3.2 to 1.5.x, so Cargo
//! selects one `nixl-sys` for both (`links = "nixl"` allows no second). NIXL registration stays
//! nixl-connect's: it registers what an operation uses (with its own cache), whatever
//! `dynamo-memory` registered with its own agent.
//!
//! [`media`] reads what Dynamo's Rust media path publishes (`RdmaMediaDataDescriptor`: a decoded
//! image registered with a `dynamo-memory` NIXL agent), the mirror of nixl-connect's
//! `examples/media_rdma.rs`, which Dynamo's Python reader reads.
//!
//! ```no_run
//! use dynamo_memory::SystemStorage;
//! # async fn f(md: &nixl_connect::RdmaMetadata) -> Result<(), Box<dyn std::error::Error>> {
//! let conn = nixl_connect::Connector::new()?;
//! let dst = nixl_connect_dynamo_memory::descriptor(SystemStorage::new(1 << 20)?);
//! let op = conn.begin_read(md, vec![dst]).await?;
//! op.wait_for_completion(None).await?;
//! let read_into = op.into_descriptors().ok(); // the storage, once the operation has ended
//! # Ok(()) }
//! ```
#![deny(missing_docs)]

pub mod media;

use dynamo_memory::{Buffer, MemoryDescriptor, StorageKind};
use nixl_connect::{Descriptor, Device};

/// Storage nixl-connect cannot move bytes of directly.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Unsupported {
    /// `DiskStorage`: a file, not memory an operation can read or write.
    #[error(
        "dynamo-memory's disk storage (fd {0}) is a file, not memory: read it into SystemStorage, \
         PinnedStorage or DeviceStorage first"
    )]
    Disk(u64),
    /// A zero-length region (dynamo-memory's storage types refuse these themselves).
    #[error("the storage is empty: nixl-connect descriptors need at least one byte")]
    Empty,
}

/// The nixl-connect device of a `dynamo-memory` storage kind: system and pinned memory are host
/// memory, `Device(i)` is CUDA device `i`.
///
/// # Errors
/// [`Unsupported::Disk`] for disk storage.
pub fn device_of(kind: StorageKind) -> Result<Device, Unsupported> {
    match kind {
        StorageKind::System | StorageKind::Pinned => Ok(Device::Host),
        StorageKind::Device(i) => Ok(Device::Cuda(i)),
        StorageKind::Disk(fd) => Err(Unsupported::Disk(fd)),
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for dynamo_memory::SystemStorage {}
    impl Sealed for dynamo_memory::PinnedStorage {}
    impl Sealed for dynamo_memory::DeviceStorage {}
}

/// `dynamo-memory`'s storage types that own their allocation (`SystemStorage`: malloc,
/// `PinnedStorage`: page-locked, `DeviceStorage`: `cuMemAlloc`). Sealed: a descriptor is made
/// safely only over memory whose address and size come from its allocation.
pub trait Storage: MemoryDescriptor + sealed::Sealed + 'static {}
impl Storage for dynamo_memory::SystemStorage {}
impl Storage for dynamo_memory::PinnedStorage {}
impl Storage for dynamo_memory::DeviceStorage {}

/// A writable descriptor owning `storage`: its memory is the descriptor's alone (moved in) and
/// freed by `storage`'s own drop once the descriptor, and every operation or transfer that still
/// uses it, is gone. Host storage reads back through `Descriptor::as_slice`.
pub fn descriptor<S: Storage>(storage: S) -> Descriptor<'static> {
    let device = match storage.storage_kind() {
        StorageKind::Device(i) => Device::Cuda(i),
        _ => Device::Host,
    };
    let (addr, size) = (storage.addr(), storage.size());
    // SAFETY: `S` is one of dynamo-memory's own storage types (sealed), whose `addr..addr+size`
    // is the allocation the value made and frees on drop; moved into the descriptor as its owner,
    // it stays valid while the descriptor (or a transfer using it) lives, and nothing else can
    // reach it (their raw pointers are `unsafe` to take).
    unsafe { Descriptor::from_raw_parts_with_owner(addr as *mut u8, size, device, true, storage) }
}

/// A descriptor over all of `buffer`'s memory, which it keeps alive (a clone of the `Buffer`'s
/// `Arc` is the descriptor's owner) for as long as the descriptor, or any operation or transfer
/// that still uses it, lives. Writable.
///
/// # Safety
/// `buffer`'s `addr()` and `size()` must describe memory of its `storage_kind()` that the
/// `Buffer` keeps allocated (true of `dynamo-memory`'s own storage types; a `MemoryDescriptor`
/// of another crate may say anything), and while an operation using the descriptor runs nothing
/// else may read or write that memory: in particular no second descriptor over the same `Buffer`
/// (it is `Clone`) may be in an operation at the same time.
///
/// # Errors
/// [`Unsupported`] for disk storage and empty regions.
pub unsafe fn descriptor_of(buffer: &Buffer) -> Result<Descriptor<'static>, Unsupported> {
    let device = device_of(buffer.storage_kind())?;
    if buffer.size() == 0 {
        return Err(Unsupported::Empty);
    }
    // SAFETY: the caller's contract above; the `Buffer` clone moved in keeps the allocation.
    Ok(unsafe {
        Descriptor::from_raw_parts_with_owner(
            buffer.addr() as *mut u8,
            buffer.size(),
            device,
            true,
            buffer.clone(),
        )
    })
}
