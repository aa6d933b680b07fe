//! The NIXL exposer's quarantine: memory given up after NIXL exposed it stays held until the
//! exposing agent is gone, but only the most recent entries keep their NIXL registrations (up to
//! `REGISTERED_QUARANTINE`), so that exposing fresh small buffers one after another does not
//! grow NIXL's address-sorted registration list (whose every insert moves what lies above it:
//! the nineteenth session measured a whole 4 KiB Python operation slowing from ~110 us to
//! ~425 us as 64,000 given-up exposures stayed registered after a rotation).

use std::sync::Arc;
use std::time::Duration;

use nixl_connect::{Connector, Descriptor, Device, PathPolicy, RdmaMetadata, REGISTERED_QUARANTINE};

use super::support::{all_bytes, runtime};

const T: Option<Duration> = Some(Duration::from_secs(10));

/// Fresh memory per exposure, each given up at once: the memory is all still held (nothing
/// rotated, the bytes counted), but the registrations stay under the bound, and a peer replaying
/// the metadata of the first (deregistered, still held) exposure gets its bytes or a typed error,
/// never another exposure's bytes; the connector goes on serving.
#[test]
fn quarantine_keeps_given_up_memory_with_a_bounded_number_of_registrations() {
    runtime().block_on(async {
        // Over NIXL (the same-host path refuses a replay before any bytes move).
        let nixl = || Connector::builder().path(PathPolicy::Nixl).build().unwrap();
        let (a, b) = (nixl(), nixl());
        let first = a
            .create_readable(Descriptor::from(vec![0x5au8; 4096]))
            .await
            .unwrap();
        let replay: RdmaMetadata = first.metadata().clone();
        drop(first);
        let n = 3 * REGISTERED_QUARANTINE;
        for i in 0..n {
            let r = a
                .create_readable(Descriptor::from(vec![i as u8; 4096]))
                .await
                .unwrap();
            drop(r);
        }
        let stats = a.stats().await.unwrap();
        assert_eq!(stats.rotations, 0, "{stats:?}");
        assert!(
            stats.registrations > n as u64,
            "each fresh buffer registers: {stats:?}"
        );
        assert!(
            stats.quarantined_bytes >= (n as u64 + 1) * 4096,
            "given-up memory must stay held until the agent is gone: {stats:?}"
        );
        assert!(
            stats.live_registrations <= REGISTERED_QUARANTINE + 2,
            "{} registrations live for {} given-up exposures (bound {REGISTERED_QUARANTINE}): {stats:?}",
            stats.live_registrations,
            n + 1
        );
        // The first exposure's memory is held, its registration gone: a replay reads its own
        // bytes (UCX checks no registration at the target over TCP, CMA or shared memory) or fails.
        let mut dst = vec![0u8; 4096];
        let outcome = match b.begin_read(&replay, Descriptor::from(&mut dst[..])).await {
            Ok(op) => op.wait_for_completion(Some(Duration::from_secs(5))).await,
            Err(e) => Err(e),
        };
        match outcome {
            Ok(()) => assert!(all_bytes(&dst, 0x5a), "a replay read other bytes"),
            Err(e) => println!("replayed read refused or failed (allowed): {e}"),
        }
        // And the connector still serves.
        let readable = a
            .create_readable(Descriptor::from(vec![0xc3u8; 4096]))
            .await
            .unwrap();
        let mut dst = vec![0u8; 4096];
        let read = b
            .begin_read(readable.metadata(), Descriptor::from(&mut dst[..]))
            .await
            .unwrap();
        read.wait_for_completion(T).await.unwrap();
        readable.wait_for_completion(T).await.unwrap();
        drop(read);
        assert!(all_bytes(&dst, 0xc3));
    });
}

/// The same memory exposed again and again, each exposure given up (what a caller reusing one
/// tensor or bytearray per operation does): every exposure after the first finds the
/// registration the quarantine still keeps, so it registers once.
#[test]
fn quarantine_reused_memory_keeps_its_registration() {
    runtime().block_on(async {
        let conn = Connector::new().unwrap();
        let memory = Arc::new(vec![9u8; 4096]);
        let before = conn.stats().await.unwrap();
        let n = 3 * REGISTERED_QUARANTINE;
        for _ in 0..n {
            // SAFETY: the Arc kept as the owner keeps the Vec's heap memory valid and unmoved for
            // as long as the descriptor (or the engine holding it) lives; nothing writes it.
            let d = unsafe {
                Descriptor::from_raw_parts_with_owner(
                    memory.as_ptr() as *mut u8,
                    memory.len(),
                    Device::Host,
                    false,
                    memory.clone(),
                )
            };
            drop(conn.create_readable(d).await.unwrap());
        }
        let stats = conn.stats().await.unwrap();
        assert_eq!(
            stats.registrations - before.registrations,
            1,
            "reused memory must register once: {stats:?}"
        );
        assert!(
            stats.registration_hits - before.registration_hits >= n as u64 - 1,
            "{stats:?}"
        );
    });
}

/// The bound counts registrations, not operations: operations of many fresh descriptors each
/// (Dynamo's callers pass one descriptor per tensor) given up one after another keep at most the
/// bound (and one operation's) registered.
#[test]
fn quarantine_bounds_registrations_not_operations() {
    runtime().block_on(async {
        let conn = Connector::builder().path(PathPolicy::Nixl).build().unwrap();
        const PER_OP: usize = 64;
        let ops = 2 * REGISTERED_QUARANTINE / PER_OP;
        for i in 0..ops {
            let descs: Vec<Descriptor<'static>> = (0..PER_OP).map(|_| Descriptor::from(vec![i as u8; 4096])).collect();
            drop(conn.create_readable(descs).await.unwrap());
        }
        let stats = conn.stats().await.unwrap();
        assert_eq!(stats.rotations, 0, "{stats:?}");
        assert!(stats.registrations >= (ops * PER_OP) as u64, "{stats:?}");
        assert!(
            stats.live_registrations <= REGISTERED_QUARANTINE + PER_OP,
            "{} registrations live for {} given-up operations of {PER_OP} descriptors (bound {REGISTERED_QUARANTINE}): {stats:?}",
            stats.live_registrations,
            ops
        );
    });
}
