//! `send` / `recv` between two processes through the embedded HTTP channel, and `doctor`:
//! a delivery is confirmed end to end, a file is never lost or clobbered, interruptions leave
//! nothing behind, and every wait ends within its `--timeout`.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Output, Stdio};
use std::time::{Duration, Instant};

use crate::support::*;

/// A running `send`: the child and the URL it printed.
struct Sender {
    child: Child,
    url: String,
}

impl Sender {
    fn start(file: &Path, env: &[(&str, &str)]) -> Self {
        let mut c = cli();
        c.arg("send")
            .arg(file)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in env {
            c.env(k, v);
        }
        let mut child = c.spawn().unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert!(line.starts_with("http://"), "send printed {line:?}");
        Sender {
            child,
            url: line.trim().to_string(),
        }
    }

    /// Waits (bounded) for the sender to exit: its output.
    fn finish(mut self) -> Output {
        let t0 = Instant::now();
        while self.child.try_wait().unwrap().is_none() {
            assert!(t0.elapsed() < Duration::from_secs(60), "send did not exit");
            std::thread::sleep(Duration::from_millis(20));
        }
        self.child.wait_with_output().unwrap()
    }
}

fn recv(url: &str, out: &Path, extra: &[&str]) -> Output {
    let mut r = cli();
    r.args(["recv", url, "-o"]).arg(out).args(extra);
    run(r, Duration::from_secs(90)).0
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn sha256_of(data: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(data).iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn cli_send_recv_is_byte_exact_and_confirmed() {
    let dir = scratch("sendrecv");
    let (file, data) = file_of((64 << 20) + 12345, &dir, 5);
    let sender = Sender::start(&file, &[]);
    let url = sender.url.clone();
    let out = dir.join("received");
    let o = recv(&url, &out, &[]);
    ok(&o, "recv");
    // What sha256sum prints: "<hash>  <path>".
    let hash = sha256_of(&data);
    let printed = String::from_utf8_lossy(&o.stdout);
    assert_eq!(printed.trim(), format!("{hash}  {}", out.display()), "{printed}");
    let so = sender.finish();
    ok(&so, "send");
    assert!(stderr(&so).contains("delivered"), "{}", stderr(&so));
    assert!(
        stderr(&so).contains(&hash),
        "the sender prints the hash: {}",
        stderr(&so)
    );
    assert!(std::fs::read(&out).unwrap() == data);
    if let Ok(c) = std::process::Command::new("sha256sum").arg(&out).output() {
        assert!(
            String::from_utf8_lossy(&c.stdout).starts_with(&hash),
            "sha256sum agrees"
        );
    }
    // The publication is gone once the delivery is confirmed.
    let o = recv(&url, &dir.join("again"), &["--timeout", "5"]);
    assert!(!o.status.success());
    assert!(!dir.join("again").exists());
    no_partials(&dir);
}

/// The destination is settled before anything moves, and the sender hears of a failure.
#[test]
fn cli_recv_checks_the_destination_first_and_tells_the_sender() {
    let dir = scratch("destination");
    let (file, data) = file_of(1 << 20, &dir, 7);
    // An existing file is not overwritten without --force; the sender reports the refusal.
    let existing = dir.join("existing");
    std::fs::write(&existing, b"keep me").unwrap();
    let s = Sender::start(&file, &[]);
    let o = recv(&s.url, &existing, &[]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("--force"), "{}", stderr(&o));
    let so = s.finish();
    assert!(!so.status.success(), "the sender must not report a delivery");
    assert!(
        stderr(&so).contains("failed to save") && stderr(&so).contains("exists"),
        "{}",
        stderr(&so)
    );
    assert_eq!(std::fs::read(&existing).unwrap(), b"keep me");
    // With --force it is replaced.
    let s = Sender::start(&file, &[]);
    ok(&recv(&s.url, &existing, &["--force"]), "recv --force");
    ok(&s.finish(), "send");
    assert!(std::fs::read(&existing).unwrap() == data);
    // A folder means "into it", like cp.
    let into = dir.join("into");
    std::fs::create_dir(&into).unwrap();
    let s = Sender::start(&file, &[]);
    ok(&recv(&s.url, &into, &[]), "recv into a folder");
    ok(&s.finish(), "send");
    let name = file.file_name().unwrap();
    assert!(std::fs::read(into.join(name)).unwrap() == data);
    // A missing folder fails before any transfer, naming it.
    let s = Sender::start(&file, &[]);
    let missing = dir.join("no/such/folder/out.bin");
    let o = recv(&s.url, &missing, &[]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("does not exist") && stderr(&o).contains("no/such/folder"),
        "{}",
        stderr(&o)
    );
    let so = s.finish();
    assert!(
        !so.status.success() && stderr(&so).contains("failed to save"),
        "{}",
        stderr(&so)
    );
    no_partials(&dir);
    no_partials(&into);
}

/// A filesystem mounted for the test (read-only, or too small): skipped with a printed reason
/// where mounting is not allowed.
struct Mount(Scratch);

impl Mount {
    fn tmpfs(name: &str, opts: &str) -> Option<Self> {
        let dir = scratch(name);
        let o = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", opts, "tmpfs"])
            .arg(&dir)
            .output();
        match o {
            Ok(o) if o.status.success() => Some(Mount(dir)),
            Ok(o) => {
                println!(
                    "{name}: skipped: cannot mount a tmpfs ({})",
                    String::from_utf8_lossy(&o.stderr).trim()
                );
                None
            }
            Err(e) => {
                println!("{name}: skipped: cannot run mount ({e})");
                None
            }
        }
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).output();
    }
}

#[test]
fn cli_recv_read_only_folder_and_full_disk_lose_nothing() {
    let dir = scratch("fs-limits");
    let (file, _) = file_of(64 << 20, &dir, 9);
    if let Some(ro) = Mount::tmpfs("cli-recv-read-only", "ro,size=1m") {
        let s = Sender::start(&file, &[]);
        let o = recv(&s.url, &ro.0.join("out.bin"), &[]);
        assert!(!o.status.success());
        assert!(
            stderr(&o).contains(&ro.0.display().to_string()),
            "names the folder: {}",
            stderr(&o)
        );
        let so = s.finish();
        assert!(
            !so.status.success() && stderr(&so).contains("failed to save"),
            "{}",
            stderr(&so)
        );
    }
    if let Some(small) = Mount::tmpfs("cli-recv-full-disk", "size=8m") {
        let s = Sender::start(&file, &[]);
        let out = small.0.join("out.bin");
        let o = recv(&s.url, &out, &[]);
        assert!(!o.status.success());
        assert!(stderr(&o).contains("cannot reserve"), "{}", stderr(&o));
        let so = s.finish();
        assert!(
            !so.status.success() && stderr(&so).contains("failed to save"),
            "{}",
            stderr(&so)
        );
        assert!(!out.exists());
        no_partials(&small.0);
    }
}

/// SIGINT at different moments of a receive: whatever phase it lands in, no partial file is left
/// and nothing incomplete is saved; the receiver exits 130.
#[test]
fn cli_recv_sigint_in_each_phase_leaves_no_file() {
    let dir = scratch("sigint");
    let (file, data) = file_of(256 << 20, &dir, 11);
    for (i, after) in [5u64, 150, 400, 800, 1500].into_iter().enumerate() {
        let s = Sender::start(&file, &[("UCX_TLS", tcp_tls())]);
        let out = dir.join(format!("out-{i}"));
        let mut r = cli();
        r.args(["recv", &s.url, "-o"])
            .arg(&out)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let child = r.spawn().unwrap();
        std::thread::sleep(Duration::from_millis(after));
        // SAFETY: kill(2) on our own child's pid.
        #[allow(unsafe_code)]
        unsafe {
            libc::kill(child.id() as i32, libc::SIGINT)
        };
        let o = child.wait_with_output().unwrap();
        if o.status.success() {
            // It finished first: then it is whole.
            assert!(std::fs::read(&out).unwrap() == data);
        } else {
            // Exit 130 once its handler is in place; killed by the signal itself before that
            // (it had created nothing yet).
            use std::os::unix::process::ExitStatusExt;
            assert!(
                o.status.code() == Some(130) || o.status.signal() == Some(libc::SIGINT),
                "after {after} ms: {:?} {}",
                o.status,
                stderr(&o)
            );
            assert!(!out.exists(), "after {after} ms: nothing incomplete is saved");
        }
        no_partials(&dir);
        if o.status.code().is_some() {
            // The receiver told the sender how it ended.
            let so = s.finish();
            assert_eq!(
                so.status.success(),
                o.status.success(),
                "the sender agrees: {}",
                stderr(&so)
            );
        } else {
            // Killed before it could tell anyone: the sender would wait for its --timeout.
            let mut s = s;
            let _ = s.child.kill();
            let _ = s.child.wait();
        }
        println!("SIGINT after {after} ms: receiver {:?}", o.status);
    }
}

/// The sender dies during the receive (over TCP, to make the transfer last): `recv` fails within
/// its timeout with one line and leaves no file.
#[test]
fn cli_recv_fails_cleanly_when_the_sender_dies() {
    let dir = scratch("sender-dies");
    let (file, _) = file_of(512 << 20, &dir, 6);
    let mut s = Sender::start(&file, &[("UCX_TLS", tcp_tls())]);
    let out = dir.join("received");
    let mut r = cli();
    r.args(["recv", &s.url, "--timeout", "20", "-o"])
        .arg(&out)
        .env("UCX_TLS", tcp_tls());
    let t0 = Instant::now();
    let recv = r.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    std::thread::sleep(Duration::from_millis(400));
    s.child.kill().unwrap();
    s.child.wait().unwrap();
    let o = recv.wait_with_output().unwrap();
    let took = t0.elapsed();
    let err = stderr(&o);
    if o.status.success() {
        println!("the receive finished before the kill landed");
        return;
    }
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one clear line: {err}");
    assert!(took < Duration::from_secs(25), "within the timeout: {took:?}");
    assert!(!out.exists(), "no complete-looking output after a failed receive");
    no_partials(&dir);
}

/// A sender stopped (SIGSTOP) after publishing: `recv --timeout` ends in time with exit code 3.
#[test]
fn cli_recv_deadline_holds_when_the_sender_is_stopped() {
    let dir = scratch("sender-stopped");
    let (file, _) = file_of(64 << 20, &dir, 13);
    for tls in ["", tcp_tls()] {
        let env: Vec<(&str, &str)> = if tls.is_empty() {
            vec![]
        } else {
            vec![("UCX_TLS", tls)]
        };
        let s = Sender::start(&file, &env);
        crate::stop::signal(s.child.id(), libc::SIGSTOP);
        let mut r = cli();
        r.args(["recv", &s.url, "--timeout", "3", "-o"])
            .arg(dir.join("out"));
        for (k, v) in &env {
            r.env(k, v);
        }
        let (o, took) = run(r, Duration::from_secs(30));
        crate::stop::signal(s.child.id(), libc::SIGCONT);
        crate::stop::signal(s.child.id(), libc::SIGKILL);
        assert_eq!(o.status.code(), Some(3), "UCX_TLS={tls}: {}", stderr(&o));
        assert!(took < Duration::from_secs(6), "UCX_TLS={tls}: took {took:?}");
        assert!(!dir.join("out").exists());
        no_partials(&dir);
        drop(s.finish());
    }
}

#[test]
fn cli_send_refuses_a_folder_with_a_clear_message() {
    let dir = scratch("send-dir");
    let (o, _) = run(
        {
            let mut c = cli();
            c.arg("send").arg(&dir);
            c
        },
        Duration::from_secs(30),
    );
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("is a folder"), "{}", stderr(&o));
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
        "same-host path",
        "CUDA",
        "huge pages",
    ] {
        assert!(names.contains(&want), "{want} missing from {names:?}");
    }
    // An optional check that fails (NATS down) does not make NIXL unusable.
    let mut c = cli();
    c.args(["doctor", "--json", "--nats", "nats://127.0.0.1:1"]);
    let (o, _) = run(c, Duration::from_secs(60));
    ok(&o, "doctor with NATS down");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["usable"], true, "{v}");
    assert_eq!(v["optional_failed"][0], "NATS", "{v}");
    // Pointed at an empty folder, doctor says what to do and exits 1.
    let empty = scratch("doctor-empty");
    let mut c = cli();
    c.arg("doctor").env("NIXL_CONNECT_LIB", &empty);
    let (o, _) = run(c, Duration::from_secs(60));
    assert_eq!(o.status.code(), Some(1));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains("fix:") && text.contains("scripts/setup.sh"),
        "{text}"
    );
}
