//! The soak: mixed load between two processes for `NIXL_CONNECT_SOAK_SECS` (600 by
//! `scripts/soak.sh`): up to 1,000 operations outstanding, both paths, reads and writes, random
//! drops on both sides, the peer killed and restarted every `NIXL_CONNECT_SOAK_KILL_SECS` (60).
//!
//! This process exposes readables (filled with a pattern by sequence number) and writables; the
//! peer reads or writes each with a random path, or drops its operation at a random point. The
//! soak checks: nothing lost (every operation ends within its deadline), nothing doubled (one
//! result per operation, a completed writable holds exactly its writer's bytes, a read returns
//! exactly the readable's), and RSS and file descriptors flat after warm-up.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nixl_connect::{Connector, Descriptor, Error, HostBuffer, PathPolicy, RdmaMetadata};

use super::support::{pattern, runtime, PEER_ENV};

const OUTSTANDING: usize = 1000;

/// A task awaiting a passive operation: 0 dropped by this side, 1 complete with the right bytes,
/// 2 complete with other bytes.
type Waiter = tokio::task::JoinHandle<Result<u8, Error>>;
/// How long a passive operation may wait for its peer before it counts as lost.
const DEADLINE: Duration = Duration::from_secs(30);

fn fnv(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| {
        (h ^ u64::from(x)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn rss_kb() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap()
}

fn fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The peer process and a thread turning its result lines into messages.
struct SoakPeer {
    child: Child,
    rx: tokio::sync::mpsc::UnboundedReceiver<String>,
}

impl SoakPeer {
    fn start(gen: u64) -> Self {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "soak::support_soak_peer",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(PEER_ENV, gen.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        std::thread::spawn(move || {
            for line in out.lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        Self { child, rx }
    }

    fn say(&mut self, line: &str) -> bool {
        let w = self.child.stdin.as_mut().unwrap();
        writeln!(w, "{line}").and_then(|()| w.flush()).is_ok()
    }
}

#[derive(Default, Debug)]
struct Tally {
    started: u64,
    completed: u64,
    read_ok: u64,
    write_ok: u64,
    peer_dropped: u64,
    we_dropped: u64,
    failed_after_kill: u64,
    /// Passive operations failed because their retired exposer was destroyed past the cap.
    evicted: u64,
    timed_out: u64,
    peer_errors: u64,
    wrong_bytes: u64,
    doubled: u64,
    kills: u64,
}

#[test]
#[ignore = "the soak: run by scripts/soak.sh (NIXL_CONNECT_SOAK_SECS, default 600)"]
fn soak_mixed_load_between_two_processes() {
    let secs: u64 = std::env::var("NIXL_CONNECT_SOAK_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(600);
    let kill_every = Duration::from_secs(
        std::env::var("NIXL_CONNECT_SOAK_KILL_SECS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(60),
    );
    runtime().block_on(async move {
        let conn = Connector::new().unwrap();
        let mut rng = Rng(0x5EED_1234_ABCD_0001);
        let mut peer_gen = 0;
        let mut peer = SoakPeer::start(peer_gen);
        let start = Instant::now();
        let mut last_kill = Instant::now();
        let mut t = Tally::default();
        // seq -> (a task awaiting the passive side, issued at, peer generation)
        let mut live: HashMap<u64, (Waiter, Instant, u64)> = HashMap::new();
        let mut results: HashMap<u64, String> = HashMap::new();
        let mut samples: Vec<(u64, u64, usize)> = Vec::new();
        let mut next_sample = Instant::now();
        let mut seq = 0u64;
        let mut max_wait = Duration::ZERO;
        while start.elapsed() < Duration::from_secs(secs) || !live.is_empty() {
            let running = start.elapsed() < Duration::from_secs(secs);
            // Keep OUTSTANDING operations in flight.
            while running && live.len() < OUTSTANDING {
                seq += 1;
                let len = [4096usize, 65536, 1 << 20][rng.below(3) as usize];
                let write = rng.below(2) == 1;
                let path = ["auto", "nixl"][rng.below(2) as usize];
                // The peer drops its operation at a random point 1 time in 10; this side 1 in 20.
                let peer_drop = rng.below(10) == 0;
                let our_drop = rng.below(20) == 0;
                let (md, task): (RdmaMetadata, Waiter) = if write {
                    let w = conn
                        .create_writable(Descriptor::from(vec![0u8; len]))
                        .await
                        .unwrap();
                    let md = w.metadata().clone();
                    let s = seq;
                    let task = tokio::spawn(async move {
                        if our_drop {
                            tokio::time::sleep(Duration::from_micros(s % 500)).await;
                            return Ok(0);
                        }
                        w.wait_for_completion(Some(DEADLINE)).await?;
                        let d = w.into_descriptors();
                        Ok(if fnv(d[0].as_slice().unwrap()) == fnv(&pattern(len, s)) {
                            1
                        } else {
                            2
                        })
                    });
                    (md, task)
                } else {
                    // One readable in three over a HostBuffer (its drop hands the mapping to the
                    // quarantine), the others over a Vec.
                    let d = if seq % 3 == 0 {
                        Descriptor::from(HostBuffer::from_slice(&pattern(len, seq)).unwrap())
                    } else {
                        Descriptor::from(pattern(len, seq))
                    };
                    let r = conn.create_readable(d).await.unwrap();
                    let md = r.metadata().clone();
                    let s = seq;
                    let task = tokio::spawn(async move {
                        if our_drop {
                            tokio::time::sleep(Duration::from_micros(s % 500)).await;
                            return Ok(0);
                        }
                        r.wait_for_completion(Some(DEADLINE)).await?;
                        Ok(1)
                    });
                    (md, task)
                };
                let op = if write { "write" } else { "read" };
                let drop_at = if peer_drop { rng.below(2000) as i64 } else { -1 };
                let line = format!("{op} {seq} {len} {path} {drop_at} {}", md.to_json());
                if our_drop {
                    t.we_dropped += 1;
                }
                t.started += 1;
                live.insert(seq, (task, Instant::now(), peer_gen));
                peer.say(&line);
            }
            // Results from the peer.
            while let Ok(line) = peer.rx.try_recv() {
                let mut w = line.splitn(3, ' ');
                let (Some(s), Some(what)) = (w.next().and_then(|s| s.parse::<u64>().ok()), w.next()) else {
                    continue;
                };
                let rest = w.next().unwrap_or("").to_string();
                if results.insert(s, format!("{what} {rest}")).is_some() {
                    t.doubled += 1;
                }
            }
            // Passive sides that ended.
            let done: Vec<u64> = live
                .iter()
                .filter(|(_, (h, _, _))| h.is_finished())
                .map(|(s, _)| *s)
                .collect();
            for s in done {
                let (h, at, gen) = live.remove(&s).unwrap();
                max_wait = max_wait.max(at.elapsed());
                match h.await.unwrap() {
                    Ok(1) => t.completed += 1,
                    Ok(2) => t.wrong_bytes += 1,
                    Ok(_) => {}
                    Err(Error::Interrupted { .. }) => t.evicted += 1,
                    Err(Error::TimedOut { .. }) if gen < peer_gen => t.failed_after_kill += 1,
                    Err(Error::TimedOut { .. }) => {
                        // Only acceptable if the peer dropped or failed its side.
                        t.timed_out += 1;
                    }
                    Err(_) => t.failed_after_kill += 1,
                }
            }
            if Instant::now() >= next_sample {
                samples.push((start.elapsed().as_secs(), rss_kb(), fds()));
                next_sample += Duration::from_secs(10);
            }
            if running && last_kill.elapsed() >= kill_every {
                let _ = peer.child.kill();
                let _ = peer.child.wait();
                peer_gen += 1;
                t.kills += 1;
                peer = SoakPeer::start(peer_gen);
                last_kill = Instant::now();
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        peer.say("quit");
        let _ = peer.child.wait();
        while let Ok(line) = peer.rx.try_recv() {
            if let Some((s, rest)) = line.split_once(' ') {
                if let Ok(s) = s.parse::<u64>() {
                    if results.insert(s, rest.to_string()).is_some() {
                        t.doubled += 1;
                    }
                }
            }
        }
        for r in results.values() {
            match r.split_whitespace().next() {
                Some("read-ok") => t.read_ok += 1,
                Some("write-ok") => t.write_ok += 1,
                Some("dropped") => t.peer_dropped += 1,
                Some("read-bad") => t.wrong_bytes += 1,
                _ => t.peer_errors += 1,
            }
        }
        let warm: Vec<_> = samples.iter().filter(|s| s.0 >= 60).collect();
        let (first, last) = (warm.first().copied(), warm.last().copied());
        let max_rss = warm.iter().map(|s| s.1).max().unwrap_or(0);
        let max_fds = warm.iter().map(|s| s.2).max().unwrap_or(0);
        println!(
            "SOAK {secs}s: {t:?}\n  longest passive wait {max_wait:?}; after warm-up (60 s): \
             RSS {:?} -> {:?} KiB (max {max_rss}), fds {:?} -> {:?} (max {max_fds})",
            first.map(|s| s.1),
            last.map(|s| s.1),
            first.map(|s| s.2),
            last.map(|s| s.2)
        );
        println!("  engine {:?}", conn.stats().await);
        for s in &samples {
            println!("  sample t={}s rss={} KiB fds={}", s.0, s.1, s.2);
        }
        assert_eq!(t.doubled, 0, "an operation had two results");
        assert_eq!(
            t.wrong_bytes, 0,
            "a transfer delivered other bytes than its source's"
        );
        assert!(
            max_wait <= DEADLINE + Duration::from_secs(5),
            "an operation outlived its deadline"
        );
        if let (Some(f), Some(l)) = (first, last) {
            assert!(
                l.1 <= f.1 + f.1 / 2 + 65536,
                "RSS grew after warm-up: {f:?} -> {l:?}"
            );
            assert!(
                l.2 <= f.2 + 64,
                "file descriptors grew after warm-up: {f:?} -> {l:?}"
            );
        }
        println!("SOAK-OK");
    });
}

/// The soak's peer: one line per operation, `read|write SEQ LEN auto|nixl DROP_AT_US JSON`
/// (`DROP_AT_US` < 0: never drop); prints `SEQ read-ok|read-bad|write-ok|dropped|error ...`.
#[test]
#[ignore = "run by soak_mixed_load_between_two_processes as its peer"]
fn support_soak_peer() {
    let Ok(_) = std::env::var(PEER_ENV) else { return };
    runtime().block_on(async {
        let conns = [
            (PathPolicy::Auto, Connector::new().unwrap()),
            (
                PathPolicy::Nixl,
                Connector::builder().path(PathPolicy::Nixl).build().unwrap(),
            ),
        ];
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
        let printer = std::thread::spawn(move || {
            let mut out = std::io::stdout().lock();
            while let Some(line) = rx.blocking_recv() {
                let _ = writeln!(out, "{line}");
                let _ = out.flush();
            }
        });
        let stdin = std::io::stdin();
        for line in stdin.lock().lines().map_while(Result::ok) {
            if line == "quit" {
                break;
            }
            let mut w = line.splitn(6, ' ');
            let (op, seq, len, path, drop_at, json) = (
                w.next().unwrap().to_string(),
                w.next().unwrap().parse::<u64>().unwrap(),
                w.next().unwrap().parse::<usize>().unwrap(),
                w.next().unwrap().parse::<PathPolicy>().unwrap(),
                w.next().unwrap().parse::<i64>().unwrap(),
                w.next().unwrap().to_string(),
            );
            let conn = conns.iter().find(|(p, _)| *p == path).unwrap().1.clone();
            let tx = tx.clone();
            tokio::spawn(async move {
                let md: RdmaMetadata = json.parse().unwrap();
                let fut = async {
                    if op == "read" {
                        let r = conn.begin_read(&md, Descriptor::from(vec![0u8; len])).await?;
                        r.wait_for_completion(Some(DEADLINE)).await?;
                        let d = r.into_descriptors().unwrap();
                        Ok::<_, Error>(if d[0].as_slice().unwrap() == &pattern(len, seq)[..] {
                            "read-ok".to_string()
                        } else {
                            "read-bad".to_string()
                        })
                    } else {
                        let w = conn.begin_write(Descriptor::from(pattern(len, seq)), &md).await?;
                        w.wait_for_completion(Some(DEADLINE)).await?;
                        Ok("write-ok".to_string())
                    }
                };
                let r = if drop_at >= 0 {
                    match tokio::time::timeout(Duration::from_micros(drop_at as u64), fut).await {
                        Ok(r) => r,
                        Err(_) => Ok("dropped".to_string()),
                    }
                } else {
                    fut.await
                };
                let _ = tx.send(match r {
                    Ok(s) => format!("{seq} {s}"),
                    Err(e) => format!("{seq} error {}", e.to_string().replace('\n', " ")),
                });
            });
        }
        drop(tx);
        tokio::time::sleep(Duration::from_millis(200)).await;
        drop(printer);
    });
}
