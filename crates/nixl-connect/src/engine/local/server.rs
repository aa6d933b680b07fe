//! The passive side: the handshake as a server, and the scope policy that decides what a peer's
//! request may reach (keys, ranges, direction, one writer, grants per connection).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::cma::{self, Copy, Piece, SlotRef};
use super::device::device_path_refusal;
use super::eager;
use super::link::{grant_ipc_len, Answer, Request};
#[cfg(test)]
use super::proto::Msg;
use super::proto::{RefuseCode, MAX_FRAME, NOT_LIVE};
use super::records::{AnyCopy, ConnId, CopyOwner};
use super::state::{LocalTransport, MAX_EXPORTING, MAX_EXPORTING_PER_CONN, MAX_GRANTS_PER_CONN};
use crate::device::Device;
use crate::engine::transport::Event;
use crate::metadata::OperationKind;

impl LocalTransport {
    /// Server side: the client's `Hello` came with a sealed slot table (checked on receipt);
    /// whether this side may pull from the client (ptrace rules) is known now.
    pub(super) fn on_hello(&mut self, i: ConnId) {
        let Some(c) = self.conns.get_mut(&i) else { return };
        c.can_pull = c.pidfd.as_deref().is_some_and(cma::may_pull);
    }

    /// Server side: the scope policy for a proven request: what it may reach, and the answer
    /// (or the copy, for a write).
    pub(super) fn on_req(&mut self, i: ConnId, r: Request, out: &mut Vec<Event>) {
        let Request {
            slot,
            gen,
            write,
            key,
            device,
            remote,
            local,
            sources,
            eager,
            data,
            ..
        } = r;
        let key = &*key;
        let Some(c) = self.conns.get_mut(&i) else { return };
        if !c.link.is_ready() {
            // The connection died after the request was heard (the peer went away, or broke a
            // rule later in the same read): no answer can reach it, so nothing is granted,
            // copied or completed for it.
            return;
        }
        let (can_pull, peer_pid, peer_pidfd) = (c.can_pull, c.peer_pid, c.pidfd.clone());
        // Exports queued past either bound (this connection's, the process's): device reads
        // take NIXL until some end.
        let exports_full = c.exporting + remote.len() > MAX_EXPORTING_PER_CONN
            || self.exporting + remote.len() > MAX_EXPORTING;
        let refuse = |code, reason: String| Answer::Refuse(code, reason);
        let mut completed = None;
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
            Some(s) if device != s.device => Some(Answer::Fallback(format!(
                "the request names memory on {device}; the operation's is on {}",
                s.device
            ))),
            Some(s) if s.done || s.state.status().is_terminal() => Some(refuse(
                RefuseCode::NotLive,
                "the operation has ended (completed, cancelled or dropped)".into(),
            )),
            Some(s) if remote.is_empty() || !remote.iter().all(|&(a, l)| s.contains(a, l)) => Some(refuse(
                RefuseCode::OutOfRange,
                "a requested range lies outside the operation's descriptors".into(),
            )),
            // Small host operations (the link checked the sizes, the direction and host memory):
            // this side copies its own memory, on this thread, holding it in use for the copy so
            // that its owner's drop waits for it. The operation is over once the answer is sent.
            Some(s) if !data.is_empty() && s.writer.is_some() => Some(refuse(
                RefuseCode::Busy,
                "another writer is writing this writable now".into(),
            )),
            Some(s) if eager || !data.is_empty() => {
                let answer = if eager {
                    eager::read_scope(s, &remote).map(Answer::Data)
                } else {
                    eager::write_scope(s, &remote, &data).then(|| Answer::WriteDone {
                        ok: true,
                        reason: String::new(),
                    })
                };
                if answer.is_some() {
                    s.done = true;
                    completed = self.scopes.get_key_value(key).map(|(k, _)| k.clone());
                    answer
                } else {
                    Some(refuse(
                        RefuseCode::NotLive,
                        "the operation has ended (completed, cancelled or dropped)".into(),
                    ))
                }
            }
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
            // Every read grant, host or device, counts against the connection's cap.
            Some(_) if !write && c.granted >= MAX_GRANTS_PER_CONN => Some(Answer::Fallback(format!(
                "this connection holds {MAX_GRANTS_PER_CONN} same-host read grants already"
            ))),
            // A device read's grant carries one export per range: it must fit one frame.
            Some(s) if !write && s.device != Device::Host && grant_ipc_len(remote.len()) > MAX_FRAME => Some(
                Answer::Fallback("too many ranges for one same-host device grant".into()),
            ),
            Some(s) if !write && s.device != Device::Host && exports_full => Some(Answer::Fallback(
                "too many device ranges are being shared through CUDA IPC now".into(),
            )),
            // The device path, device memory as the source: a read of a device readable, or a
            // write that sent its device source's export.
            Some(s) if (!write && s.device != Device::Host) || (write && !sources.is_empty()) => {
                let src = if write { Device::Cuda(0) } else { s.device };
                match device_path_refusal(src, if write { s.device } else { Device::Host }) {
                    Some(refusal) => Some(Answer::Fallback(refusal.to_string())),
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
                Some(Answer::Fallback(
                    device_path_refusal(Device::Host, s.device)
                        .map(|r| r.to_string())
                        .unwrap_or_default(),
                ))
            }
            Some(_) if write && !can_pull => Some(Answer::Fallback(
                "the kernel does not let the passive side read this process (ptrace rules)".into(),
            )),
            Some(s) if write && s.writer.is_some() => Some(refuse(
                RefuseCode::Busy,
                "another writer is writing this writable now".into(),
            )),
            Some(s) if !write => {
                if s.grants.insert((i, slot, gen)) {
                    c.granted += 1;
                }
                Some(Answer::Grant)
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
        let sent = match answer {
            Some(a) => self
                .conns
                .get_mut(&i)
                .is_some_and(|c| c.link.answer(slot, gen, a)),
            None => false,
        };
        // An eager operation is complete once its answer is on its way (a read's bytes, a
        // write's Done); should the connection have died in queueing it, the reader never gets
        // the bytes and the writer learns nothing: the operation stays live for a retry (a
        // write's bytes are in place, and a retry writes them again).
        if let Some(key) = completed {
            if sent {
                out.push(Event::PassiveCompleted { key });
            } else if let Some(s) = self.scopes.get_mut(&key) {
                s.done = false;
            }
        }
    }

    /// A read grant of connection `i` ended.
    pub(super) fn ungrant(&mut self, i: ConnId) {
        if let Some(c) = self.conns.get_mut(&i) {
            c.granted = c.granted.saturating_sub(1);
        }
    }

    /// Server side: the reader finished copying a granted read of the operation keyed `key`.
    pub(super) fn on_read_done(
        &mut self,
        i: ConnId,
        slot: u32,
        gen: u64,
        ok: bool,
        key: &str,
        out: &mut Vec<Event>,
    ) {
        let Some((key, s)) = self.scopes.get_key_value(key) else {
            return;
        };
        let key = key.clone();
        if !s.grants.contains(&(i, slot, gen)) {
            return;
        }
        let s = self.scopes.get_mut(&key).expect("found");
        s.grants.remove(&(i, slot, gen));
        if ok {
            // Completed: a request heard later in this turn finds it done.
            s.done = true;
        }
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

    use super::*;
    use crate::engine::local::auth;
    use crate::engine::local::link::fuzz::{Pair, KEYS};
    use crate::engine::local::link::Heard;
    use crate::engine::local::records::Scope;
    use crate::engine::local::slots::SLOTS;
    use crate::engine::poller::Poller;
    use crate::reg::Range;
    use crate::state::OpState;
    use crate::state::OperationStatus;

    /// A transport serving `p`'s (shaken) connection `i`, with one live operation of `kind` over
    /// `range` under `KEYS[1]` (its metadata's identity 1). The poller and the peer's end of the
    /// socket live as long as it.
    struct Served {
        _poller: Poller,
        _theirs: std::os::unix::net::UnixStream,
        t: LocalTransport,
        i: ConnId,
        key: Arc<str>,
        state: Arc<OpState>,
    }

    fn served(p: &mut Pair, kind: OperationKind, range: Range) -> Served {
        let poller = Poller::new().unwrap();
        let (mut t, i, theirs) = LocalTransport::serving(&poller, p);
        let key: Arc<str> = KEYS[1].into();
        t.key_ids.insert(auth::key_id(&key), key.clone());
        t.identities.insert(1);
        let state = OpState::new(OperationStatus::Initialized);
        t.scopes.insert(
            key.clone(),
            Scope {
                kind,
                device: range.device,
                ranges: vec![range],
                state: state.clone(),
                grants: HashSet::new(),
                writer: None,
                done: false,
            },
        );
        Served {
            _poller: poller,
            _theirs: theirs,
            t,
            i,
            key,
            state,
        }
    }

    impl Served {
        /// Feeds `bytes` to the connection's core and acts on what it heard, as one turn would.
        fn hear(&mut self, p: &Pair, bytes: &[u8], out: &mut Vec<Event>) {
            let mut heard = Vec::new();
            let c = self.t.conns.get_mut(&self.i).unwrap();
            c.link.recv(bytes, 0, p.now, &self.t.key_ids, &mut heard);
            for h in heard {
                self.t.handle(self.i, h, out);
            }
        }

        /// The messages queued to the peer since the last call (taken as sent).
        fn answers(&mut self) -> Vec<Msg> {
            let c = self.t.conns.get_mut(&self.i).unwrap();
            let bytes = c.link.out().to_vec();
            c.link.sent(bytes.len());
            let mut at = 0;
            let mut msgs = Vec::new();
            while let Some((f, n)) = Msg::decode(&bytes[at..], MAX_FRAME).expect("well-formed") {
                msgs.push(f.msg);
                at += n;
            }
            msgs
        }
    }

    fn host_range(mem: &mut [u8]) -> Range {
        Range {
            addr: mem.as_mut_ptr() as usize,
            len: mem.len(),
            device: Device::Host,
        }
    }

    fn kind(write: bool) -> OperationKind {
        if write {
            OperationKind::Write
        } else {
            OperationKind::Read
        }
    }

    /// The owner's side of small operations: an eager read's answer carries the readable's bytes
    /// and completes it once (a second request in the same turn finds it done); an eager write
    /// lands its bytes and completes the writable; and a request heard on a connection that died
    /// later in the same read (here: a frame out of order right behind it) is neither answered,
    /// copied nor completed (found by review: it used to complete the readable with no byte sent).
    #[test]
    fn server_eager_operations_complete_once_and_only_when_answered() {
        for case in ["read", "write", "dead"] {
            let mut p = Pair::new(0);
            p.shake();
            let mut mem = vec![7u8; 4096];
            let range = host_range(&mut mem);
            let write = case == "write";
            let mut sv = served(&mut p, kind(write), range);
            let req = |slot: u32| {
                let mut m = Pair::eager_req(slot, 1, 1, write, 4096);
                if let Msg::Req { remote, data, .. } = &mut m {
                    remote[0].0 = range.addr as u64;
                    if write {
                        *data = vec![9; 4096];
                    }
                }
                p.forge(&m, Some(1), true)
            };
            let mut bytes = req(0);
            if case == "dead" {
                bytes.extend(p.forge(&Msg::Grant { slot: 5, gen: 5 }, Some(1), true));
            } else {
                bytes.extend(req(1));
            }
            let mut out = Vec::new();
            sv.hear(&p, &bytes, &mut out);
            let completed = out
                .iter()
                .filter(|e| matches!(e, Event::PassiveCompleted { .. }))
                .count();
            let msgs = sv.answers();
            let done = sv.t.scopes[&sv.key].done;
            match case {
                "dead" => {
                    assert_eq!(completed, 0, "nothing completed on a dead connection");
                    assert!(msgs.is_empty(), "{msgs:?}");
                    assert!(!done);
                }
                _ => {
                    assert_eq!(completed, 1, "{case}: completed once");
                    assert!(done);
                    match &msgs[..] {
                        [first, Msg::Refuse {
                            code: RefuseCode::NotLive,
                            ..
                        }] => match (write, first) {
                            (false, Msg::Data { data, .. }) => assert_eq!(data, &vec![7u8; 4096]),
                            (true, Msg::Done { ok: true, .. }) => assert_eq!(mem, vec![9u8; 4096]),
                            other => panic!("{other:?}"),
                        },
                        other => panic!("{case}: {other:?}"),
                    }
                }
            }
        }
    }

    /// The grant path's completions end the operation for the rest of the engine's turn: a request
    /// heard after a reader's `Done` in the same read, or after a writer's copy ended (whole or
    /// torn), is refused as not live. Before, the engine (which applies the completion only after
    /// the turn) granted the second read, and let the second write start a copy into (or take
    /// NIXL to) the memory of a writable that had just completed. A write that never began
    /// leaves the writable live.
    #[test]
    fn server_grant_path_completions_end_the_operation_within_the_turn() {
        for case in ["read", "written", "torn", "write not started"] {
            let write = case != "read";
            let mut p = Pair::new(0);
            p.shake();
            let mut mem = vec![7u8; 4096];
            let range = host_range(&mut mem);
            let mut sv = served(&mut p, kind(write), range);
            // The kernel lets this side pull (so a request that passed the liveness checks would
            // start a copy), except where the test needs an answer from a request that does.
            sv.t.conns.get_mut(&sv.i).unwrap().can_pull = case != "write not started";
            let req = |p: &Pair, slot: u32| {
                let mut m = Pair::req(slot, 1, 1, write, Device::Host, 1);
                if let Msg::Req { remote, .. } = &mut m {
                    remote[0].0 = range.addr as u64;
                }
                p.forge(&m, Some(1), true)
            };
            let mut out = Vec::new();
            let mut bytes = Vec::new();
            if write {
                // A writer's copy into the writable (slot 0) has just ended on the pool: all of
                // it, torn by the writer's exit, or never begun (the writer cancelled first).
                assert!(sv.state.try_mark_in_use());
                let (i, key) = (sv.i, sv.key.clone());
                sv.t.scopes.get_mut(&key).unwrap().writer = Some((i, 0, 1, Arc::new(AtomicBool::new(false))));
                let result = match case {
                    "written" => Ok(()),
                    "torn" => Err(cma::CopyError::PeerGone),
                    _ => Err(cma::CopyError::NotStarted),
                };
                sv.t.finished.push((
                    CopyOwner::Write {
                        key,
                        conn: i,
                        slot: 0,
                        gen: 1,
                        state: sv.state.clone(),
                        pidfd: None,
                    },
                    result,
                ));
                sv.t.reap(&mut out);
            } else {
                // A reader was granted slot 0; its `Done` arrives in the same read as another
                // reader's request.
                sv.hear(&p, &req(&p, 0), &mut out);
                sv.answers();
                bytes.extend(p.forge(
                    &Msg::Done {
                        slot: 0,
                        gen: 1,
                        ok: true,
                        reason: String::new(),
                    },
                    Some(1),
                    true,
                ));
            }
            bytes.extend(req(&p, 1));
            sv.hear(&p, &bytes, &mut out);
            let count = |f: fn(&Event) -> bool| out.iter().filter(|e| f(e)).count();
            let completed = count(|e| matches!(e, Event::PassiveCompleted { .. }));
            let failed = count(|e| matches!(e, Event::PassiveFailed { .. }));
            let scope = &sv.t.scopes[&sv.key];
            assert!(scope.writer.is_none(), "{case}");
            let done = scope.done;
            let msgs = sv.answers();
            let last = msgs.last();
            if case == "write not started" {
                // Nothing was touched: the writable goes on, and the next writer is served (here
                // the kernel's rules send it to NIXL).
                assert_eq!((completed, failed), (0, 0), "{case}");
                assert!(!done, "{case}");
                assert!(
                    matches!(last, Some(Msg::Fallback { slot: 1, .. })),
                    "{case}: {msgs:?}"
                );
                continue;
            }
            let torn = case == "torn";
            assert_eq!(
                (completed, failed),
                (usize::from(!torn), usize::from(torn)),
                "{case}"
            );
            assert!(done, "{case}");
            assert!(
                matches!(
                    last,
                    Some(Msg::Refuse {
                        slot: 1,
                        code: RefuseCode::NotLive,
                        ..
                    })
                ),
                "{case}: {msgs:?}"
            );
        }
    }

    /// A same-user client that asks for more reads than it has slots (reusing slot numbers under
    /// new generations, never saying it is done) gets `MAX_GRANTS_PER_CONN` grants, then
    /// `Fallback` (the operation goes to NIXL) instead of growing the server's grant set; an
    /// ended grant makes room again. Without the cap: 4,106 grants for 4,106 requests. Device
    /// reads count against the same cap (before: the device branch ran before the check), and
    /// against the bounds on ranges queued for export.
    #[test]
    fn server_read_grants_per_connection_are_capped() {
        for device in [Device::Host, Device::Cuda(0)] {
            let mut p = Pair::new(0);
            p.shake();
            let mem = vec![7u8; 4096];
            let range = Range {
                addr: mem.as_ptr() as usize,
                len: mem.len(),
                device,
            };
            let mut sv = served(&mut p, OperationKind::Read, range);
            let i = sv.i;
            let mut out = Vec::new();
            let ask = |sv: &mut Served, p: &Pair, n: u64, out: &mut Vec<Event>| {
                let slot = (n % SLOTS as u64) as u32;
                let mut m = Pair::req(slot, n, 1, false, device, 1);
                if let Msg::Req { remote, .. } = &mut m {
                    remote[0] = (range.addr as u64, 4096);
                }
                sv.hear(p, &p.forge(&m, Some(1), true), out);
            };
            let fallback = |sv: &mut Served| {
                let msgs = sv.answers();
                let [Msg::Fallback { reason, .. }] = &msgs[..] else {
                    panic!("{msgs:?}")
                };
                reason.clone()
            };
            if device != Device::Host {
                // A connection that holds the cap in grants asks for a device read: the cap is
                // checked before the device path is even considered.
                sv.t.conns.get_mut(&i).unwrap().granted = MAX_GRANTS_PER_CONN;
                ask(&mut sv, &p, 1, &mut out);
                let reason = fallback(&mut sv);
                assert!(reason.contains("grants already"), "{reason}");
                // Exports queued at either bound (the connection's, the process's): the device
                // read takes NIXL instead of queueing more (before: one export per range of
                // every grant, on an unbounded queue).
                for (conn_full, all_full) in [(true, false), (false, true)] {
                    let c = sv.t.conns.get_mut(&i).unwrap();
                    c.granted = 0;
                    c.exporting = if conn_full { MAX_EXPORTING_PER_CONN } else { 0 };
                    sv.t.exporting = if all_full { MAX_EXPORTING } else { 0 };
                    ask(&mut sv, &p, 2 + u64::from(all_full), &mut out);
                    let reason = fallback(&mut sv);
                    assert!(reason.contains("being shared"), "{reason}");
                }
                continue;
            }
            for n in 0..(MAX_GRANTS_PER_CONN + 10) as u64 {
                ask(&mut sv, &p, n, &mut out);
            }
            let msgs = sv.answers();
            let grants = msgs.iter().filter(|m| matches!(m, Msg::Grant { .. })).count();
            let fallbacks = msgs.iter().filter(|m| matches!(m, Msg::Fallback { .. })).count();
            assert_eq!(grants, MAX_GRANTS_PER_CONN, "{} answers", msgs.len());
            assert_eq!(fallbacks, 10);
            assert_eq!(sv.t.scopes[&sv.key].grants.len(), MAX_GRANTS_PER_CONN);
            assert_eq!(sv.t.conns[&i].granted, MAX_GRANTS_PER_CONN);

            // One read ends (its copy failed, so the readable stays live): the next request is
            // granted.
            let key = sv.key.clone();
            sv.t.on_read_done(i, 0, 0, false, &key, &mut out);
            assert_eq!(sv.t.conns[&i].granted, MAX_GRANTS_PER_CONN - 1);
            // Its Done also closes the core's request, which makes room there too.
            sv.t.conns.get_mut(&i).unwrap().link.recv(
                &p.forge(
                    &Msg::Done {
                        slot: 0,
                        gen: 0,
                        ok: false,
                        reason: String::new(),
                    },
                    Some(1),
                    true,
                ),
                0,
                p.now,
                &sv.t.key_ids.clone(),
                &mut Vec::<Heard>::new(),
            );
            ask(&mut sv, &p, u64::MAX, &mut out);
            let msgs = sv.answers();
            assert!(matches!(msgs.last(), Some(Msg::Grant { .. })), "{msgs:?}");
            drop(mem);
        }
    }
}
