//! `--metrics` scraped by a real Prometheus (Debian's `prometheus`, `bash scripts/setup.sh
//! --prometheus`): the figures Prometheus stores match what the operation moved, every family of
//! docs/METRICS.md is in a scrape (and nothing else is), `promtool` accepts the text, and every
//! query of the Grafana dashboard runs.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::*;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A GET over HTTP/1.0 (no client library in this test crate): the status and the body.
fn get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut buf = String::new();
    s.read_to_string(&mut buf)?;
    let (head, body) = buf.split_once("\r\n\r\n").unwrap_or((&buf, ""));
    let status = head.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    Ok((status, body.to_string()))
}

fn encode_query(q: &str) -> String {
    q.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

struct Prometheus {
    child: Child,
    addr: SocketAddr,
    _dir: Scratch,
}

impl Prometheus {
    /// Starts a Prometheus scraping `targets` every second.
    fn start(targets: &[SocketAddr]) -> Self {
        let dir = scratch("prometheus");
        let list: Vec<String> = targets.iter().map(|t| format!("'{t}'")).collect();
        std::fs::write(
            dir.join("p.yml"),
            format!(
                "global: {{scrape_interval: 1s, scrape_timeout: 1s}}\n\
                 scrape_configs:\n  - job_name: nixl\n    static_configs: [{{targets: [{}]}}]\n",
                list.join(", ")
            ),
        )
        .unwrap();
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", dir.join("p.yml").display()))
            .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
            .arg(format!("--web.listen-address={addr}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("prometheus is not installed ({e}): run `bash scripts/setup.sh --prometheus`")
            });
        let t0 = Instant::now();
        while !matches!(get(addr, "/-/ready"), Ok((200, _))) {
            assert!(t0.elapsed() < Duration::from_secs(30), "prometheus did not start");
            std::thread::sleep(Duration::from_millis(100));
        }
        Prometheus {
            child,
            addr,
            _dir: dir,
        }
    }

    /// Runs an instant query; the JSON answer (status checked).
    fn query(&self, q: &str) -> serde_json::Value {
        let (code, body) = get(self.addr, &format!("/api/v1/query?query={}", encode_query(q))).unwrap();
        let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{q}: {e}: {body}"));
        assert_eq!(
            (code, v["status"].as_str()),
            (200, Some("success")),
            "{q}: {body}"
        );
        v
    }

    /// The single value `q` gives, once it gives one (scrapes take a second or two).
    fn value(&self, q: &str, want: impl Fn(f64) -> bool) -> f64 {
        let t0 = Instant::now();
        loop {
            let v = self.query(q);
            let got = v["data"]["result"][0]["value"][1]
                .as_str()
                .and_then(|s| s.parse::<f64>().ok());
            if let Some(x) = got.filter(|x| want(*x)) {
                return x;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "{q} never gave the value: {v}"
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The metric names docs/METRICS.md's table lists.
fn documented() -> Vec<String> {
    let doc = std::fs::read_to_string(root().join("docs/METRICS.md")).unwrap();
    let mut names: Vec<String> = doc
        .lines()
        .filter_map(|l| l.strip_prefix("| `nixl_connect_"))
        .filter_map(|l| l.split('`').next())
        .map(|n| format!("nixl_connect_{n}"))
        .collect();
    names.sort();
    names
}

/// The family names of a Prometheus-text scrape (`# TYPE` lines: counters end in `_total`).
fn scraped(text: &str) -> Vec<String> {
    let mut names: Vec<String> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split(' ').next())
        .map(str::to_string)
        .collect();
    names.sort();
    names
}

/// Every `expr` of the dashboard's panels.
fn dashboard_queries(path: &Path) -> Vec<String> {
    let d: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert!(
        d["schemaVersion"].as_u64().is_some() && d["title"].is_string(),
        "a dashboard"
    );
    let mut out = Vec::new();
    for p in d["panels"].as_array().expect("panels") {
        for key in ["type", "title"] {
            assert!(p[key].is_string(), "panel without {key}: {p}");
        }
        for key in ["x", "y", "w", "h"] {
            assert!(p["gridPos"][key].is_u64(), "panel without gridPos.{key}: {p}");
        }
        let targets = p["targets"].as_array().expect("targets");
        assert!(!targets.is_empty());
        for t in targets {
            out.push(t["expr"].as_str().expect("expr").to_string());
        }
    }
    out
}

#[test]
fn cli_metrics_scraped_by_prometheus() {
    let dir = scratch("metrics");
    let (sm, rm) = (free_port(), free_port());
    let serve_at: SocketAddr = format!("127.0.0.1:{sm}").parse().unwrap();
    let read_at: SocketAddr = format!("127.0.0.1:{rm}").parse().unwrap();
    let prom = Prometheus::start(&[serve_at, read_at]);

    let mut c = cli();
    c.args([
        "serve",
        "--size",
        "1M",
        "--metrics",
        &serve_at.to_string(),
        "--metrics-linger",
        "30",
    ]);
    let peer = Passive::start(c);
    // Before anything moves: the endpoint answers, every documented family is there and nothing
    // else, and promtool accepts the text.
    let (code, text) = get(serve_at, "/metrics").unwrap();
    assert_eq!(code, 200);
    assert_eq!(
        scraped(&text),
        documented(),
        "docs/METRICS.md and a scrape list the same metrics"
    );
    let mut lint = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool (Debian's prometheus package)");
    lint.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let lint = lint.wait_with_output().unwrap();
    assert!(
        lint.status.success(),
        "promtool: {}{}",
        String::from_utf8_lossy(&lint.stdout),
        String::from_utf8_lossy(&lint.stderr)
    );
    assert_eq!(get(serve_at, "/health").unwrap(), (200, "ok\n".to_string()));

    let md = peer.metadata_file(&dir);
    let out = dir.join("out");
    let mut r = cli();
    r.args(["read", "--metadata"])
        .arg(&md)
        .arg("--out")
        .arg(&out)
        .args(["--metrics", &read_at.to_string(), "--metrics-linger", "30"]);
    let mut reader = r.stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();

    // Prometheus stores what the operation moved: 1 MiB out of the server's memory, into the
    // reader's, once.
    let exact = |x: f64| x == 1048576.0;
    let one = |x: f64| x == 1.0;
    prom.value(
        r#"sum(last_over_time(nixl_connect_bytes_total{op="read",side="passive"}[5m]))"#,
        exact,
    );
    prom.value(
        r#"sum(last_over_time(nixl_connect_bytes_total{op="read",side="active"}[5m]))"#,
        exact,
    );
    prom.value(
        r#"sum(last_over_time(nixl_connect_operations_total{op="read",status="complete"}[5m]))"#,
        |x| x == 2.0,
    );
    prom.value(
        r#"sum(last_over_time(nixl_connect_operation_duration_seconds_count{op="read",side="passive"}[5m]))"#,
        one,
    );
    // One observation: the median lies in the bucket that holds it (the sum is the observation).
    let sum = prom.value(
        r#"sum(last_over_time(nixl_connect_operation_duration_seconds_sum{op="read",side="passive"}[5m]))"#,
        |x| x > 0.0,
    );
    let median = prom.value(
        r#"histogram_quantile(0.5, sum by (le) (last_over_time(nixl_connect_operation_duration_seconds_bucket{op="read",side="passive"}[5m])))"#,
        |x| x > 0.0,
    );
    let upper = (0..22)
        .map(|k| 5e-6 * 2f64.powi(k))
        .find(|b| sum <= *b)
        .expect("under 10.5 s");
    assert!(
        median > upper / 2.0 && median <= upper,
        "median {median} s outside the bucket ({}, {upper}] of the one observation {sum} s",
        upper / 2.0
    );
    prom.value(
        r#"sum(last_over_time(nixl_connect_registrations_total[5m]))"#,
        |x| x >= 1.0,
    );

    // Every query of the dashboard runs against these names (Grafana's range variable
    // replaced, as Grafana replaces it), and those on the bytes find them.
    for q in dashboard_queries(&root().join("dashboards/nixl-connect.json")) {
        let q = q.replace("$__rate_interval", "1m");
        let t0 = Instant::now();
        loop {
            let v = prom.query(&q);
            // A rate needs two scrapes in its window: the byte rates are waited for.
            if !q.contains("bytes_total") || !v["data"]["result"].as_array().unwrap().is_empty() {
                break;
            }
            assert!(t0.elapsed() < Duration::from_secs(30), "{q} found nothing: {v}");
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    // Both commands are lingering by now (the read is saved before the linger starts).
    let mut serve = peer.child;
    for c in [&mut reader, &mut serve] {
        let _ = c.kill();
        let _ = c.wait();
    }
    assert!(
        std::fs::read(&out).unwrap() == pattern(1 << 20, &dir),
        "the bytes read"
    );
}

/// `NIXL_CONNECT_LOG=nixl_connect=debug`: a read shows its span (operation, side, sizes, path,
/// status) on both sides, and neither side ever logs the notification key.
#[test]
fn cli_operation_span_has_the_path_and_end_never_the_key() {
    let dir = scratch("span");
    let mut c = cli();
    c.args(["serve", "--size", "4096"])
        .env("NIXL_CONNECT_LOG", "nixl_connect=debug");
    let peer = Passive::start(c);
    let key = serde_json::from_str::<serde_json::Value>(&peer.metadata).unwrap()["notification_key"]
        .as_str()
        .unwrap()
        .to_string();
    let md = peer.metadata_file(&dir);
    let mut r = cli();
    r.args(["read", "--metadata"])
        .arg(&md)
        .arg("--out")
        .arg(dir.join("out"))
        .env("NIXL_CONNECT_LOG", "nixl_connect=debug");
    let (out, _) = run(r, Duration::from_secs(60));
    ok(&out, "read");
    let served = peer.finish();
    ok(&served, "serve");
    let reader = String::from_utf8_lossy(&out.stderr);
    let server = String::from_utf8_lossy(&served.stderr);
    for (side, log) in [("active", &reader), ("passive", &server)] {
        let ended = log
            .lines()
            .find(|l| l.contains("nixl_connect.operation{") && l.contains("operation ended"))
            .unwrap_or_else(|| panic!("no span ended on the {side} side:\n{log}"));
        for field in [
            format!("side=\"{side}\""),
            "op=\"read\"".into(),
            "bytes=4096".into(),
            "descriptors=1".into(),
        ] {
            assert!(ended.contains(&field), "{field} missing: {ended}");
        }
        assert!(ended.contains("status=DONE"), "{ended}");
        assert!(log.contains("path taken") && log.contains("path=local"), "{log}");
        assert!(!log.contains(&key), "the {side} side logged the notification key");
    }
}
