//! The records the same-host transport keeps about its operations and copies: an active
//! operation's phase, a finished copy's owner, a finished export. Below the files that act on
//! them, so those never import each other.

use std::os::fd::OwnedFd;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use super::cma::{Copy, CopyError};
#[cfg(feature = "cuda")]
use super::ipc;
use super::proto::{IpcSource, RefuseCode};
use super::ConnId;
use crate::engine::transport::{ActiveSpec, OpId};
use crate::error::{Error, ErrorSource};
use crate::state::OpState;

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
    pub(super) spec: ActiveSpec,
    pub(super) conn: ConnId,
    pub(super) slot: u32,
    pub(super) gen: u64,
    pub(super) phase: Phase,
    pub(super) cancel: Arc<AtomicBool>,
    /// The peer's pidfd while copying (to tell afterwards that it is still the same process).
    pub(super) pidfd: Option<Arc<OwnedFd>>,
    /// The source's memory is device memory: reads get `GrantIpc`, writes send their export.
    pub(super) device: bool,
    /// A device write's exported source, once the CUDA thread has it.
    pub(super) sources: Vec<IpcSource>,
}

/// Which frame a client-side operation may receive in its phase.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Expect {
    /// A read waiting for its grant (or given up, which answers it with a failure).
    Grant,
    /// A refusal or a hand-over to NIXL: only before any copy began.
    Answer,
    /// The passive side's end of a write.
    WriteDone,
}

pub(super) fn refused(agent: String, code: RefuseCode, reason: String) -> Error {
    Error::Refused {
        agent,
        replay: code == RefuseCode::NotLive,
        reason,
    }
}

/// Copies running on the pool, so the transport can stop and wait for them before the memory
/// they write is freed.
#[derive(Default)]
pub(super) struct Outstanding {
    pub(super) count: Mutex<usize>,
    pub(super) cv: std::sync::Condvar,
}

/// Who a finished copy belonged to.
pub(super) enum CopyOwner {
    /// A read of this side (client).
    Read(OpId),
    /// A write into this side's passive operation (server).
    Write {
        key: Arc<str>,
        conn: ConnId,
        slot: u32,
        gen: u64,
        state: Arc<OpState>,
        pidfd: Option<Arc<OwnedFd>>,
    },
}

pub(super) type Finished = Arc<Mutex<Vec<(CopyOwner, std::result::Result<(), CopyError>)>>>;

/// A copy for the host path or the device path.
pub(super) enum AnyCopy {
    Host(Copy),
    #[cfg(feature = "cuda")]
    Device(ipc::Copy),
}

/// A finished CUDA IPC export.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(super) enum ExportDone {
    /// A read grant's source (this side serves it).
    Grant {
        key: Arc<str>,
        conn: ConnId,
        slot: u32,
        gen: u64,
        result: std::result::Result<Vec<IpcSource>, ErrorSource>,
    },
    /// A write's source (this side writes).
    Write {
        id: OpId,
        result: std::result::Result<Vec<IpcSource>, ErrorSource>,
    },
}

pub(super) type Exports = Arc<Mutex<Vec<ExportDone>>>;
