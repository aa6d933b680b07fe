//! The same-host path between network namespaces that share only a directory (issue 41): pods on
//! one node, each in its own network namespace, mounting one volume. Their abstract sockets cannot
//! meet; with `NIXL_CONNECT_SOCKET_DIR` naming the shared directory on both sides, each connector's
//! socket is also a file there, found from the identity its agent name advertises. Real processes
//! in real namespaces (`ip netns`, `unshare`: these tests run as root), NIXL over TCP between them.

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::Command;

use super::local::Netns;
use super::soundness::PEER;
use super::support::{tcp_tls, Peer, PEER_ENV};

/// A fresh directory both namespaces see, open to all as a shared volume (Kubernetes' `emptyDir`)
/// is.
fn shared_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("nxc-pods-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o777)).unwrap();
    d
}

/// The owner exposes, the other side reads (`op`: `read ...`) or writes, and the owner's
/// operation completes: the other side's report line.
fn through(owner: &mut Peer, other: &mut Peer, expose: &str, op: &str) -> String {
    owner.say(expose);
    let md = owner.expect("MD:");
    other.say(op);
    other.say(&md);
    other.expect("STARTED");
    let got = other.expect(if op.starts_with("read") { "READ:" } else { "WRITE:" });
    if got.starts_with("ok") {
        owner.say("wait 5000");
        assert_eq!(
            owner.expect("WAIT:"),
            "ok",
            "{expose}: the operation reached the owner"
        );
    }
    owner.say("drop");
    owner.expect("DROPPED");
    got
}

/// Reads and writes, host memory (the library's own and plain vectors, small and large), between
/// two network namespaces: with the socket directory they take the same-host path (bytes checked
/// by the reader, a `local`-only write completing on the owner); without it, NIXL over TCP.
#[test]
fn pods_socket_dir_reaches_a_peer_in_another_network_namespace() {
    let Some(ns) = Netns::make() else { return };
    let dir = shared_dir("reach");
    let d = dir.to_str().unwrap().to_string();
    let tls = tcp_tls();
    for with_dir in [false, true] {
        let mut env_a = vec![("UCX_TLS", tls), ("UCX_NET_DEVICES", ns.dev_a.as_str())];
        let mut env_b = vec![("UCX_TLS", tls), ("UCX_NET_DEVICES", ns.dev_b.as_str())];
        if with_dir {
            env_a.push(("NIXL_CONNECT_SOCKET_DIR", d.as_str()));
            env_b.push(("NIXL_CONNECT_SOCKET_DIR", d.as_str()));
        }
        let mut owner = Peer::from_command(ns.command_for(&ns.a, PEER, &env_a));
        let mut other = Peer::from_command(ns.command_for(&ns.b, PEER, &env_b));
        for (len, kind) in [(4096usize, "vec"), (1 << 20, "host"), (8 << 20, "vec")] {
            let got = through(
                &mut owner,
                &mut other,
                &format!("expose readable {len} {kind}"),
                "read auto fresh",
            );
            let path = if with_dir { "path=local" } else { "path=nixl" };
            assert!(
                got.starts_with("ok first=90") && got.contains(path) && got.ends_with("same=true"),
                "dir={with_dir} {len} {kind}: {got}"
            );
            let got = through(
                &mut owner,
                &mut other,
                &format!("expose writable {len} {kind}"),
                "write local",
            );
            if with_dir {
                assert_eq!(got, "ok", "{len} {kind}: a same-host write across namespaces");
            } else {
                assert!(
                    got.starts_with("err"),
                    "{len} {kind}: no same-host path without the directory: {got}"
                );
            }
        }
    }
    // The peers were killed (their files left behind, as a crashed pod's): the next connector to
    // start removes them, and its own go with it.
    drop(ns);
    // SAFETY: getuid cannot fail.
    let uid = unsafe { libc::getuid() };
    let files = || -> Vec<String> {
        std::fs::read_dir(dir.join(format!("nixl-connect.{uid}")))
            .map(|r| {
                r.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default()
    };
    assert!(!files().is_empty(), "the killed peers' sockets");
    let c = nixl_connect::Connector::builder()
        .socket_dir(&dir)
        .build()
        .unwrap();
    let (_, fp) = c.name().rsplit_once(".nxc1-").expect("an advertised name");
    let mut mine = files();
    mine.sort();
    assert_eq!(
        mine,
        [format!("nxc1-{fp}.lock"), format!("nxc1-{fp}.sock")],
        "only the live connector's"
    );
    drop(c);
    assert!(files().is_empty(), "left behind: {:?}", files());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A peer found through the directory from another PID namespace (its pid is not visible): the
/// same-host path cannot copy across it yet, so `auto` takes NIXL and `local` fails with that
/// reason, at once.
#[test]
fn pods_peer_in_another_pid_namespace_takes_nixl_with_the_reason() {
    let Some(ns) = Netns::make() else { return };
    let dir = shared_dir("pidns");
    let d = dir.to_str().unwrap().to_string();
    let tls = tcp_tls();
    let env_a = [
        ("UCX_TLS", tls),
        ("UCX_NET_DEVICES", ns.dev_a.as_str()),
        ("NIXL_CONNECT_SOCKET_DIR", d.as_str()),
    ];
    let mut owner = Peer::from_command(ns.command_for(&ns.a, PEER, &env_a));
    // The other side in network namespace b and a PID namespace of its own (with its own /proc).
    let mut cmd = Command::new("ip");
    cmd.args([
        "netns",
        "exec",
        &ns.b,
        "unshare",
        "--pid",
        "--fork",
        "--mount-proc",
    ])
    .arg(std::env::current_exe().unwrap())
    .args([PEER, "--exact", "--ignored", "--nocapture", "--test-threads=1"])
    .env(PEER_ENV, "peer")
    .env("UCX_TLS", tls)
    .env("UCX_NET_DEVICES", &ns.dev_b)
    .env("NIXL_CONNECT_SOCKET_DIR", &d);
    let mut other = Peer::from_command(cmd);
    let got = through(
        &mut owner,
        &mut other,
        "expose readable 1048576 host",
        "read auto fresh",
    );
    assert!(
        got.starts_with("ok first=90") && got.contains("path=nixl"),
        "auto across PID namespaces: {got}"
    );
    let got = through(
        &mut owner,
        &mut other,
        "expose readable 4096 vec",
        "read local fresh",
    );
    assert!(
        got.starts_with("err") && got.contains("another PID namespace"),
        "local across PID namespaces: {got}"
    );
    drop((owner, other, ns));
    std::fs::remove_dir_all(&dir).unwrap();
}
