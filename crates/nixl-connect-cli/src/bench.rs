//! `nixl-connect bench`: two processes, a new operation pair per iteration, JSON lines out.
//!
//! This process is the active side (it reads or writes); the peer it spawns (`bench-peer`) is the
//! passive side. Per iteration the peer creates a readable (or writable), prints its metadata and
//! times until completion (`server_wait`); this side times from receiving the metadata to the end
//! of its read or write (`read`), as the anchors in ../shared/anchors do.

use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use nixl_connect::{Connector, Descriptor, Device, HostBuffer, RdmaMetadata};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use crate::pattern;

#[derive(clap::Args, Debug)]
pub(crate) struct Args {
    /// Sizes to run, comma-separated (4K, 64K, 1M, ...).
    #[arg(long, default_value = "4K,64K,1M,16M,64M,256M", value_delimiter = ',', value_parser = crate::parse_size)]
    sizes: Vec<usize>,
    /// Measured iterations per size (default: by size, from 1000 at 4 KiB to 8 at 256 MiB).
    #[arg(long)]
    iters: Option<usize>,
    /// Unmeasured iterations before the measured ones.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// `read` (readable -> read) or `write` (writable -> write).
    #[arg(long, default_value = "read", value_parser = ["read", "write"])]
    op: String,
    /// `huge`: the library's page-aligned huge-page `HostBuffer`; `vec`: plain `Vec<u8>`.
    #[arg(long, default_value = "huge", value_parser = ["huge", "vec"])]
    buffers: String,
    /// Where this (active) side's memory lives: `cpu` or `cuda:N` (needs the `cuda` feature).
    #[arg(long, default_value = "cpu")]
    device: Device,
    /// Where the peer's (passive) memory lives; default: the same as --device.
    #[arg(long)]
    peer_device: Option<Device>,
    /// Extra UCX backend parameters, KEY=VALUE (e.g. ucx_error_handling_mode=none).
    #[arg(long = "ucx-param", value_parser = parse_kv)]
    ucx_params: Vec<(String, String)>,
}

fn parse_kv(s: &str) -> std::result::Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("{s:?} is not KEY=VALUE"))
}

#[derive(Serialize, Deserialize, Debug, Clone)]
struct Block {
    op: String,
    size: usize,
    n: usize,
    buffers: String,
    device: Device,
    ucx_params: Vec<(String, String)>,
}

#[derive(Serialize, Deserialize, Debug)]
struct PeerIter {
    wait_us: f64,
    ok: bool,
}

fn default_iters(size: usize) -> usize {
    match size {
        s if s <= 4 << 10 => 1000,
        s if s <= 64 << 10 => 500,
        s if s <= 1 << 20 => 200,
        s if s <= 16 << 20 => 40,
        s if s <= 64 << 20 => 20,
        _ => 8,
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Memory for one side: a huge-page HostBuffer or a Vec, recycled across iterations.
enum Mem {
    Huge(HostBuffer),
    Vec(Option<Descriptor<'static>>),
    #[cfg(feature = "cuda")]
    Gpu(gpu::Gpu),
}

impl Mem {
    fn new(kind: &str, size: usize, seed: Option<u64>, device: Device) -> Result<Self> {
        if device != Device::Host {
            #[cfg(feature = "cuda")]
            return Ok(Mem::Gpu(gpu::Gpu::new(device, size, seed)?));
            #[cfg(not(feature = "cuda"))]
            bail!("--device {device}: this nixl-connect was built without the `cuda` feature");
        }
        Ok(if kind == "huge" {
            let mut b = HostBuffer::new(size)?;
            if let Some(s) = seed {
                pattern::fill(&mut b, s, 0);
            }
            Mem::Huge(b)
        } else {
            let mut v = vec![0u8; size];
            if let Some(s) = seed {
                pattern::fill(&mut v, s, 0);
            }
            Mem::Vec(Some(Descriptor::from(v)))
        })
    }

    /// A descriptor for one operation: borrowed for huge-page and GPU memory, the recycled owned
    /// `Vec` descriptor (which keeps its registration) otherwise. `dest`: NIXL writes into it.
    fn descriptor(&mut self, dest: bool) -> Result<Descriptor<'_>> {
        Ok(match self {
            Mem::Huge(b) => match dest {
                true => Descriptor::from(b),
                false => Descriptor::from(&*b),
            },
            Mem::Vec(slot) => slot
                .take()
                .expect("the descriptor is returned after each operation"),
            #[cfg(feature = "cuda")]
            Mem::Gpu(g) => match dest {
                true => Descriptor::from_cuda_mut(&mut g.slice)?,
                false => Descriptor::from_cuda_ref(&g.slice)?,
            },
        })
    }

    /// Takes back the owned descriptor an operation returned (borrowed ones are just dropped).
    fn recycle(&mut self, back: Vec<Descriptor<'static>>) {
        if let Mem::Vec(slot) = self {
            *slot = back.into_iter().next();
        }
    }

    /// True when the memory holds the pattern for `seed`.
    fn holds(&self, seed: u64) -> bool {
        match self {
            Mem::Huge(b) => pattern::first_mismatch(b, seed, 0).is_none(),
            Mem::Vec(d) => {
                pattern::first_mismatch(d.as_ref().and_then(|d| d.as_slice()).unwrap_or(&[]), seed, 0)
                    .is_none()
            }
            #[cfg(feature = "cuda")]
            Mem::Gpu(g) => g
                .to_host()
                .is_ok_and(|h| pattern::first_mismatch(&h, seed, 0).is_none()),
        }
    }
}

#[cfg(feature = "cuda")]
mod gpu {
    use std::sync::Arc;

    use anyhow::Result;
    use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
    use nixl_connect::Device;

    /// Device memory for the benchmark, filled from and checked against the host pattern.
    pub(super) struct Gpu {
        pub(super) stream: Arc<CudaStream>,
        pub(super) slice: CudaSlice<u8>,
    }

    impl Gpu {
        pub(super) fn new(device: Device, size: usize, seed: Option<u64>) -> Result<Self> {
            nixl_connect::cuda::device_count()?;
            let stream = CudaContext::new(device.id() as usize)?.default_stream();
            let slice = match seed {
                Some(s) => {
                    let mut host = vec![0u8; size];
                    crate::pattern::fill(&mut host, s, 0);
                    stream.clone_htod(&host)?
                }
                None => stream.alloc_zeros::<u8>(size)?,
            };
            stream.synchronize()?;
            Ok(Self { stream, slice })
        }

        pub(super) fn to_host(&self) -> Result<Vec<u8>> {
            Ok(self.stream.clone_dtoh(&self.slice)?)
        }
    }
}

pub(crate) async fn run(a: Args) -> Result<()> {
    let exe = std::env::current_exe().context("locating this executable")?;
    let mut child = tokio::process::Command::new(exe)
        .arg("bench-peer")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .context("starting the benchmark peer")?;
    let mut to_peer = child.stdin.take().context("peer stdin")?;
    let mut from_peer = BufReader::new(child.stdout.take().context("peer stdout")?).lines();
    let mut builder = Connector::builder();
    for (k, v) in &a.ucx_params {
        builder = builder.ucx_param(k, v);
    }
    let conn = builder.build()?;
    let write = a.op == "write";
    for &size in &a.sizes {
        let n = a.iters.unwrap_or_else(|| default_iters(size)) + a.warmup;
        let block = Block {
            op: a.op.clone(),
            size,
            n,
            buffers: a.buffers.clone(),
            device: a.peer_device.unwrap_or(a.device),
            ucx_params: a.ucx_params.clone(),
        };
        to_peer
            .write_all(format!("{}\n", serde_json::to_string(&block)?).as_bytes())
            .await?;
        to_peer.flush().await?;
        // The active side's memory: destination of a read, source of a write.
        let mut mem = Mem::new(&a.buffers, size, write.then_some(size as u64), a.device)?;
        let (mut times, mut waits) = (Vec::new(), Vec::new());
        let mut ok = true;
        for i in 0..n {
            let line = next_line(&mut from_peer).await?;
            let t0 = Instant::now();
            let md: RdmaMetadata = line.parse()?;
            let back = active_once(&conn, &md, mem.descriptor(!write)?, write).await?;
            mem.recycle(back);
            let dt = t0.elapsed();
            if !write && i == 0 {
                ok &= mem.holds(size as u64);
            }
            let peer: PeerIter = serde_json::from_str(&next_line(&mut from_peer).await?)?;
            ok &= peer.ok;
            if i >= a.warmup {
                times.push(dt.as_secs_f64() * 1e6);
                waits.push(peer.wait_us);
            }
        }
        let read_min_us = times.iter().copied().fold(f64::INFINITY, f64::min);
        let read_median_us = median(&mut times);
        let out = serde_json::json!({
            "impl": "nixl-connect",
            "op": a.op,
            "device": a.device.to_string(),
            "peer_device": a.peer_device.unwrap_or(a.device).to_string(),
            "buffers": a.buffers,
            "size": size,
            "iters": times.len(),
            "read_median_us": read_median_us,
            "read_min_us": read_min_us,
            "server_wait_median_us": median(&mut waits),
            "GBps": size as f64 / read_median_us / 1e3,
            "ok": ok,
        });
        println!("{out}");
    }
    // An idle connector (nothing outstanding) must cost next to no CPU: measure this process's
    // CPU time over two idle seconds, after the engine's spin window has passed.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let (c0, t0) = (process_cpu_ns(), Instant::now());
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (c1, wall) = (process_cpu_ns(), t0.elapsed());
    if let (Some(c0), Some(c1)) = (c0, c1) {
        let pct = (c1 - c0) as f64 / wall.as_nanos() as f64 * 100.0;
        println!(
            "{}",
            serde_json::json!({"impl": "nixl-connect", "idle_connector_cpu_pct": pct, "idle_seconds": wall.as_secs_f64()})
        );
    }
    drop(conn);
    drop(to_peer);
    let st = tokio::time::timeout(Duration::from_secs(10), child.wait()).await??;
    if !st.success() {
        bail!("benchmark peer exited with {st}");
    }
    Ok(())
}

async fn next_line(lines: &mut tokio::io::Lines<impl tokio::io::AsyncBufRead + Unpin>) -> Result<String> {
    match tokio::time::timeout(Duration::from_secs(60), lines.next_line()).await {
        Ok(Ok(Some(l))) => Ok(l),
        Ok(Ok(None)) => bail!("the benchmark peer exited early (see its error above)"),
        Ok(Err(e)) => Err(e.into()),
        Err(_) => bail!("the benchmark peer said nothing for 60 s"),
    }
}

/// The passive side: for each block, one readable or writable per iteration.
pub(crate) async fn peer() -> Result<()> {
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    let mut conn: Option<Connector> = None;
    while let Some(line) = lines.next_line().await? {
        let b: Block = serde_json::from_str(&line)?;
        let conn = match &conn {
            Some(c) => c.clone(),
            None => {
                let mut builder = Connector::builder();
                for (k, v) in &b.ucx_params {
                    builder = builder.ucx_param(k, v);
                }
                conn.insert(builder.build()?).clone()
            }
        };
        let write = b.op == "write";
        let mut mem = Mem::new(&b.buffers, b.size, (!write).then_some(b.size as u64), b.device)?;
        for i in 0..b.n {
            let (wait_us, back) = passive_once(&conn, mem.descriptor(write)?, write).await?;
            mem.recycle(back);
            let ok = !(write && i == 0) || mem.holds(b.size as u64);
            let reply = serde_json::to_string(&PeerIter { wait_us, ok })?;
            println!("{reply}");
        }
    }
    Ok(())
}

/// One active operation (read, or write with `write`) on `d`; returns the owned descriptors back.
async fn active_once(
    conn: &Connector,
    md: &RdmaMetadata,
    d: Descriptor<'_>,
    write: bool,
) -> Result<Vec<Descriptor<'static>>> {
    let t = Some(Duration::from_secs(60));
    let back = if write {
        let op = conn.begin_write(d, md).await?;
        op.wait_for_completion(t).await?;
        op.into_descriptors()
            .map_err(|_| anyhow::anyhow!("the write was not released"))?
    } else {
        let op = conn.begin_read(md, d).await?;
        op.wait_for_completion(t).await?;
        op.into_descriptors()
            .map_err(|_| anyhow::anyhow!("the read was not released"))?
    };
    Ok(back
        .into_iter()
        .filter_map(|d| d.try_into_static().ok())
        .collect())
}

/// One passive operation (readable, or writable with `write`) on `d`, published on stdout; returns
/// the wait from publishing to completion, in microseconds, and the owned descriptors back.
async fn passive_once(
    conn: &Connector,
    d: Descriptor<'_>,
    write: bool,
) -> Result<(f64, Vec<Descriptor<'static>>)> {
    let t = Some(Duration::from_secs(60));
    let (wait_us, back) = if write {
        let op = conn.create_writable(d).await?;
        (
            expose(op.metadata(), op.wait_for_completion(t)).await?,
            op.into_descriptors(),
        )
    } else {
        let op = conn.create_readable(d).await?;
        (
            expose(op.metadata(), op.wait_for_completion(t)).await?,
            op.into_descriptors(),
        )
    };
    Ok((
        wait_us,
        back.into_iter()
            .filter_map(|d| d.try_into_static().ok())
            .collect(),
    ))
}

/// Publishes the metadata and times the wait from the moment it is published.
async fn expose(
    md: &RdmaMetadata,
    wait: impl std::future::Future<Output = nixl_connect::Result<()>>,
) -> Result<f64> {
    use std::io::Write;
    let line = format!("{}\n", md.to_json());
    let t0 = Instant::now();
    {
        // A blocking write of one short line: tokio's stdout would hop through its blocking pool.
        let mut o = std::io::stdout().lock();
        o.write_all(line.as_bytes())?;
        o.flush()?;
    }
    wait.await?;
    Ok(t0.elapsed().as_secs_f64() * 1e6)
}

/// CPU time of every thread of this process, in nanoseconds (from /proc/self/task/*/schedstat).
fn process_cpu_ns() -> Option<u64> {
    let mut total = 0u64;
    for e in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
        let s = std::fs::read_to_string(e.path().join("schedstat")).ok()?;
        total += s.split_whitespace().next()?.parse::<u64>().ok()?;
    }
    Some(total)
}
