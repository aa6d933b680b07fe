//! `nixl_connect._core`: the Rust core of the Python package `nixl_connect`.
//!
//! The package (`python/nixl_connect/`) gives Python the classes of Dynamo's
//! `dynamo.nixl_connect`; this module is what they call: a `Connector` whose four coroutines
//! return `Passive` (readable / writable) and `Active` (read / write) operations, and one
//! exception type, `CoreError(kind, message)`, carrying the Rust error's variant name.
//!
//! Memory comes from Python as `(ptr, size, device, keepalive)` tuples; the keepalive object (the
//! tensor, array or bytes the pointer belongs to) is held by the Rust operation, and after it by
//! the engine, for as long as any transfer may touch the memory, even if Python code drops every
//! reference to it.
//!
//! # How coroutines complete
//!
//! The Rust futures are polled on their asyncio loop's own thread, with the GIL held (a poll never
//! blocks): twice when the coroutine is called, before an asyncio future is made (a future that
//! is ready by then, like waiting for a finished transfer or an exposure a hot engine answered
//! meanwhile, costs no trip through the loop; the Python layer then takes the outcome itself, with
//! no future at all), then whenever it is woken. A waker, called
//! by the engine thread or a timer without the GIL, queues the task on its loop's `Completions`
//! and writes one byte to a socket the loop watches (`loop.add_reader`). So no thread of ours ever
//! takes the GIL (a thread that does while Python finalizes crashes the process), and a completion
//! costs one wake-up of the loop. Timers run on a one-thread tokio runtime of this module's own.
//! Cancelling the awaiting Python task drops the Rust future (each operation is cancel safe).
use std::cell::RefCell;
use std::collections::VecDeque;
use std::future::Future;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use nixl_connect::{
    Descriptor, Device, Error, ErrorKind, RdmaMetadata, ReadOperation, ReadableOperation,
    SerializedDescriptor, TransferPath, WritableOperation, WriteOperation,
};
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyList, PyString, PyWeakrefMethods, PyWeakrefReference};

create_exception!(
    _core,
    CoreError,
    PyException,
    "An error of the Rust core: args are (kind, message, class), kind the Rust error's kind, \
     class the name of the `nixl_connect` exception class to raise for it."
);

/// The `nixl_connect` exception class (in `_errors.py`) raised for each kind of core error: the
/// choice is made here, beside the kinds; `test_core_chooses_the_class_of_every_kind`
/// (tests/python/test_extras.py) fails when a kind has none or names another kind's class.
fn class_of(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::InvalidArgument => "InvalidArgumentError",
        ErrorKind::WrongPairing => "WrongPairingError",
        ErrorKind::DeviceMismatch => "DeviceMismatchError",
        ErrorKind::DescriptorMismatch => "DescriptorMismatchError",
        ErrorKind::Metadata => "MetadataError",
        ErrorKind::Refused => "RefusedError",
        ErrorKind::NixlNotFound => "NixlNotFoundError",
        ErrorKind::NixlLoad => "NixlLoadError",
        ErrorKind::CudaUnavailable => "CudaUnavailableError",
        ErrorKind::NixlBackend => "NixlBackendError",
        ErrorKind::Os => "OsError",
        ErrorKind::Nixl => "NixlError",
        ErrorKind::RemoteGone => "RemoteGoneError",
        ErrorKind::Transfer => "TransferError",
        ErrorKind::Interrupted => "TransferInterruptedError",
        ErrorKind::PathUnavailable => "PathUnavailableError",
        ErrorKind::EngineStopped => "EngineStoppedError",
        ErrorKind::Cancelled => "CancelledError",
        ErrorKind::TimedOut => "TimeoutError",
        ErrorKind::Channel => "ChannelError",
        ErrorKind::NotPublished => "NotPublishedError",
        _ => UNKNOWN_CLASS,
    }
}

/// The class for a kind this module does not know yet (a newer core).
const UNKNOWN_CLASS: &str = "NixlConnectError";

/// The error of an object used in a process forked after it was made: a kind of this module's
/// own, since the core has no such error.
const FORKED: (&str, &str) = ("Forked", "ForkedError");

fn err(e: Error) -> PyErr {
    let kind = e.kind();
    CoreError::new_err((kind.as_str(), e.report().to_string(), class_of(kind)))
}

fn invalid(msg: String) -> PyErr {
    let kind = ErrorKind::InvalidArgument;
    CoreError::new_err((kind.as_str(), msg, class_of(kind)))
}

/// Every kind of core error, with the class raised for it: `(kind, class)` pairs, the forked
/// object's error included (for the Python layer's own checks).
#[pyfunction]
fn error_classes() -> Vec<(&'static str, &'static str)> {
    ErrorKind::ALL
        .iter()
        .map(|k| (k.as_str(), class_of(*k)))
        .chain([FORKED])
        .collect()
}

/// One descriptor from Python: `(ptr, size, device, keepalive)`; a device string ending in
/// `!ro` marks read-only memory (bytes), which may only be a source; `@<stream>` after it names
/// the CUDA stream an operation over the memory waits for.
type PyDesc = (u64, u64, String, Py<PyAny>);

fn descriptors(descs: Vec<PyDesc>) -> PyResult<Vec<Descriptor<'static>>> {
    if descs.is_empty() {
        return Err(invalid("the descriptor list is empty".into()));
    }
    descs
        .into_iter()
        .map(|(ptr, size, device, keep)| {
            // `@<stream>`: the CUDA stream whose queued work an operation waits for (stream order).
            let (device, stream) = match device.split_once('@') {
                Some((d, s)) => {
                    let s: u64 = s
                        .parse()
                        .map_err(|_| invalid(format!("bad stream handle {s:?}")))?;
                    (d, Some(s))
                }
                None => (device.as_str(), None),
            };
            let (dev, writable) = match device.strip_suffix("!ro") {
                Some(d) => (d, false),
                None => (device, true),
            };
            let dev: Device = dev
                .parse()
                .map_err(|e: nixl_connect::ParseDeviceError| err(e.into()))?;
            let len = usize::try_from(size).map_err(|_| invalid(format!("size {size} is too large")))?;
            if ptr == 0 {
                return Err(invalid("a descriptor has a null pointer".into()));
            }
            // SAFETY: the pointer and size come from the Python object `keep` (a tensor's
            // data_ptr(), a buffer's address), which the descriptor keeps alive for as long as a
            // transfer may touch the memory; read-only objects are marked so and never written.
            #[allow(unsafe_code)]
            let d =
                unsafe { Descriptor::from_raw_parts_with_owner(ptr as *mut u8, len, dev, writable, keep) };
            Ok(match stream {
                // SAFETY: the stream is the tensor's current stream (or its CUDA array interface's),
                // which its runtime keeps alive while the tensor is in use.
                #[allow(unsafe_code)]
                Some(s) => unsafe { d.ordered_after(s) },
                None => d,
            })
        })
        .collect()
}

/// A wait's limit from Python's seconds: `None` (and a finite number of seconds past what a
/// `Duration` holds, like Python's `inf`) waits without one.
fn timeout(t: Option<f64>) -> PyResult<Option<Duration>> {
    match t {
        None => Ok(None),
        Some(s) if s.is_finite() && s >= 0.0 => Ok(Duration::try_from_secs_f64(s).ok()),
        Some(s) => Err(invalid(format!("timeout {s} is not a number of seconds >= 0"))),
    }
}

/// Which process image this is: 0 in the process that loaded the module, one more in each child
/// of `fork()` (a `pthread_atfork` handler counts them). Reading it is a load, where asking the
/// kernel for the pid is a system call (about 0.2 us here, and an operation asked ~19 times).
static FORKS: AtomicU64 = AtomicU64::new(0);

extern "C" fn forked() {
    FORKS.fetch_add(1, Ordering::Relaxed);
}

/// Counts the children of `fork()` from now on (once; at module load).
fn watch_forks() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: registers a child handler that only increments an atomic counter
        // (async-signal-safe); the handler is a plain `extern "C"` function of this library,
        // which Python never unloads.
        #[allow(unsafe_code)]
        unsafe {
            libc::pthread_atfork(None, None, Some(forked));
        }
    });
}

/// Rust state tied to the process that made it. After `fork()` the child has none of the parent's
/// threads (the engine, the timers), so it must neither use such state (it would wait forever) nor
/// drop it (dropping may wait for those threads): it gets `Forked` errors, and the state is leaked.
struct Owned<T> {
    /// [`FORKS`] when it was made.
    image: u64,
    inner: Option<T>,
}

impl<T> Owned<T> {
    fn new(t: T) -> Self {
        Self {
            image: FORKS.load(Ordering::Relaxed),
            inner: Some(t),
        }
    }

    fn here(&self) -> bool {
        FORKS.load(Ordering::Relaxed) == self.image
    }

    fn get(&self) -> PyResult<&T> {
        match &self.inner {
            Some(t) if self.here() => Ok(t),
            _ => Err(CoreError::new_err((
                FORKED.0,
                "this object was created in a parent of this process before it forked; objects \
                 of the parent cannot be used in a child: create a new Connector (and operations) \
                 in this process"
                    .to_string(),
                FORKED.1,
            ))),
        }
    }
}

impl<T> Drop for Owned<T> {
    fn drop(&mut self) {
        if !self.here() {
            std::mem::forget(self.inner.take());
        }
    }
}

/// One NIXL agent (and same-host endpoint), as `dynamo.nixl_connect.Connector`'s connection.
#[pyclass(frozen, module = "nixl_connect._core")]
struct Connector {
    inner: Owned<nixl_connect::Connector>,
}

/// Memory registered ahead of active operations (`Connector.register`); dropping it deregisters.
#[pyclass(frozen, module = "nixl_connect._core")]
struct Registration {
    _reg: Owned<nixl_connect::Registration>,
}

#[pymethods]
impl Connector {
    /// Creates the connector (blocks for the tens of milliseconds UCX takes, without the GIL).
    #[new]
    fn new(py: Python<'_>, worker_id: String) -> PyResult<Self> {
        let inner = py
            .detach(|| {
                let builder = nixl_connect::Connector::builder()
                    .worker_id(worker_id)
                    .metrics(&metrics().1);
                // Waits here spin only when asked (`NIXL_CONNECT_WAIT_SPIN_US`): a spin's turns
                // are turns of the asyncio loop, and small same-host waits already wait at the
                // call (`LOCAL_WAIT`), which a spin would cut short.
                let set = std::env::var_os(nixl_connect::WAIT_SPIN_ENV)
                    .is_some_and(|v| !v.to_string_lossy().trim().is_empty());
                let builder = if set {
                    builder
                } else {
                    builder.wait_spin(Duration::ZERO)
                };
                builder.build()
            })
            .map_err(err)?;
        Ok(Self {
            inner: Owned::new(inner),
        })
    }

    /// How long the wait of a small operation stays awake before it parks, in microseconds
    /// (0 unless `NIXL_CONNECT_WAIT_SPIN_US` says otherwise).
    #[getter]
    fn wait_spin_us(&self) -> PyResult<u64> {
        Ok(self.inner.get()?.wait_spin().as_micros() as u64)
    }

    /// The NIXL agent name peers see.
    #[getter]
    fn name(&self) -> PyResult<String> {
        Ok(self.inner.get()?.name().to_string())
    }

    /// Registers memory with the agent that posts this connector's transfers, ahead of the
    /// reads and writes that will use it (Dynamo's `Descriptor.register_with_connector`). Blocks,
    /// without the GIL, for the engine's reply (tens of milliseconds the first time, when the
    /// initiating NIXL agent is created).
    fn register(&self, py: Python<'_>, descs: Vec<PyDesc>) -> PyResult<Registration> {
        let descs = descriptors(descs)?;
        let conn = self.inner.get()?.clone();
        let rt = runtime()?;
        let reg = py.detach(|| rt.block_on(conn.register(&descs))).map_err(err)?;
        drop(descs);
        Ok(Registration {
            _reg: Owned::new(reg),
        })
    }

    /// The engine's counters as a dict (`registrations`, `live_registrations`, `transfers`,
    /// `local_transfers`, `remote_loads`); for tests and diagnostics.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
        let conn = self.inner.get()?.clone();
        let rt = runtime()?;
        let s = py.detach(|| rt.block_on(conn.stats())).map_err(err)?;
        let d = pyo3::types::PyDict::new(py);
        d.set_item("registrations", s.registrations)?;
        d.set_item("live_registrations", s.live_registrations)?;
        d.set_item("transfers", s.transfers)?;
        d.set_item("local_transfers", s.local_transfers)?;
        d.set_item("remote_loads", s.remote_loads)?;
        Ok(d)
    }

    /// Exposes `descs` for a peer to read: an awaitable of a `Passive` (see [`Now`] for `now`).
    #[pyo3(signature = (descs, now=false))]
    fn create_readable<'py>(
        &self,
        py: Python<'py>,
        descs: Vec<PyDesc>,
        now: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let descs = descriptors(descs)?;
        let conn = self.inner.get()?.clone();
        spawn_local(
            py,
            async move {
                let op = conn.create_readable(descs).await?;
                Ok(Outcome::Passive(Passive::new(PassiveOp::Readable(op))))
            },
            Now(now),
        )
    }

    /// Exposes `descs` for a peer to write: an awaitable of a `Passive` (see [`Now`] for `now`).
    #[pyo3(signature = (descs, now=false))]
    fn create_writable<'py>(
        &self,
        py: Python<'py>,
        descs: Vec<PyDesc>,
        now: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let descs = descriptors(descs)?;
        let conn = self.inner.get()?.clone();
        spawn_local(
            py,
            async move {
                let op = conn.create_writable(descs).await?;
                Ok(Outcome::Passive(Passive::new(PassiveOp::Writable(op))))
            },
            Now(now),
        )
    }

    /// Reads the peer's memory that `metadata` (its JSON, or the Python layer's `RdmaMetadata`:
    /// see [`peer_metadata`]) describes into `descs`: an awaitable of an `Active` (see [`Now`]).
    #[pyo3(signature = (metadata, descs, now=false))]
    fn begin_read<'py>(
        &self,
        py: Python<'py>,
        metadata: &Bound<'py, PyAny>,
        descs: Vec<PyDesc>,
        now: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let md = peer_metadata(metadata)?;
        let descs = descriptors(descs)?;
        let quick = is_quick(&descs);
        let conn = self.inner.get()?.clone();
        spawn(
            py,
            async move {
                let op = conn.begin_read(&md, descs).await?;
                Ok(Outcome::Active(Active::new(ActiveOp::Read(op), quick)))
            },
            Now(now),
        )
    }

    /// Writes `descs` into the peer's memory that `metadata` describes (as in `begin_read`).
    #[pyo3(signature = (descs, metadata, now=false))]
    fn begin_write<'py>(
        &self,
        py: Python<'py>,
        descs: Vec<PyDesc>,
        metadata: &Bound<'py, PyAny>,
        now: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let md = peer_metadata(metadata)?;
        let descs = descriptors(descs)?;
        let quick = is_quick(&descs);
        let conn = self.inner.get()?.clone();
        spawn(
            py,
            async move {
                let op = conn.begin_write(descs, &md).await?;
                Ok(Outcome::Active(Active::new(ActiveOp::Write(op), quick)))
            },
            Now(now),
        )
    }
}

/// A peer's metadata as the Python layer hands it: its JSON text, or its pydantic `RdmaMetadata`,
/// whose fields are read here one by one (sparing a `model_dump_json()` and a parse per
/// operation). A model whose fields do not read as the core's types, or break a rule, takes the
/// JSON path after all, so that every refusal is the one its JSON would get (the same kind,
/// field and message).
fn peer_metadata(metadata: &Bound<'_, PyAny>) -> PyResult<RdmaMetadata> {
    if let Ok(text) = metadata.cast::<PyString>() {
        return text.to_cow()?.parse().map_err(err);
    }
    if let Some(md) = metadata_fields(metadata).filter(|md| md.validate().is_ok()) {
        return Ok(md);
    }
    let json: String = metadata
        .call_method0(intern!(metadata.py(), "model_dump_json"))?
        .extract()?;
    json.parse().map_err(err)
}

/// The model's fields as the core's types, or `None` at the first that does not read as one.
fn metadata_fields(md: &Bound<'_, PyAny>) -> Option<RdmaMetadata> {
    let py = md.py();
    let list = md.getattr(intern!(py, "descriptors")).ok()?;
    let list = list.cast::<PyList>().ok()?;
    let mut descriptors = Vec::with_capacity(list.len());
    for d in list.iter() {
        let device = d.getattr(intern!(py, "device")).ok()?;
        let device: Device = device.cast::<PyString>().ok()?.to_cow().ok()?.parse().ok()?;
        let ptr: u64 = d.getattr(intern!(py, "ptr")).ok()?.extract().ok()?;
        let size: u64 = d.getattr(intern!(py, "size")).ok()?.extract().ok()?;
        if ptr == 0 {
            return None;
        }
        descriptors.push(SerializedDescriptor { device, ptr, size });
    }
    Some(RdmaMetadata {
        descriptors,
        nixl_metadata: md.getattr(intern!(py, "nixl_metadata")).ok()?.extract().ok()?,
        notification_key: md.getattr(intern!(py, "notification_key")).ok()?.extract().ok()?,
        operation_kind: md.getattr(intern!(py, "operation_kind")).ok()?.extract().ok()?,
    })
}

enum PassiveOp {
    Readable(ReadableOperation<'static>),
    Writable(WritableOperation<'static>),
}

impl PassiveOp {
    fn status(&self) -> u8 {
        match self {
            PassiveOp::Readable(o) => o.status() as u8,
            PassiveOp::Writable(o) => o.status() as u8,
        }
    }

    fn cancel(&self) {
        match self {
            PassiveOp::Readable(o) => o.cancel(),
            PassiveOp::Writable(o) => o.cancel(),
        }
    }

    async fn wait(&self, t: Option<Duration>) -> nixl_connect::Result<()> {
        match self {
            PassiveOp::Readable(o) => o.wait_for_completion(t).await,
            PassiveOp::Writable(o) => o.wait_for_completion(t).await,
        }
    }

    fn metadata(&self) -> &RdmaMetadata {
        match self {
            PassiveOp::Readable(o) => o.metadata(),
            PassiveOp::Writable(o) => o.metadata(),
        }
    }
}

/// A readable or writable: memory exposed to a peer.
#[pyclass(frozen, module = "nixl_connect._core")]
struct Passive {
    op: Owned<Mutex<Option<Arc<PassiveOp>>>>,
    metadata_json: String,
    key: String,
    /// The status when released (the operation itself is gone then).
    last: Mutex<u8>,
}

impl Passive {
    fn new(op: PassiveOp) -> Self {
        let md = op.metadata();
        Self {
            metadata_json: md.to_json(),
            key: md.notification_key.clone(),
            last: Mutex::new(op.status()),
            op: Owned::new(Mutex::new(Some(Arc::new(op)))),
        }
    }

    fn get(&self) -> PyResult<Option<Arc<PassiveOp>>> {
        Ok(lock(self.op.get()?).clone())
    }
}

#[pymethods]
impl Passive {
    /// The RdmaMetadata JSON to hand to the peer.
    fn metadata_json(&self) -> String {
        self.metadata_json.clone()
    }

    #[getter]
    fn notification_key(&self) -> String {
        self.key.clone()
    }

    fn status(&self) -> PyResult<u8> {
        Ok(match self.get()? {
            Some(op) => op.status(),
            None => *self.last.lock().unwrap_or_else(|p| p.into_inner()),
        })
    }

    /// Waits for the peer (`timeout` in seconds, None: no limit); cancel safe. See [`Now`] for
    /// `now`.
    #[pyo3(signature = (timeout=None, now=false))]
    fn wait<'py>(&self, py: Python<'py>, timeout: Option<f64>, now: bool) -> PyResult<Bound<'py, PyAny>> {
        let t = self::timeout(timeout)?;
        let op = self.get()?;
        spawn(
            py,
            async move {
                match op {
                    Some(op) => op.wait(t).await.map(|()| Outcome::Done),
                    None => Err(Error::Cancelled),
                }
            },
            Now(now),
        )
    }

    fn cancel(&self) -> PyResult<()> {
        if let Some(op) = self.get()? {
            op.cancel();
        }
        Ok(())
    }

    /// Ends the operation (idempotent): the memory is no longer exposed.
    fn release(&self, py: Python<'_>) -> PyResult<()> {
        let op = lock(self.op.get()?).take();
        if let Some(op) = op {
            op.cancel();
            *self.last.lock().unwrap_or_else(|p| p.into_inner()) = op.status();
            // Dropping may wait for this process's own same-host copy into the memory to stop.
            py.detach(move || drop(op));
        }
        Ok(())
    }
}

enum ActiveOp {
    Read(ReadOperation<'static>),
    Write(WriteOperation<'static>),
}

impl ActiveOp {
    fn status(&self) -> u8 {
        match self {
            ActiveOp::Read(o) => o.status() as u8,
            ActiveOp::Write(o) => o.status() as u8,
        }
    }

    fn path_taken(&self) -> Option<TransferPath> {
        match self {
            ActiveOp::Read(o) => o.path(),
            ActiveOp::Write(o) => o.path(),
        }
    }

    fn path(&self) -> Option<String> {
        self.path_taken().map(|p| p.to_string())
    }

    fn mechanism(&self) -> Option<String> {
        match self {
            ActiveOp::Read(o) => o.mechanism(),
            ActiveOp::Write(o) => o.mechanism(),
        }
        .map(|m| m.to_string())
    }

    fn cancel(&self) {
        match self {
            ActiveOp::Read(o) => o.cancel(),
            ActiveOp::Write(o) => o.cancel(),
        }
    }

    async fn wait(&self, t: Option<Duration>) -> nixl_connect::Result<()> {
        match self {
            ActiveOp::Read(o) => o.wait_for_completion(t).await,
            ActiveOp::Write(o) => o.wait_for_completion(t).await,
        }
    }
}

/// The most bytes an active operation over local host memory moves for its wait to count as quick
/// (see [`Active::wait`]): on the same-host path such an operation takes one round trip between
/// two engines (8 KiB or less travel in the frames; up to this, one `process_vm_readv`).
const QUICK_BYTES: usize = 64 << 10;

/// Whether an active operation over `descs` (its local memory) is small and over host memory
/// only. Remote device memory takes NIXL, which ends the wait at the call as soon as it is known.
fn is_quick(descs: &[Descriptor<'_>]) -> bool {
    descs.iter().all(|d| d.device() == Device::Host)
        && descs.iter().map(Descriptor::size).sum::<usize>() <= QUICK_BYTES
}

/// A read or a write: moving data to or from a peer's passive operation.
#[pyclass(frozen, module = "nixl_connect._core")]
struct Active {
    op: Owned<Mutex<Option<Arc<ActiveOp>>>>,
    last: Mutex<(u8, Option<String>, Option<String>)>,
    /// Small and over host memory: a wait may wait briefly at the call (see [`Active::wait`]).
    quick: bool,
}

impl Active {
    fn new(op: ActiveOp, quick: bool) -> Self {
        Self {
            last: Mutex::new((op.status(), None, None)),
            op: Owned::new(Mutex::new(Some(Arc::new(op)))),
            quick,
        }
    }

    fn get(&self) -> PyResult<Option<Arc<ActiveOp>>> {
        Ok(lock(self.op.get()?).clone())
    }
}

#[pymethods]
impl Active {
    fn status(&self) -> PyResult<u8> {
        Ok(match self.get()? {
            Some(op) => op.status(),
            None => self.last.lock().unwrap_or_else(|p| p.into_inner()).0,
        })
    }

    /// `"local"` or `"nixl"` once a transport has taken the operation.
    fn path(&self) -> PyResult<Option<String>> {
        Ok(match self.get()? {
            Some(op) => op.path(),
            None => self.last.lock().unwrap_or_else(|p| p.into_inner()).1.clone(),
        })
    }

    /// How the same-host path moved the bytes (`"frames"`, `"cma"`, `"pipes"`, `"cuda-ipc"`,
    /// `"cuda-vmm"`, `"pinned-staging"`), once it decided; `None` on NIXL (an extension:
    /// Dynamo's module has no such property).
    fn mechanism(&self) -> PyResult<Option<String>> {
        Ok(match self.get()? {
            Some(op) => op.mechanism(),
            None => self.last.lock().unwrap_or_else(|p| p.into_inner()).2.clone(),
        })
    }

    /// Waits for the transfer (`timeout` in seconds, None: no limit); cancel safe.
    ///
    /// A small operation over host memory that has not taken the NIXL path ([`QUICK_BYTES`]: one
    /// round trip on the same-host path) is waited for at the call for up to [`LOCAL_WAIT`] (or
    /// `timeout`, if shorter), the GIL held, for as long as it does not turn out to take NIXL.
    /// See [`Now`] for `now`.
    #[pyo3(signature = (timeout=None, now=false))]
    fn wait<'py>(&self, py: Python<'py>, timeout: Option<f64>, now: bool) -> PyResult<Bound<'py, PyAny>> {
        let t = self::timeout(timeout)?;
        let op = self.get()?;
        let watched = op.clone().filter(|_| self.quick);
        let work = async move {
            match op {
                Some(op) => op.wait(t).await.map(|()| Outcome::Done),
                None => Err(Error::Cancelled),
            }
        };
        match watched {
            Some(op) => {
                let limit = t.map_or(LOCAL_WAIT, |t| t.min(LOCAL_WAIT));
                let quick = move || op.path_taken() != Some(TransferPath::Nixl);
                spawn_within(py, work, Some((limit, &quick)), Now(now))
            }
            None => spawn(py, work, Now(now)),
        }
    }

    fn cancel(&self) -> PyResult<()> {
        if let Some(op) = self.get()? {
            op.cancel();
        }
        Ok(())
    }

    /// Ends the operation (idempotent; never blocks long: the memory belongs to Python objects
    /// the engine keeps alive until no transfer touches it).
    fn release(&self, py: Python<'_>) -> PyResult<()> {
        let op = lock(self.op.get()?).take();
        if let Some(op) = op {
            *self.last.lock().unwrap_or_else(|p| p.into_inner()) = (op.status(), op.path(), op.mechanism());
            py.detach(move || drop(op));
        }
        Ok(())
    }
}

// --------------------------------------------------------------------------- completions

/// What a finished Rust future hands its asyncio future.
enum Outcome {
    Done,
    Passive(Passive),
    Active(Active),
    Failed(Error),
}

type Work = Pin<Box<dyn Future<Output = Result<Outcome, Error>> + Send>>;

/// The runtime whose driver serves the futures' timers (and any task they spawn); the futures
/// themselves are polled on their event loop's thread.
///
/// One per process: a child of `fork()` has none of its parent's threads, so it starts its own
/// (the parent's is leaked there, never dropped).
fn runtime() -> PyResult<&'static tokio::runtime::Runtime> {
    static RT: Mutex<Option<(u64, &'static tokio::runtime::Runtime)>> = Mutex::new(None);
    let image = FORKS.load(Ordering::Relaxed);
    let mut slot = lock(&RT);
    if let Some((p, rt)) = *slot {
        if p == image {
            return Ok(rt);
        }
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("nixl-connect-py")
        .enable_all()
        .build()
        .map_err(|e| CoreError::new_err(("Io", format!("cannot start the tokio runtime: {e}"))))?;
    let rt: &'static tokio::runtime::Runtime = Box::leak(Box::new(rt));
    *slot = Some((image, rt));
    Ok(rt)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// One Rust future and the asyncio future it resolves.
struct Task {
    work: Mutex<Option<Work>>,
    /// Touched only on the loop's thread with the GIL held (moved, never cloned, elsewhere).
    target: Mutex<Option<Py<PyAny>>>,
    queued: AtomicBool,
    queue: Arc<Queue>,
}

impl Wake for Task {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    /// Called from any thread (the engine's, a timer's), never with the GIL: queues the task for
    /// its loop's thread.
    fn wake_by_ref(self: &Arc<Self>) {
        if !self.queued.swap(true, Ordering::AcqRel) {
            self.queue.push(self.clone());
        }
    }
}

impl Task {
    /// Whether the task is woken within `limit`, while `keep` holds (both checked between yields
    /// of this thread's core, so an engine thread that shares it runs; on a busy host one yield
    /// may take a time slice).
    fn woken_within(&self, limit: Duration, keep: &dyn Fn() -> bool) -> bool {
        let until = Instant::now() + limit;
        loop {
            if self.queued.load(Ordering::Acquire) {
                return true;
            }
            if Instant::now() >= until || !keep() {
                return false;
            }
            std::thread::yield_now();
        }
    }

    /// Polls the future once with this task as its waker (on the loop's thread, GIL held; polls
    /// never block): its result once it is ready (the future is then dropped), else `None`. It
    /// leaves `queued` as it is: a task woken meanwhile is in the queue already, and queueing it
    /// twice would poll it twice a turn.
    fn poll_here(self: &Arc<Self>, rt: &tokio::runtime::Runtime) -> Option<Result<Outcome, Error>> {
        let mut slot = lock(&self.work);
        let work = slot.as_mut()?;
        let waker = Waker::from(self.clone());
        let poll = {
            let _timers = rt.enter();
            work.as_mut().poll(&mut Context::from_waker(&waker))
        };
        match poll {
            Poll::Ready(result) => {
                *slot = None;
                Some(result)
            }
            Poll::Pending => None,
        }
    }

    /// The loop's poll of a task it took from its queue (so a wake-up from now on queues it
    /// again): resolves the asyncio future once the work is ready.
    fn run(self: &Arc<Self>, py: Python<'_>, rt: &tokio::runtime::Runtime) {
        self.queued.store(false, Ordering::Release);
        if let Some(result) = self.poll_here(rt) {
            if let Some(target) = lock(&self.target).take() {
                resolve(target.bind(py), result.unwrap_or_else(Outcome::Failed));
            }
        }
    }
}

/// Tasks woken since the loop last drained them, and the socket that wakes the loop.
struct Queue {
    ready: Mutex<VecDeque<Arc<Task>>>,
    signal: UnixStream,
}

impl Queue {
    fn push(&self, task: Arc<Task>) {
        let mut ready = lock(&self.ready);
        let was_empty = ready.is_empty();
        ready.push_back(task);
        drop(ready);
        if was_empty {
            // One byte per batch: the loop empties the socket before it takes the queue, so a task
            // queued after that finds the queue empty and writes again. WouldBlock means unread
            // bytes are there already; any other error leaves the task queued for the next wake.
            let _ = (&self.signal).write(&[1]);
        }
    }
}

/// One asyncio loop's executor (internal; created on the loop's first coroutine).
#[pyclass(frozen, module = "nixl_connect._core")]
struct Completions {
    queue: Arc<Queue>,
    wake: UnixStream,
}

#[pymethods]
impl Completions {
    /// The socket the loop watches.
    fn fileno(&self) -> i32 {
        self.wake.as_raw_fd()
    }

    /// Polls every woken task (the loop's reader callback).
    fn drain(&self, py: Python<'_>) -> PyResult<()> {
        let mut buf = [0u8; 256];
        loop {
            match (&self.wake).read(&mut buf) {
                Ok(n) if n == buf.len() => continue,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                _ => break,
            }
        }
        let rt = runtime()?;
        let ready = std::mem::take(&mut *lock(&self.queue.ready));
        for task in ready {
            task.run(py, rt);
        }
        Ok(())
    }
}

/// Sets an asyncio future's result or exception (skipped if it was cancelled meanwhile: the
/// outcome, an operation for instance, is then dropped, which releases it).
fn resolve(future: &Bound<'_, PyAny>, outcome: Outcome) {
    let py = future.py();
    if future
        .call_method0("done")
        .and_then(|d| d.is_truthy())
        .unwrap_or(true)
    {
        return;
    }
    let set = match outcome {
        Outcome::Done => future.call_method1("set_result", (py.None(),)),
        Outcome::Passive(p) => Bound::new(py, p).and_then(|p| future.call_method1("set_result", (p,))),
        Outcome::Active(a) => Bound::new(py, a).and_then(|a| future.call_method1("set_result", (a,))),
        Outcome::Failed(e) => future.call_method1("set_exception", (err(e).into_value(py),)),
    };
    if let Err(e) = set {
        e.write_unraisable(py, Some(future));
    }
}

/// Drops the Rust future when its asyncio future is done (a no-op unless it was cancelled:
/// a resolved task has dropped its future already).
#[pyclass(frozen, module = "nixl_connect._core")]
struct Abort(Arc<Task>);

#[pymethods]
impl Abort {
    fn __call__(&self, _future: &Bound<'_, PyAny>) {
        let work = lock(&self.0.work).take();
        drop(work);
        drop(lock(&self.0.target).take());
    }
}

thread_local! {
    /// This thread's last event loop (weakly: a closed loop is not kept alive) and its
    /// `Completions`. A thread runs one loop at a time, so this answers nearly every lookup with a
    /// comparison, where the loops' `WeakKeyDictionary` makes a weak reference per call.
    static LAST_LOOP: RefCell<Option<(Py<PyWeakrefReference>, Py<Completions>)>> = const { RefCell::new(None) };
}

/// The running loop's `Completions`, created and registered with the loop the first time.
fn completions<'py>(py: Python<'py>, event_loop: &Bound<'py, PyAny>) -> PyResult<Bound<'py, Completions>> {
    let last = LAST_LOOP.with(|last| {
        let last = last.borrow();
        let (weak, c) = last.as_ref()?;
        let target = weak.bind(py).upgrade()?;
        target.is(event_loop).then(|| c.bind(py).clone())
    });
    if let Some(c) = last {
        return Ok(c);
    }
    let c = completions_of(py, event_loop)?;
    let weak = PyWeakrefReference::new(event_loop)?.unbind();
    LAST_LOOP.with(|last| *last.borrow_mut() = Some((weak, c.clone().unbind())));
    Ok(c)
}

/// [`completions`] found in (or added to) the table of every loop's.
fn completions_of<'py>(py: Python<'py>, event_loop: &Bound<'py, PyAny>) -> PyResult<Bound<'py, Completions>> {
    static LOOPS: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    let loops = LOOPS
        .get_or_try_init(py, || {
            Ok::<_, PyErr>(
                py.import("weakref")?
                    .getattr("WeakKeyDictionary")?
                    .call0()?
                    .unbind(),
            )
        })?
        .bind(py);
    if let Ok(c) = loops
        .call_method1("get", (event_loop,))?
        .cast_into::<Completions>()
    {
        return Ok(c);
    }
    let (wake, signal) = UnixStream::pair()
        .and_then(|(a, b)| {
            a.set_nonblocking(true)?;
            b.set_nonblocking(true)?;
            Ok((a, b))
        })
        .map_err(|e| CoreError::new_err(("Io", format!("cannot create the completion socket: {e}"))))?;
    let queue = Arc::new(Queue {
        ready: Mutex::new(VecDeque::new()),
        signal,
    });
    let c = Bound::new(py, Completions { queue, wake })?;
    event_loop.call_method1("add_reader", (c.get().fileno(), c.getattr("drain")?))?;
    loops.set_item(event_loop, &c)?;
    Ok(c)
}

/// Whether a coroutine-like call of this module may return its outcome itself when it is known
/// before an asyncio future is needed: the operation (`Passive`, `Active`), `None` for a finished
/// wait, or its error raised at the call. The Python layer asks for it on every call and awaits
/// only what is not an outcome, which spares a small operation's calls the making, resolving and
/// awaiting of a future each (about 2 us a call here). Without it every call returns an awaitable,
/// as a coroutine would.
#[derive(Clone, Copy)]
struct Now(bool);

/// What an outcome known at the call becomes: itself under [`Now`], else a resolved future.
fn known<'py>(
    event_loop: &Bound<'py, PyAny>,
    result: Result<Outcome, Error>,
    now: Now,
) -> PyResult<Bound<'py, PyAny>> {
    let py = event_loop.py();
    if !now.0 {
        let future = event_loop.call_method0(intern!(py, "create_future"))?;
        resolve(&future, result.unwrap_or_else(Outcome::Failed));
        return Ok(future);
    }
    match result {
        Ok(Outcome::Done) => Ok(py.None().into_bound(py)),
        Ok(Outcome::Passive(p)) => Ok(Bound::new(py, p)?.into_any()),
        Ok(Outcome::Active(a)) => Ok(Bound::new(py, a)?.into_any()),
        Ok(Outcome::Failed(e)) | Err(e) => Err(err(e)),
    }
}

/// Returns an asyncio future of the running loop that `work` resolves (or, under [`Now`], the
/// outcome itself when it is known before a future is needed).
///
/// `work` is polled once before anything else (which starts it: an operation's command reaches
/// its engine), then again with its waker. A future that is ready by then, like waiting for a
/// finished transfer, or an exposure a hot engine answered meanwhile, resolves without a trip
/// through the loop (a trip costs a wake-up of its thread and two turns of the loop). After that
/// it is polled on the loop's thread whenever it is woken.
fn spawn<'py, F>(py: Python<'py>, work: F, now: Now) -> PyResult<Bound<'py, PyAny>>
where
    F: Future<Output = Result<Outcome, Error>> + Send + 'static,
{
    spawn_within(py, work, None, now)
}

/// The longest the loop's thread waits at the call for an answer that takes no more than one turn
/// of this process's engine (an exposure: registering the memory and making its metadata) or one
/// round trip between two engines (a small same-host operation), before it hands the loop a
/// pending future instead.
const LOCAL_WAIT: Duration = Duration::from_micros(50);

/// [`spawn`] for work that no peer takes part in: when the engine has not answered after the
/// first polls, the loop's thread waits up to [`LOCAL_WAIT`] for it (yielding its core to the
/// engine), which spares the loop the wake-up of its thread and two of its turns.
fn spawn_local<'py, F>(py: Python<'py>, work: F, now: Now) -> PyResult<Bound<'py, PyAny>>
where
    F: Future<Output = Result<Outcome, Error>> + Send + 'static,
{
    spawn_within(py, work, Some((LOCAL_WAIT, &|| true)), now)
}

/// How long the loop's thread may wait at the call, and while what holds.
type LocalWait<'a> = Option<(Duration, &'a dyn Fn() -> bool)>;

/// [`spawn`], waiting at the call as `local` says (see [`spawn_local`]).
fn spawn_within<'py, F>(
    py: Python<'py>,
    work: F,
    local: LocalWait<'_>,
    now: Now,
) -> PyResult<Bound<'py, PyAny>>
where
    F: Future<Output = Result<Outcome, Error>> + Send + 'static,
{
    static GET_RUNNING_LOOP: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    // No running loop (a call outside a coroutine) raises here, before anything has started.
    let event_loop = GET_RUNNING_LOOP
        .get_or_try_init(py, || {
            Ok::<_, PyErr>(py.import("asyncio")?.getattr("get_running_loop")?.unbind())
        })?
        .bind(py)
        .call0()?;
    let rt = runtime()?;
    let mut work: Work = Box::pin(work);
    // The first poll only starts the work: the next, with the task's waker, is the one whose
    // wake-ups count. Should anything fail after it, dropping `work` ends what it started (every
    // operation is cancel safe).
    let first = {
        let _timers = rt.enter();
        work.as_mut().poll(&mut Context::from_waker(Waker::noop()))
    };
    if let Poll::Ready(result) = first {
        return known(&event_loop, result, now);
    }
    let queue = completions(py, &event_loop)?.get().queue.clone();
    let task = Arc::new(Task {
        work: Mutex::new(Some(work)),
        target: Mutex::new(None),
        queued: AtomicBool::new(false),
        queue,
    });
    // Until the asyncio future exists only this thread polls the task: the loop's `drain`, which
    // runs on this thread, cannot run before this call returns.
    if let Some(result) = task.poll_here(rt) {
        return known(&event_loop, result, now);
    }
    if let Some((limit, keep)) = local {
        // The GIL stays held: no thread of the module takes it, and releasing it could hand it to
        // another Python thread for a whole switch interval (5 ms) before this one got it back.
        if task.woken_within(limit, keep) {
            if let Some(result) = task.poll_here(rt) {
                return known(&event_loop, result, now);
            }
        }
    }
    // Pending: from here on the loop polls the task when it is woken (a wake-up since the last
    // poll has queued it already) and resolves this future.
    let future = event_loop.call_method0(intern!(py, "create_future"))?;
    *lock(&task.target) = Some(future.clone().unbind());
    future.call_method1(intern!(py, "add_done_callback"), (Abort(task),))?;
    Ok(future)
}

/// The raw NIXL agent metadata in a `nixl_metadata` string (`b64:` base64 or legacy hex, zlib),
/// decoded by the core: bounded at `MAX_NIXL_METADATA` bytes, so a hostile string cannot inflate
/// without limit. Raises `CoreError("Metadata", ...)`.
#[pyfunction]
fn decode_agent_metadata<'py>(
    py: Python<'py>,
    nixl_metadata: &str,
) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
    let raw = RdmaMetadata::decode_agent_metadata(nixl_metadata).map_err(err)?;
    Ok(pyo3::types::PyBytes::new(py, &raw))
}

/// A `nixl_metadata` string as hex of its zlib bytes (Dynamo's `hex_encode=True` form), converted
/// by the core. Raises `CoreError("Metadata", ...)`.
#[pyfunction]
fn agent_metadata_hex(nixl_metadata: &str) -> PyResult<String> {
    RdmaMetadata::agent_metadata_as_hex(nixl_metadata).map_err(err)
}

/// The process's metrics: one registry every connector of the module records into (a registry
/// holds each family once; `nixl_connect.metrics` hands its text to `prometheus_client`). Per
/// process image, as the runtime is: a forked child starts from zero (its parent's counters are
/// the parent's, and a lock held by a parent's thread at the fork is never taken here).
fn metrics() -> &'static (
    nixl_connect::metrics::prometheus_client::registry::Registry,
    nixl_connect::metrics::Metrics,
) {
    type Held = &'static (
        nixl_connect::metrics::prometheus_client::registry::Registry,
        nixl_connect::metrics::Metrics,
    );
    static METRICS: Mutex<Option<(u64, Held)>> = Mutex::new(None);
    let image = FORKS.load(Ordering::Relaxed);
    let mut slot = lock(&METRICS);
    if let Some((p, m)) = *slot {
        if p == image {
            return m;
        }
    }
    // Leaked once per process image, as the runtime (a fork's parent keeps its own).
    let m: Held = Box::leak(Box::new(nixl_connect::metrics::Metrics::standalone()));
    *slot = Some((image, m));
    m
}

/// Every connector's metrics in the OpenMetrics text format (ending in `# EOF`), for
/// `nixl_connect.metrics.collector`.
#[pyfunction]
fn metrics_text(py: Python<'_>) -> PyResult<String> {
    py.detach(|| nixl_connect::metrics::encode(&metrics().0))
        .map_err(|e| pyo3::exceptions::PyRuntimeError::new_err(format!("encoding the metrics failed: {e}")))
}

/// The NIXL agent name inside a `nixl_metadata` string, or `""` when it is not NIXL metadata.
#[pyfunction]
fn agent_name(nixl_metadata: &str) -> String {
    RdmaMetadata::agent_name_in(nixl_metadata).unwrap_or_default()
}

/// The library folders of the NIXL wheels (`nixl_cu13`, `nixl_cu12`) this interpreter can import.
fn nixl_wheel_dirs(py: Python<'_>) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let Ok(util) = py.import("importlib.util") else {
        return out;
    };
    for pkg in ["nixl_cu13", "nixl_cu12"] {
        let origin = util
            .call_method1("find_spec", (pkg,))
            .ok()
            .filter(|s| !s.is_none())
            .and_then(|s| s.getattr("origin").ok())
            .and_then(|o| o.extract::<String>().ok());
        // <site>/nixl_cu13/__init__.py -> <site>/.nixl_cu13.mesonpy.libs
        if let Some(site) = origin
            .as_deref()
            .and_then(|o| std::path::Path::new(o).parent()?.parent())
        {
            out.push(site.join(format!(".{pkg}.mesonpy.libs")));
        }
    }
    out
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    watch_forks();
    nixl_connect::nixl_library::prefer(nixl_wheel_dirs(m.py()));
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("CoreError", m.py().get_type::<CoreError>())?;
    m.add_class::<Connector>()?;
    m.add_class::<Passive>()?;
    m.add_class::<Active>()?;
    m.add_class::<Completions>()?;
    m.add_class::<Registration>()?;
    m.add_function(wrap_pyfunction!(decode_agent_metadata, m)?)?;
    m.add_function(wrap_pyfunction!(agent_name, m)?)?;
    m.add_function(wrap_pyfunction!(error_classes, m)?)?;
    m.add_function(wrap_pyfunction!(agent_metadata_hex, m)?)?;
    m.add_function(wrap_pyfunction!(metrics_text, m)?)?;
    Ok(())
}
