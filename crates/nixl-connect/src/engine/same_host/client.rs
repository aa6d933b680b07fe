//! The active side: the handshake as a client, requests for access, grants and answers, and
//! the operations' phases.

use std::io;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use super::auth;
use super::eager;
use super::link::grant_ipc_len;
#[cfg(feature = "cuda")]
use super::records::ExportDone;
use super::records::{Act, AnyCopy, ConnId, CopyOwner, Phase, RequestId};
use super::sys;
use super::sys::cma::{self, Copy, Piece, SlotRef};
#[cfg(feature = "cuda")]
use super::sys::ipc;
use super::sys::slots::SlotTable;
use super::transport::SameHostTransport;
use super::violation::Violation;
use super::wire::{IpcSource, Msg, EAGER_MAX, MAX_FRAME};
use crate::device::Device;
use crate::engine::transport::{Event, OpId};
use crate::error::Error;
use crate::reg::Range;

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
        let n = sys::send_with_fd(c.fd.as_raw_fd(), buf, table.fd().as_raw_fd())?;
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
        c.can_pull = c.pidfd.as_deref().is_some_and(cma::may_pull);
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
            let ranges = a
                .spec
                .local
                .iter()
                .map(|r| (r.addr as u64, r.len as u64))
                .collect();
            let done = self.in_flight.export_done();
            ipc::export(
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
        if !a.spec.write && !a.device && !eager && !c.can_pull {
            self.decline_act(
                id,
                "the kernel does not let this process read the peer's memory (ptrace rules)",
                out,
            );
            return;
        }
        let req = Msg::Req {
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
            local: if a.spec.write && data.is_empty() {
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
        };
        // A request the server could not accept, or whose answer could not come back in one frame
        // (too many ranges), takes NIXL rather than breaking the connection others use.
        let reply = if a.device && !a.spec.write {
            grant_ipc_len(a.spec.remote.len())
        } else {
            0
        };
        if req.encoded_len() > MAX_FRAME || reply > MAX_FRAME {
            self.decline_act(id, "too many ranges for one same-host request", out);
            return;
        }
        a.phase = Phase::Requested;
        // Queued in the core; sent with everything else queued this turn, at the end of the
        // transport's progress.
        if !c.link.request(&a.spec.key, &req) {
            self.decline_act(id, "the same-host connection cannot take the request", out);
        }
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
            let a = self.client.remove(id).expect("present");
            if let Some(c) = self.sockets.get_mut(i) {
                c.link.read_done(slot, gen, false, "cancelled");
            }
            self.free_slot(i, a.slot, a.gen);
            return;
        }
        a.phase = Phase::Copying;
        let c = self.sockets.get(i).expect("live");
        a.pidfd = c.pidfd.clone();
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
        let _ = sources;
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
