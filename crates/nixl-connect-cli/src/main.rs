//! `nixl-connect`: the demo, the benchmark, and commands to move data by hand.
//!
//! Every failure prints one line on stderr and exits non-zero.

#![deny(unsafe_code)]

mod bench;
mod demo;
mod doctor;
mod etcd;
mod metrics;
mod pattern;
mod sendrecv;
mod topology;
mod transfer;

use std::time::Duration;

use clap::{Parser, Subcommand};

/// Move tensors and buffers between processes through NIXL (Dynamo NIXL Connect in Rust): send
/// and receive files, serve/read/write by hand, benchmark, check this host (doctor).
#[derive(Parser, Debug)]
#[command(
    name = "nixl-connect",
    version,
    after_help = "Exit codes: 0 done, 1 failed, 2 usage error, 3 timed out, 4 the peer is gone, \
                  130 interrupted.\n\
                  Logs: NIXL_CONNECT_LOG=debug (this tool), NIXL_LOG_LEVEL / UCX_LOG_LEVEL (NIXL, UCX)."
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Two processes: one exposes a buffer as readable, the other reads it; both verify, and the
    /// throughput is printed.
    Demo(demo::Args),
    /// Benchmark readable->read (or writable->write) between two processes: a table on a
    /// terminal, JSON lines otherwise (or with --json).
    Bench(bench::Args),
    /// Expose a file or a pattern as readable (or a writable with --writable); prints the
    /// RdmaMetadata JSON as one line, waits for the peer.
    Serve(transfer::ServeArgs),
    /// Read what a readable's metadata describes into a file.
    Read(transfer::ReadArgs),
    /// Write a file into what a writable's metadata describes.
    Write(transfer::WriteArgs),
    /// Send a file: prints a URL, waits until a receiver has read, verified and saved it.
    Send(sendrecv::SendArgs),
    /// Receive a file from the URL `send` printed: checks the destination first, verifies the
    /// SHA-256, saves atomically, confirms to the sender.
    Recv(sendrecv::RecvArgs),
    /// Show what this host offers (NIXL, UCX, CUDA, huge pages, NATS) and whether it works.
    Doctor(doctor::Args),
    /// Print the rates of one or more `--metrics` endpoints every second: bytes in (rx) and
    /// out (tx), operations, operations in flight, errors.
    Top(metrics::TopArgs),
    /// Internal: the benchmark's peer process.
    #[command(hide = true)]
    BenchPeer,
    /// Internal: the demo's reader process.
    #[command(hide = true)]
    DemoPeer,
}

fn main() {
    // NIXL and UCX log to stderr on their own; a command should print one clear line when it fails.
    // Still single-threaded here, so setting the environment is sound. Override to see their logs.
    // UCX_TCP_CONN_NB: connect to a peer without blocking the engine (a dead host would otherwise
    // hold NIXL's loadRemoteMD in connect() for the kernel's SYN retries).
    for (k, v) in [
        ("NIXL_LOG_LEVEL", "FATAL"),
        ("UCX_LOG_LEVEL", "fatal"),
        ("UCX_TCP_CONN_NB", "y"),
    ] {
        if std::env::var_os(k).is_none() {
            std::env::set_var(k, v);
        }
    }
    tracing_subscriber::fmt()
        // Silent unless asked (NIXL_CONNECT_LOG=debug): errors reach the user as one line below.
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("NIXL_CONNECT_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("off")),
        )
        .with_writer(std::io::stderr)
        // Colours only on a terminal: logs kept in a file or read by a tool stay plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let r = rt.block_on(async move {
        match cli.cmd {
            Cmd::Demo(a) => demo::run(a).await,
            Cmd::Bench(a) => bench::run(a).await,
            Cmd::Serve(a) => transfer::serve(a).await,
            Cmd::Read(a) => transfer::read(a).await,
            Cmd::Write(a) => transfer::write(a).await,
            Cmd::Send(a) => sendrecv::send(a).await,
            Cmd::Recv(a) => sendrecv::recv(a).await,
            Cmd::Doctor(a) => doctor::run(a).await,
            Cmd::Top(a) => metrics::top(a).await,
            Cmd::BenchPeer => bench::peer().await,
            Cmd::DemoPeer => demo::peer().await,
        }
    });
    rt.shutdown_timeout(Duration::from_millis(100));
    if let Err(e) = r {
        eprintln!("nixl-connect: {}", one_line(&e));
        std::process::exit(exit_code(&e));
    }
}

/// An error that maps to an exit code other than 1 (see the top-level help).
#[derive(Debug)]
pub(crate) struct Exit {
    code: i32,
    msg: String,
}

impl Exit {
    /// Exit code 3.
    pub(crate) fn timed_out(msg: String) -> anyhow::Error {
        anyhow::Error::new(Exit { code: 3, msg })
    }

    /// Exit code 130 (the shell's for SIGINT).
    pub(crate) fn interrupted(msg: String) -> anyhow::Error {
        anyhow::Error::new(Exit { code: 130, msg })
    }
}

impl std::fmt::Display for Exit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.msg)
    }
}

impl std::error::Error for Exit {}

/// The error and its causes on one line, each cause once: a cause whose text the message before
/// it already ends with (errors that append their source's text, as the channels' do) is not
/// repeated.
fn one_line(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.ends_with(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}

/// 3 for a timeout, 4 for a peer that is gone, 1 for everything else.
fn exit_code(e: &anyhow::Error) -> i32 {
    for cause in e.chain() {
        if let Some(x) = cause.downcast_ref::<Exit>() {
            return x.code;
        }
        match cause.downcast_ref::<nixl_connect::Error>() {
            Some(nixl_connect::Error::TimedOut { .. }) => return 3,
            Some(nixl_connect::Error::RemoteGone { .. }) => return 4,
            _ => {}
        }
    }
    1
}

/// Parses sizes like `4096`, `4K`, `64KiB`, `1M`, `1G`.
pub(crate) fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim().to_ascii_uppercase();
    let t = t.trim_end_matches("IB").trim_end_matches('B');
    let (num, mult) = match t.chars().last() {
        Some('K') => (&t[..t.len() - 1], 1usize << 10),
        Some('M') => (&t[..t.len() - 1], 1 << 20),
        Some('G') => (&t[..t.len() - 1], 1 << 30),
        _ => (t, 1),
    };
    num.parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| format!("{s:?} is not a size (examples: 4096, 4K, 64M, 1G)"))
}

/// Parses a size of at least one byte.
pub(crate) fn parse_nonzero_size(s: &str) -> Result<usize, String> {
    match parse_size(s)? {
        0 => Err("the size must be at least 1 byte".into()),
        n => Ok(n),
    }
}

/// Formats a byte count for people.
pub(crate) fn human(n: usize) -> String {
    match n {
        n if n >= 1 << 30 && n % (1 << 30) == 0 => format!("{}G", n >> 30),
        n if n >= 1 << 20 && n % (1 << 20) == 0 => format!("{}M", n >> 20),
        n if n >= 1 << 10 && n % (1 << 10) == 0 => format!("{}K", n >> 10),
        n => n.to_string(),
    }
}

/// A byte count for people, in binary units ("64 MiB (67108864 bytes)").
pub(crate) fn human_bytes(n: usize) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut v = n as f64;
    let mut unit = "";
    for u in UNITS {
        if v < 1024.0 {
            break;
        }
        v /= 1024.0;
        unit = u;
    }
    if unit.is_empty() {
        format!("{n} bytes")
    } else {
        format!("{v:.1} {unit} ({n} bytes)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_error_line_names_each_cause_once() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "connection refused");
        let e = anyhow::Error::new(nixl_connect::ChannelError::with_source("etcd get k", io))
            .context("connecting to etcd at h:1");
        assert_eq!(
            one_line(&e),
            "connecting to etcd at h:1: metadata channel: etcd get k: connection refused"
        );
        let e = anyhow::anyhow!("inner").context("outer");
        assert_eq!(one_line(&e), "outer: inner");
    }

    proptest::proptest! {
        #[test]
        fn cli_parse_size_never_panics(s in "\\PC{0,24}") {
            let _ = parse_size(&s);
            let _ = parse_nonzero_size(&s);
        }

        #[test]
        fn cli_parse_size_reads_what_it_prints(n in 0usize..(1 << 50)) {
            proptest::prop_assert_eq!(parse_size(&human(n)), Ok(n));
        }

        #[test]
        fn cli_parse_size_refuses_what_overflows(k in (1usize << 54)..usize::MAX) {
            let text = format!("{k}G");
            proptest::prop_assert!(parse_size(&text).is_err());
        }
    }
}
