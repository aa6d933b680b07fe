//! The families and the handle connectors record into ([`Metrics`]), and the text encoders.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};

use super::engine::{EngineCell, EngineCollector};
use crate::decline_reason::DeclineReason;
use crate::error::{Error, ErrorKind, Refusal};
use crate::state::{Ended, Mechanism, Observe, OperationStatus, TransferPath};

/// The prefix of every family's name.
pub const PREFIX: &str = "nixl_connect";

/// Operation labels, in index order.
const OPS: [&str; 2] = ["read", "write"];
/// Side labels, in index order: the side that began the operation, and the side that exposed
/// the memory.
const SIDES: [&str; 2] = ["active", "passive"];
/// Path labels, in [`path_ix`]'s order (`none`: ended before any transport took it).
const PATHS: [&str; 4] = [
    "none",
    TransferPath::Nixl.as_str(),
    TransferPath::SameHost.as_str(),
    TransferPath::Loopback.as_str(),
];
/// Status labels of ended operations, in index order.
const STATUSES: [&str; 3] = ["complete", "errored", "cancelled"];
/// Refusal labels, in `Refusal`'s declaration order.
const REFUSALS: [&str; 5] = [
    "not_live",
    "already_completed",
    "out_of_range",
    "wrong_direction",
    "busy",
];

/// Latency buckets: 5 µs doubling to 10.5 s (22 bounds and `+Inf`), NIXL telemetry's range.
fn latency_buckets() -> Histogram {
    Histogram::new(exponential_buckets(5e-6, 2.0, 22))
}

/// Which operation (`op` label): `Read` is 0, `Write` 1.
pub(crate) use crate::metadata::OperationKind as Op;

/// Which side (`side` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    Active = 0,
    Passive = 1,
}

/// A path's place in [`PATHS`] (its code; 0 for none).
fn path_ix(p: Option<TransferPath>) -> usize {
    p.map_or(0, |p| p as usize)
}

type Labels = Vec<(&'static str, &'static str)>;
type Per<T, const N: usize> = [T; N];

/// The families, with every bounded series taken once (the hot path looks nothing up).
#[derive(Debug)]
struct Families {
    /// `[op][side][path][status]`
    operations: Per<Per<Per<Per<Counter, 3>, 4>, 2>, 2>,
    /// `[op][side][path]`
    bytes: Per<Per<Per<Counter, 4>, 2>, 2>,
    /// `[op][side][path]`
    duration: Per<Per<Per<Histogram, 4>, 2>, 2>,
    /// `[op][path]` (active side)
    start: Per<Per<Histogram, 4>, 2>,
    /// `[op][side]`: operations begun, counted on the thread that begins them (in flight: these
    /// less the operations ended, at a scrape, so no line is shared between the two threads)
    begun: Per<Per<Counter, 2>, 2>,
    /// `[op][mechanism]` (active side, same-host path)
    local: Per<Per<Counter, 6>, 2>,
    /// `[op][side][kind]` (kinds in [`ErrorKind::ALL`]'s order)
    errors: Per<Per<Per<Counter, { ErrorKind::ALL.len() }>, 2>, 2>,
    /// `[from][to]` by path index
    fallbacks: Per<Per<Counter, 4>, 4>,
    /// `[path][reason]` (reasons in [`DeclineReason::ALL`]'s order)
    declines: Per<Per<Counter, { DeclineReason::ALL.len() }>, 4>,
    /// `[op][reason]` (the active side: refusals are returned to the side that asked)
    refusals: Per<Per<Counter, 5>, 2>,
}

/// A connector's metrics: register once per registry ([`Metrics::register`]), then hand to
/// every [`ConnectorBuilder`](crate::ConnectorBuilder::metrics) whose figures it should hold.
/// Cloning is cheap (the clones share the series).
#[derive(Clone)]
pub struct Metrics {
    families: Arc<Families>,
    engines: Arc<EngineCollector>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

/// A family of counters named `name`, registered in `reg`.
fn counter(reg: &mut Registry, name: &str, help: &str) -> Family<Labels, Counter> {
    let family = Family::default();
    reg.register(name, help, family.clone());
    family
}

/// A family of [`latency_buckets`] histograms in seconds named `name`, registered in `reg`.
fn seconds(reg: &mut Registry, name: &str, help: &str) -> Family<Labels, Histogram, fn() -> Histogram> {
    let family = Family::new_with_constructor(latency_buckets as fn() -> Histogram);
    reg.register_with_unit(name, help, Unit::Seconds, family.clone());
    family
}

/// Nested arrays of `$fam`'s series, one per combination of the labels' values, in the labels'
/// order (`grid!(fam; ("op", OPS), ("side", SIDES))[o][s]` is labelled `OPS[o]`, `SIDES[s]`).
macro_rules! grid {
    ($fam:ident; $(($n:literal, $v:expr)),+) => { grid!(@ $fam; []; $(($n, $v)),+) };
    (@ $fam:ident; [$($acc:expr),*]; ($n:literal, $v:expr) $(, $rest:tt)*) => {
        std::array::from_fn(|i| {
            let l = ($n, $v[i]);
            grid!(@ $fam; [$($acc,)* l]; $($rest),*)
        })
    };
    (@ $fam:ident; [$($acc:expr),*];) => { series(&$fam, &[$($acc),*]) };
}

fn series<M: Clone, C: prometheus_client::metrics::family::MetricConstructor<M>>(
    family: &Family<Labels, M, C>,
    labels: &[(&'static str, &'static str)],
) -> M {
    family.get_or_create_owned(&labels.to_vec())
}

impl Metrics {
    /// Registers every family under [`PREFIX`] in `registry` (a sub-registry of it) and returns
    /// the handle connectors record into. Register once per registry: a second registration
    /// would give the registry two families of each name, which Prometheus rejects.
    pub fn register(registry: &mut Registry) -> Self {
        let reg = registry.sub_registry_with_prefix(PREFIX);
        let operations = counter(
            reg,
            "operations",
            "Operations ended, by operation, side, path and status",
        );
        let bytes = counter(
            reg,
            "bytes",
            "Bytes moved by completed operations (the descriptors' sizes), by operation, side and path",
        );
        let duration = seconds(
            reg,
            "operation_duration",
            "From begin (active) or create (passive) to the operation's end, by operation, side and path",
        );
        let start = seconds(
            reg,
            "operation_start",
            "Completed active operations: from begin to the path that completed them taking them \
             (NIXL: posted; same-host: a slot taken, the request sent or queued), by operation and path",
        );
        let local = counter(
            reg,
            "local_operations",
            "Active operations the same-host path completed, by operation and mechanism",
        );
        let errors = counter(
            reg,
            "errors",
            "Errors returned to callers (from begin, create or the wait), by operation, side and ErrorKind",
        );
        let fallbacks = counter(
            reg,
            "path_fallbacks",
            "Active operations a transport declined and handed to the next path, by path from and to",
        );
        let declines = counter(
            reg,
            "path_declines",
            "Active operations a path declined, by the path and why (one of a fixed few reasons; the \
             operation's path_reason() says it in full)",
        );
        let refusals = counter(
            reg,
            "refusals",
            "Active operations refused, by operation and reason: by the peer, or as a replay here \
             (already_completed: this connector completed that metadata)",
        );
        let engines = Arc::new(EngineCollector::default());
        reg.register_collector(Box::new(engines.clone()));

        let mechanisms = Mechanism::ALL.map(Mechanism::as_str);
        let kinds: [&str; ErrorKind::ALL.len()] = std::array::from_fn(|i| ErrorKind::ALL[i].as_str());
        let reasons = DeclineReason::ALL.map(DeclineReason::as_str);
        let families = Arc::new(Families {
            operations: grid!(operations; ("op", OPS), ("side", SIDES), ("path", PATHS), ("status", STATUSES)),
            bytes: grid!(bytes; ("op", OPS), ("side", SIDES), ("path", PATHS)),
            duration: grid!(duration; ("op", OPS), ("side", SIDES), ("path", PATHS)),
            start: grid!(start; ("op", OPS), ("path", PATHS)),
            begun: Default::default(),
            local: grid!(local; ("op", OPS), ("mechanism", mechanisms)),
            errors: grid!(errors; ("op", OPS), ("side", SIDES), ("kind", kinds)),
            refusals: grid!(refusals; ("op", OPS), ("reason", REFUSALS)),
            fallbacks: grid!(fallbacks; ("from", PATHS), ("to", PATHS)),
            declines: grid!(declines; ("path", PATHS), ("reason", reasons)),
        });
        reg.register_collector(Box::new(InFlight(families.clone())));
        Metrics { families, engines }
    }

    /// A registry holding only these metrics, and the handle (for a process that serves nothing
    /// else, as the CLI and the Python module do).
    pub fn standalone() -> (Registry, Self) {
        let mut registry = Registry::default();
        let m = Self::register(&mut registry);
        (registry, m)
    }

    /// A cell an engine publishes its counters into, read at each scrape.
    pub(crate) fn engine_cell(&self) -> Arc<EngineCell> {
        self.engines.add()
    }

    /// An operation begun (active) or created (passive): in flight until its state tells the
    /// returned observer it ended.
    pub(crate) fn begin(&self, op: Op, side: Side, bytes: u64) -> Box<dyn Observe> {
        self.begin_at(op, side, bytes, Instant::now())
    }

    /// As [`begin`](Self::begin), for an operation that began at `begun`.
    pub(crate) fn begin_at(&self, op: Op, side: Side, bytes: u64, begun: Instant) -> Box<dyn Observe> {
        self.families.begun[op as usize][side as usize].inc();
        Box::new(Tally {
            families: self.families.clone(),
            begun,
            bytes,
            op,
            side,
            started: AtomicU64::new(0),
        })
    }

    /// An error returned to the caller before the operation had a state (pairing, sizes,
    /// metadata, the engine gone).
    pub(crate) fn error(&self, op: Op, side: Side, error: &Error) {
        self.families.error(op, side, error.kind(), error.refusal());
    }

    /// A transport on `from` declined an active operation, offered next to `to`.
    pub(crate) fn fallback(&self, from: Option<TransferPath>, to: Option<TransferPath>) {
        self.families.fallbacks[path_ix(from)][path_ix(to)].inc();
    }

    /// The path `path` declined an active operation, for the reason `why`.
    pub(crate) fn declined(&self, path: TransferPath, why: DeclineReason) {
        self.families.declines[path_ix(Some(path))][why.index()].inc();
    }
}

impl Families {
    fn error(&self, op: Op, side: Side, kind: ErrorKind, refusal: Option<Refusal>) {
        self.errors[op as usize][side as usize][kind as usize].inc();
        if let Some(r) = refusal {
            self.refusals[op as usize][r as usize].inc();
        }
    }
}

/// `operations_in_flight`, derived at a scrape: operations begun less those ended.
#[derive(Debug)]
struct InFlight(Arc<Families>);

impl Collector for InFlight {
    fn encode(&self, mut e: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let f = &self.0;
        let mut m = e.encode_descriptor(
            "operations_in_flight",
            "Operations begun or created and not yet ended, by operation and side",
            None,
            MetricType::Gauge,
        )?;
        for (o, op) in OPS.iter().enumerate() {
            for (s, side) in SIDES.iter().enumerate() {
                // Ended first: an operation ends after it begins, so this never goes below 0
                // (and is clamped if the two loads disagree).
                let ended: u64 = f.operations[o][s].iter().flatten().map(Counter::get).sum();
                let v = i64::try_from(f.begun[o][s].get().saturating_sub(ended)).unwrap_or(i64::MAX);
                m.encode_family(&[("op", *op), ("side", *side)])?
                    .encode_gauge(&v)?;
            }
        }
        Ok(())
    }
}

/// What an operation's state tells when its transfer starts and when it ends (once each).
pub(crate) struct Tally {
    families: Arc<Families>,
    begun: Instant,
    bytes: u64,
    op: Op,
    side: Side,
    /// Nanoseconds from `begun` to the last transport taking the operation, plus one (0: none
    /// took it yet).
    started: AtomicU64,
}

impl Observe for Tally {
    fn started(&self, _path: TransferPath) {
        let ns = u64::try_from(self.begun.elapsed().as_nanos()).unwrap_or(u64::MAX - 1);
        self.started.store(ns + 1, Ordering::Relaxed);
    }

    fn timed_out(&self) {
        self.families.error(self.op, self.side, ErrorKind::TimedOut, None);
    }

    /// The operation ended.
    fn ended(&self, e: Ended) {
        let f = &self.families;
        let (o, s, p) = (self.op as usize, self.side as usize, path_ix(e.path));
        let t = match e.status {
            OperationStatus::Complete => 0,
            OperationStatus::Errored => 1,
            _ => 2,
        };
        f.operations[o][s][p][t].inc();
        f.duration[o][s][p].observe(self.begun.elapsed().as_secs_f64());
        if t == 0 {
            f.bytes[o][s][p].inc_by(self.bytes);
            if self.side == Side::Active {
                if let Some(m) = e.mechanism {
                    f.local[o][m as usize - 1].inc(); // its place in `Mechanism::ALL`
                }
                // The start on the path that completed it (the last one to take it).
                match self.started.load(Ordering::Relaxed) {
                    0 => {}
                    ns => f.start[o][p].observe((ns - 1) as f64 * 1e-9),
                }
            }
        }
        if let Some(k) = e.error {
            f.error(self.op, self.side, k, e.refusal);
        }
    }
}

/// Encodes `registry` in the OpenMetrics text format (what Prometheus asks for first; the
/// content type is [`OPENMETRICS_CONTENT_TYPE`]).
///
/// # Errors
/// Only what the registry's own collectors return (none of this crate's fail).
pub fn encode(registry: &Registry) -> Result<String, std::fmt::Error> {
    let mut s = String::new();
    prometheus_client::encoding::text::encode(&mut s, registry).map(|()| s)
}

/// Encodes `registry` in the Prometheus text format 0.0.4 (for scrapers that do not ask for
/// OpenMetrics; the content type is [`PROMETHEUS_CONTENT_TYPE`]).
///
/// # Errors
/// As [`encode`].
pub fn encode_prometheus(registry: &Registry) -> Result<String, std::fmt::Error> {
    let mut s = String::new();
    prometheus_client::encoding::prometheus_text::encode(&mut s, registry).map(|()| s)
}

/// The content type of [`encode`]'s text.
pub const OPENMETRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// The content type of [`encode_prometheus`]'s text.
pub const PROMETHEUS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Every connector's counters (what [`EngineStats`](crate::EngineStats) holds) summed over
/// the connectors of `metrics` alive now and ended before, as a scrape shows them: for tests
/// and tools that compare the two views.
#[doc(hidden)]
pub fn engine_totals(metrics: &Metrics) -> crate::stats::EngineStats {
    metrics.engines.totals().0
}
