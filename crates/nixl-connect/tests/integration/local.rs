//! The same-host path: negotiation and fallback, access scoped to one live operation, peers dying
//! mid-copy, and two "hosts" (network namespaces) that must stay on NIXL.

use std::process::Command;
use std::time::{Duration, Instant};

use nixl_connect::{
    Connector, Descriptor, Error, HostBuffer, OperationStatus, PathPolicy, RdmaMetadata, TransferPath,
};

use super::soundness::{sound_peer, PEER};
use super::support::{all_bytes, run_support, runtime, tcp_tls, Peer, T};

const MIB: usize = 1 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_negotiation_declined_falls_back_to_nixl() {
    // A peer that does not listen (NIXL only, like a Python worker): the reader falls back to
    // NIXL by itself, and the data arrives.
    let owner = Connector::builder().path(PathPolicy::Nixl).build().unwrap();
    let reader = Connector::new().unwrap();
    let src = HostBuffer::from_slice(&[9u8; 8192]).unwrap();
    let r = owner.create_readable(Descriptor::from(&src)).await.unwrap();
    let op = reader
        .begin_read(r.metadata(), Descriptor::from(vec![0u8; 8192]))
        .await
        .unwrap();
    op.wait_for_completion(T).await.unwrap();
    r.wait_for_completion(T).await.unwrap();
    assert_eq!(op.path(), Some(TransferPath::Nixl));
    let reason = op
        .path_reason()
        .expect("the same-host path declined: why")
        .to_owned();
    println!("local_negotiation_declined_falls_back_to_nixl: path_reason: {reason}");
    let back = op.into_descriptors().unwrap();
    assert!(all_bytes(back[0].as_slice().unwrap(), 9));
    // With the same-host path required, the same peer is an error that says why.
    let strict = Connector::builder().path(PathPolicy::SameHost).build().unwrap();
    let r = owner.create_readable(Descriptor::from(&src)).await.unwrap();
    let op = strict
        .begin_read(r.metadata(), Descriptor::from(vec![0u8; 8192]))
        .await
        .unwrap();
    let e = op.wait_for_completion(T).await.unwrap_err();
    assert!(matches!(e, Error::PathUnavailable { .. }), "{e}");
    // And a listening peer is read over the same-host path.
    let owner = Connector::new().unwrap();
    let r = owner.create_readable(Descriptor::from(&src)).await.unwrap();
    let op = reader
        .begin_read(r.metadata(), Descriptor::from(vec![0u8; 8192]))
        .await
        .unwrap();
    op.wait_for_completion(T).await.unwrap();
    assert_eq!(op.path(), Some(TransferPath::SameHost));
    assert!(reader.stats().await.unwrap().local_transfers >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_wrong_direction_is_refused() {
    let owner = Connector::new().unwrap();
    let peer = Connector::new().unwrap();
    let mut dst = HostBuffer::new(4096).unwrap();
    let w = owner.create_writable(Descriptor::from(&mut dst)).await.unwrap();
    // A writable's metadata relabelled as a readable's: the local checks pass, the owner refuses.
    let mut md = w.metadata().clone();
    md.operation_kind = 1;
    let op = peer
        .begin_read(&md, Descriptor::from(vec![0u8; 4096]))
        .await
        .unwrap();
    let e = op.wait_for_completion(T).await.unwrap_err();
    assert!(
        matches!(&e, Error::Refused { refusal: nixl_connect::Refusal::WrongDirection, reason, .. } if reason.contains("writable")),
        "{e}"
    );
    assert_eq!(
        w.status(),
        OperationStatus::Initialized,
        "the writable is untouched"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_device_claim_for_host_memory_fails_cleanly() {
    // Metadata claiming that a host readable's memory is on cuda:0: no same-host grant is given
    // for memory the operation does not hold as claimed (here no CUDA either), the read ends with
    // a typed error within its deadline, and the readable is untouched and still readable.
    let owner = Connector::new().unwrap();
    let peer = Connector::new().unwrap();
    let src = HostBuffer::from_slice(&[5u8; 4096]).unwrap();
    let r = owner.create_readable(Descriptor::from(&src)).await.unwrap();
    let mut md = r.metadata().clone();
    md.descriptors[0].device = nixl_connect::Device::Cuda(0);
    let t0 = Instant::now();
    let e = match peer.begin_read(&md, Descriptor::from(vec![0u8; 4096])).await {
        Ok(op) => op.wait_for_completion(T).await.unwrap_err(),
        Err(e) => e,
    };
    assert!(t0.elapsed() < Duration::from_secs(30), "took {:?}", t0.elapsed());
    assert!(!matches!(e, Error::TimedOut { .. }), "{e}");
    assert_eq!(r.status(), OperationStatus::Initialized, "{e}");
    let op = peer
        .begin_read(r.metadata(), Descriptor::from(vec![0u8; 4096]))
        .await
        .unwrap();
    op.wait_for_completion(T).await.unwrap();
    r.wait_for_completion(T).await.unwrap();
}

#[test]
fn local_same_host_path_names_what_takes_nixl() {
    use nixl_connect::{same_host_path, Device};
    assert_eq!(same_host_path(Device::Host, Device::Host), Ok(()));
    // Without the `cuda` feature host memory into device memory takes NIXL; with it, the device
    // memory's owner pulls it through pinned staging when it has a GPU (in the loop below).
    #[cfg(not(feature = "cuda"))]
    {
        let why = same_host_path(Device::Host, Device::Cuda(0)).unwrap_err();
        assert_eq!(why, nixl_connect::PathRefusal::HostIntoDevice);
        assert!(why.message().contains("host memory into device memory"), "{why}");
    }
    for (src, dst) in [
        (Device::Cuda(0), Device::Cuda(0)),
        (Device::Cuda(0), Device::Host),
        #[cfg(feature = "cuda")]
        (Device::Host, Device::Cuda(0)),
    ] {
        let r = same_host_path(src, dst);
        #[cfg(feature = "cuda")]
        if nixl_connect::cuda::device_count().is_ok_and(|n| n > 0) {
            assert_eq!(r, Ok(()), "{src}->{dst}");
            continue;
        }
        let why = r.unwrap_err();
        assert!(why.message().contains("CUDA"), "{src}->{dst}: {why}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_many_descriptors_and_concurrent_operations() {
    let owner = Connector::new().unwrap();
    let reader = Connector::new().unwrap();
    // 10,000 descriptors of 4 KiB in one operation.
    let n = 10_000;
    let src = HostBuffer::from_slice(&(0..n * 4096).map(|i| (i / 4096) as u8).collect::<Vec<_>>()).unwrap();
    let descs: Vec<Descriptor<'_>> = src.chunks(4096).map(Descriptor::from).collect();
    let r = owner.create_readable(descs).await.unwrap();
    let mut dst = vec![0u8; n * 4096];
    let locals: Vec<Descriptor<'_>> = dst.chunks_mut(4096).map(Descriptor::from).collect();
    let op = reader.begin_read(r.metadata(), locals).await.unwrap();
    op.wait_for_completion(T).await.unwrap();
    assert_eq!(op.path(), Some(TransferPath::SameHost));
    drop(op);
    assert!(dst[..] == src[..]);
    // 1,000 concurrent operations with a fresh buffer each: none lost, none duplicated.
    let mut readables = Vec::new();
    for i in 0..1000u32 {
        let r = owner
            .create_readable(Descriptor::from(i.to_le_bytes().repeat(1024)))
            .await
            .unwrap();
        readables.push(r);
    }
    let mut ops = Vec::new();
    for r in &readables {
        ops.push(
            reader
                .begin_read(r.metadata(), Descriptor::from(vec![0u8; 4096]))
                .await
                .unwrap(),
        );
    }
    for (i, op) in ops.into_iter().enumerate() {
        op.wait_for_completion(T).await.unwrap();
        let got = op.into_descriptors().unwrap();
        assert_eq!(&got[0].as_slice().unwrap()[..4], &(i as u32).to_le_bytes());
    }
    for r in &readables {
        r.wait_for_completion(T).await.unwrap();
    }
}

/// Runs a sound peer as another user (uid 65534), NIXL over TCP.
fn foreign_peer() -> Option<Peer> {
    use std::os::unix::process::CommandExt;
    // SAFETY: getuid cannot fail.
    #[allow(unsafe_code)]
    if unsafe { libc::getuid() } != 0 {
        println!("local_uid_mismatch_is_refused: skipped: not root, cannot run a peer as another user");
        return None;
    }
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([PEER, "--exact", "--ignored", "--nocapture", "--test-threads=1"])
        .env(super::support::PEER_ENV, "peer")
        .env("UCX_TLS", tcp_tls())
        .env("HOME", std::env::temp_dir())
        .current_dir(std::env::temp_dir())
        .uid(65534)
        .gid(65534);
    Some(Peer::from_command(cmd))
}

#[test]
fn local_uid_mismatch_is_refused() {
    let text = run_support("local::support_uid_mismatch", &[("UCX_TLS", tcp_tls().as_ref())]);
    assert!(text.contains("UID-OK") || text.contains("skipped:"), "{text}");
}

#[test]
#[ignore = "run by local_uid_mismatch_is_refused with UCX_TLS=tcp"]
fn support_uid_mismatch() {
    let Ok(_) = std::env::var(super::support::PEER_ENV) else {
        return;
    };
    let Some(mut peer) = foreign_peer() else { return };
    runtime().block_on(async {
        // The peer (another user) exposes; this process reads: the peer refuses the same-host
        // path, and NIXL (over TCP) takes the operation.
        // The reader is told why, once: in the operation's reason, and in one warning for this
        // peer (not repeated for its second operation).
        assert!(super::support::warnings().is_empty());
        let reader = Connector::new().unwrap();
        for k in 0..2 {
            peer.say("expose readable 4096 vec");
            let md: RdmaMetadata = peer.expect("MD:").parse().unwrap();
            // What `doctor --peer` says first: NIXL, the same-host path declining for the uid.
            let p = reader.probe(&md, nixl_connect::Device::Host).await.unwrap();
            assert_eq!(p.path(), Some(TransferPath::Nixl), "{p:?}");
            assert!(
                matches!(p.declined(), [(TransferPath::SameHost, why)] if why.contains("uid 65534")),
                "{p:?}"
            );
            let op = reader
                .begin_read(&md, Descriptor::from(vec![0u8; 4096]))
                .await
                .unwrap();
            op.wait_for_completion(T).await.unwrap();
            assert_eq!(
                op.path(),
                Some(TransferPath::Nixl),
                "another user's peer takes NIXL"
            );
            let reason = op.path_reason().expect("why the same-host path declined");
            println!("operation {k}: path_reason: {reason}");
            assert!(reason.contains("uid"), "{reason}");
        }
        let warned: Vec<_> = super::support::warnings()
            .into_iter()
            .filter(|w| w.contains("declined it"))
            .collect();
        println!("warnings for the peer: {warned:?}");
        assert_eq!(warned.len(), 1, "one warning for the peer: {warned:?}");
        assert!(
            warned[0].contains("uid") && warned[0].contains("to=nixl"),
            "{warned:?}"
        );
        // This process exposes; the other user reads: this side refuses it.
        let owner = Connector::new().unwrap();
        let r = owner
            .create_readable(Descriptor::from(vec![3u8; 4096]))
            .await
            .unwrap();
        peer.say("read auto");
        peer.say(&r.metadata().to_json());
        peer.expect("STARTED");
        let got = peer.expect("READ:");
        assert!(got.contains("path=nixl"), "{got}");
        assert!(owner.stats().await.unwrap().local_refused_peers >= 1);
        println!("UID-OK");
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_peer_killed_mid_copy_on_each_side() {
    let conn = Connector::new().unwrap();
    let deadline = Some(Duration::from_secs(5));
    // The reader (copying from this process) dies mid-copy: this side's readable stays intact
    // and live; another reader then reads it.
    let mut src = HostBuffer::new(256 * MIB).unwrap();
    src.fill(0x42);
    let mut killed_reader = 0;
    for _ in 0..3 {
        let r = conn.create_readable(Descriptor::from(&src)).await.unwrap();
        let mut peer = sound_peer();
        peer.say("read local");
        peer.say(&r.metadata().to_json());
        peer.expect("STARTED");
        peer.signal(libc::SIGKILL);
        let _ = peer.child.wait();
        if r.wait_for_completion(Some(Duration::from_millis(300)))
            .await
            .is_ok()
        {
            continue; // it finished first
        }
        killed_reader += 1;
        let other = Connector::new().unwrap();
        let op = other
            .begin_read(r.metadata(), Descriptor::from(vec![0u8; 256 * MIB]))
            .await
            .unwrap();
        op.wait_for_completion(deadline).await.unwrap();
        r.wait_for_completion(deadline).await.unwrap();
        break;
    }
    // The writer (this side copies from it) dies mid-copy: the writable fails as torn, in time.
    let mut torn = 0;
    for _ in 0..3 {
        let mut dst = HostBuffer::new(256 * MIB).unwrap();
        let w = conn.create_writable(Descriptor::from(&mut dst)).await.unwrap();
        let mut peer = sound_peer();
        peer.say("write local");
        peer.say(&w.metadata().to_json());
        peer.expect("STARTED");
        peer.signal(libc::SIGKILL);
        let _ = peer.child.wait();
        let t0 = Instant::now();
        match w.wait_for_completion(deadline).await {
            Ok(()) => continue,
            Err(e) => {
                assert!(
                    matches!(e, Error::RemoteGone { .. } | Error::TimedOut { .. }),
                    "a typed error: {e}"
                );
                assert!(t0.elapsed() < Duration::from_secs(6));
                println!("writer killed mid-copy: {e} after {:?}", t0.elapsed());
                torn += 1;
                break;
            }
        }
    }
    println!("readers killed mid-copy: {killed_reader}, writers: {torn}");
}

/// Two network namespaces joined by a veth pair: the same-host socket of one is invisible from
/// the other, so the operation takes NIXL over TCP between the two addresses.
#[test]
fn local_network_namespaces_take_nixl() {
    let Some(ns) = Netns::make() else { return };
    let env_a = [("UCX_TLS", tcp_tls()), ("UCX_NET_DEVICES", ns.dev_a.as_str())];
    let env_b = [("UCX_TLS", tcp_tls()), ("UCX_NET_DEVICES", ns.dev_b.as_str())];
    let mut a = Peer::from_command(ns.command(&ns.a, &env_a));
    let mut b = Peer::from_command(ns.command(&ns.b, &env_b));
    for (len, kind) in [(4096usize, "vec"), (64 * MIB, "host")] {
        a.say(&format!("expose readable {len} {kind}"));
        let md = a.expect("MD:");
        b.say("read auto");
        b.say(&md);
        b.expect("STARTED");
        let got = b.expect("READ:");
        assert!(
            got.starts_with("ok first=90") && got.contains("path=nixl"),
            "{len}: {got}"
        );
        a.say("wait 5000");
        assert_eq!(a.expect("WAIT:"), "ok");
        // A writable across the namespaces too.
        a.say(&format!("expose writable {len} {kind}"));
        let md = a.expect("MD:");
        b.say("write auto");
        b.say(&md);
        b.expect("STARTED");
        assert_eq!(b.expect("WRITE:"), "ok");
        a.say("wait 5000");
        assert_eq!(a.expect("WAIT:"), "ok");
    }
    println!(
        "local_network_namespaces_take_nixl: NIXL over TCP between {} and {}",
        ns.ip_a, ns.ip_b
    );
}

/// Two namespaces made for one test, removed when dropped. Their names come from this process's
/// id, so the tests that make them take turns (one `Netns` at a time in a process: tests running
/// in parallel used to collide on the names, and the second skipped without a word).
pub(crate) struct Netns {
    pub(crate) a: String,
    pub(crate) b: String,
    pub(crate) dev_a: String,
    pub(crate) dev_b: String,
    pub(crate) ip_a: String,
    pub(crate) ip_b: String,
    _turn: std::sync::MutexGuard<'static, ()>,
}

/// Whose turn it is to have namespaces.
static NETNS_TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());

impl Netns {
    pub(crate) fn ip(args: &[&str]) -> Result<(), String> {
        let out = Command::new("ip")
            .args(args)
            .output()
            .map_err(|e| format!("ip: {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "ip {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        }
    }

    /// Makes the namespaces (waiting for the test that has them now), or prints why it cannot
    /// and returns `None`: only where this process may not (not root); as root a failure is the
    /// test's.
    pub(crate) fn make() -> Option<Self> {
        let turn = NETNS_TURN.lock().unwrap_or_else(|e| e.into_inner());
        let id = std::process::id() % 100_000;
        let n = Netns {
            a: format!("nxc-a-{id}"),
            b: format!("nxc-b-{id}"),
            dev_a: format!("nxa{id}"),
            dev_b: format!("nxb{id}"),
            ip_a: format!("10.251.{}.1", id % 250),
            ip_b: format!("10.251.{}.2", id % 250),
            _turn: turn,
        };
        // One `ip` command a line (every name and address here is free of spaces).
        let steps = [
            format!("netns add {}", n.a),
            format!("netns add {}", n.b),
            format!("link add {} type veth peer name {}", n.dev_a, n.dev_b),
            format!("link set {} netns {}", n.dev_a, n.a),
            format!("link set {} netns {}", n.dev_b, n.b),
            format!("-n {} addr add {}/30 dev {}", n.a, n.ip_a, n.dev_a),
            format!("-n {} addr add {}/30 dev {}", n.b, n.ip_b, n.dev_b),
            format!("-n {} link set {} up", n.a, n.dev_a),
            format!("-n {} link set {} up", n.b, n.dev_b),
            format!("-n {} link set lo up", n.a),
            format!("-n {} link set lo up", n.b),
        ];
        for s in &steps {
            let args: Vec<&str> = s.split_whitespace().collect();
            if let Err(e) = Self::ip(&args) {
                // SAFETY: geteuid cannot fail.
                let euid = unsafe { libc::geteuid() };
                assert!(euid != 0, "cannot make network namespaces as root: {e}");
                println!("skipped: cannot make network namespaces ({e})");
                return None; // Drop removes what was made
            }
        }
        Some(n)
    }

    fn command(&self, ns: &str, env: &[(&str, &str)]) -> Command {
        self.command_for(ns, PEER, env)
    }

    /// The support test `test` run in namespace `ns` with `env`.
    pub(crate) fn command_for(&self, ns: &str, test: &str, env: &[(&str, &str)]) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", ns])
            .arg(std::env::current_exe().unwrap())
            .args([test, "--exact", "--ignored", "--nocapture", "--test-threads=1"])
            .env(super::support::PEER_ENV, "peer");
        for (k, v) in env {
            cmd.env(k, v);
        }
        cmd
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Self::ip(&["netns", "del", &self.a]);
        let _ = Self::ip(&["netns", "del", &self.b]);
    }
}
