//! `serve`, `read`, `write` as a new user would try them, good input and bad: every failure is one
//! clear line on stderr, a non-zero exit within the timeout, and no complete-looking output file.

use std::process::Output;
use std::time::Duration;

use crate::support::*;

const LIMIT: Duration = Duration::from_secs(60);

/// Exactly one non-empty stderr line, starting with `nixl-connect:`; returns it.
fn one_line(o: &Output) -> String {
    assert!(!o.status.success(), "expected a failure, got {:?}", o.status);
    let err = String::from_utf8_lossy(&o.stderr);
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one clear line on stderr, got:\n{err}");
    assert!(lines[0].starts_with("nixl-connect: "), "{}", lines[0]);
    lines[0].to_string()
}

#[test]
fn cli_serve_read_and_write_round_trip() {
    let dir = scratch("round-trip");
    let mut c = cli();
    c.args(["serve", "--size", "64M", "--descriptors", "8"]);
    let peer = Passive::start(c);
    let md = peer.metadata_file(&dir);
    let out = dir.join("out");
    let mut r = cli();
    r.args(["read", "--metadata"]).arg(&md).arg("--out").arg(&out);
    ok(&run(r, LIMIT).0, "read");
    ok(&peer.finish(), "serve");
    assert!(std::fs::read(&out).unwrap() == pattern(64 << 20, &dir));

    let got = dir.join("got");
    let (input, data) = file_of(3 << 20, &dir, 3);
    let mut c = cli();
    c.args(["serve", "--writable", "--file"])
        .arg(&input)
        .args(["--descriptors", "5", "--out"])
        .arg(&got);
    let peer = Passive::start(c);
    let md = peer.metadata_file(&dir);
    let mut w = cli();
    w.args(["write", "--metadata"]).arg(&md).arg("--file").arg(&input);
    ok(&run(w, LIMIT).0, "write");
    ok(&peer.finish(), "serve --writable");
    assert!(std::fs::read(&got).unwrap() == data);
    no_partials(&dir);
}

/// `doctor --peer` on a Rust readable of this host and user names the same-host path, through
/// the frames for 4 KiB and cross-memory attach for 8 MiB (or pipes, where this kernel's ptrace
/// rules forbid it), and says nothing declined; the read then takes exactly that path and
/// mechanism. The same for a write into a writable of 8 MiB.
#[test]
fn cli_doctor_peer_predicts_the_path_a_read_and_a_write_take() {
    let dir = scratch("doctor-peer");
    for size in ["4K", "8M"] {
        let mut c = cli();
        c.args(["serve", "--size", size]);
        let peer = Passive::start(c);
        let md = peer.metadata_file(&dir);
        let said = doctor_peer(&md);
        assert_eq!(said["operation"], "read", "{said}");
        assert_eq!(said["path"], "local", "{size}: {said}");
        assert_eq!(said["declined"], serde_json::json!([]), "{size}: {said}");
        let took = read_reported(&md, &dir);
        ok(&peer.finish(), "serve");
        let [predicted, taken] = predicted_and_taken(&said, &took);
        assert_eq!(predicted, taken, "{size}: predicted {said}, took {took}");
        if size == "4K" {
            assert_eq!(predicted.1, "frames", "{said}");
        }
    }
    let (input, _) = file_of(8 << 20, &dir, 4);
    let mut c = cli();
    c.args(["serve", "--writable", "--file"])
        .arg(&input)
        .arg("--out")
        .arg(dir.join("got"));
    let peer = Passive::start(c);
    let md = peer.metadata_file(&dir);
    let said = doctor_peer(&md);
    assert_eq!(
        (&said["operation"], &said["path"]),
        (&"write".into(), &"local".into()),
        "{said}"
    );
    let mut w = cli();
    w.args(["write", "--json", "--metadata"])
        .arg(&md)
        .arg("--file")
        .arg(&input);
    let (o, _) = run(w, LIMIT);
    ok(&o, "write");
    ok(&peer.finish(), "serve --writable");
    let text = String::from_utf8_lossy(&o.stdout);
    let took: serde_json::Value =
        serde_json::from_str(text.lines().find(|l| l.starts_with('{')).unwrap_or_default()).unwrap();
    let [predicted, taken] = predicted_and_taken(&said, &took);
    assert_eq!(predicted, taken, "a write: predicted {said}, took {took}");
}

/// `serve --publish etcd://...` and `read --metadata etcd://...` against a real etcd (Debian's
/// `etcd-server`, `bash scripts/setup.sh --etcd`): the reader, started first, waits for the
/// publication; once `serve` exits its key is gone, and a read of it is one line.
#[test]
fn cli_serve_publishes_in_etcd_and_read_waits_for_it_there() {
    let dir = scratch("etcd");
    let port = |()| {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    };
    let (cp, pp) = (port(()), port(()));
    let (client, peer) = (format!("http://127.0.0.1:{cp}"), format!("http://127.0.0.1:{pp}"));
    let mut etcd = std::process::Command::new("etcd")
        .args(["--name", "cli", "--data-dir"])
        .arg(dir.join("etcd-data"))
        .args([
            "--listen-client-urls",
            &client,
            "--advertise-client-urls",
            &client,
        ])
        .args([
            "--listen-peer-urls",
            &peer,
            "--initial-advertise-peer-urls",
            &peer,
        ])
        .args(["--initial-cluster", &format!("cli={peer}")])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("etcd is not installed: run `bash scripts/setup.sh --etcd`");
    let t0 = std::time::Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", cp)).is_err() {
        assert!(t0.elapsed() < LIMIT, "etcd did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    let loc = format!("etcd://127.0.0.1:{cp}/nixl-connect/md/cli-test");
    let out = dir.join("out");
    let mut r = cli();
    r.args(["read", "--metadata", &loc, "--timeout", "60", "--out"])
        .arg(&out)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let reader = r.spawn().unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let mut c = cli();
    c.args(["serve", "--size", "1M", "--publish", &loc]);
    let server = Passive::start(c);
    let o = reader.wait_with_output().unwrap();
    ok(&o, "read --metadata etcd://");
    let o = server.finish();
    ok(&o, "serve --publish etcd://");
    assert!(
        String::from_utf8_lossy(&o.stderr).contains(&format!("published at {loc}")),
        "{o:?}"
    );
    assert!(std::fs::read(&out).unwrap() == pattern(1 << 20, &dir));
    let mut r = cli();
    r.args(["read", "--metadata", &loc, "--timeout", "1", "--out"])
        .arg(dir.join("out2"));
    let l = one_line(&run(r, LIMIT).0);
    assert!(
        l.contains("nothing is published at etcd key nixl-connect/md/cli-test"),
        "{l}"
    );
    assert!(!dir.join("out2").exists());
    let _ = etcd.kill();
    let _ = etcd.wait();
    let mut r = cli();
    r.args(["read", "--metadata", &loc, "--timeout", "2", "--out"])
        .arg(dir.join("out3"));
    let (o, took) = run(r, LIMIT);
    let l = one_line(&o);
    assert!(
        l.contains("etcd") && took < Duration::from_secs(10),
        "{l} after {took:?}"
    );
}

#[test]
fn cli_metadata_from_stdin() {
    let dir = scratch("stdin");
    let mut c = cli();
    c.args(["serve", "--size", "4096"]);
    let peer = Passive::start(c);
    let out = dir.join("out");
    let mut r = cli();
    r.args(["read", "--metadata", "-", "--out"])
        .arg(&out)
        .stdin(std::process::Stdio::piped());
    let mut child = r
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(peer.metadata.as_bytes())
        .unwrap();
    let o = child.wait_with_output().unwrap();
    ok(&o, "read --metadata -");
    ok(&peer.finish(), "serve");
    assert!(std::fs::read(&out).unwrap() == pattern(4096, &dir));
}

#[test]
fn cli_missing_files_are_one_line() {
    let dir = scratch("missing");
    let mut c = cli();
    c.args(["serve", "--file"]).arg(dir.join("nope"));
    let l = one_line(&run(c, LIMIT).0);
    assert!(l.contains("nope"), "{l}");
    let mut c = cli();
    c.args(["read", "--metadata"])
        .arg(dir.join("no-md"))
        .arg("--out")
        .arg(dir.join("out"));
    let l = one_line(&run(c, LIMIT).0);
    assert!(l.contains("no-md"), "{l}");
    std::fs::write(dir.join("md"), "{}").unwrap();
    let mut c = cli();
    c.args(["write", "--metadata"])
        .arg(dir.join("md"))
        .arg("--file")
        .arg(dir.join("no-input"));
    let l = one_line(&run(c, LIMIT).0);
    assert!(l.contains("no-input"), "{l}");
    assert!(!dir.join("out").exists());
    no_partials(&dir);
}

#[test]
fn cli_metadata_that_is_not_json_is_one_line() {
    let dir = scratch("not-json");
    for (name, text, says) in [
        ("garbage", "hello, world\n", "json"),
        ("empty", "\n\n", "empty"),
        ("extra", r#"{"descriptors":[],"bogus":1}"#, "extra key"),
        (
            "zero-ptr",
            r#"{"descriptors":[{"device":"cpu","ptr":0,"size":4}],"nixl_metadata":"b64:eJw=","notification_key":"k","operation_kind":1}"#,
            "ptr",
        ),
    ] {
        let md = dir.join(name);
        std::fs::write(&md, text).unwrap();
        let out = dir.join(format!("{name}.out"));
        let mut c = cli();
        c.args(["read", "--metadata"]).arg(&md).arg("--out").arg(&out);
        let l = one_line(&run(c, LIMIT).0);
        assert!(l.contains(says), "{name}: {l}");
        assert!(!out.exists());
    }
    no_partials(&dir);
}

#[test]
fn cli_wrong_direction_is_one_line() {
    let dir = scratch("direction");
    let mut c = cli();
    c.args(["serve", "--writable", "--size", "4096", "--timeout", "3", "--out"])
        .arg(dir.join("got"));
    let peer = Passive::start(c);
    let md = peer.metadata_file(&dir);
    let mut r = cli();
    r.args(["read", "--metadata"])
        .arg(&md)
        .arg("--out")
        .arg(dir.join("out"));
    let l = one_line(&run(r, LIMIT).0);
    assert!(l.contains("wrong pairing") && l.contains("begin_write"), "{l}");
    let l = one_line(&peer.finish());
    assert!(l.contains("no peer wrote"), "{l}");
    assert!(!dir.join("out").exists() && !dir.join("got").exists());

    let mut c = cli();
    c.args(["serve", "--size", "4096", "--timeout", "3"]);
    let peer = Passive::start(c);
    let md = peer.metadata_file(&dir);
    let (input, _) = file_of(4096, &dir, 9);
    let mut w = cli();
    w.args(["write", "--metadata"]).arg(&md).arg("--file").arg(&input);
    let l = one_line(&run(w, LIMIT).0);
    assert!(l.contains("wrong pairing") && l.contains("begin_read"), "{l}");
    one_line(&peer.finish());
    no_partials(&dir);
}

#[test]
fn cli_sizes_that_do_not_add_up_fail_before_transfer() {
    let dir = scratch("sizes");
    let got = dir.join("got");
    let mut c = cli();
    c.args([
        "serve",
        "--writable",
        "--size",
        "4096",
        "--descriptors",
        "2",
        "--timeout",
        "3",
        "--out",
    ])
    .arg(&got);
    let peer = Passive::start(c);
    let md = peer.metadata_file(&dir);
    let (input, _) = file_of(4000, &dir, 2);
    let mut w = cli();
    w.args(["write", "--metadata"]).arg(&md).arg("--file").arg(&input);
    let l = one_line(&run(w, LIMIT).0);
    assert!(l.contains("4000 bytes") && l.contains("4096"), "{l}");
    one_line(&peer.finish());
    assert!(
        !got.exists(),
        "nothing was written, so the writable saved nothing"
    );
    no_partials(&dir);
}

#[test]
fn cli_peer_that_never_comes_times_out() {
    let dir = scratch("never");
    let mut c = cli();
    c.args(["serve", "--size", "4096", "--timeout", "2"]);
    let peer = Passive::start(c);
    let t0 = std::time::Instant::now();
    let l = one_line(&peer.finish());
    assert!(l.contains("timed out") || l.contains("no peer read"), "{l}");
    assert!(t0.elapsed() < Duration::from_secs(20));

    let got = dir.join("got");
    let mut c = cli();
    c.args(["serve", "--writable", "--size", "4096", "--timeout", "2", "--out"])
        .arg(&got);
    one_line(&Passive::start(c).finish());
    assert!(!got.exists());
    no_partials(&dir);
}

#[test]
fn cli_dead_peer_fails_within_timeout() {
    let dir = scratch("dead");
    let mut c = cli();
    c.args(["serve", "--size", "1M"]);
    let mut peer = Passive::start(c);
    let md = peer.metadata_file(&dir);
    peer.child.kill().unwrap();
    peer.child.wait().unwrap();
    let out = dir.join("out");
    let mut r = cli();
    r.args(["read", "--timeout", "10", "--metadata"])
        .arg(&md)
        .arg("--out")
        .arg(&out);
    let (o, took) = run(r, Duration::from_secs(30));
    let l = one_line(&o);
    assert!(took < Duration::from_secs(15), "{l} after {took:?}");
    assert!(!out.exists(), "no complete-looking output: {l}");
    no_partials(&dir);
}

/// A server stopped (SIGSTOP) after printing its metadata: `read --timeout` returns in time with
/// exit code 3, over the same-host path and over NIXL (TCP), and leaves no file.
#[test]
fn cli_read_deadline_holds_when_the_server_is_stopped() {
    let dir = scratch("stopped");
    for (path, tls) in [("auto", ""), ("nixl", tcp_tls())] {
        let mut c = cli();
        c.args(["serve", "--size", "64M", "--timeout", "60"]);
        if !tls.is_empty() {
            c.env("UCX_TLS", tls);
        }
        let mut peer = Passive::start(c);
        let md = peer.metadata_file(&dir);
        crate::stop::signal(peer.child.id(), libc::SIGSTOP);
        let out = dir.join("out");
        let mut r = cli();
        r.args(["read", "--timeout", "3", "--path", path, "--metadata"])
            .arg(&md)
            .arg("--out")
            .arg(&out);
        if !tls.is_empty() {
            r.env("UCX_TLS", tls);
        }
        let (o, took) = run(r, Duration::from_secs(30));
        crate::stop::signal(peer.child.id(), libc::SIGCONT);
        let _ = peer.child.kill();
        let l = one_line(&o);
        assert_eq!(o.status.code(), Some(3), "{path}: {l}");
        assert!(took < Duration::from_secs(6), "{path}: {l} after {took:?}");
        assert!(!out.exists());
        no_partials(&dir);
    }
}

/// Inputs that used to panic are clean errors: zero iterations, descriptor sizes past 2^64, a
/// descriptor too large to allocate, a zero size.
#[test]
fn cli_bad_numbers_are_errors_not_panics() {
    let dir = scratch("numbers");
    let (o, _) = run(
        {
            let mut c = cli();
            c.args(["bench", "--sizes", "4K", "--iters", "0"]);
            c
        },
        LIMIT,
    );
    assert_eq!(
        o.status.code(),
        Some(2),
        "a usage error: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    for (c, what) in [("demo", "--size"), ("serve", "--size")] {
        let (o, _) = run(
            {
                let mut x = cli();
                x.args([c, what, "0"]);
                x
            },
            LIMIT,
        );
        assert_eq!(o.status.code(), Some(2), "{c} {what} 0");
    }
    let (o, _) = run(
        {
            let mut x = cli();
            x.args(["demo", "--repeat", "0"]);
            x
        },
        LIMIT,
    );
    assert_eq!(o.status.code(), Some(2), "demo --repeat 0");
    // Metadata from a live server, with descriptor sizes rewritten.
    let mut c = cli();
    c.args(["serve", "--size", "8192", "--descriptors", "2", "--timeout", "30"]);
    let peer = Passive::start(c);
    let mut v: serde_json::Value = serde_json::from_str(&peer.metadata).unwrap();
    for (sizes, want) in [
        ([1u64 << 63, 1u64 << 63], "2^64"),
        ([1u64 << 50, 1], "cannot allocate"),
    ] {
        v["descriptors"][0]["size"] = sizes[0].into();
        v["descriptors"][1]["size"] = sizes[1].into();
        let md = dir.join("md.json");
        std::fs::write(&md, v.to_string()).unwrap();
        let mut r = cli();
        r.args(["read", "--timeout", "10", "--metadata"])
            .arg(&md)
            .arg("--out")
            .arg(dir.join("out"));
        let (o, _) = run(r, LIMIT);
        let l = one_line(&o);
        assert_eq!(o.status.code(), Some(1), "{l}");
        assert!(l.contains(want), "{want}: {l}");
    }
    let mut peer = peer;
    let _ = peer.child.kill();
}

/// The first row (a line with a size) that a `bench --json` run printed.
fn bench_row(o: &std::process::Output) -> serde_json::Value {
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .find(|v: &serde_json::Value| v.get("size").is_some())
        .expect("a row")
}

/// Many descriptors in each layout, read and written: the bytes are verified, and each row carries
/// the copy limit of its own ranges (contiguous ones also as one range; no timing asserted).
#[test]
fn cli_bench_layouts_verify_bytes_and_measure_their_own_limit() {
    for layout in ["separate", "contiguous", "scattered"] {
        for op in ["read", "write"] {
            let mut c = cli();
            c.args([
                "bench",
                "--path",
                "local",
                "--sizes",
                "4K",
                "--descriptors",
                "300",
                "--iters",
                "3",
                "--warmup",
                "1",
                "--op",
                op,
                "--layout",
                layout,
            ]);
            let (o, _) = run(c, LIMIT);
            ok(&o, "bench");
            let v = bench_row(&o);
            assert_eq!(v["ok"], true, "{layout}/{op}: bytes verified: {v}");
            assert_eq!(v["layout"], layout);
            assert_eq!(v["descriptors"], 300);
            assert!(v["limit_GBps"].as_f64().is_some_and(|l| l > 0.0), "{v}");
            assert_eq!(
                v.get("one_range_limit_GBps").is_some(),
                layout == "contiguous",
                "{layout}/{op}: {v}"
            );
        }
    }
    let mut c = cli();
    c.args([
        "bench",
        "--sizes",
        "4K",
        "--layout",
        "scattered",
        "--buffers",
        "vec",
    ]);
    let (o, _) = run(c, LIMIT);
    assert_eq!(o.status.code(), Some(1), "refused: {o:?}");
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("--buffers huge"),
        "{o:?}"
    );
}

/// The benchmark runs every op and buffer kind and prints DESIGN.md's keys (no timing asserted).
#[test]
fn cli_bench_prints_design_keys_for_every_mode() {
    for (op, buffers) in [
        ("read", "huge"),
        ("read", "vec"),
        ("write", "huge"),
        ("write", "vec"),
    ] {
        let mut c = cli();
        c.args([
            "bench",
            "--sizes",
            "4K,1M",
            "--iters",
            "5",
            "--warmup",
            "1",
            "--op",
            op,
            "--buffers",
            buffers,
        ]);
        let idle = op == "read" && buffers == "huge";
        if idle {
            c.arg("--idle-cpu");
        }
        let (o, _) = run(c, LIMIT);
        ok(&o, "bench");
        let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&o.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let sized: Vec<&serde_json::Value> = lines.iter().filter(|v| v.get("size").is_some()).collect();
        assert_eq!(sized.len(), 2, "{op}/{buffers}: one line per size: {lines:?}");
        for v in sized {
            for key in [
                // DESIGN.md's keys, kept as aliases
                "impl",
                "device",
                "size",
                "iters",
                "read_median_us",
                "read_min_us",
                "server_wait_median_us",
                "GBps",
                "ok",
                // the keys that name the operation
                "op",
                "path",
                "latency_mean_us",
                "latency_p50_us",
                "latency_p99_us",
                "latency_max_us",
                "ops_per_s",
                "passive_p50_us",
                "limit_GBps",
            ] {
                assert!(v.get(key).is_some(), "{op}/{buffers}: {key} missing in {v}");
            }
            assert_eq!(v["ok"], true, "{op}/{buffers}: bytes verified: {v}");
            assert_eq!(v["iters"], 5);
        }
        assert_eq!(
            lines.iter().any(|v| v.get("idle_connector_cpu_pct").is_some()),
            idle,
            "{op}/{buffers}: the idle-CPU line only with --idle-cpu"
        );
    }
}

/// The wait spin a run uses (the flag, else `NIXL_CONNECT_WAIT_SPIN_US`, else the library's
/// default) is what its rows record; a value the library refuses fails the run, naming where it
/// came from.
#[test]
fn cli_bench_wait_spin_from_flag_env_or_default() {
    let row = |env: Option<&str>, flag: Option<&str>| {
        let mut c = cli();
        c.args(["bench", "--path", "local", "--sizes", "4K", "--iters", "20"]);
        if let Some(f) = flag {
            c.args(["--wait-spin-us", f]);
        }
        match env {
            Some(v) => c.env("NIXL_CONNECT_WAIT_SPIN_US", v),
            None => c.env_remove("NIXL_CONNECT_WAIT_SPIN_US"),
        };
        run(c, LIMIT).0
    };
    for (env, flag, want) in [
        (None, None, 100),
        (Some("0"), None, 0),
        (Some("250"), None, 250),
        (Some("250"), Some("30"), 30),
    ] {
        let o = row(env, flag);
        ok(&o, "bench");
        let v = bench_row(&o);
        assert_eq!(v["wait_spin_us"], want, "env {env:?}, flag {flag:?}: {v}");
        assert_eq!(
            v["peer_wait_spin_us"], want,
            "the peer runs with the active side's: {v}"
        );
        assert_eq!(v["ok"], true, "{v}");
    }
    for (env, flag, says, code) in [
        (Some("lots"), None, "NIXL_CONNECT_WAIT_SPIN_US", 1),
        (Some("20000"), None, "NIXL_CONNECT_WAIT_SPIN_US", 1),
        (None, Some("20000"), "--wait-spin-us", 2),
    ] {
        let o = row(env, flag);
        assert_eq!(o.status.code(), Some(code), "refused: {o:?}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(says), "{says}: {err}");
    }
}
