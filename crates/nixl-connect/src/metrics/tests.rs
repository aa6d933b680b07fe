//! The metrics over loopback connectors (no NIXL): what a scrape shows after real operations.

use std::time::Instant;

use super::*;
use crate::{Connector, Descriptor};

/// The value of the sample `name{labels...}` in OpenMetrics text (labels given in any order).
pub(crate) fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (series, value) = l.rsplit_once(' ')?;
        let (n, rest) = series.split_once('{').unwrap_or((series, "}"));
        if n != name {
            return None;
        }
        let all = labels.iter().all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")));
        all.then(|| value.parse().ok())?
    })
}

fn pair(m: &Metrics) -> (Connector, Connector) {
    let b = || Connector::builder().metrics(m).build_loopback().unwrap();
    (b(), b())
}

#[tokio::test]
async fn metrics_count_completed_operations_on_both_sides() {
    let (registry, m) = Metrics::standalone();
    let (a, b) = pair(&m);
    for _ in 0..3 {
        let readable = a
            .create_readable(Descriptor::from(vec![7u8; 4096]))
            .await
            .unwrap();
        let read = b
            .begin_read(readable.metadata(), Descriptor::from(vec![0u8; 4096]))
            .await
            .unwrap();
        read.wait_for_completion(None).await.unwrap();
        readable.wait_for_completion(None).await.unwrap();
    }
    let writable = b.create_writable(Descriptor::from(vec![0u8; 100])).await.unwrap();
    let write = a
        .begin_write(Descriptor::from(vec![1u8; 100]), writable.metadata())
        .await
        .unwrap();
    write.wait_for_completion(None).await.unwrap();
    writable.wait_for_completion(None).await.unwrap();
    drop((write, writable));
    let text = encode(&registry).unwrap();
    let s = |name, labels: &[(&str, &str)]| {
        sample(&text, name, labels).unwrap_or_else(|| panic!("{name} {labels:?}\n{text}"))
    };
    let read_active = [("op", "read"), ("side", "active"), ("path", "loopback")];
    let read_passive = [("op", "read"), ("side", "passive"), ("path", "loopback")];
    assert_eq!(s("nixl_connect_bytes_total", &read_active), 3.0 * 4096.0);
    assert_eq!(s("nixl_connect_bytes_total", &read_passive), 3.0 * 4096.0);
    assert_eq!(
        s(
            "nixl_connect_bytes_total",
            &[("op", "write"), ("side", "passive"), ("path", "loopback")]
        ),
        100.0
    );
    assert_eq!(
        s(
            "nixl_connect_operations_total",
            &[
                ("op", "read"),
                ("side", "active"),
                ("path", "loopback"),
                ("status", "complete")
            ]
        ),
        3.0
    );
    assert_eq!(
        s("nixl_connect_operation_duration_seconds_count", &read_active),
        3.0
    );
    assert_eq!(
        s(
            "nixl_connect_operation_start_seconds_count",
            &[("op", "read"), ("path", "loopback")]
        ),
        3.0
    );
    for (op, side) in [
        ("read", "active"),
        ("read", "passive"),
        ("write", "active"),
        ("write", "passive"),
    ] {
        assert_eq!(
            s("nixl_connect_operations_in_flight", &[("op", op), ("side", side)]),
            0.0,
            "{op} {side}"
        );
    }
    assert_eq!(s("nixl_connect_connectors", &[]), 2.0);
}

#[tokio::test]
async fn metrics_count_errors_by_kind_and_cancels() {
    let (registry, m) = Metrics::standalone();
    let (a, b) = pair(&m);
    let readable = a.create_readable(Descriptor::from(vec![7u8; 64])).await.unwrap();
    // A size mismatch fails at begin, before the operation exists.
    let err = b
        .begin_read(readable.metadata(), Descriptor::from(vec![0u8; 65]))
        .await
        .err()
        .unwrap();
    assert_eq!(err.kind(), crate::ErrorKind::DescriptorMismatch);
    // A wait that times out is an error returned to the caller; the operation stays live.
    let waited = readable
        .wait_for_completion(Some(std::time::Duration::from_millis(1)))
        .await;
    assert_eq!(waited.unwrap_err().kind(), crate::ErrorKind::TimedOut);
    drop(readable); // cancelled, never read
    let text = encode(&registry).unwrap();
    assert_eq!(
        sample(
            &text,
            "nixl_connect_errors_total",
            &[("op", "read"), ("side", "passive"), ("kind", "TimedOut")]
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(
            &text,
            "nixl_connect_errors_total",
            &[("op", "read"), ("side", "active"), ("kind", "DescriptorMismatch")]
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(
            &text,
            "nixl_connect_operations_total",
            &[
                ("op", "read"),
                ("side", "passive"),
                ("path", "none"),
                ("status", "cancelled")
            ]
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(
            &text,
            "nixl_connect_operations_in_flight",
            &[("op", "read"), ("side", "passive")]
        ),
        Some(0.0)
    );
}

#[tokio::test]
async fn metrics_engine_counters_match_stats_and_survive_the_connector() {
    let (registry, m) = Metrics::standalone();
    let (a, b) = pair(&m);
    let readable = a.create_readable(Descriptor::from(vec![7u8; 64])).await.unwrap();
    let read = b
        .begin_read(readable.metadata(), Descriptor::from(vec![0u8; 64]))
        .await
        .unwrap();
    read.wait_for_completion(None).await.unwrap();
    readable.wait_for_completion(None).await.unwrap();
    drop((read, readable));
    let sa = a.stats().await.unwrap();
    let sb = b.stats().await.unwrap();
    crate::testing::settle(&a).await.unwrap();
    crate::testing::settle(&b).await.unwrap();
    // Published before each engine sleeps: wait for both to have gone idle once more.
    let expect = sa.transfers + sb.transfers;
    assert!(expect > 0, "the loopback transport counts its transfers");
    let deadline = Instant::now() + std::time::Duration::from_secs(5);
    while engine_totals(&m).transfers != expect {
        assert!(Instant::now() < deadline, "counters never published");
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    drop((a, b));
    let text = encode(&registry).unwrap();
    assert_eq!(sample(&text, "nixl_connect_connectors", &[]), Some(0.0));
    assert_eq!(
        sample(&text, "nixl_connect_nixl_posts_total", &[]),
        Some(expect as f64)
    );
}

#[test]
fn metrics_every_family_is_in_a_scrape_from_the_start() {
    let (registry, _m) = Metrics::standalone();
    let text = encode(&registry).unwrap();
    let families: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split(' ').next())
        .collect();
    for f in [
        "nixl_connect_operations",
        "nixl_connect_bytes",
        "nixl_connect_operation_duration_seconds",
        "nixl_connect_operation_start_seconds",
        "nixl_connect_operations_in_flight",
        "nixl_connect_local_operations",
        "nixl_connect_errors",
        "nixl_connect_path_fallbacks",
        "nixl_connect_connectors",
        "nixl_connect_copy_pool_queued",
    ] {
        assert!(families.contains(&f), "{f} missing from {families:?}");
    }
    assert!(text.ends_with("# EOF\n"));
}
