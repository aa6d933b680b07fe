//! `/metrics` and `/health` over the embedded HTTP stack (feature `http`), for processes that
//! serve nothing else (the CLI's `--metrics`); a worker that already serves `/metrics` encodes
//! its own registry, ours registered in it.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use prometheus_client::registry::Registry;
use tokio::sync::oneshot;

use super::families::{encode, encode_prometheus, OPENMETRICS_CONTENT_TYPE, PROMETHEUS_CONTENT_TYPE};
use crate::error::{Error, Result};

/// A running `/metrics` endpoint ([`serve`]); it stops when dropped.
#[derive(Debug)]
pub struct MetricsServer {
    addr: SocketAddr,
    _stop: oneshot::Sender<()>,
}

impl MetricsServer {
    /// The address the endpoint listens on (the port chosen when 0 was asked).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

/// Serves `registry` on `addr` (port 0 picks a free one) until the returned server is dropped:
/// `GET /metrics` in OpenMetrics when the scraper accepts it (Prometheus does), else in the
/// Prometheus text format 0.0.4; `GET /health` answers 200 `ok` while the process serves.
///
/// Anyone who reaches the port may connect: at most 256 connections are kept open, each with 5 s
/// to send a request's headers (and to stay idle between requests) and 30 s in all.
///
/// Must be called inside a tokio runtime, which runs the server.
///
/// # Errors
/// [`Error::Channel`] when the address cannot be bound.
///
/// # Cancel safety
/// Cancel safe: dropping the future before it returns binds nothing that outlives it.
pub async fn serve(addr: SocketAddr, registry: Arc<Registry>) -> Result<MetricsServer> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| Error::channel_from(format!("cannot listen for metrics scrapes on {addr}"), e))?;
    let addr = listener
        .local_addr()
        .map_err(|e| Error::channel_from("the metrics endpoint's bound address", e))?;
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/health", get(|| async { "ok\n" }))
        .with_state(registry);
    let _stop = crate::channel::serve::spawn(listener, app, "metrics");
    Ok(MetricsServer { addr, _stop })
}

/// Whether one media range of an `Accept` header asks for OpenMetrics (with a q-value above 0).
fn accepts_openmetrics(range: &str) -> bool {
    let mut parts = range.split(';').map(str::trim);
    if parts.next() != Some("application/openmetrics-text") {
        return false;
    }
    parts
        .filter_map(|p| p.strip_prefix("q="))
        .all(|q| q.parse::<f32>().is_ok_and(|q| q > 0.0))
}

async fn metrics(State(registry): State<Arc<Registry>>, headers: HeaderMap) -> Response {
    let open = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(accepts_openmetrics);
    let (text, kind) = if open {
        (encode(&registry), OPENMETRICS_CONTENT_TYPE)
    } else {
        (encode_prometheus(&registry), PROMETHEUS_CONTENT_TYPE)
    };
    match text {
        Ok(t) => ([(header::CONTENT_TYPE, kind), (header::VARY, "Accept")], t).into_response(),
        Err(_) => (StatusCode::INTERNAL_SERVER_ERROR, "encoding the metrics failed\n").into_response(),
    }
}

/// Fetches a `/metrics` page (`http://HOST:PORT/metrics`) in the Prometheus text format, as a
/// tool reading one endpoint does (`nixl-connect top`).
///
/// # Errors
/// [`Error::Channel`] when the endpoint cannot be reached or answers anything but 200 within
/// `timeout`, or the page is not UTF-8.
///
/// # Cancel safety
/// Cancel safe.
pub async fn scrape(url: &str, timeout: std::time::Duration) -> Result<String> {
    let body = crate::channel::http::get_bytes(url, timeout).await?;
    String::from_utf8(body.to_vec()).map_err(|e| Error::channel_from(format!("{url} is not UTF-8 text"), e))
}

#[cfg(test)]
mod tests;
