//! `serve`, `read`, `write`: move data by hand (and drive the interop tests).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use nixl_connect::{Connector, Descriptor, Device, HostBuffer, PathPolicy, RdmaMetadata};

use crate::pattern;

/// The seed of `serve --size`'s pattern.
pub(crate) const SERVE_SEED: u64 = 0x6e69_786c;

#[derive(clap::Args, Debug)]
#[command(group(clap::ArgGroup::new("source").required(true).args(["file", "size"])))]
pub(crate) struct ServeArgs {
    /// Expose this file's bytes (or, with --writable, take its size).
    #[arg(long)]
    file: Option<PathBuf>,
    /// Expose this many bytes of a deterministic pattern (or a writable of this size).
    #[arg(long, value_parser = crate::parse_nonzero_size)]
    size: Option<usize>,
    /// Create a writable instead of a readable.
    #[arg(long)]
    writable: bool,
    /// Split the buffer into N descriptors of unequal sizes.
    #[arg(long, default_value_t = 1)]
    descriptors: usize,
    /// The device of the memory (only `cpu` here).
    #[arg(long, default_value = "cpu")]
    device: Device,
    /// Where a writable saves what it received.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Seconds to wait for the peer.
    #[arg(long, default_value_t = 60.0)]
    timeout: f64,
    /// Print the result as a JSON line on stdout (instead of a line on stderr).
    #[arg(long)]
    json: bool,
    /// Also publish the metadata in etcd, held by a lease while this command runs:
    /// `etcd://HOST:PORT/KEY`, or a prefix ending in `/` for a fresh name (the location is
    /// printed on stderr).
    #[arg(long)]
    publish: Option<String>,
    #[command(flatten)]
    pub(crate) metrics: crate::metrics::MetricsArgs,
}

#[derive(clap::Args, Debug)]
pub(crate) struct ReadArgs {
    /// The readable's RdmaMetadata JSON: a file, `-` for stdin, or `etcd://HOST:PORT/KEY` (waits
    /// up to --timeout for it to be published).
    #[arg(long)]
    metadata: String,
    /// Which path may move the bytes: auto (same-host when the peer is a Rust connector on
    /// this host, else NIXL), nixl, or local.
    #[arg(long, default_value = "auto")]
    path: PathPolicy,
    /// Where to save the bytes (descriptors concatenated).
    #[arg(long)]
    out: PathBuf,
    /// Seconds for the whole command.
    #[arg(long, default_value_t = 60.0)]
    timeout: f64,
    /// Print the result as a JSON line on stdout (instead of a line on stderr).
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    pub(crate) metrics: crate::metrics::MetricsArgs,
}

#[derive(clap::Args, Debug)]
pub(crate) struct WriteArgs {
    /// The writable's RdmaMetadata JSON: a file, `-` for stdin, or `etcd://HOST:PORT/KEY`.
    #[arg(long)]
    metadata: String,
    /// Which path may move the bytes: auto, nixl, or local.
    #[arg(long, default_value = "auto")]
    path: PathPolicy,
    /// The bytes to write; its size must equal the writable's total size.
    #[arg(long)]
    file: PathBuf,
    /// Seconds for the whole command.
    #[arg(long, default_value_t = 60.0)]
    timeout: f64,
    /// Print the result as a JSON line on stdout (instead of a line on stderr).
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    pub(crate) metrics: crate::metrics::MetricsArgs,
}

/// Sizes of `n` unequal parts of `total` (weights 1, 2, ..., n), each at least one byte.
/// The most descriptors a buffer is split into.
pub(crate) const MAX_SPLIT: usize = 1 << 20;

pub(crate) fn split_sizes(total: usize, n: usize) -> Result<Vec<usize>> {
    if n == 0 {
        bail!("--descriptors must be at least 1");
    }
    if n > MAX_SPLIT {
        bail!("--descriptors is at most {MAX_SPLIT}");
    }
    if total < n {
        bail!("cannot split {total} bytes into {n} non-empty descriptors");
    }
    let weight: usize = n * (n + 1) / 2; // n <= 2^20: no overflow
    let mut sizes: Vec<usize> = (1..=n).map(|w| (total / weight * w).max(1)).collect();
    let used: usize = sizes[..n - 1].iter().sum();
    sizes[n - 1] = total - used;
    Ok(sizes)
}

fn timeout_of(secs: f64) -> Result<Duration> {
    if !(secs.is_finite() && secs > 0.0) {
        bail!("--timeout must be a positive number of seconds");
    }
    Ok(Duration::from_secs_f64(secs))
}

/// Writes `parts` to `path` through a temporary file renamed into place, so a failure never
/// leaves a complete-looking file.
pub(crate) fn write_atomic(path: &Path, parts: &[&[u8]]) -> Result<()> {
    let tmp = path.with_file_name(format!(
        ".{}.partial-{}",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("out"),
        std::process::id()
    ));
    let r = (|| -> Result<()> {
        use std::io::Write;
        let mut f = std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        for p in parts {
            f.write_all(p)?;
        }
        f.sync_all()?;
        std::fs::rename(&tmp, path).with_context(|| format!("renaming into {}", path.display()))?;
        Ok(())
    })();
    if r.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    r
}

pub(crate) async fn read_metadata(src: &str, timeout: Duration) -> Result<RdmaMetadata> {
    if let Some(loc) = crate::etcd::Location::parse(src) {
        return crate::etcd::fetch(&loc?, timeout).await;
    }
    let text = if src == "-" {
        let mut s = String::new();
        tokio::io::AsyncReadExt::read_to_string(&mut tokio::io::stdin(), &mut s).await?;
        s
    } else {
        std::fs::read_to_string(src).with_context(|| format!("reading metadata file {src}"))?
    };
    // The first JSON object line: tools that print the metadata may log other lines around it
    // (NIXL's Python logger writes to stdout).
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with('{'))
        .or_else(|| text.lines().find(|l| !l.trim().is_empty()))
        .unwrap_or("");
    if line.is_empty() {
        bail!("the metadata in {src} is empty; pass the JSON line a serve/readable/writable printed");
    }
    Ok(line.parse::<RdmaMetadata>()?)
}

/// Bytes from a peer's metadata, checked: each size fits this machine, and so does the total.
fn sizes_of(md: &RdmaMetadata) -> Result<(Vec<usize>, usize)> {
    let sizes: Vec<usize> = md
        .descriptors
        .iter()
        .map(|d| usize::try_from(d.size).ok())
        .collect::<Option<_>>()
        .context("a descriptor's size does not fit this machine's addresses")?;
    let total = sizes
        .iter()
        .try_fold(0usize, |s, &n| s.checked_add(n))
        .context("the metadata's descriptor sizes add up past 2^64 bytes")?;
    Ok((sizes, total))
}

/// Owned buffers of `sizes` (kept by the engine if an operation on them is dropped).
fn buffers(sizes: &[usize]) -> Result<Vec<Descriptor<'static>>> {
    sizes
        .iter()
        .map(|&s| {
            HostBuffer::new(s)
                .map(Descriptor::from)
                .with_context(|| format!("cannot allocate {} for a descriptor", crate::human_bytes(s)))
        })
        .collect()
}

/// Reports a finished transfer: one human line on stderr, or a JSON line on stdout.
fn report(
    json: bool,
    what: &str,
    bytes: usize,
    took: Duration,
    path: Option<nixl_connect::TransferPath>,
    mechanism: Option<nixl_connect::Mechanism>,
    file: Option<&Path>,
) {
    let gbps = bytes as f64 / took.as_secs_f64().max(1e-9) / 1e9;
    let path = path.map_or("-".to_string(), |p| p.to_string());
    let mechanism = mechanism.map(|m| m.to_string());
    if json {
        println!(
            "{}",
            serde_json::json!({
                "op": what, "bytes": bytes, "seconds": took.as_secs_f64(), "GBps": gbps, "path": path,
                "mechanism": mechanism, "file": file.map(|f| f.display().to_string()),
            })
        );
    } else {
        eprintln!(
            "nixl-connect: {what} {} in {:.1} ms ({gbps:.2} GB/s, {path} path{}){}",
            crate::human_bytes(bytes),
            took.as_secs_f64() * 1e3,
            mechanism.map_or(String::new(), |m| format!(" through {m}")),
            file.map_or(String::new(), |f| format!(", {}", f.display())),
        );
    }
}

/// Publishes `md` at `loc` when there is one, saying where on stderr; the publication lasts as
/// long as the returned guard.
async fn published(
    loc: Option<&crate::etcd::Location>,
    md: &RdmaMetadata,
    timeout: Duration,
) -> Result<Option<nixl_connect::channel::etcd::EtcdPublication>> {
    let Some(loc) = loc else { return Ok(None) };
    let (p, url) = crate::etcd::publish(loc, md, timeout).await?;
    eprintln!("published at {url}");
    Ok(Some(p))
}

/// Takes the metadata back out of etcd, waiting for etcd to confirm, before the command goes on
/// to exit: a publication merely dropped revokes its lease from a task that the exit may cut off,
/// leaving the key to a reader for up to the lease's time to live.
async fn unpublished(p: Option<nixl_connect::channel::etcd::EtcdPublication>) {
    if let Some(p) = p {
        if let Err(e) = p.unpublish().await {
            eprintln!("warning: unpublishing from etcd: {e} (the key expires with its lease)");
        }
    }
}

pub(crate) async fn serve(a: ServeArgs) -> Result<()> {
    a.metrics.clone().around(async |ex| serve_with(a, ex).await).await
}

async fn serve_with(a: ServeArgs, ex: &crate::metrics::Exporter) -> Result<()> {
    if a.device != Device::Host {
        bail!("--device {}: only cpu memory is served by this command", a.device);
    }
    let timeout = timeout_of(a.timeout)?;
    if a.writable && a.out.is_none() {
        bail!("--writable needs --out PATH to save what it receives");
    }
    let mut buf = match (&a.file, a.size) {
        (Some(f), _) if !a.writable => {
            let data = std::fs::read(f).with_context(|| format!("cannot read {}", f.display()))?;
            if data.is_empty() {
                bail!("{} is empty; there is nothing to serve", f.display());
            }
            HostBuffer::from_slice(&data)?
        }
        (Some(f), _) => HostBuffer::new(
            std::fs::metadata(f)
                .with_context(|| format!("cannot read {}", f.display()))?
                .len() as usize,
        )?,
        (None, Some(0)) => bail!("--size must be at least 1 byte"),
        (None, Some(n)) => {
            let mut b =
                HostBuffer::new(n).with_context(|| format!("cannot allocate {}", crate::human_bytes(n)))?;
            if !a.writable {
                pattern::fill(&mut b, SERVE_SEED, 0);
            }
            b
        }
        (None, None) => unreachable!("clap requires --file or --size"),
    };
    let sizes = split_sizes(buf.len(), a.descriptors)?;
    let publish_at = a.publish.as_deref().map(|p| {
        crate::etcd::Location::parse(p)
            .unwrap_or_else(|| Err(anyhow::anyhow!("--publish {p:?}: write etcd://HOST:PORT/KEY")))
    });
    let publish_at = publish_at.transpose()?;
    let conn = ex.apply(Connector::builder()).build()?;
    let bytes = buf.len();
    let t0;
    let path;
    if a.writable {
        let op = conn.create_writable(buf.descriptors_mut(&sizes)?).await?;
        println!("{}", op.metadata().to_json());
        let publication = published(publish_at.as_ref(), op.metadata(), timeout).await?;
        t0 = Instant::now();
        op.wait_for_completion(Some(timeout))
            .await
            .map_err(|e| anyhow::Error::new(e).context("no peer wrote the writable"))?;
        unpublished(publication).await;
        path = op.path();
        let back = op.into_descriptors();
        let parts: Vec<&[u8]> = back.iter().filter_map(|d| d.as_slice()).collect();
        write_atomic(a.out.as_deref().expect("checked above"), &parts)?;
    } else {
        let op = conn.create_readable(buf.descriptors(&sizes)?).await?;
        println!("{}", op.metadata().to_json());
        let publication = published(publish_at.as_ref(), op.metadata(), timeout).await?;
        t0 = Instant::now();
        op.wait_for_completion(Some(timeout))
            .await
            .map_err(|e| anyhow::Error::new(e).context("no peer read the readable"))?;
        unpublished(publication).await;
        path = op.path();
    }
    let what = if a.writable {
        "served a writable of"
    } else {
        "served a readable of"
    };
    report(a.json, what, bytes, t0.elapsed(), path, None, a.out.as_deref());
    Ok(())
}

pub(crate) async fn read(a: ReadArgs) -> Result<()> {
    a.metrics.clone().around(async |ex| read_with(a, ex).await).await
}

async fn read_with(a: ReadArgs, ex: &crate::metrics::Exporter) -> Result<()> {
    let timeout = timeout_of(a.timeout)?;
    let t0 = Instant::now();
    let md = read_metadata(&a.metadata, timeout).await?;
    let (sizes, total) = sizes_of(&md)?;
    // Owned memory: if the deadline passes, dropping the operation never blocks on the peer.
    let descs = buffers(&sizes)?;
    let conn = ex.apply(Connector::builder().path(a.path)).build()?;
    let done = async {
        let t1 = Instant::now();
        let op = conn.begin_read(&md, descs).await?;
        let left = timeout.saturating_sub(t0.elapsed()).max(Duration::from_millis(1));
        op.wait_for_completion(Some(left)).await.map_err(|e| match e {
            nixl_connect::Error::TimedOut { peer, .. } => crate::Exit::timed_out(format!(
                "timed out after {} s reading from {}",
                a.timeout,
                peer.as_deref().unwrap_or("the peer")
            )),
            e => anyhow::Error::new(e).context("reading"),
        })?;
        let took = t1.elapsed();
        let (path, mechanism) = (op.path(), op.mechanism());
        let back = op
            .into_descriptors()
            .map_err(|_| anyhow::anyhow!("the read was not released"))?;
        let parts: Vec<&[u8]> = back.iter().filter_map(|d| d.as_slice()).collect();
        write_atomic(&a.out, &parts)?;
        report(a.json, "read", total, took, path, mechanism, Some(&a.out));
        Ok(())
    }
    .await;
    close_by(conn, t0 + timeout).await;
    done
}

pub(crate) async fn write(a: WriteArgs) -> Result<()> {
    a.metrics.clone().around(async |ex| write_with(a, ex).await).await
}

async fn write_with(a: WriteArgs, ex: &crate::metrics::Exporter) -> Result<()> {
    let timeout = timeout_of(a.timeout)?;
    let t0 = Instant::now();
    let data = std::fs::read(&a.file).with_context(|| format!("cannot read {}", a.file.display()))?;
    let md = read_metadata(&a.metadata, timeout).await?;
    let (sizes, total) = sizes_of(&md)?;
    if total != data.len() {
        bail!(
            "{} is {} bytes but the writable takes {total} bytes in {} descriptors; sizes must add up",
            a.file.display(),
            data.len(),
            sizes.len()
        );
    }
    // Owned memory, one buffer per descriptor: dropping the operation at the deadline never blocks.
    let mut descs = Vec::with_capacity(sizes.len());
    let mut off = 0;
    for &s in &sizes {
        descs.push(Descriptor::from(HostBuffer::from_slice(&data[off..off + s])?));
        off += s;
    }
    let conn = ex.apply(Connector::builder().path(a.path)).build()?;
    let done = async {
        let t1 = Instant::now();
        let op = conn.begin_write(descs, &md).await?;
        let left = timeout.saturating_sub(t0.elapsed()).max(Duration::from_millis(1));
        op.wait_for_completion(Some(left)).await.map_err(|e| match e {
            nixl_connect::Error::TimedOut { .. } => crate::Exit::timed_out(format!(
                "timed out after {} s writing {}",
                a.timeout,
                a.file.display()
            )),
            e => anyhow::Error::new(e).context(format!("writing {}", a.file.display())),
        })?;
        report(
            a.json,
            "wrote",
            total,
            t1.elapsed(),
            op.path(),
            op.mechanism(),
            Some(&a.file),
        );
        Ok(())
    }
    .await;
    close_by(conn, t0 + timeout).await;
    done
}

/// Ends `conn` within what is left of `deadline`: a copy that a stalled peer holds is left
/// behind (its memory leaked as the process exits) instead of waited for 10 s more.
async fn close_by(conn: Connector, deadline: Instant) {
    let left = deadline.saturating_duration_since(Instant::now());
    let _ = tokio::task::spawn_blocking(move || conn.shutdown_timeout(left)).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_sizes_are_unequal_and_add_up() {
        let s = split_sizes(1 << 20, 8).unwrap();
        assert_eq!(s.iter().sum::<usize>(), 1 << 20);
        assert!(s.windows(2).all(|w| w[0] != w[1] || w[0] == 1));
        assert!(split_sizes(3, 4).is_err());
        assert_eq!(split_sizes(10, 1).unwrap(), vec![10]);
    }

    fn metadata(sizes: &[u64]) -> RdmaMetadata {
        RdmaMetadata {
            descriptors: sizes
                .iter()
                .map(|&size| nixl_connect::SerializedDescriptor {
                    device: nixl_connect::Device::Host,
                    ptr: 4096,
                    size,
                })
                .collect(),
            nixl_metadata: "b64:".into(),
            notification_key: "k".into(),
            operation_kind: 1,
        }
    }

    proptest::proptest! {
        #[test]
        fn cli_split_sizes_add_up_or_refuse(total in 0usize..(1 << 40), n in 0usize..(MAX_SPLIT + 10)) {
            match split_sizes(total, n) {
                Ok(v) => {
                    proptest::prop_assert_eq!(v.len(), n);
                    proptest::prop_assert_eq!(v.iter().sum::<usize>(), total);
                    proptest::prop_assert!(v.iter().all(|&x| x > 0));
                }
                Err(_) => proptest::prop_assert!(n == 0 || n > MAX_SPLIT || total < n),
            }
        }

        #[test]
        fn cli_metadata_sizes_add_up_or_are_an_error(sizes in proptest::collection::vec(proptest::num::u64::ANY, 1..12)) {
            let total = sizes.iter().try_fold(0u64, |a, &b| a.checked_add(b));
            match sizes_of(&metadata(&sizes)) {
                Ok((v, t)) => {
                    proptest::prop_assert_eq!(Some(t as u64), total);
                    proptest::prop_assert_eq!(v.len(), sizes.len());
                }
                Err(e) => {
                    proptest::prop_assert!(total.is_none(), "refused {:?}: {}", sizes, e);
                }
            }
        }
    }
}
