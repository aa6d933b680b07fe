//! A peer that stalls the pages it hands out: a read from it blocks in the kernel for as long as
//! the peer wants (here a `userfaultfd` range nobody serves; a FUSE file or a hung NFS mount does
//! the same). The connector's engine must go on serving everything else meanwhile.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use nixl_connect::{
    Connector, Descriptor, Device, PathPolicy, RdmaMetadata, ReadOperation, ReadableOperation, TransferPath,
};

use super::local::Netns;
use super::soundness::{sound_peer, PEER};
use super::support::{all_bytes, pattern, runtime, tcp_tls, Peer, PEER_ENV, T};

// <linux/userfaultfd.h>: _IOWR(0xAA, 0x3F, struct uffdio_api) and _IOWR(0xAA, 0x00, struct
// uffdio_register).
const UFFD_API: u64 = 0xAA;
const UFFDIO_API: libc::c_ulong = 0xc018_aa3f;
const UFFDIO_REGISTER: libc::c_ulong = 0xc020_aa00;
const UFFDIO_REGISTER_MODE_MISSING: u64 = 1;

/// Anonymous memory whose pages never come: every access (this process's, or a peer's through
/// `process_vm_readv`) blocks until the `userfaultfd` is closed, then finds zero pages.
struct Stalled {
    ptr: *mut u8,
    len: usize,
    uffd: Option<OwnedFd>,
}

impl Stalled {
    fn new(len: usize) -> Self {
        // SAFETY: plain syscalls; each result is checked.
        unsafe {
            let fd = libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | libc::O_NONBLOCK);
            assert!(
                fd >= 0,
                "userfaultfd: {} (this test needs it: root, or vm.unprivileged_userfaultfd=1)",
                std::io::Error::last_os_error()
            );
            let uffd = OwnedFd::from_raw_fd(fd as i32);
            let mut api = [UFFD_API, 0, 0];
            assert_eq!(libc::ioctl(uffd.as_raw_fd(), UFFDIO_API, api.as_mut_ptr()), 0);
            let ptr = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            assert_ne!(ptr, libc::MAP_FAILED);
            let mut reg = [ptr as u64, len as u64, UFFDIO_REGISTER_MODE_MISSING, 0];
            assert_eq!(
                libc::ioctl(uffd.as_raw_fd(), UFFDIO_REGISTER, reg.as_mut_ptr()),
                0,
                "UFFDIO_REGISTER: {}",
                std::io::Error::last_os_error()
            );
            Self {
                ptr: ptr.cast(),
                len,
                uffd: Some(uffd),
            }
        }
    }

    /// Waits (up to `d`) until some access is blocked on a page of this memory.
    fn wait_for_a_stall(&self, d: Duration) -> bool {
        let fd = self.uffd.as_ref().expect("not released").as_raw_fd();
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd, valid for the call.
        unsafe { libc::poll(&mut p, 1, d.as_millis() as i32) == 1 }
    }

    /// Ends the stall: the blocked accesses go on and find zero pages.
    fn release(&mut self) {
        self.uffd = None;
    }
}

impl Drop for Stalled {
    fn drop(&mut self) {
        self.release();
        // SAFETY: the mapping made in `new`; every descriptor and operation over it is gone.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// `owner` exposes `s` (raw memory) and `reader` begins a read of it (into owned memory).
async fn read_stalled(
    owner: &Connector,
    reader: &Connector,
    s: &Stalled,
) -> (ReadableOperation<'static>, ReadOperation<'static>) {
    // SAFETY: the mapping lives until `s` drops, after every operation over it.
    let d = unsafe { Descriptor::from_raw_parts(s.ptr, s.len, Device::Host) };
    let bad = owner.create_readable(d).await.unwrap();
    let stuck = reader
        .begin_read(bad.metadata(), Descriptor::from(vec![1u8; s.len]))
        .await
        .unwrap();
    (bad, stuck)
}

#[test]
fn stall_of_a_peer_page_leaves_the_engine_serving_others() {
    runtime().block_on(async {
        let owner = Connector::new().unwrap();
        let reader = Connector::builder().path(PathPolicy::SameHost).build().unwrap();

        // A small read (the size once copied on the engine thread) from memory that stalls.
        let mut stalled = Stalled::new(64 << 10);
        let (bad, stuck) = read_stalled(&owner, &reader, &stalled).await;
        assert!(
            stalled.wait_for_a_stall(Duration::from_secs(10)),
            "the read never touched the stalled page"
        );

        // Meanwhile the reader's engine answers commands: it exposes memory and reports stats.
        let want = pattern(4096, 17);
        let served = tokio::time::timeout(Duration::from_secs(5), async {
            let r = reader.create_readable(Descriptor::from(want.clone())).await?;
            reader.stats().await?;
            Ok::<_, nixl_connect::Error>(r)
        })
        .await;

        // End the stall whatever happened, so the stuck copy finishes and the test can end.
        stalled.release();
        let got = stuck.wait_for_completion(T).await;
        let exposed = served
            .expect("the engine was blocked by the stalled page")
            .unwrap();
        // What it exposed meanwhile is served too.
        let op = owner
            .begin_read(exposed.metadata(), Descriptor::from(vec![0u8; 4096]))
            .await
            .unwrap();
        op.wait_for_completion(T).await.unwrap();
        assert_eq!(op.into_descriptors().unwrap()[0].as_slice().unwrap(), &want[..]);
        got.unwrap();
        assert_eq!(stuck.path(), Some(TransferPath::SameHost));
        let back = stuck.into_descriptors().unwrap();
        assert!(all_bytes(back[0].as_slice().unwrap(), 0));
        bad.wait_for_completion(T).await.unwrap();
        exposed.wait_for_completion(T).await.unwrap();
    });
}

#[test]
fn stall_of_one_peer_leaves_copies_from_others_running() {
    runtime().block_on(async {
        let owner = Connector::new().unwrap();
        let reader = Connector::builder().path(PathPolicy::SameHost).build().unwrap();

        // More stalled reads from one peer (this process) than the copy pool has threads.
        let mut stalled: Vec<Stalled> = (0..12).map(|_| Stalled::new(64 << 10)).collect();
        let mut bad = Vec::new();
        let mut stuck = Vec::new();
        for s in &stalled {
            let (r, op) = read_stalled(&owner, &reader, s).await;
            bad.push(r);
            stuck.push(op);
        }
        assert!(
            stalled[0].wait_for_a_stall(Duration::from_secs(10)),
            "the reads never touched the stalled pages"
        );

        // Another peer (a process of its own) is read meanwhile.
        let mut peer = sound_peer();
        peer.say("expose readable 4096 vec");
        let md = peer.expect("MD:");
        let md = RdmaMetadata::from_json(&md).unwrap();
        let served = tokio::time::timeout(Duration::from_secs(5), async {
            let op = reader.begin_read(&md, Descriptor::from(vec![0u8; 4096])).await?;
            op.wait_for_completion(T).await?;
            Ok::<_, nixl_connect::Error>(op)
        })
        .await;

        for s in &mut stalled {
            s.release();
        }
        for op in &stuck {
            op.wait_for_completion(T).await.unwrap();
        }
        let served = served
            .expect("copies from another peer waited behind the stalled ones")
            .unwrap();
        assert_eq!(served.path(), Some(TransferPath::SameHost));
        let back = served.into_descriptors().unwrap();
        assert!(all_bytes(back[0].as_slice().unwrap(), 0x5A));
        drop(stuck);
        for r in &bad {
            r.wait_for_completion(T).await.unwrap();
        }
        peer.finish();
    });
}

/// A reader whose same-host read of a stalled range hangs, its operation dropped: `end` ends the
/// reader (on a blocking thread) and must return within `bound`, or the test fails.
async fn end_stalled_reader(end: impl FnOnce(Connector) + Send + 'static, bound: Duration) {
    let owner = Connector::new().unwrap();
    let reader = Connector::builder().path(PathPolicy::SameHost).build().unwrap();
    let mut stalled = Stalled::new(64 << 10);
    let (bad, stuck) = read_stalled(&owner, &reader, &stalled).await;
    assert!(stalled.wait_for_a_stall(Duration::from_secs(10)));
    // The read's memory is owned: dropping it does not wait.
    drop(stuck);
    let t0 = Instant::now();
    let ended = tokio::time::timeout(bound, tokio::task::spawn_blocking(move || end(reader))).await;
    let took = t0.elapsed();
    stalled.release();
    ended
        .unwrap_or_else(|_| panic!("the reader's end waited past {bound:?} for the stalled copy ({took:?})"))
        .unwrap();
    drop(bad);
}

/// Dropping the connector waits a bounded time (`STOP_WAIT`, 10 s) for the stuck copy, then
/// leaks the memory that copy may still write.
#[test]
fn stall_never_holds_the_drop_of_a_connector() {
    runtime().block_on(end_stalled_reader(drop, Duration::from_secs(30)));
}

/// The end of a connector whose copy a peer stalls is bounded by the caller's deadline
/// (`shutdown_timeout`), not by the 10 s a plain drop waits: `read --timeout 5` against a stalled
/// owner exited after 15 s (found from outside on 2f059c9). The copy's memory is leaked instead.
#[test]
fn stall_shutdown_timeout_bounds_the_end_by_the_callers_deadline() {
    // Well under the 10 s a plain drop waits, and far over the 200 ms asked for.
    runtime().block_on(end_stalled_reader(
        |c| c.shutdown_timeout(Duration::from_millis(200)),
        Duration::from_secs(5),
    ));
}

/// A peer whose address swallows every packet (its metadata names an address that answers
/// nothing: a static neighbour entry sends the SYNs to a MAC nobody has). Connecting to it must not
/// block the engine (UCX's blocking connect retries SYNs for two minutes): the library sets UCX's
/// non-blocking connect for every agent.
#[test]
fn stall_blackholed_address_leaves_the_engine_serving() {
    let Some(ns) = Netns::make() else { return };
    let env_a = [("UCX_TLS", tcp_tls()), ("UCX_NET_DEVICES", ns.dev_a.as_str())];
    let env_b = [("UCX_TLS", tcp_tls()), ("UCX_NET_DEVICES", ns.dev_b.as_str())];
    let mut owner = Peer::from_command(ns.command_for(&ns.b, PEER, &env_b));
    owner.say("expose readable 4096 vec");
    let md = owner.expect("MD:");
    // From namespace a, the owner's address now leads nowhere.
    Netns::ip(&[
        "-n",
        &ns.a,
        "neigh",
        "replace",
        &ns.ip_b,
        "lladdr",
        "02:00:00:00:be:ef",
        "dev",
        &ns.dev_a,
        "nud",
        "permanent",
    ])
    .unwrap();
    let mut victim = Peer::from_command(ns.command_for(&ns.a, "stall::support_blackhole", &env_a));
    victim.say(&md);
    let served = victim.expect("SERVED:");
    let read = victim.expect("BLACKHOLED:");
    println!("served meanwhile: {served}; the blackholed read: {read}");
    assert!(served.starts_with("ok"), "{served}");
    assert!(read.starts_with("err"), "{read}");
    victim.finish();
}

#[test]
#[ignore = "run by stall_blackholed_address_leaves_the_engine_serving in a network namespace"]
fn support_blackhole() {
    let Ok(_) = std::env::var(PEER_ENV) else { return };
    use std::io::BufRead;
    runtime().block_on(async {
        let line = std::io::stdin().lock().lines().next().unwrap().unwrap();
        let md: RdmaMetadata = line.parse().unwrap();
        let victim = Connector::builder().path(PathPolicy::Nixl).build().unwrap();
        let other = Connector::builder().path(PathPolicy::Nixl).build().unwrap();
        let t0 = Instant::now();
        let bh = tokio::spawn({
            let victim = victim.clone();
            async move {
                let op = victim.begin_read(&md, Descriptor::from(vec![0u8; 4096])).await?;
                op.wait_for_completion(Some(Duration::from_secs(5))).await
            }
        });
        // Meanwhile the same connector reads another peer (in this namespace), within seconds.
        let want = pattern(4096, 3);
        let served = tokio::time::timeout(Duration::from_secs(10), async {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let r = other.create_readable(Descriptor::from(want.clone())).await?;
            let op = victim
                .begin_read(r.metadata(), Descriptor::from(vec![0u8; 4096]))
                .await?;
            op.wait_for_completion(T).await?;
            let ok = op.into_descriptors().unwrap()[0].as_slice().unwrap() == &want[..];
            Ok::<_, nixl_connect::Error>(ok)
        })
        .await;
        match served {
            Ok(Ok(true)) => println!("SERVED:ok after {:?}", t0.elapsed()),
            Ok(Ok(false)) => println!("SERVED:wrong bytes"),
            Ok(Err(e)) => println!("SERVED:err {e}"),
            Err(_) => println!("SERVED:blocked for 10 s"),
        }
        let r = bh.await.unwrap();
        println!(
            "BLACKHOLED:{} after {:?}",
            r.map_or_else(|e| format!("err {e}"), |()| "ok".into()),
            t0.elapsed()
        );
    });
}
