//! The benchmark peer's lines, read on the thread that runs the benchmark (and times its
//! operations), not through the runtime's reactor.
//!
//! The active side reads one line from its peer before each timed operation (the peer's
//! metadata) and one after it (the peer's timings). Read through the runtime's reactor, each line
//! woke a runtime worker, which woke the thread in `block_on`: a quarter of a core on a 2-core
//! host, taken from the timed operations of both sides (docs/FIGURES.md, "4 KiB").
//! Raw NIXL's anchor reads its peer's lines with blocking reads on its one thread; so does this,
//! out of the timed span, inside `block_in_place` (the runtime is told that the thread blocks).

use std::os::fd::{AsFd, OwnedFd};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use nix::errno::Errno;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

/// How long the peer may say nothing before the benchmark gives up on it.
pub(super) const PEER_SILENCE_MAX: Duration = Duration::from_secs(60);

/// Lines from the peer's output (a pipe or a FIFO), blocking or not.
pub(super) struct PeerLines {
    fd: OwnedFd,
    buf: Vec<u8>,
    /// How much of `buf` holds no newline: each byte is looked at once, however many reads a
    /// line takes (a 1,000-descriptor metadata line is 55 KB).
    scanned: usize,
    /// What one read takes (a whole metadata line, mostly).
    chunk: Box<[u8]>,
}

impl PeerLines {
    pub(super) fn new(fd: OwnedFd) -> Self {
        Self {
            fd,
            buf: Vec::new(),
            scanned: 0,
            chunk: vec![0; 64 << 10].into_boxed_slice(),
        }
    }

    /// The next line (without its newline), waiting for it on this thread for at most `within`.
    pub(super) fn next_blocking(&mut self, within: Duration) -> Result<String> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(i) = self.buf[self.scanned..].iter().position(|&b| b == b'\n') {
                let rest = self.buf.split_off(self.scanned + i + 1);
                self.scanned = 0;
                let mut line = std::mem::replace(&mut self.buf, rest);
                line.pop();
                if line.last() == Some(&b'\r') {
                    line.pop();
                }
                return String::from_utf8(line).context("the benchmark peer wrote a line that is not UTF-8");
            }
            self.scanned = self.buf.len();
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                bail!("the benchmark peer said nothing for {within:?}");
            }
            let ms = PollTimeout::try_from(left.as_millis().max(1).min(i32::MAX as u128) as i32)
                .unwrap_or(PollTimeout::MAX);
            let mut fds = [PollFd::new(self.fd.as_fd(), PollFlags::POLLIN)];
            match poll(&mut fds, ms) {
                Ok(0) | Err(Errno::EINTR) => continue,
                Ok(_) => {}
                Err(e) => return Err(e).context("waiting for the benchmark peer's output"),
            }
            match nix::unistd::read(&self.fd, &mut self.chunk) {
                Ok(0) if !self.buf.is_empty() => {
                    // The last line, with no newline after it.
                    let line = std::mem::take(&mut self.buf);
                    self.scanned = 0;
                    return String::from_utf8(line)
                        .context("the benchmark peer wrote a line that is not UTF-8");
                }
                Ok(0) => bail!("the benchmark peer exited early (see its error above)"),
                Ok(n) => self.buf.extend_from_slice(&self.chunk[..n]),
                Err(Errno::EAGAIN | Errno::EINTR) => {}
                Err(e) => return Err(e).context("reading the benchmark peer's output"),
            }
        }
    }

    /// The next line, read on this thread (see the module's docs) for at most
    /// [`PEER_SILENCE_MAX`].
    ///
    /// # Cancel safety
    ///
    /// Not awaited across a suspension point: it runs to its end once called.
    pub(super) async fn next(&mut self) -> Result<String> {
        tokio::task::block_in_place(|| self.next_blocking(PEER_SILENCE_MAX))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn bench_peer_lines_split_at_newlines_across_reads_and_time_out() {
        let (r, w) = nix::unistd::pipe().unwrap();
        let mut w = std::fs::File::from(w);
        let mut lines = PeerLines::new(r);
        w.write_all(b"one\r\ntw").unwrap();
        assert_eq!(lines.next_blocking(Duration::from_secs(5)).unwrap(), "one");
        let e = lines.next_blocking(Duration::from_millis(50)).unwrap_err();
        assert!(e.to_string().contains("said nothing"), "{e}");
        w.write_all(b"o\nthree\n").unwrap();
        assert_eq!(lines.next_blocking(Duration::from_secs(5)).unwrap(), "two");
        assert_eq!(lines.next_blocking(Duration::from_secs(5)).unwrap(), "three");
        w.write_all(b"last").unwrap();
        drop(w);
        assert_eq!(lines.next_blocking(Duration::from_secs(5)).unwrap(), "last");
        let e = lines.next_blocking(Duration::from_secs(5)).unwrap_err();
        assert!(e.to_string().contains("exited early"), "{e}");
    }

    #[test]
    fn bench_peer_lines_take_a_line_over_many_reads_whole() {
        let (r, w) = nix::unistd::pipe().unwrap();
        let mut lines = PeerLines::new(r);
        // Longer than a read and than the pipe: the writer blocks until the reader drains it.
        let long: String = (0..300_000).map(|i| char::from(b'a' + (i % 26) as u8)).collect();
        let sent = long.clone();
        let writer = std::thread::spawn(move || {
            let mut w = std::fs::File::from(w);
            w.write_all(format!("{sent}\nnext\n").as_bytes()).unwrap();
        });
        assert_eq!(lines.next_blocking(Duration::from_secs(5)).unwrap(), long);
        assert_eq!(lines.next_blocking(Duration::from_secs(5)).unwrap(), "next");
        writer.join().unwrap();
    }
}
