//! The connection core's tests: two cores in memory, stepped by hand, with a manual clock. No
//! socket, no thread, no sleep. Each finding of issue 27 that lives in the protocol has its test.

use std::collections::HashMap;
use std::time::Duration;

use super::fuzz::{Pair, IMPOSTOR_SEED, KEYS, SERVER_SEED};
use super::*;
use crate::engine::same_host::wire::IpcSource;

/// The reader's side of a read of `KEYS[key]` on a shaken pair: request, grant, done.
fn read(p: &mut Pair, slot: u32, gen: u64, key: usize) {
    assert!(p
        .client
        .request_msg(KEYS[key], &Pair::req(slot, gen, key, false, Device::Host, 1)));
    p.deliver_to_server(0);
}

impl Pair {
    fn deliver_to_server_plain(&mut self) {
        self.deliver_to_server(0);
    }
}

#[test]
fn link_handshake_then_read_round_trip() {
    let mut p = Pair::new(0);
    p.shake();
    assert_eq!(p.at_server, vec![Heard::Hello, Heard::Trusted { pipes: false }]);
    assert_eq!(p.at_client, vec![Heard::Ready]);
    assert!(p.client.is_ready() && p.server.is_ready());
    read(&mut p, 3, 1, 1);
    let Some(Heard::Req(r)) = p.at_server.pop() else {
        panic!("{:?}", p.at_server)
    };
    assert_eq!(
        (r.req.slot, r.req.gen, &*r.key, r.req.write),
        (3, 1, KEYS[1], false)
    );
    p.server.answer(3, 1, Answer::Grant);
    p.deliver_to_client();
    assert_eq!(
        p.at_client.pop(),
        Some(Heard::Grant {
            slot: 3,
            gen: 1,
            sources: None
        })
    );
    p.client.read_done(3, 1, true, "");
    p.deliver_to_server_plain();
    assert_eq!(
        p.at_server.pop(),
        Some(Heard::ReadDone {
            slot: 3,
            gen: 1,
            ok: true,
            key: KEYS[1].into()
        })
    );
    assert!(p.client.open.is_empty() && p.server.open.is_empty());
    assert!(!p.client.is_dead() && !p.server.is_dead());
}

/// The abort of HEAD 6daaea6: two `Welcome` frames in one write. The first is handled, the
/// second finds the connection past its handshake: the core closes it, nothing panics, and
/// nothing after it is handled.
#[test]
fn link_double_welcome_closes_without_panic() {
    for (proof_key, first) in [
        (None, Heard::NotLive { key: KEYS[0].into() }),
        (Some(1), Heard::Impostor),
        (Some(0), Heard::Ready),
    ] {
        let mut p = Pair::new(0);
        p.deliver_to_server(1);
        let mut two = p.forge(&p.welcome(proof_key, SERVER_SEED), None, false);
        two.extend(p.forge(&p.welcome(None, SERVER_SEED), None, false));
        two.extend(p.forge(&Msg::Grant { slot: 0, gen: 0 }, Some(0), false));
        p.client.recv(&two, 0, p.now, &HashMap::new(), &mut p.at_client);
        assert!(p.client.is_dead(), "closed");
        assert_eq!(p.at_client, vec![first], "only the first Welcome was handled");
        p.client.recv(&two, 0, p.now, &HashMap::new(), &mut p.at_client);
        assert_eq!(p.at_client.len(), 1, "a dead connection handles nothing");
    }
}

/// The cross-operation impostor: a process that proves the key of an operation it made itself
/// (its own metadata naming the victim's agent) cannot then answer another operation's
/// request on the reused connection: its grant is not signed under that operation's key.
#[test]
fn link_impostor_cannot_answer_another_operations_request() {
    for forged_key in [Some(0), None, Some(2)] {
        let mut p = Pair::new(0); // the impostor holds KEYS[0] (its own operation)
        p.shake();
        // The victim's operation (KEYS[1]) is asked on the same connection.
        assert!(p
            .client
            .request_msg(KEYS[1], &Pair::req(5, 9, 1, false, Device::Host, 1)));
        let g = p.forge(&Msg::Grant { slot: 5, gen: 9 }, forged_key, false);
        p.client.recv(&g, 0, p.now, &HashMap::new(), &mut p.at_client);
        assert!(
            p.client.is_dead(),
            "{forged_key:?}: the impostor's grant closes the connection"
        );
        assert_eq!(
            p.at_client,
            vec![Heard::Ready],
            "{forged_key:?}: no grant believed"
        );
    }
    // Nor a write's Done.
    let mut p = Pair::new(0);
    p.shake();
    assert!(p
        .client
        .request_msg(KEYS[1], &Pair::req(6, 1, 1, true, Device::Host, 1)));
    let d = Msg::Done {
        slot: 6,
        gen: 1,
        ok: true,
        reason: String::new(),
    };
    let d = p.forge(&d, Some(0), false);
    p.client.recv(&d, 0, p.now, &HashMap::new(), &mut p.at_client);
    assert!(p.client.is_dead());
    assert!(!p.at_client.iter().any(|h| matches!(h, Heard::WriteDone { .. })));
}

/// Answers that can only make an operation fail or take NIXL may come unproven (the server
/// does not hold a replayed operation's key); anything that makes it succeed may not.
#[test]
fn link_unproven_answers_only_fail_or_fall_back() {
    let mut p = Pair::new(0);
    p.shake();
    assert!(p
        .client
        .request_msg(KEYS[2], &Pair::req(1, 1, 2, false, Device::Host, 1)));
    p.deliver_to_server_plain(); // the server holds no KEYS[2]: it refuses, unproven
    p.deliver_to_client();
    assert!(matches!(
        p.at_client.last(),
        Some(Heard::Refused {
            code: RefuseCode::NotLive,
            ..
        })
    ));
    assert!(p
        .client
        .request_msg(KEYS[1], &Pair::req(2, 1, 1, false, Device::Host, 1)));
    let f = Msg::Fallback {
        slot: 2,
        gen: 1,
        reason: "x".into(),
    };
    let f = p.forge(&f, None, false);
    p.client.recv(&f, 0, p.now, &HashMap::new(), &mut p.at_client);
    assert!(matches!(p.at_client.last(), Some(Heard::Fallback { .. })));
    assert!(p
        .client
        .request_msg(KEYS[1], &Pair::req(3, 1, 1, false, Device::Host, 1)));
    let r = Msg::Refuse {
        slot: 3,
        gen: 1,
        code: RefuseCode::OutOfRange,
        reason: "x".into(),
    };
    let r = p.forge(&r, None, false);
    p.client.recv(&r, 0, p.now, &HashMap::new(), &mut p.at_client);
    assert!(p.client.is_dead(), "an unproven refusal of another kind closes");
}

/// A request proven under one key on one connection cannot be replayed on another (the nonce
/// differs), nor can a server's grant.
#[test]
fn link_frames_replayed_onto_another_connection_are_refused() {
    let mut a = Pair::new(0);
    a.shake();
    assert!(a
        .client
        .request_msg(KEYS[1], &Pair::req(4, 4, 1, false, Device::Host, 1)));
    let req = a.client.out().to_vec();
    let mut b = Pair::new(0);
    b.nonce = [8; 16];
    b.client = Link::client(
        KEYS[0].into(),
        Identity::from_seed(SERVER_SEED).fingerprint(),
        b.nonce,
        4100,
        4200,
        false,
        b.now,
    );
    b.shake();
    b.server.recv(&req, 0, b.now, &b.keys.clone(), &mut b.at_server);
    assert!(b.server.is_dead(), "a request replayed from another connection");
    assert!(!b.at_server.iter().any(|h| matches!(h, Heard::Req(_))));
    // A Done reflected back (client -> server bytes fed to the client) is refused too.
    let mut c = Pair::new(0);
    c.shake();
    assert!(c
        .client
        .request_msg(KEYS[1], &Pair::req(4, 4, 1, true, Device::Host, 1)));
    let d = Msg::Done {
        slot: 4,
        gen: 4,
        ok: true,
        reason: String::new(),
    };
    let d = c.forge(&d, Some(1), true); // signed as the client would
    c.client.recv(&d, 0, c.now, &HashMap::new(), &mut c.at_client);
    assert!(c.client.is_dead(), "a frame signed for the other direction");
}

/// Before `Hello` nothing but `Hello` is handled: a `Done`, a request, a grant each close the
/// connection at once, and nothing reaches the transport.
#[test]
fn link_nothing_but_hello_before_hello() {
    for m in [
        Msg::Done {
            slot: 1,
            gen: 1,
            ok: true,
            reason: String::new(),
        },
        Pair::req(1, 1, 0, false, Device::Host, 1),
        Msg::Trusted { pipes: false },
        Msg::Grant { slot: 1, gen: 1 },
    ] {
        let mut p = Pair::new(0);
        let bytes = p.forge(&m, Some(0), true);
        p.server.recv(&bytes, 0, p.now, &p.keys.clone(), &mut p.at_server);
        assert!(p.server.is_dead(), "{m:?}");
        assert!(p.at_server.is_empty(), "{m:?}");
    }
}

/// Descriptors come only with the `Hello`, one in all; a `Hello` without one is refused.
#[test]
fn link_descriptors_only_with_the_hello() {
    let mut p = Pair::new(0);
    p.deliver_to_server(2);
    assert!(p.server.is_dead(), "two descriptors");
    let mut p = Pair::new(0);
    p.deliver_to_server(0);
    assert!(p.server.is_dead(), "a hello without its table");
    let mut p = Pair::new(0);
    p.shake();
    assert!(p
        .client
        .request_msg(KEYS[1], &Pair::req(1, 1, 1, false, Device::Host, 1)));
    p.deliver_to_server(1);
    assert!(p.server.is_dead(), "a descriptor after the hello");
    assert!(!p.at_server.iter().any(|h| matches!(h, Heard::Req(_))));
    let mut p = Pair::new(0);
    p.shake();
    p.server.answer(0, 0, Answer::Grant);
    let bytes = p.forge(&p.welcome(None, SERVER_SEED), None, false);
    p.client.recv(&bytes, 1, p.now, &HashMap::new(), &mut p.at_client);
    assert!(p.client.is_dead(), "the client takes no descriptor at all");
}

/// A handshake has a deadline on both sides (a fork child holding the parent's socket, a peer
/// that never answers), and so has a frame once its first byte arrived.
#[test]
fn link_handshake_and_partial_frames_have_deadlines() {
    let mut p = Pair::new(0);
    p.deliver_to_server(1); // the server answers nothing
    assert_eq!(p.client.deadline(), Some(p.now + HANDSHAKE_TIMEOUT));
    p.advance(HANDSHAKE_TIMEOUT - Duration::from_millis(1));
    assert!(!p.client.is_dead());
    p.advance(Duration::from_millis(1));
    assert!(p.client.is_dead() && p.server.is_dead(), "both sides give up");
    assert_eq!(p.client.death(), Some(Violation::HandshakeTimedOut));

    let mut p = Pair::new(0);
    p.shake();
    assert_eq!(p.server.deadline(), None, "no deadline once ready and idle");
    assert!(p
        .client
        .request_msg(KEYS[1], &Pair::req(1, 1, 1, false, Device::Host, 1)));
    let req = p.client.out().to_vec();
    p.server
        .recv(&req[..10], 0, p.now, &p.keys.clone(), &mut p.at_server);
    assert_eq!(p.server.deadline(), Some(p.now + PARTIAL_FRAME_TIMEOUT));
    p.advance(PARTIAL_FRAME_TIMEOUT);
    assert!(p.server.is_dead(), "a frame that never arrives whole");
    assert!(p.at_server.iter().all(|h| !matches!(h, Heard::Req(_))));
}

/// Before the handshake a frame may be a few KiB: a length prefix of 16 MiB is refused from its
/// four bytes, without holding anything.
#[test]
fn link_pre_handshake_frames_are_small() {
    let mut p = Pair::new(0);
    let big = (MAX_FRAME as u32).to_le_bytes();
    p.server.recv(&big, 0, p.now, &p.keys.clone(), &mut p.at_server);
    assert!(p.server.is_dead());
    assert!(p.server.rbuf.capacity() == 0, "nothing held");
    // Many Done frames in one buffer before Hello: the first closes it, the rest are not read.
    let mut p = Pair::new(0);
    let mut many = Vec::new();
    for g in 0..10_000 {
        let d = Msg::Done {
            slot: 0,
            gen: g,
            ok: true,
            reason: String::new(),
        };
        many.extend(p.forge(&d, None, true));
    }
    p.server.recv(&many, 0, p.now, &p.keys.clone(), &mut p.at_server);
    assert!(p.server.is_dead() && p.at_server.is_empty());
}

/// Requests open on one connection are bounded: past [`MAX_OPEN`] the core answers `Fallback`
/// itself and records nothing; a request for a slot outside the table closes it.
#[test]
fn link_open_requests_are_bounded() {
    let mut p = Pair::new(0);
    p.shake();
    let mut bytes = Vec::new();
    for n in 0..(MAX_OPEN + 5) as u64 {
        let m = Pair::req((n % SLOTS as u64) as u32, n, 1, false, Device::Host, 1);
        bytes.extend(p.forge(&m, Some(1), true));
    }
    p.server.recv(&bytes, 0, p.now, &p.keys.clone(), &mut p.at_server);
    assert!(!p.server.is_dead());
    let reqs = p.at_server.iter().filter(|h| matches!(h, Heard::Req(_))).count();
    assert_eq!(reqs, MAX_OPEN);
    assert_eq!(p.server.open.len(), MAX_OPEN);
    let mut fallbacks = 0;
    let out = p.server.out().to_vec();
    let mut at = 0;
    while let Some((f, n)) = Msg::decode(&out[at..], MAX_FRAME).unwrap() {
        fallbacks += usize::from(matches!(f.msg, Msg::Fallback { .. }));
        at += n;
    }
    assert_eq!(fallbacks, 5);
    let m = p.forge(
        &Pair::req(SLOTS as u32, 1, 1, false, Device::Host, 1),
        Some(1),
        true,
    );
    p.server.recv(&m, 0, p.now, &p.keys.clone(), &mut p.at_server);
    assert!(p.server.is_dead(), "a slot outside the table");
}

/// A device read's grant must carry one export per range; a host grant for a device read, or
/// a grant for a write, closes the connection.
#[test]
fn link_grants_must_fit_their_request() {
    let mut p = Pair::new(0);
    p.shake();
    assert!(p
        .client
        .request_msg(KEYS[1], &Pair::req(1, 1, 1, false, Device::Cuda(0), 2)));
    let g = Msg::GrantIpc {
        slot: 1,
        gen: 1,
        sources: Vec::new(),
    };
    let g = p.forge(&g, Some(1), false);
    p.client.recv(&g, 0, p.now, &HashMap::new(), &mut p.at_client);
    assert!(p.client.is_dead());
    let mut p = Pair::new(0);
    p.shake();
    assert!(p
        .client
        .request_msg(KEYS[1], &Pair::req(1, 1, 1, true, Device::Host, 1)));
    let g = p.forge(&Msg::Grant { slot: 1, gen: 1 }, Some(1), false);
    p.client.recv(&g, 0, p.now, &HashMap::new(), &mut p.at_client);
    assert!(p.client.is_dead(), "a write granted as a read");
}

/// The fuzz target's invariants hold over a few fixed programs (the corpus's seeds), so a
/// change that breaks them fails here, not only under `cargo fuzz`.
#[test]
fn link_fuzz_programs_hold_their_invariants() {
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for _ in 0..2_000 {
        let mut prog = vec![0u8; 96];
        for b in &mut prog {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = (x >> 32) as u8;
        }
        // Start most programs with an honest handshake so the ready state is reached.
        prog[..8].copy_from_slice(&[0, 0, 0, 1, 1, 0, 0, 0]);
        super::fuzz::run(&prog);
    }
}

/// The protocol core (this connection core, the frame codec, the MACs, the identity) names nothing of the edge:
/// only its own parts, the slot count (a limit) and the device type. A `use` of the transport's state, its
/// jobs or the copy pool here would let a call circle run through the core.
#[test]
fn link_core_imports_nothing_of_the_edge() {
    let core = [
        ("link.rs", include_str!("../link.rs")),
        ("link/events.rs", include_str!("events.rs")),
        ("wire.rs", include_str!("../wire.rs")),
        ("wire/req.rs", include_str!("../wire/req.rs")),
        ("auth.rs", include_str!("../auth.rs")),
        ("identity.rs", include_str!("../identity.rs")),
        ("violation.rs", include_str!("../violation.rs")),
    ];
    let allowed = [
        "super::auth",
        "super::identity",
        "super::violation",
        "super::wire",
        "crate::engine::same_host::wire",
        "super::limits::SLOTS",
        "super::limits::MAX_LANES",
        "crate::engine::same_host::auth",
        "crate::engine::same_host::limits::MAX_LANES",
        "super::{device_code, device_from, IpcSource, MAC_LEN, R, SOURCE_BYTES, W}",
        "crate::device::Device",
        "crate::ipc_source::IpcSource",
        "super::*",
    ];
    let mut named = 0;
    for (file, text) in core {
        for (n, line) in text.lines().enumerate() {
            let code = line.trim_start();
            if code.starts_with("//") {
                continue;
            }
            for root in ["super::", "crate::"] {
                for (at, _) in code.match_indices(root) {
                    named += 1;
                    assert!(
                        allowed.iter().any(|a| code[at..].starts_with(a)),
                        "{file}:{}: the protocol core names `{}`",
                        n + 1,
                        code[at..].split([';', ',', '{', ' ']).next().unwrap_or(""),
                    );
                }
            }
        }
    }
    assert!(named >= 5, "the scan found the core's own imports");
}

/// A `Hello` naming no live operation is answered (the client refuses its opening operation as a
/// replay) and the connection closed: no `Trusted` makes it ready, so a peer holding no key of
/// this process is served nothing, not even refusals.
#[test]
fn link_hello_naming_no_live_operation_is_not_served() {
    let mut p = Pair::new(2); // the server holds KEYS[0] and KEYS[1] only
    p.deliver_to_server(1);
    assert!(p.server.is_dead() && !p.server.is_ready());
    p.deliver_to_client();
    assert!(p.client.is_dead());
    assert!(p.at_client.iter().any(|h| matches!(h, Heard::NotLive { .. })));
    let trusted = p.forge(&Msg::Trusted { pipes: false }, None, true);
    p.server
        .recv(&trusted, 0, p.now, &p.keys.clone(), &mut p.at_server);
    assert!(p.server.is_dead() && !p.server.is_ready());
    assert!(
        p.server.out().is_empty() || p.server.out().len() < 200,
        "only the welcome"
    );
}

/// A peer that sends and never reads what it is answered (replayed requests, each refused) is cut
/// off once [`MAX_UNSENT`] bytes wait for it.
#[test]
fn link_a_peer_that_does_not_read_is_cut_off() {
    let mut p = Pair::new(0);
    p.shake();
    let replay = p.forge(&Pair::req(1, 1, 2, false, Device::Host, 1), Some(2), true);
    let batch = replay.repeat(500);
    let mut sent = 0;
    while !p.server.is_dead() {
        p.server.recv(&batch, 0, p.now, &p.keys.clone(), &mut p.at_server);
        sent += batch.len();
        assert!(p.server.out().len() <= MAX_UNSENT + 500 * 256);
        assert!(sent < 2 * MAX_UNSENT, "never cut off");
    }
    assert_eq!(p.server.death(), Some(Violation::NotReading));
}

/// What a peer reads a byte at a time comes out whole and in order (sent bytes are dropped from
/// the buffer in halves, not on every send).
#[test]
fn link_sent_bytes_leave_in_order_however_they_are_read() {
    let mut p = Pair::new(0);
    p.shake();
    let replay = p.forge(&Pair::req(1, 1, 2, false, Device::Host, 1), Some(2), true);
    p.server
        .recv(&replay.repeat(300), 0, p.now, &p.keys.clone(), &mut p.at_server);
    let want = p.server.out().to_vec();
    assert!(want.len() > 10_000);
    let mut got = Vec::new();
    let mut step = 1;
    while !p.server.out().is_empty() {
        let n = step.min(p.server.out().len());
        got.extend_from_slice(&p.server.out()[..n]);
        p.server.sent(n);
        step = step % 97 + 1;
    }
    assert_eq!(got, want);
    p.server.sent(5); // more than queued: nothing breaks
    assert!(p.server.out().is_empty());
}

/// A small host read takes one round trip: the request asks for the bytes, the owner's answer
/// carries them (proven under the operation's key), and nothing more is sent for it (a `Done`
/// after it is a frame for no granted read, and closes the connection).
#[test]
fn link_eager_read_takes_one_round_trip() {
    let mut p = Pair::new(0);
    p.shake();
    assert!(p
        .client
        .request_msg(KEYS[1], &Pair::eager_req(2, 5, 1, false, 4096)));
    p.deliver_to_server(0);
    let Some(Heard::Req(r)) = p.at_server.pop() else {
        panic!("{:?}", p.at_server)
    };
    assert!(r.req.eager && !r.req.write && r.req.data.is_empty());
    p.server.answer(2, 5, Answer::Data(vec![0x33; 4096]));
    assert!(
        p.server.open.is_empty(),
        "the answer ends the request at the owner"
    );
    p.deliver_to_client();
    assert_eq!(
        p.at_client.pop(),
        Some(Heard::Data {
            slot: 2,
            gen: 5,
            data: vec![0x33; 4096]
        })
    );
    assert!(p.client.open.is_empty(), "and at the reader: no Done follows");
    p.client.read_done(2, 5, true, "");
    assert!(p.client.out().is_empty(), "a done for an eager read is not sent");
    assert!(!p.client.is_dead() && !p.server.is_dead());
}

/// A small host write carries its bytes in its request; the owner's `Done` ends it.
#[test]
fn link_eager_write_carries_its_bytes() {
    let mut p = Pair::new(0);
    p.shake();
    assert!(p
        .client
        .request_msg(KEYS[0], &Pair::eager_req(1, 1, 0, true, 100)));
    p.deliver_to_server(0);
    let Some(Heard::Req(r)) = p.at_server.pop() else {
        panic!("{:?}", p.at_server)
    };
    assert!(r.req.write && !r.req.eager && r.req.data == vec![0x5a; 100] && r.req.local.is_empty());
    p.server.answer(
        1,
        1,
        Answer::WriteDone {
            ok: true,
            reason: String::new(),
        },
    );
    p.deliver_to_client();
    assert!(matches!(
        p.at_client.pop(),
        Some(Heard::WriteDone { ok: true, .. })
    ));
}

/// Bytes the reader did not ask for, or not exactly as many as it asked for, or under another
/// operation's key, are never believed: the connection closes and nothing is heard. A correct
/// answer repeated is an answer to no open request.
#[test]
fn link_eager_answers_must_fit_their_request() {
    type Case = (Msg, Option<usize>, fn(&mut Pair));
    let eager = |p: &mut Pair| {
        assert!(p
            .client
            .request_msg(KEYS[0], &Pair::eager_req(0, 1, 0, false, 4096)))
    };
    let plain = |p: &mut Pair| {
        assert!(p
            .client
            .request_msg(KEYS[0], &Pair::req(0, 1, 0, false, Device::Host, 1)))
    };
    let write = |p: &mut Pair| {
        assert!(p
            .client
            .request_msg(KEYS[0], &Pair::eager_req(0, 1, 0, true, 4096)))
    };
    let data = |n: usize| Msg::Data {
        slot: 0,
        gen: 1,
        data: vec![1; n],
    };
    let cases: [Case; 6] = [
        (data(4095), Some(0), eager),
        (data(4097), Some(0), eager),
        (data(4096), Some(0), plain),
        (data(4096), Some(0), write),
        (data(4096), Some(1), eager),
        (data(4096), None, eager),
    ];
    for (m, key, ask) in cases {
        let mut p = Pair::new(0);
        p.shake();
        ask(&mut p);
        let before = p.at_client.len();
        let bytes = p.forge(&m, key, false);
        p.client.recv(&bytes, 0, p.now, &HashMap::new(), &mut p.at_client);
        assert!(p.client.is_dead(), "{m:?} under {key:?}");
        assert_eq!(p.at_client.len(), before, "nothing believed");
    }
    let mut p = Pair::new(0);
    p.shake();
    eager(&mut p);
    let bytes = p.forge(&data(4096), Some(0), false).repeat(2);
    p.client.recv(&bytes, 0, p.now, &HashMap::new(), &mut p.at_client);
    assert_eq!(
        p.at_client
            .iter()
            .filter(|h| matches!(h, Heard::Data { .. }))
            .count(),
        1
    );
    assert!(p.client.is_dead(), "the second copy answers no open request");
}

/// The owner takes an eager request only as the protocol allows: a write whose bytes do not add
/// up to its ranges, bytes with a read, an eager read of device memory or past `EAGER_MAX`
/// close the connection before anything reaches the scope policy. An answer that does not fit
/// its eager read goes out as a `Fallback`, never as bytes.
#[test]
fn link_eager_requests_must_be_small_host_operations() {
    let req = |write: bool, eager: bool, device: Device, remote: u64, local: usize, data: usize| {
        Msg::Req(Req {
            slot: 0,
            gen: 1,
            write,
            ident: 1,
            key_id: auth::key_id(KEYS[0]),
            device,
            remote: vec![(0x1000, remote)],
            local: vec![(0x9000, remote); local],
            sources: Vec::new(),
            eager,
            data: vec![9; data],
            pipes: 0,
        })
    };
    for m in [
        req(true, false, Device::Host, 4096, 0, 4095),
        req(true, false, Device::Host, 4096, 1, 4096),
        req(false, false, Device::Host, 4096, 0, 4096),
        req(true, false, Device::Cuda(0), 4096, 0, 4096),
        req(false, true, Device::Cuda(0), 4096, 0, 0),
        req(true, true, Device::Host, 4096, 0, 0),
        req(false, true, Device::Host, EAGER_MAX as u64 + 1, 0, 0),
        req(false, true, Device::Host, u64::MAX, 0, 0),
    ] {
        let mut p = Pair::new(0);
        p.shake();
        let bytes = p.forge(&m, Some(0), true);
        p.server.recv(&bytes, 0, p.now, &p.keys, &mut p.at_server);
        assert!(p.server.is_dead(), "{m:?}");
        assert!(!p.at_server.iter().any(|h| matches!(h, Heard::Req(_))), "{m:?}");
    }
    let mut p = Pair::new(0);
    p.shake();
    read(&mut p, 0, 1, 0);
    p.server.answer(0, 1, Answer::Data(vec![1; 4096]));
    p.deliver_to_client();
    assert!(
        matches!(p.at_client.pop(), Some(Heard::Fallback { .. })),
        "bytes for a grant's read"
    );
}

/// Round 4: a metadata holder (it knows every key in the metadata) binds the owner's socket name
/// and answers with a correct proof of the key under its own identity. The client believes
/// nothing: it hears an impostor, sends no `Trusted` and no request (so no eager bytes, ranges or
/// device exports), and its core closes.
#[test]
fn link_metadata_holder_cannot_answer_as_the_owner() {
    for opening in [0, 1] {
        let mut p = Pair::serving_as(opening, IMPOSTOR_SEED);
        p.deliver_to_server(1);
        assert_eq!(
            p.at_server,
            vec![Heard::Hello],
            "the squatter proves the key it holds"
        );
        p.deliver_to_client();
        assert_eq!(p.at_client, vec![Heard::Impostor]);
        assert!(p.client.is_dead());
        assert!(p.client.out().is_empty(), "nothing follows the hello");
        assert!(
            !p.client
                .request_msg(KEYS[opening], &Pair::eager_req(0, 1, opening, true, 4096)),
            "a small write's bytes never leave on it"
        );
        assert!(p.client.out().is_empty());
    }
}

/// Round 4: "no live operation" ends an operation only when the owner says it. A `Welcome`
/// without a proof that is not signed by the advertised identity (a squatter's, or an unsigned
/// one) is an impostor's (the operation takes NIXL), not a replay; the owner's is a replay.
#[test]
fn link_unproven_not_live_welcome_is_an_impostor() {
    for (seed, heard) in [
        (IMPOSTOR_SEED, Heard::Impostor),
        (SERVER_SEED, Heard::NotLive { key: KEYS[2].into() }),
    ] {
        let mut p = Pair::new(2);
        p.deliver_to_server(1);
        p.server.sent(p.server.out().len());
        let w = p.forge(&p.welcome(None, seed), None, false);
        p.client.recv(&w, 0, p.now, &HashMap::new(), &mut p.at_client);
        assert_eq!(p.at_client, vec![heard]);
    }
    // A Welcome with the owner's key but a signature over another nonce (a replayed Welcome).
    let mut p = Pair::new(0);
    let old = p.welcome(Some(0), SERVER_SEED);
    p.nonce = [9; 16];
    p.client = Link::client(
        KEYS[0].into(),
        Identity::from_seed(SERVER_SEED).fingerprint(),
        p.nonce,
        4100,
        4200,
        false,
        p.now,
    );
    let w = p.forge(&old, None, false);
    p.client.recv(&w, 0, p.now, &HashMap::new(), &mut p.at_client);
    assert_eq!(
        p.at_client,
        vec![Heard::Impostor],
        "a Welcome replayed from another connection"
    );
}

/// The owner's identity is proven once per connection; every later operation's frames still go
/// under their own key (the cross-operation rules hold on an identity-proven connection).
#[test]
fn link_owner_proven_connection_serves_later_operations() {
    let mut p = Pair::new(0);
    p.shake();
    assert_eq!(p.at_client, vec![Heard::Ready]);
    assert!(p
        .client
        .request_msg(KEYS[1], &Pair::eager_req(3, 1, 1, true, 4096)));
    p.deliver_to_server(0);
    assert!(matches!(&p.at_server[2], Heard::Req(r) if &*r.key == KEYS[1] && r.req.data.len() == 4096));
}

/// A host request through pipes, as a client that cannot read the server's memory sends it: a
/// read asking for `pipes` lanes, or a write passing `pipes` read ends (and no addresses).
fn piped_req(slot: u32, write: bool, pipes: u8) -> Msg {
    let mut m = Pair::req(slot, 1, 1, write, Device::Host, 1);
    if let Msg::Req(Req { local, pipes: p, .. }) = &mut m {
        local.clear();
        *p = pipes;
    }
    m
}

/// Pipes' read ends pass only where the client said it uses pipes (its `Trusted`), exactly as
/// many as the frame that takes them says, never more than a bound waiting; a frame that names
/// more than came, a grant of pipes for a request that asked none or more lanes than asked, and
/// pipes for device memory close the connection before anything reaches the owner.
#[test]
fn link_pipes_pass_only_as_many_as_their_frames_say() {
    // A piped write: its two read ends come with it and are counted off.
    let mut p = Pair::piped(0);
    p.shake();
    assert_eq!(p.at_server, vec![Heard::Hello, Heard::Trusted { pipes: true }]);
    assert!(p.client.request_msg(KEYS[1], &piped_req(1, true, 2)));
    p.deliver_to_server(2);
    assert!(!p.server.is_dead(), "{:?}", p.server.death());
    assert!(matches!(&p.at_server[2], Heard::Req(r) if r.req.pipes == 2 && r.req.write && r.passed == 2));
    // One fewer than the frame says.
    let mut p = Pair::piped(0);
    p.shake();
    assert!(p.client.request_msg(KEYS[1], &piped_req(1, true, 2)));
    p.deliver_to_server(1);
    assert_eq!(p.server.death(), Some(Violation::MissingDescriptors));
    assert_eq!(p.at_server.len(), 2, "nothing reached the owner");
    // Pipes on a connection whose client did not say it uses them.
    let mut p = Pair::new(0);
    p.shake();
    let forged = p.forge(&piped_req(1, true, 1), Some(1), true);
    p.server
        .recv(&forged, 1, p.now, &p.keys.clone(), &mut p.at_server);
    assert_eq!(p.server.death(), Some(Violation::PassedOutsideHello));
    // More descriptors waiting than two frames take.
    let mut p = Pair::piped(0);
    p.shake();
    p.server.recv(
        &[],
        MAX_PENDING_DESCRIPTORS + 1,
        p.now,
        &p.keys.clone(),
        &mut p.at_server,
    );
    assert_eq!(p.server.death(), Some(Violation::PassedOutsideHello));
    // Descriptors left over once the bytes are handled (no frame took them).
    let mut p = Pair::piped(0);
    p.shake();
    assert!(p.client.request_msg(KEYS[1], &piped_req(1, true, 1)));
    p.deliver_to_server(2);
    assert_eq!(p.server.death(), None, "one may belong to the next frame");
    let mut p = Pair::new(0);
    p.shake();
    p.server.recv(&[], 1, p.now, &p.keys.clone(), &mut p.at_server);
    assert_eq!(p.server.death(), Some(Violation::PassedOutsideHello));
    // Pipes for device memory: a device write's (it passes VMM descriptors with its sources,
    // not pipes), or more than the one a device read asks VMM exports with.
    for (write, pipes) in [(true, 1), (false, 2)] {
        let mut p = Pair::piped(0);
        p.shake();
        let mut m = piped_req(1, write, pipes);
        if let Msg::Req(Req { device, .. }) = &mut m {
            *device = Device::Cuda(0);
        }
        let forged = p.forge(&m, Some(1), true);
        p.server.recv(
            &forged,
            usize::from(pipes),
            p.now,
            &p.keys.clone(),
            &mut p.at_server,
        );
        assert_eq!(
            p.server.death(),
            Some(Violation::MissingDescriptors),
            "{write} {pipes}"
        );
    }
}

/// `Forgot` (exports given back) passes either way once the handshake is done, never before.
#[test]
fn link_forgot_passes_both_ways_once_ready() {
    let mut p = Pair::new(0);
    p.shake();
    p.client.forgot(&(0..70).collect::<Vec<u64>>());
    p.deliver_to_server(0);
    let told: Vec<u64> = p
        .at_server
        .iter()
        .filter_map(|h| match h {
            Heard::Forgot { ids } => Some(ids.clone()),
            _ => None,
        })
        .flatten()
        .collect();
    assert_eq!(told, (0..70).collect::<Vec<u64>>(), "in two frames");
    p.server.forgot(&[5]);
    p.deliver_to_client();
    assert_eq!(p.at_client.last(), Some(&Heard::Forgot { ids: vec![5] }));
    assert!(!p.client.is_dead() && !p.server.is_dead());
    // Before the handshake: out of order.
    let mut p = Pair::new(0);
    let bytes = p.forge(&Msg::Forgot { ids: vec![1] }, None, true);
    p.server.recv(&bytes, 0, p.now, &p.keys.clone(), &mut p.at_server);
    assert_eq!(p.server.death(), Some(Violation::OutOfOrder));
}

/// A device source exported as a VMM descriptor (`fd` k: the k-th passed with the frame).
fn vmm_source(fd: u8) -> IpcSource {
    IpcSource {
        handle: [0; 64],
        fd,
        ..super::fuzz::source(16)
    }
}

/// Delivers a grant frame `m`, proven under `KEYS[1]`, with `fds` descriptors, to the client.
fn deliver_grant(p: &mut Pair, m: &Msg, fds: usize) {
    let bytes = p.forge(m, Some(1), false);
    p.client
        .recv(&bytes, fds, p.now, &HashMap::new(), &mut p.at_client);
}

/// Device memory as VMM descriptors: a write's come with it, as many as its sources name, only
/// where the client said it passes descriptors; a device read asks for them (`pipes: 1`) and its
/// `GrantIpc` then passes one per allocation (legacy handles beside them for memory that has
/// one); a grant passing descriptors nobody asked for, or fewer than its sources name, closes the
/// connection before anything reaches the owner.
#[test]
fn link_vmm_descriptors_pass_only_with_the_sources_that_name_them() {
    let write_req = |sources: Vec<IpcSource>| {
        let mut m = Pair::req(1, 1, 1, true, Device::Cuda(0), sources.len());
        if let Msg::Req(Req { sources: s, .. }) = &mut m {
            *s = sources;
        }
        m
    };
    // Two ranges of one allocation and one of another: two descriptors.
    let mut p = Pair::piped(0);
    p.shake();
    assert!(p.client.request_msg(
        KEYS[1],
        &write_req(vec![vmm_source(1), vmm_source(2), vmm_source(1)])
    ));
    p.deliver_to_server(2);
    assert!(!p.server.is_dead(), "{:?}", p.server.death());
    assert!(
        matches!(&p.at_server[2], Heard::Req(r) if r.req.sources.len() == 3 && r.req.write && r.passed == 2)
    );
    // One fewer than the sources name.
    let mut p = Pair::piped(0);
    p.shake();
    assert!(p
        .client
        .request_msg(KEYS[1], &write_req(vec![vmm_source(1), vmm_source(2)])));
    p.deliver_to_server(1);
    assert_eq!(p.server.death(), Some(Violation::MissingDescriptors));
    assert_eq!(p.at_server.len(), 2, "nothing reached the owner");
    // An index skipped (descriptor 2 named, 1 never).
    let mut p = Pair::piped(0);
    p.shake();
    assert!(p.client.request_msg(KEYS[1], &write_req(vec![vmm_source(2)])));
    p.deliver_to_server(2);
    assert_eq!(p.server.death(), Some(Violation::MissingDescriptors));
    // On a connection whose client did not say it passes descriptors.
    let mut p = Pair::new(0);
    p.shake();
    let forged = p.forge(&write_req(vec![vmm_source(1)]), Some(1), true);
    p.server
        .recv(&forged, 1, p.now, &p.keys.clone(), &mut p.at_server);
    assert_eq!(p.server.death(), Some(Violation::PassedOutsideHello));

    // Reads: asked with `pipes: 1`, granted with one descriptor per allocation.
    let read_req = || {
        let mut m = Pair::req(1, 1, 1, false, Device::Cuda(0), 2);
        if let Msg::Req(Req { pipes, .. }) = &mut m {
            *pipes = 1;
        }
        m
    };
    let grant = |p: &mut Pair, asked: bool, sources: Vec<IpcSource>, fds: usize| {
        let m = if asked {
            read_req()
        } else {
            Pair::req(1, 1, 1, false, Device::Cuda(0), 2)
        };
        assert!(p.client.request_msg(KEYS[1], &m));
        p.deliver_to_server(0);
        assert!(
            matches!(p.at_server.last(), Some(Heard::Req(r)) if !r.req.write && r.req.pipes == u8::from(asked))
        );
        deliver_grant(
            p,
            &Msg::GrantIpc {
                slot: 1,
                gen: 1,
                sources,
            },
            fds,
        );
    };
    let mut p = Pair::piped(0);
    p.shake();
    grant(&mut p, true, vec![vmm_source(1), vmm_source(1)], 1);
    assert!(!p.client.is_dead(), "{:?}", p.client.death());
    assert!(matches!(p.at_client.last(), Some(Heard::Grant { sources: Some(s), .. }) if s.len() == 2));
    // Through the server's own answer: the descriptors' count is the frame's.
    let mut p = Pair::piped(0);
    p.shake();
    assert!(p.client.request_msg(KEYS[1], &read_req()));
    p.deliver_to_server(0);
    assert!(p
        .server
        .answer(1, 1, Answer::GrantIpc(vec![vmm_source(1), vmm_source(2)])));
    p.deliver_to_client_with(2);
    assert!(!p.client.is_dead(), "{:?}", p.client.death());
    // A client that takes exports without pipes (it uses CUDA, in one PID namespace): its
    // `Trusted` lets it pass descriptors, its host writes are not piped, its grants take them.
    let mut p = Pair::exporting(0);
    p.shake();
    assert_eq!(p.at_server[1], Heard::Trusted { pipes: true });
    assert!(p.client.passes_descriptors() && !p.client.writes_piped() && p.client.takes_exports());
    grant(&mut p, true, vec![vmm_source(1), vmm_source(1)], 1);
    assert!(!p.client.is_dead(), "{:?}", p.client.death());
    // Neither pipes nor exports: no descriptor is taken with a grant.
    let mut p = Pair::new(0);
    p.shake();
    assert!(!p.client.passes_descriptors() && !p.client.takes_exports());
    grant(&mut p, false, vec![vmm_source(1), vmm_source(1)], 1);
    assert_eq!(p.client.death(), Some(Violation::PassedOutsideHello));
    // A legacy handle beside a descriptor, where they were asked for (memory that has one).
    let mut p = Pair::piped(0);
    p.shake();
    grant(&mut p, true, vec![vmm_source(1), vmm_source(0)], 1);
    assert!(!p.client.is_dead(), "{:?}", p.client.death());
    // Fewer descriptors than named; an index skipped; descriptors where legacy handles were
    // asked for.
    for (asked, sources, fds) in [
        (true, vec![vmm_source(1), vmm_source(2)], 1),
        (true, vec![vmm_source(2), vmm_source(2)], 2),
        (false, vec![vmm_source(1), vmm_source(1)], 1),
    ] {
        let mut p = Pair::piped(0);
        p.shake();
        grant(&mut p, asked, sources, fds);
        assert_eq!(
            p.client.death(),
            Some(Violation::MissingDescriptors),
            "{asked} {fds}"
        );
        assert!(!p.at_client.iter().any(|h| matches!(h, Heard::Grant { .. })));
    }
}

/// A read through pipes: the server's `GrantPipe` carries at most the lanes asked, with as many
/// read ends; the client takes exactly those, and nothing else.
#[test]
fn link_pipe_grants_fit_their_reads() {
    let grant = |p: &mut Pair, lanes: u8, fds: usize| {
        assert!(p.client.request_msg(KEYS[1], &piped_req(1, false, 2)));
        p.deliver_to_server(0);
        assert!(matches!(p.at_server.last(), Some(Heard::Req(r)) if r.req.pipes == 2 && !r.req.write));
        deliver_grant(
            p,
            &Msg::GrantPipe {
                slot: 1,
                gen: 1,
                lanes,
            },
            fds,
        );
    };
    let mut p = Pair::piped(0);
    p.shake();
    grant(&mut p, 2, 2);
    assert_eq!(
        p.at_client.last(),
        Some(&Heard::GrantPipe {
            slot: 1,
            gen: 1,
            lanes: 2
        })
    );
    assert!(!p.client.is_dead());
    // Through the server's own answer.
    let mut p = Pair::piped(0);
    p.shake();
    assert!(p.client.request_msg(KEYS[1], &piped_req(1, false, 2)));
    p.deliver_to_server(0);
    assert!(
        !p.server.answer(1, 1, Answer::GrantPipe(3)),
        "more lanes than asked"
    );
    assert!(p.server.answer(1, 1, Answer::GrantPipe(1)));
    p.deliver_to_client_with(1);
    assert_eq!(
        p.at_client.last(),
        Some(&Heard::GrantPipe {
            slot: 1,
            gen: 1,
            lanes: 1
        })
    );
    // More lanes than asked, fewer read ends than lanes, unproven.
    let mut p = Pair::piped(0);
    p.shake();
    grant(&mut p, 3, 3);
    assert_eq!(p.client.death(), Some(Violation::WrongAnswer));
    let mut p = Pair::piped(0);
    p.shake();
    grant(&mut p, 2, 1);
    assert_eq!(p.client.death(), Some(Violation::MissingDescriptors));
    let mut p = Pair::piped(0);
    p.shake();
    assert!(p.client.request_msg(KEYS[1], &piped_req(1, false, 2)));
    let bytes = p.forge(
        &Msg::GrantPipe {
            slot: 1,
            gen: 1,
            lanes: 1,
        },
        None,
        false,
    );
    p.client.recv(&bytes, 1, p.now, &HashMap::new(), &mut p.at_client);
    assert_eq!(p.client.death(), Some(Violation::UnprovenAnswer));
    // A pipe grant for a read that asked none; descriptors to a client that uses no pipes.
    let mut p = Pair::piped(0);
    p.shake();
    assert!(p
        .client
        .request_msg(KEYS[1], &Pair::req(1, 1, 1, false, Device::Host, 1)));
    let bytes = p.forge(
        &Msg::GrantPipe {
            slot: 1,
            gen: 1,
            lanes: 1,
        },
        Some(1),
        false,
    );
    p.client.recv(&bytes, 1, p.now, &HashMap::new(), &mut p.at_client);
    assert_eq!(p.client.death(), Some(Violation::WrongAnswer));
    let mut p = Pair::new(0);
    p.shake();
    assert!(p
        .client
        .request_msg(KEYS[1], &Pair::req(1, 1, 1, false, Device::Host, 1)));
    p.client.recv(&[], 1, p.now, &HashMap::new(), &mut p.at_client);
    assert_eq!(p.client.death(), Some(Violation::PassedOutsideHello));
}

/// A server that cannot read its client's memory (a client in another PID namespace, ptrace
/// rules) asks in its signed `Welcome` for piped writes: the client's `Trusted` then says it
/// passes read ends, and its writes take pipes even where it could read the server.
#[test]
fn link_server_that_cannot_pull_asks_for_piped_writes() {
    let mut p = Pair::new(0);
    p.server.ask_piped_writes();
    p.shake();
    assert!(p.client.is_ready() && p.client.writes_piped());
    assert_eq!(p.at_server, vec![Heard::Hello, Heard::Trusted { pipes: true }]);
    assert!(p.client.request_msg(KEYS[1], &piped_req(1, true, 1)));
    p.deliver_to_server(1);
    assert!(matches!(p.at_server.last(), Some(Heard::Req(r)) if r.req.pipes == 1 && r.req.write));
    // Not asked: a client that can read the server writes by cross-memory attach.
    let mut p = Pair::new(0);
    p.shake();
    assert!(!p.client.writes_piped());
}
