//! The engines' own counters ([`EngineStats`]) as metrics: each engine publishes them into its
//! [`EngineCell`] from its thread (the engine owns them; nothing else writes them), and the
//! [`EngineCollector`] reads every cell at a scrape. An ended engine's counters are kept in the
//! totals, so counters never go down when a connector is dropped; its gauges leave with it.

use std::sync::{Arc, Mutex};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

use crate::stats::{EngineStats, Kind};
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
                ended.add(&s, Kind::Counter);
                false
            }
            (_, false) => true,
        });
    }
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
    pub(crate) fn totals(&self) -> (EngineStats, usize) {
        let mut st = self.state.lock().recover();
        st.fold_ended();
        let mut t = st.ended.clone();
        for c in st.live.iter() {
            let (s, _) = c.read();
            t.add(&s, Kind::Counter);
            t.add(&s, Kind::Gauge);
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
        let (t, live) = self.totals();
        gauge(
            &mut e,
            "connectors",
            "Connectors (engines) recording here, alive now",
            live as i64,
        )?;
        for f in t.figures() {
            match f.kind {
                Kind::Counter => counter(&mut e, f.metric, f.help, f.value)?,
                Kind::Gauge => gauge(
                    &mut e,
                    f.metric,
                    f.help,
                    i64::try_from(f.value).unwrap_or(i64::MAX),
                )?,
            }
        }
        Ok(())
    }
}
