//! The NATS channel: request/reply on a per-operation subject.
//!
//! The passive side subscribes to `nixl-connect.md.<uuid4>` and answers every request on it with
//! its metadata until the [`NatsPublication`] is dropped; the peer sends one request with a
//! timeout. It needs a plain `nats-server` (no JetStream), and a publication never outlives its
//! worker: once the worker exits, requests fail fast with "no responders".
//!
//! A restarted or briefly unreachable server costs nothing but the gap: the client reconnects by
//! itself (forever, backing off), subscriptions are made again on the server it reaches, and
//! requests fail typed meanwhile. Each gap is logged and kept ([`NatsChannel::outages`]).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use futures_util::StreamExt;

use super::outage::{self, Outage};
use crate::error::{Error, Result};
use crate::metadata::RdmaMetadata;
use crate::sync::Recover;

/// How long [`NatsChannel::publish`] waits for its own subscription to answer when the client has
/// no request timeout.
const PROOF_TIMEOUT: Duration = Duration::from_secs(10);

/// The subject prefix of published metadata.
pub const SUBJECT_PREFIX: &str = "nixl-connect.md.";

/// A connection to a NATS server used as a metadata channel. Cheap to clone.
#[derive(Clone, Debug)]
pub struct NatsChannel {
    client: async_nats::Client,
    outages: Arc<Mutex<Outages>>,
}

/// The connection's gaps: the one in progress and those that ended.
#[derive(Debug, Default)]
struct Outages {
    down: Option<(Instant, SystemTime, String)>,
    ended: Vec<Outage>,
}

impl Outages {
    /// What the client's event callback is told.
    fn event(&mut self, event: &async_nats::Event) {
        match event {
            async_nats::Event::Disconnected if self.down.is_none() => {
                tracing::warn!("the connection to the NATS server was lost: reconnecting");
                let cause = "the connection to the NATS server was lost".to_string();
                self.down = Some((Instant::now(), SystemTime::now(), cause));
            }
            async_nats::Event::ClientError(e) => {
                if let Some((_, _, cause)) = self.down.as_mut().filter(|d| !d.2.contains(": ")) {
                    *cause = format!("{cause}: {e}");
                }
            }
            async_nats::Event::Connected => {
                if let Some((t0, began, cause)) = self.down.take() {
                    let lasted = t0.elapsed();
                    tracing::warn!(?lasted, cause, "the connection to the NATS server is back");
                    let o = Outage {
                        began,
                        lasted,
                        cause,
                        republished: false,
                    };
                    outage::record(&mut self.ended, o);
                }
            }
            _ => {}
        }
    }
}

fn chan(what: &str, e: impl std::error::Error + Send + Sync + 'static) -> Error {
    Error::channel_from(format!("NATS {what}"), e)
}

impl NatsChannel {
    /// Connects to `url` (for example `nats://127.0.0.1:4222`) within `timeout`.
    ///
    /// # Errors
    /// [`Error::Channel`] when the server cannot be reached; [`Error::TimedOut`].
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn connect(url: &str, timeout: Duration) -> Result<Self> {
        let outages = Arc::new(Mutex::new(Outages::default()));
        let told = outages.clone();
        let opts = async_nats::ConnectOptions::new()
            .connection_timeout(timeout)
            .request_timeout(Some(timeout))
            .event_callback(move |event| {
                told.lock().recover().event(&event);
                std::future::ready(())
            });
        let client = tokio::time::timeout(timeout, opts.connect(url))
            .await
            .map_err(|_| Error::timed_out(timeout))?
            .map_err(|e| chan(&format!("connect to {url}"), e))?;
        Ok(Self { client, outages })
    }

    /// The times the connection to the server was lost, each with how long it lasted and why
    /// (the last 16; the one in progress is not among them until it ends).
    pub fn outages(&self) -> Vec<Outage> {
        self.outages.lock().recover().ended.clone()
    }

    /// Publishes `md` on a fresh subject; answered until the returned guard is dropped.
    ///
    /// Returns once the server answers requests on the subject: publish subscribes, then requests
    /// the document itself (a flush alone does not prove the server has read the subscription),
    /// so a peer's fetch through the same server that starts after this returns cannot miss the
    /// subscription. The client needs permission to publish on `nixl-connect.md.>` and to
    /// subscribe to its reply inbox (`_INBOX.>`), as a fetch does; a server that denies it drops
    /// the request, and publish then ends in [`Error::TimedOut`].
    ///
    /// # Errors
    /// [`Error::Channel`] when the subscription fails; [`Error::TimedOut`] when the server does
    /// not route the proof request within the client's request timeout.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn publish(&self, md: &RdmaMetadata) -> Result<NatsPublication> {
        let subject = format!("{SUBJECT_PREFIX}{}", uuid::Uuid::new_v4().simple());
        let mut sub = self
            .client
            .subscribe(subject.clone())
            .await
            .map_err(|e| chan("subscribe", e))?;
        let body = bytes::Bytes::from(md.to_json());
        let client = self.client.clone();
        let task = tokio::spawn(async move {
            while let Some(msg) = sub.next().await {
                if let Some(reply) = msg.reply {
                    if let Err(e) = client.publish(reply, body.clone()).await {
                        tracing::warn!(error = %e, "answering a metadata request failed");
                    }
                }
            }
        });
        let proof = self.client.request(subject.clone(), bytes::Bytes::new());
        let publication = NatsPublication { subject, task };
        // The server handles one connection's operations in order: our own request answered
        // proves the subscription live for every connection to it (other servers of a cluster
        // learn of it a moment later).
        let timeout = self.client.timeout().unwrap_or(PROOF_TIMEOUT);
        match tokio::time::timeout(timeout, proof).await {
            Ok(Ok(_)) => Ok(publication),
            Ok(Err(e)) if e.kind() != async_nats::RequestErrorKind::TimedOut => {
                Err(chan("request on the fresh subscription", e))
            }
            _ => Err(Error::timed_out(timeout)),
        }
    }

    /// Fetches and validates the metadata published on `subject`.
    ///
    /// # Errors
    /// [`Error::NotPublished`] when nobody answers on the subject (publication dropped, worker
    /// gone); [`Error::TimedOut`]; [`Error::Channel`] when the server is unreachable or the reply
    /// is oversized; [`Error::Metadata`] for a bad document.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn fetch(&self, subject: &str, timeout: Duration) -> Result<RdmaMetadata> {
        let req = self.client.request(subject.to_string(), bytes::Bytes::new());
        let msg = tokio::time::timeout(timeout, req)
            .await
            .map_err(|_| Error::timed_out(timeout))?
            .map_err(|e| match e.kind() {
                async_nats::RequestErrorKind::NoResponders => Error::NotPublished {
                    location: format!("NATS subject {subject}"),
                },
                async_nats::RequestErrorKind::TimedOut => Error::timed_out(timeout),
                _ => chan(&format!("request on {subject}"), e),
            })?;
        super::parse_document(format_args!("the reply on {subject}"), &msg.payload)
    }
}

/// One published document; dropping it stops answering (and unsubscribes).
#[derive(Debug)]
pub struct NatsPublication {
    subject: String,
    task: tokio::task::JoinHandle<()>,
}

impl NatsPublication {
    /// The subject the peer passes to [`NatsChannel::fetch`].
    pub fn subject(&self) -> &str {
        &self.subject
    }
}

impl Drop for NatsPublication {
    fn drop(&mut self) {
        // Aborting the task drops the subscriber, which unsubscribes.
        self.task.abort();
    }
}
