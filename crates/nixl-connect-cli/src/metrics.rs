//! `--metrics ADDR` on the commands that move data, and `top`, which reads such endpoints.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use nixl_connect::metrics::{Metrics, MetricsServer};
use nixl_connect::ConnectorBuilder;

/// The metrics options of a command that moves data.
#[derive(clap::Args, Debug, Clone, Default)]
pub(crate) struct MetricsArgs {
    /// Serve Prometheus metrics on HOST:PORT (`/metrics`, `/health`; port 0 picks one): the
    /// address is printed on stderr as `metrics at http://ADDR/metrics`.
    #[arg(long, value_name = "ADDR")]
    metrics: Option<SocketAddr>,
    /// With --metrics: keep serving this many seconds after the command's work is done, so that
    /// a scraper sees the final figures.
    #[arg(long, value_name = "SECS", default_value_t = 0.0, requires = "metrics")]
    metrics_linger: f64,
}

/// A running endpoint (or none) and the metrics its connectors record into.
pub(crate) struct Exporter {
    metrics: Option<Metrics>,
    server: Option<MetricsServer>,
    linger: Duration,
}

impl MetricsArgs {
    /// Runs `work` with the endpoint (started when asked), then keeps serving for the linger,
    /// whatever `work` returned.
    pub(crate) async fn around<T>(&self, work: impl AsyncFnOnce(&Exporter) -> Result<T>) -> Result<T> {
        let ex = self.start().await?;
        let r = work(&ex).await;
        ex.finish().await;
        r
    }

    /// Starts the endpoint when asked.
    async fn start(&self) -> Result<Exporter> {
        if !(self.metrics_linger.is_finite() && self.metrics_linger >= 0.0) {
            bail!("--metrics-linger must be a number of seconds, 0 or more");
        }
        let linger = Duration::from_secs_f64(self.metrics_linger);
        let Some(addr) = self.metrics else {
            return Ok(Exporter {
                metrics: None,
                server: None,
                linger,
            });
        };
        let (registry, metrics) = Metrics::standalone();
        let server = nixl_connect::metrics::serve(addr, Arc::new(registry))
            .await
            .with_context(|| format!("--metrics {addr}"))?;
        eprintln!("metrics at http://{}/metrics", server.local_addr());
        Ok(Exporter {
            metrics: Some(metrics),
            server: Some(server),
            linger,
        })
    }
}

impl Exporter {
    /// Whether the command records metrics.
    pub(crate) fn recording(&self) -> bool {
        self.metrics.is_some()
    }

    /// `b`, recording into the endpoint's metrics when there is one.
    pub(crate) fn apply(&self, b: ConnectorBuilder) -> ConnectorBuilder {
        match &self.metrics {
            Some(m) => b.metrics(m),
            None => b,
        }
    }

    /// Keeps serving for the linger, then stops.
    async fn finish(self) {
        if self.server.is_some() && !self.linger.is_zero() {
            tokio::time::sleep(self.linger).await;
        }
        drop(self.server);
    }
}

/// `top`: rates from one or more `/metrics` endpoints, every interval.
#[derive(clap::Args, Debug)]
pub(crate) struct TopArgs {
    /// Endpoints: `HOST:PORT` or `http://HOST:PORT/metrics`.
    #[arg(required = true)]
    endpoints: Vec<String>,
    /// Seconds between lines.
    #[arg(long, default_value_t = 1.0)]
    interval: f64,
    /// Stop after this many lines (default: until interrupted).
    #[arg(long)]
    count: Option<u64>,
}

/// The sums `top` shows, from one scrape.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub(crate) struct Totals {
    /// Bytes into this process's memory (reads it began, writes into what it exposed): NIXL's rx.
    pub(crate) rx: f64,
    /// Bytes out of this process's memory (writes it began, reads of what it exposed): NIXL's tx.
    pub(crate) tx: f64,
    pub(crate) ops: f64,
    pub(crate) errors: f64,
    pub(crate) in_flight: f64,
}

fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    let at = labels.find(&format!("{key}=\""))? + key.len() + 2;
    let rest = &labels[at..];
    Some(&rest[..rest.find('"')?])
}

/// Sums a scrape (Prometheus or OpenMetrics text) into [`Totals`].
pub(crate) fn totals(text: &str) -> Totals {
    let mut t = Totals::default();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let Ok(v) = value.parse::<f64>() else { continue };
        let (name, labels) = series.split_once('{').unwrap_or((series, ""));
        match name {
            "nixl_connect_bytes_total" => match (label(labels, "op"), label(labels, "side")) {
                (Some("read"), Some("active")) | (Some("write"), Some("passive")) => t.rx += v,
                _ => t.tx += v,
            },
            "nixl_connect_operations_total" => t.ops += v,
            "nixl_connect_errors_total" => t.errors += v,
            "nixl_connect_operations_in_flight" => t.in_flight += v,
            _ => {}
        }
    }
    t
}

/// The `/metrics` URL of an endpoint given as `HOST:PORT`, `http://HOST:PORT` or a full URL.
fn url_of(endpoint: &str) -> String {
    let rest = endpoint.strip_prefix("http://").unwrap_or(endpoint);
    match rest.split_once('/') {
        Some((_, path)) if !path.is_empty() => format!("http://{rest}"),
        Some((host, _)) => format!("http://{host}/metrics"),
        None => format!("http://{rest}/metrics"),
    }
}

pub(crate) async fn top(a: TopArgs) -> Result<()> {
    if !(a.interval.is_finite() && a.interval > 0.0) {
        bail!("--interval must be a positive number of seconds");
    }
    let every = Duration::from_secs_f64(a.interval);
    let urls: Vec<String> = a.endpoints.iter().map(|e| url_of(e)).collect();
    let mut last: Vec<Option<(Instant, Totals)>> = vec![None; urls.len()];
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    println!(
        "{:<32} {:>10} {:>10} {:>10} {:>9} {:>9}",
        "endpoint", "rx MB/s", "tx MB/s", "ops/s", "in flight", "errors/s"
    );
    let mut lines = 0u64;
    loop {
        tick.tick().await;
        // Every endpoint at once: a dead one costs its timeout, not every line's.
        let timeout = every.max(Duration::from_millis(500));
        let mut scrapes = tokio::task::JoinSet::new();
        for (i, url) in urls.iter().enumerate() {
            let url = url.clone();
            scrapes.spawn(async move {
                (
                    i,
                    nixl_connect::metrics::scrape(&url, timeout).await,
                    Instant::now(),
                )
            });
        }
        let mut got: Vec<_> = scrapes.join_all().await;
        got.sort_by_key(|(i, _, _)| *i);
        for (i, scraped, now) in got {
            let t = match scraped {
                Ok(text) => totals(&text),
                Err(e) => {
                    println!("{:<32} unreachable: {e}", a.endpoints[i]);
                    last[i] = None;
                    continue;
                }
            };
            if let Some((then, before)) = last[i] {
                let s = now.duration_since(then).as_secs_f64().max(1e-9);
                let rate = |a: f64, b: f64| (a - b).max(0.0) / s;
                println!(
                    "{:<32} {:>10.1} {:>10.1} {:>10.0} {:>9} {:>9.1}",
                    a.endpoints[i],
                    rate(t.rx, before.rx) / 1e6,
                    rate(t.tx, before.tx) / 1e6,
                    rate(t.ops, before.ops),
                    t.in_flight,
                    rate(t.errors, before.errors),
                );
            }
            last[i] = Some((now, t));
        }
        lines += 1;
        if a.count.is_some_and(|c| lines > c) {
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_totals_split_rx_and_tx_as_nixl_does() {
        let text = "# TYPE nixl_connect_bytes counter\n\
            nixl_connect_bytes_total{op=\"read\",side=\"active\",path=\"local\"} 100\n\
            nixl_connect_bytes_total{op=\"read\",side=\"passive\",path=\"local\"} 7\n\
            nixl_connect_bytes_total{op=\"write\",side=\"passive\",path=\"nixl\"} 5\n\
            nixl_connect_bytes_total{op=\"write\",side=\"active\",path=\"nixl\"} 3\n\
            nixl_connect_operations_total{op=\"read\",side=\"active\",path=\"local\",status=\"complete\"} 2\n\
            nixl_connect_operations_in_flight{op=\"read\",side=\"active\"} 4\n\
            # EOF\n";
        let t = totals(text);
        assert_eq!((t.rx, t.tx, t.ops, t.in_flight), (105.0, 10.0, 2.0, 4.0));
    }

    #[test]
    fn top_endpoint_urls_name_the_metrics_page() {
        assert_eq!(url_of("h:9"), "http://h:9/metrics");
        assert_eq!(url_of("http://h:9"), "http://h:9/metrics");
        assert_eq!(url_of("http://h:9/"), "http://h:9/metrics");
        assert_eq!(url_of("http://h:9/custom"), "http://h:9/custom");
    }
}
