//! The engines' counters ([`EngineStats`]): kept by each engine's transports, read by
//! `Connector::stats()` and published to the metrics. In the floor, so that the engine and the
//! metrics both name it.

use std::sync::OnceLock;

#[allow(unused_imports)] // doc links
use crate::error::Error;

/// Reads the same-host copy pool's queue (process-wide): set by the engine, which knows the
/// pool, read by the metrics at a scrape (they sit below the engine and cannot name it).
static COPY_POOL_PROBE: OnceLock<fn() -> usize> = OnceLock::new();

/// Names the function that reads the copy pool's queue (the first call wins).
pub(crate) fn set_copy_pool_probe(probe: fn() -> usize) {
    let _ = COPY_POOL_PROBE.set(probe);
}

/// Copies queued for this process's copy threads now (0 before any engine started).
pub(crate) fn copy_pool_queued() -> usize {
    COPY_POOL_PROBE.get().map_or(0, |f| f())
}

/// Counters for tests, `bench` and `doctor`.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct EngineStats {
    /// NIXL memory registrations made so far.
    pub registrations: u64,
    /// NIXL registrations currently live.
    pub live_registrations: usize,
    /// The lengths of those live registrations, summed (memory in two registrations, as an
    /// exposed range also read from, counts twice).
    pub registered_bytes: u64,
    /// Registrations an operation asked for that a live one already covered (no new one made):
    /// memory that carries its registration (a reused `HostBuffer`, a `Registration`) is one.
    pub registration_hits: u64,
    /// Peer agent metadata loads into NIXL made so far.
    pub remote_loads: u64,
    /// Peers' agent metadata loaded into NIXL now.
    pub peers_loaded: usize,
    /// Transfers posted through NIXL so far.
    pub transfers: u64,
    /// Active operations that took the same-host path.
    pub local_transfers: u64,
    /// Same-host connections refused: the peer runs as another user, cannot be named, or could
    /// not prove it holds the operation's key.
    pub local_refused_peers: u64,
    /// Same-host connections open now (to peers and from them).
    pub local_connections: usize,
    /// Times the NIXL initiator was destroyed to cut off an unresponsive peer.
    pub resets: u64,
    /// Times the NIXL exposer was replaced to release quarantined memory.
    pub rotations: u64,
    /// Bytes of exposed memory held back from the allocator until no peer can reach it.
    pub quarantined_bytes: u64,
    /// Passive operations failed with [`Error::Interrupted`] because the retired NIXL agent that
    /// exposed them was destroyed to bound held memory (see
    /// [`MAX_RETIRED_EXPOSERS`](crate::MAX_RETIRED_EXPOSERS)).
    pub evicted_operations: u64,
    /// Same-host copies queued for this process's copy threads (process-wide, shared by every
    /// connector of the process).
    pub copy_pool_queued: usize,
}
