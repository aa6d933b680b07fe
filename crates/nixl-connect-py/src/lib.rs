//! `nixl_connect._core`: the Rust core of the Python package `nixl_connect`.
//!
//! The package (`python/nixl_connect/`) gives Python the classes of Dynamo's
//! `dynamo.nixl_connect`; this module is what they call: a `Connector` whose four operation calls
//! return awaitables of `Passive` (readable / writable) and `Active` (read / write) operations (or,
//! asked with `now=True`, the operation itself when it is made at the call), and one exception
//! type, `CoreError(kind, message, class)`, carrying the Rust error's kind and the `nixl_connect`
//! exception class to raise for it.
//!
//! Memory comes from Python as `(ptr, size, device, keepalive)` tuples; the keepalive object (the
//! tensor, array or bytes the pointer belongs to) is held by the Rust operation, and after it by
//! the engine, for as long as any transfer may touch the memory, even if Python code drops every
//! reference to it.
//!
//! # How calls complete
//!
//! The Rust futures are polled on their asyncio loop's own thread, with the GIL held (a poll never
//! blocks): at the call, before any asyncio future is made (twice, or three times for a call that
//! waits briefly at the call), so a future that is ready by then, like waiting for a finished
//! transfer or an exposure a hot engine answered meanwhile, costs no trip through the loop (and,
//! with `now=True`, no future at all); then whenever it is woken. A waker, called
//! by the engine thread or a timer without the GIL, queues the task on its loop's `Completions`
//! and writes one byte to a socket the loop watches (`loop.add_reader`). So no thread of ours ever
//! takes the GIL (a thread that does while Python finalizes crashes the process), and a completion
//! costs one wake-up of the loop. Timers run on a one-thread tokio runtime of this module's own.
//! Cancelling the awaiting Python task drops the Rust future (each operation is cancel safe).
//!
//! The asyncio futures of pending calls belong to their loop: its `Completions` (which the loop's
//! reader callback keeps, and nothing else strongly) holds them and shows them to Python's
//! collector. A task nobody holds that awaits one lives as long as the loop (asyncio holds tasks
//! only weakly; Dynamo's module waits on the loop's timers, which the loop holds too), and when
//! the loop closes or is collected with calls still pending, `Completions` goes with it and ends
//! them, as a cancel would, instead of keeping their operations and memory for good.
//!
//! # Layout
//!
//! `errors` (the exception and the class for each kind) <- `forks` (state of one process image)
//! <- `completions` (futures to awaits) <- `operations` (`Passive`, `Active`) <- this file (the
//! `Connector`, the module's functions); each uses only those before it.
mod completions;
mod errors;
mod forks;
mod operations;

use std::sync::atomic::Ordering;
use std::sync::Mutex;
use std::time::Duration;

use nixl_connect::{Descriptor, Device, RdmaMetadata, SerializedDescriptor};
use pyo3::exceptions::PyTypeError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyInt, PyList, PyString, PyType};

use crate::completions::{lock, runtime, spawn, spawn_local, Completions, Now, Outcome};
use crate::errors::{err, error_classes, invalid, CoreError};
use crate::forks::{watch_forks, Owned, FORKS};
use crate::operations::{is_quick, Active, ActiveOp, Passive, PassiveOp};

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

    /// The engine's counters as a dict, every field of `EngineStats` by its name
    /// (`registrations`, `live_registrations`, `registration_hits`, `transfers`,
    /// `local_transfers`, `remote_loads`, ...); for tests and diagnostics.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
        let conn = self.inner.get()?.clone();
        let rt = runtime()?;
        let s = py.detach(|| rt.block_on(conn.stats())).map_err(err)?;
        let d = pyo3::types::PyDict::new(py);
        for (name, value) in s.iter() {
            d.set_item(name, value)?;
        }
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
                Ok(Outcome::object(Passive::new(PassiveOp::Readable(op))))
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
                Ok(Outcome::object(Passive::new(PassiveOp::Writable(op))))
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
                Ok(Outcome::object(Active::new(ActiveOp::Read(op), quick)))
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
                Ok(Outcome::object(Active::new(ActiveOp::Write(op), quick)))
            },
            Now(now),
        )
    }
}

/// A peer's metadata as the Python layer hands it: its JSON text, or its pydantic `RdmaMetadata`,
/// whose fields are read here one by one (sparing a `model_dump_json()` and a parse per
/// operation). A model whose fields do not read exactly as the core's types (a `bool` or a
/// `numpy` integer where an `int` belongs, a model with fields of its own), or that breaks a
/// rule, takes the JSON path after all, so that every refusal is the one its JSON would get (the
/// same kind, field and message).
fn peer_metadata(metadata: &Bound<'_, PyAny>) -> PyResult<RdmaMetadata> {
    if let Ok(text) = metadata.cast::<PyString>() {
        return text.to_cow()?.parse().map_err(err);
    }
    if let Some(md) = metadata_fields(metadata).filter(|md| md.validate().is_ok()) {
        return Ok(md);
    }
    let py = metadata.py();
    let Ok(dump) = metadata.getattr(intern!(py, "model_dump_json")) else {
        return Err(PyTypeError::new_err(
            "the peer's metadata must be its RdmaMetadata JSON (str) or an RdmaMetadata model",
        ));
    };
    let json: String = dump.call0()?.extract()?;
    json.parse().map_err(err)
}

/// Whether the pydantic model `kind` has exactly the fields `names` (a subclass with a field of its
/// own writes a key the wire format refuses).
fn has_exactly(kind: &Bound<'_, PyType>, names: &[&Bound<'_, PyString>]) -> bool {
    let Ok(fields) = kind.getattr(intern!(kind.py(), "model_fields")) else {
        return false;
    };
    let Ok(fields) = fields.cast::<PyDict>() else {
        return false;
    };
    fields.len() == names.len() && names.iter().all(|f| fields.contains(f).unwrap_or(false))
}

/// The model's four fields as the core's types, or `None` at the first that does not read as one.
fn metadata_fields(md: &Bound<'_, PyAny>) -> Option<RdmaMetadata> {
    let py = md.py();
    let four = [
        intern!(py, "descriptors"),
        intern!(py, "nixl_metadata"),
        intern!(py, "notification_key"),
        intern!(py, "operation_kind"),
    ];
    if !has_exactly(&md.get_type(), &four) {
        return None;
    }
    // Exactly `int`: bool and numpy's integers convert, but their JSON is not what they convert to.
    fn int<T: for<'a> FromPyObject<'a, 'a>>(v: Bound<'_, PyAny>) -> Option<T> {
        v.cast_exact::<PyInt>().ok()?.extract().ok()
    }
    let list = md.getattr(four[0]).ok()?;
    let list = list.cast_exact::<PyList>().ok()?;
    let mut descriptors = Vec::with_capacity(list.len());
    let mut checked = None; // the descriptors' model, once its three fields were seen
    for d in list.iter() {
        let kind = d.get_type();
        if checked.as_ref().is_none_or(|c: &Bound<'_, PyType>| !c.is(&kind)) {
            let three = [intern!(py, "device"), intern!(py, "ptr"), intern!(py, "size")];
            if !has_exactly(&kind, &three) {
                return None;
            }
            checked = Some(kind);
        }
        let device = d.getattr(intern!(py, "device")).ok()?;
        let device: Device = device.cast::<PyString>().ok()?.to_cow().ok()?.parse().ok()?;
        let ptr: u64 = int(d.getattr(intern!(py, "ptr")).ok()?)?;
        let size: u64 = int(d.getattr(intern!(py, "size")).ok()?)?;
        if ptr == 0 {
            return None;
        }
        descriptors.push(SerializedDescriptor { device, ptr, size });
    }
    let text = |name| -> Option<String> {
        md.getattr(name)
            .ok()?
            .cast::<PyString>()
            .ok()?
            .to_cow()
            .ok()
            .map(Into::into)
    };
    Some(RdmaMetadata {
        descriptors,
        nixl_metadata: text(four[1])?,
        notification_key: text(four[2])?,
        operation_kind: int(md.getattr(four[3]).ok()?)?,
    })
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
