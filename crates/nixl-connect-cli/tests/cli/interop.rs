//! Rust and Python Dynamo workers pairing in every direction, with nothing but the RdmaMetadata
//! JSON between them. The Python side is the unmodified `dynamo.nixl_connect` from PyPI's
//! `ai-dynamo-runtime==1.6.1` (installed by `bash scripts/setup.sh --interop`), driven by
//! `tests/interop/py_peer.py`, with a stand-in `torch` module (see `support::python`).

use std::time::Duration;

use crate::support::*;

const CASES: [(usize, usize); 3] = [(4096, 1), (64 << 20, 1), (1 << 20, 8)];
const LIMIT: Duration = Duration::from_secs(120);

#[test]
fn interop_python_readable_to_rust_read() {
    let dir = scratch("py-readable");
    for (size, n) in CASES {
        let mut py = python();
        py.args([
            "readable",
            "--size",
            &size.to_string(),
            "--descriptors",
            &n.to_string(),
        ]);
        let peer = Passive::start(py);
        let md = peer.metadata_file(&dir);
        let out = dir.join("out");
        let mut c = cli();
        c.args(["read", "--metadata"]).arg(&md).arg("--out").arg(&out);
        ok(&run(c, LIMIT).0, "nixl-connect read");
        ok(
            &peer.finish(),
            "python readable (its wait_for_completion returned)",
        );
        assert!(
            std::fs::read(&out).unwrap() == pattern(size, &dir),
            "{size} bytes / {n} descriptors differ"
        );
    }
}

/// `doctor --peer` on a Python Dynamo worker's readable: NIXL, because the peer's agent name
/// advertises no same-host endpoint (said in those words); the read then takes NIXL.
#[test]
fn interop_doctor_peer_says_why_a_python_peer_takes_nixl() {
    let dir = scratch("py-doctor");
    let mut py = python();
    py.args(["readable", "--size", "1048576", "--descriptors", "1"]);
    let peer = Passive::start(py);
    let md = peer.metadata_file(&dir);
    let said = doctor_peer(&md);
    assert_eq!(said["path"], "nixl", "{said}");
    let declined = said["declined"].as_array().expect("a list");
    assert_eq!(declined.len(), 1, "{said}");
    assert_eq!(declined[0]["path"], "local", "{said}");
    assert!(
        declined[0]["reason"]
            .as_str()
            .unwrap_or_default()
            .contains("advertises no same-host endpoint"),
        "{said}"
    );
    assert!(said["nixl"].is_string(), "what UCX has here: {said}");
    let took = read_reported(&md, &dir);
    ok(&peer.finish(), "python readable");
    let [predicted, taken] = predicted_and_taken(&said, &took);
    assert_eq!(predicted, taken, "predicted {said}, took {took}");
}

#[test]
fn interop_rust_readable_to_python_read() {
    let dir = scratch("rs-readable");
    for (size, n) in CASES {
        let mut c = cli();
        c.args([
            "serve",
            "--size",
            &size.to_string(),
            "--descriptors",
            &n.to_string(),
        ]);
        let peer = Passive::start(c);
        let md = peer.metadata_file(&dir);
        let out = dir.join("out");
        let mut py = python();
        py.args(["read", "--metadata"]).arg(&md).arg("--out").arg(&out);
        ok(&run(py, LIMIT).0, "python read");
        ok(
            &peer.finish(),
            "nixl-connect serve (its wait_for_completion returned)",
        );
        assert!(
            std::fs::read(&out).unwrap() == pattern(size, &dir),
            "{size} bytes / {n} descriptors differ"
        );
    }
}

#[test]
fn interop_python_writable_to_rust_write() {
    let dir = scratch("py-writable");
    for (size, n) in CASES {
        let got = dir.join("got");
        let mut py = python();
        py.args([
            "writable",
            "--size",
            &size.to_string(),
            "--descriptors",
            &n.to_string(),
            "--out",
        ])
        .arg(&got);
        let peer = Passive::start(py);
        let md = peer.metadata_file(&dir);
        let (input, data) = file_of(size, &dir, n as u8);
        let mut c = cli();
        c.args(["write", "--metadata"]).arg(&md).arg("--file").arg(&input);
        ok(&run(c, LIMIT).0, "nixl-connect write");
        ok(&peer.finish(), "python writable");
        assert!(
            std::fs::read(&got).unwrap() == data,
            "{size} bytes / {n} descriptors differ"
        );
    }
}

#[test]
fn interop_rust_writable_to_python_write() {
    let dir = scratch("rs-writable");
    for (size, n) in CASES {
        let got = dir.join("got");
        let mut c = cli();
        c.args([
            "serve",
            "--writable",
            "--size",
            &size.to_string(),
            "--descriptors",
            &n.to_string(),
            "--out",
        ])
        .arg(&got);
        let peer = Passive::start(c);
        let md = peer.metadata_file(&dir);
        let (input, data) = file_of(size, &dir, n as u8 + 7);
        let mut py = python();
        py.args(["write", "--metadata"])
            .arg(&md)
            .arg("--file")
            .arg(&input);
        ok(&run(py, LIMIT).0, "python write");
        ok(&peer.finish(), "nixl-connect serve --writable");
        assert!(
            std::fs::read(&got).unwrap() == data,
            "{size} bytes / {n} descriptors differ"
        );
    }
}

#[test]
fn interop_python_hex_metadata_is_accepted() {
    let dir = scratch("py-hex");
    let mut py = python();
    py.args(["readable", "--size", "65536", "--descriptors", "3", "--hex"]);
    let peer = Passive::start(py);
    assert!(
        !peer.metadata.contains("b64:"),
        "python printed hex-encoded nixl_metadata"
    );
    let md = peer.metadata_file(&dir);
    let out = dir.join("out");
    let mut c = cli();
    c.args(["read", "--metadata"]).arg(&md).arg("--out").arg(&out);
    ok(&run(c, LIMIT).0, "nixl-connect read of hex metadata");
    ok(&peer.finish(), "python readable");
    assert!(std::fs::read(&out).unwrap() == pattern(65536, &dir));
}

#[test]
fn interop_rust_json_passes_pydantic_strict_model() {
    let dir = scratch("pydantic");
    for flags in [
        &["serve", "--size", "4096", "--descriptors", "3"][..],
        &["serve", "--writable", "--size", "100"],
    ] {
        let mut c = cli();
        c.args(flags)
            .args(["--timeout", "30", "--out"])
            .arg(dir.join("unused"));
        let mut peer = Passive::start(c);
        let md = peer.metadata_file(&dir);
        let mut py = python();
        py.args(["validate", "--metadata"]).arg(&md);
        let (o, _) = run(py, LIMIT);
        ok(&o, "pydantic RdmaMetadata.model_validate_json");
        let back = String::from_utf8_lossy(&o.stdout);
        let back = back.lines().find(|l| l.starts_with('{')).unwrap();
        assert_eq!(
            back, peer.metadata,
            "Python re-serialises Rust's JSON byte for byte"
        );
        let _ = peer.child.kill();
        let _ = peer.child.wait();
    }
}

#[test]
fn interop_wrong_pairings_fail_cleanly_and_move_nothing() {
    let dir = scratch("wrong");
    // A Python writable's metadata given to Rust `read`: Rust detects it before any transfer.
    let got = dir.join("py-got");
    let mut py = python();
    py.args(["writable", "--size", "4096", "--timeout", "3", "--out"])
        .arg(&got);
    let peer = Passive::start(py);
    let md = peer.metadata_file(&dir);
    let out = dir.join("rs-out");
    let mut c = cli();
    c.args(["read", "--metadata"]).arg(&md).arg("--out").arg(&out);
    let (o, _) = run(c, LIMIT);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("wrong pairing") && err.contains("begin_write"),
        "{err}"
    );
    assert!(!out.exists(), "no output for a refused read");
    let o = peer.finish();
    assert!(
        !o.status.success(),
        "the python writable was never written, so it times out"
    );
    assert!(!got.exists(), "nothing was transferred into the python writable");

    // A Rust readable given to Python `write`: Python detects it before any transfer.
    let mut c = cli();
    c.args(["serve", "--size", "4096", "--timeout", "3"]);
    let peer = Passive::start(c);
    let md = peer.metadata_file(&dir);
    let (input, _) = file_of(4096, &dir, 1);
    let mut py = python();
    py.args(["write", "--metadata"])
        .arg(&md)
        .arg("--file")
        .arg(&input);
    let (o, _) = run(py, LIMIT);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("Cannot create a `WriteOperation`"), "{err}");
    let o = peer.finish();
    assert!(
        !o.status.success(),
        "nobody read the Rust readable, so serve times out"
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("no peer read the readable"), "{err}");
}
