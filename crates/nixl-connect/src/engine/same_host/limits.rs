//! The same-host wing's limits (connections, slots, grants, exports, pipes, negative cache).

use std::time::Duration;

/// Slots per connection (operations in flight on one connection at once): the slot table's
/// size, which the floor's table defines.
pub(crate) use crate::sys::same_host::slots::SLOTS;

/// How long the listener rests after `accept` ran out of descriptors or memory.
pub(super) const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);
/// Connections this connector serves at once (same-host peers beyond it are refused and use NIXL).
pub(super) const MAX_SERVED: usize = 1024;
/// Connections it serves at once to one process.
pub(super) const MAX_SERVED_PER_PID: usize = 64;
/// Served connections that have not finished their handshake, from one process: past it, that
/// process's next connection is refused (the handshake window is charged to who holds it).
pub(super) const MAX_HANDSHAKING_PER_PID: usize = 4;
/// Served connections that have not finished their handshake, in all.
pub(super) const MAX_HANDSHAKING: usize = 64;

/// The caps on served connections, set from the descriptor limit at start.
#[derive(Debug, Clone, Copy)]
pub(super) struct Caps {
    /// Connections served at once: [`MAX_SERVED`], or an eighth of the descriptor limit if
    /// that is lower (each holds a socket, a pidfd and a slot table: the table never fills).
    served: usize,
    /// Connections served to one process: [`MAX_SERVED_PER_PID`], or an eighth of `served`.
    per_pid: usize,
}

impl Caps {
    /// The caps under a limit of `budget` descriptors.
    pub(super) fn for_budget(budget: usize) -> Self {
        let served = MAX_SERVED.min(budget / 8).max(8);
        Self {
            served,
            per_pid: MAX_SERVED_PER_PID.min(served / 8).max(2),
        }
    }

    /// True when one more connection than the `served` ones, `from_pid` of them from its
    /// process, would pass a cap.
    pub(super) fn full(&self, served: usize, from_pid: usize) -> bool {
        served >= self.served || from_pid >= self.per_pid
    }
}
/// The most read grants one connection holds at once (a well-behaved client has at most one per
/// slot of its table); past it, requests take NIXL.
pub(super) const MAX_GRANTS_PER_CONN: usize = SLOTS;
/// Device ranges one connection may have queued for export (CUDA IPC handles) at once: a grant
/// of the largest device read that fits one frame (~139,800 ranges), and more; past it, device
/// reads take NIXL until exports end.
pub(super) const MAX_EXPORTING_PER_CONN: usize = 1 << 18;
/// Device ranges queued for export at once in the process, over every connection.
pub(super) const MAX_EXPORTING: usize = 1 << 20;
/// The most pipes one copy through pipes uses, which the floor's pipes define.
pub(crate) use crate::sys::same_host::pipe::MAX_LANES;
/// Pipes one connection's copies through pipes hold at once (two descriptors each on the side
/// that feeds them); past it, such copies take NIXL until some end.
pub(super) const MAX_PIPES_PER_CONN: usize = 64;
/// Pipes held at once in the process, over every connection.
pub(super) const MAX_PIPES: usize = 512;
/// How long a peer with no same-host socket is not asked again.
pub(super) const NEGATIVE_TTL: Duration = Duration::from_secs(2);
/// Negative answers remembered.
pub(super) const MAX_NEGATIVE: usize = 4096;
