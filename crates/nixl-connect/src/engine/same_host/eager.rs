//! Eager copies: a small host operation's bytes (up to [`EAGER_MAX`](super::wire::EAGER_MAX)) ride
//! in its frame ([`Msg::Data`](super::wire::Msg::Data) or the request), so each side copies only
//! its *own* memory on its engine thread: no copy thread, no slot word, no `Done`. Nothing here
//! reads a peer's memory; the ranges are checked against this side's own operation by [`mem`].

use super::records::Act;
use super::server_book::Scope;
use crate::sys::same_host::mem;

/// The owner of a readable: the bytes of `remote` (ranges of its memory), in order; `None`, with
/// nothing read, unless the operation is live host memory and every range lies inside one of its
/// descriptors. The memory is held in use for the copy, so the owner's drop waits for it.
pub(super) fn read_scope(scope: &Scope, remote: &[(u64, u64)]) -> Option<Vec<u8>> {
    if !scope.state().try_mark_in_use() {
        return None;
    }
    let out = mem::gather(scope.ranges(), remote);
    scope.state().mark_released();
    out
}

/// The owner of a writable: copies `data` into `remote` (ranges of its memory), in order; false,
/// with nothing written, unless the operation is live host memory, every range lies inside one of
/// its descriptors, and the ranges add up to `data.len()`. The caller checked that no other
/// writer copies into it.
pub(super) fn write_scope(scope: &Scope, remote: &[(u64, u64)], data: &[u8]) -> bool {
    if !scope.state().try_mark_in_use() {
        return false;
    }
    let done = mem::scatter(scope.ranges(), remote, data);
    scope.state().mark_released();
    done
}

/// A writer: its source's bytes (its local ranges), in order, for the request (none once it was
/// abandoned, or for device memory).
pub(super) fn read_act(act: &Act) -> Vec<u8> {
    if act.is_abandoned() {
        return Vec::new();
    }
    // An active operation's local memory is held from before its command left the caller until
    // the engine reports it ended (or abandons it), and this one is neither.
    mem::gather_all(&act.spec().local).unwrap_or_default()
}

/// A reader: copies an eager answer's `data` into its local ranges; false, with nothing written,
/// when the operation was abandoned (its memory may be gone), is not into host memory, or `data`
/// is not exactly as long as its ranges.
pub(super) fn write_act(act: &Act, data: &[u8]) -> bool {
    if act.is_abandoned() {
        return false;
    }
    // Held and lent to this operation alone until the engine reports it ended or abandons it.
    mem::scatter_all(&act.spec().local, data)
}
