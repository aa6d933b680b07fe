//! The active side: the handshake as a client, requests for access, grants and answers, and
//! the operations' phases.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::time::Instant;

use super::auth;
use super::cma::{self, Copy, Piece, SlotRef};
#[cfg(feature = "cuda")]
use super::ipc;
use super::proto::{IpcSource, Msg, RefuseCode, MAX_FRAME, VERSION};
#[cfg(feature = "cuda")]
use super::records::ExportDone;
use super::records::{refused, Act, AnyCopy, ConnId, CopyOwner, Expect, Phase};
use super::slots::SlotTable;
use super::state::{LocalTransport, MAX_NEGATIVE, NOT_LIVE};
use super::sys::self_pid;
use crate::device::Device;
use crate::engine::transport::{Event, OpId};
#[cfg(feature = "cuda")]
use crate::sync::Recover;

impl LocalTransport {
    /// Whether a client-side operation on `i` in its current phase may receive frame `e`.
    pub(super) fn expects(&self, i: ConnId, slot: u32, gen: u64, e: Expect) -> bool {
        self.acts
            .values()
            .find(|a| a.conn == i && a.slot == slot && a.gen == gen)
            .is_some_and(|a| match (e, &a.phase) {
                (_, Phase::Abandoned) => true,
                (Expect::Grant, Phase::Requested) => !a.spec.write,
                (Expect::Answer, Phase::Requested) => true,
                (Expect::WriteDone, Phase::Requested) => a.spec.write,
                _ => false,
            })
    }

    /// Sends `Hello` with the slot table's descriptor attached.
    #[allow(unsafe_code)]
    pub(super) fn send_hello(&mut self, i: ConnId, key: &str) -> io::Result<()> {
        let c = self.conns.get_mut(&i).expect("live connection");
        let table = Arc::new(SlotTable::create()?);
        let mut buf = Vec::new();
        // Nothing about this process but the key's hash and a nonce: the server proves it holds
        // the key before anything else is sent.
        Msg::Hello {
            version: VERSION,
            key_id: auth::key_id(key),
            nonce: c.nonce,
        }
        .encode(&mut buf);
        let fd = table.fd().as_raw_fd();
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        // SAFETY: CMSG_SPACE is a pure size computation.
        let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
        let mut cbuf = vec![0u64; space.div_ceil(8)];
        // SAFETY: msghdr is plain old data; the pointers set below outlive the sendmsg call, and
        // the control buffer is large enough for one SCM_RIGHTS descriptor (CMSG_SPACE).
        let n = unsafe {
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_iov = &mut iov;
            msg.msg_iovlen = 1;
            msg.msg_control = cbuf.as_mut_ptr().cast();
            msg.msg_controllen = space as _;
            let cm = libc::CMSG_FIRSTHDR(&msg);
            (*cm).cmsg_level = libc::SOL_SOCKET;
            (*cm).cmsg_type = libc::SCM_RIGHTS;
            (*cm).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
            std::ptr::write_unaligned(libc::CMSG_DATA(cm).cast::<RawFd>(), fd);
            libc::sendmsg(c.fd.as_raw_fd(), &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT)
        };
        if n != buf.len() as isize {
            // A fresh connection's buffer always takes a few dozen bytes; anything else is broken.
            return Err(io::Error::other("the hello did not fit the socket"));
        }
        c.slots = Some(table);
        Ok(())
    }

    pub(super) fn on_welcome(&mut self, i: ConnId, proof: Option<auth::Tag>, out: &mut Vec<Event>) {
        let c = self.conns.get_mut(&i).expect("live");
        if c.ready {
            c.dead = true;
            return;
        }
        let key = c.opening_key.take().expect("set by try_connect");
        let Some(proof) = proof else {
            // The server has no live operation with the opening key: refuse that operation as a
            // replay (it must not go on to NIXL and read stale memory). Nothing was revealed; the
            // others queued behind it take NIXL, and the connection is opened afresh next time.
            c.dead = true;
            let peer = c.peer.clone();
            let queued = std::mem::take(&mut c.queued);
            for id in queued {
                let Some(a) = self.acts.remove(&id) else { continue };
                self.free_slot(i, a.slot, a.gen);
                if matches!(a.phase, Phase::Abandoned) {
                    continue;
                }
                if a.spec.key == key {
                    out.push(Event::ActiveEnded {
                        id,
                        result: Err(refused(peer.to_string(), RefuseCode::NotLive, NOT_LIVE.into())),
                    });
                } else {
                    out.push(Event::Declined {
                        spec: a.spec,
                        reason: "the same-host connection closed before its request".into(),
                    });
                }
            }
            return;
        };
        if !auth::same(
            &proof,
            &auth::welcome_proof(&key, &c.nonce, self_pid(), c.peer_pid),
        ) {
            // Not the process that made the operation: another one holds the socket name. It
            // learnt a key hash and a nonce; nothing else is sent, nothing it says is believed.
            tracing::warn!(
                peer = %c.peer,
                pid = c.peer_pid,
                "the process on this peer's same-host socket could not prove it holds the \
                 operation's key (an impostor?); using NIXL"
            );
            c.dead = true;
            let peer = c.peer.clone();
            self.refused_peers += 1;
            self.decline_queued(
                i,
                "the process on the peer's same-host socket could not prove it holds the \
                 operation's key (another process holds the socket name)",
                out,
            );
            if self.negative.len() >= MAX_NEGATIVE {
                self.negative.clear();
            }
            self.negative.insert(peer, Instant::now());
            return;
        }
        c.can_pull = c.pidfd.as_deref().is_some_and(cma::may_pull);
        c.ready = true;
        c.send(&Msg::Trusted);
        let queued = std::mem::take(&mut c.queued);
        for id in queued {
            self.request(id, out);
        }
    }

    pub(super) fn decline_queued(&mut self, i: ConnId, reason: &str, out: &mut Vec<Event>) {
        let queued = self
            .conns
            .get_mut(&i)
            .map(|c| std::mem::take(&mut c.queued))
            .unwrap_or_default();
        for id in queued {
            if let Some(a) = self.acts.remove(&id) {
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
        let a = self.acts.remove(&id).expect("present");
        self.free_slot(a.conn, a.slot, a.gen);
        out.push(Event::Declined {
            spec: a.spec,
            reason: reason.into(),
        });
    }

    pub(super) fn take_act(&mut self, i: ConnId, slot: u32, gen: u64) -> Option<(OpId, Act)> {
        let id = self
            .acts
            .iter()
            .find(|(_, a)| a.conn == i && a.slot == slot && a.gen == gen)
            .map(|(id, _)| *id)?;
        self.acts.remove(&id).map(|a| (id, a))
    }

    pub(super) fn free_slot(&mut self, i: ConnId, slot: u32, gen: u64) {
        if let Some(c) = self.conns.get_mut(&i) {
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
        let Some(a) = self.acts.get_mut(&id) else { return };
        #[cfg(feature = "cuda")]
        if a.spec.write && a.device && a.sources.is_empty() {
            a.phase = Phase::Exporting;
            let ranges = a
                .spec
                .local
                .iter()
                .map(|r| (r.addr as u64, r.len as u64))
                .collect();
            let (exports, waker) = (self.exports.clone(), self.waker.clone());
            ipc::export(
                ranges,
                Box::new(move |result| {
                    exports.lock().recover().push(ExportDone::Write { id, result });
                    waker.wake_always();
                }),
            );
            return;
        }
        let c = self.conns.get_mut(&a.conn).expect("live");
        if !a.spec.write && !a.device && !c.can_pull {
            self.decline_act(
                id,
                "the kernel does not let this process read the peer's memory (ptrace rules)",
                out,
            );
            return;
        }
        // A request the server could not accept (too many ranges for one frame) takes NIXL,
        // rather than breaking the connection every other operation uses.
        let frame = 64 + 16 * (a.spec.remote.len() + a.spec.local.len()) + 128 * a.sources.len();
        if frame > MAX_FRAME {
            self.decline_act(id, "too many ranges for one same-host request", out);
            return;
        }
        a.phase = Phase::Requested;
        let req = Msg::Req {
            slot: a.slot,
            gen: a.gen,
            write: a.spec.write,
            ident: a.spec.remote_ident,
            key_id: auth::key_id(&a.spec.key),
            mac: auth::req_mac(
                &a.spec.key,
                &c.nonce,
                self_pid(),
                c.peer_pid,
                a.slot,
                a.gen,
                a.spec.write,
            ),
            device: a.spec.remote.first().map_or(Device::Host, |r| r.device),
            remote: a
                .spec
                .remote
                .iter()
                .map(|r| (r.addr as u64, r.len as u64))
                .collect(),
            local: if a.spec.write {
                a.spec
                    .local
                    .iter()
                    .map(|r| (r.addr as u64, r.len as u64))
                    .collect()
            } else {
                Vec::new()
            },
            sources: std::mem::take(&mut a.sources),
        };
        c.send(&req);
        let i = a.conn;
        self.flush(i);
    }

    pub(super) fn on_grant(
        &mut self,
        i: ConnId,
        slot: u32,
        gen: u64,
        sources: Option<Vec<IpcSource>>,
        out: &mut Vec<Event>,
    ) {
        let Some((&id, a)) = self
            .acts
            .iter_mut()
            .find(|(_, a)| a.conn == i && a.slot == slot && a.gen == gen)
        else {
            return;
        };
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
            if let Some(c) = self.conns.get_mut(&i) {
                c.dead = true;
            }
            return;
        }
        if matches!(a.phase, Phase::Abandoned) {
            let a = self.acts.remove(&id).expect("present");
            if let Some(c) = self.conns.get_mut(&i) {
                c.send(&Msg::Done {
                    slot,
                    gen,
                    ok: false,
                    reason: "cancelled".into(),
                });
            }
            self.free_slot(i, a.slot, a.gen);
            return;
        }
        a.phase = Phase::Copying;
        let c = self.conns.get(&i).expect("live");
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
            self.start_copy(copy, CopyOwner::Read(id));
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
        self.start_copy(copy, CopyOwner::Read(id));
        let _ = out;
    }
}
