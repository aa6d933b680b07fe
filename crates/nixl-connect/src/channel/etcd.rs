//! The etcd channel: metadata under a key held by a lease, in the etcd a Dynamo deployment runs.
//!
//! The passive side writes its metadata under `<prefix><name>` (default prefix [`DEFAULT_PREFIX`],
//! a fresh UUID for the name unless one is given), attached to a lease of [`LEASE_TTL`] that it
//! keeps alive while the [`EtcdPublication`] lives. Dropping the publication revokes the lease
//! (the key goes at once); a publisher that dies or loses etcd stops renewing it, and etcd deletes
//! the key when the lease runs out, so a key never outlives its worker by more than the TTL. The
//! peer gets the key, or watches for it until its deadline when it is not there yet.
//!
//! The key is written only if absent, in one put of the whole document. A publication survives
//! an etcd restart or outage ([`EtcdPublication::outages`]); readers need nothing, as each fetch is
//! a fresh request on a client that reconnects by itself.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, PutOptions, Txn, TxnOp, WatchOptions,
};

use super::outage::{self, Outage};
use crate::error::{Error, Result};
use crate::metadata::RdmaMetadata;
use crate::sync::Recover;

/// The key prefix of published metadata, under Dynamo's etcd as under any other.
pub const DEFAULT_PREFIX: &str = "nixl-connect/md/";

/// How long a published key outlives a publisher that stopped renewing its lease (etcd's lease
/// TTL, seconds granularity). The lease is renewed every third of it.
pub const LEASE_TTL: Duration = Duration::from_secs(10);

/// A client of an etcd cluster used as a metadata channel. Cheap to clone.
#[derive(Clone)]
pub struct EtcdChannel {
    client: Client,
    endpoints: Vec<String>,
    prefix: String,
    timeout: Duration,
}

impl std::fmt::Debug for EtcdChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdChannel")
            .field("endpoints", &self.endpoints)
            .field("prefix", &self.prefix)
            .finish()
    }
}

fn chan(what: &str, e: etcd_client::Error) -> Error {
    Error::channel_from(format!("etcd {what}"), e)
}

/// Runs `fut` (an etcd call) within `limit`: a server that does not answer is a typed timeout,
/// never a hang.
async fn within<T>(
    limit: Duration,
    what: &str,
    fut: impl std::future::Future<Output = std::result::Result<T, etcd_client::Error>>,
) -> Result<T> {
    tokio::time::timeout(limit, fut)
        .await
        .map_err(|_| Error::timed_out(limit))?
        .map_err(|e| chan(what, e))
}

impl EtcdChannel {
    /// Connects to the etcd cluster at `endpoints` (`http://host:port`, or `host:port`) and checks
    /// that it answers, within `timeout`; every later call is bounded by the same `timeout`.
    ///
    /// # Errors
    /// [`Error::Channel`] when no endpoint can be reached or the cluster refuses;
    /// [`Error::TimedOut`] when it does not answer within `timeout`;
    /// [`Error::InvalidArgument`] for an empty endpoint list.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn connect(endpoints: &[impl AsRef<str>], timeout: Duration) -> Result<Self> {
        let endpoints: Vec<String> = endpoints
            .iter()
            .map(|e| match e.as_ref() {
                e if e.contains("://") => e.to_string(),
                e => format!("http://{e}"),
            })
            .collect();
        if endpoints.is_empty() {
            return Err(Error::InvalidArgument("no etcd endpoint given".into()));
        }
        let opts = ConnectOptions::new()
            .with_connect_timeout(timeout)
            .with_timeout(timeout);
        let what = format!("connect to {}", endpoints.join(","));
        let mut client = within(timeout, &what, Client::connect(&endpoints, Some(opts))).await?;
        // The client connects lazily: one read proves the cluster answers.
        let probe = GetOptions::new().with_keys_only().with_limit(1);
        within(timeout, &what, client.get(DEFAULT_PREFIX, Some(probe))).await?;
        Ok(Self {
            client,
            endpoints,
            prefix: DEFAULT_PREFIX.to_string(),
            timeout,
        })
    }

    /// Publishes under `prefix` instead of [`DEFAULT_PREFIX`] (a deployment's namespace, for
    /// instance `dynamo/nixl-connect/`).
    #[must_use]
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The prefix keys are published under.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Publishes `md` under the prefix and a fresh name; kept until the returned publication is
    /// dropped (or its publisher stops renewing it: [`LEASE_TTL`]).
    ///
    /// # Errors
    /// As [`publish_as`](Self::publish_as).
    ///
    /// # Cancel safety
    /// As [`publish_as`](Self::publish_as).
    pub async fn publish(&self, md: &RdmaMetadata) -> Result<EtcdPublication> {
        self.publish_as(&uuid::Uuid::new_v4().simple().to_string(), md)
            .await
    }

    /// Publishes `md` under `<prefix><name>`, only if that key is free.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty name or a key already published;
    /// [`Error::Channel`] when etcd refuses; [`Error::TimedOut`] when it does not answer within
    /// the channel's timeout. On any error nothing is left in etcd (the lease is revoked, or
    /// expires).
    ///
    /// # Cancel safety
    /// Cancel safe: a publication dropped half-way leaves at most a lease (and its key) that
    /// expires within [`LEASE_TTL`].
    pub async fn publish_as(&self, name: &str, md: &RdmaMetadata) -> Result<EtcdPublication> {
        if name.is_empty() {
            return Err(Error::InvalidArgument("an etcd key name cannot be empty".into()));
        }
        let key = format!("{}{name}", self.prefix);
        let mut c = self.client.clone();
        let t = self.timeout;
        let ttl = LEASE_TTL.as_secs() as i64;
        let lease = within(t, "lease grant", c.lease_grant(ttl, None)).await?.id();
        // From here on the lease is ours to end: a guard revokes it unless the publication takes it.
        let mut guard = Revoke(Some((c.clone(), lease)));
        let txn = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(
                key.clone(),
                md.to_json(),
                Some(PutOptions::new().with_lease(lease)),
            )]);
        let put = within(t, &format!("put {key}"), c.txn(txn)).await?;
        if !put.succeeded() {
            return Err(Error::InvalidArgument(format!(
                "etcd key {key} is already published (by another worker, or by this one earlier): \
                 choose another name"
            )));
        }
        let stream = within(t, "lease keep-alive", c.lease_keep_alive(lease)).await?;
        let keeping = Arc::new(Keeping {
            lease: AtomicI64::new(lease),
            outages: Mutex::new(Vec::new()),
        });
        Ok(EtcdPublication {
            task: tokio::spawn(keep(c, key.clone(), md.to_json(), stream, keeping.clone())),
            key,
            keeping,
            client: guard.0.take().map(|(c, _)| c),
        })
    }

    /// Fetches and validates the metadata under `key` (a full key, as
    /// [`EtcdPublication::key`] gives it), waiting for it to be published until `timeout`.
    ///
    /// # Errors
    /// [`Error::NotPublished`] when the key is not there by the deadline (never published,
    /// unpublished, or its publisher's lease ran out); [`Error::TimedOut`] when etcd does not
    /// answer; [`Error::Channel`] when it refuses or the document is oversized;
    /// [`Error::Metadata`] for a bad document.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn fetch(&self, key: &str, timeout: Duration) -> Result<RdmaMetadata> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut c = self.client.clone();
        let limit = self.timeout.min(timeout);
        let got = within(limit, &format!("get {key}"), c.get(key, None)).await?;
        if let Some(kv) = got.kvs().first() {
            return parse(key, kv.value());
        }
        // Not there yet: watch from the revision just read, so a put in between is not missed.
        let from = got.header().map_or(0, |h| h.revision()) + 1;
        let watched = async {
            let failed = |e: etcd_client::Error| chan(&format!("watch {key}"), e);
            let watch = c.watch(key, Some(WatchOptions::new().with_start_revision(from)));
            let mut stream = watch.await.map_err(failed)?;
            loop {
                let Some(resp) = stream.message().await.map_err(failed)? else {
                    return Err(Error::channel(format!("etcd ended the watch of {key}")));
                };
                if resp.canceled() {
                    return Err(Error::channel(format!("etcd cancelled the watch of {key}")));
                }
                for ev in resp.events() {
                    if let (EventType::Put, Some(kv)) = (ev.event_type(), ev.kv()) {
                        return parse(key, kv.value());
                    }
                }
            }
        };
        tokio::time::timeout_at(deadline, watched)
            .await
            .map_err(|_| Error::NotPublished {
                location: format!("etcd key {key} (waited {timeout:?})"),
            })?
    }
}

/// What a publication's renewal task shares with the publication.
struct Keeping {
    /// The lease holding the key now (another after a re-publication).
    lease: AtomicI64,
    outages: Mutex<Vec<Outage>>,
}

type Stream = (etcd_client::LeaseKeeper, etcd_client::LeaseKeepAliveStream);

/// Keeps the key `key` (holding `doc`) published: renews its lease every third of
/// [`LEASE_TTL`]; after a failed renewal opens a new keep-alive stream; when etcd no longer knows
/// the lease, writes the key again under a new one (only if absent: a name another worker took
/// meanwhile is left to it, and this task ends). Ends when the publication is dropped (aborted).
async fn keep(mut c: Client, key: String, doc: String, stream: Stream, keeping: Arc<Keeping>) {
    let mut stream = Some(stream);
    // The first failure of the outage in progress: when (monotonic, wall) and why.
    let mut down: Option<(Instant, SystemTime, String)> = None;
    let mut tick = tokio::time::interval(LEASE_TTL / 3);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        let lease = keeping.lease.load(Ordering::Relaxed);
        let result = match renew(&mut c, lease, &mut stream).await {
            Ok(false) => match republish(&mut c, &key, &doc).await {
                Ok(Some((new, s))) => {
                    keeping.lease.store(new, Ordering::Relaxed);
                    stream = Some(s);
                    down.get_or_insert_with(|| {
                        (
                            Instant::now(),
                            SystemTime::now(),
                            format!("etcd no longer knew lease {lease}"),
                        )
                    });
                    Ok(true)
                }
                Ok(None) => {
                    tracing::warn!(key, "the etcd key was taken by another publisher while this one's lease was lost: it is no longer published here");
                    return;
                }
                Err(e) => Err(e),
            },
            r => r.map(|_| false),
        };
        match result {
            Ok(republished) => {
                if let Some((t0, began, cause)) = down.take() {
                    let lasted = t0.elapsed();
                    tracing::warn!(
                        key,
                        ?lasted,
                        cause,
                        republished,
                        "the etcd publication is held again"
                    );
                    let o = Outage {
                        began,
                        lasted,
                        cause,
                        republished,
                    };
                    outage::record(&mut keeping.outages.lock().recover(), o);
                }
            }
            Err(e) => {
                stream = None;
                if down.is_none() {
                    tracing::warn!(
                        key,
                        lease,
                        error = e,
                        "renewing the etcd lease failed: retrying every {:?}",
                        LEASE_TTL / 3
                    );
                    down = Some((Instant::now(), SystemTime::now(), e));
                }
            }
        }
    }
}

/// One renewal of `lease` on `stream` (opened first when there is none): `Ok(false)` when etcd
/// answers that the lease is gone.
async fn renew(c: &mut Client, lease: i64, stream: &mut Option<Stream>) -> std::result::Result<bool, String> {
    let limit = LEASE_TTL / 3;
    if stream.is_none() {
        let opened = tokio::time::timeout(limit, c.lease_keep_alive(lease))
            .await
            .map_err(|_| format!("etcd did not open a lease keep-alive stream within {limit:?}"))?;
        match opened {
            Ok(o) => *stream = Some(o),
            // What etcd-client says when the stream's first answer has no TTL: the lease is gone.
            Err(etcd_client::Error::LeaseKeepAliveError(m)) if m == "lease not found" => return Ok(false),
            Err(e) => return Err(e.to_string()),
        }
    }
    let (keeper, s) = stream.as_mut().expect("opened above");
    let renewed = async {
        keeper.keep_alive().await?;
        s.message().await
    };
    match tokio::time::timeout(limit, renewed).await {
        Ok(Ok(Some(r))) => Ok(r.ttl() > 0),
        Ok(Ok(None)) => Err("etcd closed the lease keep-alive stream".into()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("etcd did not answer a lease renewal within {limit:?}")),
    }
}

/// Writes `key` again under a new lease, only if absent: the lease now holding it and its
/// keep-alive stream, or `None` when the key is another publisher's (a document other than
/// `doc`). A key that already holds `doc` is this publisher's own (a put whose answer was lost):
/// its lease is adopted. A put whose outcome is unknown (no answer in time) leaves its lease to
/// expire, never revoked, so that a put that did land is found and adopted at the next renewal.
async fn republish(
    c: &mut Client,
    key: &str,
    doc: &str,
) -> std::result::Result<Option<(i64, Stream)>, String> {
    let limit = LEASE_TTL / 3;
    let grant = tokio::time::timeout(limit, c.lease_grant(LEASE_TTL.as_secs() as i64, None)).await;
    let lease = answered("lease grant", grant)?.id();
    let mut guard = Revoke(Some((c.clone(), lease)));
    let txn = Txn::new()
        .when([Compare::create_revision(key, CompareOp::Equal, 0)])
        .and_then([TxnOp::put(key, doc, Some(PutOptions::new().with_lease(lease)))])
        .or_else([TxnOp::get(key, None)]);
    let put = tokio::time::timeout(limit, c.txn(txn)).await;
    if put.is_err() {
        guard.0 = None; // the put may have landed under it: left to expire, or adopted
    }
    let put = answered("put", put)?;
    let ours = |o: etcd_client::TxnOpResponse| match o {
        etcd_client::TxnOpResponse::Get(g) => g
            .kvs()
            .first()
            .filter(|kv| kv.value() == doc.as_bytes() && kv.lease() != 0)
            .map(|kv| kv.lease()),
        _ => None,
    };
    let held = if put.succeeded() {
        lease
    } else if let Some(l) = put.op_responses().into_iter().find_map(ours) {
        l // the new lease is revoked by the guard
    } else {
        return Ok(None);
    };
    let alive = tokio::time::timeout(limit, c.lease_keep_alive(held)).await;
    let s = answered("lease keep-alive", alive)?;
    if held == lease {
        guard.0 = None; // the publication's now
    }
    Ok(Some((held, s)))
}

/// The outcome of the etcd call `what`, bounded by a third of [`LEASE_TTL`], its failure in words.
fn answered<T>(
    what: &str,
    r: std::result::Result<std::result::Result<T, etcd_client::Error>, tokio::time::error::Elapsed>,
) -> std::result::Result<T, String> {
    match r {
        Ok(r) => r.map_err(|e| format!("etcd {what}: {e}")),
        Err(_) => Err(format!("etcd did not answer a {what} within {:?}", LEASE_TTL / 3)),
    }
}

fn parse(key: &str, value: &[u8]) -> Result<RdmaMetadata> {
    super::parse_document(format_args!("the value of etcd key {key}"), value)
}

/// Revokes a lease when dropped while it still holds one (a publication that failed half-way).
struct Revoke(Option<(Client, i64)>);

impl Drop for Revoke {
    fn drop(&mut self) {
        if let Some((c, lease)) = self.0.take() {
            revoke_later(c, lease);
        }
    }
}

/// Revokes `lease` from a task of the current runtime; without one (or if etcd does not answer)
/// the lease expires by itself within [`LEASE_TTL`].
fn revoke_later(mut c: Client, lease: i64) {
    if let Ok(rt) = tokio::runtime::Handle::try_current() {
        rt.spawn(async move {
            let _ = tokio::time::timeout(LEASE_TTL, c.lease_revoke(lease)).await;
        });
    }
}

/// One published document; dropping it stops renewing its lease and revokes it (the key is
/// deleted at once, or by etcd within [`LEASE_TTL`] if the revocation cannot reach it).
pub struct EtcdPublication {
    key: String,
    keeping: Arc<Keeping>,
    task: tokio::task::JoinHandle<()>,
    client: Option<Client>,
}

impl std::fmt::Debug for EtcdPublication {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdPublication")
            .field("key", &self.key)
            .field("lease", &self.lease())
            .finish()
    }
}

impl EtcdPublication {
    /// The full key the peer passes to [`EtcdChannel::fetch`].
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The lease that holds the key now (another after a re-publication).
    pub fn lease(&self) -> i64 {
        self.keeping.lease.load(Ordering::Relaxed)
    }

    /// The times etcd could not be reached or had forgotten the lease, and how each ended (the
    /// last 16).
    pub fn outages(&self) -> Vec<Outage> {
        self.keeping.outages.lock().recover().clone()
    }

    /// Unpublishes now and waits for etcd to confirm (up to [`LEASE_TTL`]).
    ///
    /// # Errors
    /// [`Error::Channel`] when etcd refuses; [`Error::TimedOut`]. Either way the key is gone
    /// within [`LEASE_TTL`].
    ///
    /// # Cancel safety
    /// Cancel safe: the lease then expires within [`LEASE_TTL`].
    pub async fn unpublish(mut self) -> Result<()> {
        self.task.abort();
        // Once the task has stopped, `lease()` is the last lease it will ever hold (a
        // re-publication cut off half-way has its new lease revoked by its own guard).
        let _ = (&mut self.task).await;
        match self.client.take() {
            Some(mut c) => within(LEASE_TTL, "lease revoke", c.lease_revoke(self.lease()))
                .await
                .map(drop),
            None => Ok(()),
        }
    }
}

impl Drop for EtcdPublication {
    fn drop(&mut self) {
        self.task.abort();
        if let Some(c) = self.client.take() {
            revoke_later(c, self.lease());
        }
    }
}
