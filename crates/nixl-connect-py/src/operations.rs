//! The operations Python holds: `Passive` (a readable or writable: memory exposed to a peer) and
//! `Active` (a read or a write), each a Rust operation of the core behind a handle that outlives
//! it (its last status stays readable after `release()`).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use nixl_connect::{
    Descriptor, Device, Error, RdmaMetadata, ReadOperation, ReadableOperation, TransferPath,
    WritableOperation, WriteOperation,
};
use pyo3::prelude::*;

use crate::completions::{lock, spawn, spawn_within, Now, Outcome, LOCAL_WAIT};
use crate::errors::invalid;
use crate::forks::Owned;

/// A wait's limit from Python's seconds: `None` (and a finite number of seconds past what a
/// `Duration` holds, like Python's `inf`) waits without one.
fn timeout(t: Option<f64>) -> PyResult<Option<Duration>> {
    match t {
        None => Ok(None),
        Some(s) if s.is_finite() && s >= 0.0 => Ok(Duration::try_from_secs_f64(s).ok()),
        Some(s) => Err(invalid(format!("timeout {s} is not a number of seconds >= 0"))),
    }
}

/// The Rust operation behind a `Passive`.
pub(crate) enum PassiveOp {
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
pub(crate) struct Passive {
    op: Owned<Mutex<Option<Arc<PassiveOp>>>>,
    metadata_json: String,
    key: String,
    /// The status when released (the operation itself is gone then).
    last: Mutex<u8>,
}

impl Passive {
    pub(crate) fn new(op: PassiveOp) -> Self {
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

/// The Rust operation behind an `Active`.
pub(crate) enum ActiveOp {
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

    fn path_reason(&self) -> Option<String> {
        match self {
            ActiveOp::Read(o) => o.path_reason(),
            ActiveOp::Write(o) => o.path_reason(),
        }
        .map(str::to_owned)
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
pub(crate) fn is_quick(descs: &[Descriptor<'_>]) -> bool {
    descs.iter().all(|d| d.device() == Device::Host)
        && descs.iter().map(Descriptor::size).sum::<usize>() <= QUICK_BYTES
}

/// What an active operation says of itself, kept when it is released: its status, path,
/// mechanism and path reason.
type Last = (u8, Option<String>, Option<String>, Option<String>);

/// A read or a write: moving data to or from a peer's passive operation.
#[pyclass(frozen, module = "nixl_connect._core")]
pub(crate) struct Active {
    op: Owned<Mutex<Option<Arc<ActiveOp>>>>,
    last: Mutex<Last>,
    /// Small and over host memory: a wait may wait briefly at the call (see [`Active::wait`]).
    quick: bool,
}

impl Active {
    pub(crate) fn new(op: ActiveOp, quick: bool) -> Self {
        Self {
            last: Mutex::new((op.status(), None, None, None)),
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

    /// Why a faster path declined the operation (it then took NIXL), if one did (an extension:
    /// Dynamo's module has no such property).
    fn path_reason(&self) -> PyResult<Option<String>> {
        Ok(match self.get()? {
            Some(op) => op.path_reason(),
            None => self.last.lock().unwrap_or_else(|p| p.into_inner()).3.clone(),
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
            *self.last.lock().unwrap_or_else(|p| p.into_inner()) =
                (op.status(), op.path(), op.mechanism(), op.path_reason());
            py.detach(move || drop(op));
        }
        Ok(())
    }
}
