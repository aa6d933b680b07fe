//! [`Connector`]: one NIXL agent, shared by every operation made through it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use std::path::PathBuf;
use std::time::Duration;

use crate::descriptor::{Descriptor, Descriptors};
use crate::device::Device;
use crate::engine::{Engine, EngineOptions};
use crate::error::{Error, Result};
use crate::metadata::{OperationKind, RdmaMetadata};
use crate::metrics::families::Metrics;
use crate::operation::{PathPolicy, ReadOperation, ReadableOperation, WritableOperation, WriteOperation};
use crate::path_probe::PathProbe;
use crate::registration::Registration;
use crate::settings::{self, WAIT_SPIN_ENV};
use crate::state::TransferPath;
use crate::stats::EngineStats;

/// How long, by default, a dropped operation with borrowed memory waits for its NIXL transfer to
/// end before the connector cuts the transfer off.
pub const DEFAULT_CANCEL_GRACE: Duration = Duration::from_secs(2);

static CONNECTIONS: AtomicU64 = AtomicU64::new(1);

/// Moves data between this worker and its peers, as Python's `dynamo.nixl_connect.Connector`.
///
/// One connector owns one NIXL agent, created once on a dedicated engine thread and shared by all
/// its operations and clones. Cloning is cheap. The agent and its thread end when the last clone
/// and the last operation made through it are dropped.
///
/// ```no_run
/// # async fn demo() -> nixl_connect::Result<()> {
/// use nixl_connect::{Connector, Descriptor, HostBuffer};
/// let conn = Connector::new()?;
/// let data = HostBuffer::from_slice(b"embeddings")?;
/// let readable = conn.create_readable(Descriptor::from(&data)).await?;
/// let json = readable.metadata().to_json(); // hand this to the peer (HTTP, NATS, ...)
/// readable.wait_for_completion(None).await?; // returns once the peer has read it
/// # let _ = json; Ok(()) }
/// ```
#[derive(Clone)]
pub struct Connector {
    inner: Arc<Inner>,
}

struct Inner {
    engine: Engine,
    worker_id: String,
    path: PathPolicy,
}

/// Builds a [`Connector`] with options.
#[derive(Debug, Clone)]
pub struct ConnectorBuilder {
    worker_id: Option<String>,
    backends: Vec<String>,
    ucx_params: Vec<(String, String)>,
    progress_delay: Duration,
    path: PathPolicy,
    cancel_grace: Duration,
    deregister_on_completion: bool,
    quarantine_limit: usize,
    socket_dir: Option<PathBuf>,
    metrics: Option<Metrics>,
    wait_spin: Option<Duration>,
}

/// The longest time an operation's wait may stay awake before it parks
/// ([`ConnectorBuilder::wait_spin`]).
pub const MAX_WAIT_SPIN: Duration = Duration::from_millis(10);

/// How long, by default, the wait of a small operation stays awake before it parks
/// ([`ConnectorBuilder::wait_spin`]): 100 us.
pub const DEFAULT_WAIT_SPIN: Duration = Duration::from_micros(100);

/// How much given-up exposed memory a connector holds back, by default, before it replaces its
/// NIXL agent to release it.
pub const DEFAULT_QUARANTINE_LIMIT: usize = 256 << 20;

/// How long, by default, NIXL may go unprogressed while it has work (transfers in flight,
/// passive operations waiting for a peer) once the connector has been idle for a moment: 1 ms,
/// the default of Dynamo's `DYN_MM_NIXL_PROGRESS_DELAY_US`. An idle connector with nothing
/// exposed is never progressed and costs no CPU.
pub const DEFAULT_PROGRESS_DELAY: Duration = crate::engine::DEFAULT_PROGRESS_DELAY;

/// The longest progress delay a builder takes (1 s, Dynamo's bound).
pub const MAX_PROGRESS_DELAY: Duration = Duration::from_secs(1);

impl Default for ConnectorBuilder {
    fn default() -> Self {
        Self {
            worker_id: None,
            backends: vec!["UCX".into()],
            ucx_params: Vec::new(),
            progress_delay: DEFAULT_PROGRESS_DELAY,
            path: PathPolicy::Auto,
            cancel_grace: DEFAULT_CANCEL_GRACE,
            deregister_on_completion: false,
            quarantine_limit: DEFAULT_QUARANTINE_LIMIT,
            socket_dir: None,
            metrics: None,
            wait_spin: None,
        }
    }
}

impl ConnectorBuilder {
    /// The worker id (Python's `worker_id`); default: a fresh UUID without dashes.
    pub fn worker_id(mut self, id: impl Into<String>) -> Self {
        self.worker_id = Some(id.into());
        self
    }

    /// The NIXL backends (plugin names) each of the connector's NIXL agents is created with, in
    /// order (default `["UCX"]`). A peer's transfer uses a backend both agents have; the same-host
    /// path is not a NIXL backend and is chosen by [`path`](Self::path). Other plugins
    /// (`LIBFABRIC`, or storage backends such as `POSIX` and `GDS`) are created with their
    /// plugin's default parameters; [`ucx_param`](Self::ucx_param) applies to `UCX` alone.
    /// [`build`](Self::build) checks the list.
    pub fn backends<I, S>(mut self, names: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.backends = names.into_iter().map(Into::into).collect();
        self
    }

    /// The longest time NIXL goes unprogressed while it has work, once the connector has been
    /// idle for a moment (default [`DEFAULT_PROGRESS_DELAY`], at most [`MAX_PROGRESS_DELAY`]):
    /// Dynamo's `DYN_MM_NIXL_PROGRESS_DELAY_US`. After any activity the engine thread polls NIXL
    /// for 2 ms, then backs off up to this delay: shorter answers a lone transfer sooner at the
    /// cost of CPU; zero spins a core while any operation waits (NIXL's own default). An idle
    /// connector sleeps whatever this is.
    pub fn progress_delay(mut self, delay: Duration) -> Self {
        self.progress_delay = delay;
        self
    }

    /// Sets a UCX backend parameter (for example `ucx_error_handling_mode` = `none`, which moves
    /// notifications to shared memory at the cost of peer-failure detection).
    pub fn ucx_param(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.ucx_params.push((key.into(), value.into()));
        self
    }

    /// A directory shared with same-host peers that share no network namespace with this process
    /// (pods on one node mounting one volume, each in its own namespace): this connector's
    /// same-host socket is also a file there, and peers' are looked for there when their abstract
    /// socket cannot be reached. Default: the environment's `NIXL_CONNECT_SOCKET_DIR`, else none
    /// (abstract sockets only).
    ///
    /// The sockets go in a folder of the user's own inside it (`nixl-connect.<uid>`, mode 0700).
    /// The path must be short enough for a Unix socket address (about 60 bytes with the names
    /// added).
    pub fn socket_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.socket_dir = Some(dir.into());
        self
    }

    /// Records the connector's operations and counters into `metrics` (registered once in the
    /// user's Prometheus registry: [`Metrics::register`]); connectors sharing one [`Metrics`] add
    /// up. Default: nothing is recorded. Names, types and labels: `docs/METRICS.md`.
    pub fn metrics(mut self, metrics: &Metrics) -> Self {
        self.metrics = Some(metrics.clone());
        self
    }

    /// How long `wait_for_completion` of a small operation (at most 64 KiB in all) stays awake, at
    /// most, before its task parks until the engine wakes it (default: [`WAIT_SPIN_ENV`] in
    /// microseconds where set, else [`DEFAULT_WAIT_SPIN`]; zero turns it off; at most
    /// [`MAX_WAIT_SPIN`]).
    ///
    /// A spinning waiter sees the end at once instead of paying a wake-up, yielding its core and
    /// its runtime between turns; on an oversubscribed core it stops spinning for a while. Larger
    /// operations never spin. At most half the cores' worth of this connector's waits spin at
    /// once (at least one); the others park at once.
    pub fn wait_spin(mut self, spin: Duration) -> Self {
        self.wait_spin = Some(spin);
        self
    }

    /// Which paths active operations may take (default [`PathPolicy::Auto`]: the same-host path
    /// to Rust peers on this host, NIXL otherwise). [`PathPolicy::Nixl`] also stops this
    /// connector from listening for same-host peers.
    pub fn path(mut self, path: PathPolicy) -> Self {
        self.path = path;
        self
    }

    /// How long a dropped active operation whose memory is borrowed waits for its NIXL transfer
    /// to end (default [`DEFAULT_CANCEL_GRACE`]). Past it, the connector destroys the NIXL agent
    /// that posted the transfer, the only way NIXL ends a posted transfer for sure; its other
    /// NIXL transfers then fail with [`Error::Interrupted`] and may be retried.
    pub fn cancel_grace(mut self, grace: Duration) -> Self {
        self.cancel_grace = grace;
        self
    }

    /// Deregisters a passive operation's memory from NIXL when the operation ends, instead of
    /// keeping the registration cached while the memory lives (default off). This revokes a
    /// late or replayed NIXL access only where the transport checks registrations (RDMA NICs
    /// without UCX's registration cache); over TCP, CMA and shared memory UCX checks nothing at
    /// the target. Each operation then registers its memory again.
    pub fn deregister_on_completion(mut self, on: bool) -> Self {
        self.deregister_on_completion = on;
        self
    }

    /// How much memory, given up after NIXL exposed it, the connector holds back before it
    /// replaces its exposing NIXL agent (default [`DEFAULT_QUARANTINE_LIMIT`]). Exposed memory is
    /// not returned to the allocator while the agent that exposed it lives (UCX checks no
    /// registration over TCP, CMA or shared memory). Past this much, new operations go to a
    /// fresh agent, and the old one is destroyed (releasing the memory) once its last operation
    /// has ended, or, when more than [`MAX_RETIRED_EXPOSERS`](crate::MAX_RETIRED_EXPOSERS) old
    /// agents wait for their operations, at once: the oldest one's waiting operations then fail
    /// with [`Error::Interrupted`]. Memory held back is thus bounded by about
    /// `(MAX_RETIRED_EXPOSERS + 1) * bytes`. Creating an agent takes tens of milliseconds.
    pub fn quarantine_limit(mut self, bytes: usize) -> Self {
        self.quarantine_limit = bytes;
        self
    }

    /// Loads NIXL if needed, creates the agent and its UCX backend, starts listening for
    /// same-host peers, and starts the engine thread.
    ///
    /// Blocks for the tens of milliseconds UCX takes to start (call it outside async code, or in
    /// `spawn_blocking`).
    ///
    /// # Errors
    /// [`Error::NixlNotFound`] / [`Error::NixlLoad`] when NIXL is absent or broken (with the fix
    /// in the message), [`Error::NixlBackend`] when a backend cannot start,
    /// [`Error::InvalidArgument`] for an empty worker id, an unknown UCX parameter, a backend list
    /// that is empty, repeats a name or names a plugin NIXL lacks, UCX parameters without UCX
    /// among the backends, a progress delay above [`MAX_PROGRESS_DELAY`], a wait spin above
    /// [`MAX_WAIT_SPIN`] or a [`WAIT_SPIN_ENV`] that is not a number of microseconds.
    pub fn build(self) -> Result<Connector> {
        if self.backends.is_empty() {
            return Err(Error::InvalidArgument(
                "the connector's NIXL backend list is empty; name at least one (\"UCX\")".into(),
            ));
        }
        if let Some(b) = (1..self.backends.len())
            .find(|&i| self.backends[..i].contains(&self.backends[i]))
            .map(|i| &self.backends[i])
        {
            return Err(Error::InvalidArgument(format!(
                "NIXL backend {b:?} is named twice in the connector's backend list"
            )));
        }
        if !self.ucx_params.is_empty() && !self.backends.iter().any(|b| b == "UCX") {
            return Err(Error::InvalidArgument(
                "UCX parameters were given but UCX is not among the connector's NIXL backends".into(),
            ));
        }
        if self.progress_delay > MAX_PROGRESS_DELAY {
            return Err(Error::InvalidArgument(format!(
                "progress delay {:?} is above the {MAX_PROGRESS_DELAY:?} a connector takes",
                self.progress_delay
            )));
        }
        let wait_spin = self.checked_wait_spin()?;
        let worker_id = self
            .worker_id
            .unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string());
        if worker_id.is_empty() || worker_id.contains('\0') {
            return Err(Error::InvalidArgument(
                "worker_id must be a non-empty string without NUL".into(),
            ));
        }
        let engine = Engine::start(
            numbered(&worker_id),
            EngineOptions {
                backends: self.backends,
                ucx_params: self.ucx_params,
                progress_delay: self.progress_delay,
                path: self.path,
                cancel_grace: self.cancel_grace,
                deregister_on_completion: self.deregister_on_completion,
                quarantine_limit: self.quarantine_limit,
                socket_dir: self.socket_dir.or_else(settings::socket_dir),
                metrics: self.metrics,
                wait_spin,
            },
        )?;
        Ok(Connector::over(engine, worker_id, self.path))
    }

    /// The wait spin set, else [`WAIT_SPIN_ENV`]'s, else [`DEFAULT_WAIT_SPIN`]; refused above
    /// [`MAX_WAIT_SPIN`].
    fn checked_wait_spin(&self) -> Result<Duration> {
        let (spin, from) = match self.wait_spin {
            Some(s) => (s, "ConnectorBuilder::wait_spin"),
            None => match wait_spin_from_env(settings::wait_spin()?.as_deref())? {
                Some(s) => (s, WAIT_SPIN_ENV),
                None => (DEFAULT_WAIT_SPIN, "the default"),
            },
        };
        if spin > MAX_WAIT_SPIN {
            return Err(Error::InvalidArgument(format!(
                "a wait spin of {spin:?} ({from}) is above the {MAX_WAIT_SPIN:?} a connector takes"
            )));
        }
        Ok(spin)
    }

    /// A connector over the in-process loopback transport only (no NIXL, no same-host socket;
    /// feature `testing`): it pairs with the other loopback connectors of this process, so tests
    /// of code that uses connectors run without the NIXL library. See [`crate::testing`].
    ///
    /// The builder's worker id, cancel grace and wait spin apply; its NIXL and same-host settings
    /// do not.
    ///
    /// # Errors
    /// [`Error::Os`] when the engine's thread or poller cannot be made; [`Error::InvalidArgument`]
    /// for a wait spin as [`build`](Self::build) refuses it.
    #[cfg(any(test, feature = "testing"))]
    pub fn build_loopback(self) -> Result<Connector> {
        let wait_spin = self.checked_wait_spin()?;
        let worker_id = self.worker_id.unwrap_or_else(|| "loopback".into());
        let engine =
            Engine::start_loopback(numbered(&worker_id), self.cancel_grace, wait_spin, self.metrics)?;
        Ok(Connector::over(engine, worker_id, self.path))
    }
}

/// The engine's name: `worker_id` and this process's next connection number.
fn numbered(worker_id: &str) -> String {
    format!("{worker_id}-{}", CONNECTIONS.fetch_add(1, Ordering::Relaxed))
}

/// The wait spin [`WAIT_SPIN_ENV`]'s value says: none when unset or blank.
fn wait_spin_from_env(value: Option<&str>) -> Result<Option<Duration>> {
    let Some(v) = value.map(str::trim).filter(|v| !v.is_empty()) else {
        return Ok(None);
    };
    v.bytes()
        .all(|b| b.is_ascii_digit())
        .then(|| v.parse::<u64>().ok())
        .flatten()
        .map(|us| Some(Duration::from_micros(us)))
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "{WAIT_SPIN_ENV}={v:?} is not a number of microseconds (unset it, or set 0 to 10000)"
            ))
        })
}

impl Connector {
    fn over(engine: Engine, worker_id: String, path: PathPolicy) -> Self {
        let inner = Arc::new(Inner {
            engine,
            worker_id,
            path,
        });
        Connector { inner }
    }

    /// A connector with a fresh worker id and default UCX settings.
    ///
    /// # Errors
    /// As [`ConnectorBuilder::build`].
    pub fn new() -> Result<Self> {
        Self::builder().build()
    }

    /// A builder for options.
    pub fn builder() -> ConnectorBuilder {
        ConnectorBuilder::default()
    }

    /// The worker id.
    pub fn worker_id(&self) -> &str {
        &self.inner.worker_id
    }

    /// How long the wait of a small operation stays awake before it parks
    /// ([`ConnectorBuilder::wait_spin`]; zero: it parks at once).
    pub fn wait_spin(&self) -> Duration {
        self.inner.engine.wait_spin()
    }

    /// Which paths this connector's active operations may take.
    pub fn path_policy(&self) -> PathPolicy {
        self.inner.path
    }

    /// The NIXL agent name peers see (`<worker_id>-<n>`, or `<worker_id>-<n>-<pid>-<k>` when
    /// another connector on this host already has that name).
    pub fn name(&self) -> &str {
        self.inner.engine.name()
    }

    /// Exposes local memory for a peer to read.
    ///
    /// Registers the memory (once: registrations are cached while the memory lives) and returns
    /// an operation whose [`metadata`](ReadableOperation::metadata) the peer passes to
    /// [`begin_read`](Self::begin_read).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty list or mixed device kinds; [`Error::Nixl`] when
    /// NIXL refuses the registration.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future at any point ends the exposure (nobody has its metadata
    /// yet), as dropping the operation would.
    pub async fn create_readable<'a>(
        &self,
        local: impl Into<Descriptors<'a>>,
    ) -> Result<ReadableOperation<'a>> {
        ReadableOperation::create(&self.inner.engine, local.into().0).await
    }

    /// Exposes local memory for a peer to write.
    ///
    /// # Errors
    /// As [`create_readable`](Self::create_readable), and [`Error::InvalidArgument`] when a
    /// descriptor borrows read-only memory.
    ///
    /// # Cancel safety
    /// As [`create_readable`](Self::create_readable).
    pub async fn create_writable<'a>(
        &self,
        local: impl Into<Descriptors<'a>>,
    ) -> Result<WritableOperation<'a>> {
        WritableOperation::create(&self.inner.engine, local.into().0).await
    }

    /// Reads a peer's readable into `local` (one local descriptor per remote one, same sizes).
    ///
    /// Everything is checked before any transfer is posted. The peer's agent metadata is loaded
    /// once and reused while it does not change.
    ///
    /// # Errors
    /// [`Error::WrongPairing`] for a writable's metadata; [`Error::DescriptorMismatch`] when counts
    /// or sizes differ; [`Error::Metadata`] for metadata that is malformed or that NIXL rejects;
    /// [`Error::InvalidArgument`] for read-only local memory; [`Error::RemoteGone`] when the
    /// peer cannot be reached.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future at any point behaves as dropping the operation would
    /// (see [`ReadOperation`]'s Drop): the transfer is cancelled, owned memory is freed by the
    /// engine once nothing touches it, and borrowed memory is waited for before the borrow ends.
    /// The transfer may already have moved data by then.
    pub async fn begin_read<'a>(
        &self,
        remote: &RdmaMetadata,
        local: impl Into<Descriptors<'a>>,
    ) -> Result<ReadOperation<'a>> {
        ReadOperation::begin(&self.inner.engine, remote, local.into().0).await
    }

    /// Which path an operation with the peer that published `remote` (a read of its readable, a
    /// write into its writable) would take from this connector now, over memory of this process
    /// on `local`, and why each path before it declines (`nixl-connect doctor --peer`).
    ///
    /// Nothing is transferred and the peer's operation is not asked for (the same-host path hangs
    /// up before its handshake). The answer may change by the time an operation starts.
    ///
    /// # Errors
    /// [`Error::Metadata`] for metadata that is malformed or that no transport here can read;
    /// [`Error::EngineStopped`] if the engine thread is gone.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future drops the answer (a same-host probe's connection is hung
    /// up either way).
    pub async fn probe(&self, remote: &RdmaMetadata, local: Device) -> Result<PathProbe> {
        remote.validate()?;
        let write = remote.kind()? == OperationKind::Write;
        let device = remote.descriptors[0].device;
        let bytes = remote
            .descriptors
            .iter()
            .fold(0u64, |t, d| t.saturating_add(d.size));
        let peer = self.inner.engine.decode(&remote.nixl_metadata)?;
        let name = peer.name.to_string();
        let mut declined = Vec::new();
        if self.inner.path == PathPolicy::Nixl {
            declined.push((
                TransferPath::SameHost,
                "this connector's path policy is `nixl`: it takes NIXL only".to_string(),
            ));
        }
        let mut taken = None;
        for (path, answer) in self.inner.engine.probe(peer, write, local, device, bytes).await? {
            match answer {
                Ok(m) => taken = Some((path, m)),
                Err(why) => declined.push((path, why)),
            }
        }
        Ok(PathProbe::new(name, write, taken, declined))
    }

    /// Writes `local` into a peer's writable (one local descriptor per remote one, same sizes).
    ///
    /// # Errors
    /// [`Error::WrongPairing`] for a readable's metadata; otherwise as
    /// [`begin_read`](Self::begin_read).
    ///
    /// # Cancel safety
    /// As [`begin_read`](Self::begin_read).
    pub async fn begin_write<'a>(
        &self,
        local: impl Into<Descriptors<'a>>,
        remote: &RdmaMetadata,
    ) -> Result<WriteOperation<'a>> {
        WriteOperation::begin(&self.inner.engine, remote, local.into().0).await
    }

    /// Registers `local`'s memory with NIXL ahead of the active operations
    /// ([`begin_read`](Self::begin_read), [`begin_write`](Self::begin_write)) that will use it,
    /// as Dynamo's `Descriptor.register_with_connector`. An operation whose local memory lies
    /// inside a live registration (all of it, or its start: a pooled buffer used for a smaller
    /// transfer) skips registering it. Empty descriptors are skipped.
    ///
    /// Passive operations register exactly what they expose and do not use these registrations.
    ///
    /// # Errors
    /// [`Error::Nixl`] when NIXL refuses the registration, [`Error::EngineStopped`] if the engine
    /// thread is gone.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future drops the registration as soon as it is made.
    pub async fn register(&self, local: &[Descriptor<'_>]) -> Result<Registration> {
        let ranges: Vec<_> = local.iter().filter(|d| d.size() > 0).map(|d| d.range()).collect();
        let bytes = ranges.iter().map(|r| r.len).sum();
        if ranges.is_empty() {
            return Ok(Registration::new(Vec::new(), bytes));
        }
        let tokens = self
            .inner
            .engine
            .call(|reply| crate::engine::Cmd::Register { ranges, reply })
            .await??;
        Ok(Registration::new(tokens, bytes))
    }

    /// Drops this handle to the connector and bounds the end of its engine by `within`: when
    /// its last operation or clone is gone too, the engine stops, and same-host copies still
    /// running are waited for up to `within`, then their memory is leaked rather than freed under
    /// them. Dropping a connector waits up to 10 s (as `tokio::runtime::Runtime::shutdown_timeout`).
    ///
    /// Blocks for at most `within` when this was the last handle, at once otherwise. From async
    /// code, call it where blocking is allowed (`spawn_blocking`) or at the end of `main`.
    pub fn shutdown_timeout(self, within: Duration) {
        self.inner.engine.set_stop_wait(within);
    }

    /// The engine's counters (registrations, remote loads, transfers).
    ///
    /// # Errors
    /// [`Error::EngineStopped`] if the engine thread is gone.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn stats(&self) -> Result<EngineStats> {
        self.inner
            .engine
            .call(|reply| crate::engine::Cmd::Stats { reply })
            .await
    }

    /// This connector's engine, for the counters and steps of [`crate::testing`].
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn engine(&self) -> &Engine {
        &self.inner.engine
    }
}

impl std::fmt::Debug for Connector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connector")
            .field("worker_id", &self.inner.worker_id)
            .field("name", &self.name())
            .finish()
    }
}

#[cfg(test)]
mod tests;
