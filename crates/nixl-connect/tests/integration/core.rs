//! The core library against the real NIXL library (UCX moving host memory): every pairing in one
//! process and across two OS processes, validation, cancel and drop, NIXL absent.
//!
//! Cross-process cases re-run this test binary as the peer (`support_peer`, ignored unless the
//! peer environment variable is set), talking over its stdin/stdout.

use std::io::{BufRead, Write};
use std::time::{Duration, Instant};

use nixl_connect::{
    Connector, Descriptor, Device, Error, HostBuffer, Mismatch, OperationStatus, PathPolicy, RdmaMetadata,
    SerializedDescriptor, TransferPath,
};

use super::support::{
    all_bytes, pattern, run_support, runtime, sizes, split, split_ro, tcp_tls, Peer, PEER_ENV, T,
};

fn pair() -> (Connector, Connector) {
    (
        Connector::new().expect("NIXL is installed (bash scripts/setup.sh)"),
        Connector::new().unwrap(),
    )
}

/// Two connectors whose operations take `path` (the passive side always listens, so `Auto`
/// takes the same-host path and `Nixl` forces NIXL).
fn pair_on(path: PathPolicy) -> (Connector, Connector) {
    (
        Connector::new().expect("NIXL is installed (bash scripts/setup.sh)"),
        Connector::builder().path(path).build().unwrap(),
    )
}

/// Both paths, for the tests that must hold on each.
const PATHS: [(PathPolicy, TransferPath); 2] = [
    (PathPolicy::Auto, TransferPath::SameHost),
    (PathPolicy::Nixl, TransferPath::Nixl),
];

async fn read_pair(a: &Connector, b: &Connector, len: usize, ndesc: usize) {
    let src = HostBuffer::from_slice(&pattern(len, len as u64)).unwrap();
    let sz = sizes(len, ndesc);
    let readable = a.create_readable(split_ro(&src, &sz)).await.unwrap();
    assert_eq!(readable.status(), OperationStatus::Initialized);
    let md: RdmaMetadata = readable.metadata().to_json().parse().unwrap();
    assert_eq!(md.descriptors.len(), ndesc);
    let mut dst = vec![0u8; len];
    let read = b.begin_read(&md, split(&mut dst, &sz)).await.unwrap();
    read.wait_for_completion(T).await.unwrap();
    readable.wait_for_completion(T).await.unwrap();
    assert_eq!(read.status(), OperationStatus::Complete);
    assert_eq!(read.path(), Some(path_of(b)), "the expected path moved the bytes");
    assert_eq!(readable.status(), OperationStatus::Complete);
    drop(read);
    assert!(
        dst == src[..],
        "read {len} bytes in {ndesc} descriptors: bytes differ"
    );
}

async fn write_pair(a: &Connector, b: &Connector, len: usize, ndesc: usize) {
    let src = pattern(len, !(len as u64));
    let sz = sizes(len, ndesc);
    let mut dst = HostBuffer::new(len).unwrap();
    let writable = a.create_writable(split(&mut dst, &sz)).await.unwrap();
    let md: RdmaMetadata = writable.metadata().to_json().parse().unwrap();
    let write = b.begin_write(split_ro(&src, &sz), &md).await.unwrap();
    write.wait_for_completion(T).await.unwrap();
    writable.wait_for_completion(T).await.unwrap();
    assert_eq!(
        write.path(),
        Some(path_of(b)),
        "the expected path moved the bytes"
    );
    drop(writable);
    assert!(
        dst[..] == src[..],
        "write {len} bytes in {ndesc} descriptors: bytes differ"
    );
}

/// The path `b`'s operations take with a same-host passive side.
fn path_of(b: &Connector) -> TransferPath {
    match b.path_policy() {
        PathPolicy::Nixl => TransferPath::Nixl,
        _ => TransferPath::SameHost,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pairing_read_in_process_sizes() {
    for (p, _) in PATHS {
        let (a, b) = pair_on(p);
        for len in [1, 4096, 64 << 20] {
            read_pair(&a, &b, len, 1).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pairing_write_in_process_sizes() {
    for (p, _) in PATHS {
        let (a, b) = pair_on(p);
        for len in [1, 4096, 64 << 20] {
            write_pair(&a, &b, len, 1).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pairing_lists_of_64_descriptors() {
    for (p, _) in PATHS {
        let (a, b) = pair_on(p);
        read_pair(&a, &b, 1 << 20, 64).await;
        write_pair(&a, &b, 1 << 20, 64).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pairing_owned_memory_round_trips() {
    let (a, b) = pair();
    let readable = a
        .create_readable(Descriptor::from(pattern(5000, 5)))
        .await
        .unwrap();
    let read = b
        .begin_read(readable.metadata(), Descriptor::from(vec![0u16; 2500]))
        .await
        .unwrap();
    read.wait_for_completion(T).await.unwrap();
    readable.wait_for_completion(T).await.unwrap();
    let back = read.into_descriptors().unwrap();
    let v: Vec<u16> = back.into_iter().next().unwrap().into_inner().unwrap();
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_ne_bytes()).collect();
    assert_eq!(bytes, pattern(5000, 5));
    let src = readable.into_descriptors().into_iter().next().unwrap();
    assert_eq!(src.into_inner::<Vec<u8>>().unwrap(), pattern(5000, 5));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_registers_and_loads_once() {
    let (a, b) = pair_on(PathPolicy::Nixl);
    let src = HostBuffer::from_slice(&pattern(1 << 16, 1)).unwrap();
    let mut dst = HostBuffer::new(1 << 16).unwrap();
    for _ in 0..10 {
        let r = a.create_readable(Descriptor::from(&src)).await.unwrap();
        let op = b
            .begin_read(r.metadata(), Descriptor::from(&mut dst))
            .await
            .unwrap();
        op.wait_for_completion(T).await.unwrap();
        r.wait_for_completion(T).await.unwrap();
    }
    assert!(dst[..] == src[..]);
    let (sa, sb) = (a.stats().await.unwrap(), b.stats().await.unwrap());
    assert_eq!(
        sa.registrations, 1,
        "the readable side registered its buffer once: {sa:?}"
    );
    assert_eq!(
        sb.registrations, 1,
        "the reading side registered its buffer once: {sb:?}"
    );
    assert_eq!(
        sb.remote_loads, 1,
        "the peer's agent metadata was loaded once: {sb:?}"
    );
    assert_eq!(sb.transfers, 10);
    drop((src, dst));
    let sa = a.stats().await.unwrap();
    assert_eq!(
        sa.live_registrations, 0,
        "dropping the buffer deregisters it: {sa:?}"
    );
}

/// Reads `r` from `b` into a fresh `Vec` over `path`, and checks both ends and the bytes.
async fn read_checked(
    b: &Connector,
    r: &nixl_connect::ReadableOperation<'_>,
    path: TransferPath,
    want: Vec<u8>,
) {
    let op = b
        .begin_read(r.metadata(), Descriptor::from(vec![0u8; want.len()]))
        .await
        .unwrap();
    op.wait_for_completion(T).await.unwrap();
    r.wait_for_completion(T).await.unwrap();
    assert_eq!(op.path(), Some(path));
    let got: Vec<u8> = op.into_descriptors().unwrap().remove(0).into_inner().unwrap();
    assert!(got == want, "{path:?}: bytes differ");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_shared_buffer_is_exposed_again_and_at_once_through_one_registration() {
    const LEN: usize = 1 << 16;
    for (policy, path) in PATHS {
        let (a, b) = pair_on(policy);
        let shared = std::sync::Arc::new(HostBuffer::from_slice(&pattern(LEN, 3)).unwrap());
        // Read-only: a writable over shared memory is refused.
        let e = a
            .create_writable(Descriptor::from(shared.clone()))
            .await
            .unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        // Exposed again and again, one operation after another.
        let mut expose_us = Vec::new();
        for _ in 0..20 {
            let t0 = Instant::now();
            let r = a.create_readable(Descriptor::from(shared.clone())).await.unwrap();
            expose_us.push(t0.elapsed().as_secs_f64() * 1e6);
            read_checked(&b, &r, path, pattern(LEN, 3)).await;
        }
        // And exposed by several operations at once, each read by its own reader.
        let mut readables = Vec::new();
        for _ in 0..4 {
            readables.push(a.create_readable(Descriptor::from(shared.clone())).await.unwrap());
        }
        for r in &readables {
            read_checked(&b, r, path, pattern(LEN, 3)).await;
        }
        let sa = a.stats().await.unwrap();
        assert_eq!(
            sa.registrations, 1,
            "{path:?}: 24 exposures of one shared buffer registered it once: {sa:?}"
        );
        println!(
            "{path:?}: expose of a shared 64 KiB buffer: first {:.1} us, then median {:.1} us",
            expose_us[0],
            {
                let mut v = expose_us[1..].to_vec();
                v.sort_by(f64::total_cmp);
                v[v.len() / 2]
            }
        );
        // The operations hold references; the buffer goes (and its registration with it) when
        // the last one does.
        drop(readables);
        assert_eq!(a.stats().await.unwrap().live_registrations, 1, "{path:?}");
        drop(shared);
        let sa = a.stats().await.unwrap();
        assert_eq!(sa.live_registrations, 0, "{path:?}: {sa:?}");
    }
}

// ---------------------------------------------------------------- builder

#[test]
fn builder_refuses_bad_backend_lists_and_delays_naming_the_fix() {
    let cases: [(ConnectorBuilderFn, &str); 5] = [
        (|b| b.backends(Vec::<String>::new()), "empty"),
        (
            |b| b.backends(["POSIX"]).ucx_param("ucx_error_handling_mode", "none"),
            "not among",
        ),
        (|b| b.backends(["UCX", "UCX"]), "twice"),
        (|b| b.backends(["UCX", "NO_SUCH_PLUGIN"]), "UCX"),
        (|b| b.progress_delay(Duration::from_secs(2)), "above"),
    ];
    for (make, says) in cases {
        let e = make(Connector::builder()).build().unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        assert!(e.to_string().contains(says), "{says}: {e}");
    }
}

type ConnectorBuilderFn = fn(nixl_connect::ConnectorBuilder) -> nixl_connect::ConnectorBuilder;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn builder_backends_and_progress_delay_still_move_data() {
    // A second NIXL backend beside UCX (POSIX, a storage plugin every NIXL wheel ships), and the
    // progress delay at both ends of its range: NIXL reads still complete on both sides.
    for (backends, delay) in [
        (vec!["UCX", "POSIX"], nixl_connect::DEFAULT_PROGRESS_DELAY),
        (vec!["UCX"], Duration::ZERO),
        (vec!["UCX"], nixl_connect::MAX_PROGRESS_DELAY),
    ] {
        let make = || {
            Connector::builder()
                .backends(backends.clone())
                .progress_delay(delay)
                .path(PathPolicy::Nixl)
                .build()
                .unwrap()
        };
        let (a, b) = (make(), make());
        for round in 0..3u64 {
            let r = a
                .create_readable(Descriptor::from(pattern(1 << 16, round)))
                .await
                .unwrap();
            let op = b
                .begin_read(r.metadata(), Descriptor::from(vec![0u8; 1 << 16]))
                .await
                .unwrap();
            op.wait_for_completion(T).await.unwrap();
            r.wait_for_completion(T).await.unwrap();
            assert_eq!(op.path(), Some(TransferPath::Nixl));
            let got: Vec<u8> = op.into_descriptors().unwrap().remove(0).into_inner().unwrap();
            assert!(
                got == pattern(1 << 16, round),
                "{backends:?} {delay:?}: bytes differ"
            );
            // Let the engines go idle, so the next round starts from the delay's back-off.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

// ---------------------------------------------------------------- validation

async fn readable_md(
    a: &Connector,
    len: usize,
    n: usize,
) -> (nixl_connect::ReadableOperation<'static>, RdmaMetadata) {
    let r = a.create_readable(Descriptor::from(vec![1u8; len])).await.unwrap();
    let _ = n;
    let md = r.metadata().clone();
    (r, md)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn validation_wrong_pairings_are_typed() {
    let (a, b) = pair();
    let (_r, rmd) = readable_md(&a, 64, 1).await;
    let w = a.create_writable(Descriptor::from(vec![0u8; 64])).await.unwrap();
    let wmd = w.metadata().clone();
    let e = b
        .begin_read(&wmd, Descriptor::from(vec![0u8; 64]))
        .await
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::WrongPairing {
                operation: "begin_read",
                ..
            }
        ),
        "{e}"
    );
    assert!(
        e.to_string().contains("begin_write"),
        "the message says what to call: {e}"
    );
    let e = b
        .begin_write(Descriptor::from(vec![0u8; 64]), &rmd)
        .await
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::WrongPairing {
                operation: "begin_write",
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(b.stats().await.unwrap().transfers, 0, "nothing was posted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn validation_descriptor_mismatches_are_typed() {
    let (a, b) = pair();
    let mut two = vec![0u8; 128];
    let src = vec![1u8; 128];
    let r = a.create_readable(split_ro(&src, &[64, 64])).await.unwrap();
    let md = r.metadata().clone();
    let e = b
        .begin_read(&md, Descriptor::from(vec![0u8; 128]))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::DescriptorMismatch(_)), "count: {e}");
    let e = b.begin_read(&md, split(&mut two, &[60, 68])).await.unwrap_err();
    assert!(
        matches!(&e, Error::DescriptorMismatch(Mismatch::Size { index: 0, .. })),
        "size: {e}"
    );
    let e = b.begin_read(&md, Vec::<Descriptor<'_>>::new()).await.unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "empty: {e}");
    let e = a.create_readable(Vec::<Descriptor<'_>>::new()).await.unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "empty readable: {e}");
    let ro = [0u8; 64];
    let w = a.create_writable(Descriptor::from(vec![0u8; 64])).await.unwrap();
    let e = a.create_writable(Descriptor::from(&ro[..])).await.unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "read-only writable: {e}");
    let (_r1, md1) = readable_md(&a, 64, 1).await;
    let e = b.begin_read(&md1, Descriptor::from(&ro[..])).await.unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument(_)),
        "read-only destination: {e}"
    );
    drop(w);
    assert_eq!(b.stats().await.unwrap().transfers, 0, "nothing was posted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn validation_mixed_devices_are_rejected() {
    let (a, _b) = pair();
    let mut host = vec![0u8; 64];
    // SAFETY: the raw descriptor is rejected before registration; it is never dereferenced.
    let gpu = unsafe { Descriptor::from_raw_parts(host.as_mut_ptr(), 64, Device::Cuda(0)) };
    let e = a
        .create_readable(vec![Descriptor::from(vec![0u8; 64]), gpu])
        .await
        .unwrap_err();
    assert!(e.to_string().contains("mixes device kinds"), "{e}");
    let mut md = readable_md(&a, 64, 1).await.1;
    md.descriptors.push(SerializedDescriptor {
        device: Device::Cuda(0),
        ptr: 4096,
        size: 64,
    });
    assert!(matches!(
        md.validate(),
        Err(Error::Metadata {
            field: "descriptors",
            ..
        })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn validation_bad_nixl_metadata_is_typed() {
    use base64::Engine as _;
    let (a, b) = pair();
    let (_r, good) = readable_md(&a, 64, 1).await;
    let zlib = |data: &[u8]| {
        let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::new(6));
        z.write_all(data).unwrap();
        format!(
            "b64:{}",
            base64::engine::general_purpose::STANDARD.encode(z.finish().unwrap())
        )
    };
    for (bad, what) in [
        ("b64:@@@".to_string(), "base64"),
        ("b64:aGVsbG8gd29ybGQ=".to_string(), "zlib"),
        ("xyz".to_string(), "hex"),
        (zlib(b"this is not NIXL agent metadata"), "NIXL"),
    ] {
        let md = RdmaMetadata {
            nixl_metadata: bad,
            ..good.clone()
        };
        let e = b
            .begin_read(&md, Descriptor::from(vec![0u8; 64]))
            .await
            .unwrap_err();
        assert!(
            matches!(
                e,
                Error::Metadata {
                    field: "nixl_metadata",
                    ..
                }
            ),
            "{what}: {e}"
        );
        assert!(e.to_string().contains(what), "{what}: {e}");
    }
    // A zero pointer, an unknown device, an extra key: rejected at parse time, naming the field.
    let json = good.to_json();
    for (from, to, field) in [
        ("\"device\":\"cpu\"", "\"device\":\"tpu\"", "descriptors[].device"),
        ("\"operation_kind\":1", "\"operation_kind\":9", "operation_kind"),
        (
            "\"operation_kind\":1",
            "\"operation_kind\":1,\"x\":0",
            "(extra key)",
        ),
    ] {
        let e = json.replace(from, to).parse::<RdmaMetadata>().unwrap_err();
        assert!(
            matches!(e, Error::Metadata { field: f, .. } if f == field),
            "{field}: {e}"
        );
    }
    let zero = json.replacen(&format!("\"ptr\":{}", good.descriptors[0].ptr), "\"ptr\":0", 1);
    assert!(matches!(
        zero.parse::<RdmaMetadata>(),
        Err(Error::Metadata {
            field: "descriptors[].ptr",
            ..
        })
    ));
    assert_eq!(b.stats().await.unwrap().transfers, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn validation_descriptors_outside_the_peers_registrations_fail_before_transfer() {
    // NIXL: the peer's registrations as loaded refuse the range before anything is posted.
    let (a, b) = pair_on(PathPolicy::Nixl);
    let (_r, mut md) = readable_md(&a, 4096, 1).await;
    md.descriptors[0].ptr += 1 << 30; // not memory the peer registered
    let op = b
        .begin_read(&md, Descriptor::from(vec![0u8; 4096]))
        .await
        .unwrap();
    let e = op.wait_for_completion(T).await.unwrap_err();
    assert_eq!(b.stats().await.unwrap().transfers, 0, "nothing was posted");
    assert!(
        matches!(
            e,
            Error::Nixl {
                op: "create transfer",
                ..
            }
        ),
        "{e}"
    );
    // Same host: the owner refuses the range before anything is copied.
    let (a, b) = pair_on(PathPolicy::Auto);
    let (_r, mut md) = readable_md(&a, 4096, 1).await;
    md.descriptors[0].ptr += 1 << 30;
    let mut dst = vec![7u8; 4096];
    let op = b.begin_read(&md, Descriptor::from(&mut dst[..])).await.unwrap();
    let e = op.wait_for_completion(T).await.unwrap_err();
    assert!(
        matches!(
            e,
            Error::Refused {
                refusal: nixl_connect::Refusal::OutOfRange,
                ..
            }
        ),
        "{e}"
    );
    drop(op);
    assert!(all_bytes(&dst, 7), "nothing was copied");
}

// ---------------------------------------------------------------- cancel, drop, timeout

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_before_peer_reads() {
    let (a, b) = pair();
    let r = a
        .create_readable(Descriptor::from(vec![3u8; 4096]))
        .await
        .unwrap();
    let md = r.metadata().clone();
    r.cancel();
    assert_eq!(r.status(), OperationStatus::Cancelled);
    assert!(matches!(r.wait_for_completion(T).await, Err(Error::Cancelled)));
    drop(r); // deregisters: the peer's read now fails cleanly
    let res = async {
        let op = b.begin_read(&md, Descriptor::from(vec![0u8; 4096])).await?;
        op.wait_for_completion(T).await
    }
    .await;
    assert!(res.is_err(), "reading a dropped readable must fail, got {res:?}");
}

/// Over the default transports UCX finishes host-memory transfers inside the post (CMA is
/// synchronous), so nothing is ever observably in flight; over TCP they are asynchronous. This
/// runs the case in a fresh process (and its peer) with `UCX_TLS=tcp`.
#[test]
fn cancel_during_transfer() {
    let text = run_support("core::support_cancel_during", &[("UCX_TLS", tcp_tls().as_ref())]);
    assert!(text.contains("CANCEL-OK"), "{text}");
}

#[test]
#[ignore = "run by cancel_during_transfer in a fresh process with UCX_TLS=tcp"]
fn support_cancel_during() {
    let Ok(_) = std::env::var(PEER_ENV) else { return };
    runtime().block_on(async {
        // The NIXL path (over TCP here); the same-host path has its own cancel tests. A long
        // grace: this test checks that a borrowed drop waits for a live peer's transfer to end
        // (soundness tests cover the cut-off of an unresponsive one).
        let conn = Connector::builder()
            .path(PathPolicy::Nixl)
            .cancel_grace(Duration::from_secs(60))
            .build()
            .unwrap();
        let mut peer = Peer::start("readable");
        let len = 64 << 20;
        let mut in_flight = 0;
        for _ in 0..3 {
            writeln!(peer.child.stdin.as_mut().unwrap(), "readable {len} 1").unwrap();
            let md: RdmaMetadata = peer.expect("MD:").parse().unwrap();
            let mut dst = HostBuffer::new(len).unwrap();
            let before = conn.stats().await.unwrap().transfers;
            let op = conn.begin_read(&md, Descriptor::from(&mut dst)).await.unwrap();
            // begin_read returns before the engine posts: wait until it has.
            while conn.stats().await.unwrap().transfers == before && !op.status().is_terminal() {
                tokio::task::yield_now().await;
            }
            if op.status() == OperationStatus::InProgress {
                op.cancel();
                // The transfer may end between the look and the cancel (seen once in a run of
                // the suite): a cancel that loses that race leaves the completion standing.
                match op.status() {
                    OperationStatus::Cancelled => {
                        in_flight += 1;
                        assert!(matches!(op.wait_for_completion(T).await, Err(Error::Cancelled)));
                    }
                    s => {
                        assert_eq!(s, OperationStatus::Complete, "a cancel that lost the race");
                        op.wait_for_completion(T).await.unwrap();
                    }
                }
            }
            drop(op); // borrowed memory: blocks until NIXL has released the transfer
            dst.fill(1); // the borrow ended: NIXL has let go
            assert_eq!(peer.expect("DONE:"), "ok", "the transfer itself still ends");
        }
        assert!(
            in_flight > 0,
            "no transfer was in flight when begin_read returned, even over TCP"
        );
        // Dropping an in-flight read into owned memory: the engine adopts the memory until NIXL
        // lets go, the drop does not block, and the connector keeps working.
        let mut adopted = 0;
        for _ in 0..3 {
            writeln!(peer.child.stdin.as_mut().unwrap(), "readable {len} 1").unwrap();
            let md: RdmaMetadata = peer.expect("MD:").parse().unwrap();
            let before = conn.stats().await.unwrap().transfers;
            let op = conn
                .begin_read(&md, Descriptor::from(HostBuffer::new(len).unwrap()))
                .await
                .unwrap();
            while conn.stats().await.unwrap().transfers == before && !op.status().is_terminal() {
                tokio::task::yield_now().await;
            }
            adopted += usize::from(op.status() == OperationStatus::InProgress);
            drop(op);
            assert_eq!(peer.expect("DONE:"), "ok");
        }
        assert!(adopted > 0, "no owned-memory transfer was in flight when dropped");
        writeln!(peer.child.stdin.as_mut().unwrap(), "readable 4096 1").unwrap();
        let md: RdmaMetadata = peer.expect("MD:").parse().unwrap();
        let mut dst = vec![0u8; 4096];
        let op = conn
            .begin_read(&md, Descriptor::from(&mut dst[..]))
            .await
            .unwrap();
        op.wait_for_completion(T).await.unwrap();
        drop(op);
        assert!(dst == pattern(4096, 4096));
        assert_eq!(peer.expect("DONE:"), "ok");
        peer.finish();

        // The peer dies while a transfer from it is in flight: the wait ends with an error.
        let mut died_mid = 0;
        for _ in 0..3 {
            let mut peer = Peer::start("readable");
            writeln!(peer.child.stdin.as_mut().unwrap(), "readable {} 1", 256 << 20).unwrap();
            let md: RdmaMetadata = peer.expect("MD:").parse().unwrap();
            let mut dst = HostBuffer::new(256 << 20).unwrap();
            let before = conn.stats().await.unwrap().transfers;
            let op = conn.begin_read(&md, Descriptor::from(&mut dst)).await.unwrap();
            while conn.stats().await.unwrap().transfers == before && !op.status().is_terminal() {
                tokio::task::yield_now().await;
            }
            if op.status() != OperationStatus::InProgress {
                continue;
            }
            peer.child.kill().unwrap();
            peer.child.wait().unwrap();
            let t0 = Instant::now();
            match op.wait_for_completion(Some(Duration::from_secs(20))).await {
                Err(Error::TimedOut { .. }) => panic!("a dead peer must fail the transfer, not hang it"),
                Err(e) => {
                    died_mid += 1;
                    println!("peer died mid-transfer: {e} after {:?}", t0.elapsed());
                }
                Ok(()) => println!("the transfer finished before the kill landed"),
            }
        }
        assert!(
            died_mid > 0,
            "no transfer was caught in flight by the peer's death"
        );
        println!("CANCEL-OK in flight {in_flight}/3");
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_after_completion_keeps_complete() {
    let (a, b) = pair();
    let r = a
        .create_readable(Descriptor::from(vec![3u8; 4096]))
        .await
        .unwrap();
    let op = b
        .begin_read(r.metadata(), Descriptor::from(vec![0u8; 4096]))
        .await
        .unwrap();
    op.wait_for_completion(T).await.unwrap();
    r.wait_for_completion(T).await.unwrap();
    op.cancel();
    r.cancel();
    assert_eq!(op.status(), OperationStatus::Complete);
    assert_eq!(r.status(), OperationStatus::Complete);
    op.wait_for_completion(None).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drop_in_flight_owned_and_borrowed() {
    for (p, _) in PATHS {
        let (a, b) = pair_on(p);
        let src = HostBuffer::from_slice(&pattern(64 << 20, 2)).unwrap();
        // A dropped read may or may not complete the readable (the same-host path stops the copy).
        let short = Some(Duration::from_millis(500));
        for _ in 0..2 {
            let r = a.create_readable(Descriptor::from(&src)).await.unwrap();
            // Owned destination: the engine keeps it until NIXL lets go.
            let op = b
                .begin_read(r.metadata(), Descriptor::from(HostBuffer::new(64 << 20).unwrap()))
                .await
                .unwrap();
            drop(op);
            r.wait_for_completion(short).await.ok();
            let r = a.create_readable(Descriptor::from(&src)).await.unwrap();
            // Borrowed destination: drop blocks until NIXL lets go.
            let mut dst = vec![0u8; 64 << 20];
            let op = b
                .begin_read(r.metadata(), Descriptor::from(&mut dst[..]))
                .await
                .unwrap();
            drop(op);
            dst.clear();
            r.wait_for_completion(short).await.ok();
        }
        read_pair(&a, &b, 4096, 1).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeout_is_typed_and_leaves_the_operation_live() {
    let (a, b) = pair();
    let r = a
        .create_readable(Descriptor::from(vec![5u8; 4096]))
        .await
        .unwrap();
    let t0 = Instant::now();
    let e = r
        .wait_for_completion(Some(Duration::from_millis(200)))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::TimedOut { .. }), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(5));
    assert_eq!(r.status(), OperationStatus::Initialized);
    let op = b
        .begin_read(r.metadata(), Descriptor::from(vec![0u8; 4096]))
        .await
        .unwrap();
    op.wait_for_completion(T).await.unwrap();
    r.wait_for_completion(T).await.unwrap();
}

// ---------------------------------------------------------------- two processes

/// The peer process: `readable LEN N` or `writable LEN N`, repeated for each stdin line.
#[test]
#[ignore = "run by the two-process tests as their peer"]
fn support_peer() {
    let Ok(_) = std::env::var(PEER_ENV) else { return };
    runtime().block_on(async {
        let conn = Connector::new().unwrap();
        let stdin = std::io::stdin();
        for line in stdin.lock().lines() {
            let line = line.unwrap();
            let w: Vec<&str> = line.split_whitespace().collect();
            let (len, n): (usize, usize) = (w[1].parse().unwrap(), w[2].parse().unwrap());
            let sz = sizes(len, n);
            if w[0] == "readable" {
                let src = pattern(len, len as u64);
                let r = conn.create_readable(split_ro(&src, &sz)).await.unwrap();
                println!("MD:{}", r.metadata().to_json());
                std::io::stdout().flush().unwrap();
                r.wait_for_completion(T).await.unwrap();
                println!("DONE:ok");
            } else {
                let mut dst = vec![0u8; len];
                let r = conn.create_writable(split(&mut dst, &sz)).await.unwrap();
                println!("MD:{}", r.metadata().to_json());
                std::io::stdout().flush().unwrap();
                r.wait_for_completion(T).await.unwrap();
                drop(r);
                println!(
                    "DONE:{}",
                    if dst == pattern(len, !(len as u64)) {
                        "ok"
                    } else {
                        "BAD"
                    }
                );
            }
            std::io::stdout().flush().unwrap();
        }
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn process_read_from_peer_readable() {
    for (p, _) in PATHS {
        let conn = Connector::builder().path(p).build().unwrap();
        let mut peer = Peer::start("readable");
        for (len, n) in [(1, 1), (4096, 1), (64 << 20, 1), (1 << 20, 64)] {
            writeln!(peer.child.stdin.as_mut().unwrap(), "readable {len} {n}").unwrap();
            let md: RdmaMetadata = peer.expect("MD:").parse().unwrap();
            let mut dst = vec![0u8; len];
            let op = conn
                .begin_read(&md, split(&mut dst, &sizes(len, n)))
                .await
                .unwrap();
            op.wait_for_completion(T).await.unwrap();
            drop(op);
            assert_eq!(peer.expect("DONE:"), "ok");
            assert!(
                dst == pattern(len, len as u64),
                "{len} bytes / {n} descriptors differ"
            );
        }
        peer.finish();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn process_write_into_peer_writable() {
    for (p, _) in PATHS {
        let conn = Connector::builder().path(p).build().unwrap();
        let mut peer = Peer::start("writable");
        for (len, n) in [(1, 1), (4096, 1), (64 << 20, 1), (1 << 20, 64)] {
            writeln!(peer.child.stdin.as_mut().unwrap(), "writable {len} {n}").unwrap();
            let md: RdmaMetadata = peer.expect("MD:").parse().unwrap();
            let src = pattern(len, !(len as u64));
            let op = conn
                .begin_write(split_ro(&src, &sizes(len, n)), &md)
                .await
                .unwrap();
            op.wait_for_completion(T).await.unwrap();
            assert_eq!(peer.expect("DONE:"), "ok", "{len} bytes / {n} descriptors");
            assert_eq!(op.path(), Some(path_of(&conn)));
        }
        peer.finish();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn process_dead_peer_is_an_error_not_a_hang() {
    let conn = Connector::new().unwrap();
    // Warm the connection to the peer, then kill it and read again from its old metadata.
    let mut peer = Peer::start("readable");
    writeln!(peer.child.stdin.as_mut().unwrap(), "readable 4096 1").unwrap();
    let md: RdmaMetadata = peer.expect("MD:").parse().unwrap();
    let op = conn
        .begin_read(&md, Descriptor::from(vec![0u8; 4096]))
        .await
        .unwrap();
    op.wait_for_completion(T).await.unwrap();
    peer.expect("DONE:");
    writeln!(peer.child.stdin.as_mut().unwrap(), "readable 65536 1").unwrap();
    let md: RdmaMetadata = peer.expect("MD:").parse().unwrap();
    peer.child.kill().unwrap();
    peer.child.wait().unwrap();
    let t0 = Instant::now();
    let res = async {
        let op = conn.begin_read(&md, Descriptor::from(vec![0u8; 65536])).await?;
        op.wait_for_completion(Some(Duration::from_secs(20))).await
    }
    .await;
    assert!(res.is_err(), "reading from a dead peer must fail");
    eprintln!("dead peer: {:?} after {:?}", res.unwrap_err(), t0.elapsed());
    // A writable whose writer never comes times out instead of hanging.
    let w = conn
        .create_writable(Descriptor::from(vec![0u8; 16]))
        .await
        .unwrap();
    let e = w
        .wait_for_completion(Some(Duration::from_millis(300)))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::TimedOut { .. }));
}

// ---------------------------------------------------------------- NIXL absent

#[test]
fn nixl_absent_is_a_typed_error_not_an_abort() {
    let empty = std::env::temp_dir().join(format!("nixl-connect-empty-{}", std::process::id()));
    std::fs::create_dir_all(&empty).unwrap();
    let text = run_support(
        "core::support_nixl_absent",
        &[(nixl_connect::nixl_library::NIXL_LIB_ENV, empty.as_os_str())],
    );
    assert!(text.contains("ABSENT-OK"), "{text}");
    let _ = std::fs::remove_dir(&empty);
}

#[test]
#[ignore = "run by nixl_absent_is_a_typed_error_not_an_abort in a fresh process"]
fn support_nixl_absent() {
    let Ok(_) = std::env::var(PEER_ENV) else { return };
    let e = Connector::new().unwrap_err();
    assert!(matches!(e, Error::NixlNotFound { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("scripts/setup.sh") && msg.contains("pip install nixl-cu13"),
        "{msg}"
    );
    println!("ABSENT-OK: {msg}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_exposed_slices_register_only_themselves() {
    let (a, b) = pair();
    let src = HostBuffer::from_slice(&pattern(1 << 20, 4)).unwrap();
    let whole = a.create_readable(Descriptor::from(&src)).await.unwrap();
    // A slice inside an exposed buffer, and two slices of it in one operation.
    let part = a
        .create_readable(vec![src.part(4096..8192).unwrap(), src.part(100..200).unwrap()])
        .await
        .unwrap();
    let mut d1 = vec![0u8; 4096];
    let mut d2 = [0u8; 100];
    let op = b
        .begin_read(
            part.metadata(),
            vec![Descriptor::from(&mut d1[..]), Descriptor::from(&mut d2[..])],
        )
        .await
        .unwrap();
    op.wait_for_completion(T).await.unwrap();
    part.wait_for_completion(T).await.unwrap();
    drop(op);
    assert!(d1[..] == src[4096..8192] && d2[..] == src[100..200]);
    let mut all = vec![0u8; 1 << 20];
    let op = b
        .begin_read(whole.metadata(), Descriptor::from(&mut all[..]))
        .await
        .unwrap();
    op.wait_for_completion(T).await.unwrap();
    whole.wait_for_completion(T).await.unwrap();
    drop(op);
    assert!(all[..] == src[..]);
    // Per-operation metadata publishes whole registrations, and a registration's key reaches all
    // of it: slices of an exposed buffer get registrations of their own, so the part's metadata
    // does not reach the rest of the buffer (see untrusted_published_*).
    let s = a.stats().await.unwrap();
    assert_eq!(
        s.registrations, 3,
        "the buffer and each exposed slice are registered exactly: {s:?}"
    );
}
