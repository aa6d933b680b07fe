//! The status machine every operation shares with the engine: [`OperationStatus`], which path
//! moved it ([`TransferPath`]), which paths it may take ([`PathPolicy`]), and [`OpState`] (one
//! operation's status, error, waiters, and whether its memory is released). Below both the
//! operations and the engine, so neither imports the other for it.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::error::{Error, ErrorKind, Refusal, Result};
use crate::reg::RegToken;
use crate::sync::{label_enum, Recover, Watched};

label_enum! {
/// Which path moved an operation's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
#[non_exhaustive]
pub enum TransferPath {
    /// NIXL (UCX): Python peers, other hosts, device memory.
    Nixl = 1 => "nixl",
    /// The same-host path: a Rust (or `nixl_connect` Python) peer on this host, its memory
    /// copied directly (printed `local`, as Python and the metrics' labels name it).
    SameHost = 2 => "local",
    /// The in-process loopback transport of the `testing` feature.
    Loopback = 3 => "loopback",
}
}

impl TransferPath {
    /// The same-host path's name before 0.2.
    #[deprecated(note = "renamed `TransferPath::SameHost`")]
    #[allow(non_upper_case_globals)]
    pub const Local: TransferPath = TransferPath::SameHost;

    pub(crate) fn from_u8(v: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|p| *p as u8 == v)
    }
}

label_enum! {
/// How the same-host path ([`TransferPath::SameHost`]) moves an operation's bytes, as the active
/// side saw it decided ([`ReadOperation::mechanism`](crate::ReadOperation::mechanism)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
#[repr(u8)]
pub enum Mechanism {
    /// In the protocol's frames (a small host operation): each side copies only its own memory.
    Frames = 1 => "frames",
    /// Cross-memory attach (`process_vm_readv`): the side whose memory is written pulls from the
    /// other's.
    CrossMemoryAttach = 2 => "cma",
    /// Pipes the source's owner writes its memory into and the destination's owner reads
    /// (two copies): peers that cannot read each other's memory (another PID namespace: pods;
    /// ptrace refused).
    Pipes = 3 => "pipes",
    /// CUDA IPC: the source's device memory opened and copied by the destination's owner.
    CudaIpc = 4 => "cuda-ipc",
    /// Host memory pulled through pinned staging buffers into device memory.
    PinnedStaging = 5 => "pinned-staging",
    /// A VMM allocation's POSIX descriptor passed over the socket, mapped and copied by the
    /// destination's owner: device memory between PID namespaces (pods), where legacy CUDA IPC
    /// handles do not open.
    CudaVmm = 6 => "cuda-vmm",
}
}

impl Mechanism {
    fn from_u8(v: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|m| *m as u8 == v)
    }
}

/// Which paths a connector's active operations may take
/// ([`ConnectorBuilder::path`](crate::ConnectorBuilder::path)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum PathPolicy {
    /// The same-host path when the peer is a Rust connector on this host, NIXL otherwise.
    #[default]
    Auto,
    /// NIXL only; the connector does not listen for same-host peers either.
    Nixl,
    /// The same-host path only: an operation it cannot take fails with
    /// [`Error::PathUnavailable`] (for benchmarks and tests). Parsed and printed as `local`.
    SameHost,
}

impl PathPolicy {
    /// The same-host-only policy's name before 0.2.
    #[deprecated(note = "renamed `PathPolicy::SameHost`")]
    #[allow(non_upper_case_globals)]
    pub const Local: PathPolicy = PathPolicy::SameHost;
}

impl std::str::FromStr for PathPolicy {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(Self::Auto),
            "nixl" => Ok(Self::Nixl),
            "local" => Ok(Self::SameHost),
            other => Err(Error::InvalidArgument(format!(
                "path {other:?} is not one of auto, nixl, local"
            ))),
        }
    }
}

label_enum! {
/// The status of an operation, as Python's `OperationStatus`; printed as Python's short names
/// (`INIT`, `PROC`, `DONE`, `STOP`, `ERR`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
#[non_exhaustive]
pub enum OperationStatus {
    /// Not yet set up.
    Uninitialized = 0 => "<invalid>",
    /// Set up and waiting for its peer (passive operations).
    Initialized = 1 => "INIT",
    /// Data is moving (active operations).
    InProgress = 2 => "PROC",
    /// Done: the data has arrived.
    Complete = 3 => "DONE",
    /// Cancelled by `cancel()` or drop.
    Cancelled = 4 => "STOP",
    /// Failed; `wait_for_completion` returns the error.
    Errored = 5 => "ERR",
}
}

impl OperationStatus {
    pub(crate) fn from_u8(v: u8) -> Self {
        Self::ALL
            .into_iter()
            .find(|s| *s as u8 == v)
            .unwrap_or(Self::Uninitialized)
    }

    /// True for `Complete`, `Cancelled` and `Errored`.
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Complete | Self::Cancelled | Self::Errored)
    }
}

/// How an operation ended, as an [`Observe`]r is told.
pub(crate) struct Ended {
    pub(crate) status: OperationStatus,
    pub(crate) path: Option<TransferPath>,
    pub(crate) mechanism: Option<Mechanism>,
    pub(crate) error: Option<ErrorKind>,
    /// Why the peer refused it, when it did.
    pub(crate) refusal: Option<Refusal>,
}

/// Told when an operation's transfer starts and when the operation ends (once each), on the
/// thread that made the change: the connector's metrics.
pub(crate) trait Observe: Send + Sync {
    /// A transport took the operation on `path` (again, when the previous one declined it).
    fn started(&self, path: TransferPath);
    /// A wait for the operation timed out (the operation stays live).
    fn timed_out(&self);
    /// The operation ended.
    fn ended(&self, e: Ended);
}

/// Shared by an operation's handle, the engine, and the transport moving its bytes.
///
/// `released` is true while no transport may touch the operation's memory: before the engine has
/// its command, and again once every transfer on it has ended (or the transport that posted it is
/// gone). A borrow may only end, and owned memory may only be freed, while it is true.
pub(crate) struct OpState {
    status: AtomicU8,
    path: AtomicU8,
    mechanism: AtomicU8,
    error: Mutex<Option<Error>>,
    notify: Notify,
    released: Watched<bool>,
    /// Registrations the engine made for the operation's memory, to keep with it.
    tokens: Mutex<Vec<RegToken>>,
    /// Told when the operation starts and ends: the connector's metrics (none without them).
    observer: OnceLock<Box<dyn Observe>>,
    /// The operation's `tracing` span, when a subscriber wants it (closed when the state goes).
    span: OnceLock<tracing::Span>,
    /// Why the first path offered the operation declined it (it went to the next path).
    declined: OnceLock<Box<str>>,
}

impl OpState {
    pub(crate) fn new(status: OperationStatus) -> Arc<Self> {
        Arc::new(Self {
            status: AtomicU8::new(status as u8),
            path: AtomicU8::new(0),
            mechanism: AtomicU8::new(0),
            error: Mutex::new(None),
            notify: Notify::new(),
            released: Watched::new(true),
            tokens: Mutex::new(Vec::new()),
            observer: OnceLock::new(),
            span: OnceLock::new(),
            declined: OnceLock::new(),
        })
    }

    /// Keeps the operation's span: its path and its end are recorded in it.
    pub(crate) fn trace(&self, span: tracing::Span) {
        if !span.is_disabled() {
            let _ = self.span.set(span);
        }
    }

    /// The operation's span, if a subscriber wants it (entered where a transport works on it).
    pub(crate) fn span(&self) -> Option<&tracing::Span> {
        self.span.get()
    }

    /// Tells `observer` of the operation's start and end from now on (set once, before any
    /// transport has the operation).
    pub(crate) fn observe(&self, observer: Box<dyn Observe>) {
        let _ = self.observer.set(observer);
    }

    /// As [`observe`](Self::observe) for an operation a transport may already have: the
    /// observer is made (by `make`) and set under the lock every end takes, unless the operation
    /// has ended already (then it is never made: an end it would not be told of).
    pub(crate) fn observe_unless_ended(&self, make: impl FnOnce() -> Box<dyn Observe>) {
        let _slot = self.error.lock().recover();
        if !self.status().is_terminal() {
            let _ = self.observer.set(make());
        }
    }

    pub(crate) fn status(&self) -> OperationStatus {
        OperationStatus::from_u8(self.status.load(Ordering::Acquire))
    }

    /// Moves to a terminal status unless already in one; wakes every waiter. Returns whether this
    /// call made the move (so exactly one caller wins).
    ///
    /// The status changes here only, under the error's lock, with the error: exactly one call
    /// ends the operation, and a waiter that sees `Errored` finds the error. The observer and the
    /// span are told first, so whoever sees the operation ended sees it counted.
    pub(crate) fn finish(&self, status: OperationStatus, error: Option<Error>) -> bool {
        let mut slot = self.error.lock().recover();
        if self.status().is_terminal() {
            return false;
        }
        let kind = error.as_ref().map(Error::kind);
        if let Some(t) = self.observer.get() {
            t.ended(Ended {
                status,
                path: self.path(),
                mechanism: self.mechanism(),
                error: kind,
                refusal: error.as_ref().and_then(Error::refusal),
            });
        }
        if let Some(sp) = self.span.get() {
            sp.record("status", tracing::field::display(status));
            if let Some(m) = self.mechanism() {
                sp.record("mechanism", tracing::field::display(m));
            }
            sp.in_scope(|| match kind {
                Some(k) => tracing::debug!(status = %status, error = k.as_str(), "operation ended"),
                None => tracing::debug!(status = %status, "operation ended"),
            });
        }
        self.status.store(status as u8, Ordering::Release);
        *slot = error;
        drop(slot);
        self.notify.notify_waiters();
        true
    }

    /// A wait for the operation timed out: tells the observer (the error is the caller's; the
    /// operation goes on).
    pub(crate) fn timed_out(&self) {
        if let Some(t) = self.observer.get() {
            t.timed_out();
        }
    }

    pub(crate) fn error(&self) -> Option<Error> {
        self.error.lock().recover().clone()
    }

    pub(crate) fn notified(&self) -> tokio::sync::futures::Notified<'_> {
        self.notify.notified()
    }

    /// Records which path moves (or moved) the bytes, and tells the observer the transport
    /// took the operation.
    pub(crate) fn set_path(&self, p: TransferPath) {
        self.path.store(p as u8, Ordering::Release);
        if let Some(t) = self.observer.get() {
            t.started(p);
        }
        if let Some(sp) = self.span.get() {
            sp.record("path", tracing::field::display(p));
            sp.in_scope(|| tracing::debug!(path = %p, "path taken"));
        }
    }

    pub(crate) fn path(&self) -> Option<TransferPath> {
        TransferPath::from_u8(self.path.load(Ordering::Acquire))
    }

    /// Records why a path declined the operation, when it is the first to.
    pub(crate) fn set_declined(&self, why: &str) {
        let _ = self.declined.set(why.into());
    }

    /// Why the first path offered the operation declined it, if one did.
    pub(crate) fn declined(&self) -> Option<&str> {
        self.declined.get().map(|s| &**s)
    }

    /// Records how the same-host path moves the bytes.
    pub(crate) fn set_mechanism(&self, m: Mechanism) {
        self.mechanism.store(m as u8, Ordering::Release);
    }

    /// How the same-host path moves (or moved) the bytes, while it is the path.
    pub(crate) fn mechanism(&self) -> Option<Mechanism> {
        match self.path() {
            Some(TransferPath::SameHost) => Mechanism::from_u8(self.mechanism.load(Ordering::Acquire)),
            _ => None,
        }
    }

    /// Keeps registrations for the operation's memory until the operation takes them.
    pub(crate) fn keep_tokens(&self, t: Vec<RegToken>) {
        self.tokens.lock().recover().extend(t);
    }

    /// The registrations kept for the operation's memory (one per descriptor, in order).
    pub(crate) fn take_tokens(&self) -> Vec<RegToken> {
        std::mem::take(&mut *self.tokens.lock().recover())
    }

    /// Marks the memory as possibly in use by a transport (before the command leaves).
    pub(crate) fn mark_in_use(&self) {
        self.released.update(|r| *r = false);
    }

    /// Marks the memory as in use by a transport unless the operation has ended; false if it has.
    ///
    /// The owner ends an operation by finishing it and then taking this same lock to look at the
    /// flag, so either the transport sees the end and stays away, or the owner sees the memory in
    /// use and waits.
    pub(crate) fn try_mark_in_use(&self) -> bool {
        self.released.update(|r| {
            if self.status().is_terminal() {
                return false;
            }
            *r = false;
            true
        })
    }

    /// Marks the memory as no longer touched by any transport; wakes a blocked dropper (no
    /// system call when none waits: this runs once per operation).
    pub(crate) fn mark_released(&self) {
        self.released.update(|r| *r = true);
    }

    pub(crate) fn is_released(&self) -> bool {
        self.released.read(|r| *r)
    }

    /// Blocks the calling thread until the memory is released or `limit` passes; true if released.
    pub(crate) fn wait_released(&self, limit: Option<Duration>) -> bool {
        // A limit too far to represent waits as long as it takes.
        self.released
            .wait_until(|r| *r, limit.and_then(|l| Instant::now().checked_add(l)))
    }
}

#[cfg(test)]
mod tests;
