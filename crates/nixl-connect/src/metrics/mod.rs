//! Prometheus metrics: what connectors move, how long it takes, and what went wrong, in a
//! registry the user owns ([`prometheus_client::registry::Registry`]).
//!
//! ```
//! use nixl_connect::metrics::{prometheus_client::registry::Registry, Metrics};
//! let mut registry = Registry::default();
//! let metrics = Metrics::register(&mut registry);
//! let builder = nixl_connect::Connector::builder().metrics(&metrics);
//! // ... build connectors with it, then serve `registry` where the worker serves `/metrics`
//! // (`nixl_connect::metrics::encode`, or `serve` with the `http` feature).
//! # let _ = builder;
//! ```
//!
//! One [`Metrics`] is registered once per registry and shared by every connector built with it:
//! their figures add up (a registry must not hold two families of one name). Names, types,
//! labels and what each means: `docs/METRICS.md`. Labels are bounded enumerations (operation,
//! side, path, mechanism, error kind, status); no key, address or peer name ever becomes a label.
//! A connector built without metrics records nothing.

pub(crate) mod engine;
pub(crate) mod families;
#[cfg(feature = "http")]
mod http;

pub use prometheus_client;

#[doc(hidden)]
pub use self::families::engine_totals;
pub use self::families::{
    encode, encode_prometheus, Metrics, OPENMETRICS_CONTENT_TYPE, PREFIX, PROMETHEUS_CONTENT_TYPE,
};
#[cfg(feature = "http")]
pub use self::http::{scrape, serve, MetricsServer};

#[cfg(test)]
mod tests;
