//! What the same-host wire carries of one exported device range: a value the wing's floor fills
//! and reads (`sys/same_host/ipc.rs`) and its protocol core encodes (`engine/same_host/wire.rs`).

/// One source range of device memory as its owner exports it through CUDA IPC: what the copier
/// needs to open the allocation and to tell it from a later one at the same address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct IpcSource {
    /// The GPU's UUID (ordinals differ between processes that see different devices).
    pub(crate) uuid: [u8; 16],
    /// `cuIpcGetMemHandle` of the allocation's base.
    pub(crate) handle: [u8; 64],
    /// The allocation's base and length in the owner's address space.
    pub(crate) base: u64,
    pub(crate) alloc_len: u64,
    /// `CU_POINTER_ATTRIBUTE_BUFFER_ID`: unique per allocation for the life of the owner.
    pub(crate) buffer_id: u64,
    /// The range, as an offset into the allocation.
    pub(crate) offset: u64,
    pub(crate) len: u64,
    /// 0: `handle` is a legacy CUDA IPC handle. `k` (1 ..= `MAX_LANES`, `sys/same_host/pipe.rs`):
    /// the allocation is a VMM allocation whose POSIX descriptor is the `k`-th passed with this
    /// frame (`handle` is zero; `base`/`alloc_len` are where the exporter maps that one
    /// allocation); several ranges of one allocation share one descriptor.
    pub(crate) fd: u8,
}
