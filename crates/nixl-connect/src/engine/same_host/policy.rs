//! The access policy: what a proven request may reach, decided from the request, the scope it
//! names, the asking connection's load and the device paths this process has, and nothing else
//! (sans-IO: no socket, no clock, no syscall; deadlines are the link core's; the caller acts on
//! the [`Decision`]).

use super::limits::{
    MAX_EXPORTING, MAX_EXPORTING_PER_CONN, MAX_GRANTS_PER_CONN, MAX_PIPES, MAX_PIPES_PER_CONN,
};
use super::link::grant_ipc_len;
use super::server_book::Scope;
use super::wire::{RefuseCode, Req, MAX_FRAME, NOT_LIVE};
use crate::device::Device;
use crate::metadata::OperationKind;

/// The asking connection and the process's load, as the policy sees them.
#[derive(Debug, Clone, Copy)]
pub(super) struct Load {
    /// Read grants the connection holds.
    pub(super) granted: usize,
    /// Device ranges queued for export for the connection.
    pub(super) exporting: usize,
    /// Device ranges queued for export in the process, over every connection.
    pub(super) exporting_all: usize,
    /// The kernel lets this side read the peer's memory (ptrace rules).
    pub(super) can_pull: bool,
    /// Pipes the connection's copies through pipes hold.
    pub(super) pipes: usize,
    /// Pipes held in the process, over every connection.
    pub(super) pipes_all: usize,
}

/// What is done with a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Decision {
    /// Refused: the operation is not this peer's to use as asked (ends it on the peer's side).
    Refuse(RefuseCode, String),
    /// Not on this path: the peer takes NIXL.
    Fallback(String),
    /// A small read: answer with the readable's bytes (copied on the engine thread).
    EagerRead,
    /// A small write: land the bytes carried, then answer done.
    EagerWrite,
    /// A host read: grant the peer its ranges (it pulls).
    Grant,
    /// A device read: export the ranges through CUDA IPC and grant them.
    DeviceRead,
    /// A write from device memory: open the writer's exports and copy on this side.
    DeviceWrite,
    /// A write from host memory: pull it from the writer into this side's memory.
    PullWrite,
    /// A host read by a peer that cannot read this side's memory: feed pipes it reads.
    PipeRead,
    /// A host write from a peer this side cannot read: read the pipes it feeds.
    PipeWrite,
}

fn refuse(code: RefuseCode, reason: &str) -> Decision {
    Decision::Refuse(code, reason.into())
}

const ENDED: &str = "the operation has ended (completed, cancelled or dropped)";
const BUSY: &str = "another writer is writing this writable now";

/// Decides what the proven request `asked` (the request's body as the frame carried it) may do
/// with `scope` (the scope its key names, if any), for a connection under `load`. `device_path(src, dst)` says why this process cannot copy from `src` into `dst`
/// memory on the same-host path, if it cannot (no CUDA, no IPC for that pair).
///
/// The order matters and is the policy: liveness and bounds come before any path is chosen, the
/// caps before any export is queued, and a busy writable refuses before any copy starts.
pub(super) fn decide(
    scope: Option<&Scope>,
    asked: &Req,
    load: &Load,
    device_path: &dyn Fn(Device, Device) -> Option<String>,
) -> Decision {
    let Some(s) = scope else {
        return refuse(RefuseCode::NotLive, NOT_LIVE);
    };
    let write = asked.write;
    if (s.kind() == OperationKind::Write) != write {
        let (is, asks) = [("writable", "read"), ("readable", "write")][usize::from(write)];
        return refuse(
            RefuseCode::WrongDirection,
            &format!("the operation is a {is}; a {asks} cannot use it"),
        );
    }
    if asked.device != s.device() {
        return Decision::Fallback(format!(
            "the request names memory on {}; the operation's is on {}",
            asked.device,
            s.device()
        ));
    }
    if s.is_done() || s.state().status().is_terminal() {
        return refuse(RefuseCode::NotLive, ENDED);
    }
    if asked.remote.is_empty() || !asked.remote.iter().all(|&(a, l)| s.contains(a, l)) {
        return refuse(
            RefuseCode::OutOfRange,
            "a requested range lies outside the operation's descriptors",
        );
    }
    // Small host operations (the link checked the sizes, the direction and host memory).
    if !asked.data.is_empty() && s.has_writer() {
        return refuse(RefuseCode::Busy, BUSY);
    }
    if asked.eager {
        return Decision::EagerRead;
    }
    if !asked.data.is_empty() {
        return Decision::EagerWrite;
    }
    let device = s.device() != Device::Host;
    let pipes = piped(asked);
    if pipes > 0 {
        // Host memory both sides (the link checked the request's; the scope's device matches it).
        if !write && (load.pipes + pipes > MAX_PIPES_PER_CONN || load.pipes_all + pipes > MAX_PIPES) {
            return Decision::Fallback("too many same-host pipes are open now".into());
        }
        if !write && load.granted >= MAX_GRANTS_PER_CONN {
            return Decision::Fallback(format!(
                "this connection holds {MAX_GRANTS_PER_CONN} same-host read grants already"
            ));
        }
        if write && s.has_writer() {
            return refuse(RefuseCode::Busy, BUSY);
        }
        return if write {
            Decision::PipeWrite
        } else {
            Decision::PipeRead
        };
    }
    if write && !matches_sources(asked) {
        return refuse(
            RefuseCode::OutOfRange,
            "the write's source ranges do not match its destination ranges",
        );
    }
    if !write {
        // Every read grant, host or device, counts against the connection's cap.
        if load.granted >= MAX_GRANTS_PER_CONN {
            return Decision::Fallback(format!(
                "this connection holds {MAX_GRANTS_PER_CONN} same-host read grants already"
            ));
        }
        if !device {
            return Decision::Grant;
        }
        // A device read's grant carries one export per range: it must fit one frame.
        if grant_ipc_len(asked.remote.len()) > MAX_FRAME {
            return Decision::Fallback("too many ranges for one same-host device grant".into());
        }
        let n = asked.remote.len();
        if load.exporting + n > MAX_EXPORTING_PER_CONN || load.exporting_all + n > MAX_EXPORTING {
            return Decision::Fallback("too many device ranges are being shared through CUDA IPC now".into());
        }
        return match device_path(s.device(), Device::Host) {
            Some(refusal) => Decision::Fallback(refusal),
            None => Decision::DeviceRead,
        };
    }
    // Writes from here on.
    if !asked.sources.is_empty() {
        // The writer's source is device memory (its device is known to the writer only).
        return match device_path(Device::Cuda(0), s.device()) {
            Some(refusal) => Decision::Fallback(refusal),
            None if s.has_writer() => refuse(RefuseCode::Busy, BUSY),
            None => Decision::DeviceWrite,
        };
    }
    // Host memory into a device writable is pulled through pinned staging, when this side can.
    if device {
        if let Some(refusal) = device_path(Device::Host, s.device()) {
            return Decision::Fallback(refusal);
        }
    }
    if !load.can_pull {
        return Decision::Fallback(
            "the kernel does not let the passive side read this process (ptrace rules)".into(),
        );
    }
    if s.has_writer() {
        return refuse(RefuseCode::Busy, BUSY);
    }
    Decision::PullWrite
}

/// A write's source ranges pair with its destination ranges: one each, of equal lengths, none
/// wrapping the address space (and one device export per range, if any).
fn matches_sources(asked: &Req) -> bool {
    let (local, remote, sources) = (&asked.local, &asked.remote, &asked.sources);
    local.len() == remote.len()
        && local
            .iter()
            .zip(remote)
            .all(|(l, r)| l.1 == r.1 && l.0.checked_add(l.1).is_some())
        && (sources.is_empty()
            || (sources.len() == remote.len() && sources.iter().zip(remote).all(|(s, r)| s.len == r.1)))
}

/// Host memory through pipes (the link checked it is host memory, not eager): a read's lanes
/// asked for, a write's pipes passed. (On a device read, `pipes` asks for VMM descriptors.)
fn piped(asked: &Req) -> usize {
    if asked.device == Device::Host {
        usize::from(asked.pipes)
    } else {
        0
    }
}

/// Why a request's answer is that the operation ended (an eager copy found it ended, a write
/// could not mark it in use).
pub(super) fn ended() -> Decision {
    refuse(RefuseCode::NotLive, ENDED)
}

#[cfg(test)]
mod tests;
