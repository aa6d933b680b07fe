//! The coordinator's actions through one served connection's core (a socket pair under a
//! poller): the passive side's, and a connection's turn. The policy's own rules are tested
//! without either in `policy/tests.rs`.

use std::io::Write;

use super::*;
use crate::device::Device;
use crate::engine::poller::Poller;
use crate::engine::same_host::limits::{MAX_EXPORTING, MAX_EXPORTING_PER_CONN, MAX_GRANTS_PER_CONN};
use crate::engine::same_host::link::fuzz::{Pair, KEYS, SERVER_SEED};
use crate::engine::same_host::link::Heard;
use crate::engine::same_host::server_book::Scope;
use crate::engine::same_host::violation::Violation;
use crate::engine::same_host::wire::{Msg, RefuseCode, Req, MAX_FRAME};
use crate::engine::transport::Transport;
use crate::metadata::OperationKind;
use crate::reg::Range;
use crate::state::{OpState, OperationStatus};
use crate::sys::same_host::cma;
use crate::sys::same_host::slots::SLOTS;

/// A transport serving one connection for tests: `p`'s (shaken) server core over one end of a
/// socket pair, non-blocking; returns the transport, the connection's id and the other end (the
/// peer's).
fn serving(poller: &Poller, p: &mut Pair) -> (SameHostTransport, ConnId, std::os::unix::net::UnixStream) {
    let id = crate::engine::transport::TransportId::nth(0).expect("the first id");
    let mut t = SameHostTransport::new(false, None, None, None, poller.registrar_for(id), poller.waker());
    t.identity = Some(Arc::new(Identity::from_seed(SERVER_SEED)));
    let (ours, theirs) = std::os::unix::net::UnixStream::pair().expect("a socket pair");
    ours.set_nonblocking(true).expect("non-blocking");
    let spare = Link::server(t.identity.clone().expect("set above"), 0, 0, Instant::now());
    let link = std::mem::replace(&mut p.server, spare);
    let fd = Tracked::new(std::os::fd::OwnedFd::from(ours));
    let i = t.sockets.insert(Conn::new(fd, link, 4100, 4100, None, "".into()));
    (t, i, theirs)
}

/// A transport serving `p`'s (shaken) connection `i`, with one live operation of `kind` over
/// `range` under `KEYS[1]` (its metadata's identity 1). The poller and the peer's end of the
/// socket live as long as it.
struct Served {
    _poller: Poller,
    _theirs: std::os::unix::net::UnixStream,
    t: SameHostTransport,
    i: ConnId,
    key: Arc<str>,
    state: Arc<OpState>,
}

fn served(p: &mut Pair, kind: OperationKind, range: Range) -> Served {
    let poller = Poller::new().unwrap();
    let (mut t, i, theirs) = serving(&poller, p);
    let key: Arc<str> = KEYS[1].into();
    let state = OpState::new(OperationStatus::Initialized);
    t.server
        .expose(key.clone(), 1, Scope::new(kind, vec![range], state.clone()));
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
        let c = self.t.sockets.get_mut(self.i).unwrap();
        c.link_mut()
            .recv(bytes, 0, p.now, self.t.server.key_ids(), &mut heard);
        for h in heard {
            self.t.handle(self.i, h, out);
        }
    }

    /// The messages queued to the peer since the last call (taken as sent).
    fn answers(&mut self) -> Vec<Msg> {
        let c = self.t.sockets.get_mut(self.i).unwrap();
        let bytes = c.link().out().to_vec();
        c.link_mut().sent(bytes.len());
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
            if let Msg::Req(Req { remote, data, .. }) = &mut m {
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
        let done = sv.t.server.scope(&sv.key).unwrap().is_done();
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
        sv.t.sockets
            .get_mut(sv.i)
            .unwrap()
            .set_reach(case != "write not started", false);
        let req = |p: &Pair, slot: u32| {
            let mut m = Pair::req(slot, 1, 1, write, Device::Host, 1);
            if let Msg::Req(Req { remote, .. }) = &mut m {
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
            let id = RequestId {
                conn: i,
                slot: 0,
                gen: 1,
            };
            sv.t.server.scope_mut(&key).unwrap().set_writer(id);
            let result = match case {
                "written" => Ok(()),
                "torn" => Err(cma::CopyError::PeerGone),
                _ => Err(cma::CopyError::NotStarted),
            };
            sv.t.in_flight.finish(
                CopyOwner::Write {
                    key,
                    id,
                    state: sv.state.clone(),
                    pidfd: None,
                },
                result,
            );
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
        let scope = sv.t.server.scope(&sv.key).unwrap();
        assert!(!scope.has_writer(), "{case}");
        let done = scope.is_done();
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
            if let Msg::Req(Req { remote, .. }) = &mut m {
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
            sv.t.sockets.get_mut(i).unwrap().charge(MAX_GRANTS_PER_CONN, 0);
            ask(&mut sv, &p, 1, &mut out);
            let reason = fallback(&mut sv);
            assert!(reason.contains("grants already"), "{reason}");
            // Exports queued at either bound (the connection's, the process's): the device
            // read takes NIXL instead of queueing more (before: one export per range of
            // every grant, on an unbounded queue).
            for (conn_full, all_full) in [(true, false), (false, true)] {
                let c = sv.t.sockets.get_mut(i).unwrap();
                let (granted, exporting) = c.load();
                c.charge(0, if conn_full { MAX_EXPORTING_PER_CONN } else { 0 });
                for _ in 0..granted {
                    c.ungrant();
                }
                c.exported(exporting);
                let all = sv.t.server.exporting();
                sv.t.server.exports_ended(all);
                sv.t.server
                    .exports_queued(if all_full { MAX_EXPORTING } else { 0 });
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
        assert_eq!(sv.t.server.scope(&sv.key).unwrap().grants(), MAX_GRANTS_PER_CONN);
        assert_eq!(sv.t.sockets.get(i).unwrap().load().0, MAX_GRANTS_PER_CONN);

        // One read ends (its copy failed, so the readable stays live): the next request is
        // granted.
        let key = sv.key.clone();
        sv.t.on_read_done(
            RequestId {
                conn: i,
                slot: 0,
                gen: 0,
            },
            false,
            &key,
            &mut out,
        );
        assert_eq!(sv.t.sockets.get(i).unwrap().load().0, MAX_GRANTS_PER_CONN - 1);
        // Its Done also closes the core's request, which makes room there too.
        sv.t.sockets.get_mut(i).unwrap().link_mut().recv(
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
            &sv.t.server.key_ids().clone(),
            &mut Vec::<Heard>::new(),
        );
        ask(&mut sv, &p, u64::MAX, &mut out);
        let msgs = sv.answers();
        assert!(matches!(msgs.last(), Some(Msg::Grant { .. })), "{msgs:?}");
        drop(mem);
    }
}

/// A served connection whose client said it uses pipes, and its writable of `len` bytes.
fn piped_writable(mem: &mut [u8]) -> (Pair, Served) {
    let mut p = Pair::piped(0);
    p.shake();
    let mut sv = served(&mut p, OperationKind::Write, host_range(mem));
    // The client's slot table, its request's slot armed (as its `begin` does).
    let table = crate::sys::same_host::slots::SlotTable::create().unwrap();
    table.arm(1, 1);
    sv.t.sockets.get_mut(sv.i).unwrap().set_slots(Arc::new(table));
    (p, sv)
}

impl Served {
    /// Sends `bytes` from the peer's end with `fds` attached, then reads them as one turn would
    /// (the descriptors through the kernel, as a peer passes them) and acts on what was heard.
    fn hear_passed(&mut self, bytes: &[u8], fds: &[std::os::fd::RawFd], out: &mut Vec<Event>) {
        use std::os::fd::AsRawFd;
        let n = crate::sys::same_host::send_with_fds(self._theirs.as_raw_fd(), bytes, fds).unwrap();
        assert_eq!(n, bytes.len());
        let mut heard = Vec::new();
        self.t.sockets.read(self.i, self.t.server.key_ids(), &mut heard);
        for h in heard {
            self.t.handle(self.i, h, out);
        }
    }

    /// Waits for the copies in flight and handles their ends.
    fn settle(&mut self, out: &mut Vec<Event>) {
        assert!(self.t.in_flight.wait(Some(std::time::Duration::from_secs(10))));
        self.t.reap(out);
    }
}

/// A piped write request of `len` bytes at `addr` passing one read end, signed as the client.
fn piped_write(p: &Pair, addr: usize, len: usize) -> Vec<u8> {
    let mut m = Pair::req(1, 1, 1, true, Device::Host, 1);
    if let Msg::Req(Req {
        remote, local, pipes, ..
    }) = &mut m
    {
        *remote = vec![(addr as u64, len as u64)];
        local.clear();
        *pipes = 1;
    }
    p.forge(&m, Some(1), true)
}

/// A client's write passes one read end with its request: anything else (a socket, a pipe's
/// write end, a file) closes the connection before a byte is copied, and the writable is
/// untouched; a genuine read end is read into the writable, which completes with its bytes.
#[test]
fn server_piped_write_takes_only_a_pipes_read_end() {
    use std::os::fd::AsRawFd;
    let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
    let file = std::fs::File::open("/proc/self/stat").unwrap();
    let mut lanes = crate::sys::same_host::pipe::Lanes::new(1).unwrap();
    let ends = lanes.take_read_ends();
    for (what, fd) in [
        ("a socket", a.as_raw_fd()),
        ("a file", file.as_raw_fd()),
        ("a pipe's write end", lanes.write_end(0).as_raw_fd()),
    ] {
        let mut mem = vec![0u8; 64 << 10];
        let (p, mut sv) = piped_writable(&mut mem);
        let mut out = Vec::new();
        sv.hear_passed(
            &piped_write(&p, mem.as_ptr() as usize, mem.len()),
            &[fd],
            &mut out,
        );
        let c = sv.t.sockets.get(sv.i).unwrap();
        assert_eq!(c.link().death(), Some(Violation::NotAPipe), "{what}");
        assert_eq!(c.passed(), 0, "{what}: nothing held");
        sv.settle(&mut out);
        assert!(out.is_empty(), "{what}: {} events", out.len());
        assert!(mem.iter().all(|&b| b == 0), "{what}: the writable was touched");
    }
    // The genuine article: a read end the test feeds.
    let mut mem = vec![0u8; 3 << 20];
    let (p, mut sv) = piped_writable(&mut mem);
    let src: Vec<u8> = (0..mem.len()).map(|i| (i % 251) as u8).collect();
    let mut out = Vec::new();
    sv.hear_passed(
        &piped_write(&p, mem.as_ptr() as usize, mem.len()),
        &ends.raw(),
        &mut out,
    );
    drop(ends);
    assert!(sv.t.sockets.get(sv.i).unwrap().link().death().is_none());
    let ended = std::sync::atomic::AtomicBool::new(false);
    let wake = crate::sys::same_host::pipe::Wake::new().unwrap();
    crate::sys::same_host::pipe::feed(
        lanes.write_end(0),
        &[(src.as_ptr() as usize, src.len())],
        &ended,
        &wake,
    )
    .unwrap();
    sv.settle(&mut out);
    assert_eq!(
        out.iter()
            .filter(|e| matches!(e, Event::PassiveCompleted { key, .. } if *key == sv.key))
            .count(),
        1,
        "one completion"
    );
    assert!(mem == src, "the writable holds the fed bytes");
    assert!(matches!(sv.answers().last(), Some(Msg::Done { ok: true, .. })));
}

/// A writer that passes a read end and never feeds it: the owner's unexpose (a drop) wakes the
/// copy waiting on the pipe at once, and the writable is released; nothing is left running.
#[test]
fn server_piped_write_from_a_silent_writer_ends_with_the_writable() {
    let mut mem = vec![0u8; 1 << 20];
    let (p, mut sv) = piped_writable(&mut mem);
    let mut lanes = crate::sys::same_host::pipe::Lanes::new(1).unwrap();
    let ends = lanes.take_read_ends();
    let mut out = Vec::new();
    sv.hear_passed(
        &piped_write(&p, mem.as_ptr() as usize, mem.len()),
        &ends.raw(),
        &mut out,
    );
    drop(ends);
    assert!(!sv.state.is_released(), "the copy holds the writable");
    let t = std::time::Instant::now();
    sv.t.unexpose(&sv.key.clone());
    sv.settle(&mut out);
    assert!(sv.state.is_released(), "released once the copy ended");
    assert!(t.elapsed() < std::time::Duration::from_secs(5));
    drop(lanes);
}

/// Review finding (H1): a reader that ends its piped read (`Done`) and asks again under the same
/// request id at once, while the first feed still runs, must not make the two feeds one (the
/// second would run on unseen, reading the readable after its release): the second request takes
/// NIXL, one feed is left, and it ends with the readable.
#[test]
fn server_piped_read_request_id_reused_while_feeding_is_refused() {
    let mut mem = vec![7u8; 4 << 20];
    let mut p = Pair::piped(0);
    p.shake();
    let mut sv = served(&mut p, OperationKind::Read, host_range(&mut mem));
    let mut m = Pair::req(1, 1, 1, false, Device::Host, 1);
    if let Msg::Req(Req { remote, pipes, .. }) = &mut m {
        *remote = vec![(mem.as_ptr() as u64, mem.len() as u64)];
        *pipes = 1;
    }
    let req = p.forge(&m, Some(1), true);
    let mut out = Vec::new();
    sv.hear(&p, &req, &mut out);
    assert!(matches!(sv.answers()[..], [Msg::GrantPipe { lanes: 1, .. }]));
    assert_eq!(sv.t.feeds.lanes(), 1);
    let done = p.forge(
        &Msg::Done {
            slot: 1,
            gen: 1,
            ok: false,
            reason: String::new(),
        },
        Some(1),
        true,
    );
    sv.hear(&p, &[done, req].concat(), &mut out);
    assert!(
        matches!(&sv.answers()[..], [Msg::Fallback { reason, .. }] if reason.contains("still in use")),
        "the reused id is refused"
    );
    assert_eq!(sv.t.feeds.lanes(), 1, "one feed, still the first");
    sv.t.unexpose(&sv.key.clone());
    sv.settle(&mut out);
    assert!(sv.state.is_released(), "released once the feed stopped");
    assert_eq!(sv.t.feeds.lanes(), 0);
}

/// A peer that keeps its socket full (here: 4 MiB of replayed requests, each refused) is read
/// at most [`READ_PER_TURN`] bytes a turn: the engine thread goes back to its other work
/// between turns, and what one turn decodes is bounded.
#[test]
fn conn_reads_at_most_a_budget_per_turn() {
    let poller = Poller::new().unwrap();
    let mut p = Pair::new(0);
    p.shake();
    let (mut t, i, mut theirs) = serving(&poller, &mut p);
    let replay = p.forge(&Pair::req(1, 1, 2, false, Device::Host, 1), Some(2), true);
    let frames = (4 << 20) / replay.len();
    let batch = replay.repeat(frames);
    let writer = std::thread::spawn(move || theirs.write_all(&batch).map(|()| theirs));
    let mut turns = 0;
    let mut answered = 0;
    while answered < frames {
        let mut heard = Vec::new();
        t.sockets.read(i, t.server.key_ids(), &mut heard);
        turns += 1;
        let c = t.sockets.get_mut(i).unwrap();
        assert!(!c.link().is_dead(), "{:?}", c.link().death());
        let out = c.link().out().to_vec();
        c.link_mut().sent(out.len());
        let mut at = 0;
        while let Some((_, n)) = Msg::decode(&out[at..], MAX_FRAME).unwrap() {
            answered += 1;
            at += n;
        }
        assert!(turns < 100_000, "no progress");
    }
    assert!(turns >= 4, "4 MiB in {turns} turns");
    let _keep_open = writer.join().unwrap().unwrap();
}
