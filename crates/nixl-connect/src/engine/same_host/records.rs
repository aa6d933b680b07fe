//! The records: an active operation ([`Act`]) and its phase, a request's name ([`RequestId`]), a
//! finished copy's owner, a finished export.

use std::mem::take;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use super::wire::{IpcSource, RefuseCode};
use crate::device::Device;
use crate::engine::transport::{ActiveSpec, OpId};
use crate::error::{Error, ErrorSource};
use crate::state::OpState;
use crate::sync::Recover;
use crate::sys::same_host::cma::{CopyError, Pull};
#[cfg(feature = "cuda")]
use crate::sys::same_host::ipc;
use crate::sys::same_host::pipe;

/// Where an active operation is on the same-host path.
pub(super) enum Phase {
    /// Waiting for the connection's handshake.
    Queued,
    /// A write from device memory: its source is being exported (CUDA thread).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Exporting,
    /// Asked; waiting for the grant (reads) or for the passive side's copy (writes).
    Requested,
    /// A read being copied here.
    Copying,
    /// Given up: any late answer is ignored.
    Abandoned,
}

/// An active operation on this transport.
pub(super) struct Act {
    spec: ActiveSpec,
    conn: ConnId,
    slot: u32,
    gen: u64,
    phase: Phase,
    cancel: Arc<AtomicBool>,
    /// Wakes a copy from pipes waiting for its peer, once `cancel` is set.
    wake: Option<Arc<pipe::Wake>>,
    /// The peer's pidfd while copying (to tell afterwards that it is still the same process).
    pidfd: Option<Arc<OwnedFd>>,
    /// The source's memory is device memory: reads get `GrantIpc`, writes send their export.
    device: bool,
    /// A device write's exported source, once the CUDA thread has it.
    sources: Vec<IpcSource>,
    /// The VMM descriptors `sources` name (a peer in another PID namespace), passed with the
    /// request.
    source_fds: Vec<OwnedFd>,
}

impl Act {
    /// The operation `spec` on connection `conn`, in `slot` of generation `gen`, waiting for the
    /// handshake; `device` when its source is device memory.
    pub(super) fn new(spec: ActiveSpec, conn: ConnId, slot: u32, gen: u64, device: bool) -> Self {
        Self {
            spec,
            conn,
            slot,
            gen,
            phase: Phase::Queued,
            cancel: Arc::new(AtomicBool::new(false)),
            wake: None,
            pidfd: None,
            device,
            sources: Vec::new(),
            source_fds: Vec::new(),
        }
    }

    /// The operation.
    pub(super) fn spec(&self) -> &ActiveSpec {
        &self.spec
    }

    /// The operation, as it ends here.
    pub(super) fn into_spec(self) -> ActiveSpec {
        self.spec
    }

    /// The connection it goes over.
    pub(super) fn conn(&self) -> ConnId {
        self.conn
    }

    /// Its slot in the connection's table.
    pub(super) fn slot(&self) -> u32 {
        self.slot
    }

    /// Its slot's generation.
    pub(super) fn gen(&self) -> u64 {
        self.gen
    }

    /// Where it is.
    pub(super) fn phase(&self) -> &Phase {
        &self.phase
    }

    /// Given up: any late answer is ignored.
    pub(super) fn is_abandoned(&self) -> bool {
        matches!(self.phase, Phase::Abandoned)
    }

    /// Moves on to `phase`.
    pub(super) fn enter(&mut self, phase: Phase) {
        self.phase = phase;
    }

    /// Its copy begins: `wake` wakes it if it waits on pipes, `pidfd` tells afterwards that the
    /// peer is still the same process.
    pub(super) fn copying(&mut self, wake: Option<Arc<pipe::Wake>>, pidfd: Option<Arc<OwnedFd>>) {
        self.phase = Phase::Copying;
        self.wake = wake;
        self.pidfd = pidfd;
    }

    /// The flag that stops its copy.
    pub(super) fn cancel(&self) -> &Arc<AtomicBool> {
        &self.cancel
    }

    /// The peer's pidfd while copying.
    pub(super) fn pidfd(&self) -> &Option<Arc<OwnedFd>> {
        &self.pidfd
    }

    /// The source's memory is device memory.
    pub(super) fn device(&self) -> bool {
        self.device
    }

    /// A device write's source is exported: its sources and the descriptors they name go with
    /// the request.
    pub(super) fn exported(&mut self, sources: Vec<IpcSource>, fds: Vec<OwnedFd>) {
        self.sources = sources;
        self.source_fds = fds;
        self.phase = Phase::Requested;
    }

    /// A device write's source is exported (and not yet sent).
    #[cfg(feature = "cuda")]
    pub(super) fn has_sources(&self) -> bool {
        !self.sources.is_empty()
    }

    /// A device write's exported sources and their descriptors, taken to send.
    pub(super) fn take_sources(&mut self) -> (Vec<IpcSource>, Vec<OwnedFd>) {
        (take(&mut self.sources), take(&mut self.source_fds))
    }

    /// Stops its copy (a copy from pipes waiting for its peer wakes at once).
    pub(super) fn stop(&self) {
        self.cancel.store(true, Ordering::Relaxed);
        if let Some(w) = &self.wake {
            w.wake();
        }
    }
}

/// The error a refusal (`code`, `reason`) from `agent` ends an active operation with.
pub(super) fn refused(agent: String, code: RefuseCode, reason: String) -> Error {
    Error::Refused {
        agent,
        refusal: match code {
            RefuseCode::NotLive => crate::error::Refusal::NotLive,
            RefuseCode::OutOfRange => crate::error::Refusal::OutOfRange,
            RefuseCode::WrongDirection => crate::error::Refusal::WrongDirection,
            RefuseCode::Busy => crate::error::Refusal::Busy,
        },
        reason,
    }
}

/// The number of copies running on the pool, so the transport can stop and wait for them before
/// the memory they write is freed.
pub(super) type Outstanding = crate::sync::Watched<usize>;

/// Who a finished copy belonged to.
pub(super) enum CopyOwner {
    /// A read of this side (client).
    Read(OpId),
    /// Pipes this side fed, now empty (`feeds`).
    Fed(FeedFor),
    /// A write into this side's passive operation (server).
    Write {
        key: Arc<str>,
        id: RequestId,
        state: Arc<OpState>,
        pidfd: Option<Arc<OwnedFd>>,
    },
}

/// What other threads hand the engine (finished copies, finished exports): pushed under a lock,
/// taken by the engine, which checks a flag first so that a turn with nothing to take costs no
/// lock.
pub(super) struct Inbox<T> {
    items: Mutex<Vec<T>>,
    any: AtomicBool,
}

impl<T> Default for Inbox<T> {
    fn default() -> Self {
        Self {
            items: Mutex::new(Vec::new()),
            any: AtomicBool::new(false),
        }
    }
}

impl<T> Inbox<T> {
    /// Hands `item` to the engine (the caller wakes it).
    pub(super) fn push(&self, item: T) {
        self.items.lock().recover().push(item);
        self.any.store(true, Ordering::SeqCst);
    }

    /// Everything handed over so far.
    pub(super) fn take(&self) -> Vec<T> {
        if !self.any.swap(false, Ordering::SeqCst) {
            return Vec::new();
        }
        take(&mut *self.items.lock().recover())
    }

    /// True when something waits to be taken (read after the engine's `prepare_sleep` fence, so
    /// an item pushed before a [`Waker::wake`](crate::engine::poller::Waker::wake) that saw the
    /// engine awake is never left behind).
    pub(super) fn is_pending(&self) -> bool {
        self.any.load(Ordering::SeqCst)
    }
}

pub(super) type Finished = Arc<Inbox<(CopyOwner, std::result::Result<(), CopyError>)>>;

/// Which operation a feed of pipes carries (`feeds`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum FeedFor {
    /// A read this side serves (server).
    Grant(RequestId),
    /// A write of this side (client).
    Write(OpId),
}

/// A copy for the host path or the device path.
pub(super) enum AnyCopy {
    Host(Pull),
    /// Host memory read from pipes the peer feeds (it cannot be pulled: another PID namespace).
    Filled(pipe::Fill),
    #[cfg(feature = "cuda")]
    Device(ipc::DeviceCopy),
    /// Host memory of the peer into device memory here (pulled through pinned staging).
    #[cfg(feature = "cuda")]
    Staged(Pull),
}

impl AnyCopy {
    /// A copy pulled from the peer's host memory (cross-memory attach) into memory here on `dst`:
    /// straight in for host memory, through pinned staging buffers for device memory.
    pub(super) fn pulled_into(c: Pull, dst: Option<Device>) -> AnyCopy {
        match dst {
            #[cfg(feature = "cuda")]
            Some(Device::Cuda(_)) => AnyCopy::Staged(c),
            _ => AnyCopy::Host(c),
        }
    }
}

/// An export's sources and the VMM descriptors they name (passed with the frame that carries
/// them).
pub(super) type Exported = (Vec<IpcSource>, Vec<OwnedFd>);

/// A finished CUDA IPC export.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(super) enum ExportDone {
    /// A read grant's source (this side serves it).
    Grant {
        key: Arc<str>,
        id: RequestId,
        /// Ranges it exported (counted against the bounds while queued).
        ranges: usize,
        result: std::result::Result<Exported, ErrorSource>,
    },
    /// A write's source (this side writes).
    Write {
        id: OpId,
        result: std::result::Result<Exported, ErrorSource>,
    },
    /// VMM exports this side gave back on connection `conn` (evicted, or their `DeviceBuffer`
    /// dropped): told to the peer at once, so its mappings of them go.
    Forgotten { conn: ConnId, ids: Vec<u64> },
}

pub(super) type Exports = Arc<Inbox<ExportDone>>;

/// A connection's id (also its token in the engine's poller); unique in the process, never reused.
pub(super) type ConnId = u64;

/// One request on one connection: the name a grant or a writer goes by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct RequestId {
    /// The connection it came on.
    pub(super) conn: ConnId,
    /// The slot of the client's table it uses.
    pub(super) slot: u32,
    /// The slot's generation for this request.
    pub(super) gen: u64,
}
