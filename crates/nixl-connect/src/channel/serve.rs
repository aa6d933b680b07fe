//! How the library's HTTP endpoints serve (the metadata channel's, the metrics'): bounded, so
//! that connections from anyone who can reach the port cannot fill the process's descriptor table
//! nor hold the endpoint. At most [`Limits::connections`] are open at once (one more is closed as
//! it is accepted); a connection has [`Limits::header`] to send each request's headers (which also
//! ends a keep-alive connection idle that long) and lives [`Limits::total`] at most, whatever it
//! does (a body trickled after the headers, answers it never reads), then has [`CLOSING_GRACE`]
//! to finish the request in flight.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{oneshot, Semaphore};

/// How much one endpoint gives its clients.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    /// Connections open at once: a scraper or a few dozen peers need a handful; a flood costs
    /// this many descriptors at most.
    connections: usize,
    /// How long a connection may take to send a request's headers, and stay idle between
    /// requests (Prometheus sends its scrape at once, and reconnects when a kept connection was
    /// closed).
    header: Duration,
    /// How long a connection stays open at most (a 16 MiB metadata document over a slow link
    /// takes far less; a client closed meanwhile connects again).
    total: Duration,
}

impl Limits {
    /// The library's endpoints' limits.
    const DEFAULT: Limits = Limits {
        connections: 256,
        header: Duration::from_secs(5),
        total: Duration::from_secs(30),
    };
}

/// How long a connection past its total has to finish the request in flight.
const CLOSING_GRACE: Duration = Duration::from_secs(1);

/// How long the accept loop waits after an error other than a connection lost before it was
/// accepted (running out of descriptors, first of all), as `axum::serve` does: accepting again at
/// once would spin.
const ACCEPT_BACKOFF: Duration = Duration::from_secs(1);

/// Serves `app` on `listener` within the default limits until the returned sender is sent or
/// dropped; `what` names the endpoint in logs.
pub(crate) fn spawn(listener: TcpListener, app: Router, what: &'static str) -> oneshot::Sender<()> {
    let (tx, rx) = oneshot::channel();
    tokio::spawn(serve(listener, app, rx, what, Limits::DEFAULT));
    tx
}

/// Serves `app` on `listener` until `stop` resolves, within `limits` (the module says how);
/// `what` names the endpoint in logs. Connections open when it stops end with their request, at
/// their header deadline when idle, and at their total at the latest.
///
/// # Cancel safety
/// Cancel safe: dropping it stops accepting; open connections run on as above.
pub(crate) async fn serve(
    listener: TcpListener,
    app: Router,
    mut stop: oneshot::Receiver<()>,
    what: &'static str,
    limits: Limits,
) {
    let open = Arc::new(Semaphore::new(limits.connections));
    loop {
        let stream = tokio::select! {
            _ = &mut stop => return,
            r = listener.accept() => match r {
                Ok((stream, _)) => stream,
                Err(e) if matches!(
                    e.kind(),
                    io::ErrorKind::ConnectionRefused | io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset
                ) => continue,
                Err(e) => {
                    tracing::warn!(error = %e, endpoint = what, "accepting an HTTP connection failed; trying again in a second");
                    tokio::select! {
                        _ = &mut stop => return,
                        () = tokio::time::sleep(ACCEPT_BACKOFF) => continue,
                    }
                }
            },
        };
        let Ok(permit) = open.clone().try_acquire_owned() else {
            tracing::debug!(
                endpoint = what,
                "{} HTTP connections open: closing a new one",
                limits.connections
            );
            continue; // dropped: closed at once
        };
        let service = TowerToHyperService::new(app.clone());
        tokio::spawn(async move {
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header)
                .serve_connection(TokioIo::new(stream), service);
            tokio::pin!(conn);
            let served = match tokio::time::timeout(limits.total, conn.as_mut()).await {
                Ok(r) => r,
                Err(_) => {
                    conn.as_mut().graceful_shutdown();
                    tokio::time::timeout(CLOSING_GRACE, conn.as_mut())
                        .await
                        .unwrap_or(Ok(()))
                }
            };
            if let Err(e) = served {
                tracing::trace!(error = %e, endpoint = what, "HTTP connection ended");
            }
            drop(permit);
        });
    }
}

#[cfg(test)]
mod tests;
