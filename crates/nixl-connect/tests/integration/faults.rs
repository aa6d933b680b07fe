//! Faults survived (issue 43): NIXL over TCP between two network namespaces ("hosts") whose link
//! is taken down in the middle of a transfer. The operation ends typed within its deadline, and
//! once the link is back the next operation on the same connector works, byte-exact, with no
//! restart. (This kernel has no `sch_netem`, so loss and delay are not emulated here: the link is
//! rate-limited with `tbf`, so that a 256 MiB read is certainly in flight when the link goes
//! down, and flapped.)

use std::time::{Duration, Instant};

use super::local::Netns;
use super::soundness::PEER;
use super::support::{tcp_tls, Peer};

/// Runs `tc` in namespace `ns`.
fn tc(ns: &str, args: &[&str]) {
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", ns, "tc"])
        .args(args)
        .output()
        .expect("tc (iproute2)");
    assert!(
        out.status.success(),
        "tc {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The link between the namespaces limited to 1 Gbit/s each way (a 1 GiB read takes about 9 s),
/// an owner in `b` and a reader in `a` (soundness peers), NIXL over TCP on that link.
fn linked_peers(ns: &Netns) -> (Peer, Peer) {
    for (n, dev) in [(&ns.a, &ns.dev_a), (&ns.b, &ns.dev_b)] {
        tc(
            n,
            &[
                "qdisc", "add", "dev", dev, "root", "tbf", "rate", "1gbit", "burst", "1mb", "latency", "50ms",
            ],
        );
    }
    let env_a = [("UCX_TLS", tcp_tls()), ("UCX_NET_DEVICES", ns.dev_a.as_str())];
    let env_b = [("UCX_TLS", tcp_tls()), ("UCX_NET_DEVICES", ns.dev_b.as_str())];
    let owner = Peer::from_command(ns.command_for(&ns.b, PEER, &env_b));
    let reader = Peer::from_command(ns.command_for(&ns.a, PEER, &env_a));
    (owner, reader)
}

#[test]
fn faults_link_down_mid_transfer_ends_typed_and_the_next_read_works() {
    let Some(ns) = Netns::make() else { return };
    let (mut owner, mut reader) = linked_peers(&ns);
    // 256 MiB: about 2.2 s at the link's rate, well inside the reader's deadline (6 s), so only
    // the link going down can end the read with an error.
    owner.say("expose readable 268435456 hostpat");
    let md = owner.expect("MD:");
    reader.say("deadline 6000");
    reader.expect("DEADLINE");
    reader.say("read nixl");
    reader.say(&md);
    assert_eq!(reader.expect("STARTED"), "");
    std::thread::sleep(Duration::from_millis(500));
    Netns::ip(&["-n", &ns.a, "link", "set", &ns.dev_a, "down"]).unwrap();
    let t0 = Instant::now();
    // The peer's wait is bounded at 6 s: the read must end by then, typed, not hang.
    let read = reader.expect("READ:");
    let took = t0.elapsed();
    println!("link down {took:?} into the read: {read}");
    assert!(
        read.starts_with("err "),
        "the read completed with the link down: {read}"
    );
    assert!(took < Duration::from_secs(10), "ended after {took:?}");
    // The link comes back; the owner exposes again; the same reader (its connector kept) reads.
    Netns::ip(&["-n", &ns.a, "link", "set", &ns.dev_a, "up"]).unwrap();
    reader.say("deadline 20000");
    reader.expect("DEADLINE");
    owner.say("drop");
    owner.expect("DROPPED");
    owner.say("expose readable 8388608 hostpat");
    let md = owner.expect("MD:");
    let t1 = Instant::now();
    reader.say("read nixl");
    reader.say(&md);
    reader.expect("STARTED");
    let read = reader.expect("READ:");
    println!("after the link came back ({:?}): {read}", t1.elapsed());
    assert!(read.starts_with("ok ") && read.contains("pattern=true"), "{read}");
    owner.finish();
    reader.finish();
}

#[test]
fn faults_link_flap_mid_transfer_completes_byte_exact() {
    let Some(ns) = Netns::make() else { return };
    let (mut owner, mut reader) = linked_peers(&ns);
    // 256 MiB: about 2.2 s at the link's rate, with 1 s of it down (TCP retransmits meanwhile).
    owner.say("expose readable 268435456 hostpat");
    let md = owner.expect("MD:");
    reader.say("read nixl");
    reader.say(&md);
    reader.expect("STARTED");
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_millis(500));
    Netns::ip(&["-n", &ns.a, "link", "set", &ns.dev_a, "down"]).unwrap();
    std::thread::sleep(Duration::from_secs(1));
    Netns::ip(&["-n", &ns.a, "link", "set", &ns.dev_a, "up"]).unwrap();
    let read = reader.expect("READ:");
    println!("a 1 s flap in a 256 MiB read: {read} after {:?}", t0.elapsed());
    assert!(read.starts_with("ok ") && read.contains("pattern=true"), "{read}");
    owner.say("wait 5000");
    assert_eq!(owner.expect("WAIT:"), "ok");
    owner.finish();
    reader.finish();
}
