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
use super::support::{tcp_tls, Peer, PEER_ENV, POD};

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
    through_probed(owner, other, expose, op, None).1
}

/// As [`through`], the other side first asking (`probe`: `probe ...`) which path the operation
/// would take: its prediction (`path=<p> mechanism=<m> declined=...`), and the report line.
fn through_probed(
    owner: &mut Peer,
    other: &mut Peer,
    expose: &str,
    op: &str,
    probe: Option<&str>,
) -> (String, String) {
    owner.say(expose);
    let md = owner.expect("MD:");
    let predicted = match probe {
        Some(p) => {
            other.say(p);
            other.say(&md);
            other.expect("PROBE:")
        }
        None => String::new(),
    };
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
    (predicted, got)
}

/// The `path=<p> mechanism=<m> ` a probe's prediction names.
fn path_of(predicted: &str) -> &str {
    predicted.find("declined=").map_or(predicted, |i| &predicted[..i])
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
            let (predicted, got) = through_probed(
                &mut owner,
                &mut other,
                &format!("expose readable {len} {kind}"),
                "read auto fresh",
                Some("probe auto"),
            );
            let path = match (with_dir, len <= 8192) {
                (true, true) => "path=local mechanism=frames ",
                (true, false) => "path=local mechanism=cma ",
                (false, _) => "path=nixl mechanism=none ",
            };
            assert!(
                got.starts_with("ok first=90") && got.contains(path) && got.contains("same=true"),
                "dir={with_dir} {len} {kind}: {got}"
            );
            // The prediction (`doctor --peer`'s) is the path taken; without the directory, it says
            // why the same-host path declines.
            assert_eq!(
                path_of(&predicted),
                path,
                "dir={with_dir} {len} {kind}: {predicted}"
            );
            if !with_dir {
                assert!(
                    predicted.contains("declined=local: no same-host socket for this peer"),
                    "{predicted}"
                );
            }
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

/// The owner exposes a writable of `len` bytes (`kind`: `host` or `vec`), `on_md` sees its
/// metadata, the writer writes the pattern into it (`mode`: `local` or `auto`), and the owner
/// checks every byte; returns how the same-host path moved it (`none`: another path).
fn write_checked(
    owner: &mut Peer,
    writer: &mut Peer,
    len: usize,
    kind: &str,
    mode: &str,
    on_md: &mut dyn FnMut(&str),
) -> String {
    owner.say(&format!("expose writable {len} {kind}"));
    let md = owner.expect("MD:");
    on_md(&md);
    writer.say(&format!("write {mode} pat"));
    writer.say(&md);
    writer.expect("STARTED");
    let how = writer.expect("MECHANISM:");
    assert_eq!(writer.expect("WRITE:"), "ok", "a write of {len} {kind}");
    owner.say("wait 5000");
    assert_eq!(owner.expect("WAIT:"), "ok");
    owner.say("check pat");
    assert_eq!(owner.expect("CHECK:"), "true", "the write's bytes, {len} {kind}");
    owner.say("drop");
    owner.expect("DROPPED");
    how
}

/// A peer process in its own network, PID, mount and IPC namespaces, with its own /proc, as a pod.
fn pod(ns: &Netns, netns: &str, dev: &str, dir: &str) -> Peer {
    pod_running(ns, netns, dev, dir, PEER, &[])
}

/// As [`pod`], running the support test `test` with `env` added.
fn pod_running(ns: &Netns, netns: &str, dev: &str, dir: &str, test: &str, env: &[(&str, &str)]) -> Peer {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", netns])
        .args(POD)
        .arg(std::env::current_exe().unwrap())
        .args([test, "--exact", "--ignored", "--nocapture", "--test-threads=1"])
        .env(PEER_ENV, "peer")
        .env("UCX_TLS", tcp_tls())
        .env("UCX_NET_DEVICES", dev)
        .env("NIXL_CONNECT_SOCKET_DIR", dir);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let _ = ns;
    Peer::from_command(cmd)
}

/// Two pods that share only the socket directory (separate network, PID, mount and IPC
/// namespaces: neither sees the other's pid, so no cross-memory attach): host memory moves
/// through pipes the source's owner feeds, on the same-host path (`local` only, no NIXL), reads
/// and writes, the library's buffers and plain vectors, small (in the frames) and large (through
/// 1 to 4 lanes), every byte checked against a pattern that differs with its position.
#[test]
fn pods_peer_in_another_pid_namespace_moves_host_memory_through_pipes() {
    let Some(ns) = Netns::make() else { return };
    let dir = shared_dir("pidns");
    let d = dir.to_str().unwrap().to_string();
    let mut owner = pod(&ns, &ns.a, &ns.dev_a, &d);
    let mut other = pod(&ns, &ns.b, &ns.dev_b, &d);
    for (len, kind) in [
        (4096usize, "vecpat"),
        (1 << 20, "hostpat"),
        ((8 << 20) + 12345, "vecpat"),
        (64 << 20, "hostpat"),
    ] {
        let (predicted, got) = through_probed(
            &mut owner,
            &mut other,
            &format!("expose readable {len} {kind}"),
            "read local fresh",
            Some("probe local"),
        );
        let how = if len <= 8192 { "frames" } else { "pipes" };
        assert!(
            got.starts_with("ok")
                && got.contains(&format!("path=local mechanism={how} "))
                && got.ends_with("pattern=true"),
            "a read of {len} {kind} across PID namespaces: {got}"
        );
        assert_eq!(
            path_of(&predicted),
            format!("path=local mechanism={how} "),
            "the prediction (`doctor --peer`'s) for {len} {kind}"
        );
        let plain = kind.trim_end_matches("pat");
        let got = write_checked(&mut owner, &mut other, len, plain, "local", &mut |_| {});
        assert_eq!(got, how, "a write of {len} {kind} across PID namespaces");
    }
    drop((owner, other, ns));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Round 4's metadata holder, against the directory rendezvous: a process of the same user in
/// another pod holds the owner's metadata and replaces the owner's socket file in the shared
/// directory with its own (the directory is the user's, so it may), proving every key it learnt
/// and signing its `Welcome` with an identity of its own. The reader in its pod dials the file and
/// meets the squatter: its `Welcome` is not signed by the identity the owner's name advertises,
/// so the reader sends it nothing after the hello (no `Trusted`, no request, no bytes), and the
/// reads and writes reach the real owner through NIXL, bytes checked.
#[test]
fn pods_metadata_holder_in_the_socket_directory_cannot_answer_as_the_owner() {
    let Some(ns) = Netns::make() else { return };
    let dir = shared_dir("squat");
    let d = dir.to_str().unwrap().to_string();
    let mut owner = pod(&ns, &ns.a, &ns.dev_a, &d);
    let mut squatter = pod_running(
        &ns,
        &ns.b,
        &ns.dev_b,
        &d,
        "hostile::support_squatter",
        &[("SQUAT_DIR", d.as_str())],
    );
    let mut reader = pod(&ns, &ns.b, &ns.dev_b, &d);
    for (len, kind) in [(4096usize, "vecpat"), (2usize << 20, "hostpat")] {
        owner.say(&format!("expose readable {len} {kind}"));
        let md = owner.expect("MD:");
        squatter.say(&md);
        squatter.expect("BOUND");
        reader.say("read auto fresh");
        reader.say(&md);
        reader.expect("STARTED");
        let got = reader.expect("READ:");
        assert!(
            got.starts_with("ok") && got.contains("path=nixl") && got.ends_with("pattern=true"),
            "{len}: the owner's bytes through NIXL: {got}"
        );
        owner.say("wait 5000");
        assert_eq!(owner.expect("WAIT:"), "ok");
        owner.say("drop");
        owner.expect("DROPPED");
        let mut squat = |md: &str| {
            squatter.say(md);
            squatter.expect("BOUND");
        };
        let how = write_checked(&mut owner, &mut reader, len, "vec", "auto", &mut squat);
        assert_eq!(how, "none", "{len}: not the same-host path");
    }
    squatter.say("report");
    let heard = squatter.expect("HEARD:");
    println!("pods_metadata_holder_in_the_socket_directory_cannot_answer_as_the_owner: {heard}");
    assert!(
        !heard.starts_with("hellos=0 "),
        "the reader met the squatter: {heard}"
    );
    assert!(heard.ends_with("trusted=0 requests=0"), "{heard}");
    drop((owner, squatter, reader, ns));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Issue 63, finding 2: a reader in another PID namespace (or one that uses CUDA) takes
/// descriptors from its server, so it let the kernel deliver them from the moment it connected,
/// before the server proved anything: a same-user process in another pod that replaced the
/// owner's socket file passed descriptors at once, which the reader held. Now the reader's socket
/// refuses descriptors until the server's `Welcome` is proven (the kernel fails the squatter's
/// `sendmsg`), and the read takes NIXL, bytes checked.
#[test]
fn pods_squatter_passing_descriptors_before_its_welcome_passes_none() {
    let Some(ns) = Netns::make() else { return };
    let dir = shared_dir("prepass");
    let d = dir.to_str().unwrap().to_string();
    let mut owner = pod(&ns, &ns.a, &ns.dev_a, &d);
    let mut squatter = pod_running(
        &ns,
        &ns.b,
        &ns.dev_b,
        &d,
        "hostile::support_squatter",
        &[("SQUAT_DIR", d.as_str()), ("PREPASS", "1")],
    );
    let mut reader = pod(&ns, &ns.b, &ns.dev_b, &d);
    owner.say("expose readable 65536 vecpat");
    let md = owner.expect("MD:");
    squatter.say(&md);
    squatter.expect("BOUND");
    reader.say("read auto fresh");
    reader.say(&md);
    reader.expect("STARTED");
    let got = reader.expect("READ:");
    assert!(
        got.starts_with("ok") && got.contains("path=nixl") && got.ends_with("pattern=true"),
        "the owner's bytes through NIXL: {got}"
    );
    owner.say("wait 5000");
    assert_eq!(owner.expect("WAIT:"), "ok");
    squatter.say("report");
    let heard = squatter.expect("HEARD:");
    let passed = squatter.expect("PREPASS:");
    println!("pods_squatter_passing_descriptors_before_its_welcome_passes_none: {heard} {passed}");
    if passed.ends_with("kernel=false") {
        // Before Linux 6.16 a socket cannot refuse them: the reader's core refuses them instead
        // and closes them off the engine thread.
        eprintln!("this kernel cannot refuse passed descriptors (SO_PASSRIGHTS): not checked");
    } else {
        assert!(
            passed.starts_with("passed=0 ") && !passed.starts_with("passed=0 refused=0 "),
            "the squatter tried, and no descriptor reached the reader: {passed}"
        );
        assert!(heard.ends_with("trusted=0 requests=0"), "{heard}");
    }
    drop((owner, squatter, reader, ns));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Round 4's other user, against the directory rendezvous: the user's folder in the shared
/// directory is 0700, so another user's process cannot even reach a socket file in it (it gets
/// `EACCES` where the abstract socket would have had it refused on its uid after connecting); the
/// folder's listing is closed to it too.
#[test]
fn pods_another_user_cannot_reach_the_socket_directory() {
    // SAFETY: getuid cannot fail.
    #[allow(unsafe_code)]
    if unsafe { libc::getuid() } != 0 {
        panic!("this test runs as root (it becomes uid 65534 to play the other user)");
    }
    use std::os::unix::process::CommandExt;
    let dir = shared_dir("otheruser");
    let c = nixl_connect::Connector::builder()
        .socket_dir(&dir)
        .build()
        .unwrap();
    let (_, fp) = c.name().rsplit_once(".nxc1-").expect("an advertised name");
    let folder = dir.join("nixl-connect.0");
    let sock = folder.join(format!("nxc1-{fp}.sock"));
    assert!(sock.exists(), "the connector's socket file");
    let probe = format!(
        "import os, socket\n\
         s = socket.socket(socket.AF_UNIX)\n\
         try:\n    s.connect({sock:?}); print('CONNECT:ok')\n\
         except OSError as e: print('CONNECT:' + os.strerror(e.errno))\n\
         try:\n    os.listdir({folder:?}); print('LIST:ok')\n\
         except OSError as e: print('LIST:' + os.strerror(e.errno))\n",
        sock = sock.to_str().unwrap(),
        folder = folder.to_str().unwrap(),
    );
    let out = Command::new("python3")
        .args(["-c", &probe])
        .uid(65534)
        .gid(65534)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("CONNECT:Permission denied"), "{text}");
    assert!(text.contains("LIST:Permission denied"), "{text}");
    drop(c);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Round 4's bare-connection flood, against the directory rendezvous: a process of the same user
/// in another pod opens 200 connections to the owner's socket file and never says a word. The
/// handshake places are charged to that process (named across PID namespaces by its pidfs id), so
/// a reader in a third pod still takes the same-host path.
#[test]
fn pods_bare_connection_flood_through_the_directory_leaves_readers_served() {
    let Some(ns) = Netns::make() else { return };
    let dir = shared_dir("flood");
    let d = dir.to_str().unwrap().to_string();
    let mut owner = pod(&ns, &ns.a, &ns.dev_a, &d);
    owner.say("expose readable 1048576 hostpat");
    let md = owner.expect("MD:");
    let name = nixl_connect::RdmaMetadata::agent_name_in(
        &md.parse::<nixl_connect::RdmaMetadata>().unwrap().nixl_metadata,
    )
    .unwrap();
    let (_, fp) = name.rsplit_once(".nxc1-").expect("an advertising owner");
    let sock = dir.join("nixl-connect.0").join(format!("nxc1-{fp}.sock"));
    let flood = format!(
        "import socket, sys, time\n\
         held = []\n\
         for _ in range(200):\n    s = socket.socket(socket.AF_UNIX)\n    try:\n        s.connect({sock:?}); held.append(s)\n    except OSError: pass\n\
         print('FLOODING', len(held), flush=True)\n\
         sys.stdin.read()\n",
        sock = sock.to_str().unwrap()
    );
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &ns.b])
        .args(POD)
        .args(["python3", "-c", &flood]);
    let mut flooder = Peer::from_command(cmd);
    let held = flooder.expect("FLOODING");
    assert!(held.trim().parse::<usize>().unwrap() > 0, "{held}");
    let mut reader = pod(&ns, &ns.b, &ns.dev_b, &d);
    reader.say("read local fresh");
    reader.say(&md);
    reader.expect("STARTED");
    let got = reader.expect("READ:");
    assert!(
        got.starts_with("ok") && got.contains("path=local mechanism=pipes ") && got.ends_with("pattern=true"),
        "a read under the flood: {got}"
    );
    owner.say("wait 5000");
    assert_eq!(owner.expect("WAIT:"), "ok");
    drop((owner, flooder, reader, ns));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Nested namespaces: a writer in the node's PID namespace (it sees the owner's pid, so it could
/// be read by cross-memory attach) writing into a pod that cannot see it. The owner asks, in its
/// signed `Welcome`, for writes through pipes, and the write takes them, bytes checked.
#[test]
fn pods_owner_that_cannot_see_its_writer_asks_for_pipes() {
    let Some(ns) = Netns::make() else { return };
    let dir = shared_dir("nested");
    let d = dir.to_str().unwrap().to_string();
    let mut owner = pod(&ns, &ns.a, &ns.dev_a, &d);
    let env_b = [
        ("UCX_TLS", tcp_tls()),
        ("UCX_NET_DEVICES", ns.dev_b.as_str()),
        ("NIXL_CONNECT_SOCKET_DIR", d.as_str()),
    ];
    let mut writer = Peer::from_command(ns.command_for(&ns.b, PEER, &env_b));
    let how = write_checked(&mut owner, &mut writer, 3 << 20, "vec", "local", &mut |_| {});
    assert_eq!(how, "pipes");
    // The other way, the writer reads the owner's memory by cross-memory attach (it sees it).
    owner.say(&format!("expose readable {} hostpat", 3 << 20));
    let md = owner.expect("MD:");
    writer.say("read local fresh");
    writer.say(&md);
    writer.expect("STARTED");
    let got = writer.expect("READ:");
    assert!(
        got.starts_with("ok") && got.contains("mechanism=cma ") && got.ends_with("pattern=true"),
        "{got}"
    );
    drop((owner, writer, ns));
    std::fs::remove_dir_all(&dir).unwrap();
}
