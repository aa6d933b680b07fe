//! `serve`, `read`, `write`: move data by hand (and drive the interop tests).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use nixl_connect::{Connector, Device, HostBuffer, PathPolicy, RdmaMetadata};

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
    #[arg(long, value_parser = crate::parse_size)]
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
}

#[derive(clap::Args, Debug)]
pub(crate) struct ReadArgs {
    /// The readable's RdmaMetadata JSON: a file, or `-` for stdin.
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
}

#[derive(clap::Args, Debug)]
pub(crate) struct WriteArgs {
    /// The writable's RdmaMetadata JSON: a file, or `-` for stdin.
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
}

/// Sizes of `n` unequal parts of `total` (weights 1, 2, ..., n), each at least one byte.
pub(crate) fn split_sizes(total: usize, n: usize) -> Result<Vec<usize>> {
    if n == 0 {
        bail!("--descriptors must be at least 1");
    }
    if total < n {
        bail!("cannot split {total} bytes into {n} non-empty descriptors");
    }
    let weight: usize = (1..=n).sum();
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

async fn within<T>(secs: f64, what: &str, f: impl std::future::Future<Output = Result<T>>) -> Result<T> {
    let t = timeout_of(secs)?;
    match tokio::time::timeout(t, f).await {
        Ok(r) => r,
        Err(_) => bail!("timed out after {secs} s {what}"),
    }
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

async fn read_metadata(src: &str) -> Result<RdmaMetadata> {
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

pub(crate) async fn serve(a: ServeArgs) -> Result<()> {
    if a.device != Device::Host {
        bail!("--device {}: only cpu memory is served by this command", a.device);
    }
    let timeout = timeout_of(a.timeout)?;
    if a.writable && a.out.is_none() {
        bail!("--writable needs --out PATH to save what it receives");
    }
    let mut buf = match (&a.file, a.size) {
        (Some(f), _) if !a.writable => {
            let data = std::fs::read(f).with_context(|| format!("reading {}", f.display()))?;
            HostBuffer::from_slice(&data)?
        }
        (Some(f), _) => HostBuffer::new(
            std::fs::metadata(f)
                .with_context(|| format!("reading {}", f.display()))?
                .len() as usize,
        )?,
        (None, Some(n)) => {
            let mut b = HostBuffer::new(n)?;
            if !a.writable {
                pattern::fill(&mut b, SERVE_SEED, 0);
            }
            b
        }
        (None, None) => unreachable!("clap requires --file or --size"),
    };
    let sizes = split_sizes(buf.len(), a.descriptors)?;
    let conn = Connector::new()?;
    if a.writable {
        let op = conn.create_writable(buf.descriptors_mut(&sizes)?).await?;
        println!("{}", op.metadata().to_json());
        op.wait_for_completion(Some(timeout))
            .await
            .map_err(|e| anyhow::anyhow!("no peer wrote the writable: {e}"))?;
        let back = op.into_descriptors();
        let parts: Vec<&[u8]> = back.iter().filter_map(|d| d.as_slice()).collect();
        write_atomic(a.out.as_deref().expect("checked above"), &parts)?;
    } else {
        let op = conn.create_readable(buf.descriptors(&sizes)?).await?;
        println!("{}", op.metadata().to_json());
        op.wait_for_completion(Some(timeout))
            .await
            .map_err(|e| anyhow::anyhow!("no peer read the readable: {e}"))?;
    }
    Ok(())
}

pub(crate) async fn read(a: ReadArgs) -> Result<()> {
    let out = a.out.clone();
    within(a.timeout, "reading", async move {
        let md = read_metadata(&a.metadata).await?;
        let sizes: Vec<usize> = md.descriptors.iter().map(|d| d.size as usize).collect();
        let total: usize = sizes.iter().sum();
        let mut buf = HostBuffer::new(total)?;
        let conn = Connector::builder().path(a.path).build()?;
        let op = conn.begin_read(&md, buf.descriptors_mut(&sizes)?).await?;
        op.wait_for_completion(None).await?;
        drop(op);
        write_atomic(&out, &[&buf])?;
        Ok(())
    })
    .await
}

pub(crate) async fn write(a: WriteArgs) -> Result<()> {
    within(a.timeout, "writing", async move {
        let data = std::fs::read(&a.file).with_context(|| format!("reading {}", a.file.display()))?;
        let md = read_metadata(&a.metadata).await?;
        let sizes: Vec<usize> = md.descriptors.iter().map(|d| d.size as usize).collect();
        let total: usize = sizes.iter().sum();
        if total != data.len() {
            bail!(
                "{} is {} bytes but the writable takes {total} bytes in {} descriptors; sizes must add up",
                a.file.display(),
                data.len(),
                sizes.len()
            );
        }
        let buf = HostBuffer::from_slice(&data)?;
        let conn = Connector::builder().path(a.path).build()?;
        let op = conn.begin_write(buf.descriptors(&sizes)?, &md).await?;
        op.wait_for_completion(None).await?;
        Ok(())
    })
    .await
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
}
