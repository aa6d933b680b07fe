//! The engines' counters ([`EngineStats`]): kept by each engine's transports, read by
//! `Connector::stats()` and published to the metrics (below both, so both name it).

use std::sync::OnceLock;

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

/// Whether a figure of [`EngineStats`] only grows (a counter: an ended engine's stays in the
/// totals) or is what holds now (a gauge: it leaves with its engine).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Counter,
    Gauge,
}

/// One figure of [`EngineStats`] as the metrics publish it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Figure {
    /// Its metric's name (without the `nixl_connect_` prefix or a counter's `_total`).
    pub(crate) metric: &'static str,
    pub(crate) help: &'static str,
    pub(crate) kind: Kind,
    pub(crate) value: u64,
}

/// [`EngineStats`], its fields listed once: the struct, [`EngineStats::iter`] (by field name),
/// the metrics' figures and the sum of engines' figures all come from this list.
macro_rules! engine_stats {
    ($(
        $(#[doc = $doc:literal])*
        $field:ident: $ty:ty, $kind:ident $metric:literal $help:literal;
    )*) => {
        /// Counters for tests, `bench` and `doctor`.
        #[derive(Debug, Clone, Default)]
        #[non_exhaustive]
        pub struct EngineStats {
            $( $(#[doc = $doc])* pub $field: $ty, )*
        }

        impl EngineStats {
            /// Every figure, by its field's name, in the order of the fields (the Python
            /// module's `stats()` dict).
            pub fn iter(&self) -> impl Iterator<Item = (&'static str, u64)> {
                [$( (stringify!($field), self.$field as u64) ),*].into_iter()
            }

            /// Every figure as the metrics publish it.
            pub(crate) fn figures(&self) -> [Figure; [$(stringify!($field)),*].len()] {
                [$( Figure {
                    metric: $metric,
                    help: $help,
                    kind: Kind::$kind,
                    value: self.$field as u64,
                } ),*]
            }

            /// Adds `other`'s figures of `kind` to these.
            pub(crate) fn add(&mut self, other: &EngineStats, kind: Kind) {
                $( if Kind::$kind == kind { self.$field += other.$field; } )*
            }
        }
    };
}

engine_stats! {
    /// NIXL memory registrations made so far.
    registrations: u64, Counter "registrations" "NIXL memory registrations made";
    /// NIXL registrations currently live.
    live_registrations: usize, Gauge "registrations_live" "NIXL memory registrations live";
    /// The lengths of those live registrations, summed (memory in two registrations, as an
    /// exposed range also read from, counts twice).
    registered_bytes: u64, Gauge "registered_bytes" "Bytes of memory the live NIXL registrations cover";
    /// Registrations an operation asked for that a live one already covered (no new one made):
    /// memory that carries its registration (a reused `HostBuffer`, a `Registration`) is one.
    registration_hits: u64, Counter "registration_cache_hits"
        "Registrations asked for that a live one already covered (none made)";
    /// Peer agent metadata loads into NIXL made so far.
    remote_loads: u64, Counter "peer_loads" "Peers' agent metadata loaded into NIXL";
    /// Peers' agent metadata loaded into NIXL now.
    peers_loaded: usize, Gauge "peers_loaded" "Peers' agent metadata loaded into NIXL now";
    /// Transfers posted through NIXL so far.
    transfers: u64, Counter "nixl_posts" "Transfers posted through NIXL";
    /// Active operations that took the same-host path.
    local_transfers: u64, Counter "local_transfers" "Active operations the same-host path completed";
    /// Same-host connections refused: the peer runs as another user, cannot be named, or could
    /// not prove it holds the operation's key.
    local_refused_peers: u64, Counter "local_peers_refused"
        "Same-host connections refused (another user, or a peer that cannot be named)";
    /// Same-host connections open now (to peers and from them).
    local_connections: usize, Gauge "local_connections"
        "Same-host connections open now (to peers and from them)";
    /// Times the NIXL initiator was destroyed to cut off an unresponsive peer.
    resets: u64, Counter "nixl_resets" "NIXL initiators destroyed to cut off an unresponsive peer";
    /// Times the NIXL exposer was replaced to release quarantined memory.
    rotations: u64, Counter "nixl_rotations" "NIXL exposers replaced to release quarantined memory";
    /// Bytes of exposed memory held back from the allocator until no peer can reach it.
    quarantined_bytes: u64, Gauge "quarantined_bytes"
        "Exposed memory held back from the allocator until no peer can reach it";
    /// Passive operations failed with [`Error::Interrupted`](crate::Error::Interrupted) because
    /// the retired NIXL agent that exposed them was destroyed to bound held memory (see
    /// [`MAX_RETIRED_EXPOSERS`](crate::MAX_RETIRED_EXPOSERS)).
    evicted_operations: u64, Counter "evicted_operations"
        "Passive operations failed because the retired NIXL agent exposing them was destroyed";
    /// Same-host copies queued for this process's copy threads (process-wide, shared by every
    /// connector of the process).
    copy_pool_queued: usize, Gauge "copy_pool_queued"
        "Same-host copies queued for this process's copy threads";
}
