//! Helpers shared by the integration tests: data patterns, descriptor splitting, and peer
//! processes (this test binary re-run as an ignored `support_*` test, talking over its
//! stdin/stdout).

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use nixl_connect::Descriptor;

/// The default wait in tests.
pub(crate) const T: Option<Duration> = Some(Duration::from_secs(30));
/// Set in a support process (to its role); support tests return at once without it.
pub(crate) const PEER_ENV: &str = "NIXL_CONNECT_TEST_PEER";

/// The command prefix that starts a process as a pod does: its own PID namespace (with its own
/// /proc), IPC and mount namespaces, killed with its parent.
pub(crate) const POD: [&str; 7] = [
    "unshare",
    "--pid",
    "--ipc",
    "--mount",
    "--fork",
    "--kill-child",
    "--mount-proc",
];

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

/// Reads one same-host frame (`u32` length, then the body), as a hand-written peer does; `None`
/// at end of stream.
pub(crate) fn read_frame(s: &mut impl std::io::Read) -> Option<Vec<u8>> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).ok()?;
    let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
    s.read_exact(&mut body).ok()?;
    Some(body)
}

/// Deterministic bytes for `seed`, with no period a transfer's offsets could hide behind: blocks
/// of one xorshift block of a prime length (4093 bytes), each rotated by, and starting with, a
/// mix of its index and the seed. Built by copies, not per byte: tests run in debug builds, where
/// a per-byte generator took 11 ns a byte (12 s for 1 GiB).
pub(crate) fn pattern(len: usize, seed: u64) -> Vec<u8> {
    const BLOCK: usize = 4093;
    let mix = |v: u64| v.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut x = mix(seed);
    let block: Vec<u8> = (0..BLOCK)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect();
    let mut v = Vec::with_capacity(len + BLOCK);
    for i in 0..len.div_ceil(BLOCK) as u64 {
        let m = mix(i ^ seed.rotate_left(32));
        let r = (m >> 32) as usize % BLOCK;
        let at = v.len();
        v.extend_from_slice(&block[r..]);
        v.extend_from_slice(&block[..r]);
        v[at..at + 8].copy_from_slice(&m.to_le_bytes());
    }
    v.truncate(len);
    v
}

/// True if every byte of `b` is `byte`. Compared a block at a time (a `memcmp`): tests run in
/// debug builds, where a per-byte loop took 2.4 ns a byte (0.16 s per 64 MiB canary).
pub(crate) fn all_bytes(b: &[u8], byte: u8) -> bool {
    let block = [byte; 4096];
    b.chunks(block.len()).all(|c| c == &block[..c.len()])
}

/// Unequal sizes summing to `total`: 1, 2, 3, ... weights.
pub(crate) fn sizes(total: usize, n: usize) -> Vec<usize> {
    let w: usize = (1..=n).sum();
    let mut s: Vec<usize> = (1..=n).map(|i| (total / w * i).max(1)).collect();
    let used: usize = s[..n - 1].iter().sum();
    s[n - 1] = total - used;
    s
}

pub(crate) fn split<'a>(mut buf: &'a mut [u8], sizes: &[usize]) -> Vec<Descriptor<'a>> {
    sizes
        .iter()
        .map(|&s| {
            let (h, r) = std::mem::take(&mut buf).split_at_mut(s);
            buf = r;
            Descriptor::from(h)
        })
        .collect()
}

pub(crate) fn split_ro<'a>(mut buf: &'a [u8], sizes: &[usize]) -> Vec<Descriptor<'a>> {
    sizes
        .iter()
        .map(|&s| {
            let (h, r) = buf.split_at(s);
            buf = r;
            Descriptor::from(h)
        })
        .collect()
}

pub(crate) fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Runs the ignored support test `name` in a fresh process of this binary with `env`; asserts it
/// passed and returns its stdout.
pub(crate) fn run_support(name: &str, env: &[(&str, &std::ffi::OsStr)]) -> String {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([name, "--exact", "--ignored", "--nocapture", "--test-threads=1"])
        .env(PEER_ENV, "1");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{name} failed or aborted: {:?}\n{text}\n{err}",
        out.status
    );
    text
}

/// A peer process: this test binary running one of the ignored `support_*` tests.
pub(crate) struct Peer {
    pub child: Child,
    out: BufReader<std::process::ChildStdout>,
}

impl Peer {
    /// The `core::support_peer` role `role` (`readable` / `writable` commands).
    pub(crate) fn start(role: &str) -> Self {
        Self::spawn("core::support_peer", role, &[])
    }

    /// The support test `test` with `role` in its environment, plus `env`.
    pub(crate) fn spawn(test: &str, role: &str, env: &[(&str, &str)]) -> Self {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args([test, "--exact", "--ignored", "--nocapture", "--test-threads=1"])
            .env(PEER_ENV, role)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        Peer { child, out }
    }

    /// A peer from a prepared command (another user, another network namespace...).
    pub(crate) fn from_command(mut cmd: Command) -> Self {
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = cmd.spawn().unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        Peer { child, out }
    }

    /// Sends one line to the peer.
    pub(crate) fn say(&mut self, line: &str) {
        writeln!(self.child.stdin.as_mut().unwrap(), "{line}").unwrap();
        self.child.stdin.as_mut().unwrap().flush().unwrap();
    }

    /// The next line the peer tagged with `tag`.
    pub(crate) fn expect(&mut self, tag: &str) -> String {
        let mut line = String::new();
        loop {
            line.clear();
            assert!(
                self.out.read_line(&mut line).unwrap() > 0,
                "peer exited before sending {tag}"
            );
            // libtest may print "test ... " on the same line before the peer's output.
            if let Some(i) = line.find(tag) {
                return line[i + tag.len()..].trim_end().to_string();
            }
        }
    }

    /// Sends a signal to the peer (SIGSTOP, SIGCONT, SIGKILL); SIGSTOP returns once it is stopped.
    /// The peer's process id.
    pub(crate) fn id(&self) -> u32 {
        self.child.id()
    }

    pub(crate) fn signal(&self, sig: i32) {
        crate::stop::signal(self.child.id(), sig);
    }

    pub(crate) fn finish(mut self) {
        drop(self.child.stdin.take());
        let st = self.child.wait().unwrap();
        assert!(st.success(), "peer failed: {st}");
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A TCP port free on loopback right now.
#[cfg_attr(
    not(any(feature = "http", feature = "nats", feature = "etcd")),
    allow(dead_code)
)]
pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The warnings the library has logged in this process (`tracing`, level `warn`), each as its
/// fields (`name=value`, the message first), recorded from the first call on: a global
/// subscriber, so warnings from the engine's thread count too. For support processes that check
/// what a user is warned of.
pub(crate) fn warnings() -> Vec<String> {
    use std::sync::{Mutex, OnceLock};
    use tracing_subscriber::layer::{Context, Layer, SubscriberExt};

    static SEEN: OnceLock<&'static Mutex<Vec<String>>> = OnceLock::new();

    struct Record(&'static Mutex<Vec<String>>);
    struct Fields(String);
    impl tracing::field::Visit for Fields {
        fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
            self.0.push_str(&format!("{}={value:?} ", field.name()));
        }
    }
    impl<S: tracing::Subscriber> Layer<S> for Record {
        fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
            if *event.metadata().level() == tracing::Level::WARN {
                let mut f = Fields(String::new());
                event.record(&mut f);
                self.0.lock().unwrap_or_else(|p| p.into_inner()).push(f.0);
            }
        }
    }
    let seen = SEEN.get_or_init(|| {
        let seen: &'static Mutex<Vec<String>> = Box::leak(Box::default());
        let subscriber = tracing_subscriber::registry().with(Record(seen));
        tracing::subscriber::set_global_default(subscriber).expect("no other global subscriber");
        seen
    });
    seen.lock().unwrap_or_else(|p| p.into_inner()).clone()
}
