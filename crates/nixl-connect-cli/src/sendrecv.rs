//! `send` and `recv`: move a file between two processes with a read operation, the metadata and a
//! checksum travelling through the embedded HTTP channel.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use nixl_connect::channel::http::{self, HttpChannel};
use nixl_connect::{Connector, Descriptor, HostBuffer};

use crate::pattern;
use crate::transfer::write_atomic;

#[derive(clap::Args, Debug)]
pub(crate) struct SendArgs {
    /// The file to send (memory-mapped, not copied).
    file: PathBuf,
    /// Address the HTTP listener binds (default 127.0.0.1:0; 0.0.0.0:PORT for other hosts).
    #[arg(long)]
    listen: Option<std::net::SocketAddr>,
    /// Seconds to wait for the receiver.
    #[arg(long, default_value_t = 300.0)]
    timeout: f64,
}

#[derive(clap::Args, Debug)]
pub(crate) struct RecvArgs {
    /// The URL `send` printed.
    url: String,
    /// Where to save the file (default: the sender's file name, in this folder).
    #[arg(short = 'o', long = "out")]
    out: Option<PathBuf>,
    /// Seconds for the whole transfer.
    #[arg(long, default_value_t = 300.0)]
    timeout: f64,
}

fn secs(s: f64) -> Result<Duration> {
    if !(s.is_finite() && s > 0.0) {
        bail!("--timeout must be a positive number of seconds");
    }
    Ok(Duration::from_secs_f64(s))
}

#[allow(unsafe_code)]
fn map(file: &std::fs::File) -> std::io::Result<memmap2::Mmap> {
    // SAFETY: the map is read-only and only read while this process holds it. Another process
    // truncating the file meanwhile would fault on access, as with any mmap; `send` documents that
    // the file must not change while it is being sent.
    unsafe { memmap2::Mmap::map(file) }
}

pub(crate) async fn send(a: SendArgs) -> Result<()> {
    let timeout = secs(a.timeout)?;
    let file = std::fs::File::open(&a.file).with_context(|| format!("opening {}", a.file.display()))?;
    let size = file.metadata()?.len() as usize;
    if size == 0 {
        bail!("{} is empty; there is nothing to send", a.file.display());
    }
    let data = map(&file).with_context(|| format!("mapping {}", a.file.display()))?;
    let checksum = pattern::checksum(&[&data]);
    let name = a
        .file
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("received.bin")
        .to_string();
    let conn = Connector::new()?;
    let readable = conn.create_readable(Descriptor::from(&data[..])).await?;
    let channel = match a.listen {
        Some(addr) => HttpChannel::bind(addr).await?,
        None => HttpChannel::global().await?,
    };
    let extra = serde_json::json!({"checksum": checksum, "size": size, "name": name});
    let publication = channel.publish_with(readable.metadata(), &extra);
    println!("{}", publication.url());
    eprintln!(
        "nixl-connect: sending {} ({} bytes); on the receiving side run: nixl-connect recv {}",
        a.file.display(),
        size,
        publication.url()
    );
    readable
        .wait_for_completion(Some(timeout))
        .await
        .map_err(|e| anyhow::anyhow!("no receiver read the file: {e}"))?;
    drop(publication);
    eprintln!("nixl-connect: sent {name}");
    Ok(())
}

pub(crate) async fn recv(a: RecvArgs) -> Result<()> {
    let timeout = secs(a.timeout)?;
    let t0 = Instant::now();
    let fetch_limit = timeout.min(Duration::from_secs(30));
    let md = http::fetch(&a.url, fetch_limit).await?;
    let extra = http::fetch_extra(&a.url, fetch_limit).await?;
    let want = extra["checksum"]
        .as_str()
        .context("the sender published no checksum")?
        .to_string();
    let size: usize = md.descriptors.iter().map(|d| d.size as usize).sum();
    if extra["size"].as_u64() != Some(size as u64) {
        bail!(
            "the sender announced {} bytes but its metadata describes {size}",
            extra["size"]
        );
    }
    let out = match a.out {
        Some(p) => p,
        None => {
            let name = extra["name"].as_str().unwrap_or("received.bin");
            // Never let a sender choose a path outside the current folder.
            let base = std::path::Path::new(name)
                .file_name()
                .context("the sender's file name is empty")?;
            PathBuf::from(base)
        }
    };
    // Fault the pages in before the transfer: first-touch faults inside the kernel's cross-process
    // copy cost about twice as much as touching the memory here (measured: 1 GiB, 1.9 s vs 0.8 s).
    let t_alloc = Instant::now();
    let mut buf = HostBuffer::new(size)?;
    buf.fill(0);
    let alloc = t_alloc.elapsed();
    let conn = Connector::new()?;
    let bar = std::io::stderr().is_terminal().then(|| {
        let b = indicatif::ProgressBar::new_spinner();
        b.set_message(format!("receiving {size} bytes from {}", a.url));
        b.enable_steady_tick(Duration::from_millis(100));
        b
    });
    let t_read = Instant::now();
    let result = async {
        let op = conn.begin_read(&md, Descriptor::from(&mut buf)).await?;
        op.wait_for_completion(Some(
            timeout.saturating_sub(t0.elapsed()).max(Duration::from_millis(1)),
        ))
        .await
    }
    .await;
    let took = t_read.elapsed();
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    result.map_err(|e| anyhow::anyhow!("receiving from {} failed: {e}", a.url))?;
    let got = pattern::checksum(&[&buf]);
    if got != want {
        bail!("checksum mismatch: the sender published {want}, received {got}; nothing was saved");
    }
    write_atomic(&out, &[&buf])?;
    println!(
        "received {} bytes into {}: transfer {:.1} ms ({:.2} GB/s), memory set-up {:.1} ms, {:.2} s in all; \
         checksum {got} verified",
        size,
        out.display(),
        took.as_secs_f64() * 1e3,
        size as f64 / took.as_secs_f64() / 1e9,
        alloc.as_secs_f64() * 1e3,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}
