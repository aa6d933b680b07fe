//! Host memory between processes that cannot read each other's (another PID namespace: the peer's
//! pid is not ours to see; ptrace refused): pipes, fed by the owner of the source and emptied by
//! the owner of the destination.
//!
//! The source's owner makes the pipes (one per lane, [`MAX_LANES`] at most) and passes their read
//! ends over the connection. It splices its own pages into the write ends (`vmsplice`: the pipe
//! references the pages, nothing is copied) from one job on the copy pool ([`feed`]); the
//! destination's owner reads each lane into its own memory from one job per lane ([`fill`]): the
//! one copy, by the side whose memory is written, as on every same-host path. Neither side ever
//! touches the other's memory; each writes only its own.
//!
//! A pipe holds references to the source's pages until they are read, so what is still in it
//! when the operation ends would show the memory's later contents to whoever holds a read end.
//! The source's owner therefore keeps a read end of every pipe it made and empties them
//! ([`drain`]) when the operation ends (completed, revoked, its peer gone) before the memory may
//! be reused; the job that fed them waits for that end ([`wait_end`]) and drains before it
//! reports. Emptying takes the pipe's lock, which a reader holds while its copy runs: a peer whose
//! destination page never comes (a FUSE mapping) can hold it, and with it the drain, as a stalled
//! page holds a `process_vm_readv` (never on the engine thread).
//!
//! Every wait is a `poll` on the pipe and on the job's [`Wake`] (an eventfd the engine writes when
//! the operation ends or is cancelled): nothing sleeps to poll.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use super::cma::{self, CopyError, SlotRef};

type Done = Box<dyn FnOnce(Result<(), CopyError>) + Send>;

pub(crate) use crate::engine::same_host::limits::MAX_LANES;
/// The size a pipe is asked to have (the unprivileged maximum, `/proc/sys/fs/pipe-max-size`'s
/// default): how much of the source one lane holds at once.
pub(crate) const PIPE_BYTES: usize = 1 << 20;
/// The most bytes one `vmsplice` or `readv` moves (a cancelled copy stops within this).
const STEP: usize = 1 << 20;
const IOV_MAX: usize = 1024;

/// One pipe of the source's side: the write end it feeds, and a read end it keeps to empty the
/// pipe when the operation ends (another read end goes to the peer).
pub(crate) struct Lane {
    r: OwnedFd,
    w: OwnedFd,
}

impl Lane {
    /// A read end to pass to the peer (a new descriptor of the same pipe).
    pub(crate) fn read_end(&self) -> io::Result<OwnedFd> {
        self.r.try_clone()
    }

    /// Its write end (tests: a descriptor a hostile peer could pass instead of a read end).
    #[cfg(test)]
    pub(crate) fn write_end_for_tests(&self) -> RawFd {
        self.w.as_raw_fd()
    }
}

/// `n` new pipes (non-blocking, closed on exec), each asked for [`PIPE_BYTES`] (a kernel that
/// allows less keeps its default: only the depth of the lane changes).
pub(crate) fn lanes(n: usize) -> io::Result<Vec<Lane>> {
    (0..n.clamp(1, MAX_LANES))
        .map(|_| {
            let mut p = [0 as RawFd; 2];
            // SAFETY: pipe2 writes two descriptors into the array on success.
            if unsafe { libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) } != 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: two fresh descriptors nothing else owns.
            let (r, w) = unsafe { (OwnedFd::from_raw_fd(p[0]), OwnedFd::from_raw_fd(p[1])) };
            // SAFETY: fcntl on a descriptor this function owns.
            unsafe { libc::fcntl(w.as_raw_fd(), libc::F_SETPIPE_SZ, PIPE_BYTES as libc::c_int) };
            Ok(Lane { r, w })
        })
        .collect()
}

/// True when `fd`, passed by a peer, is the read end of a pipe (`F_GETPIPE_SZ` answers only for
/// pipes, and touches no file system: a FUSE file cannot stall it), opened for reading only. It is
/// made non-blocking (its reads wait in `poll`, never in the kernel's pipe wait).
pub(crate) fn is_read_end(fd: &OwnedFd) -> bool {
    let raw = fd.as_raw_fd();
    // SAFETY: fcntl queries on a descriptor this process owns; they touch no memory.
    unsafe {
        if libc::fcntl(raw, libc::F_GETPIPE_SZ) <= 0 {
            return false;
        }
        let fl = libc::fcntl(raw, libc::F_GETFL);
        if fl < 0 || fl & libc::O_ACCMODE != libc::O_RDONLY {
            return false;
        }
        libc::fcntl(raw, libc::F_SETFL, fl | libc::O_NONBLOCK) == 0
    }
}

/// What wakes a job waiting on pipes: an eventfd, written when its operation ends or is
/// cancelled.
#[derive(Debug)]
pub(crate) struct Wake(OwnedFd);

impl Wake {
    /// A new wake-up.
    pub(crate) fn new() -> io::Result<Self> {
        // SAFETY: eventfd returns a new descriptor or -1.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor nothing else owns.
        Ok(Self(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Wakes the job (it then reads its flags).
    pub(crate) fn wake(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live local to an eventfd this process owns; a full
        // counter (EAGAIN) means a wake-up is pending already.
        unsafe { libc::write(self.0.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }
}

/// Waits until `fd` is ready for `events` or `wake` was written; true when `fd` is ready (or in
/// error: the next call on it says which).
fn wait(fd: RawFd, events: libc::c_short, wake: &Wake) -> bool {
    let mut p = [
        libc::pollfd {
            fd,
            events,
            revents: 0,
        },
        libc::pollfd {
            fd: wake.0.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    // SAFETY: poll reads and writes the two pollfds of a live local array.
    let r = unsafe { libc::poll(p.as_mut_ptr(), 2, -1) };
    r > 0 && p[0].revents != 0
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

/// Moves past `n` bytes of `pieces` from `*i` (and `*off` into it).
fn advance(pieces: &[(usize, usize)], i: &mut usize, off: &mut usize, mut n: usize) {
    while n > 0 && *i < pieces.len() {
        let left = pieces[*i].1 - *off;
        if n >= left {
            n -= left;
            *i += 1;
            *off = 0;
        } else {
            *off += n;
            n = 0;
        }
    }
    while *i < pieces.len() && pieces[*i].1 == *off {
        *i += 1;
        *off = 0;
    }
}

/// The iovecs of at most [`STEP`] bytes from `*i`/`off` on.
fn iovecs(pieces: &[(usize, usize)], i: usize, off: usize) -> Vec<libc::iovec> {
    let mut v = Vec::new();
    let mut total = 0;
    for (k, &(addr, len)) in pieces.iter().enumerate().skip(i) {
        let skip = if k == i { off } else { 0 };
        let take = (len - skip).min(STEP - total);
        if take > 0 {
            v.push(libc::iovec {
                iov_base: (addr + skip) as *mut libc::c_void,
                iov_len: take,
            });
        }
        total += take;
        if total == STEP || v.len() == IOV_MAX {
            break;
        }
    }
    v
}

/// The source's side: splices `pieces` (this process's memory, in stream order) into `lanes`,
/// lane `k` carrying [`span`] `k` of the stream, until every byte is in a pipe, or `ended` is set
/// (then [`CopyError::Revoked`]). Waits in `poll` while the pipes are full (the reader copies at
/// its own pace); copies nothing.
///
/// The caller keeps `pieces` mapped and keeps the memory from reuse until the lanes are drained.
pub(crate) fn feed(
    lanes: &[Lane],
    pieces: &[(usize, usize)],
    ended: &AtomicBool,
    wake: &Wake,
) -> Result<(), CopyError> {
    let total: usize = pieces.iter().map(|p| p.1).sum();
    let n = lanes.len();
    // Each lane's pieces, the one it is at, and how far into it.
    type Left = (Vec<(usize, usize)>, usize, usize);
    let mut left: Vec<Left> = (0..n)
        .map(|k| {
            let (s, e) = span(total, n, k);
            (cut(pieces, s, e), 0, 0)
        })
        .collect();
    let mut polls = Vec::with_capacity(n + 1);
    loop {
        if ended.load(Ordering::Acquire) {
            return Err(CopyError::Revoked);
        }
        let mut progressed = false;
        for (k, (p, i, off)) in left.iter_mut().enumerate() {
            while *i < p.len() {
                let v = iovecs(p, *i, *off);
                // SAFETY: the iovecs lie in this process's memory that the caller keeps mapped
                // (see above); vmsplice only takes references to those pages.
                let r = unsafe {
                    libc::vmsplice(
                        lanes[k].w.as_raw_fd(),
                        v.as_ptr(),
                        v.len(),
                        libc::SPLICE_F_NONBLOCK,
                    )
                };
                if r > 0 {
                    advance(p, i, off, r as usize);
                    progressed = true;
                    continue;
                }
                let e = io::Error::last_os_error();
                if r < 0 && e.kind() == io::ErrorKind::WouldBlock {
                    break;
                }
                return Err(CopyError::Os(std::sync::Arc::new(e)));
            }
        }
        if left.iter().all(|(p, i, _)| *i >= p.len()) {
            return Ok(());
        }
        if progressed {
            continue;
        }
        polls.clear();
        for (k, (p, i, _)) in left.iter().enumerate() {
            if *i < p.len() {
                polls.push(libc::pollfd {
                    fd: lanes[k].w.as_raw_fd(),
                    events: libc::POLLOUT,
                    revents: 0,
                });
            }
        }
        polls.push(libc::pollfd {
            fd: wake.0.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        });
        // SAFETY: poll reads and writes the pollfds of a live local vector.
        unsafe { libc::poll(polls.as_mut_ptr(), polls.len() as libc::nfds_t, -1) };
    }
}

/// The source's side, once everything is fed: waits until `ended` is set (the operation ended:
/// the reader's answer, a revocation, the peer gone), woken through `wake`.
pub(crate) fn wait_end(ended: &AtomicBool, wake: &Wake) {
    while !ended.load(Ordering::Acquire) {
        let mut p = libc::pollfd {
            fd: wake.0.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll reads and writes one live local pollfd.
        unsafe { libc::poll(&mut p, 1, -1) };
        let mut v = 0u64;
        // SAFETY: reads 8 bytes into a live local (the counter, reset).
        unsafe { libc::read(wake.0.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
    }
}

fn dev_null() -> Option<RawFd> {
    static NULL: OnceLock<Option<OwnedFd>> = OnceLock::new();
    NULL.get_or_init(|| {
        std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/null")
            .ok()
            .map(OwnedFd::from)
    })
    .as_ref()
    .map(AsRawFd::as_raw_fd)
}

/// The source's side: empties every lane through the read end it kept, so that no reference to
/// its pages is left for a peer's read end. Returns once each pipe is empty.
pub(crate) fn drain(lanes: &[Lane]) {
    let null = dev_null();
    let mut scratch = [0u8; 4096];
    for l in lanes {
        loop {
            let r = match null {
                // SAFETY: splice between two descriptors this process owns; no memory of ours.
                Some(n) => unsafe {
                    libc::splice(
                        l.r.as_raw_fd(),
                        std::ptr::null_mut(),
                        n,
                        std::ptr::null_mut(),
                        PIPE_BYTES,
                        libc::SPLICE_F_NONBLOCK,
                    )
                },
                // SAFETY: reads into a live local buffer of its length.
                None => unsafe { libc::read(l.r.as_raw_fd(), scratch.as_mut_ptr().cast(), scratch.len()) },
            };
            if r <= 0 {
                break;
            }
        }
    }
}

/// The destination's side: reads one lane (the read end `r` a peer passed, checked by
/// [`is_read_end`]) into `pieces` (this process's memory, in stream order) until they are full.
/// `cancel` (then [`CopyError::Revoked`], or [`CopyError::NotStarted`] if no byte came) stops it
/// within [`STEP`] bytes, woken through `wake`; the end of the stream before the last byte (the
/// source revoked, or its process is gone) is [`CopyError::Revoked`].
///
/// The caller keeps `pieces` mapped and owned by this copy until it returns.
pub(crate) fn fill(
    r: &OwnedFd,
    pieces: &[(usize, usize)],
    cancel: &AtomicBool,
    wake: &Wake,
) -> Result<(), CopyError> {
    let (mut i, mut off) = (0usize, 0usize);
    advance(pieces, &mut i, &mut off, 0);
    let mut moved = false;
    while i < pieces.len() {
        if cancel.load(Ordering::Acquire) {
            return Err(if moved {
                CopyError::Revoked
            } else {
                CopyError::NotStarted
            });
        }
        let v = iovecs(pieces, i, off);
        // SAFETY: the iovecs lie in this process's memory that the caller keeps mapped and owned
        // by this copy (see above); readv writes at most their lengths.
        let n = unsafe { libc::readv(r.as_raw_fd(), v.as_ptr(), v.len() as libc::c_int) };
        if n > 0 {
            moved = true;
            advance(pieces, &mut i, &mut off, n as usize);
        } else if n == 0 {
            return Err(CopyError::Revoked);
        } else {
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::WouldBlock => {
                    wait(r.as_raw_fd(), libc::POLLIN, wake);
                }
                io::ErrorKind::Interrupted => {}
                _ => return Err(CopyError::Os(std::sync::Arc::new(e))),
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
    pub(crate) pid: libc::pid_t,
    pub(crate) lanes: Vec<OwnedFd>,
    pub(crate) pieces: Vec<(usize, usize)>,
    pub(crate) slot: SlotRef,
    pub(crate) cancel: Arc<AtomicBool>,
    pub(crate) wake: Arc<Wake>,
}

/// Starts `c` on the copy pool, one part per lane; `done` runs once every lane has ended.
/// Returns the revocation error at once (without calling `done`) when the grant was revoked
/// before the copy began.
pub(crate) fn spawn_fill(c: Fill, done: Done) -> Result<(), CopyError> {
    let n = c.lanes.len();
    let total: usize = c.pieces.iter().map(|p| p.1).sum();
    let next = AtomicUsize::new(0);
    let (lanes, pieces, cancel, wake) = (c.lanes, c.pieces, c.cancel.clone(), c.wake);
    let task = Arc::new(move || {
        let k = next.fetch_add(1, Ordering::Relaxed);
        let Some(r) = lanes.get(k) else {
            return Ok(());
        };
        let (a, b) = span(total, n, k);
        fill(r, &cut(&pieces, a, b), &cancel, &wake)
    });
    cma::spawn_tasks(c.pid, c.slot, c.cancel, n, task, done)
}

/// The source's side of a copy through pipes: its lanes, fed from `pieces` (this process's
/// memory in stream order) until the operation ends.
pub(crate) struct Feeding {
    /// Whose share of the copy pool it runs under.
    pub(crate) pid: libc::pid_t,
    pub(crate) lanes: Vec<Lane>,
    pub(crate) pieces: Vec<(usize, usize)>,
    pub(crate) ended: Arc<AtomicBool>,
    pub(crate) wake: Arc<Wake>,
}

/// Starts `f` on the copy pool: feeds every lane, waits for the operation's end (set `ended`,
/// then wake), empties the pipes and reports (the feed's own error if it failed; it then ends
/// without waiting). Once `done` ran, no pipe of it holds a page of `pieces`.
pub(crate) fn spawn_feed(f: Feeding, done: Done) {
    let cancel = Arc::new(AtomicBool::new(false));
    let (lanes, pieces, ended, wake) = (f.lanes, f.pieces, f.ended, f.wake);
    let task = Arc::new(move || {
        let r = feed(&lanes, &pieces, &ended, &wake);
        if r.is_ok() {
            wait_end(&ended, &wake);
        }
        drain(&lanes);
        // Ending is not failing: fed in full, the reader's answer says how the copy went.
        match r {
            Err(CopyError::Revoked) => Ok(()),
            r => r,
        }
    });
    cma::spawn_job(f.pid, cancel, task, done);
}

#[cfg(test)]
mod tests;
