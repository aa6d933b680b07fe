//! Device memory (feature `cuda`): CUDA IPC exports and the device path's refusals.

use super::link::Answer;
#[cfg(feature = "cuda")]
use super::records::AnyCopy;
use super::records::{ConnId, ExportDone, Phase, RequestId};
#[cfg(feature = "cuda")]
use super::sys::ipc;
use super::sys::pipe;
use super::transport::SameHostTransport;
use super::wire::{IpcSource, RefuseCode};
use crate::device::Device;
use crate::engine::transport::{Decline, Event};
use crate::error::PathRefusal;
use crate::reg::Range;

/// The one device all `ranges` are on, or `None` for none or several.
pub(super) fn uniform(ranges: &[Range]) -> Option<Device> {
    let d = ranges.first()?.device;
    ranges.iter().all(|r| r.device == d).then_some(d)
}

/// Why the device path cannot move a transfer from memory on `src` into memory on `dst`, if it
/// cannot (the host path takes host-to-host; host into device memory is pulled through pinned
/// staging by the device memory's owner, which needs CUDA).
pub(crate) fn device_path_refusal(src: Device, dst: Device) -> Option<PathRefusal> {
    match (src, dst) {
        (Device::Cuda(_), Device::Cuda(_) | Device::Host) if cfg!(feature = "cuda") => {
            #[cfg(feature = "cuda")]
            if !ipc::available() {
                return Some(PathRefusal::NoCudaDevice);
            }
            None
        }
        (Device::Cuda(_), Device::Cuda(_) | Device::Host) => Some(PathRefusal::NoCudaSupport),
        (Device::Host, Device::Cuda(_)) if cfg!(feature = "cuda") => {
            #[cfg(feature = "cuda")]
            if !ipc::available() {
                return Some(PathRefusal::NoCudaDevice);
            }
            None
        }
        (Device::Host, Device::Cuda(_)) => Some(PathRefusal::HostIntoDevice),
        _ => Some(PathRefusal::UnsupportedMemory),
    }
}

/// A device request the policy let through, as the device path takes it.
pub(super) struct DeviceAsk {
    pub(super) write: bool,
    /// Ranges in this side's memory.
    pub(super) remote: Vec<(u64, u64)>,
    /// A write's exported sources (one per range).
    pub(super) sources: Vec<IpcSource>,
    /// A read whose reader takes the exports as VMM descriptors (it asked for them).
    pub(super) vmm: bool,
    /// A write's VMM descriptors, passed with its request (checked; closed off the engine
    /// thread wherever they are dropped, a copy takes them out).
    pub(super) fds: pipe::Ends,
}

impl SameHostTransport {
    /// The device path of a request the policy let through: a read is granted once its source
    /// is exported (the answer comes later); a write is copied here from its export.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub(super) fn device_req(&mut self, id: RequestId, key: &str, ask: DeviceAsk) -> Option<Answer> {
        let DeviceAsk {
            write,
            remote,
            sources,
            vmm,
            fds,
        } = ask;
        #[cfg(not(feature = "cuda"))]
        return Some(Answer::Fallback(
            "this build has no CUDA support (feature `cuda`)".into(),
        ));
        #[cfg(feature = "cuda")]
        {
            let key = self.server.key(key).expect("decided on it");
            if !write {
                let done = self.in_flight.export_done();
                let s = self.server.scope_mut(&key).expect("decided on it");
                let fresh = s.grants.insert(id);
                let ranges = remote.len();
                self.server.exports_queued(ranges);
                if let Some(c) = self.sockets.get_mut(id.conn) {
                    c.granted += usize::from(fresh);
                    c.exporting += ranges;
                }
                let how = match self.sockets.get(id.conn) {
                    Some(c) if vmm => ipc::ExportAs::Descriptors {
                        other_namespace: c.other_pid_ns,
                    },
                    _ => ipc::ExportAs::Handles,
                };
                let to = ipc::ExportTo {
                    conn: id.conn,
                    how,
                    tell: self.teller(),
                };
                ipc::export(
                    to,
                    remote,
                    Box::new(move |result| {
                        done(ExportDone::Grant {
                            key,
                            id,
                            ranges,
                            result,
                        })
                    }),
                );
                return None;
            }
            let w = match self.claim_writable(id, &key) {
                Ok(w) => w,
                Err(a) => return Some(a),
            };
            let copy = AnyCopy::Device(ipc::Copy {
                conn: id.conn,
                pid: w.pid,
                pieces: remote
                    .iter()
                    .zip(sources)
                    .map(|(&(dst, _), src)| ipc::Piece { dst, src })
                    .collect(),
                fds: fds.into_vec(),
                slot: w.slot,
                cancel: w.cancel,
            });
            self.in_flight.start(copy, w.owner);
            None
        }
    }

    /// The peer gave back VMM exports it had passed on connection `i`: this side's mappings of
    /// them go. Only ids it passed here count, each once: a flood of `Forgot` frames makes no
    /// work on the CUDA thread beyond what the exports themselves did.
    pub(super) fn on_forgot(&mut self, i: ConnId, ids: Vec<u64>) {
        let ids = self.sockets.unname_exports(i, &ids);
        #[cfg(feature = "cuda")]
        if !ids.is_empty() {
            ipc::forget_imports(i, ids);
        }
        #[cfg(not(feature = "cuda"))]
        let _ = ids;
    }

    /// What tells this transport, from the CUDA thread, of VMM exports given back on one of its
    /// connections (it then tells the peer).
    #[cfg(feature = "cuda")]
    pub(super) fn teller(&self) -> ipc::Teller {
        let done = self.in_flight.export_done();
        std::sync::Arc::new(move |conn, ids| done(ExportDone::Forgotten { conn, ids }))
    }

    /// Handles finished CUDA IPC exports.
    pub(super) fn reap_exports(&mut self, out: &mut Vec<Event>) -> bool {
        let done = self.in_flight.take_exports();
        let any = !done.is_empty();
        for d in done {
            match d {
                ExportDone::Grant {
                    key,
                    id,
                    ranges,
                    result,
                } => {
                    self.server.exports_ended(ranges);
                    if let Some(c) = self.sockets.get_mut(id.conn) {
                        c.exporting = c.exporting.saturating_sub(ranges);
                    }
                    // Not for a scope another reader completed this turn (its grants go when
                    // the engine applies the completion and unexposes it).
                    let granted = self
                        .server
                        .scope(&key)
                        .is_some_and(|s| !s.done && s.grants.contains(&id));
                    let mut fds = Vec::new();
                    let answer = match result {
                        Ok((sources, f)) if granted => {
                            fds = f;
                            Answer::GrantIpc(sources)
                        }
                        _ if !granted => Answer::Refuse(
                            RefuseCode::NotLive,
                            "the operation ended before its memory could be shared".into(),
                        ),
                        Ok(_) => unreachable!("granted is checked above"),
                        Err(reason) => {
                            if self.server.scope_mut(&key).is_some_and(|s| s.grants.remove(&id)) {
                                self.ungrant(id.conn);
                            }
                            Answer::Fallback(format!(
                                "the device memory cannot be shared through CUDA IPC: {reason}"
                            ))
                        }
                    };
                    if let Some(c) = self.sockets.get_mut(id.conn) {
                        // The descriptors go with the grant's first byte.
                        let at = c.link.queued_end();
                        if c.link.answer(id.slot, id.gen, answer) && !fds.is_empty() {
                            self.sockets.attach(id.conn, at, pipe::Ends::new(fds));
                        }
                    }
                }
                ExportDone::Forgotten { conn, ids } => {
                    if let Some(c) = self.sockets.get_mut(conn) {
                        c.link.forgot(&ids);
                    }
                }
                ExportDone::Write { id, result } => {
                    let Some(a) = self.client.get_mut(id) else {
                        continue;
                    };
                    match (&a.phase, result) {
                        (Phase::Exporting, Ok((sources, fds))) => {
                            a.sources = sources;
                            a.source_fds = fds;
                            a.phase = Phase::Requested;
                            self.request(id, out);
                        }
                        (Phase::Exporting, Err(reason)) => {
                            let a = self.client.remove(id).expect("present");
                            self.free_slot(a.conn, a.slot, a.gen);
                            out.push(Event::Declined {
                                spec: a.spec,
                                reason: Decline::shared(
                                    "the device memory cannot be shared through CUDA IPC",
                                    reason,
                                ),
                            });
                        }
                        // Abandoned while exporting: it was answered then; forget it now.
                        (_, _) => {
                            if matches!(a.phase, Phase::Abandoned) {
                                let a = self.client.remove(id).expect("present");
                                self.free_slot(a.conn, a.slot, a.gen);
                            }
                        }
                    }
                }
            }
        }
        any
    }
}
