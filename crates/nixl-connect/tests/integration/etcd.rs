//! The etcd channel against a real `etcd` (Debian's `etcd-server`, installed by
//! `bash scripts/setup.sh --etcd`), started here on free loopback ports with its own data folder:
//! publish and fetch, a fetch that waits for a later publication, a taken name, a killed
//! publisher's key removed by its lease, etcd frozen or gone (typed errors within the deadline,
//! nothing left half-written), and three "hosts" (network namespaces: etcd in one, a worker in
//! each of the others) that find each other through it and move data over NIXL.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nixl_connect::channel::etcd::{EtcdChannel, LEASE_TTL};
use nixl_connect::{Connector, Descriptor, Error, RdmaMetadata};

use super::local::Netns;
use super::support::{free_port, pattern, runtime, tcp_tls, Peer, PEER_ENV};

const T: Duration = Duration::from_secs(10);
const LEN: usize = 1 << 20;

/// A real etcd on `client`/`peer` addresses, with a fresh data folder; killed on drop.
struct Etcd {
    child: Child,
    endpoint: String,
    dir: std::path::PathBuf,
    /// What started it (for a restart on the same addresses).
    prefix: Vec<String>,
    ip: String,
    ports: (u16, u16),
}

impl Etcd {
    /// Starts etcd listening on `ip` (through `prefix`, e.g. `ip netns exec NS`), and waits
    /// until it accepts connections (probed from `probe`, or here).
    fn start_with(prefix: &[&str], ip: &str, probe: bool) -> Self {
        let (cp, pp) = (free_port(), free_port());
        let dir = std::env::temp_dir().join(format!("nxc-etcd-{}-{cp}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        Self::spawn(prefix, ip, (cp, pp), dir, probe)
    }

    /// Kills etcd and starts it again on the same addresses, with its data (`keep_data`: as a
    /// restarted pod with a volume) or without (as a pod whose data was on its own disk).
    fn restart(&mut self, keep_data: bool) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if !keep_data {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
        let prefix: Vec<&str> = self.prefix.iter().map(String::as_str).collect();
        let again = Self::spawn(&prefix, &self.ip, self.ports, self.dir.clone(), true);
        let old = std::mem::replace(self, again);
        // The old value's process is already reaped; its folder is the new one's.
        std::mem::forget(old);
    }

    fn spawn(prefix: &[&str], ip: &str, (cp, pp): (u16, u16), dir: std::path::PathBuf, probe: bool) -> Self {
        let client = format!("http://{ip}:{cp}");
        let peer = format!("http://{ip}:{pp}");
        let mut cmd = match prefix.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg("etcd");
                c
            }
            None => Command::new("etcd"),
        };
        cmd.args(["--name", "nxc", "--data-dir"])
            .arg(&dir)
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
            .args(["--initial-cluster", &format!("nxc={peer}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("etcd is not installed ({e}): run `bash scripts/setup.sh --etcd`"));
        let mut e = Etcd {
            child,
            endpoint: client,
            dir,
            prefix: prefix.iter().map(|s| s.to_string()).collect(),
            ip: ip.to_string(),
            ports: (cp, pp),
        };
        if probe {
            let addr: SocketAddr = format!("{ip}:{cp}").parse().unwrap();
            let t0 = Instant::now();
            while std::net::TcpStream::connect(addr).is_err() {
                if let Ok(Some(st)) = e.child.try_wait() {
                    panic!("etcd exited at start: {st}");
                }
                assert!(t0.elapsed() < T, "etcd did not start");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        e
    }

    fn start() -> Self {
        Self::start_with(&[], "127.0.0.1", true)
    }

    fn signal(&self, sig: i32) {
        crate::stop::signal(self.child.id(), sig);
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

async fn readable(c: &Connector) -> nixl_connect::ReadableOperation<'static> {
    c.create_readable(Descriptor::from(pattern(LEN, 7)))
        .await
        .unwrap()
}

async fn read_and_check(c: &Connector, md: &RdmaMetadata) {
    let op = c.begin_read(md, Descriptor::from(vec![0u8; LEN])).await.unwrap();
    op.wait_for_completion(Some(T)).await.unwrap();
    assert!(op.results()[0].as_slice().unwrap() == pattern(LEN, 7));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_publish_fetch_read_and_unpublish() {
    let etcd = Etcd::start();
    let (a, b) = (Connector::new().unwrap(), Connector::new().unwrap());
    let publisher = EtcdChannel::connect(&[&etcd.endpoint], T).await.unwrap();
    let fetcher = EtcdChannel::connect(&[&etcd.endpoint], T).await.unwrap();
    let r = readable(&a).await;
    let publication = publisher.publish(r.metadata()).await.unwrap();
    assert!(
        publication.key().starts_with("nixl-connect/md/"),
        "{publication:?}"
    );
    let md = fetcher.fetch(publication.key(), T).await.unwrap();
    assert_eq!(&md, r.metadata());
    read_and_check(&b, &md).await;
    r.wait_for_completion(Some(T)).await.unwrap();
    let key = publication.key().to_string();
    publication.unpublish().await.unwrap();
    let t0 = Instant::now();
    let e = fetcher.fetch(&key, Duration::from_millis(500)).await.unwrap_err();
    assert!(matches!(e, Error::NotPublished { .. }), "{e}");
    assert!(
        t0.elapsed() < Duration::from_secs(3),
        "{e} after {:?}",
        t0.elapsed()
    );
    // Dropping a publication revokes it too (from a task: within moments, not the TTL).
    let p = publisher.publish(r.metadata()).await.unwrap();
    let key = p.key().to_string();
    drop(p);
    let t0 = Instant::now();
    while fetcher.fetch(&key, Duration::from_millis(200)).await.is_ok() {
        assert!(
            t0.elapsed() < LEASE_TTL / 2,
            "a dropped publication stays published"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_fetch_waits_for_a_later_publication_and_names_are_not_overwritten() {
    let etcd = Etcd::start();
    let a = Connector::new().unwrap();
    let ch = EtcdChannel::connect(&[&etcd.endpoint], T)
        .await
        .unwrap()
        .with_prefix("dynamo/nixl-connect/test/");
    let r = readable(&a).await;
    let waiter = {
        let ch = ch.clone();
        tokio::spawn(async move { ch.fetch("dynamo/nixl-connect/test/encoder-0", T).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let p = ch.publish_as("encoder-0", r.metadata()).await.unwrap();
    assert_eq!(p.key(), "dynamo/nixl-connect/test/encoder-0");
    assert_eq!(&waiter.await.unwrap().unwrap(), r.metadata());
    // The name is taken: a second publication is refused and leaves the first one as it was.
    let other = readable(&a).await;
    let e = ch.publish_as("encoder-0", other.metadata()).await.unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument(ref m) if m.contains("already published")),
        "{e}"
    );
    assert_eq!(&ch.fetch(p.key(), T).await.unwrap(), r.metadata());
    // A document that is not metadata is a typed error, not a panic or a hang.
    let e = ch
        .fetch("dynamo/nixl-connect/test/missing", Duration::from_millis(300))
        .await;
    assert!(matches!(e, Err(Error::NotPublished { .. })), "{e:?}");
}

/// A publisher killed with SIGKILL renews nothing: etcd removes its key when the lease runs out.
#[test]
fn etcd_killed_publisher_key_expires_with_its_lease() {
    let etcd = Etcd::start();
    let mut publisher = Peer::spawn(
        "etcd::support_publisher",
        "publisher",
        &[("NXC_ETCD", etcd.endpoint.as_str()), ("NXC_ETCD_NAME", "killed")],
    );
    let key = publisher.expect("KEY:");
    runtime().block_on(async {
        let ch = EtcdChannel::connect(&[&etcd.endpoint], T).await.unwrap();
        ch.fetch(&key, T).await.unwrap();
        publisher.signal(libc::SIGKILL);
        let _ = publisher.child.wait();
        let t0 = Instant::now();
        // Still there until the lease runs out, then gone. A probe etcd is slow to answer (it
        // syncs its log as the lease ends; CI saw one take over 200 ms) is asked again.
        loop {
            match ch.fetch(&key, Duration::from_millis(200)).await {
                Ok(_) | Err(Error::TimedOut { .. }) => assert!(
                    t0.elapsed() < LEASE_TTL + Duration::from_secs(5),
                    "the key outlived its lease"
                ),
                Err(Error::NotPublished { .. }) => break,
                Err(e) => panic!("{e}"),
            }
        }
        println!("a killed publisher's key went after {:?}", t0.elapsed());
        assert!(
            t0.elapsed() > Duration::from_secs(1),
            "gone only when the lease ran out"
        );
    });
}

/// etcd killed and started again under a running publication and a reader's channel, with its
/// data kept (a pod restarted with its volume): the publisher's lease renewals resume on a new
/// stream, so the key outlives several lease periods after the restart, and the reader, on the
/// connection it had, resolves it again. Without its data (a fresh etcd): the publisher grants a
/// new lease and puts the key again, and says so (`EtcdPublication::outages`: the gap and its
/// cause).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_restarted_server_publications_resolve_again() {
    let mut etcd = Etcd::start();
    let a = Connector::new().unwrap();
    let b = Connector::new().unwrap();
    let publisher = EtcdChannel::connect(&[&etcd.endpoint], T).await.unwrap();
    let reader = EtcdChannel::connect(&[&etcd.endpoint], T).await.unwrap();
    let r = readable(&a).await;
    let publication = publisher.publish(r.metadata()).await.unwrap();
    let key = publication.key().to_string();
    reader.fetch(&key, T).await.unwrap();
    for keep_data in [true, false] {
        etcd.restart(keep_data);
        let t0 = Instant::now();
        // Resolvable again within a lease period, and still so after two more.
        let md = loop {
            match reader.fetch(&key, Duration::from_secs(1)).await {
                Ok(md) => break md,
                Err(e) => assert!(
                    t0.elapsed() < LEASE_TTL + T,
                    "keep_data {keep_data}: not resolvable {:?} after the restart: {e}",
                    t0.elapsed()
                ),
            }
        };
        println!("keep_data {keep_data}: resolvable again after {:?}", t0.elapsed());
        assert_eq!(&md, r.metadata());
        tokio::time::sleep(LEASE_TTL * 2).await;
        let md = reader.fetch(&key, T).await.unwrap_or_else(|e| {
            panic!("keep_data {keep_data}: gone two lease periods after the restart: {e}")
        });
        assert_eq!(&md, r.metadata());
        let outages = publication.outages();
        println!("keep_data {keep_data}: outages {outages:?}");
        if !keep_data {
            let last = outages.last().expect("a re-publication is reported");
            assert!(last.republished, "{last:?}");
            assert!(!last.cause.is_empty() && last.lasted < LEASE_TTL + T, "{last:?}");
        }
    }
    read_and_check(&b, &reader.fetch(&key, T).await.unwrap()).await;
    r.wait_for_completion(Some(T)).await.unwrap();
}

/// etcd frozen (SIGSTOP) or gone: each call is a typed error within its deadline, and a
/// publication that failed leaves nothing behind once etcd answers again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_frozen_or_gone_is_a_typed_error_within_the_deadline() {
    let etcd = Etcd::start();
    let a = Connector::new().unwrap();
    let short = Duration::from_secs(2);
    let ch = EtcdChannel::connect(&[&etcd.endpoint], short).await.unwrap();
    let r = readable(&a).await;
    etcd.signal(libc::SIGSTOP);
    let t0 = Instant::now();
    let e = ch.publish_as("frozen", r.metadata()).await.unwrap_err();
    assert!(matches!(e, Error::TimedOut { .. } | Error::Channel(_)), "{e}");
    assert!(t0.elapsed() < 3 * short, "{e} after {:?}", t0.elapsed());
    let t0 = Instant::now();
    let e = ch.fetch("nixl-connect/md/frozen", short).await.unwrap_err();
    assert!(matches!(e, Error::TimedOut { .. } | Error::Channel(_)), "{e}");
    assert!(t0.elapsed() < 3 * short, "{e} after {:?}", t0.elapsed());
    etcd.signal(libc::SIGCONT);
    // Whatever of the failed publication reached etcd late is revoked (or expires): never a
    // published key nobody keeps.
    let t0 = Instant::now();
    loop {
        match ch
            .fetch("nixl-connect/md/frozen", Duration::from_millis(200))
            .await
        {
            Err(Error::NotPublished { .. }) if t0.elapsed() > Duration::from_secs(1) => break,
            // etcd, just resumed, may take more than a probe's 200 ms to answer: asked again.
            Err(Error::NotPublished { .. } | Error::TimedOut { .. }) | Ok(_) => {}
            Err(e) => panic!("{e}"),
        }
        assert!(
            t0.elapsed() < LEASE_TTL + Duration::from_secs(5),
            "left half-published"
        );
    }
    drop(etcd);
    let t0 = Instant::now();
    let e = ch.fetch("nixl-connect/md/any", short).await.unwrap_err();
    assert!(t0.elapsed() < 3 * short, "{e} after {:?}", t0.elapsed());
    let e2 = EtcdChannel::connect(&["127.0.0.1:1"], short).await.unwrap_err();
    assert!(matches!(e2, Error::TimedOut { .. } | Error::Channel(_)), "{e2}");
    println!("etcd gone: {e}; nothing listening: {e2}");
}

/// Three "hosts": etcd in one network namespace, a worker in each of two others. The publisher
/// finds etcd by address only; the reader finds the publisher's metadata through etcd, by name,
/// and reads over NIXL (TCP) across the namespaces.
#[test]
fn etcd_three_hosts_find_each_other_and_move_data() {
    let Some(ns) = Netns::make() else { return };
    let Some(e_ns) = EtcdHost::make(&ns) else { return };
    let etcd = Etcd::start_with(&["ip", "netns", "exec", &e_ns.name], &e_ns.ip, false);
    let endpoint = etcd.endpoint.clone();
    let env_a = [
        ("UCX_TLS", tcp_tls()),
        ("UCX_NET_DEVICES", ns.dev_a.as_str()),
        ("NXC_ETCD", endpoint.as_str()),
        ("NXC_ETCD_NAME", "three-hosts"),
    ];
    let mut a = Peer::from_command(ns.command_for(&ns.a, "etcd::support_publisher", &env_a));
    let key = a.expect("KEY:");
    let env_b = [
        ("UCX_TLS", tcp_tls()),
        ("UCX_NET_DEVICES", ns.dev_b.as_str()),
        ("NXC_ETCD", endpoint.as_str()),
        ("NXC_ETCD_KEY", key.as_str()),
    ];
    let mut b = Peer::from_command(ns.command_for(&ns.b, "etcd::support_reader", &env_b));
    let got = b.expect("READ:");
    assert!(got.starts_with("ok") && got.contains("path=nixl"), "{got}");
    assert_eq!(a.expect("DONE:"), "ok");
    println!("three hosts: etcd at {endpoint}, {key} read across namespaces: {got}");
}

/// A third namespace holding etcd, joined to the two of [`Netns`] by a veth pair each.
struct EtcdHost {
    name: String,
    ip: String,
}

impl EtcdHost {
    fn make(ns: &Netns) -> Option<Self> {
        let id = std::process::id() % 100_000;
        let e = EtcdHost {
            name: format!("nxc-e-{id}"),
            ip: format!("10.252.{}.1", id % 250),
        };
        let (ea, ae, eb, be) = (
            format!("nxea{id}"),
            format!("nxae{id}"),
            format!("nxeb{id}"),
            format!("nxbe{id}"),
        );
        let ip_a = format!("10.252.{}.2", id % 250);
        let ip_b = format!("10.252.{}.6", id % 250);
        let ip_eb = format!("10.252.{}.5", id % 250);
        let steps = [
            format!("netns add {}", e.name),
            format!("-n {} link set lo up", e.name),
            // etcd <-> worker a: 10.252.x.0/30
            format!("link add {ea} type veth peer name {ae}"),
            format!("link set {ea} netns {}", e.name),
            format!("link set {ae} netns {}", ns.a),
            format!("-n {} addr add {}/30 dev {ea}", e.name, e.ip),
            format!("-n {} addr add {ip_a}/30 dev {ae}", ns.a),
            format!("-n {} link set {ea} up", e.name),
            format!("-n {} link set {ae} up", ns.a),
            // etcd <-> worker b: 10.252.x.4/30 (etcd listens on both of its addresses' host: a
            // route in b to etcd's first address through etcd's second)
            format!("link add {eb} type veth peer name {be}"),
            format!("link set {eb} netns {}", e.name),
            format!("link set {be} netns {}", ns.b),
            format!("-n {} addr add {ip_eb}/30 dev {eb}", e.name),
            format!("-n {} addr add {ip_b}/30 dev {be}", ns.b),
            format!("-n {} link set {eb} up", e.name),
            format!("-n {} link set {be} up", ns.b),
            format!("-n {} route add {}/32 via {ip_eb}", ns.b, e.ip),
        ];
        for s in &steps {
            let args: Vec<&str> = s.split_whitespace().collect();
            if let Err(err) = Netns::ip(&args) {
                println!("skipped: cannot make the etcd namespace ({err})");
                let _ = Netns::ip(&["netns", "del", &e.name]);
                return None;
            }
        }
        Some(e)
    }
}

impl Drop for EtcdHost {
    fn drop(&mut self) {
        let _ = Netns::ip(&["netns", "del", &self.name]);
    }
}

/// Publishes a readable of [`LEN`] pattern bytes through etcd (`NXC_ETCD`, name `NXC_ETCD_NAME`),
/// prints `KEY:<key>`, then `DONE:ok` once it has been read (or `DONE:err ...`).
#[test]
#[ignore = "run by the etcd tests as their publisher"]
fn support_publisher() {
    let Ok(_) = std::env::var(PEER_ENV) else { return };
    let endpoint = std::env::var("NXC_ETCD").unwrap();
    let name = std::env::var("NXC_ETCD_NAME").unwrap();
    runtime().block_on(async {
        let c = Connector::new().unwrap();
        let ch = EtcdChannel::connect(&[&endpoint], T).await.unwrap();
        let r = readable(&c).await;
        let p = ch.publish_as(&name, r.metadata()).await.unwrap();
        println!("KEY:{}", p.key());
        use std::io::Write;
        std::io::stdout().flush().unwrap();
        let done = r.wait_for_completion(Some(Duration::from_secs(60))).await;
        println!(
            "DONE:{}",
            done.map_or_else(|e| format!("err {e}"), |()| "ok".into())
        );
        std::io::stdout().flush().unwrap();
        drop(p);
        // Stay until the test ends (or kills this process): the publication's lease is what a
        // killed publisher leaves behind.
        tokio::time::sleep(Duration::from_secs(60)).await;
    });
}

/// Fetches `NXC_ETCD_KEY` through etcd (`NXC_ETCD`), waiting for it, reads it and checks the
/// bytes: `READ:ok path=<path>` or `READ:err ...`.
#[test]
#[ignore = "run by the etcd tests as their reader"]
fn support_reader() {
    let Ok(_) = std::env::var(PEER_ENV) else { return };
    let endpoint = std::env::var("NXC_ETCD").unwrap();
    let key = std::env::var("NXC_ETCD_KEY").unwrap();
    runtime().block_on(async {
        let c = Connector::new().unwrap();
        let r = async {
            let ch = EtcdChannel::connect(&[&endpoint], T).await?;
            let md = ch.fetch(&key, T).await?;
            let op = c.begin_read(&md, Descriptor::from(vec![0u8; LEN])).await?;
            op.wait_for_completion(Some(T)).await?;
            let ok = op.results()[0].as_slice().unwrap() == pattern(LEN, 7);
            Ok::<_, Error>((ok, op.path().map_or("?".into(), |p| p.to_string())))
        }
        .await;
        match r {
            Ok((true, path)) => println!("READ:ok path={path}"),
            Ok((false, path)) => println!("READ:err the bytes differ (path={path})"),
            Err(e) => println!("READ:err {e}"),
        }
    });
}
