//! Device memory (feature `cuda`): CUDA IPC exports and the device path's refusals.

use super::link::Answer;
#[cfg(feature = "cuda")]
use super::records::AnyCopy;
use super::records::{ExportDone, Phase, RequestId};
#[cfg(feature = "cuda")]
use super::sys::ipc;
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

impl SameHostTransport {
    /// The device path of a request the policy let through: a read is granted once its source
    /// is exported (the answer comes later); a write is copied here from its export.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub(super) fn device_req(
        &mut self,
        id: RequestId,
        write: bool,
        key: &str,
        remote: Vec<(u64, u64)>,
        sources: Vec<IpcSource>,
    ) -> Option<Answer> {
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
                ipc::export(
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
                slot: w.slot,
                cancel: w.cancel,
            });
            self.in_flight.start(copy, w.owner);
            None
        }
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
                    let answer = match result {
                        Ok(sources) if granted => Answer::GrantIpc(sources),
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
                        c.link.answer(id.slot, id.gen, answer);
                    }
                }
                ExportDone::Write { id, result } => {
                    let Some(a) = self.client.get_mut(id) else {
                        continue;
                    };
                    match (&a.phase, result) {
                        (Phase::Exporting, Ok(sources)) => {
                            a.sources = sources;
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
