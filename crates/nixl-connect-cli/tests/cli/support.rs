//! Running the CLI and the Python peer as processes.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub(crate) const BIN: &str = env!("CARGO_BIN_EXE_nixl-connect");

/// The `UCX_TLS` value that makes NIXL move host memory over TCP (asynchronous, so a transfer can
/// be caught in flight): `tcp`, plus `cuda_copy` on a machine with an NVIDIA driver, where NIXL
/// refuses a transport list without it ("Add cuda_copy").
pub(crate) fn tcp_tls() -> &'static str {
    if std::path::Path::new("/dev/nvidiactl").exists() {
        "tcp,cuda_copy"
    } else {
        "tcp"
    }
}

pub(crate) fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap()
}

/// A fresh scratch folder, removed with everything in it when the guard drops (a failing test
/// included: the sigint test alone writes 768 MiB, and scratch left behind fills a CI disk).
pub(crate) struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<std::ffi::OsStr> for Scratch {
    fn as_ref(&self) -> &std::ffi::OsStr {
        self.0.as_os_str()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A fresh scratch folder named after `name` and this process.
pub(crate) fn scratch(name: &str) -> Scratch {
    let d = std::env::temp_dir().join(format!("nixl-connect-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    Scratch(d)
}

pub(crate) fn cli() -> Command {
    Command::new(BIN)
}

/// The venv's python with Dynamo's module (and real torch, which it imports); fails (never
/// skips) when it is missing.
pub(crate) fn python() -> Command {
    let py = root().join(".venv/bin/python");
    assert!(
        py.exists(),
        "{} is missing: run `bash scripts/setup.sh --interop` (the interop tests need Python Dynamo)",
        py.display()
    );
    let mut c = Command::new(py);
    c.arg(root().join("tests/interop/py_peer.py"));
    c.env("NIXL_LOG_LEVEL", "WARN");
    c
}

/// A passive peer (CLI `serve` or Python readable/writable) that printed its metadata line.
pub(crate) struct Passive {
    pub child: Child,
    pub metadata: String,
}

impl Passive {
    /// Starts `cmd` and waits for the first JSON line on its stdout.
    pub(crate) fn start(mut cmd: Command) -> Self {
        let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
        let out = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if line.trim_start().starts_with('{') {
                    let _ = tx.send(line);
                    return;
                }
            }
        });
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(metadata) => Passive { child, metadata },
            Err(_) => {
                let _ = child.kill();
                let out = child.wait_with_output().unwrap();
                panic!(
                    "the passive peer printed no metadata: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        }
    }

    /// Writes the metadata to a file in `dir`.
    pub(crate) fn metadata_file(&self, dir: &Path) -> PathBuf {
        let p = dir.join("metadata.json");
        std::fs::write(&p, &self.metadata).unwrap();
        p
    }

    /// Waits for the peer to exit (bounded) and returns its output.
    pub(crate) fn finish(mut self) -> Output {
        let t0 = Instant::now();
        while self.child.try_wait().unwrap().is_none() {
            assert!(
                t0.elapsed() < Duration::from_secs(90),
                "the passive peer did not exit"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        self.child.wait_with_output().unwrap()
    }
}

/// Runs `cmd` to completion within `limit`, returning its output and how long it took.
pub(crate) fn run(mut cmd: Command, limit: Duration) -> (Output, Duration) {
    let t0 = Instant::now();
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    while child.try_wait().unwrap().is_none() {
        if t0.elapsed() > limit {
            let _ = child.kill();
            panic!("{cmd:?} ran past {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    (child.wait_with_output().unwrap(), t0.elapsed())
}

pub(crate) fn ok(o: &Output, what: &str) {
    assert!(
        o.status.success(),
        "{what} failed: {:?}\nstdout: {}\nstderr: {}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// The bytes `serve --size N` exposes, from the Python peer's implementation of the pattern (so
/// both languages agree on it).
pub(crate) fn pattern(n: usize, dir: &Path) -> Vec<u8> {
    let p = dir.join(format!("pattern-{n}"));
    let mut c = python();
    c.args(["pattern", "--size", &n.to_string(), "--out"]).arg(&p);
    let (o, _) = run(c, Duration::from_secs(60));
    ok(&o, "py_peer pattern");
    std::fs::read(p).unwrap()
}

/// A deterministic file of `n` bytes.
pub(crate) fn file_of(n: usize, dir: &Path, seed: u8) -> (PathBuf, Vec<u8>) {
    let data: Vec<u8> = (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 9) as u8)
        .collect();
    let p = dir.join(format!("input-{n}-{seed}"));
    std::fs::write(&p, &data).unwrap();
    (p, data)
}

/// No file in `dir` looks like a leftover partial output.
pub(crate) fn no_partials(dir: &Path) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let n = e.file_name().to_string_lossy().into_owned();
        assert!(!n.contains("partial"), "partial output left behind: {n}");
    }
}

/// `nixl-connect doctor --peer MD --json`: what it predicts for an operation with that peer.
pub(crate) fn doctor_peer(md: &Path) -> serde_json::Value {
    let mut c = cli();
    c.args(["doctor", "--json", "--peer"]).arg(md);
    let (o, _) = run(c, Duration::from_secs(60));
    ok(&o, "doctor --peer");
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
        panic!(
            "doctor --peer printed no JSON ({e}): {}",
            String::from_utf8_lossy(&o.stdout)
        )
    })
}

/// `nixl-connect read --json` of `md` into a file in `dir`: its report (path, mechanism).
pub(crate) fn read_reported(md: &Path, dir: &Path) -> serde_json::Value {
    let mut c = cli();
    c.args(["read", "--json", "--metadata"])
        .arg(md)
        .arg("--out")
        .arg(dir.join("out"));
    let (o, _) = run(c, Duration::from_secs(120));
    ok(&o, "read");
    let text = String::from_utf8_lossy(&o.stdout);
    let line = text.lines().find(|l| l.starts_with('{')).unwrap_or_default();
    serde_json::from_str(line).unwrap_or_else(|e| panic!("read printed no JSON ({e}): {text}"))
}

/// The path and mechanism `doctor --peer` predicted, and the ones the read then took, as pairs.
pub(crate) fn predicted_and_taken(
    said: &serde_json::Value,
    took: &serde_json::Value,
) -> [(String, String); 2] {
    let pair = |v: &serde_json::Value| {
        (
            v["path"].as_str().unwrap_or("-").to_string(),
            v["mechanism"].as_str().unwrap_or("none").to_string(),
        )
    };
    [pair(said), pair(took)]
}
