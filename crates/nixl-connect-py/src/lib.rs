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
//! reference to it. Coroutines are driven by pyo3-async-runtimes on a tokio runtime, so awaiting
//! them never blocks the asyncio loop; blocking work (creating a NIXL agent) runs with the GIL
//! released.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use nixl_connect::{
    Descriptor, Device, Error, RdmaMetadata, ReadOperation, ReadableOperation, WritableOperation,
    WriteOperation,
};
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(
    _core,
    CoreError,
    PyException,
    "An error of the Rust core: args are (kind, message), kind the Rust error variant's name."
);

fn err(e: Error) -> PyErr {
    CoreError::new_err((e.kind(), e.to_string()))
}

fn invalid(msg: String) -> PyErr {
    CoreError::new_err(("InvalidArgument", msg))
}

/// One descriptor from Python: `(ptr, size, device, keepalive)`; a device string ending in
/// `!ro` marks read-only memory (bytes), which may only be a source.
type PyDesc = (u64, u64, String, Py<PyAny>);

fn descriptors(descs: Vec<PyDesc>) -> PyResult<Vec<Descriptor<'static>>> {
    if descs.is_empty() {
        return Err(invalid("the descriptor list is empty".into()));
    }
    descs
        .into_iter()
        .map(|(ptr, size, device, keep)| {
            let (dev, writable) = match device.strip_suffix("!ro") {
                Some(d) => (d, false),
                None => (device.as_str(), true),
            };
            let dev: Device = dev.parse().map_err(err)?;
            let len = usize::try_from(size).map_err(|_| invalid(format!("size {size} is too large")))?;
            if ptr == 0 {
                return Err(invalid("a descriptor has a null pointer".into()));
            }
            // SAFETY: the pointer and size come from the Python object `keep` (a tensor's
            // data_ptr(), a buffer's address), which the descriptor keeps alive for as long as a
            // transfer may touch the memory; read-only objects are marked so and never written.
            #[allow(unsafe_code)]
            Ok(unsafe { Descriptor::from_raw_parts_with_owner(ptr as *mut u8, len, dev, writable, keep) })
        })
        .collect()
}

fn timeout(t: Option<f64>) -> PyResult<Option<Duration>> {
    match t {
        None => Ok(None),
        Some(s) if s.is_finite() && s >= 0.0 => Ok(Some(Duration::from_secs_f64(s))),
        Some(s) => Err(invalid(format!("timeout {s} is not a number of seconds >= 0"))),
    }
}

/// One NIXL agent (and same-host endpoint), as `dynamo.nixl_connect.Connector`'s connection.
#[pyclass(frozen, module = "nixl_connect._core")]
struct Connector {
    inner: nixl_connect::Connector,
}

#[pymethods]
impl Connector {
    /// Creates the connector (blocks for the tens of milliseconds UCX takes, without the GIL).
    #[new]
    fn new(py: Python<'_>, worker_id: String) -> PyResult<Self> {
        let inner = py
            .detach(|| nixl_connect::Connector::builder().worker_id(worker_id).build())
            .map_err(err)?;
        Ok(Self { inner })
    }

    /// The NIXL agent name peers see.
    #[getter]
    fn name(&self) -> String {
        self.inner.name().to_string()
    }

    fn create_readable<'py>(&self, py: Python<'py>, descs: Vec<PyDesc>) -> PyResult<Bound<'py, PyAny>> {
        let descs = descriptors(descs)?;
        let conn = self.inner.clone();
        pyo3_async_runtimes::tokio::future_into_py(py, async move {
            let op = conn.create_readable(descs).await.map_err(err)?;
            Ok(Passive::new(PassiveOp::Readable(op)))
        })
    }

    fn create_writable<'py>(&self, py: Python<'py>, descs: Vec<PyDesc>) -> PyResult<Bound<'py, PyAny>> {
        let descs = descriptors(descs)?;
        let conn = self.inner.clone();
        pyo3_async_runtimes::tokio::future_into_py(py, async move {
            let op = conn.create_writable(descs).await.map_err(err)?;
            Ok(Passive::new(PassiveOp::Writable(op)))
        })
    }

    fn begin_read<'py>(
        &self,
        py: Python<'py>,
        metadata_json: &str,
        descs: Vec<PyDesc>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let md: RdmaMetadata = metadata_json.parse().map_err(err)?;
        let descs = descriptors(descs)?;
        let conn = self.inner.clone();
        pyo3_async_runtimes::tokio::future_into_py(py, async move {
            let op = conn.begin_read(&md, descs).await.map_err(err)?;
            Ok(Active::new(ActiveOp::Read(op)))
        })
    }

    fn begin_write<'py>(
        &self,
        py: Python<'py>,
        descs: Vec<PyDesc>,
        metadata_json: &str,
    ) -> PyResult<Bound<'py, PyAny>> {
        let md: RdmaMetadata = metadata_json.parse().map_err(err)?;
        let descs = descriptors(descs)?;
        let conn = self.inner.clone();
        pyo3_async_runtimes::tokio::future_into_py(py, async move {
            let op = conn.begin_write(descs, &md).await.map_err(err)?;
            Ok(Active::new(ActiveOp::Write(op)))
        })
    }
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
    op: Mutex<Option<Arc<PassiveOp>>>,
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
            op: Mutex::new(Some(Arc::new(op))),
        }
    }

    fn get(&self) -> Option<Arc<PassiveOp>> {
        self.op.lock().unwrap_or_else(|p| p.into_inner()).clone()
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

    fn status(&self) -> u8 {
        match self.get() {
            Some(op) => op.status(),
            None => *self.last.lock().unwrap_or_else(|p| p.into_inner()),
        }
    }

    /// Waits for the peer (`timeout` in seconds, None: no limit); cancel safe.
    #[pyo3(signature = (timeout=None))]
    fn wait<'py>(&self, py: Python<'py>, timeout: Option<f64>) -> PyResult<Bound<'py, PyAny>> {
        let t = self::timeout(timeout)?;
        let op = self.get();
        pyo3_async_runtimes::tokio::future_into_py(py, async move {
            match op {
                Some(op) => op.wait(t).await.map_err(err),
                None => Err(err(Error::Cancelled)),
            }
        })
    }

    fn cancel(&self) {
        if let Some(op) = self.get() {
            op.cancel();
        }
    }

    /// Ends the operation (idempotent): the memory is no longer exposed.
    fn release(&self, py: Python<'_>) {
        let op = self.op.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(op) = op {
            op.cancel();
            *self.last.lock().unwrap_or_else(|p| p.into_inner()) = op.status();
            // Dropping may wait for this process's own same-host copy into the memory to stop.
            py.detach(move || drop(op));
        }
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

    fn path(&self) -> Option<String> {
        match self {
            ActiveOp::Read(o) => o.path(),
            ActiveOp::Write(o) => o.path(),
        }
        .map(|p| p.to_string())
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

/// A read or a write: moving data to or from a peer's passive operation.
#[pyclass(frozen, module = "nixl_connect._core")]
struct Active {
    op: Mutex<Option<Arc<ActiveOp>>>,
    last: Mutex<(u8, Option<String>)>,
}

impl Active {
    fn new(op: ActiveOp) -> Self {
        Self {
            last: Mutex::new((op.status(), None)),
            op: Mutex::new(Some(Arc::new(op))),
        }
    }

    fn get(&self) -> Option<Arc<ActiveOp>> {
        self.op.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

#[pymethods]
impl Active {
    fn status(&self) -> u8 {
        match self.get() {
            Some(op) => op.status(),
            None => self.last.lock().unwrap_or_else(|p| p.into_inner()).0,
        }
    }

    /// `"local"` or `"nixl"` once a transport has taken the operation.
    fn path(&self) -> Option<String> {
        match self.get() {
            Some(op) => op.path(),
            None => self.last.lock().unwrap_or_else(|p| p.into_inner()).1.clone(),
        }
    }

    /// Waits for the transfer (`timeout` in seconds, None: no limit); cancel safe.
    #[pyo3(signature = (timeout=None))]
    fn wait<'py>(&self, py: Python<'py>, timeout: Option<f64>) -> PyResult<Bound<'py, PyAny>> {
        let t = self::timeout(timeout)?;
        let op = self.get();
        pyo3_async_runtimes::tokio::future_into_py(py, async move {
            match op {
                Some(op) => op.wait(t).await.map_err(err),
                None => Err(err(Error::Cancelled)),
            }
        })
    }

    fn cancel(&self) {
        if let Some(op) = self.get() {
            op.cancel();
        }
    }

    /// Ends the operation (idempotent; never blocks long: the memory belongs to Python objects
    /// the engine keeps alive until no transfer touches it).
    fn release(&self, py: Python<'_>) {
        let op = self.op.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(op) = op {
            *self.last.lock().unwrap_or_else(|p| p.into_inner()) = (op.status(), op.path());
            py.detach(move || drop(op));
        }
    }
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
    nixl_connect::nixl_library::prefer(nixl_wheel_dirs(m.py()));
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("CoreError", m.py().get_type::<CoreError>())?;
    m.add_class::<Connector>()?;
    m.add_class::<Passive>()?;
    m.add_class::<Active>()?;
    Ok(())
}
