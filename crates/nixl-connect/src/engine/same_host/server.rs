//! The passive side's actions: the handshake as a server, and what is done with a proven request
//! once the policy (`policy.rs`) has decided it: an answer, a grant, a copy.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use super::device::{device_path_refusal, DeviceAsk};
use super::eager;
use super::feeds::FeedFor;
use super::link::{Answer, Request};
use super::policy::{self, Asked, Decision, Load};
use super::records::{AnyCopy, ConnId, CopyOwner, RequestId};
use super::server_book::Writer;
use super::sys::cma::{Copy, Piece, SlotRef};
use super::sys::pipe;
use super::transport::SameHostTransport;
use super::wire::Req;
use crate::device::Device;
use crate::engine::transport::Event;
use crate::state::TransferPath;

impl SameHostTransport {
    /// Server side: a proven request, decided by the policy (`policy.rs`) and acted on here:
    /// answered, granted, or handed to a copy.
    pub(super) fn on_req(&mut self, i: ConnId, r: Request, out: &mut Vec<Event>) {
        let Request {
            req:
                Req {
                    slot,
                    gen,
                    write,
                    device,
                    remote,
                    local,
                    sources,
                    eager,
                    data,
                    pipes,
                    ..
                },
            key,
            passed: descriptors,
        } = r;
        // A write's pipes are taken first, whatever is decided, so the next frame's are the next
        // ones (a descriptor that is no pipe's read end kills the connection).
        // (Dropped anywhere below, they are closed on the pipes' closer, never here.)
        let mut passed = if write && pipes > 0 {
            match self.sockets.take_pipes(i, pipes as usize) {
                Some(fds) => fds,
                None => return,
            }
        } else {
            pipe::Ends::new(Vec::new())
        };
        // A device write's VMM descriptors likewise (each an NVIDIA device's, or the connection
        // dies); the link checked their count against the sources. (Dropped anywhere below,
        // they are closed on the closer, never here.)
        let vmm = descriptors - if write && pipes > 0 { usize::from(pipes) } else { 0 };
        let mut vmm_fds = if vmm > 0 {
            match self.sockets.take_cuda_exports(i, vmm) {
                Some(fds) => {
                    self.sockets.name_exports(i, &sources);
                    pipe::Ends::new(fds)
                }
                None => return,
            }
        } else {
            pipe::Ends::new(Vec::new())
        };
        let Some(c) = self.sockets.get(i) else { return };
        if !c.link.is_ready() {
            // The connection died after the request was heard (the peer went away, or broke a
            // rule later in the same read): no answer can reach it, so nothing is granted,
            // copied or completed for it.
            return;
        }
        let load = Load {
            granted: c.granted,
            exporting: c.exporting,
            exporting_all: self.server.exporting(),
            can_pull: c.can_pull,
            pipes: self.feeds.lanes_of(i),
            pipes_all: self.feeds.lanes(),
        };
        let asked = Asked {
            write,
            device,
            remote: &remote,
            local: &local,
            sources: &sources,
            eager,
            data: data.len(),
            // (On a device read, `pipes` asks for VMM descriptors, not pipes.)
            pipes: if device == Device::Host { pipes as usize } else { 0 },
        };
        let refusal = |s: Device, d: Device| device_path_refusal(s, d).map(|r| r.to_string());
        let decision = policy::decide(self.server.scope(&key), &asked, &load, &refusal);
        let id = RequestId { conn: i, slot, gen };
        let mut completed = None;
        let answer = match decision {
            Decision::Refuse(..) | Decision::Fallback(_) => Some(answer_of(decision)),
            // Small host operations: this side copies its own memory, on this thread, holding it
            // in use for the copy so that its owner's drop waits for it. The operation is over
            // once the answer is sent.
            Decision::EagerRead | Decision::EagerWrite => {
                let s = self.server.scope_mut(&key).expect("decided on it");
                let answer = if decision == Decision::EagerRead {
                    eager::read_scope(s, &remote).map(Answer::Data)
                } else {
                    eager::write_scope(s, &remote, &data).then(|| Answer::WriteDone {
                        ok: true,
                        reason: String::new(),
                    })
                };
                if answer.is_some() {
                    s.done = true;
                    completed = self.server.key(&key);
                    answer
                } else {
                    Some(answer_of(policy::ended()))
                }
            }
            Decision::Grant => {
                let s = self.server.scope_mut(&key).expect("decided on it");
                if s.grants.insert(id) {
                    if let Some(c) = self.sockets.get_mut(i) {
                        c.granted += 1;
                    }
                }
                Some(Answer::Grant)
            }
            Decision::DeviceRead | Decision::DeviceWrite => self.device_req(
                id,
                &key,
                DeviceAsk {
                    write,
                    remote,
                    sources,
                    vmm: !write && pipes > 0,
                    fds: std::mem::replace(&mut vmm_fds, pipe::Ends::new(Vec::new())),
                },
            ),
            Decision::PullWrite => self.pull_write(id, &key, &remote, &local),
            Decision::PipeRead => self.pipe_read(id, &key, &remote, pipes as usize),
            Decision::PipeWrite => self.pipe_write(
                id,
                &key,
                &remote,
                std::mem::replace(&mut passed, pipe::Ends::new(Vec::new())),
            ),
        };
        drop((passed, vmm_fds));
        let sent = match answer {
            Some(a) => self
                .sockets
                .get_mut(i)
                .is_some_and(|c| c.link.answer(slot, gen, a)),
            None => false,
        };
        // An eager operation is complete once its answer is on its way (a read's bytes, a
        // write's Done); should the connection have died in queueing it, the reader never gets
        // the bytes and the writer learns nothing: the operation stays live for a retry (a
        // write's bytes are in place, and a retry writes them again).
        if let Some(key) = completed {
            if sent {
                out.push(Event::PassiveCompleted {
                    key,
                    path: TransferPath::SameHost,
                });
            } else if let Some(s) = self.server.scope_mut(&key) {
                s.done = false;
            }
        }
    }

    /// A write from host memory that the policy let through: marks the writable in use (its
    /// owner may have ended it an instant ago: then not live) and pulls the writer's bytes into
    /// it on the copy pool.
    fn pull_write(
        &mut self,
        id: RequestId,
        key: &str,
        remote: &[(u64, u64)],
        local: &[(u64, u64)],
    ) -> Option<Answer> {
        let w = match self.claim_writable(id, key) {
            Ok(w) => w,
            Err(a) => return Some(a),
        };
        let copy = AnyCopy::pulled_into(
            Copy {
                pid: w.pid,
                pieces: remote
                    .iter()
                    .zip(local)
                    .map(|(&(dst, len), &(src, _))| Piece {
                        local: dst as usize,
                        remote: src as usize,
                        len: len as usize,
                    })
                    .collect(),
                slot: w.slot,
                cancel: w.cancel,
            },
            Some(w.device),
        );
        self.in_flight.start(copy, w.owner);
        None
    }

    /// A host read the policy let through for a peer that cannot read this side's memory: makes
    /// `lanes` pipes, answers with their read ends and copies the readable's `remote` ranges into
    /// them on the copy pool. The grant lasts until the reader's `Done`; if the feed still runs
    /// then, the read completes once it stopped (`copies.rs`). `None`: answered here.
    fn pipe_read(&mut self, id: RequestId, key: &str, remote: &[(u64, u64)], lanes: usize) -> Option<Answer> {
        if self.feeds.has(FeedFor::Grant(id)) {
            // A request id reused while its feed runs: never an honest client's (generations).
            return Some(Answer::Fallback("this request's id is still in use".into()));
        }
        let made = pipe::Lanes::new(lanes).and_then(|l| Ok((l, Arc::new(pipe::Wake::new()?))));
        let (mut lanes, wake) = match made {
            Ok(m) => m,
            Err(e) => {
                return Some(Answer::Fallback(format!(
                    "the passive side cannot make pipes: {e}"
                )))
            }
        };
        let ends = lanes.take_read_ends();
        let key = self.server.key(key).expect("decided on it");
        let s = self.server.scope_mut(&key).expect("decided on it");
        let state = s.state.clone();
        s.grants.insert(id);
        let c = self.sockets.get_mut(id.conn).expect("decided on it");
        c.granted += 1;
        let pid = c.feed_key();
        let at = c.link.queued_end();
        if !c
            .link
            .answer(id.slot, id.gen, Answer::GrantPipe(lanes.len() as u8))
        {
            self.server
                .scope_mut(&key)
                .expect("decided on it")
                .grants
                .remove(&id);
            self.ungrant(id.conn);
            return None;
        }
        self.sockets.attach(id.conn, at, ends);
        let pieces = remote.iter().map(|&(a, l)| (a as usize, l as usize)).collect();
        self.start_feed(
            FeedFor::Grant(id),
            id.conn,
            Some((key, state)),
            pipe::Feeding {
                pid,
                lanes,
                pieces,
                ended: Arc::default(),
                wake,
            },
        );
        None
    }

    /// A host write the policy let through from a peer this side cannot read: reads the pipes it
    /// passed (`fds`, checked) into the writable's `remote` ranges, in order, on the copy pool.
    fn pipe_write(
        &mut self,
        id: RequestId,
        key: &str,
        remote: &[(u64, u64)],
        fds: pipe::Ends,
    ) -> Option<Answer> {
        // (`fds` dropped on a return below are closed on the pipes' closer.)
        let wake = match pipe::Wake::new() {
            Ok(w) => Arc::new(w),
            Err(e) => return Some(Answer::Fallback(format!("the passive side has no eventfd: {e}"))),
        };
        let w = match self.claim_writable(id, key) {
            Ok(w) => w,
            Err(a) => return Some(a),
        };
        if let Some(s) = self.server.scope_mut(key) {
            if let Some(writer) = &mut s.writer {
                writer.wake = Some(wake.clone());
            }
        }
        let pid = self.sockets.get(id.conn).map_or(w.pid, |c| c.pool_key());
        let copy = AnyCopy::Filled(pipe::Fill {
            pid,
            lanes: fds,
            pieces: remote.iter().map(|&(a, l)| (a as usize, l as usize)).collect(),
            slot: w.slot,
            cancel: w.cancel,
            wake,
        });
        self.in_flight.start(copy, w.owner);
        None
    }

    /// Claims the writable keyed `key` for the write `id` the policy let through: marks it in
    /// use (its owner may have ended it an instant ago: then the answer is "not live") and makes
    /// `id` its writer. What the copy into it needs.
    pub(super) fn claim_writable(&mut self, id: RequestId, key: &str) -> Result<Claim, Answer> {
        let c = self.sockets.get(id.conn).expect("decided on it");
        let (pid, pidfd, table) = (c.peer_pid, c.pidfd.clone(), c.slots.clone().expect("ready"));
        let key = self.server.key(key).expect("decided on it");
        let s = self.server.scope_mut(&key).expect("decided on it");
        if !s.state.try_mark_in_use() {
            return Err(answer_of(policy::ended()));
        }
        let cancel = Arc::new(AtomicBool::new(false));
        s.writer = Some(Writer {
            id,
            cancel: cancel.clone(),
            wake: None,
        });
        Ok(Claim {
            device: s.device,
            pid,
            slot: SlotRef {
                table,
                idx: id.slot,
                gen: id.gen,
            },
            cancel,
            owner: CopyOwner::Write {
                state: s.state.clone(),
                key,
                id,
                pidfd,
            },
        })
    }

    /// A read grant of connection `i` ended.
    pub(super) fn ungrant(&mut self, i: ConnId) {
        if let Some(c) = self.sockets.get_mut(i) {
            c.granted = c.granted.saturating_sub(1);
        }
    }

    /// Server side: the reader finished copying a granted read of the operation keyed `key`.
    pub(super) fn on_read_done(&mut self, id: RequestId, ok: bool, key: &str, out: &mut Vec<Event>) {
        let Some(key) = self.server.key(key) else { return };
        let s = self.server.scope_mut(&key).expect("found");
        if !s.grants.remove(&id) {
            return;
        }
        if ok {
            // Completed: a request heard later in this turn finds it done.
            s.done = true;
        }
        self.ungrant(id.conn);
        if let Some(f) = self.feeds.end(FeedFor::Grant(id)) {
            // Complete once its pipes are empty (`copies.rs`).
            f.answered = Some(ok);
            return;
        }
        if ok {
            out.push(Event::PassiveCompleted {
                key,
                path: TransferPath::SameHost,
            });
        }
    }

    /// Tells the writer copying into the writable keyed `key`, if any, to stop.
    pub(super) fn release_writer(&mut self, key: &str) {
        if let Some(s) = self.server.scope(key) {
            s.cancel_writer();
        }
    }
}

/// A writable claimed for one write: what the copy into it needs.
pub(super) struct Claim {
    /// Where the writable's memory is.
    pub(super) device: Device,
    /// The writer's pid (its memory is read by it).
    pub(super) pid: i32,
    /// The writer's slot for this request (the copy checks and ends it).
    pub(super) slot: SlotRef,
    /// Set to stop the copy.
    pub(super) cancel: Arc<AtomicBool>,
    /// Who learns of the copy's end.
    pub(super) owner: CopyOwner,
}

/// The answer that carries a refusal or a fallback decided by the policy.
fn answer_of(d: Decision) -> Answer {
    match d {
        Decision::Refuse(code, reason) => Answer::Refuse(code, reason),
        Decision::Fallback(reason) => Answer::Fallback(reason),
        other => unreachable!("{other:?} is not an answer"),
    }
}

#[cfg(test)]
mod tests;
