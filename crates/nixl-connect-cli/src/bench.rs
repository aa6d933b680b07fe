//! `nixl-connect bench`: two processes, new operations every iteration, a table or JSON lines.
//!
//! This process is the active side (it reads or writes); the peer it spawns (`bench-peer`) is the
//! passive side. Per iteration the peer creates `--concurrency` readables (or writables) of
//! `--descriptors` descriptors each, prints their metadata, and times until they complete (the
//! passive side's wait, from publishing; the `from begin` column times the same completion from
//! this side's start, the span of raw NIXL's `notif_A`); this side times from receiving the
//! metadata to the end of its reads or writes, as the anchors in ../shared/anchors do. With
//! `--limit` (the default for host memory) the same run also measures the copy limit: one
//! thread's `process_vm_readv` of the peer's buffer.

use std::io::IsTerminal;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use nixl_connect::{Connector, Descriptor, Device, HostBuffer, PathPolicy, RdmaMetadata};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use crate::pattern;

mod lines;
use lines::PeerLines;

#[derive(clap::Args, Debug)]
pub(crate) struct Args {
    /// Bytes per descriptor, comma-separated (4K, 64K, 1M, ...: binary units).
    #[arg(long, default_value = "4K,64K,1M,16M,64M,256M", value_delimiter = ',', value_parser = crate::parse_size)]
    sizes: Vec<usize>,
    /// Measured iterations per size (default: by size, from 1000 at 4 KiB to 8 at 256 MiB).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    iters: Option<u32>,
    /// Unmeasured iterations before the measured ones.
    #[arg(long, default_value_t = 3)]
    warmup: u32,
    /// `read` (readable -> read) or `write` (writable -> write).
    #[arg(long, default_value = "read", value_parser = ["read", "write"])]
    op: String,
    /// `huge`: the library's page-aligned huge-page `HostBuffer`; `vec`: plain `Vec<u8>`. With
    /// `--device cuda:N`: `huge` and `vec` are `cuMemAlloc` memory (legacy CUDA IPC), `vmm` the
    /// library's `DeviceBuffer` (a VMM allocation: the device memory that crosses PID namespaces;
    /// a host side of the same run takes `huge`).
    #[arg(long, default_value = "huge", value_parser = ["huge", "vec", "vmm"])]
    buffers: String,
    /// Which path moves the bytes: `auto` (same-host to a Rust peer on this host), `nixl`, `local`.
    #[arg(long, default_value = "auto")]
    path: PathPolicy,
    /// Descriptors per operation (each of the size given).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    descriptors: u32,
    /// How an operation's descriptors lie in memory (both sides alike): `separate` (a buffer of
    /// its own each), `contiguous` (consecutive parts of one buffer) or `scattered` (parts of one
    /// buffer with a gap of one descriptor's size between each). The last two need `--buffers huge`.
    #[arg(long, default_value = "separate", value_parser = ["separate", "contiguous", "scattered"])]
    layout: String,
    /// Fresh memory for every operation, on both sides (allocated outside the timed part, as a
    /// worker allocates a tensor per request), instead of the same buffers reused.
    #[arg(long)]
    fresh: bool,
    /// Operations outstanding at once (each with its own fresh metadata).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    concurrency: u32,
    /// Where this (active) side's memory lives: `cpu` or `cuda:N` (needs the `cuda` feature).
    #[arg(long, default_value = "cpu")]
    device: Device,
    /// Where the peer's (passive) memory lives; default: the same as --device.
    #[arg(long)]
    peer_device: Option<Device>,
    /// Extra UCX backend parameters, KEY=VALUE (e.g. ucx_error_handling_mode=none); unknown keys
    /// are refused.
    #[arg(long = "ucx-param", value_parser = parse_kv)]
    ucx_params: Vec<(String, String)>,
    /// Print JSON lines (the default when stdout is not a terminal).
    #[arg(long)]
    json: bool,
    /// Also measure the copy limit in the same run (one thread's process_vm_readv of the peer's
    /// buffer); on by default for host memory.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    limit: bool,
    /// Also measure a connector's CPU use over two idle seconds: with nothing outstanding, then
    /// with one readable exposed and waiting for a reader (Dynamo's media publisher), then with
    /// one writable waiting for a writer.
    #[arg(long)]
    idle_cpu: bool,
    /// Talk to a benchmark peer started elsewhere instead of starting one: these two FIFOs are its
    /// stdin and its stdout (`scripts/bench-pods.sh` starts it in a PID namespace of its own and
    /// this side in another, as two pods; both name the shared socket directory in
    /// `NIXL_CONNECT_SOCKET_DIR`). The copy limit is not measured then: the peer's pid is not
    /// ours to see.
    #[arg(long, value_delimiter = ',', num_args = 1, value_name = "IN,OUT")]
    pub(crate) peer_fifos: Option<Vec<std::path::PathBuf>>,
    /// Both connectors' progress delay in microseconds (`ConnectorBuilder::progress_delay`;
    /// default 1000): the active side's and the passive peer's.
    #[arg(long)]
    progress_delay_us: Option<u64>,
    /// Both connectors' wait spin in microseconds (`ConnectorBuilder::wait_spin`; default
    /// `NIXL_CONNECT_WAIT_SPIN_US`, else the library's 100): how long the wait of a small
    /// operation stays awake before it parks, on the active side and on the passive peer (which
    /// is given the active side's, whatever its own environment says). At most 10000.
    #[arg(long, value_parser = clap::value_parser!(u64).range(0..=10_000))]
    wait_spin_us: Option<u64>,
    /// Metrics of this (active) side's connector (the peer records too, unserved).
    #[command(flatten)]
    metrics: crate::metrics::MetricsArgs,
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
    descriptors: usize,
    concurrency: usize,
    n: usize,
    buffers: String,
    layout: String,
    fresh: bool,
    device: Device,
    ucx_params: Vec<(String, String)>,
    /// The passive peer's progress delay (the active side's too).
    progress_delay_us: Option<u64>,
    /// The passive peer's wait spin (the active side's too).
    #[serde(default)]
    wait_spin_us: Option<u64>,
    /// The peer records metrics too (the active side was given `--metrics`): both sides pay
    /// what recording costs.
    #[serde(default)]
    metrics: bool,
}

#[derive(Serialize, Deserialize, Debug)]
struct PeerIter {
    wait_us: f64,
    ok: bool,
    /// When the passive side saw its operation complete ([`monotonic_ns`]).
    done_ns: u64,
    /// The passive side's wait spin, microseconds.
    #[serde(default)]
    spin_us: u64,
}

/// `CLOCK_MONOTONIC` in nanoseconds: one clock for every process of the machine, so the passive
/// side's completion can be timed from the active side's start, the span raw NIXL's anchor
/// (`nixl_raw_pair.py`, `notif_A`) measures.
fn monotonic_ns() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .map(|t| t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64)
        .unwrap_or(0)
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

/// Latency statistics in microseconds.
#[derive(Debug, Clone, Copy, Default)]
struct Stats {
    mean: f64,
    min: f64,
    p50: f64,
    p99: f64,
    max: f64,
}

fn stats(v: &mut [f64]) -> Stats {
    if v.is_empty() {
        return Stats::default();
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    Stats {
        mean: v.iter().sum::<f64>() / v.len() as f64,
        min: v[0],
        p50: at(0.5),
        p99: at(0.99),
        max: v[v.len() - 1],
    }
}

/// Memory for one side: a huge-page HostBuffer or Vecs, recycled across iterations.
enum Mem {
    Huge(Vec<HostBuffer>),
    /// Parts of one HostBuffer: part `i` is `size` bytes at `i * stride`.
    Parts {
        buf: HostBuffer,
        size: usize,
        stride: usize,
    },
    Vec(Vec<Option<Descriptor<'static>>>),
    #[cfg(feature = "cuda")]
    Gpu(Vec<gpu::Gpu>),
}

impl Mem {
    /// `count` buffers (or parts of one buffer, as `layout` says) of `size` bytes.
    fn new(
        kind: &str,
        layout: &str,
        size: usize,
        count: usize,
        seed: Option<u64>,
        device: Device,
    ) -> Result<Self> {
        if layout != "separate" {
            if kind != "huge" || device != Device::Host {
                bail!("--layout {layout} needs --buffers huge and host memory");
            }
            let stride = if layout == "scattered" { 2 * size } else { size };
            let total = stride
                .checked_mul(count)
                .context("--layout: the buffer's size overflows")?;
            let mut buf = HostBuffer::new(total)
                .with_context(|| format!("allocating {} for the benchmark", crate::human(total)))?;
            if let Some(s) = seed {
                for k in 0..count {
                    pattern::fill(&mut buf[k * stride..k * stride + size], s, 0);
                }
            }
            return Ok(Mem::Parts { buf, size, stride });
        }
        // `vmm` names device memory; a host side of the same run takes `huge`.
        let kind = if kind == "vmm" && device == Device::Host {
            "huge"
        } else {
            kind
        };
        if device != Device::Host {
            #[cfg(feature = "cuda")]
            return Ok(Mem::Gpu(
                (0..count)
                    .map(|_| gpu::Gpu::new(device, size, seed, kind == "vmm"))
                    .collect::<Result<_>>()?,
            ));
            #[cfg(not(feature = "cuda"))]
            bail!("--device {device}: this nixl-connect was built without the `cuda` feature");
        }
        Ok(if kind == "huge" {
            let mut v = Vec::with_capacity(count);
            for _ in 0..count {
                let mut b = HostBuffer::new(size)
                    .with_context(|| format!("allocating {} for the benchmark", crate::human(size)))?;
                if let Some(s) = seed {
                    pattern::fill(&mut b, s, 0);
                }
                v.push(b);
            }
            Mem::Huge(v)
        } else {
            Mem::Vec(
                (0..count)
                    .map(|_| {
                        let mut v = vec![0u8; size];
                        if let Some(s) = seed {
                            pattern::fill(&mut v, s, 0);
                        }
                        Some(Descriptor::from(v))
                    })
                    .collect(),
            )
        })
    }

    /// Descriptors for one operation: `per` consecutive buffers starting at `first`.
    fn descriptors(&mut self, first: usize, per: usize, dest: bool) -> Result<Vec<Descriptor<'_>>> {
        Ok(match self {
            Mem::Huge(bs) => bs[first..first + per]
                .iter_mut()
                .map(|b| {
                    if dest {
                        Descriptor::from(b)
                    } else {
                        Descriptor::from(&*b)
                    }
                })
                .collect(),
            Mem::Vec(slots) => slots[first..first + per]
                .iter_mut()
                .map(|s| s.take().expect("descriptors are given back after each operation"))
                .collect(),
            Mem::Parts { buf, size, stride } => {
                // Parts from the buffer's start: each descriptor, then its gap (if any).
                let gap = *stride - *size;
                let per_slot = if gap > 0 { 2 } else { 1 };
                let sizes: Vec<usize> = (0..first + per)
                    .flat_map(|_| [*size, gap].into_iter().take(per_slot))
                    .collect();
                let all = if dest {
                    buf.descriptors_mut(&sizes)?
                } else {
                    buf.descriptors(&sizes)?
                };
                all.into_iter().step_by(per_slot).skip(first).collect()
            }
            #[cfg(feature = "cuda")]
            Mem::Gpu(gs) => gs[first..first + per]
                .iter_mut()
                .map(|g| {
                    let _ = dest;
                    g.descriptor()
                })
                .collect::<nixl_connect::Result<_>>()?,
        })
    }

    /// Takes back the owned descriptors an operation returned.
    fn recycle(&mut self, first: usize, back: Vec<Descriptor<'static>>) {
        if let Mem::Vec(slots) = self {
            for (s, d) in slots[first..].iter_mut().zip(back) {
                *s = Some(d);
            }
        }
    }

    /// True when buffer `i` holds the pattern for `seed`.
    fn holds(&self, i: usize, seed: u64) -> bool {
        match self {
            Mem::Huge(b) => pattern::first_mismatch(&b[i], seed, 0).is_none(),
            Mem::Parts { buf, size, stride } => {
                pattern::first_mismatch(&buf[i * stride..i * stride + size], seed, 0).is_none()
            }
            Mem::Vec(d) => {
                pattern::first_mismatch(d[i].as_ref().and_then(|d| d.as_slice()).unwrap_or(&[]), seed, 0)
                    .is_none()
            }
            #[cfg(feature = "cuda")]
            Mem::Gpu(g) => g[i]
                .to_host()
                .is_ok_and(|h| pattern::first_mismatch(&h, seed, 0).is_none()),
        }
    }
}

#[cfg(feature = "cuda")]
#[allow(unsafe_code)] // raw device memory
mod gpu {
    use std::sync::Arc;

    use anyhow::{bail, Result};
    use cudarc::driver::{sys, CudaContext};
    use nixl_connect::{Descriptor, Device};

    /// Device memory for the benchmark, filled from and checked against the host pattern.
    ///
    /// Allocated with `cuMemAlloc`, as PyTorch's caching allocator does: cudarc's own allocations
    /// come from the stream-ordered pool (`cuMemAllocAsync`) where the device has one, and pool
    /// memory cannot be shared through legacy CUDA IPC handles (it takes NIXL).
    pub(super) struct Gpu {
        ctx: Arc<CudaContext>,
        ptr: u64,
        size: usize,
        device: Device,
        /// The memory, when it is the library's VMM `DeviceBuffer` (else `cuMemAlloc`'s).
        vmm: Option<nixl_connect::cuda::DeviceBuffer>,
    }

    fn ok(r: sys::CUresult, what: &str) -> Result<()> {
        if r != sys::CUresult::CUDA_SUCCESS {
            bail!("{what} failed: {r:?}");
        }
        Ok(())
    }

    impl Gpu {
        pub(super) fn new(device: Device, size: usize, seed: Option<u64>, vmm: bool) -> Result<Self> {
            nixl_connect::cuda::device_count()?;
            let ctx = CudaContext::new(device.id() as usize)?;
            ctx.bind_to_thread()?;
            let mut host = vec![0u8; size];
            if let Some(s) = seed {
                crate::pattern::fill(&mut host, s, 0);
            }
            if vmm {
                let mut b = nixl_connect::cuda::DeviceBuffer::new(device, size)?;
                b.copy_from_host(&host)?;
                return Ok(Self {
                    ctx,
                    ptr: b.ptr(),
                    size,
                    device,
                    vmm: Some(b),
                });
            }
            let mut ptr: sys::CUdeviceptr = 0;
            // SAFETY: allocates `size` bytes in the bound context, then fills them from `host`
            // (synchronous copy); freed once, in Drop.
            unsafe {
                ok(sys::cuMemAlloc_v2(&mut ptr, size.max(1)), "cuMemAlloc")?;
                ok(
                    sys::cuMemcpyHtoD_v2(ptr, host.as_ptr().cast(), size),
                    "cuMemcpyHtoD",
                )?;
            }
            Ok(Self {
                ctx,
                ptr,
                size,
                device,
                vmm: None,
            })
        }

        /// A descriptor over this memory.
        pub(super) fn descriptor(&mut self) -> nixl_connect::Result<Descriptor<'static>> {
            // SAFETY: the memory stays allocated while the benchmark holds `self`, which outlives
            // every operation over it (descriptors are given back after each operation).
            unsafe { Descriptor::from_raw_cuda(self.ptr, self.size, self.device) }
        }

        pub(super) fn to_host(&self) -> Result<Vec<u8>> {
            self.ctx.bind_to_thread()?;
            let mut host = vec![0u8; self.size];
            // SAFETY: copies this allocation's `size` bytes into `host` (synchronous).
            let r = unsafe { sys::cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), self.ptr, self.size) };
            ok(r, "cuMemcpyDtoH")?;
            Ok(host)
        }
    }

    impl Drop for Gpu {
        fn drop(&mut self) {
            if self.vmm.is_some() {
                return; // the DeviceBuffer frees itself
            }
            let _ = self.ctx.bind_to_thread();
            // SAFETY: frees the allocation made in `new`, which no operation uses any more.
            unsafe { sys::cuMemFree_v2(self.ptr) };
        }
    }
}

/// One result row.
struct Row {
    block: Block,
    path: String,
    /// How the same-host path moved the bytes (`-` on another path).
    mechanism: String,
    iters: usize,
    lat: Stats,
    passive: Stats,
    /// The passive side's completion timed from the active side's start (raw NIXL's `notif_A`).
    passive_from_begin: Stats,
    /// The copy limit: one thread's process_vm_readv of the operation's ranges (one per
    /// descriptor).
    limit_gbps: Option<f64>,
    /// The same bytes as one range, for consecutive descriptors.
    one_range_gbps: Option<f64>,
    /// The passive peer's wait spin, as it reported it (microseconds).
    peer_spin_us: Option<u64>,
    ok: bool,
}

impl Row {
    fn bytes(&self) -> usize {
        self.block.size * self.block.descriptors
    }

    fn gbps(&self) -> f64 {
        (self.bytes() * self.block.concurrency) as f64 / self.lat.p50 / 1e3
    }

    fn ops_per_s(&self) -> f64 {
        self.block.concurrency as f64 / (self.lat.p50 / 1e6)
    }

    fn json(&self, a: &Args) -> serde_json::Value {
        let mut v = serde_json::json!({
            "impl": "nixl-connect",
            "op": a.op,
            "path": self.path,
            "mechanism": self.mechanism,
            "device": a.device.to_string(),
            "peer_device": a.peer_device.unwrap_or(a.device).to_string(),
            "buffers": a.buffers,
            "layout": a.layout,
            "fresh": a.fresh,
            "size": self.block.size,
            "descriptors": self.block.descriptors,
            "bytes": self.bytes(),
            "concurrency": self.block.concurrency,
            "iters": self.iters,
            "latency_mean_us": self.lat.mean,
            "latency_min_us": self.lat.min,
            "latency_p50_us": self.lat.p50,
            "latency_p99_us": self.lat.p99,
            "latency_max_us": self.lat.max,
            "passive_p50_us": self.passive.p50,
            "passive_p99_us": self.passive.p99,
            "passive_from_begin_p50_us": self.passive_from_begin.p50,
            "GBps": self.gbps(),
            "ops_per_s": self.ops_per_s(),
            "ok": self.ok,
            "wait_spin_us": self.block.wait_spin_us,
            "peer_wait_spin_us": self.peer_spin_us,
            // DESIGN.md's keys, kept for existing scripts (they name the read for any op).
            "read_median_us": self.lat.p50,
            "read_min_us": self.lat.min,
            "server_wait_median_us": self.passive.p50,
        });
        if let Some(l) = self.limit_gbps {
            v["limit_GBps"] = l.into();
            v["of_limit"] = (self.gbps() / l).into();
        }
        if let Some(l) = self.one_range_gbps {
            v["one_range_limit_GBps"] = l.into();
            v["of_one_range_limit"] = (self.gbps() / l).into();
        }
        v
    }
}

fn size_label(n: usize) -> String {
    match n {
        n if n >= 1 << 30 && n % (1 << 30) == 0 => format!("{} GiB", n >> 30),
        n if n >= 1 << 20 && n % (1 << 20) == 0 => format!("{} MiB", n >> 20),
        n if n >= 1 << 10 && n % (1 << 10) == 0 => format!("{} KiB", n >> 10),
        n => format!("{n} B"),
    }
}

fn table_header(a: &Args) {
    println!(
        "nixl-connect bench: {} {} memory, {} path, {} -> {}; latency in µs (per {}), rates in GB/s (10^9 B/s), sizes per descriptor (KiB/MiB = 2^10/2^20 B)",
        a.op,
        a.buffers,
        a.path_label(),
        a.device,
        a.peer_device.unwrap_or(a.device),
        if a.concurrency > 1 { "round of concurrent operations" } else { "operation" },
    );
    println!(
        "{:>9} {:>6} {:>5} {:>6} {:>9} {:>9} {:>9} {:>9} {:>8} {:>10} {:>9} {:>10} {:>7} {:>6} {:>3}",
        "size",
        "descs",
        "conc",
        "iters",
        "mean",
        "p50",
        "p99",
        "max",
        "GB/s",
        "ops/s",
        "passive",
        "from begin",
        "limit",
        "path",
        "ok"
    );
}

fn table_row(r: &Row) {
    println!(
        "{:>9} {:>6} {:>5} {:>6} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>8.2} {:>10.0} {:>9.1} {:>10.1} {:>7} {:>6} {:>3}",
        size_label(r.block.size),
        r.block.descriptors,
        r.block.concurrency,
        r.iters,
        r.lat.mean,
        r.lat.p50,
        r.lat.p99,
        r.lat.max,
        r.gbps(),
        r.ops_per_s(),
        r.passive.p50,
        r.passive_from_begin.p50,
        r.limit_gbps.map_or("-".into(), |l| format!("{l:.2}")),
        if r.mechanism == "-" {
            r.path.clone()
        } else {
            format!("{}/{}", r.path, r.mechanism)
        },
        if r.ok { "yes" } else { "NO" },
    );
}

impl Args {
    fn path_label(&self) -> &'static str {
        match self.path {
            PathPolicy::Nixl => "NIXL",
            PathPolicy::SameHost => "same-host",
            _ => "auto",
        }
    }
}

pub(crate) async fn run(a: Args) -> Result<()> {
    a.metrics.clone().around(async |ex| run_with(a, ex).await).await
}

async fn run_with(a: Args, ex: &crate::metrics::Exporter) -> Result<()> {
    let json = a.json || !std::io::stdout().is_terminal();
    type Out = Box<dyn tokio::io::AsyncWrite + Unpin + Send>;
    let (mut child, peer_pid, mut to_peer, mut from_peer): (_, _, Out, _) = match &a.peer_fifos {
        Some(f) if f.len() == 2 => {
            // Opened read-write, so that the open does not wait for the peer; the peer's input
            // is written through the runtime's reactor, its output read on this thread (as a
            // spawned peer's: see `lines`).
            let open = || {
                let mut o = tokio::net::unix::pipe::OpenOptions::new();
                o.read_write(true);
                o
            };
            let to: Out = Box::new(
                open()
                    .open_sender(&f[0])
                    .with_context(|| format!("opening the peer's input FIFO {}", f[0].display()))?,
            );
            // Opened read-write too, so that the open does not wait for the peer.
            let from = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&f[1])
                .with_context(|| format!("opening the peer's output FIFO {}", f[1].display()))?;
            (None, None, to, PeerLines::new(from.into()))
        }
        Some(_) => bail!("--peer-fifos takes two paths: the peer's stdin and its stdout"),
        None => {
            let exe = std::env::current_exe().context("locating this executable")?;
            let mut child = tokio::process::Command::new(exe)
                .arg("bench-peer")
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .kill_on_drop(true)
                .spawn()
                .context("starting the benchmark peer")?;
            let pid = child.id().context("the benchmark peer's pid")? as i32;
            let to: Out = Box::new(child.stdin.take().context("peer stdin")?);
            let from = child
                .stdout
                .take()
                .context("peer stdout")?
                .into_owned_fd()
                .context("the peer's stdout")?;
            (Some(child), Some(pid), to, PeerLines::new(from))
        }
    };
    let mut builder = ex.apply(Connector::builder().path(a.path));
    for (k, v) in &a.ucx_params {
        builder = builder.ucx_param(k, v);
    }
    if let Some(us) = a.progress_delay_us {
        builder = builder.progress_delay(Duration::from_micros(us));
    }
    if let Some(us) = a.wait_spin_us {
        builder = builder.wait_spin(Duration::from_micros(us));
    }
    let conn = builder.build()?;
    // What the active side runs with (the flag, its environment or the default), recorded in
    // each row and handed to the peer.
    let wait_spin_us = conn.wait_spin().as_micros() as u64;
    let write = a.op == "write";
    let (per, conc) = (a.descriptors as usize, a.concurrency as usize);
    if !json {
        table_header(&a);
    }
    for &size in &a.sizes {
        let iters = a.iters.map_or_else(|| default_iters(size * per), |n| n as usize);
        let n = iters + a.warmup as usize;
        let block = Block {
            op: a.op.clone(),
            size,
            descriptors: per,
            concurrency: conc,
            n,
            buffers: a.buffers.clone(),
            layout: a.layout.clone(),
            fresh: a.fresh,
            device: a.peer_device.unwrap_or(a.device),
            ucx_params: a.ucx_params.clone(),
            progress_delay_us: a.progress_delay_us,
            wait_spin_us: Some(wait_spin_us),
            metrics: ex.recording(),
        };
        to_peer
            .write_all(format!("{}\n", serde_json::to_string(&block)?).as_bytes())
            .await?;
        to_peer.flush().await?;
        // The active side's memory: destinations of reads, sources of writes.
        let new_mem = || {
            Mem::new(
                &a.buffers,
                &a.layout,
                size,
                per * conc,
                write.then_some(size as u64),
                a.device,
            )
        };
        let mut mem = new_mem()?;
        let (mut times, mut waits, mut from_begin) = (Vec::new(), Vec::new(), Vec::new());
        let mut ok = true;
        let mut path = String::from("-");
        let mut mechanism = String::from("-");
        let mut last_md: Option<RdmaMetadata> = None;
        let mut peer_spin_us = None;
        for i in 0..n {
            if a.fresh && i > 0 {
                drop(mem);
                mem = new_mem()?;
            }
            let mut lines = Vec::with_capacity(conc);
            for _ in 0..conc {
                lines.push(from_peer.next().await?);
            }
            let (t0, begin_ns) = (Instant::now(), monotonic_ns());
            let mut mds = Vec::with_capacity(conc);
            for l in &lines {
                mds.push(l.parse::<RdmaMetadata>()?);
            }
            let ((p, m), backs) = active_round(&conn, &mds, &mut mem, per, write).await?;
            let dt = t0.elapsed();
            for (k, back) in backs.into_iter().enumerate() {
                mem.recycle(k * per, back);
            }
            path = p;
            mechanism = m;
            // Verified on the first iteration, and with fresh memory on the last one as well.
            if !write && (i == 0 || (a.fresh && i + 1 == n)) {
                ok &= (0..per * conc).all(|k| mem.holds(k, size as u64));
            }
            for _ in 0..conc {
                let peer: PeerIter = serde_json::from_str(&from_peer.next().await?)?;
                ok &= peer.ok;
                peer_spin_us = Some(peer.spin_us);
                if i >= a.warmup as usize {
                    waits.push(peer.wait_us);
                    from_begin.push(peer.done_ns.saturating_sub(begin_ns) as f64 / 1e3);
                }
            }
            if i >= a.warmup as usize {
                times.push(dt.as_secs_f64() * 1e6);
            }
            // The last operation's memory is the one the peer still holds (with --fresh, each operation
            // had its own).
            last_md = Some(mds.swap_remove(0));
        }
        // The copy limit, in the same run: one thread's process_vm_readv of the peer's memory
        // (still mapped: the peer keeps it until the next block).
        let (limit_gbps, one_range_gbps) = match (&last_md, a.device, peer_pid) {
            (Some(md), Device::Host, Some(peer_pid))
                if a.limit && a.peer_device.unwrap_or(a.device) == Device::Host =>
            {
                let (l, one) = vm_readv_limit(peer_pid, md, size, &a.buffers, &a.layout)?;
                (Some(l), one.filter(|_| per > 1))
            }
            _ => (None, None),
        };
        let row = Row {
            block,
            path,
            mechanism,
            iters: times.len(),
            lat: stats(&mut times),
            passive: stats(&mut waits),
            passive_from_begin: stats(&mut from_begin),
            limit_gbps,
            one_range_gbps,
            peer_spin_us,
            ok,
        };
        if json {
            println!("{}", row.json(&a));
        } else {
            table_row(&row);
        }
    }
    if a.idle_cpu {
        // An idle connector must cost next to no CPU: this process's CPU time over two idle
        // seconds, after the engine's spin window has passed; first with nothing outstanding,
        // then with one readable waiting for a reader that does not come, then one writable
        // waiting for a writer.
        let waiting = HostBuffer::from_slice(&[7u8; 1 << 20])?;
        let mut landing = HostBuffer::new(1 << 20)?;
        for what in [
            "idle_connector_cpu_pct",
            "waiting_readable_cpu_pct",
            "waiting_writable_cpu_pct",
        ] {
            let _readable = match what {
                "waiting_readable_cpu_pct" => Some(conn.create_readable(Descriptor::from(&waiting)).await?),
                _ => None,
            };
            let _writable = match what {
                "waiting_writable_cpu_pct" => {
                    Some(conn.create_writable(Descriptor::from(&mut landing)).await?)
                }
                _ => None,
            };
            tokio::time::sleep(Duration::from_millis(50)).await;
            let (c0, t0) = (process_cpu_ns(), Instant::now());
            tokio::time::sleep(Duration::from_secs(2)).await;
            let (c1, wall) = (process_cpu_ns(), t0.elapsed());
            if let (Some(c0), Some(c1)) = (c0, c1) {
                let pct = (c1 - c0) as f64 / wall.as_nanos() as f64 * 100.0;
                if json {
                    println!(
                        "{}",
                        serde_json::json!({"impl": "nixl-connect", what: pct, "idle_seconds": wall.as_secs_f64(), "progress_delay_us": a.progress_delay_us.unwrap_or(1000)})
                    );
                } else {
                    println!("{what}: {pct:.3}% of a core over {:.1} s", wall.as_secs_f64());
                }
            }
        }
    }
    drop(conn);
    drop(to_peer);
    if let Some(child) = &mut child {
        let st = tokio::time::timeout(Duration::from_secs(10), child.wait()).await??;
        if !st.success() {
            bail!("benchmark peer exited with {st}");
        }
    }
    Ok(())
}

/// The copy limits of one operation (GB/s, medians): one thread's `process_vm_readv` of the
/// peer's descriptors in `md` into local memory laid out as the benchmark's (`buffers`, `layout`),
/// one range per descriptor in calls of at most 1,024 ranges; and for consecutive descriptors
/// (`--layout contiguous`, or one descriptor), the same bytes as one range.
fn vm_readv_limit(
    pid: i32,
    md: &RdmaMetadata,
    size: usize,
    buffers: &str,
    layout: &str,
) -> Result<(f64, Option<f64>)> {
    use nix::sys::uio::RemoteIoVec;
    let n = md.descriptors.len();
    let remote: Vec<RemoteIoVec> = md
        .descriptors
        .iter()
        .map(|d| RemoteIoVec {
            base: d.ptr as usize,
            len: d.size as usize,
        })
        .collect();
    let total = size * n;
    let (mut huge, mut vecs, mut one) = (Vec::new(), Vec::<Vec<u8>>::new(), None);
    let mut local: Vec<&mut [u8]> = match layout {
        "separate" if buffers == "huge" => {
            for _ in 0..n {
                huge.push(HostBuffer::new(size)?);
            }
            huge.iter_mut().map(|b| &mut b[..]).collect()
        }
        "separate" => {
            vecs.resize(n, vec![0u8; size]);
            vecs.iter_mut().map(|v| &mut v[..]).collect()
        }
        _ => {
            let stride = if layout == "scattered" { 2 * size } else { size };
            let buf = one.insert(HostBuffer::new((stride * n).max(1))?);
            buf.chunks_mut(stride.max(1))
                .take(n)
                .map(|c| &mut c[..size])
                .collect()
        }
    };
    let per_range = readv_rate(pid, &mut local, &remote, total)?;
    drop(local);
    let adjacent = remote.windows(2).all(|w| w[0].base + w[0].len == w[1].base);
    let one_range = match (one.as_mut(), remote.first()) {
        (Some(buf), Some(first)) if layout == "contiguous" && adjacent => Some(readv_rate(
            pid,
            &mut [&mut buf[..total]],
            &[RemoteIoVec {
                base: first.base,
                len: total,
            }],
            total,
        )?),
        _ if n == 1 => Some(per_range),
        _ => None,
    };
    Ok((per_range, one_range))
}

/// One thread's rate (GB/s, median of repeated reads) of `process_vm_readv` from `remote` (in
/// `pid`) into `local`, in calls of at most 1,024 ranges.
fn readv_rate(
    pid: i32,
    local: &mut [&mut [u8]],
    remote: &[nix::sys::uio::RemoteIoVec],
    total: usize,
) -> Result<f64> {
    use nix::sys::uio::process_vm_readv;
    use nix::unistd::Pid;
    for s in local.iter_mut() {
        s.fill(0);
    }
    let reps = (default_iters(total) / 2).clamp(5, 200);
    let mut v = Vec::with_capacity(reps);
    for _ in 0..reps + 2 {
        let t0 = Instant::now();
        for (l, r) in local.chunks_mut(1024).zip(remote.chunks(1024)) {
            let want: usize = r.iter().map(|r| r.len).sum();
            let mut iov: Vec<std::io::IoSliceMut<'_>> =
                l.iter_mut().map(|s| std::io::IoSliceMut::new(s)).collect();
            let got = process_vm_readv(Pid::from_raw(pid), &mut iov, r)
                .context("process_vm_readv of the peer's buffer (the copy limit)")?;
            if got != want {
                bail!("process_vm_readv read {got} of {want} bytes (the copy limit)");
            }
        }
        v.push(t0.elapsed().as_secs_f64() * 1e6);
    }
    let s = stats(&mut v[2..]);
    Ok(total as f64 / s.p50 / 1e3)
}

/// One round: an active operation per metadata, all outstanding at once; returns the path taken
/// and each operation's owned descriptors back.
async fn active_round(
    conn: &Connector,
    mds: &[RdmaMetadata],
    mem: &mut Mem,
    per: usize,
    write: bool,
) -> Result<((String, String), Vec<Vec<Descriptor<'static>>>)> {
    let t = Some(Duration::from_secs(60));
    let mut all = mem.descriptors(0, per * mds.len(), !write)?;
    let mut reads = Vec::new();
    let mut writes = Vec::new();
    for md in mds {
        let rest = all.split_off(per.min(all.len()));
        let ds = std::mem::replace(&mut all, rest);
        if write {
            writes.push(conn.begin_write(ds, md).await?);
        } else {
            reads.push(conn.begin_read(md, ds).await?);
        }
    }
    let mut path = String::from("-");
    let mut mechanism = String::from("-");
    let mut backs = Vec::with_capacity(mds.len());
    for op in reads {
        op.wait_for_completion(t).await?;
        path = op.path().map_or("-".into(), |p| p.to_string());
        mechanism = op.mechanism().map_or("-".into(), |m| m.to_string());
        backs.push(
            op.into_descriptors()
                .map_err(|_| anyhow::anyhow!("the read was not released"))?,
        );
    }
    for op in writes {
        op.wait_for_completion(t).await?;
        path = op.path().map_or("-".into(), |p| p.to_string());
        mechanism = op.mechanism().map_or("-".into(), |m| m.to_string());
        backs.push(
            op.into_descriptors()
                .map_err(|_| anyhow::anyhow!("the write was not released"))?,
        );
    }
    Ok((
        (path, mechanism),
        backs
            .into_iter()
            .map(|b| b.into_iter().filter_map(|d| d.try_into_static().ok()).collect())
            .collect(),
    ))
}

/// The passive side: for each block, `concurrency` readables (or writables) per iteration.
pub(crate) async fn peer() -> Result<()> {
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    let mut conn: Option<Connector> = None;
    // What the connector records into when asked (nothing scrapes the peer; kept for the run).
    let mut _registry = None;
    // The previous block's memory stays mapped until the next block starts (the active side
    // measures the copy limit from it).
    let mut _prev: Option<Mem> = None;
    while let Some(line) = lines.next_line().await? {
        let b: Block = serde_json::from_str(&line)?;
        let conn = match &conn {
            Some(c) => c.clone(),
            None => {
                let mut builder = Connector::builder();
                for (k, v) in &b.ucx_params {
                    builder = builder.ucx_param(k, v);
                }
                if let Some(us) = b.progress_delay_us {
                    builder = builder.progress_delay(Duration::from_micros(us));
                }
                if let Some(us) = b.wait_spin_us {
                    builder = builder.wait_spin(Duration::from_micros(us));
                }
                if b.metrics {
                    let (registry, m) = nixl_connect::metrics::Metrics::standalone();
                    builder = builder.metrics(&m);
                    _registry = Some(registry);
                }
                conn.insert(builder.build()?).clone()
            }
        };
        let write = b.op == "write";
        let count = b.descriptors * b.concurrency;
        let new_mem = || {
            Mem::new(
                &b.buffers,
                &b.layout,
                b.size,
                count,
                (!write).then_some(b.size as u64),
                b.device,
            )
        };
        let mut mem = new_mem()?;
        for i in 0..b.n {
            if b.fresh && i > 0 {
                drop(mem);
                mem = new_mem()?;
            }
            let done = passive_round(&conn, &mut mem, b.descriptors, b.concurrency, write).await?;
            let check = write && (i == 0 || (b.fresh && i + 1 == b.n));
            let ok = !check || (0..count).all(|k| mem.holds(k, b.size as u64));
            for (wait_us, done_ns) in done {
                let spin_us = conn.wait_spin().as_micros() as u64;
                println!(
                    "{}",
                    serde_json::to_string(&PeerIter {
                        wait_us,
                        ok,
                        done_ns,
                        spin_us
                    })?
                );
            }
        }
        _prev = Some(mem);
    }
    Ok(())
}

/// One round of passive operations, published on stdout; returns each one's wait (publish to
/// completion) in microseconds, and when it completed ([`monotonic_ns`]).
async fn passive_round(
    conn: &Connector,
    mem: &mut Mem,
    per: usize,
    conc: usize,
    write: bool,
) -> Result<Vec<(f64, u64)>> {
    use std::io::Write;
    let t = Some(Duration::from_secs(60));
    let mut all = mem.descriptors(0, per * conc, write)?;
    let mut readables = Vec::new();
    let mut writables = Vec::new();
    let mut out = String::new();
    for _ in 0..conc {
        let rest = all.split_off(per.min(all.len()));
        let ds = std::mem::replace(&mut all, rest);
        if write {
            let op = conn.create_writable(ds).await?;
            out.push_str(&op.metadata().to_json());
            writables.push(op);
        } else {
            let op = conn.create_readable(ds).await?;
            out.push_str(&op.metadata().to_json());
            readables.push(op);
        }
        out.push('\n');
    }
    let t0 = Instant::now();
    {
        // A blocking write of a few lines: tokio's stdout would hop through its blocking pool.
        let mut o = std::io::stdout().lock();
        o.write_all(out.as_bytes())?;
        o.flush()?;
    }
    let mut waits = Vec::with_capacity(conc);
    let mut backs = Vec::with_capacity(conc);
    for op in readables {
        op.wait_for_completion(t).await?;
        waits.push((t0.elapsed().as_secs_f64() * 1e6, monotonic_ns()));
        backs.push(op.into_descriptors());
    }
    for op in writables {
        op.wait_for_completion(t).await?;
        waits.push((t0.elapsed().as_secs_f64() * 1e6, monotonic_ns()));
        backs.push(op.into_descriptors());
    }
    let owned: Vec<Vec<Descriptor<'static>>> = backs
        .into_iter()
        .map(|b| b.into_iter().filter_map(|d| d.try_into_static().ok()).collect())
        .collect();
    for (k, back) in owned.into_iter().enumerate() {
        mem.recycle(k * per, back);
    }
    Ok(waits)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bench_stats_are_ordered_and_handle_one_sample() {
        let s = stats(&mut [5.0]);
        assert_eq!((s.min, s.p50, s.p99, s.max, s.mean), (5.0, 5.0, 5.0, 5.0, 5.0));
        let mut v: Vec<f64> = (1..=100).map(f64::from).collect();
        let s = stats(&mut v);
        assert!(s.min <= s.p50 && s.p50 <= s.p99 && s.p99 <= s.max);
        assert_eq!(s.max, 100.0);
        assert_eq!(stats(&mut []).p50, 0.0);
    }

    #[test]
    fn bench_size_labels_are_binary_units() {
        assert_eq!(size_label(4096), "4 KiB");
        assert_eq!(size_label(64 << 20), "64 MiB");
        assert_eq!(size_label(1000), "1000 B");
    }
}
