//! nixl-connect descriptors over Dynamo's Rust storage (`dynamo-memory` 1.6.1), so that memory a
//! Dynamo Rust worker already holds (`SystemStorage`, `PinnedStorage`, `DeviceStorage`, or any
//! [`Buffer`]) is read and written by nixl-connect operations without copying or allocating twice.
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
//! use dynamo_memory::{Buffer, SystemStorage};
//! # async fn f(md: &nixl_connect::RdmaMetadata) -> Result<(), Box<dyn std::error::Error>> {
//! let storage = Buffer::new(SystemStorage::new(1 << 20)?);
//! let conn = nixl_connect::Connector::new()?;
//! let op = conn.begin_read(md, vec![nixl_connect_dynamo_memory::descriptor(&storage)?]).await?;
//! op.wait_for_completion(None).await?;
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

/// A descriptor over all of `buffer`'s memory, which it keeps alive (a clone of the `Buffer`'s
/// `Arc` is the descriptor's owner) for as long as the descriptor, or any operation or transfer
/// that still uses it, lives. Writable: `dynamo-memory`'s storage types own their memory.
///
/// # Errors
/// [`Unsupported`] for disk storage and empty regions.
pub fn descriptor(buffer: &Buffer) -> Result<Descriptor<'static>, Unsupported> {
    let device = device_of(buffer.storage_kind())?;
    if buffer.size() == 0 {
        return Err(Unsupported::Empty);
    }
    // SAFETY: `addr..addr + size` is the storage's own allocation (malloc, cudaHostAlloc or
    // cuMemAlloc), valid, readable and writable for as long as the `Buffer`'s `Arc` lives; the
    // clone moved into the descriptor as its owner keeps it alive until no transfer can touch
    // the memory. Not otherwise accessed during a transfer: the caller's contract with any
    // operation, as for every descriptor.
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
