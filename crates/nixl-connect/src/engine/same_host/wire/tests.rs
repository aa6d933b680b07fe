//! The frame codec alone: round trips split anywhere, exact lengths, limits before bytes,
//! malformed frames.

use super::*;

fn source(seed: u8) -> IpcSource {
    IpcSource {
        uuid: [seed; 16],
        handle: [seed ^ 0x5a; 64],
        base: 0x7f00_0000_0000,
        alloc_len: 2 << 20,
        buffer_id: u64::from(seed) + 40,
        offset: 4096,
        len: 1 << 20,
        fd: seed % 3,
    }
}

fn all() -> Vec<Msg> {
    vec![
        Msg::Hello {
            version: VERSION,
            key_id: [1; 16],
            nonce: [2; 16],
        },
        Msg::Welcome {
            proof: Some([5; 32]),
            public: [6; 32],
            sig: [7; 64],
            pipes: true,
        },
        Msg::Welcome {
            proof: None,
            public: [6; 32],
            sig: [7; 64],
            pipes: false,
        },
        Msg::Trusted { pipes: true },
        Msg::Reject { reason: "uid".into() },
        Msg::Forgot {
            ids: vec![7, 1 << 40],
        },
        Msg::Forgot { ids: Vec::new() },
        Msg::Req(Req {
            slot: 9,
            gen: 10,
            write: true,
            ident: 11,
            key_id: [6; 16],
            device: Device::Cuda(3),
            remote: vec![(1, 2), (3, 4)],
            local: vec![(5, 6), (7, 8)],
            sources: vec![source(1), source(2)],
            eager: false,
            data: Vec::new(),
            pipes: 0,
        }),
        Msg::Req(Req {
            slot: 12,
            gen: 13,
            write: true,
            ident: 14,
            key_id: [7; 16],
            device: Device::Host,
            remote: vec![(1, 3), (9, 2)],
            local: vec![],
            sources: vec![],
            eager: true,
            data: vec![1, 2, 3, 4, 5],
            pipes: 0,
        }),
        Msg::Req(Req {
            slot: 14,
            gen: 15,
            write: true,
            ident: 16,
            key_id: [8; 16],
            device: Device::Host,
            remote: vec![(1, 3), (9, 2)],
            local: vec![],
            sources: vec![],
            eager: false,
            data: vec![],
            pipes: MAX_LANES as u8,
        }),
        Msg::Grant { slot: 1, gen: 2 },
        Msg::GrantPipe {
            slot: 1,
            gen: 2,
            lanes: 1,
        },
        Msg::Data {
            slot: 5,
            gen: 6,
            data: vec![9; EAGER_MAX],
        },
        Msg::GrantIpc {
            slot: 3,
            gen: 4,
            sources: vec![source(3)],
        },
        Msg::Refuse {
            slot: 1,
            gen: 2,
            code: RefuseCode::Busy,
            reason: "busy".into(),
        },
        Msg::Fallback {
            slot: 1,
            gen: 2,
            reason: "gpu".into(),
        },
        Msg::Done {
            slot: 1,
            gen: 2,
            ok: false,
            reason: "x".into(),
        },
    ]
}

#[test]
fn wire_round_trips_split_anywhere() {
    let mut buf = Vec::new();
    for m in all() {
        m.encode(&mut buf);
    }
    // Feed the stream one byte at a time: every frame comes out once, whole.
    let mut got = Vec::new();
    let mut pending: Vec<u8> = Vec::new();
    for b in buf {
        pending.push(b);
        while let Some((f, used)) = Msg::decode(&pending, MAX_FRAME).unwrap() {
            assert_eq!(f.mac.is_some(), f.msg.signed());
            got.push(f.msg);
            pending.drain(..used);
        }
    }
    assert_eq!(got, all());
}

#[test]
fn wire_encoded_len_is_exact() {
    let long = "é".repeat(MAX_REASON); // 2 bytes a character: cut mid-way, at a boundary
    let mut msgs = all();
    msgs.push(Msg::Refuse {
        slot: 1,
        gen: 2,
        code: RefuseCode::OutOfRange,
        reason: long.clone(),
    });
    msgs.push(Msg::Reject { reason: long });
    for m in msgs {
        let mut buf = Vec::new();
        m.encode(&mut buf);
        assert_eq!(buf.len(), m.encoded_len(), "{m:?}");
        if let Msg::Req(req) = &m {
            assert_eq!(req.frame_len(), buf.len(), "a request's own size: {m:?}");
        }
        assert_eq!(m.kind().signed(), m.signed());
        let (f, used) = Msg::decode(&buf, MAX_FRAME).unwrap().expect("whole");
        assert_eq!(used, buf.len());
        if let Msg::Refuse { reason, .. } | Msg::Reject { reason } = &f.msg {
            assert!(reason.len() <= MAX_REASON);
            assert!(!reason.starts_with('é') || reason.chars().all(|c| c == 'é'));
        }
    }
}

#[test]
fn wire_refuses_a_length_over_the_limit_before_its_bytes() {
    let mut buf = Vec::new();
    Msg::Refuse {
        slot: 1,
        gen: 2,
        code: RefuseCode::Busy,
        reason: "x".repeat(100),
    }
    .encode(&mut buf);
    assert!(
        Msg::decode(&buf[..4], 64).is_err(),
        "refused from its prefix alone"
    );
    assert!(Msg::decode(&buf[..4], MAX_FRAME).unwrap().is_none());
}

#[test]
fn wire_rejects_malformed_frames_without_panicking() {
    assert!(Msg::decode(&[0, 0, 0, 0], MAX_FRAME).is_err());
    assert!(Msg::decode(&(MAX_FRAME as u32 + 1).to_le_bytes(), MAX_FRAME).is_err());
    let mut buf = Vec::new();
    all()[5].encode(&mut buf);
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    for _ in 0..50_000 {
        let mut m = buf.clone();
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let i = 4 + (x as usize) % (m.len() - 4);
        m[i] = (x >> 24) as u8;
        let _ = Msg::decode(&m, MAX_FRAME);
    }
    // So is an IPC source whose range overruns its allocation.
    let mut bad = source(7);
    bad.offset = bad.alloc_len - 1;
    let mut buf = Vec::new();
    Msg::GrantIpc {
        slot: 1,
        gen: 1,
        sources: vec![bad],
    }
    .encode(&mut buf);
    assert!(Msg::decode(&buf, MAX_FRAME).is_err());
    // So are an eager read's bytes, or an eager write's, past EAGER_MAX.
    for m in [
        Msg::Data {
            slot: 1,
            gen: 1,
            data: vec![0; EAGER_MAX + 1],
        },
        Msg::Req(Req {
            slot: 1,
            gen: 1,
            write: true,
            ident: 0,
            key_id: [0; 16],
            device: Device::Host,
            remote: vec![(0, EAGER_MAX as u64 + 1)],
            local: vec![],
            sources: vec![],
            eager: false,
            data: vec![0; EAGER_MAX + 1],
            pipes: 0,
        }),
        // More pipes than a copy uses, or a grant of none.
        Msg::Req(Req {
            slot: 1,
            gen: 1,
            write: true,
            ident: 0,
            key_id: [0; 16],
            device: Device::Host,
            remote: vec![(0, 1 << 20)],
            local: vec![],
            sources: vec![],
            eager: false,
            data: vec![],
            pipes: MAX_LANES as u8 + 1,
        }),
        Msg::GrantPipe {
            slot: 1,
            gen: 1,
            lanes: 0,
        },
        Msg::GrantPipe {
            slot: 1,
            gen: 1,
            lanes: MAX_LANES as u8 + 1,
        },
    ] {
        let mut buf = Vec::new();
        m.encode(&mut buf);
        assert!(Msg::decode(&buf, MAX_FRAME).is_err(), "{:?}", &buf[..5]);
    }
    // A huge range count in a small frame is refused, not allocated.
    let mut evil = vec![0u8; 4];
    evil.push(4);
    evil.extend_from_slice(&[0; 12]);
    evil.push(0);
    evil.extend_from_slice(&[0; 8 + 16]);
    evil.push(0);
    evil.extend_from_slice(&0u32.to_le_bytes());
    evil.extend_from_slice(&u32::MAX.to_le_bytes());
    let n = (evil.len() - 4) as u32;
    evil[..4].copy_from_slice(&n.to_le_bytes());
    assert!(Msg::decode(&evil, MAX_FRAME).is_err());
}

/// `Forgot` is unsigned and names at most `MAX_FORGOT` ids.
#[test]
fn wire_forgot_is_bounded() {
    let m = Msg::Forgot {
        ids: vec![1; MAX_FORGOT],
    };
    assert!(!m.signed());
    let mut b = Vec::new();
    m.encode(&mut b);
    assert_eq!(b.len(), m.encoded_len());
    assert!(matches!(Msg::decode(&b, MAX_FRAME), Ok(Some((f, _))) if f.msg == m));
    let mut b = Vec::new();
    Msg::Forgot {
        ids: vec![1; MAX_FORGOT + 1],
    }
    .encode(&mut b);
    assert!(Msg::decode(&b, MAX_FRAME).is_err());
}

/// A frame passes as many descriptors as its sources' highest index, every index from 1 used;
/// an index skipped or past what a frame may pass is malformed.
#[test]
fn wire_vmm_descriptor_indices_are_counted_and_bounded() {
    let with =
        |fds: &[u8]| -> Vec<IpcSource> { fds.iter().map(|&fd| IpcSource { fd, ..source(1) }).collect() };
    assert_eq!(passed_fds(&[]), Some(0));
    assert_eq!(passed_fds(&with(&[0, 0])), Some(0));
    assert_eq!(passed_fds(&with(&[1, 2, 1])), Some(2));
    assert_eq!(passed_fds(&with(&[2])), None, "index 1 skipped");
    assert_eq!(passed_fds(&with(&[MAX_LANES as u8 + 1])), None);
    // The decoder refuses an index past the bound.
    let m = Msg::GrantIpc {
        slot: 1,
        gen: 1,
        sources: with(&[MAX_LANES as u8 + 1]),
    };
    let mut b = Vec::new();
    m.encode_signed(&mut b, |_| [0; MAC_LEN]);
    assert!(Msg::decode(&b, MAX_FRAME).is_err());
}

/// Every frame type's byte reads back as that type, and no other byte is a type.
#[test]
fn wire_kinds_are_one_table() {
    for m in all() {
        let mut buf = Vec::new();
        m.encode(&mut buf);
        assert_eq!(buf[4], m.kind() as u8, "{m:?}");
    }
    let known: Vec<u8> = Kind::ALL.iter().map(|k| *k as u8).collect();
    for b in 0..=u8::MAX {
        assert_eq!(Kind::from_u8(b).is_some(), known.contains(&b), "type byte {b}");
    }
}
