//! The passive side: the handshake as a server, and the scope policy that decides what a peer's
//! request may reach (keys, ranges, direction, one writer, grants per connection).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::auth::{self, KeyId, Nonce};
use super::cma::{self, Copy, Piece, SlotRef};
use super::device::device_path_refusal;
use super::proto::{IpcSource, Msg, RefuseCode, VERSION};
use super::records::{AnyCopy, ConnId, CopyOwner};
use super::slots::SlotTable;
use super::state::{LocalTransport, MAX_GRANTS_PER_CONN, NOT_LIVE};
use super::sys::self_pid;
use crate::device::Device;
use crate::engine::transport::Event;
use crate::metadata::OperationKind;

impl LocalTransport {
    pub(super) fn on_hello(&mut self, i: ConnId, version: u32, key_id: KeyId, nonce: Nonce) {
        let key = self.key_ids.get(&key_id).cloned();
        let c = self.conns.get_mut(&i).expect("live");
        if c.ready || c.slots.is_some() {
            c.dead = true;
            return;
        }
        let table = match c.fds_in.pop_front().map(SlotTable::open) {
            Some(Ok(t)) => t,
            _ => {
                c.dead = true;
                return;
            }
        };
        if version != VERSION {
            c.send(&Msg::Reject {
                reason: format!("protocol version {version}; this side speaks {VERSION}"),
            });
            c.dead = true;
            return;
        }
        c.slots = Some(Arc::new(table));
        c.nonce = nonce;
        c.ready = true;
        // The proof that this process holds the opening operation's key (none if it has no such
        // live operation: the client then refuses that operation as a replay).
        let proof = key.map(|k| auth::welcome_proof(&k, &nonce, c.peer_pid, self_pid()));
        c.send(&Msg::Welcome { proof });
    }

    /// Server side: the client trusted our proof; its requests follow.
    pub(super) fn on_trusted(&mut self, i: ConnId) {
        let c = self.conns.get_mut(&i).expect("live");
        if !c.ready || c.trusted {
            c.dead = true;
            return;
        }
        c.trusted = true;
        c.can_pull = c.pidfd.as_deref().is_some_and(cma::may_pull);
    }

    /// Server side: the key a request names, if the client proved it holds it. Otherwise the
    /// request is refused (an unknown key id: a replay) or the connection closed (a bad proof).
    pub(super) fn proven_key(
        &mut self,
        i: ConnId,
        slot: u32,
        gen: u64,
        write: bool,
        key_id: &KeyId,
        mac: &auth::Tag,
    ) -> Option<Arc<str>> {
        let key = self.key_ids.get(key_id).cloned();
        let c = self.conns.get_mut(&i).expect("live");
        if !c.trusted {
            c.dead = true;
            return None;
        }
        let Some(key) = key else {
            c.send(&Msg::Refuse {
                slot,
                gen,
                code: RefuseCode::NotLive,
                reason: NOT_LIVE.into(),
            });
            self.flush(i);
            return None;
        };
        let want = auth::req_mac(&key, &c.nonce, c.peer_pid, self_pid(), slot, gen, write);
        if !auth::same(&want, mac) {
            tracing::warn!(
                pid = c.peer_pid,
                "a same-host request without proof of its key; closing"
            );
            c.dead = true;
            return None;
        }
        Some(key)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn on_req(
        &mut self,
        i: ConnId,
        slot: u32,
        gen: u64,
        write: bool,
        key: &str,
        device: Device,
        remote: Vec<(u64, u64)>,
        local: Vec<(u64, u64)>,
        sources: Vec<IpcSource>,
        out: &mut Vec<Event>,
    ) {
        let c = self.conns.get_mut(&i).expect("live");
        if !c.ready {
            c.dead = true;
            return;
        }
        let (can_pull, peer_pid, peer_pidfd) = (c.can_pull, c.peer_pid, c.pidfd.clone());
        let refuse = |code, reason: String| Msg::Refuse {
            slot,
            gen,
            code,
            reason,
        };
        let answer = match self.scopes.get_mut(key) {
            None => Some(refuse(RefuseCode::NotLive, NOT_LIVE.into())),
            Some(s) if (s.kind == OperationKind::Write) != write => Some(refuse(
                RefuseCode::WrongDirection,
                format!(
                    "the operation is a {}able; a {} cannot use it",
                    if s.kind == OperationKind::Write {
                        "writ"
                    } else {
                        "read"
                    },
                    if write { "write" } else { "read" }
                ),
            )),
            Some(s) if device != s.device => Some(Msg::Fallback {
                slot,
                gen,
                reason: format!(
                    "the request names memory on {device}; the operation's is on {}",
                    s.device
                ),
            }),
            Some(s) if s.state.status().is_terminal() => Some(refuse(
                RefuseCode::NotLive,
                "the operation has ended (completed, cancelled or dropped)".into(),
            )),
            Some(s) if remote.is_empty() || !remote.iter().all(|&(a, l)| s.contains(a, l)) => Some(refuse(
                RefuseCode::OutOfRange,
                "a requested range lies outside the operation's descriptors".into(),
            )),
            Some(_)
                if write
                    && (local.len() != remote.len()
                        || local
                            .iter()
                            .zip(&remote)
                            .any(|(l, r)| l.1 != r.1 || l.0.checked_add(l.1).is_none())
                        || (!sources.is_empty()
                            && (sources.len() != remote.len()
                                || sources.iter().zip(&remote).any(|(s, r)| s.len != r.1)))) =>
            {
                Some(refuse(
                    RefuseCode::OutOfRange,
                    "the write's source ranges do not match its destination ranges".into(),
                ))
            }
            // The device path, device memory as the source: a read of a device readable, or a
            // write that sent its device source's export.
            Some(s) if (!write && s.device != Device::Host) || (write && !sources.is_empty()) => {
                let src = if write { Device::Cuda(0) } else { s.device };
                match device_path_refusal(src, if write { s.device } else { Device::Host }) {
                    Some(refusal) => Some(Msg::Fallback {
                        slot,
                        gen,
                        reason: refusal.to_string(),
                    }),
                    None => self.device_req(i, slot, gen, write, key, remote, sources),
                }
            }
            // Host memory into a device writable (pulled through pinned staging below), when this
            // side can.
            Some(s)
                if write
                    && s.device != Device::Host
                    && device_path_refusal(Device::Host, s.device).is_some() =>
            {
                Some(Msg::Fallback {
                    slot,
                    gen,
                    reason: device_path_refusal(Device::Host, s.device)
                        .map(|r| r.to_string())
                        .unwrap_or_default(),
                })
            }
            Some(_) if write && !can_pull => Some(Msg::Fallback {
                slot,
                gen,
                reason: "the kernel does not let the passive side read this process (ptrace rules)".into(),
            }),
            Some(s) if write && s.writer.is_some() => Some(refuse(
                RefuseCode::Busy,
                "another writer is writing this writable now".into(),
            )),
            Some(_) if !write && c.granted >= MAX_GRANTS_PER_CONN => Some(Msg::Fallback {
                slot,
                gen,
                reason: format!("this connection holds {MAX_GRANTS_PER_CONN} same-host read grants already"),
            }),
            Some(s) if !write => {
                if s.grants.insert((i, slot, gen)) {
                    c.granted += 1;
                }
                Some(Msg::Grant { slot, gen })
            }
            // The owner ended it an instant ago (its Unexpose is still queued).
            Some(s) if write && !s.state.try_mark_in_use() => Some(refuse(
                RefuseCode::NotLive,
                "the operation has ended (completed, cancelled or dropped)".into(),
            )),
            Some(s) => {
                // A write: this side copies from the writer into its own memory (marked in use
                // just above).
                let cancel = Arc::new(AtomicBool::new(false));
                s.writer = Some((i, slot, gen, cancel.clone()));
                let state = s.state.clone();
                let dst_device = s.device;
                let table = self.conns.get(&i).and_then(|c| c.slots.clone()).expect("ready");
                let key = self.scopes.get_key_value(key).expect("present").0.clone();
                let copy = AnyCopy::pulled_into(
                    Copy {
                        pid: peer_pid,
                        pieces: remote
                            .iter()
                            .zip(&local)
                            .map(|(&(dst, len), &(src, _))| Piece {
                                local: dst as usize,
                                remote: src as usize,
                                len: len as usize,
                            })
                            .collect(),
                        slot: SlotRef {
                            table,
                            idx: slot,
                            gen,
                        },
                        cancel,
                    },
                    Some(dst_device),
                );
                let owner = CopyOwner::Write {
                    key,
                    conn: i,
                    slot,
                    gen,
                    state,
                    pidfd: peer_pidfd,
                };
                self.start_copy(copy, owner);
                None
            }
        };
        if let Some(m) = answer {
            if let Some(c) = self.conns.get_mut(&i) {
                c.send(&m);
            }
        }
        let _ = out;
    }

    /// A read grant of connection `i` ended.
    pub(super) fn ungrant(&mut self, i: ConnId) {
        if let Some(c) = self.conns.get_mut(&i) {
            c.granted = c.granted.saturating_sub(1);
        }
    }

    pub(super) fn on_read_done(&mut self, i: ConnId, slot: u32, gen: u64, ok: bool, out: &mut Vec<Event>) {
        let key = self
            .scopes
            .iter()
            .find(|(_, s)| s.grants.contains(&(i, slot, gen)))
            .map(|(k, _)| k.clone());
        let Some(key) = key else { return };
        let s = self.scopes.get_mut(&key).expect("found");
        s.grants.remove(&(i, slot, gen));
        self.ungrant(i);
        if ok {
            out.push(Event::PassiveCompleted { key });
        }
    }

    pub(super) fn release_writer(&mut self, key: &str) {
        if let Some(s) = self.scopes.get(key) {
            if let Some(w) = &s.writer {
                w.3.store(true, Ordering::Relaxed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::io::Read;
    use std::os::fd::OwnedFd;
    use std::os::unix::net::UnixStream;

    use super::*;
    use crate::engine::local::records::{Conn, Scope};
    use crate::engine::local::slots::SLOTS;
    use crate::engine::poller::Poller;
    use crate::reg::Range;
    use crate::state::OpState;
    use crate::state::OperationStatus;

    /// The frames the transport sent on `i`: those the socket took, then those still buffered.
    fn sent(t: &LocalTransport, i: ConnId, peer: &mut UnixStream) -> Vec<Msg> {
        let mut bytes = Vec::new();
        let _ = peer.read_to_end(&mut bytes); // non-blocking: until EAGAIN
        bytes.extend_from_slice(&t.conns[&i].wbuf);
        let mut msgs = Vec::new();
        let mut at = 0;
        while let Some((m, n)) = Msg::decode(&bytes[at..]).expect("well-formed") {
            msgs.push(m);
            at += n;
        }
        msgs
    }

    /// A same-user client that asks for more reads than it has slots (reusing slot numbers under
    /// new generations, never saying it is done) gets `MAX_GRANTS_PER_CONN` grants, then
    /// `Fallback` (the operation goes to NIXL) instead of growing the server's grant set; an
    /// ended grant makes room again. Without the cap: 4,106 grants for 4,106 requests.
    #[test]
    fn server_read_grants_per_connection_are_capped() {
        let poller = Poller::new().unwrap();
        let mut t = LocalTransport::new(false, None, poller.registrar(), poller.waker());
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        theirs.set_nonblocking(true).unwrap();
        ours.set_nonblocking(true).unwrap();
        let mut c = Conn::new(OwnedFd::from(ours), false, self_pid(), "client".into());
        c.ready = true;
        c.trusted = true;
        let i = t.insert(c);
        let mem = vec![7u8; 4096];
        let range = Range {
            addr: mem.as_ptr() as usize,
            len: mem.len(),
            device: Device::Host,
        };
        t.scopes.insert(
            "key".into(),
            Scope {
                kind: OperationKind::Read,
                device: Device::Host,
                ranges: vec![range],
                state: OpState::new(OperationStatus::Initialized),
                grants: HashSet::new(),
                writer: None,
            },
        );
        let extra = 10;
        let mut out = Vec::new();
        let ask = |t: &mut LocalTransport, n: u64, out: &mut Vec<Event>| {
            let remote = vec![(range.addr as u64, 4096)];
            let local = vec![(0x1000, 4096)];
            let slot = (n % SLOTS as u64) as u32;
            t.on_req(i, slot, n, false, "key", Device::Host, remote, local, vec![], out);
        };
        for n in 0..(MAX_GRANTS_PER_CONN + extra) as u64 {
            ask(&mut t, n, &mut out);
            // Keep the socket drained so every answer can be counted.
            t.flush(i);
        }
        let msgs = sent(&t, i, &mut theirs);
        let grants = msgs.iter().filter(|m| matches!(m, Msg::Grant { .. })).count();
        let fallbacks = msgs.iter().filter(|m| matches!(m, Msg::Fallback { .. })).count();
        assert_eq!(grants, MAX_GRANTS_PER_CONN, "{} answers", msgs.len());
        assert_eq!(fallbacks, extra);
        assert_eq!(t.scopes["key"].grants.len(), MAX_GRANTS_PER_CONN);
        assert_eq!(t.conns[&i].granted, MAX_GRANTS_PER_CONN);

        // One read ends: the next request is granted.
        t.on_read_done(i, 0, 0, true, &mut out);
        assert_eq!(t.conns[&i].granted, MAX_GRANTS_PER_CONN - 1);
        t.conns.get_mut(&i).unwrap().wbuf.clear();
        ask(&mut t, u64::MAX, &mut out);
        t.flush(i);
        let msgs = sent(&t, i, &mut theirs);
        assert!(matches!(msgs.last(), Some(Msg::Grant { .. })), "{}", msgs.len());
        drop(mem);
    }
}
