//! [`Connector`]: one NIXL agent, shared by every operation made through it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::descriptor::Descriptors;
use crate::engine::{BackendOptions, Engine, EngineStats};
use crate::error::{Error, Result};
use crate::metadata::RdmaMetadata;
use crate::operation::{ReadOperation, ReadableOperation, WritableOperation, WriteOperation};

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
}

/// Builds a [`Connector`] with options.
#[derive(Debug, Clone, Default)]
pub struct ConnectorBuilder {
    worker_id: Option<String>,
    backend: BackendOptions,
}

impl ConnectorBuilder {
    /// The worker id (Python's `worker_id`); default: a fresh UUID without dashes.
    pub fn worker_id(mut self, id: impl Into<String>) -> Self {
        self.worker_id = Some(id.into());
        self
    }

    /// Sets a UCX backend parameter (for example `ucx_error_handling_mode` = `none`, which moves
    /// notifications to shared memory at the cost of peer-failure detection).
    pub fn ucx_param(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.backend.params.push((key.into(), value.into()));
        self
    }

    /// Loads NIXL if needed, creates the agent and its UCX backend, and starts the engine thread.
    ///
    /// Blocks for the few milliseconds UCX takes to start.
    ///
    /// # Errors
    /// [`Error::NixlNotFound`] / [`Error::NixlLoad`] when NIXL is absent or broken (with the fix
    /// in the message), [`Error::NixlBackend`] when UCX cannot start, [`Error::InvalidArgument`]
    /// for an empty worker id.
    pub fn build(self) -> Result<Connector> {
        let worker_id = self
            .worker_id
            .unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string());
        if worker_id.is_empty() || worker_id.contains('\0') {
            return Err(Error::InvalidArgument(
                "worker_id must be a non-empty string without NUL".into(),
            ));
        }
        let name = format!("{worker_id}-{}", CONNECTIONS.fetch_add(1, Ordering::Relaxed));
        let engine = Engine::start(name, self.backend)?;
        Ok(Connector {
            inner: Arc::new(Inner { engine, worker_id }),
        })
    }
}

impl Connector {
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

    /// The NIXL agent name peers see (`<worker_id>-<n>`).
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
    /// Not cancel safe: if the future is dropped after the engine has registered the memory, the
    /// registration is released but the notification key stays watched until the connector ends.
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
    /// Not cancel safe: dropping the future after the transfer was posted leaves it running with
    /// no handle (the memory is kept alive by the engine until NIXL lets go).
    pub async fn begin_read<'a>(
        &self,
        remote: &RdmaMetadata,
        local: impl Into<Descriptors<'a>>,
    ) -> Result<ReadOperation<'a>> {
        ReadOperation::begin(&self.inner.engine, remote, local.into().0).await
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

    /// The engine's counters (registrations, remote loads, transfers).
    ///
    /// # Errors
    /// [`Error::EngineStopped`] if the engine thread is gone.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn stats(&self) -> Result<EngineStats> {
        self.inner.engine.stats().await
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
