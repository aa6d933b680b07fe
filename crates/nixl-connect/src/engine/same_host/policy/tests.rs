//! The access policy alone: each rule from a scope, a request and a load built in memory (no
//! socket, no poller, no clock, no sleep).

use super::*;
use crate::engine::same_host::records::RequestId;
use crate::engine::same_host::wire::IpcSource;
use crate::reg::Range;
use crate::state::{OpState, OperationStatus};

const BASE: u64 = 0x10_0000;
const LEN: u64 = 64 << 10;

fn scope(kind: OperationKind, device: Device) -> Scope {
    Scope::new(
        kind,
        vec![
            Range {
                addr: BASE as usize + LEN as usize * 2,
                len: LEN as usize,
                device,
            },
            Range {
                addr: BASE as usize,
                len: LEN as usize,
                device,
            },
        ],
        OpState::new(OperationStatus::Initialized),
    )
}

/// A request of `write` to `remote` ranges on `device` (a write's sources at `local`), as the
/// frame carries it: nothing small, piped or exported.
fn asked(write: bool, device: Device, remote: &[(u64, u64)], local: &[(u64, u64)]) -> Req {
    Req {
        slot: 0,
        gen: 1,
        write,
        ident: 1,
        key_id: [0; 16],
        device,
        remote: remote.to_vec(),
        local: local.to_vec(),
        sources: Vec::new(),
        eager: false,
        data: Vec::new(),
        pipes: 0,
    }
}

const IDLE: Load = Load {
    granted: 0,
    exporting: 0,
    exporting_all: 0,
    can_pull: true,
    pipes: 0,
    pipes_all: 0,
};

/// Every device pair is possible (a process with CUDA IPC).
fn any_path(_: Device, _: Device) -> Option<String> {
    None
}

/// No device pair is possible (a build or host without CUDA).
fn no_cuda(_: Device, _: Device) -> Option<String> {
    Some("no CUDA here".into())
}

fn busy(s: &mut Scope) {
    s.set_writer(RequestId {
        conn: 1,
        slot: 0,
        gen: 1,
    });
}

fn code(d: &Decision) -> Option<RefuseCode> {
    match d {
        Decision::Refuse(c, _) => Some(*c),
        _ => None,
    }
}

/// A request for a key no live scope has is refused as not live (a replay), whatever it asks.
#[test]
fn policy_unknown_key_is_not_live() {
    let r = [(BASE, 16)];
    for write in [false, true] {
        let d = decide(None, &asked(write, Device::Host, &r, &r), &IDLE, &any_path);
        assert_eq!(code(&d), Some(RefuseCode::NotLive), "{d:?}");
        assert!(matches!(&d, Decision::Refuse(_, m) if m == NOT_LIVE));
    }
}

/// A read of a writable or a write of a readable is refused; a request that names another
/// device than the operation's takes NIXL.
#[test]
fn policy_direction_and_device_must_match() {
    let r = [(BASE, 16)];
    let readable = scope(OperationKind::Read, Device::Host);
    let writable = scope(OperationKind::Write, Device::Host);
    let d = decide(
        Some(&readable),
        &asked(true, Device::Host, &r, &r),
        &IDLE,
        &any_path,
    );
    assert!(
        matches!(&d, Decision::Refuse(RefuseCode::WrongDirection, m) if m.contains("readable")),
        "{d:?}"
    );
    let d = decide(
        Some(&writable),
        &asked(false, Device::Host, &r, &r),
        &IDLE,
        &any_path,
    );
    assert!(
        matches!(&d, Decision::Refuse(RefuseCode::WrongDirection, m) if m.contains("writable")),
        "{d:?}"
    );
    let d = decide(
        Some(&readable),
        &asked(false, Device::Cuda(0), &r, &[]),
        &IDLE,
        &any_path,
    );
    assert!(matches!(d, Decision::Fallback(_)), "{d:?}");
}

/// An operation that ended (its status terminal, or completed earlier in this turn) is not live,
/// before any bound or path is considered.
#[test]
fn policy_ended_operation_is_not_live() {
    let r = [(BASE, 16)];
    let mut s = scope(OperationKind::Read, Device::Host);
    s.set_done(true);
    let d = decide(Some(&s), &asked(false, Device::Host, &r, &[]), &IDLE, &any_path);
    assert_eq!(code(&d), Some(RefuseCode::NotLive));
    let s = scope(OperationKind::Read, Device::Host);
    s.state().finish(OperationStatus::Cancelled, None);
    let d = decide(Some(&s), &asked(false, Device::Host, &r, &[]), &IDLE, &any_path);
    assert_eq!(code(&d), Some(RefuseCode::NotLive));
}

/// Every requested range lies inside one descriptor: none empty, none past an end, none spanning
/// the gap between two descriptors, none wrapping the address space.
#[test]
fn policy_ranges_must_lie_inside_one_descriptor() {
    let s = scope(OperationKind::Read, Device::Host);
    let inside = [(BASE, LEN), (BASE + 2 * LEN + 8, LEN - 8)];
    assert_eq!(
        decide(
            Some(&s),
            &asked(false, Device::Host, &inside, &[]),
            &IDLE,
            &any_path
        ),
        Decision::Grant
    );
    let outside: [&[(u64, u64)]; 5] = [
        &[],
        &[(BASE, LEN + 1)],
        &[(BASE + LEN - 8, 16)],
        &[(BASE - 1, 2)],
        &[(u64::MAX - 4, 8)],
    ];
    for remote in outside {
        let d = decide(
            Some(&s),
            &asked(false, Device::Host, remote, &[]),
            &IDLE,
            &any_path,
        );
        assert_eq!(code(&d), Some(RefuseCode::OutOfRange), "{remote:?}: {d:?}");
    }
}

/// Small operations: a read that asks for its bytes is answered with them; a write that carries
/// its bytes lands them, unless another writer is copying into the writable now.
#[test]
fn policy_small_operations_carry_their_bytes() {
    let r = [(BASE, 4096)];
    let s = scope(OperationKind::Read, Device::Host);
    let a = Req {
        eager: true,
        ..asked(false, Device::Host, &r, &[])
    };
    assert_eq!(decide(Some(&s), &a, &IDLE, &any_path), Decision::EagerRead);
    let mut s = scope(OperationKind::Write, Device::Host);
    let a = Req {
        data: vec![7; 4096],
        ..asked(true, Device::Host, &r, &r)
    };
    assert_eq!(decide(Some(&s), &a, &IDLE, &any_path), Decision::EagerWrite);
    busy(&mut s);
    assert_eq!(
        code(&decide(Some(&s), &a, &IDLE, &any_path)),
        Some(RefuseCode::Busy)
    );
}

/// A write's sources pair with its destinations: as many, of equal lengths, none wrapping.
#[test]
fn policy_write_sources_must_match_destinations() {
    let s = scope(OperationKind::Write, Device::Host);
    let remote = [(BASE, 16), (BASE + 32, 16)];
    let cases: [&[(u64, u64)]; 3] = [
        &[(0x1000, 16)],
        &[(0x1000, 16), (0x2000, 15)],
        &[(0x1000, 16), (u64::MAX - 7, 16)],
    ];
    for local in cases {
        let d = decide(
            Some(&s),
            &asked(true, Device::Host, &remote, local),
            &IDLE,
            &any_path,
        );
        assert_eq!(code(&d), Some(RefuseCode::OutOfRange), "{local:?}: {d:?}");
    }
    let local = [(0x1000, 16), (0x2000, 16)];
    assert_eq!(
        decide(
            Some(&s),
            &asked(true, Device::Host, &remote, &local),
            &IDLE,
            &any_path
        ),
        Decision::PullWrite
    );
}

/// Read grants per connection are capped (past the cap: NIXL), host and device alike, and the
/// cap comes before any device path is considered.
#[test]
fn policy_read_grants_per_connection_are_capped() {
    let r = [(BASE, 16)];
    let full = Load {
        granted: MAX_GRANTS_PER_CONN,
        ..IDLE
    };
    for device in [Device::Host, Device::Cuda(0)] {
        let s = scope(OperationKind::Read, device);
        let a = asked(false, device, &r, &[]);
        let d = decide(Some(&s), &a, &full, &no_cuda);
        assert!(
            matches!(&d, Decision::Fallback(m) if m.contains("grants already")),
            "{d:?}"
        );
        let below = Load {
            granted: MAX_GRANTS_PER_CONN - 1,
            ..IDLE
        };
        let want = if device == Device::Host {
            Decision::Grant
        } else {
            Decision::DeviceRead
        };
        assert_eq!(decide(Some(&s), &a, &below, &any_path), want);
    }
}

/// Device reads: exports queued at either bound (the connection's, the process's) and grants too
/// large for one frame take NIXL, as does a process without the device path.
#[test]
fn policy_device_reads_are_bounded_by_exports_and_frames() {
    let dev = Device::Cuda(0);
    let s = scope(OperationKind::Read, dev);
    let r = [(BASE, 16)];
    let a = asked(false, dev, &r, &[]);
    for load in [
        Load {
            exporting: MAX_EXPORTING_PER_CONN,
            ..IDLE
        },
        Load {
            exporting_all: MAX_EXPORTING,
            ..IDLE
        },
    ] {
        let d = decide(Some(&s), &a, &load, &any_path);
        assert!(
            matches!(&d, Decision::Fallback(m) if m.contains("being shared")),
            "{d:?}"
        );
    }
    let many = vec![(BASE, 1); MAX_FRAME / 16];
    let d = decide(Some(&s), &asked(false, dev, &many, &[]), &IDLE, &any_path);
    assert!(
        matches!(&d, Decision::Fallback(m) if m.contains("one same-host device grant")),
        "{d:?}"
    );
    let d = decide(Some(&s), &a, &IDLE, &no_cuda);
    assert_eq!(d, Decision::Fallback("no CUDA here".into()));
}

/// Writes: one writer at a time (host or device source), the device path's refusal and the
/// kernel's ptrace rules send the writer to NIXL, and each source kind takes its own copy.
#[test]
fn policy_writes_take_one_writer_and_the_right_copy() {
    let r = [(BASE, 16)];
    let host = scope(OperationKind::Write, Device::Host);
    let a = asked(true, Device::Host, &r, &r);
    assert_eq!(decide(Some(&host), &a, &IDLE, &any_path), Decision::PullWrite);
    let no_pull = Load {
        can_pull: false,
        ..IDLE
    };
    let d = decide(Some(&host), &a, &no_pull, &any_path);
    assert!(
        matches!(&d, Decision::Fallback(m) if m.contains("ptrace")),
        "{d:?}"
    );
    let mut taken = scope(OperationKind::Write, Device::Host);
    busy(&mut taken);
    assert_eq!(
        code(&decide(Some(&taken), &a, &IDLE, &any_path)),
        Some(RefuseCode::Busy)
    );

    // Host memory into a device writable: pulled through staging where the process can.
    let dev = scope(OperationKind::Write, Device::Cuda(0));
    let a = asked(true, Device::Cuda(0), &r, &r);
    assert_eq!(decide(Some(&dev), &a, &IDLE, &any_path), Decision::PullWrite);
    assert!(matches!(
        decide(Some(&dev), &a, &IDLE, &no_cuda),
        Decision::Fallback(_)
    ));

    // A device source: the writer's exports are opened here.
    let sources = [IpcSource {
        uuid: [0; 16],
        handle: [0; 64],
        base: 0,
        alloc_len: 16,
        buffer_id: 1,
        offset: 0,
        len: 16,
        fd: 0,
    }];
    let a = Req {
        sources: sources.to_vec(),
        ..asked(true, Device::Cuda(0), &r, &r)
    };
    assert_eq!(decide(Some(&dev), &a, &no_pull, &any_path), Decision::DeviceWrite);
    assert!(matches!(
        decide(Some(&dev), &a, &IDLE, &no_cuda),
        Decision::Fallback(_)
    ));
    let mut taken = scope(OperationKind::Write, Device::Cuda(0));
    busy(&mut taken);
    assert_eq!(
        code(&decide(Some(&taken), &a, &IDLE, &any_path)),
        Some(RefuseCode::Busy)
    );
    // A source export whose length differs from its destination's is out of range.
    let wrong = [IpcSource {
        len: 15,
        ..sources[0].clone()
    }];
    let a = Req {
        sources: wrong.to_vec(),
        ..a
    };
    assert_eq!(
        code(&decide(Some(&dev), &a, &IDLE, &any_path)),
        Some(RefuseCode::OutOfRange)
    );
}
