//! Host memory between processes that cannot read each other's (another PID namespace, ptrace
//! refused): pipes, one per lane, that the source's owner makes and writes from its own memory
//! ([`spawn_feed`]) and whose read ends the destination's owner reads into its own ([`spawn_fill`]).
//!
//! Copied, not spliced: `vmsplice` would put the source's own pages in the pipe, and a reader can
//! keep such references (`tee`) and read the memory after its owner reused it. Every wait is a
//! `poll` on the pipe and the job's [`Wake`]. The destination reads with `RWF_NOWAIT` (the peer
//! shares the read end's open file and could clear `O_NONBLOCK`). A peer can hold a pipe's lock:
//! that holds the job, never the engine thread, and pipe ends close on their own closer pool
//! ([`close_pipe_end`]).

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use super::close_pipe_end;
use super::cma::{self, CopyError, SlotRef};

/// Run once a copy's lanes have all ended, with how it went.
type Done = Box<dyn FnOnce(Result<(), CopyError>) + Send>;

/// The most pipes one copy through pipes uses.
pub(crate) const MAX_LANES: usize = 4;
/// The size a pipe is asked to have (the unprivileged maximum, `/proc/sys/fs/pipe-max-size`'s
/// default): how much of the source one lane holds at once.
pub(crate) const PIPE_BYTES: usize = 1 << 20;
/// The most bytes one `writev` or read moves (a cancelled copy stops within this).
const STEP: usize = 1 << 20;

/// Pipe ends this process holds, closed on the pipes' closer pool whenever the last owner drops
/// them (an engine turn, a copy thread: never a close that a peer can stall there).
#[derive(Default)]
pub(crate) struct Ends(Vec<OwnedFd>);

impl Ends {
    /// `fds`, from now on closed off this thread.
    pub(crate) fn new(fds: Vec<OwnedFd>) -> Self {
        Self(fds)
    }

    /// How many.
    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }

    /// Their numbers (to pass them).
    pub(crate) fn raw(&self) -> Vec<RawFd> {
        self.0.iter().map(AsRawFd::as_raw_fd).collect()
    }

    /// The descriptors themselves, for a holder that closes them where it may block (the CUDA
    /// thread, with NVIDIA devices' descriptors only).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn into_vec(mut self) -> Vec<OwnedFd> {
        std::mem::take(&mut self.0)
    }
}

impl Drop for Ends {
    fn drop(&mut self) {
        self.0.drain(..).for_each(close_pipe_end);
    }
}

/// The pipes of one copy, on the source's side: their write ends (ours alone), read ends to pass
/// to the peer, and one read end of each this side keeps and never reads: with it the pipe always
/// has a reader, so a peer that closes its end never makes a write raise `SIGPIPE` (a host
/// program may not ignore it); the feed then waits, and ends with the operation.
pub(crate) struct Lanes {
    w: Ends,
    r: Ends,
    _keep: Ends,
}

impl Lanes {
    /// `n` new pipes (at most [`MAX_LANES`]), each asked for [`PIPE_BYTES`] (a kernel that allows
    /// less keeps its default: only the depth of the lane changes), write ends non-blocking.
    pub(crate) fn new(n: usize) -> io::Result<Self> {
        let (mut w, mut r, mut keep) = (Ends::default(), Ends::default(), Ends::default());
        for _ in 0..n.clamp(1, MAX_LANES) {
            let (rd, wr) = std::io::pipe()?; // pipe2(O_CLOEXEC)
            let (rd, wr) = (OwnedFd::from(rd), OwnedFd::from(wr));
            // SAFETY: fcntl on descriptors this function owns (the write end's file is ours alone:
            // the peer gets only read ends, which are other open files).
            unsafe {
                libc::fcntl(wr.as_raw_fd(), libc::F_SETPIPE_SZ, PIPE_BYTES as libc::c_int);
                libc::fcntl(wr.as_raw_fd(), libc::F_SETFL, libc::O_NONBLOCK);
            }
            w.0.push(wr);
            keep.0.push(rd.try_clone()?);
            r.0.push(rd);
        }
        Ok(Self { w, r, _keep: keep })
    }

    /// How many.
    pub(crate) fn len(&self) -> usize {
        self.w.len()
    }

    /// The read ends, to pass to the peer.
    pub(crate) fn take_read_ends(&mut self) -> Ends {
        std::mem::take(&mut self.r)
    }

    /// Write end `k` (tests: to feed by hand, or to pass where a read end is due).
    #[cfg(test)]
    pub(crate) fn write_end(&self, k: usize) -> &OwnedFd {
        &self.w.0[k]
    }
}

/// True when `fd`, passed by a peer, is the read end of an anonymous pipe opened for reading only:
/// its `/proc/self/fd` link reads `pipe:[...]` (a named FIFO on some file system does not) and its
/// access mode is read-only. Neither check takes the pipe's lock or touches a file system, so a
/// peer can stall neither.
pub(crate) fn is_read_end(fd: &OwnedFd) -> bool {
    let link = match std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())) {
        Ok(l) => l,
        Err(_) => return false,
    };
    if !link.to_string_lossy().starts_with("pipe:[") {
        return false;
    }
    // SAFETY: F_GETFL reads the open file's flags; it touches no memory.
    let fl = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
    fl >= 0 && fl & libc::O_ACCMODE == libc::O_RDONLY
}

/// What wakes a job waiting on pipes: an eventfd, written when its operation ends or is
/// cancelled.
#[derive(Debug)]
pub(crate) struct Wake(OwnedFd);

impl Wake {
    /// A new wake-up.
    pub(crate) fn new() -> io::Result<Self> {
        crate::sys::eventfd().map(Self)
    }

    /// Wakes the jobs waiting on it (they then read their flags); it stays readable.
    pub(crate) fn wake(&self) {
        crate::sys::eventfd_add(&self.0, 1);
    }
}

/// Waits until `fd` is ready for `events` or `wake` was written.
fn wait(fd: RawFd, events: libc::c_short, wake: &Wake) {
    let pollfd = |fd, events| libc::pollfd {
        fd,
        events,
        revents: 0,
    };
    let mut p = [pollfd(fd, events), pollfd(wake.0.as_raw_fd(), libc::POLLIN)];
    // SAFETY: poll reads and writes the two pollfds of a live local array.
    unsafe { libc::poll(p.as_mut_ptr(), 2, -1) };
}

/// The part of a stream of `total` bytes that lane `k` of `lanes` carries: `[start, end)`.
pub(crate) fn span(total: usize, lanes: usize, k: usize) -> (usize, usize) {
    let lanes = lanes.max(1) as u128;
    let at = |k: usize| (total as u128 * k as u128 / lanes) as usize;
    (at(k), at(k + 1))
}

/// The pieces of memory (`(address, length)`, in stream order) that bytes `[start, end)` of their
/// concatenation occupy.
pub(crate) fn cut(pieces: &[(usize, usize)], start: usize, end: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut at = 0usize;
    for &(addr, len) in pieces {
        let (a, b) = (at.max(start), (at + len).min(end));
        if a < b {
            out.push((addr + (a - at), b - a));
        }
        at += len;
        if at >= end {
            break;
        }
    }
    out
}

/// The source's side of one lane: copies `pieces` (this process's memory, in stream order, kept
/// mapped and unchanged by the caller until it returns) into the write end `w` until every byte
/// is in the pipe, or `ended` is set (then [`CopyError::Revoked`]); waits in `poll` while full.
pub(crate) fn feed(
    w: &OwnedFd,
    pieces: &[(usize, usize)],
    ended: &AtomicBool,
    wake: &Wake,
) -> Result<(), CopyError> {
    // SAFETY: the iovecs lie in this process's memory, which the caller keeps mapped (see
    // above); writev only reads them.
    let write = |fd, v: &[libc::iovec]| unsafe { libc::writev(fd, v.as_ptr(), v.len() as libc::c_int) };
    match pump(w, pieces, ended, wake, libc::POLLOUT, write) {
        Err(CopyError::NotStarted) => Err(CopyError::Revoked),
        r => r,
    }
}

/// The destination's side of one lane: reads the read end `r` a peer passed (checked by
/// [`is_read_end`]) into `pieces` (this process's memory, in stream order, kept mapped and owned
/// by this copy until it returns) until they are full. `cancel` stops it within [`STEP`] bytes
/// ([`CopyError::Revoked`], or [`CopyError::NotStarted`] if no byte came); the stream's end before
/// the last byte is [`CopyError::Revoked`]. Reads are `preadv2(RWF_NOWAIT)`, as `O_NONBLOCK` is the
/// peer's to change.
pub(crate) fn fill(
    r: &OwnedFd,
    pieces: &[(usize, usize)],
    cancel: &AtomicBool,
    wake: &Wake,
) -> Result<(), CopyError> {
    // SAFETY: the iovecs lie in this process's memory that the caller keeps mapped and owned
    // by this copy (see above); preadv2 writes at most their lengths. Offset -1: the file's
    // own position (a pipe has none).
    let read = |fd, v: &[libc::iovec]| unsafe {
        libc::preadv2(fd, v.as_ptr(), v.len() as libc::c_int, -1, libc::RWF_NOWAIT)
    };
    pump(r, pieces, cancel, wake, libc::POLLIN, read)
}

/// Moves `pieces` through `fd` with `call` (one call, at most [`STEP`] bytes: the bytes moved, 0 at
/// the stream's end, or -1 with `errno` set), waiting in `poll` for `events` while it would
/// block, until every byte moved; `stop` ends it ([`CopyError::NotStarted`] if no byte moved,
/// else [`CopyError::Revoked`]), as does the stream's end ([`CopyError::Revoked`]).
fn pump(
    fd: &OwnedFd,
    pieces: &[(usize, usize)],
    stop: &AtomicBool,
    wake: &Wake,
    events: libc::c_short,
    call: impl Fn(RawFd, &[libc::iovec]) -> isize,
) -> Result<(), CopyError> {
    let (mut i, mut off, mut moved) = (0usize, 0usize, false);
    let mut iov = Vec::new();
    cma::advance(pieces, |p| p.1, &mut i, &mut off, 0);
    while i < pieces.len() {
        if stop.load(Ordering::Acquire) {
            return Err(if moved {
                CopyError::Revoked
            } else {
                CopyError::NotStarted
            });
        }
        let n = call(
            fd.as_raw_fd(),
            cma::iovecs(&mut iov, pieces, i, off, STEP, |&p| p),
        );
        if n > 0 {
            moved = true;
            cma::advance(pieces, |p| p.1, &mut i, &mut off, n as usize);
        } else if n == 0 {
            return Err(CopyError::Revoked);
        } else {
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::WouldBlock => wait(fd.as_raw_fd(), events, wake),
                io::ErrorKind::Interrupted => {}
                _ => return Err(CopyError::Os(Arc::new(e))),
            }
        }
    }
    Ok(())
}

/// The lanes a copy of `total` bytes asks for: one per MiB, at most one per core and
/// [`MAX_LANES`], at least one.
pub(crate) fn lanes_for(total: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    total.div_ceil(PIPE_BYTES).min(cores).clamp(1, MAX_LANES)
}

/// The destination's copy: lanes' read ends (passed by the source, checked) into `pieces`, this
/// process's memory in stream order, guarded by `slot` as a pull is.
pub(crate) struct Fill {
    /// Whose share of the copy pool it runs under (the peer's pid, or a stand-in for a peer in
    /// another PID namespace).
    pid: libc::pid_t,
    lanes: Ends,
    pieces: Vec<(usize, usize)>,
    slot: SlotRef,
    cancel: Arc<AtomicBool>,
    wake: Arc<Wake>,
}

impl Fill {
    /// The fill of `pieces` from `lanes`, on the pool share `pid`, guarded by `slot`, stoppable
    /// through `cancel` (`wake` wakes lanes waiting on their pipes).
    pub(crate) fn new(
        pid: libc::pid_t,
        lanes: Ends,
        pieces: Vec<(usize, usize)>,
        slot: SlotRef,
        cancel: Arc<AtomicBool>,
        wake: Arc<Wake>,
    ) -> Self {
        Self {
            pid,
            lanes,
            pieces,
            slot,
            cancel,
            wake,
        }
    }
}

/// A copy pool task that, on its `k`-th run, runs `f` on end `k` and the part of `pieces` (in
/// stream order) that lane `k` carries; runs past the last end do nothing.
fn per_lane(
    ends: Ends,
    pieces: Vec<(usize, usize)>,
    f: impl Fn(&OwnedFd, &[(usize, usize)]) -> Result<(), CopyError> + Send + Sync + 'static,
) -> Arc<dyn Fn() -> Result<(), CopyError> + Send + Sync> {
    let (n, total, next) = (ends.len(), pieces.iter().map(|p| p.1).sum(), AtomicUsize::new(0));
    Arc::new(move || {
        let k = next.fetch_add(1, Ordering::Relaxed);
        let Some(end) = ends.0.get(k) else {
            return Ok(());
        };
        let (a, b) = span(total, n, k);
        f(end, &cut(&pieces, a, b))
    })
}

/// Starts `c` on the copy pool, one part per lane; `done` runs once every lane has ended (a lane
/// that fails wakes the others, which then stop). Returns the revocation error at once (without
/// calling `done`) when the grant was revoked before the copy began.
pub(crate) fn spawn_fill(c: Fill, done: Done) -> Result<(), CopyError> {
    let (n, cancel, wake) = (c.lanes.len(), c.cancel.clone(), c.wake);
    let task = per_lane(c.lanes, c.pieces, move |r, part| {
        let res = fill(r, part, &cancel, &wake);
        if res.is_err() {
            // The pool sets `cancel` for the other lanes; they may be waiting in poll.
            cancel.store(true, Ordering::Release);
            wake.wake();
        }
        res
    });
    cma::spawn_tasks(c.pid, Some(c.slot), c.cancel, n, task, done)
}

/// The source's side of a copy through pipes: its lanes' write ends, fed from `pieces` (this
/// process's memory in stream order) until every byte is in a pipe or the operation ends.
pub(crate) struct Feeding {
    /// Whose share of the copy pool it runs under: not the one its peer's reads of this side's
    /// pipes (fills) use, so that feeds waiting for a peer never hold up the fills that peer
    /// waits for (two processes piping to each other would deadlock).
    pid: libc::pid_t,
    lanes: Lanes,
    pieces: Vec<(usize, usize)>,
    ended: Arc<AtomicBool>,
    wake: Arc<Wake>,
}

impl Feeding {
    /// The feed of `pieces` into `lanes`, on the pool share `pid` (`wake` wakes lanes waiting on
    /// their pipes; `ended` stops it).
    pub(crate) fn new(pid: libc::pid_t, lanes: Lanes, pieces: Vec<(usize, usize)>, wake: Arc<Wake>) -> Self {
        Self {
            pid,
            lanes,
            pieces,
            ended: Arc::default(),
            wake,
        }
    }

    /// How many lanes it feeds.
    pub(crate) fn lanes(&self) -> usize {
        self.lanes.len()
    }

    /// Set to stop it.
    pub(crate) fn ended(&self) -> &Arc<AtomicBool> {
        &self.ended
    }

    /// Wakes its lanes waiting on their pipes.
    pub(crate) fn wake(&self) -> &Arc<Wake> {
        &self.wake
    }
}

/// Starts `f` on the copy pool, one part per lane; `done` runs once every lane has stopped
/// reading `pieces` (all fed, ended, or failed: a failed lane ends the others).
pub(crate) fn spawn_feed(f: Feeding, done: Done) {
    let (n, ended, wake) = (f.lanes.len(), f.ended, f.wake);
    let cancel = Arc::new(AtomicBool::new(false));
    let task = per_lane(f.lanes.w, f.pieces, move |end, part| {
        match feed(end, part, &ended, &wake) {
            // Ending is not failing: the reader's answer says how the copy went.
            Err(CopyError::Revoked) => Ok(()),
            Err(e) => {
                ended.store(true, Ordering::Release);
                wake.wake();
                Err(e)
            }
            Ok(()) => Ok(()),
        }
    });
    // No slot: nothing to revoke, so it always starts.
    let _ = cma::spawn_tasks(f.pid, None, cancel, n, task, done);
}

#[cfg(test)]
mod tests;
