//! The engines' counters ([`EngineStats`]): kept by each engine's transports, read by
//! `Connector::stats()` and published to the metrics. In the floor, so that the engine and the
//! metrics both name it.

#[allow(unused_imports)] // doc links
use crate::error::Error;

/// Counters for tests, `bench` and `doctor`.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct EngineStats {
    /// NIXL memory registrations made so far.
    pub registrations: u64,
    /// NIXL registrations currently live.
    pub live_registrations: usize,
    /// Bytes of memory those live registrations cover.
    pub registered_bytes: u64,
    /// Registrations an operation asked for that a live one already covered (no new one made;
    /// memory that carries its registration, as a reused `HostBuffer`, does not even ask).
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
