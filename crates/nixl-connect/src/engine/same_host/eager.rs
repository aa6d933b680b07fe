//! Eager copies: a small host operation's bytes ride in its frame (protocol version 6), so each
//! side copies only its *own* memory, on its engine thread: the owner of a readable gathers the
//! requested ranges into the answer ([`Msg::Data`](super::wire::Msg::Data)), the reader scatters
//! them into its destination; a writer gathers its source into the request, the owner of the
//! writable scatters it into its memory. No copy thread, no slot word, no `Done`: one round trip.
//!
//! Bounded at [`EAGER_MAX`](super::wire::EAGER_MAX) bytes an operation (a copy of that size takes
//! well under a microsecond). Nothing here reads a peer's memory, so a peer cannot stall the
//! engine through it: the ranges were checked against this side's own operation (the server's
//! scope, the client's descriptors) before they reach these functions.

#![allow(unsafe_code)]

use super::records::{Act, Phase};
use super::server_book::Scope;
use crate::device::Device;

/// The owner of a readable: the bytes of `remote` (ranges of its memory), in order; `None`, with
/// nothing read, unless the operation is live host memory and every range lies inside one of its
/// descriptors. The memory is held in use for the copy, so the owner's drop waits for it.
pub(super) fn read_scope(scope: &Scope, remote: &[(u64, u64)]) -> Option<Vec<u8>> {
    if !own_ranges(scope, remote) || !scope.state.try_mark_in_use() {
        return None;
    }
    let total = remote.iter().map(|r| r.1 as usize).sum();
    // SAFETY: every range lies inside one of this live operation's host descriptors (checked
    // above), which stay allocated while it is held in use (until `mark_released` below).
    let out = unsafe { gather(remote.iter().copied(), total) };
    scope.state.mark_released();
    Some(out)
}

/// The owner of a writable: copies `data` into `remote` (ranges of its memory), in order; false,
/// with nothing written, unless the operation is live host memory, every range lies inside one of
/// its descriptors, and the ranges add up to `data.len()`. The caller checked that no other
/// writer copies into it.
pub(super) fn write_scope(scope: &Scope, remote: &[(u64, u64)], data: &[u8]) -> bool {
    let total = remote.iter().try_fold(0u64, |t, r| t.checked_add(r.1));
    if total != Some(data.len() as u64) || !own_ranges(scope, remote) || !scope.state.try_mark_in_use() {
        return false;
    }
    // SAFETY: every range lies inside one of this live operation's host descriptors (checked
    // above), which stay allocated while it is held in use (until `mark_released` below); no
    // other writer touches it (the caller's check); the lengths add up to `data.len()`.
    unsafe { scatter(data, remote.iter().copied()) };
    scope.state.mark_released();
    true
}

/// A writer: its source's bytes (its local ranges), in order, for the request.
pub(super) fn read_act(act: &Act) -> Vec<u8> {
    let total = act.spec.local.iter().map(|r| r.len).sum();
    if matches!(act.phase, Phase::Abandoned) || act.spec.local.iter().any(|r| r.device != Device::Host) {
        return Vec::new();
    }
    // SAFETY: an active operation's local memory is held in use from before its command left the
    // caller until the engine reports it ended (or abandons it), and this one is neither.
    unsafe {
        gather(
            act.spec.local.iter().map(|r| (r.addr as u64, r.len as u64)),
            total,
        )
    }
}

/// A reader: copies an eager answer's `data` into its local ranges; false, with nothing written,
/// when the operation was abandoned (its memory may be gone), is not into host memory, or `data`
/// is not exactly as long as its ranges.
pub(super) fn write_act(act: &Act, data: &[u8]) -> bool {
    let total: usize = act.spec.local.iter().map(|r| r.len).sum();
    if matches!(act.phase, Phase::Abandoned)
        || total != data.len()
        || act.spec.local.iter().any(|r| r.device != Device::Host)
    {
        return false;
    }
    // SAFETY: an active operation's local memory is held in use (and lent to it alone) from
    // before its command left the caller until the engine reports it ended or abandons it, and
    // this one is neither; the lengths add up to `data.len()` (checked above).
    unsafe { scatter(data, act.spec.local.iter().map(|r| (r.addr as u64, r.len as u64))) };
    true
}

fn own_ranges(scope: &Scope, remote: &[(u64, u64)]) -> bool {
    scope.device == Device::Host && !remote.is_empty() && remote.iter().all(|&(a, l)| scope.contains(a, l))
}

/// The bytes of `ranges` (address, length) of this process's memory, in order.
///
/// # Safety
/// Every range must be readable memory of this process that stays allocated for the call (the
/// caller holds the operation that owns it in use).
unsafe fn gather(ranges: impl Iterator<Item = (u64, u64)>, total: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(total);
    for (addr, len) in ranges {
        // SAFETY: the caller guarantees `addr..addr + len` is readable memory of this process,
        // allocated for the call; `out` is a fresh allocation, so the two cannot overlap.
        let src = unsafe { std::slice::from_raw_parts(addr as usize as *const u8, len as usize) };
        out.extend_from_slice(src);
    }
    out
}

/// Copies `data` into `ranges` (address, length) of this process's memory, in order; the ranges'
/// lengths add up to `data.len()` (checked by the caller; a shorter `data` stops early).
///
/// # Safety
/// Every range must be writable memory of this process that stays allocated for the call and is
/// not read or written by anything else meanwhile (the caller holds the operation that owns it in
/// use).
unsafe fn scatter(data: &[u8], ranges: impl Iterator<Item = (u64, u64)>) {
    let mut at = 0usize;
    for (addr, len) in ranges {
        let len = (len as usize).min(data.len() - at);
        // SAFETY: the caller guarantees `addr..addr + len` is writable memory of this process
        // that nothing else touches during the call; `data` is a frame buffer of this engine, a
        // distinct allocation, and `at + len <= data.len()` by the `min` above.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr().add(at), addr as usize as *mut u8, len);
        }
        at += len;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eager_gather_then_scatter_moves_the_bytes_in_order() {
        let src: Vec<u8> = (0..100u8).collect();
        let ranges = [(src.as_ptr() as u64 + 10, 5u64), (src.as_ptr() as u64 + 50, 3)];
        // SAFETY: both ranges lie inside `src`, alive for the call.
        let got = unsafe { gather(ranges.iter().copied(), 8) };
        assert_eq!(got, [10, 11, 12, 13, 14, 50, 51, 52]);
        let mut dst = [0u8; 16];
        let base = dst.as_mut_ptr() as u64;
        // SAFETY: both ranges lie inside `dst`, borrowed mutably for the call.
        unsafe { scatter(&got, [(base + 1, 3u64), (base + 8, 5)].into_iter()) };
        assert_eq!(dst, [0, 10, 11, 12, 0, 0, 0, 0, 13, 14, 50, 51, 52, 0, 0, 0]);
    }
}
