//! `send` and `recv`: deliver a file between two processes, confirmed end to end.
//!
//! `send` memory-maps the file, hashes it (SHA-256), exposes it as readables of [`CHUNK`] bytes
//! each, and publishes the first one's metadata on the embedded HTTP channel with the others, the
//! file's name, size and hash beside it. `recv` checks where it will save before anything moves:
//! it resolves the destination (a directory means "into it", like `cp`), refuses to overwrite
//! unless `--force`, creates a hidden partial file next to the destination and reserves its space
//! (`fallocate`), and maps it; then it reads every chunk straight into that mapping, verifies the
//! hash, syncs the file, renames it into place and syncs the folder. Only then does it confirm to
//! the sender (`POST <url>/reply`) with the hash it computed; the sender says "delivered" only on
//! that confirmation. Any failure, SIGINT or SIGTERM removes the partial file and is reported to
//! the sender.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use nixl_connect::channel::http::{self, HttpChannel};
use nixl_connect::{Connector, Descriptor, Device, RdmaMetadata};
use sha2::{Digest, Sha256};

use crate::Exit;

/// Bytes per readable: the receiver's progress moves at this step.
const CHUNK: usize = 64 << 20;

#[derive(clap::Args, Debug)]
pub(crate) struct SendArgs {
    /// The file to send (memory-mapped, not copied; it must not change while it is sent).
    file: PathBuf,
    /// Address the HTTP listener binds (default 127.0.0.1:0; 0.0.0.0:PORT for other hosts).
    #[arg(long)]
    listen: Option<std::net::SocketAddr>,
    /// Seconds to wait for the receiver to read and confirm.
    #[arg(long, default_value_t = 300.0)]
    timeout: f64,
    #[command(flatten)]
    metrics: crate::metrics::MetricsArgs,
}

#[derive(clap::Args, Debug)]
pub(crate) struct RecvArgs {
    /// The URL `send` printed.
    url: String,
    /// Where to save: a file path, or an existing folder to save into under the sender's file name
    /// (default: the sender's file name in the current folder).
    #[arg(short = 'o', long = "out")]
    out: Option<PathBuf>,
    /// Overwrite the destination if it exists.
    #[arg(short = 'f', long)]
    force: bool,
    /// Seconds for the whole transfer.
    #[arg(long, default_value_t = 300.0)]
    timeout: f64,
    #[command(flatten)]
    metrics: crate::metrics::MetricsArgs,
}

fn secs(s: f64) -> Result<Duration> {
    if !(s.is_finite() && s > 0.0) {
        bail!("--timeout must be a positive number of seconds");
    }
    Ok(Duration::from_secs_f64(s))
}

/// A progress bar on stderr when it is a terminal; nothing otherwise.
fn bar(len: u64, what: &str) -> Option<indicatif::ProgressBar> {
    styled_bar(
        len,
        what,
        "{msg:>10} [{bar:30}] {bytes}/{total_bytes} {decimal_bytes_per_sec} eta {eta}",
    )
}

/// The sender's bar: bytes only, since it learns of progress a chunk at a time and cannot tell
/// when the receiver started (the receiver's bar shows the rate).
fn count_bar(len: u64, what: &str) -> Option<indicatif::ProgressBar> {
    styled_bar(len, what, "{msg:>10} [{bar:30}] {bytes}/{total_bytes}")
}

fn styled_bar(len: u64, what: &str, template: &str) -> Option<indicatif::ProgressBar> {
    std::io::stderr().is_terminal().then(|| {
        let b = indicatif::ProgressBar::new(len);
        b.set_style(
            indicatif::ProgressStyle::with_template(template)
                .expect("a valid template")
                .progress_chars("=> "),
        );
        b.set_message(what.to_string());
        b
    })
}

/// A spinner on stderr for a phase whose progress cannot be counted, when stderr is a terminal.
fn spinner(what: &str) -> Option<indicatif::ProgressBar> {
    std::io::stderr().is_terminal().then(|| {
        let b = indicatif::ProgressBar::new_spinner();
        b.set_style(
            indicatif::ProgressStyle::with_template("{spinner} {msg} ({elapsed})").expect("a valid template"),
        );
        b.set_message(what.to_string());
        b.enable_steady_tick(Duration::from_millis(100));
        b
    })
}

/// SHA-256 of `data`, advancing `bar`.
fn sha256(data: &[u8], bar: &Option<indicatif::ProgressBar>) -> String {
    let mut h = Sha256::new();
    for c in data.chunks(16 << 20) {
        h.update(c);
        if let Some(b) = bar {
            b.inc(c.len() as u64);
        }
    }
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

#[allow(unsafe_code)]
fn map(file: &std::fs::File) -> std::io::Result<memmap2::Mmap> {
    // SAFETY: the map is read-only and only read while this process holds it. Another process
    // truncating the file meanwhile would fault on access, as with any mmap; `send` documents that
    // the file must not change while it is being sent.
    unsafe { memmap2::Mmap::map(file) }
}

pub(crate) async fn send(a: SendArgs) -> Result<()> {
    a.metrics.clone().around(async |ex| send_with(a, ex).await).await
}

async fn send_with(a: SendArgs, ex: &crate::metrics::Exporter) -> Result<()> {
    let timeout = secs(a.timeout)?;
    let t0 = Instant::now();
    let path = &a.file;
    let meta = std::fs::metadata(path).with_context(|| format!("cannot read {}", path.display()))?;
    if meta.is_dir() {
        bail!(
            "{} is a folder; send takes one file (archive a folder first, e.g. with tar)",
            path.display()
        );
    }
    if !meta.is_file() {
        bail!("{} is not a regular file", path.display());
    }
    let size = meta.len() as usize;
    if size == 0 {
        bail!("{} is empty; there is nothing to send", path.display());
    }
    let file = std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let data = Arc::new(map(&file).with_context(|| format!("cannot map {}", path.display()))?);
    let hash = sha256(&data, &bar(size as u64, "hashing"));
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("received.bin")
        .to_string();
    let conn = ex.apply(Connector::builder()).build()?;
    // One readable per chunk, each keeping the mapping alive for as long as a transfer may use it.
    let mut readables = Vec::new();
    for off in (0..size).step_by(CHUNK) {
        let len = CHUNK.min(size - off);
        // SAFETY: [off, off+len) lies inside the read-only mapping `data`, which the descriptor
        // keeps alive (an Arc clone) for as long as a transfer may read it; it is never written.
        #[allow(unsafe_code)]
        let d = unsafe {
            Descriptor::from_raw_parts_with_owner(
                data.as_ptr().add(off).cast_mut(),
                len,
                Device::Host,
                false,
                data.clone(),
            )
        };
        readables.push((len, conn.create_readable(d).await?));
    }
    let chunks: Vec<serde_json::Value> = readables
        .iter()
        .map(|(_, r)| serde_json::to_value(r.metadata()).expect("metadata serialises"))
        .collect();
    let channel = match a.listen {
        Some(addr) => HttpChannel::bind(addr).await?,
        None => HttpChannel::global().await?,
    };
    let extra = serde_json::json!({"name": name, "size": size, "sha256": hash, "chunks": chunks});
    let mut publication = channel.publish_with(readables[0].1.metadata(), &extra);
    println!("{}", publication.url());
    eprintln!(
        "nixl-connect: sending {} ({} bytes, sha256 {hash}); on the receiving side run:\n  nixl-connect recv {}",
        path.display(),
        size,
        publication.url()
    );
    let progress = count_bar(size as u64, "waiting");
    let deadline = t0 + timeout;
    let left = || {
        deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1))
    };
    let mut reply: Option<serde_json::Value> = None;
    for (len, r) in &readables {
        // The receiver reports a failure (its destination, say) without reading on.
        tokio::select! {
            res = r.wait_for_completion(Some(left())) => match res {
                Ok(()) => {
                    if let Some(b) = &progress {
                        b.set_message("sent");
                        b.inc(*len as u64);
                    }
                }
                Err(nixl_connect::Error::TimedOut { .. }) => {
                    return Err(Exit::timed_out(format!(
                        "no receiver read {name} within {:.0} s",
                        timeout.as_secs_f64()
                    )));
                }
                Err(e) => return Err(e.into()),
            },
            got = publication.reply(left()) => {
                reply = got.ok();
                break;
            }
        }
    }
    if let Some(b) = &progress {
        b.finish_and_clear();
    }
    let reply = match reply {
        Some(r) => r,
        None => {
            let waiting = spinner("the receiver is verifying and saving");
            let got = publication.reply(left()).await;
            if let Some(s) = waiting {
                s.finish_and_clear();
            }
            got.map_err(|_| {
                Exit::timed_out(format!(
                    "the receiver read {name} but did not confirm saving it within {:.0} s (it failed, \
                 vanished or is still busy)",
                    timeout.as_secs_f64()
                ))
            })?
        }
    };
    drop(publication);
    if reply["ok"] != true {
        bail!(
            "the receiver failed to save {name}: {}",
            reply["error"].as_str().unwrap_or("no reason given")
        );
    }
    if reply["sha256"] != hash.as_str() {
        bail!(
            "the receiver saved {name} with sha256 {}, not {hash}",
            reply["sha256"]
        );
    }
    eprintln!(
        "nixl-connect: delivered {name} ({size} bytes) in {:.2} s; the receiver saved it as {}\n{hash}  {name}",
        t0.elapsed().as_secs_f64(),
        reply["saved_as"].as_str().unwrap_or("?"),
    );
    Ok(())
}

/// The hidden partial file next to the destination: created (and its space reserved) before any
/// transfer, mapped for the transfer to land in, and removed on every path that does not commit.
struct Partial {
    tmp: PathBuf,
    dest: PathBuf,
    file: std::fs::File,
    map: Option<memmap2::MmapMut>,
    committed: bool,
}

impl Partial {
    fn create(dest: &Path, size: usize) -> Result<Self> {
        let dir = match dest.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let name = dest.file_name().context("the destination has no file name")?;
        let tmp = dir.join(format!(
            ".{}.partial-{}",
            name.to_string_lossy(),
            std::process::id()
        ));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::NotFound => {
                    anyhow::anyhow!("cannot save into {}: the folder does not exist", dir.display())
                }
                _ => anyhow::anyhow!("cannot create a file in {}: {e}", dir.display()),
            })?;
        let mut p = Partial {
            tmp,
            dest: dest.to_path_buf(),
            file,
            map: None,
            committed: false,
        };
        // Reserve the space now: a full disk fails here, before anything moves (and a mapped file
        // on a filesystem that ran out of space would fault instead of failing).
        match nix::fcntl::fallocate(&p.file, nix::fcntl::FallocateFlags::empty(), 0, size as i64) {
            Ok(()) => {}
            Err(nix::errno::Errno::EOPNOTSUPP) => p
                .file
                .set_len(size as u64)
                .map_err(|e| anyhow::anyhow!("cannot size {} to {size} bytes: {e}", p.tmp.display()))?,
            Err(e) => bail!(
                "cannot reserve {size} bytes in {}: {}",
                dir.display(),
                std::io::Error::from(e)
            ),
        }
        p.map = Some(Self::map(&p.file).with_context(|| format!("cannot map {}", p.tmp.display()))?);
        Ok(p)
    }

    #[allow(unsafe_code)]
    fn map(file: &std::fs::File) -> std::io::Result<memmap2::MmapMut> {
        // SAFETY: a shared writable mapping of a file this process just created with O_EXCL under
        // a hidden name and fully allocated; no one else writes it.
        unsafe { memmap2::MmapMut::map_mut(file) }
    }

    fn data(&mut self) -> &mut [u8] {
        self.map.as_mut().expect("mapped until commit")
    }

    /// Syncs the data, renames it into place (refusing to replace a file unless `force`), and
    /// syncs the folder.
    fn commit(mut self, force: bool) -> Result<PathBuf> {
        let map = self.map.take().expect("mapped");
        map.flush()
            .with_context(|| format!("cannot write {}", self.tmp.display()))?;
        drop(map);
        self.file
            .sync_all()
            .with_context(|| format!("cannot write {}", self.tmp.display()))?;
        if force {
            std::fs::rename(&self.tmp, &self.dest)
        } else {
            // A link fails if the destination appeared meanwhile: never clobber without --force.
            std::fs::hard_link(&self.tmp, &self.dest).and_then(|()| std::fs::remove_file(&self.tmp))
        }
        .with_context(|| format!("cannot move the received file into {}", self.dest.display()))?;
        self.committed = true;
        if let Some(dir) = self.dest.parent().filter(|p| !p.as_os_str().is_empty()) {
            if let Ok(d) = std::fs::File::open(dir) {
                let _ = d.sync_all();
            }
        }
        Ok(self.dest.clone())
    }
}

impl Drop for Partial {
    fn drop(&mut self) {
        drop(self.map.take());
        if !self.committed {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// Where to save: `-o` naming an existing folder saves into it under the sender's name.
fn destination(out: Option<PathBuf>, name: &str, force: bool) -> Result<PathBuf> {
    // Never let a sender choose a path outside the destination folder.
    let base = Path::new(name)
        .file_name()
        .filter(|b| !b.is_empty())
        .map(PathBuf::from)
        .context("the sender's file name is empty")?;
    let dest = match out {
        Some(p) if p.is_dir() => p.join(base),
        Some(p) if p.as_os_str().to_string_lossy().ends_with('/') => {
            bail!("cannot save into {}: the folder does not exist", p.display())
        }
        Some(p) => p,
        None => base,
    };
    match std::fs::symlink_metadata(&dest) {
        Ok(m) if m.is_dir() => bail!(
            "{} is a folder; name a file, or a folder to save into",
            dest.display()
        ),
        Ok(_) if !force => bail!("{} exists; pass --force to overwrite it", dest.display()),
        _ => Ok(dest),
    }
}

pub(crate) async fn recv(a: RecvArgs) -> Result<()> {
    a.metrics.clone().around(async |ex| recv_with(a, ex).await).await
}

async fn recv_with(a: RecvArgs, ex: &crate::metrics::Exporter) -> Result<()> {
    // The handlers go in before anything is created on disk: a signal that lands first ends the
    // process by default, with nothing to clean up.
    let signals = Signals::install();
    let timeout = secs(a.timeout)?;
    let t0 = Instant::now();
    let fetch_limit = timeout.min(Duration::from_secs(30));
    let md = http::fetch(&a.url, fetch_limit).await?;
    let extra = http::fetch_extra(&a.url, fetch_limit).await?;
    let url = a.url.clone();
    let work = receive(a, md, extra, (t0, timeout), ex);
    let outcome = tokio::select! {
        biased;
        s = signals.received() => Err(Exit::interrupted(format!("interrupted by {s}; nothing was saved"))),
        r = work => r,
    };
    // The partial file is gone by now on every failure (its guard dropped with `work`).
    let reply = match &outcome {
        Ok((saved, hash)) => {
            serde_json::json!({"ok": true, "saved_as": saved.display().to_string(), "sha256": hash})
        }
        Err(e) => serde_json::json!({"ok": false, "error": format!("{e:#}")}),
    };
    // Best effort: a sender that has gone cannot be told (and then needs no telling).
    let _ = http::reply(&url, &reply, Duration::from_secs(10)).await;
    let (saved, hash) = outcome?;
    let name = saved
        .file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    eprintln!(
        "nixl-connect: received {} in {:.2} s, verified and saved as {}",
        name,
        t0.elapsed().as_secs_f64(),
        saved.display()
    );
    println!("{hash}  {}", saved.display());
    Ok(())
}

/// SIGINT and SIGTERM, caught from the moment [`Signals::install`] returns.
struct Signals(Option<(tokio::signal::unix::Signal, tokio::signal::unix::Signal)>);

impl Signals {
    fn install() -> Self {
        use tokio::signal::unix::{signal, SignalKind};
        Self(
            signal(SignalKind::interrupt())
                .ok()
                .zip(signal(SignalKind::terminate()).ok()),
        )
    }

    /// Which signal arrived; never resolves if the handlers could not be installed.
    async fn received(mut self) -> &'static str {
        let Some((int, term)) = &mut self.0 else {
            return std::future::pending().await;
        };
        tokio::select! {
            _ = int.recv() => "SIGINT",
            _ = term.recv() => "SIGTERM",
        }
    }
}

async fn receive(
    a: RecvArgs,
    md: RdmaMetadata,
    extra: serde_json::Value,
    (t0, timeout): (Instant, Duration),
    ex: &crate::metrics::Exporter,
) -> Result<(PathBuf, String)> {
    let want = extra["sha256"]
        .as_str()
        .context("the sender published no sha256")?
        .to_string();
    let name = extra["name"].as_str().unwrap_or("received.bin").to_string();
    let chunks: Vec<RdmaMetadata> = match extra.get("chunks") {
        Some(c) => serde_json::from_value::<Vec<serde_json::Value>>(c.clone())
            .context("the sender's chunk list is not a list")?
            .into_iter()
            .map(|v| v.to_string().parse::<RdmaMetadata>())
            .collect::<nixl_connect::Result<_>>()?,
        None => vec![md],
    };
    let mut sizes = Vec::with_capacity(chunks.len());
    for c in &chunks {
        let n = c.descriptors.iter().try_fold(0u64, |s, d| s.checked_add(d.size));
        sizes.push(
            n.and_then(|n| usize::try_from(n).ok())
                .context("a chunk's sizes overflow")?,
        );
    }
    let size = sizes
        .iter()
        .try_fold(0usize, |s, &n| s.checked_add(n))
        .context("the file's size overflows")?;
    if extra["size"].as_u64() != Some(size as u64) {
        bail!(
            "the sender announced {} bytes but its metadata describes {size}",
            extra["size"]
        );
    }
    // Everything about the destination is settled before any byte moves.
    let dest = destination(a.out, &name, a.force)?;
    let mut partial = Partial::create(&dest, size)?;
    let conn = ex.apply(Connector::builder()).build()?;
    let progress = bar(size as u64, "received");
    let deadline = t0 + timeout;
    let mut off = 0;
    for (c, &len) in chunks.iter().zip(&sizes) {
        let parts: Vec<usize> = c.descriptors.iter().map(|d| d.size as usize).collect();
        let mut rest = &mut partial.data()[off..off + len];
        let mut descs = Vec::with_capacity(parts.len());
        for p in parts {
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(p);
            descs.push(Descriptor::from(head));
            rest = tail;
        }
        let op = conn.begin_read(c, descs).await?;
        let left = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1));
        match op.wait_for_completion(Some(left)).await {
            Ok(()) => {}
            Err(nixl_connect::Error::TimedOut { .. }) => {
                return Err(Exit::timed_out(format!(
                    "receiving {name} did not finish within {:.0} s",
                    timeout.as_secs_f64()
                )))
            }
            Err(e) => return Err(anyhow::Error::new(e).context(format!("receiving {name} from {}", a.url))),
        }
        off += len;
        if let Some(b) = &progress {
            b.inc(len as u64);
        }
    }
    if let Some(b) = &progress {
        b.finish_and_clear();
    }
    let got = sha256(partial.data(), &bar(size as u64, "verifying"));
    if got != want {
        bail!("the data's sha256 is {got} but the sender published {want}; nothing was saved");
    }
    let saving = spinner("saving (fsync, rename)");
    let saved = partial.commit(a.force);
    if let Some(s) = saving {
        s.finish_and_clear();
    }
    Ok((saved?, got))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recv_destination_follows_cp() {
        let dir = std::env::temp_dir().join(format!("nxc-dest-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(
            destination(Some(dir.clone()), "a.bin", false).unwrap(),
            dir.join("a.bin")
        );
        assert_eq!(
            destination(None, "../../etc/passwd", false).unwrap(),
            PathBuf::from("passwd")
        );
        std::fs::write(dir.join("a.bin"), b"x").unwrap();
        assert!(destination(Some(dir.clone()), "a.bin", false)
            .unwrap_err()
            .to_string()
            .contains("--force"));
        assert!(destination(Some(dir.clone()), "a.bin", true).is_ok());
        assert!(destination(Some(dir.join("missing/")), "a.bin", false).is_err());
        assert!(destination(None, "", false).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
