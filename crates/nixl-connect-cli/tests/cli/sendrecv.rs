//! `send` / `recv` between two processes through the embedded HTTP channel, and `doctor`.

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::support::*;

/// Starts `send FILE` with `env`; returns the child and the URL it printed.
fn start_send(file: &std::path::Path, env: &[(&str, &str)]) -> (std::process::Child, String) {
    let mut c = cli();
    c.arg("send")
        .arg(file)
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    for (k, v) in env {
        c.env(k, v);
    }
    let mut child = c.spawn().unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.starts_with("http://"), "send printed {line:?}");
    (child, line.trim().to_string())
}

#[test]
fn cli_send_recv_is_byte_exact() {
    let dir = scratch("sendrecv");
    let (file, data) = file_of(64 << 20, &dir, 5);
    let (mut sender, url) = start_send(&file, &[]);
    let out = dir.join("received");
    let mut r = cli();
    r.args(["recv", &url, "-o"]).arg(&out);
    let (o, _) = run(r, Duration::from_secs(60));
    ok(&o, "recv");
    let report = String::from_utf8_lossy(&o.stdout);
    assert!(report.contains("GB/s") && report.contains("verified"), "{report}");
    assert!(sender.wait().unwrap().success(), "send exits 0 once read");
    assert!(std::fs::read(&out).unwrap() == data);
    // The publication is gone once the transfer completed.
    let mut again = cli();
    again
        .args(["recv", &url, "--timeout", "5", "-o"])
        .arg(dir.join("again"));
    let (o, _) = run(again, Duration::from_secs(30));
    assert!(!o.status.success());
    assert!(!dir.join("again").exists());
    no_partials(&dir);
}

/// The sender dies during the receive (over TCP, UCX_TLS=tcp, to make the transfer last): `recv`
/// must fail within its timeout with one line and leave no complete-looking file. The library's
/// `core::cancel_during_transfer` kills a peer with a transfer provably in flight.
#[test]
fn cli_recv_fails_cleanly_when_the_sender_dies() {
    let dir = scratch("sender-dies");
    let (file, _) = file_of(512 << 20, &dir, 6);
    let env = [("UCX_TLS", "tcp")];
    let (mut sender, url) = start_send(&file, &env);
    let out = dir.join("received");
    let mut r = cli();
    r.args(["recv", &url, "--timeout", "20", "-o"])
        .arg(&out)
        .env("UCX_TLS", "tcp");
    let t0 = Instant::now();
    let recv = r.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    // Its memory set-up takes ~0.7 s and the TCP transfer ~0.3 s here; the kill lands in one or
    // the other, and either way recv must fail cleanly.
    std::thread::sleep(Duration::from_millis(900));
    sender.kill().unwrap();
    sender.wait().unwrap();
    let o = recv.wait_with_output().unwrap();
    let took = t0.elapsed();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success(),
        "recv must fail once the sender is gone; stdout: {}",
        String::from_utf8_lossy(&o.stdout)
    );
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one clear line: {err}");
    assert!(took < Duration::from_secs(25), "within the timeout: {took:?}");
    assert!(!out.exists(), "no complete-looking output after a failed receive");
    no_partials(&dir);
}

#[test]
fn cli_doctor_reports_a_usable_host() {
    let (o, _) = run(
        {
            let mut c = cli();
            c.args(["doctor", "--json"]);
            c
        },
        Duration::from_secs(60),
    );
    ok(&o, "doctor");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["usable"], true, "{v}");
    let names: Vec<&str> = v["checks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["check"].as_str().unwrap())
        .collect();
    for want in [
        "NIXL library",
        "NIXL plugins",
        "UCX backend",
        "self-test",
        "CUDA",
        "huge pages",
    ] {
        assert!(names.contains(&want), "{want} missing from {names:?}");
    }
    // Pointed at an empty folder, doctor says what to do and exits non-zero.
    let empty = scratch("doctor-empty");
    let mut c = cli();
    c.arg("doctor").env("NIXL_CONNECT_LIB", &empty);
    let (o, _) = run(c, Duration::from_secs(60));
    assert!(!o.status.success());
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains("fix:") && text.contains("scripts/setup.sh"),
        "{text}"
    );
}
