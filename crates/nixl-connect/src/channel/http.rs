//! The embedded HTTP channel.
//!
//! The side exposing memory publishes its metadata on a process-wide HTTP listener
//! ([`HttpChannel::global`], or one bound explicitly with [`HttpChannel::bind`]); each publication
//! gets its own unguessable path, `/nixl/<uuid4>`, and disappears when its [`Publication`] is
//! dropped. The peer fetches it with [`fetch`], bounded by a timeout.
//!
//! `GET /nixl/<id>` returns exactly the `RdmaMetadata` JSON (so any HTTP client, Python's too, can
//! use it); `GET /nixl/<id>/extra` returns the optional JSON document published beside it (the
//! `send` command puts the file's checksum and name there).
//!
//! ```no_run
//! # async fn demo(conn: nixl_connect::Connector) -> nixl_connect::Result<()> {
//! use nixl_connect::{channel::http, Descriptor};
//! let readable = conn.create_readable(Descriptor::from(vec![7u8; 4096])).await?;
//! let channel = http::HttpChannel::global().await?;
//! let publication = channel.publish(readable.metadata());
//! println!("fetch it from {}", publication.url());
//! readable.wait_for_completion(None).await?;
//! drop(publication); // unpublished
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Bytes;
use tokio::sync::{oneshot, OnceCell};

use super::MAX_DOCUMENT;
use crate::error::{Error, Result};
use crate::metadata::RdmaMetadata;
use crate::sync::Recover;

/// The address [`HttpChannel::global`] binds (default `127.0.0.1:0`).
pub use crate::settings::LISTEN_ENV;

struct Item {
    metadata: Bytes,
    extra: Option<Bytes>,
    /// The peer's reply (`POST <url>/reply`), e.g. a receiver's confirmation.
    reply: tokio::sync::watch::Sender<Option<Bytes>>,
}

struct Inner {
    addr: SocketAddr,
    host: String,
    items: Mutex<HashMap<String, Item>>,
    /// Dropped with the last clone: the listener stops.
    _stop: oneshot::Sender<()>,
}

/// An HTTP listener serving published metadata. Cheap to clone; the listener stops when the last
/// clone is dropped (the [`global`](Self::global) one lives as long as the process).
#[derive(Clone)]
pub struct HttpChannel {
    inner: Arc<Inner>,
}

static GLOBAL: OnceCell<HttpChannel> = OnceCell::const_new();

impl HttpChannel {
    /// The process-wide listener, started on first use on `$NIXL_CONNECT_HTTP_LISTEN` (default
    /// `127.0.0.1:0`, a free loopback port).
    ///
    /// # Errors
    /// [`Error::Channel`] when the address does not parse or cannot be bound.
    ///
    /// # Cancel safety
    /// Cancel safe: a cancelled first call leaves the listener unstarted.
    pub async fn global() -> Result<Self> {
        GLOBAL
            .get_or_try_init(|| async {
                let addr = match crate::settings::http_listen() {
                    Some(s) => s.parse().map_err(|e| {
                        Error::channel_from(format!("{LISTEN_ENV}={s:?} is not an address"), e)
                    })?,
                    None => SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
                };
                Self::bind(addr).await
            })
            .await
            .cloned()
    }

    /// Binds a listener on `addr` (port 0 picks a free port) and serves until dropped: at most
    /// 256 connections kept open, each with 5 s to send a request's headers (and to stay idle
    /// between requests) and 30 s in all.
    ///
    /// Must be called inside a tokio runtime, which runs the server.
    ///
    /// # Errors
    /// [`Error::Channel`] when the address cannot be bound.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn bind(addr: SocketAddr) -> Result<Self> {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| Error::channel_from(format!("cannot listen on {addr}"), e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::channel_from("the bound address", e))?;
        let host = match addr.ip() {
            ip if ip.is_unspecified() => hostname().unwrap_or_else(|| "localhost".into()),
            IpAddr::V6(ip) => format!("[{ip}]"),
            ip => ip.to_string(),
        };
        let inner = Arc::new_cyclic(|weak: &Weak<Inner>| {
            let app = Router::new()
                .route("/nixl/{id}", get(get_metadata))
                .route("/nixl/{id}/extra", get(get_extra))
                .route("/nixl/{id}/reply", axum::routing::post(post_reply))
                .with_state(weak.clone());
            Inner {
                addr,
                host,
                items: Mutex::new(HashMap::new()),
                _stop: super::serve::spawn(listener, app, "metadata"),
            }
        });
        Ok(Self { inner })
    }

    /// The address the listener is bound to.
    pub fn local_addr(&self) -> SocketAddr {
        self.inner.addr
    }

    /// Publishes `md` under a fresh unguessable path; unpublished when the guard is dropped.
    pub fn publish(&self, md: &RdmaMetadata) -> Publication {
        self.insert(md, None)
    }

    /// Publishes `md` and, beside it at `<url>/extra`, the JSON document `extra`.
    pub fn publish_with(&self, md: &RdmaMetadata, extra: &serde_json::Value) -> Publication {
        self.insert(md, Some(Bytes::from(extra.to_string())))
    }

    fn insert(&self, md: &RdmaMetadata, extra: Option<Bytes>) -> Publication {
        let id = uuid::Uuid::new_v4().simple().to_string();
        let (reply, replies) = tokio::sync::watch::channel(None);
        let item = Item {
            metadata: Bytes::from(md.to_json()),
            extra,
            reply,
        };
        self.inner.items.lock().recover().insert(id.clone(), item);
        Publication {
            url: format!("http://{}:{}/nixl/{id}", self.inner.host, self.inner.addr.port()),
            id,
            channel: Arc::downgrade(&self.inner),
            replies,
        }
    }

    /// How many publications are live.
    pub fn len(&self) -> usize {
        self.inner.items.lock().recover().len()
    }

    /// True when nothing is published.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl std::fmt::Debug for HttpChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpChannel")
            .field("addr", &self.inner.addr)
            .field("published", &self.len())
            .finish()
    }
}

/// One published document. Dropping it unpublishes it: fetches then get [`Error::NotPublished`].
#[derive(Debug)]
pub struct Publication {
    url: String,
    id: String,
    channel: Weak<Inner>,
    replies: tokio::sync::watch::Receiver<Option<Bytes>>,
}

impl Publication {
    /// The URL the peer fetches.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Waits for the peer's reply (a JSON document it posts with [`reply`]), up to `timeout`.
    ///
    /// # Errors
    /// [`Error::TimedOut`] when no reply came in time; [`Error::Channel`] when the reply is not
    /// JSON or the listener stopped.
    ///
    /// # Cancel safety
    /// Cancel safe: a reply that arrives later is kept for the next call.
    pub async fn reply(&mut self, timeout: Duration) -> Result<serde_json::Value> {
        let got = super::within(timeout, async {
            match self.replies.wait_for(Option::is_some).await {
                Ok(got) => Ok(got.clone().expect("waited for Some")),
                Err(_) => Err(Error::channel("the metadata listener stopped")),
            }
        })
        .await?;
        serde_json::from_slice(&got).map_err(|e| Error::channel_from("the reply is not JSON", e))
    }
}

impl Drop for Publication {
    fn drop(&mut self) {
        if let Some(inner) = self.channel.upgrade() {
            inner.items.lock().recover().remove(&self.id);
        }
    }
}

fn json(body: Bytes) -> Response {
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// `f` of the live publication `id`, if there is one.
fn with_item<R>(inner: &Weak<Inner>, id: &str, f: impl FnOnce(&Item) -> R) -> Option<R> {
    Some(f(inner.upgrade()?.items.lock().ok()?.get(id)?))
}

const NO_SUCH: &str = "no such operation (completed, dropped, or never published)\n";

fn not_found() -> Response {
    (StatusCode::NOT_FOUND, NO_SUCH).into_response()
}

async fn get_metadata(State(inner): State<Weak<Inner>>, Path(id): Path<String>) -> Response {
    with_item(&inner, &id, |it| json(it.metadata.clone())).unwrap_or_else(not_found)
}

async fn get_extra(State(inner): State<Weak<Inner>>, Path(id): Path<String>) -> Response {
    let extra = |it: &Item| json(it.extra.clone().unwrap_or(Bytes::from_static(b"null")));
    with_item(&inner, &id, extra).unwrap_or_else(not_found)
}

async fn post_reply(
    State(inner): State<Weak<Inner>>,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Response {
    if body.len() > MAX_DOCUMENT || serde_json::from_slice::<serde_json::Value>(&body).is_err() {
        return (StatusCode::BAD_REQUEST, "the reply must be a JSON document\n").into_response();
    }
    with_item(&inner, &id, |it| {
        it.reply.send_replace(Some(body));
        StatusCode::NO_CONTENT.into_response()
    })
    .unwrap_or_else(not_found)
}

fn hostname() -> Option<String> {
    let h = std::fs::read_to_string("/proc/sys/kernel/hostname").ok()?;
    let h = h.trim();
    (!h.is_empty()).then(|| h.to_string())
}

pub(crate) async fn get_bytes(url: &str, timeout: Duration) -> Result<Bytes> {
    exchange(url, url, None, timeout).await
}

/// Sends a GET (or, with a JSON `body`, a POST) to `target` within `timeout` and returns the body
/// of a successful answer; a 404 is [`Error::NotPublished`] at `location`.
async fn exchange(location: &str, target: &str, body: Option<String>, timeout: Duration) -> Result<Bytes> {
    let uri: hyper::Uri = target
        .parse()
        .map_err(|e| Error::channel_from(format!("{location:?} is not a URL"), e))?;
    if uri.scheme_str() != Some("http") {
        return Err(Error::channel(format!(
            "{location}: only http:// URLs are served by this channel"
        )));
    }
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Full<Bytes>>();
    let req = match body {
        None => hyper::Request::get(uri).body(Full::default()),
        Some(b) => hyper::Request::post(uri)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(b))),
    }
    .map_err(|e| Error::channel_from("building the request", e))?;
    let work = async {
        let resp = client
            .request(req)
            .await
            .map_err(|e| Error::channel_from(format!("cannot reach {location}"), e))?;
        let status = resp.status();
        let body = Limited::new(resp.into_body(), MAX_DOCUMENT)
            .collect()
            .await
            .map_err(|e| Error::channel_shared(format!("reading {target}"), e.into()))?
            .to_bytes();
        match status {
            s if s.is_success() => Ok(body),
            StatusCode::NOT_FOUND => Err(Error::NotPublished {
                location: location.to_string(),
            }),
            s => Err(Error::channel(format!("{target} answered {s}"))),
        }
    };
    super::within(timeout, work).await
}

/// Fetches and validates the metadata published at `url`.
///
/// # Errors
/// [`Error::NotPublished`] (404: the operation completed or was dropped), [`Error::TimedOut`],
/// [`Error::Channel`] (unreachable, not HTTP, oversized), [`Error::Metadata`] (bad document).
///
/// # Cancel safety
/// Cancel safe.
pub async fn fetch(url: &str, timeout: Duration) -> Result<RdmaMetadata> {
    super::parse_document(format_args!("{url}"), &get_bytes(url, timeout).await?)
}

/// Posts `reply` (a JSON document, e.g. a receiver's confirmation) to the publisher of `url`,
/// who reads it with [`Publication::reply`].
///
/// # Errors
/// [`Error::NotPublished`] (the publication is gone), [`Error::TimedOut`], [`Error::Channel`].
///
/// # Cancel safety
/// Cancel safe (the reply may or may not have arrived).
pub async fn reply(url: &str, reply: &serde_json::Value, timeout: Duration) -> Result<()> {
    let target = format!("{}/reply", url.trim_end_matches('/'));
    exchange(url, &target, Some(reply.to_string()), timeout)
        .await
        .map(drop)
}

/// Fetches the extra JSON document published beside the metadata at `url` (`null` when none).
///
/// # Errors
/// As [`fetch`], and [`Error::Channel`] when the document is not JSON.
///
/// # Cancel safety
/// Cancel safe.
pub async fn fetch_extra(url: &str, timeout: Duration) -> Result<serde_json::Value> {
    let body = get_bytes(&format!("{}/extra", url.trim_end_matches('/')), timeout).await?;
    serde_json::from_slice(&body).map_err(|e| Error::channel_from(format!("{url}/extra is not JSON"), e))
}
