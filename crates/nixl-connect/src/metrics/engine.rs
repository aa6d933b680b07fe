//! The engines' own counters ([`EngineStats`]) as metrics: each engine publishes them into its
//! [`EngineCell`] from its thread (the engine owns them; nothing else writes them), and the
//! [`EngineCollector`] reads every cell at a scrape. An ended engine's counters are kept in the
//! totals, so counters never go down when a connector is dropped; its gauges leave with it.

use std::sync::{Arc, Mutex};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

use crate::stats::EngineStats;
use crate::sync::Recover;

/// One engine's published counters (what [`EngineStats`] holds), written by its thread alone
/// (when it goes idle, at most every 200 ms while busy) and read at a scrape.
#[derive(Debug, Default)]
pub(crate) struct EngineCell(Mutex<Published>);

#[derive(Debug, Default)]
struct Published {
    stats: EngineStats,
    /// The engine has ended: its counters move into the collector's totals.
    ended: bool,
}

impl EngineCell {
    /// Publishes the engine's counters (whoever drives the engine: its thread, or a caller's
    /// that holds its lock; one at a time).
    pub(crate) fn publish(&self, s: &EngineStats) {
        self.0.lock().recover().stats = s.clone();
    }

    /// The engine has ended (after its last [`publish`](Self::publish)).
    pub(crate) fn end(&self) {
        self.0.lock().recover().ended = true;
    }

    /// The counters, and whether the engine has ended.
    fn read(&self) -> (EngineStats, bool) {
        let p = self.0.lock().recover();
        (p.stats.clone(), p.ended)
    }
}

/// Reads every engine's cell at a scrape.
#[derive(Debug, Default)]
pub(crate) struct EngineCollector {
    state: Mutex<Cells>,
}

#[derive(Debug, Default)]
struct Cells {
    live: Vec<Arc<EngineCell>>,
    /// The counters of ended engines (gauges are not kept).
    ended: EngineStats,
}

impl Cells {
    /// Moves ended engines' counters into the totals.
    fn fold_ended(&mut self) {
        let Cells { live, ended } = self;
        live.retain(|c| match c.read() {
            (s, true) => {
                add_counters(ended, &s);
                false
            }
            (_, false) => true,
        });
    }
}

fn add_counters(to: &mut EngineStats, s: &EngineStats) {
    to.registrations += s.registrations;
    to.registration_hits += s.registration_hits;
    to.remote_loads += s.remote_loads;
    to.transfers += s.transfers;
    to.local_transfers += s.local_transfers;
    to.local_refused_peers += s.local_refused_peers;
    to.resets += s.resets;
    to.rotations += s.rotations;
    to.evicted_operations += s.evicted_operations;
}

impl EngineCollector {
    pub(crate) fn add(&self) -> Arc<EngineCell> {
        let cell = Arc::new(EngineCell::default());
        let mut st = self.state.lock().recover();
        // Ended engines are folded in here too, not only at scrapes: connectors that come and go
        // in a process nobody scrapes keep nothing.
        st.fold_ended();
        st.live.push(cell.clone());
        cell
    }

    /// Counters of every engine, live or ended; gauges of the live ones; and how many are live.
    pub(crate) fn totals(&self) -> EngineStats {
        self.totals_and_count().0
    }

    fn totals_and_count(&self) -> (EngineStats, usize) {
        let mut st = self.state.lock().recover();
        st.fold_ended();
        let mut t = st.ended.clone();
        for c in st.live.iter() {
            let (s, _) = c.read();
            add_counters(&mut t, &s);
            t.live_registrations += s.live_registrations;
            t.registered_bytes += s.registered_bytes;
            t.peers_loaded += s.peers_loaded;
            t.local_connections += s.local_connections;
            t.quarantined_bytes += s.quarantined_bytes;
        }
        // One pool per process, read now (an idle engine's last figure would be stale).
        t.copy_pool_queued = crate::stats::copy_pool_queued();
        (t, st.live.len())
    }
}

fn counter(e: &mut DescriptorEncoder<'_>, name: &str, help: &str, v: u64) -> Result<(), std::fmt::Error> {
    let c = ConstCounter::new(v);
    c.encode(e.encode_descriptor(name, help, None, c.metric_type())?)
}

fn gauge(e: &mut DescriptorEncoder<'_>, name: &str, help: &str, v: i64) -> Result<(), std::fmt::Error> {
    let g = ConstGauge::new(v);
    g.encode(e.encode_descriptor(name, help, None, g.metric_type())?)
}

impl Collector for EngineCollector {
    fn encode(&self, mut e: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let (t, live) = self.totals_and_count();
        let i = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        gauge(
            &mut e,
            "connectors",
            "Connectors (engines) recording here, alive now",
            live as i64,
        )?;
        counter(
            &mut e,
            "registrations",
            "NIXL memory registrations made",
            t.registrations,
        )?;
        gauge(
            &mut e,
            "registrations_live",
            "NIXL memory registrations live",
            i(t.live_registrations as u64),
        )?;
        gauge(
            &mut e,
            "registered_bytes",
            "Bytes of memory the live NIXL registrations cover",
            i(t.registered_bytes),
        )?;
        counter(
            &mut e,
            "registration_cache_hits",
            "Registrations asked for that a live one already covered (none made)",
            t.registration_hits,
        )?;
        counter(
            &mut e,
            "peer_loads",
            "Peers' agent metadata loaded into NIXL",
            t.remote_loads,
        )?;
        gauge(
            &mut e,
            "peers_loaded",
            "Peers' agent metadata loaded into NIXL now",
            i(t.peers_loaded as u64),
        )?;
        gauge(
            &mut e,
            "local_connections",
            "Same-host connections open now (to peers and from them)",
            i(t.local_connections as u64),
        )?;
        counter(&mut e, "nixl_posts", "Transfers posted through NIXL", t.transfers)?;
        counter(
            &mut e,
            "local_transfers",
            "Active operations the same-host path completed",
            t.local_transfers,
        )?;
        counter(
            &mut e,
            "local_peers_refused",
            "Same-host connections refused (another user, or a peer that cannot be named)",
            t.local_refused_peers,
        )?;
        counter(
            &mut e,
            "nixl_resets",
            "NIXL initiators destroyed to cut off an unresponsive peer",
            t.resets,
        )?;
        counter(
            &mut e,
            "nixl_rotations",
            "NIXL exposers replaced to release quarantined memory",
            t.rotations,
        )?;
        gauge(
            &mut e,
            "quarantined_bytes",
            "Exposed memory held back from the allocator until no peer can reach it",
            i(t.quarantined_bytes),
        )?;
        counter(
            &mut e,
            "evicted_operations",
            "Passive operations failed because the retired NIXL agent exposing them was destroyed",
            t.evicted_operations,
        )?;
        gauge(
            &mut e,
            "copy_pool_queued",
            "Same-host copies queued for this process's copy threads",
            i(t.copy_pool_queued as u64),
        )?;
        Ok(())
    }
}
