//! How the library's HTTP endpoints serve (the metadata channel's, the metrics'): bounded, so
//! that idle connections from anyone who can reach the port cannot fill the process's descriptor
//! table. At most [`MAX_CONNECTIONS`] connections are open at once (one more is closed as it is
//! accepted), and a connection has [`HEADER_DEADLINE`] to send each request's headers, which also
//! ends a keep-alive connection idle that long between requests.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// Connections one endpoint keeps open at once: a scraper or a few dozen peers need a handful;
/// a flood of idle ones costs this many descriptors at most.
pub(crate) const MAX_CONNECTIONS: usize = 256;

/// How long a connection may take to send a request's headers, and stay idle between requests
/// (Prometheus sends its scrape at once, and reconnects when a kept connection was closed).
pub(crate) const HEADER_DEADLINE: Duration = Duration::from_secs(5);

/// How long the accept loop waits after the process ran out of descriptors (as `axum::serve`
/// does, a second): accepting again at once would spin.
const ACCEPT_BACKOFF: Duration = Duration::from_secs(1);

/// Serves `app` on `listener` until `stop` resolves, bounded as the module says; `what` names the
/// endpoint in logs. Connections open when it stops end with their request, or at their header
/// deadline when idle.
///
/// # Cancel safety
/// Cancel safe: dropping it stops accepting; open connections run on as above.
pub(crate) async fn serve(
    listener: TcpListener,
    app: Router,
    stop: impl Future<Output = ()>,
    what: &'static str,
) {
    let open = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    tokio::pin!(stop);
    loop {
        let stream = tokio::select! {
            () = &mut stop => return,
            r = listener.accept() => match r {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::debug!(error = %e, endpoint = what, "accepting an HTTP connection failed");
                    if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)) {
                        tokio::time::sleep(ACCEPT_BACKOFF).await;
                    }
                    continue;
                }
            },
        };
        let Ok(permit) = open.clone().try_acquire_owned() else {
            tracing::debug!(
                endpoint = what,
                "{MAX_CONNECTIONS} HTTP connections open: closing a new one"
            );
            continue; // dropped: closed at once
        };
        let service = TowerToHyperService::new(app.clone());
        tokio::spawn(async move {
            let served = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_DEADLINE)
                .serve_connection(TokioIo::new(stream), service)
                .await;
            if let Err(e) = served {
                tracing::trace!(error = %e, endpoint = what, "HTTP connection ended");
            }
            drop(permit);
        });
    }
}
