//! Resource limits a same-host peer runs into: out of descriptors while accepting.

use std::time::{Duration, Instant};

use nixl_connect::{Connector, Descriptor};

use super::soundness::sound_peer;
use super::support::{pattern, run_support, runtime, PEER_ENV, T};

fn cpu_time() -> Duration {
    let mut u = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage fills the struct it is given.
    let u = unsafe {
        libc::getrusage(libc::RUSAGE_SELF, u.as_mut_ptr());
        u.assume_init()
    };
    let t = |v: libc::timeval| Duration::new(v.tv_sec as u64, v.tv_usec as u32 * 1000);
    t(u.ru_utime) + t(u.ru_stime)
}

fn per_thread() -> String {
    let mut out = String::new();
    for e in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
        let comm = stat
            .split('(')
            .nth(1)
            .and_then(|r| r.split(')').next())
            .unwrap_or("");
        let f: Vec<&str> = stat.rsplit(')').next().unwrap_or("").split_whitespace().collect();
        out += &format!(
            "{comm}:{}+{} ",
            f.get(11).unwrap_or(&""),
            f.get(12).unwrap_or(&"")
        );
    }
    out
}

#[test]
fn limits_listener_backs_off_when_out_of_descriptors() {
    let text = run_support("limits::support_emfile", &[]);
    assert!(text.contains("EMFILE-OK"), "{text}");
}

#[test]
#[ignore = "run by limits_listener_backs_off_when_out_of_descriptors in a fresh process"]
fn support_emfile() {
    let Ok(_) = std::env::var(PEER_ENV) else { return };
    runtime().block_on(async {
        let owner = Connector::new().unwrap();
        let want = pattern(4096, 5);
        let r = owner
            .create_readable(Descriptor::from(want.clone()))
            .await
            .unwrap();
        let mut peer = sound_peer();
        // Use up this process's descriptors.
        let mut hoard = Vec::new();
        while let Ok(f) = std::fs::File::open("/dev/null") {
            hoard.push(f);
        }
        // The peer connects (the kernel queues it) and waits for the handshake: every accept
        // fails with EMFILE while the hoard lasts.
        peer.say("read auto");
        peer.say(&r.metadata().to_json());
        peer.expect("STARTED");
        let (cpu0, t0) = (cpu_time(), Instant::now());
        tokio::time::sleep(Duration::from_secs(2)).await;
        let (cpu, wall) = (cpu_time() - cpu0, t0.elapsed());
        drop(hoard);
        let threads = per_thread();
        println!("threads: {threads}");
        println!("while out of descriptors: {cpu:?} of CPU in {wall:?}");
        // A spinning listener would burn a core; backing off costs next to nothing.
        assert!(
            cpu < wall / 4,
            "the engine spun on the listener: {cpu:?} of CPU in {wall:?}"
        );
        // Descriptors are back: the waiting peer is served.
        assert!(peer.expect("READ:").starts_with("ok"));
        r.wait_for_completion(T).await.unwrap();
        println!("EMFILE-OK");
    });
}
