//! `nixl-connect demo`: the real thing between two OS processes on this machine.

use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use nixl_connect::{Connector, Descriptor, HostBuffer, RdmaMetadata};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use crate::pattern;

#[derive(clap::Args, Debug)]
pub(crate) struct Args {
    /// Bytes to move (at least 1).
    #[arg(long, default_value = "256M", value_parser = crate::parse_nonzero_size)]
    size: usize,
    /// Times to repeat the read (the first includes connection set-up); at least 1.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    repeat: u32,
}

#[derive(Serialize, Deserialize)]
struct Report {
    pid: u32,
    seconds: f64,
    ok: bool,
    checksum: String,
}

const SEED: u64 = 0x6e69_786c;

pub(crate) async fn run(a: Args) -> Result<()> {
    let conn = Connector::new()?;
    let mut src = HostBuffer::new(a.size)?;
    pattern::fill(&mut src, SEED, 0);
    let want = pattern::checksum(&[&src]);
    eprintln!(
        "demo: process {} exposes {} bytes as readable (agent {}); starting a reader process",
        std::process::id(),
        a.size,
        conn.name()
    );
    let exe = std::env::current_exe()?;
    let mut child = tokio::process::Command::new(exe)
        .arg("demo-peer")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .context("starting the reader process")?;
    let mut to = child.stdin.take().context("stdin")?;
    let mut from = BufReader::new(child.stdout.take().context("stdout")?).lines();
    for i in 0..a.repeat {
        let op = conn.create_readable(Descriptor::from(&src)).await?;
        to.write_all(format!("{}\n", op.metadata().to_json()).as_bytes())
            .await?;
        to.flush().await?;
        op.wait_for_completion(Some(Duration::from_secs(120))).await?;
        let line = tokio::time::timeout(Duration::from_secs(120), from.next_line())
            .await
            .context("the reader said nothing for 120 s")??
            .context("the reader exited early")?;
        let r: Report = serde_json::from_str(&line)?;
        let same = r.checksum == want;
        println!(
            "read {} from process {} into process {} in {:.1} ms: {:.2} GB/s, verified by both: {}{}",
            crate::human(a.size),
            std::process::id(),
            r.pid,
            r.seconds * 1e3,
            a.size as f64 / r.seconds / 1e9,
            if r.ok && same { "yes" } else { "NO" },
            if i == 0 {
                " (first read includes connection set-up)"
            } else {
                ""
            }
        );
        if !(r.ok && same) {
            bail!("the bytes read differ from the bytes exposed");
        }
    }
    drop(to);
    child.wait().await?;
    Ok(())
}

/// The reader: reads each readable it is given, verifies the pattern, reports.
pub(crate) async fn peer() -> Result<()> {
    let conn = Connector::new()?;
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    let mut dst: Option<HostBuffer> = None;
    while let Some(line) = lines.next_line().await? {
        let md: RdmaMetadata = line.parse()?;
        let size = md.descriptors.iter().map(|d| d.size as usize).sum();
        let buf = match &mut dst {
            Some(b) if b.len() == size => b,
            _ => dst.insert(HostBuffer::new(size)?),
        };
        buf.fill(0);
        let t0 = Instant::now();
        let op = conn.begin_read(&md, Descriptor::from(&mut *buf)).await?;
        op.wait_for_completion(Some(Duration::from_secs(120))).await?;
        drop(op);
        let seconds = t0.elapsed().as_secs_f64();
        let ok = pattern::first_mismatch(buf, SEED, 0).is_none();
        let r = Report {
            pid: std::process::id(),
            seconds,
            ok,
            checksum: pattern::checksum(&[buf]),
        };
        println!("{}", serde_json::to_string(&r)?);
    }
    Ok(())
}
