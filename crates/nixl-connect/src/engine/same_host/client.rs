//! The active side: the handshake as a client, requests for access, grants and answers, and
//! the operations' phases.

use std::io;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use super::auth;
use super::eager;
use super::feeds::FeedFor;
use super::limits::{MAX_PIPES, MAX_PIPES_PER_CONN};
use super::link::grant_ipc_len;
#[cfg(feature = "cuda")]
use super::records::ExportDone;
use super::records::{Act, AnyCopy, ConnId, CopyOwner, Phase, RequestId};
use super::sys;
use super::sys::cma::{Copy, Piece, SlotRef};
#[cfg(feature = "cuda")]
use super::sys::ipc;
use super::sys::pipe;
use super::sys::slots::SlotTable;
use super::transport::SameHostTransport;
use super::violation::Violation;
use super::wire::{passed_fds, IpcSource, Req, EAGER_MAX, MAX_FRAME};
use crate::device::Device;
use crate::engine::transport::{Event, OpId};
use crate::error::Error;
use crate::reg::Range;
use crate::state::Mechanism;

/// Requests open on a connection below which a small host operation carries its bytes in its
/// frames (see [`EAGER_MAX`]); at or above it, it takes a grant and the copy pool.
const EAGER_OPEN: usize = 4;

impl SameHostTransport {
    /// Sends the core's `Hello` with the slot table's descriptor attached.
    pub(super) fn send_hello(&mut self, i: ConnId) -> io::Result<()> {
        let c = self.sockets.get_mut(i).expect("live connection");
        let table = Arc::new(SlotTable::create()?);
        // Nothing about this process but the key's hash and a nonce: the server proves it holds
        // the key before anything else is sent.
        let buf = c.link.out();
        let n = sys::send_with_fds(c.fd.as_raw_fd(), buf, &[table.fd().as_raw_fd()])?;
        if n != buf.len() {
            // A fresh connection's buffer always takes a few dozen bytes; anything else is broken.
            return Err(io::Error::other("the hello did not fit the socket"));
        }
        c.link.sent(n);
        c.slots = Some(table);
        Ok(())
    }

    /// Client: the server proved it holds the opening operation's key; the queued requests go.
    pub(super) fn on_ready(&mut self, i: ConnId, out: &mut Vec<Event>) {
        let Some(c) = self.sockets.get_mut(i) else { return };
        let queued = std::mem::take(&mut c.queued);
        for id in queued {
            self.request(id, out);
        }
    }

    pub(super) fn decline_queued(&mut self, i: ConnId, reason: &str, out: &mut Vec<Event>) {
        let queued = self
            .sockets
            .get_mut(i)
            .map(|c| std::mem::take(&mut c.queued))
            .unwrap_or_default();
        for id in queued {
            if let Some(a) = self.client.remove(id) {
                self.free_slot(i, a.slot, a.gen);
                if !matches!(a.phase, Phase::Abandoned) {
                    out.push(Event::Declined {
                        spec: a.spec,
                        reason: reason.into(),
                    });
                }
            }
        }
    }

    /// Hands a queued operation to the next transport, freeing its slot.
    pub(super) fn decline_act(&mut self, id: OpId, reason: &str, out: &mut Vec<Event>) {
        let a = self.client.remove(id).expect("present");
        self.free_slot(a.conn, a.slot, a.gen);
        out.push(Event::Declined {
            spec: a.spec,
            reason: reason.into(),
        });
    }

    pub(super) fn take_act(&mut self, i: ConnId, slot: u32, gen: u64) -> Option<(OpId, Act)> {
        let id = self.client.by_request(RequestId { conn: i, slot, gen })?;
        self.client.remove(id).map(|a| (id, a))
    }

    pub(super) fn free_slot(&mut self, i: ConnId, slot: u32, gen: u64) {
        if let Some(c) = self.sockets.get_mut(i) {
            if c.client && c.gens.get(slot as usize) == Some(&gen) {
                if let Some(t) = &c.slots {
                    t.free(slot, gen);
                }
                c.free_slots.push(slot);
            }
        }
    }

    /// Sends the request of a queued operation (the handshake is done); a write from device
    /// memory exports its source first.
    pub(super) fn request(&mut self, id: OpId, out: &mut Vec<Event>) {
        let Some(a) = self.client.get_mut(id) else { return };
        #[cfg(feature = "cuda")]
        if a.spec.write && a.device && a.sources.is_empty() {
            a.phase = Phase::Exporting;
            // A server that takes descriptors gets VMM descriptors for memory without a legacy
            // handle, and for all memory in another PID namespace (legacy handles do not open
            // there).
            let how = match self.sockets.get(a.conn) {
                Some(c) if c.link.passes_descriptors() => ipc::ExportAs::Descriptors {
                    other_namespace: c.other_pid_ns,
                },
                _ => ipc::ExportAs::Handles,
            };
            let conn = a.conn;
            let ranges = a
                .spec
                .local
                .iter()
                .map(|r| (r.addr as u64, r.len as u64))
                .collect();
            let done = self.in_flight.export_done();
            let to = ipc::ExportTo {
                conn,
                how,
                tell: self.teller(),
            };
            ipc::export(
                to,
                ranges,
                Box::new(move |result| done(ExportDone::Write { id, result })),
            );
            return;
        }
        // A small host operation carries its bytes in a frame (a write's in its request, a
        // read's in the answer): each side copies only its own memory, and needs no pull.
        // Only while few requests are open on the connection: many small operations at once go
        // faster as grants, their copies batched on the pool (64 outstanding 4 KiB reads: 50K/s
        // eager, 120K/s batched), where the frames and MACs of eager ones load the engines.
        // Always where this side may not pull (ptrace rules): a grant could not be served.
        let host = |r: &[Range]| r.iter().all(|r| r.device == Device::Host);
        let total = a.spec.remote.iter().fold(0usize, |t, r| t.saturating_add(r.len));
        let few = self
            .sockets
            .get(a.conn)
            .is_some_and(|c| !c.can_pull || c.link.open_requests() < EAGER_OPEN);
        let small = few && (1..=EAGER_MAX).contains(&total) && host(&a.spec.local) && host(&a.spec.remote);
        let eager = small && !a.spec.write;
        let data = if small && a.spec.write {
            eager::read_act(a)
        } else {
            Vec::new()
        };
        let c = self.sockets.get_mut(a.conn).expect("live");
        // Host memory of a peer this side cannot read (another PID namespace, ptrace rules)
        // moves through pipes: a read's fed by the server, a write's by this side.
        let piped = !small
            && host(&a.spec.local)
            && host(&a.spec.remote)
            && if a.spec.write {
                c.link.writes_piped()
            } else {
                !c.can_pull
            };
        if !a.spec.write && !a.device && !eager && !c.can_pull && !piped {
            self.decline_act(
                id,
                "the kernel does not let this process read the peer's memory (ptrace rules), and \
                 pipes carry only host memory",
                out,
            );
            return;
        }
        let lanes = if piped { pipe::lanes_for(total) } else { 0 };
        if piped
            && (self.feeds.lanes_of(a.conn) + lanes > MAX_PIPES_PER_CONN
                || self.feeds.lanes() + lanes > MAX_PIPES)
        {
            self.decline_act(id, "too many same-host pipes are open now", out);
            return;
        }
        let feeding = if piped && a.spec.write {
            match pipe::Lanes::new(lanes).and_then(|l| Ok((l, Arc::new(pipe::Wake::new()?)))) {
                Ok(f) => Some(f),
                Err(e) => {
                    self.decline_act(id, &format!("cannot make pipes for a same-host write: {e}"), out);
                    return;
                }
            }
        } else {
            None
        };
        let a = self.client.get_mut(id).expect("present");
        let c = self.sockets.get_mut(a.conn).expect("live");
        let req_sources_empty = a.sources.is_empty();
        let source_fds = std::mem::take(&mut a.source_fds);
        // A device read by a side that takes VMM descriptors asks for them (`pipes: 1` on a
        // device read): the server then passes them where legacy handles cannot serve.
        let vmm_read = a.device && !a.spec.write && c.link.takes_exports();
        let req = Req {
            slot: a.slot,
            gen: a.gen,
            write: a.spec.write,
            ident: a.spec.peer.identity,
            key_id: auth::key_id(&a.spec.key),
            device: a.spec.remote.first().map_or(Device::Host, |r| r.device),
            remote: a
                .spec
                .remote
                .iter()
                .map(|r| (r.addr as u64, r.len as u64))
                .collect(),
            local: if a.spec.write && data.is_empty() && !piped {
                a.spec
                    .local
                    .iter()
                    .map(|r| (r.addr as u64, r.len as u64))
                    .collect()
            } else {
                Vec::new()
            },
            sources: std::mem::take(&mut a.sources),
            eager,
            data,
            pipes: if vmm_read { 1 } else { lanes as u8 },
        };
        // A request the server could not accept, or whose answer could not come back in one frame
        // (too many ranges), takes NIXL rather than breaking the connection others use.
        let reply = if a.device && !a.spec.write {
            grant_ipc_len(a.spec.remote.len())
        } else {
            0
        };
        if req.frame_len() > MAX_FRAME || reply > MAX_FRAME {
            self.decline_act(id, "too many ranges for one same-host request", out);
            return;
        }
        a.phase = Phase::Requested;
        // How the bytes move, as far as the request decides it (a read's grant says the rest).
        let mechanism = if small {
            Some(Mechanism::Frames)
        } else if piped {
            Some(Mechanism::Pipes)
        } else if a.spec.write && !source_fds.is_empty() {
            Some(Mechanism::CudaVmm)
        } else if a.spec.write && !req_sources_empty {
            Some(Mechanism::CudaIpc)
        } else if a.spec.write {
            Some(Mechanism::CrossMemoryAttach)
        } else {
            None
        };
        if let Some(m) = mechanism {
            a.spec.state.set_mechanism(m);
        }
        // Queued in the core; sent with everything else queued this turn, at the end of the
        // transport's progress (a write's pipes with it).
        let at = c.link.queued_end();
        if !c.link.request(&a.spec.key, req) {
            self.decline_act(id, "the same-host connection cannot take the request", out);
            return;
        }
        let feed_key = c.feed_key();
        if !source_fds.is_empty() {
            self.sockets.attach(a.conn, at, pipe::Ends::new(source_fds));
        }
        if let Some((mut lanes, wake)) = feeding {
            let (conn, pid) = (a.conn, feed_key);
            let pieces = a.spec.local.iter().map(|r| (r.addr, r.len)).collect();
            self.sockets.attach(conn, at, lanes.take_read_ends());
            self.start_feed(
                FeedFor::Write(id),
                conn,
                None,
                pipe::Feeding {
                    pid,
                    lanes,
                    pieces,
                    ended: Arc::default(),
                    wake,
                },
            );
        }
    }

    /// Client: a grant came for a read abandoned meanwhile: it ends (the server is told, so its
    /// grant ends too) and its slot is free.
    fn end_abandoned_grant(&mut self, i: ConnId, id: OpId, slot: u32, gen: u64) {
        let a = self.client.remove(id).expect("present");
        if let Some(c) = self.sockets.get_mut(i) {
            c.link.read_done(slot, gen, false, "cancelled");
        }
        self.free_slot(i, a.slot, a.gen);
    }

    /// Client: a host read may copy from `lanes` pipes the server feeds, whose read ends came
    /// with the grant (taken here first, whatever became of the read, so the next frame's are
    /// the next ones).
    pub(super) fn on_grant_pipe(&mut self, i: ConnId, slot: u32, gen: u64, lanes: u8, out: &mut Vec<Event>) {
        let Some(fds) = self.sockets.take_pipes(i, lanes as usize) else {
            return; // not pipes: the connection is killed; its operations end with it
        };
        // (`fds` dropped on a return below are closed on the pipes' closer.)
        let Some(id) = self.client.by_request(RequestId { conn: i, slot, gen }) else {
            return;
        };
        let a = self.client.get_mut(id).expect("found");
        if matches!(a.phase, Phase::Abandoned) {
            self.end_abandoned_grant(i, id, slot, gen);
            return;
        }
        let wake = match pipe::Wake::new() {
            Ok(w) => Arc::new(w),
            Err(e) => {
                let a = self.client.remove(id).expect("present");
                if let Some(c) = self.sockets.get_mut(i) {
                    c.link.read_done(slot, gen, false, "no eventfd");
                }
                self.free_slot(i, a.slot, a.gen);
                out.push(Event::ActiveEnded {
                    id,
                    result: Err(Error::os("an eventfd for a same-host read", e)),
                });
                return;
            }
        };
        a.phase = Phase::Copying;
        a.wake = Some(wake.clone());
        let c = self.sockets.get(i).expect("live");
        a.pidfd = c.pidfd.clone();
        let copy = AnyCopy::Filled(pipe::Fill {
            pid: c.pool_key(),
            lanes: fds,
            pieces: a.spec.local.iter().map(|r| (r.addr, r.len)).collect(),
            slot: SlotRef {
                table: c.slots.clone().expect("ready"),
                idx: slot,
                gen,
            },
            cancel: a.cancel.clone(),
            wake,
        });
        self.in_flight.start(copy, CopyOwner::Read(id));
    }

    /// Client: an eager read's bytes came (proven, exactly as many as requested): copied into
    /// the reader's memory here, and the read is over.
    pub(super) fn on_data(&mut self, i: ConnId, slot: u32, gen: u64, data: &[u8], out: &mut Vec<Event>) {
        let Some((id, a)) = self.take_act(i, slot, gen) else {
            return;
        };
        self.free_slot(i, slot, gen);
        if matches!(a.phase, Phase::Abandoned) {
            return;
        }
        let result = if eager::write_act(&a, data) {
            Ok(())
        } else {
            Err(Error::Transfer {
                agent: a.spec.peer.name.to_string(),
                reason: "the same-host answer does not fit the read's memory".into(),
                source: None,
            })
        };
        out.push(Event::ActiveEnded { id, result });
    }

    pub(super) fn on_grant(
        &mut self,
        i: ConnId,
        slot: u32,
        gen: u64,
        sources: Option<Vec<IpcSource>>,
        out: &mut Vec<Event>,
    ) {
        // VMM descriptors passed with the grant are taken first, whatever follows, so the next
        // frame's are the next ones (one that is no NVIDIA device's kills the connection); any
        // dropped below are closed on the closer.
        let n = sources.as_deref().and_then(passed_fds).unwrap_or(0);
        let fds = if n > 0 {
            match self.sockets.take_cuda_exports(i, n) {
                Some(f) => {
                    self.sockets
                        .name_exports(i, sources.as_deref().unwrap_or_default());
                    pipe::Ends::new(f)
                }
                None => return,
            }
        } else {
            pipe::Ends::new(Vec::new())
        };
        let Some(id) = self.client.by_request(RequestId { conn: i, slot, gen }) else {
            return;
        };
        let a = self.client.get_mut(id).expect("found");
        // The grant must be of the kind asked for, and an IPC grant must match the ranges.
        let fits = match &sources {
            None => !a.device,
            Some(v) => {
                a.device
                    && v.len() == a.spec.local.len()
                    && v.iter().zip(&a.spec.local).all(|(s, l)| s.len == l.len as u64)
            }
        };
        if !fits && !matches!(a.phase, Phase::Abandoned) {
            tracing::debug!("a same-host grant that does not fit its request; closing the connection");
            if let Some(c) = self.sockets.get_mut(i) {
                c.link.kill(Violation::GrantDoesNotFit);
            }
            return;
        }
        if matches!(a.phase, Phase::Abandoned) {
            self.end_abandoned_grant(i, id, slot, gen);
            return;
        }
        a.phase = Phase::Copying;
        let c = self.sockets.get(i).expect("live");
        a.pidfd = c.pidfd.clone();
        a.spec
            .state
            .set_mechanism(match (&sources, a.spec.local.first().map(|r| r.device)) {
                (Some(_), _) if n > 0 => Mechanism::CudaVmm,
                (Some(_), _) => Mechanism::CudaIpc,
                (None, Some(Device::Cuda(_))) => Mechanism::PinnedStaging,
                (None, _) => Mechanism::CrossMemoryAttach,
            });
        #[cfg(feature = "cuda")]
        if let Some(sources) = sources {
            let copy = AnyCopy::Device(ipc::Copy {
                conn: i,
                pid: c.peer_pid,
                pieces: a
                    .spec
                    .local
                    .iter()
                    .zip(sources)
                    .map(|(l, src)| ipc::Piece {
                        dst: l.addr as u64,
                        src,
                    })
                    .collect(),
                fds: fds.into_vec(),
                slot: SlotRef {
                    table: c.slots.clone().expect("ready"),
                    idx: slot,
                    gen,
                },
                cancel: a.cancel.clone(),
            });
            self.in_flight.start(copy, CopyOwner::Read(id));
            return;
        }
        let _ = (sources, fds);
        let copy = Copy {
            pid: c.peer_pid,
            pieces: a
                .spec
                .local
                .iter()
                .zip(&a.spec.remote)
                .map(|(l, r)| Piece {
                    local: l.addr,
                    remote: r.addr,
                    len: l.len,
                })
                .collect(),
            slot: SlotRef {
                table: c.slots.clone().expect("ready"),
                idx: slot,
                gen,
            },
            cancel: a.cancel.clone(),
        };
        let copy = AnyCopy::pulled_into(copy, a.spec.local.first().map(|r| r.device));
        self.in_flight.start(copy, CopyOwner::Read(id));
        let _ = out;
    }
}
