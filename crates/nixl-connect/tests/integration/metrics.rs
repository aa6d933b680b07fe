//! The metrics over the real NIXL library and the same-host path: every engine counter a scrape
//! shows equals what `stats()` says, bytes land under the path that moved them, and a replayed
//! metadata is a refusal with its reason.

use std::time::{Duration, Instant};

use nixl_connect::metrics::{encode, Metrics};
use nixl_connect::{Connector, Descriptor, EngineStats, Error, HostBuffer, PathPolicy, TransferPath};

use super::support::T;

/// The value of `name{labels...}` in OpenMetrics text.
fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (series, value) = l.rsplit_once(' ')?;
        let (n, rest) = series.split_once('{').unwrap_or((series, ""));
        (n == name && labels.iter().all(|(k, v)| rest.contains(&format!("{k}=\"{v}\""))))
            .then(|| value.parse().ok())?
    })
}

fn add(to: &mut EngineStats, s: &EngineStats) {
    to.registrations += s.registrations;
    to.live_registrations += s.live_registrations;
    to.registered_bytes += s.registered_bytes;
    to.registration_hits += s.registration_hits;
    to.remote_loads += s.remote_loads;
    to.peers_loaded += s.peers_loaded;
    to.transfers += s.transfers;
    to.local_transfers += s.local_transfers;
    to.local_refused_peers += s.local_refused_peers;
    to.local_connections += s.local_connections;
    to.resets += s.resets;
    to.rotations += s.rotations;
    to.quarantined_bytes += s.quarantined_bytes;
    to.evicted_operations += s.evicted_operations;
}

/// Each engine counter's metric, with its value in `s`.
fn pairs(s: &EngineStats) -> Vec<(&'static str, f64)> {
    vec![
        ("nixl_connect_registrations_total", s.registrations as f64),
        ("nixl_connect_registrations_live", s.live_registrations as f64),
        ("nixl_connect_registered_bytes", s.registered_bytes as f64),
        (
            "nixl_connect_registration_cache_hits_total",
            s.registration_hits as f64,
        ),
        ("nixl_connect_peer_loads_total", s.remote_loads as f64),
        ("nixl_connect_peers_loaded", s.peers_loaded as f64),
        ("nixl_connect_nixl_posts_total", s.transfers as f64),
        ("nixl_connect_local_transfers_total", s.local_transfers as f64),
        (
            "nixl_connect_local_peers_refused_total",
            s.local_refused_peers as f64,
        ),
        ("nixl_connect_local_connections", s.local_connections as f64),
        ("nixl_connect_nixl_resets_total", s.resets as f64),
        ("nixl_connect_nixl_rotations_total", s.rotations as f64),
        ("nixl_connect_quarantined_bytes", s.quarantined_bytes as f64),
        (
            "nixl_connect_evicted_operations_total",
            s.evicted_operations as f64,
        ),
    ]
}

/// A path's declines are counted by their reason: a reader of a peer that advertises no
/// same-host endpoint (a connector that serves none, as a Python Dynamo worker) counts
/// `no_endpoint` on the `local` path once an operation, beside the fallback to NIXL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_path_declines_by_reason() {
    let (registry, m) = Metrics::standalone();
    let owner = Connector::builder().path(PathPolicy::Nixl).build().unwrap();
    let reader = Connector::builder().metrics(&m).build().unwrap();
    for _ in 0..2 {
        let r = owner
            .create_readable(Descriptor::from(vec![7u8; 4096]))
            .await
            .unwrap();
        let op = reader
            .begin_read(r.metadata(), Descriptor::from(vec![0u8; 4096]))
            .await
            .unwrap();
        op.wait_for_completion(T).await.unwrap();
        r.wait_for_completion(T).await.unwrap();
        assert_eq!(op.path(), Some(TransferPath::Nixl));
    }
    let text = encode(&registry).unwrap();
    let declines = |reason| {
        sample(
            &text,
            "nixl_connect_path_declines_total",
            &[("path", "local"), ("reason", reason)],
        )
    };
    assert_eq!(declines("no_endpoint"), Some(2.0), "{text}");
    assert_eq!(declines("other"), Some(0.0), "{text}");
    assert_eq!(
        sample(
            &text,
            "nixl_connect_path_fallbacks_total",
            &[("from", "local"), ("to", "nixl")]
        ),
        Some(2.0),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_scrape_matches_stats_over_nixl_and_the_same_host_path() {
    const N: usize = 64 << 10;
    let (registry, m) = Metrics::standalone();
    let owner = Connector::builder().metrics(&m).build().unwrap();
    let by_nixl = Connector::builder()
        .path(PathPolicy::Nixl)
        .metrics(&m)
        .build()
        .unwrap();
    let by_local = Connector::builder().metrics(&m).build().unwrap();
    let src = HostBuffer::from_slice(&[5u8; N]).unwrap();
    let mut last = None;
    for (reader, path) in [
        (&by_nixl, TransferPath::Nixl),
        (&by_local, TransferPath::SameHost),
    ] {
        for _ in 0..2 {
            let r = owner.create_readable(Descriptor::from(&src)).await.unwrap();
            let op = reader
                .begin_read(r.metadata(), Descriptor::from(vec![0u8; N]))
                .await
                .unwrap();
            op.wait_for_completion(T).await.unwrap();
            r.wait_for_completion(T).await.unwrap();
            assert_eq!(op.path(), Some(path));
            last = Some(r.metadata().clone());
        }
    }
    // The last metadata again, to the reader that completed it: refused as a replay.
    let e = match by_local
        .begin_read(&last.unwrap(), Descriptor::from(vec![0u8; N]))
        .await
    {
        Err(e) => e,
        Ok(op) => op.wait_for_completion(T).await.unwrap_err(),
    };
    assert!(matches!(e, Error::Refused { .. }), "{e}");

    // Engines publish when they go idle: wait (bounded) for the scrape to agree with stats().
    let t0 = Instant::now();
    let (text, want) = loop {
        let mut want = EngineStats::default();
        for c in [&owner, &by_nixl, &by_local] {
            add(&mut want, &c.stats().await.unwrap());
        }
        let text = encode(&registry).unwrap();
        if pairs(&want)
            .iter()
            .all(|(name, v)| sample(&text, name, &[]) == Some(*v))
        {
            break (text, want);
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the scrape never matched stats(): {want:?}\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(
        want.transfers >= 2 && want.local_transfers >= 2 && want.registrations >= 1,
        "{want:?}"
    );
    assert!(want.registered_bytes >= N as u64, "{want:?}");
    // The NIXL reader loaded the owner; both readers hold a same-host connection to it (and it
    // theirs); the one HostBuffer, exposed four times, was registered once and found again.
    assert!(want.peers_loaded >= 1, "{want:?}");
    assert!(want.local_connections >= 1, "{want:?}");
    assert!(want.registration_hits >= 3, "{want:?}");
    let bytes = |side, path| {
        sample(
            &text,
            "nixl_connect_bytes_total",
            &[("op", "read"), ("side", side), ("path", path)],
        )
    };
    for side in ["active", "passive"] {
        for path in ["nixl", "local"] {
            assert_eq!(bytes(side, path), Some(2.0 * N as f64), "{side} {path}");
        }
    }
    assert_eq!(
        sample(
            &text,
            "nixl_connect_refusals_total",
            &[("op", "read"), ("reason", "already_completed")]
        ),
        Some(1.0)
    );
    assert_eq!(sample(&text, "nixl_connect_connectors", &[]), Some(3.0));
    let by_mechanism: f64 = ["frames", "cma", "pipes", "cuda-ipc", "pinned-staging", "cuda-vmm"]
        .iter()
        .filter_map(|m| {
            sample(
                &text,
                "nixl_connect_local_operations_total",
                &[("op", "read"), ("mechanism", m)],
            )
        })
        .sum();
    assert_eq!(by_mechanism, 2.0, "the same-host reads, by mechanism");
}
