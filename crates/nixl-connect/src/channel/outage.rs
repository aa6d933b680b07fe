//! What a channel reports of the times it lost its server.

use std::time::{Duration, SystemTime};

/// A time a channel's server could not be reached (or forgot what was published), from the first
/// failure to the recovery: what an operator reads to tell a restart from a partition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outage {
    /// When the first failure was seen.
    pub began: SystemTime,
    /// From the first failure to the recovery (the renewal or re-publication that worked, the
    /// connection back).
    pub lasted: Duration,
    /// The first failure, as the client library said it.
    pub cause: String,
    /// The publication had to be written again (etcd had lost its lease: restarted without its
    /// data, or the lease ran out while it was unreachable); `false` when renewing resumed.
    pub republished: bool,
}

/// The most outages a publication or connection keeps (the oldest go first).
pub(crate) const KEPT: usize = 16;

/// Appends `o` to `list`, dropping the oldest past [`KEPT`].
pub(crate) fn record(list: &mut Vec<Outage>, o: Outage) {
    if list.len() >= KEPT {
        list.remove(0);
    }
    list.push(o);
}
