//! Raw copies between this process's own memory and byte vectors, for small operations.
//!
//! Every range touched lies inside `own`: host [`Range`]s of one of this process's operations
//! (memory a caller vouched for), which stay allocated while the caller holds the operation.
//! These functions check the first; the caller keeps the second.

use crate::device::Device;
use crate::reg::Range;

/// True when `[addr, addr+len)` lies inside one of `own` (sorted by address).
pub(crate) fn inside(own: &[Range], addr: u64, len: u64) -> bool {
    let Some(end) = addr.checked_add(len) else {
        return false;
    };
    let i = own.partition_point(|r| r.addr as u64 <= addr);
    own[..i]
        .iter()
        .rev()
        .take(16)
        .any(|r| (r.addr + r.len) as u64 >= end)
}

/// True when `own` is host memory, and some.
fn host(own: &[Range]) -> bool {
    !own.is_empty() && own.iter().all(|r| r.device == Device::Host)
}

/// True when `own` is host memory and every one of `picks` (not none) lies inside it.
fn owned(own: &[Range], picks: &[(u64, u64)]) -> bool {
    host(own) && !picks.is_empty() && picks.iter().all(|&(a, l)| inside(own, a, l))
}

/// The bytes of `picks` (address, length), in order; `None`, with nothing read, unless `own`
/// (sorted by address) is host memory and every pick (not none) lies inside it.
pub(crate) fn gather(own: &[Range], picks: &[(u64, u64)]) -> Option<Vec<u8>> {
    // SAFETY: every pick lies inside one of `own`'s host ranges (checked first).
    owned(own, picks).then(|| unsafe { copy_out(picks.iter().map(|&(a, l)| (a as usize, l as usize))) })
}

/// Copies `data` into `picks` (address, length) in order; false, with nothing written, unless
/// `own` (sorted by address) is host memory, every pick (not none) lies inside it, and their
/// lengths add up to `data.len()`. The caller makes sure nothing else writes or reads them
/// meanwhile (one writer per writable; an active operation's memory is lent to it alone).
pub(crate) fn scatter(own: &[Range], picks: &[(u64, u64)], data: &[u8]) -> bool {
    let total = picks.iter().try_fold(0u64, |t, r| t.checked_add(r.1));
    if total != Some(data.len() as u64) || !owned(own, picks) {
        return false;
    }
    // SAFETY: every pick lies inside one of `own`'s host ranges, and they add up to `data.len()`
    // (checked above).
    unsafe { copy_in(data, picks.iter().map(|&(a, l)| (a as usize, l as usize))) };
    true
}

/// The bytes of all of `own`, in its order (an active operation's source: the memory it copies is
/// exactly what it owns, so nothing is checked or allocated but the answer); `None` unless it is
/// host memory, and some.
pub(crate) fn gather_all(own: &[Range]) -> Option<Vec<u8>> {
    // SAFETY: each range is one of `own`'s, host memory (checked first).
    host(own).then(|| unsafe { copy_out(own.iter().map(|r| (r.addr, r.len))) })
}

/// Copies `data` into all of `own`, in its order; false, with nothing written, unless it is host
/// memory, and its lengths add up to `data.len()`.
pub(crate) fn scatter_all(own: &[Range], data: &[u8]) -> bool {
    let total = own.iter().try_fold(0usize, |t, r| t.checked_add(r.len));
    if total != Some(data.len()) || !host(own) {
        return false;
    }
    // SAFETY: each range is one of `own`'s, host memory; they add up to `data.len()`.
    unsafe { copy_in(data, own.iter().map(|r| (r.addr, r.len))) };
    true
}

/// The bytes of `ranges` (address, length), in order.
///
/// # Safety
/// Each range lies inside a host range of an operation of this process, held allocated for the
/// call (module doc).
unsafe fn copy_out(ranges: impl Iterator<Item = (usize, usize)> + Clone) -> Vec<u8> {
    let mut out = Vec::with_capacity(ranges.clone().map(|r| r.1).sum());
    for (addr, len) in ranges {
        // SAFETY: readable memory of this process for the call (the caller's contract); `out` is
        // a fresh allocation, so the two cannot overlap.
        out.extend_from_slice(unsafe { std::slice::from_raw_parts(addr as *const u8, len) });
    }
    out
}

/// Copies `data` into `ranges` (address, length) in order.
///
/// # Safety
/// Each range lies inside a host range of an operation of this process, held allocated and
/// touched by nothing else for the call (module doc); the lengths add up to `data.len()`.
unsafe fn copy_in(data: &[u8], ranges: impl Iterator<Item = (usize, usize)>) {
    let mut at = 0usize;
    for (addr, len) in ranges {
        // SAFETY: writable memory of this process nothing else touches (the caller's contract);
        // `data` is a distinct allocation (a frame buffer); `at + len <= data.len()` since the
        // lengths add up to it.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr().add(at), addr as *mut u8, len) };
        at += len;
    }
}

#[cfg(test)]
mod tests;
