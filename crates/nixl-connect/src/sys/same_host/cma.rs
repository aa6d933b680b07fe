//! Copies between processes of one host with cross-memory attach (`process_vm_readv`): always a
//! pull into this process's own memory from the peer's.
//!
//! Every copy runs on a process-wide pool of copy threads (never on the engine thread: the peer
//! chooses the addresses, and a page it stalls would stall the thread); large ones are split in
//! pieces of at least [`MIN_PIECE`] bytes across one thread per core (at most [`MAX_THREADS`]).
//! Each system call moves at most [`CHUNK`] bytes, so a cancelled copy stops within a chunk.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::slots::{SlotTable, ARMED, COPYING, DONE};
use crate::error::ErrorSource;
use crate::pace::PACE;
use crate::sync::lock;
use crate::sync::Recover;

/// The smallest piece a large copy is split into for another thread.
pub(crate) const MIN_PIECE: usize = 8 << 20;
/// The most bytes one `process_vm_readv` call moves (the cancellation granularity).
pub(crate) const CHUNK: usize = 8 << 20;
/// The most copy threads the pool starts.
pub(crate) const MAX_THREADS: usize = 8;
/// The most iovecs one call takes.
const IOV_MAX: usize = 1024;
/// The fewest ranges a large copy of small ranges is split into for another thread.
pub(crate) const MIN_RANGES: usize = 256;

/// One contiguous piece: `len` bytes from `remote` in the peer to `local` here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Piece {
    pub(crate) local: usize,
    pub(crate) remote: usize,
    pub(crate) len: usize,
}

/// Why a copy did not complete.
#[derive(Debug, Clone)]
pub(crate) enum CopyError {
    /// The grant was revoked (or the copy cancelled) before any byte was copied.
    NotStarted,
    /// The source's owner revoked the grant, or the copy was cancelled here, mid-copy: the
    /// destination holds part of the data.
    Revoked,
    /// The peer process is gone.
    PeerGone,
    /// The kernel refused (`EPERM`: ptrace rules; `EFAULT`: an address is not mapped), or the
    /// device failed mid-copy.
    Os(ErrorSource),
    /// This path cannot do it (a device copy: no CUDA here, the peer's GPU not visible, the
    /// handle not openable), found out before any byte moved: the operation may take NIXL.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Unsupported(ErrorSource),
}

/// Equal when of the same kind and, for the kinds with a cause, saying the same.
impl PartialEq for CopyError {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (CopyError::Os(a), CopyError::Os(b)) | (CopyError::Unsupported(a), CopyError::Unsupported(b)) => {
                a.to_string() == b.to_string()
            }
            (a, b) => std::mem::discriminant(a) == std::mem::discriminant(b),
        }
    }
}

/// Where a copy's slot lives, for the revocation protocol.
#[derive(Clone)]
pub(crate) struct SlotRef {
    pub(crate) table: Arc<SlotTable>,
    pub(crate) idx: u32,
    pub(crate) gen: u64,
}

/// A copy to run: pieces pulled from `pid`, guarded by `slot`, stoppable through `cancel`.
pub(crate) struct Pull {
    pid: libc::pid_t,
    pieces: Vec<Piece>,
    slot: SlotRef,
    cancel: Arc<AtomicBool>,
}

impl Pull {
    /// A pull of `pieces` from `pid`, guarded by `slot`, stoppable through `cancel`.
    pub(crate) fn new(pid: libc::pid_t, pieces: Vec<Piece>, slot: SlotRef, cancel: Arc<AtomicBool>) -> Self {
        Self {
            pid,
            pieces,
            slot,
            cancel,
        }
    }

    /// Its parts: the pid, the pieces, the slot, the flag that stops it.
    #[cfg(feature = "cuda")]
    pub(crate) fn into_parts(self) -> (libc::pid_t, Vec<Piece>, SlotRef, Arc<AtomicBool>) {
        (self.pid, self.pieces, self.slot, self.cancel)
    }

    /// Bytes it copies.
    pub(crate) fn bytes(&self) -> usize {
        self.pieces.iter().map(|p| p.len).sum()
    }
}

/// Pulls `pieces` from `pid`, in calls of at most [`CHUNK`] bytes and [`IOV_MAX`] pieces.
pub(crate) fn pull(pid: libc::pid_t, pieces: &[Piece], cancel: &AtomicBool) -> Result<(), CopyError> {
    let (mut i, mut off) = (0, 0); // off: bytes of pieces[i] already copied
    let (mut local_buf, mut remote_buf) = (Vec::new(), Vec::new());
    while i < pieces.len() {
        if cancel.load(Ordering::Relaxed) {
            return Err(CopyError::Revoked);
        }
        advance(pieces, |p| p.len, &mut i, &mut off, 0); // zero-length pieces need no call
        if i == pieces.len() {
            break;
        }
        let local = iovecs(&mut local_buf, pieces, i, off, CHUNK, |p| (p.local, p.len));
        let remote = iovecs(&mut remote_buf, pieces, i, off, CHUNK, |p| (p.remote, p.len));
        // SAFETY: the local iovecs lie in memory this process owns and that the copy's owner keeps
        // valid (and not otherwise accessed) until the copy ends.
        let n = unsafe { readv(pid, local, remote) };
        if n <= 0 {
            let e = io::Error::last_os_error();
            return Err(match e.raw_os_error() {
                Some(libc::ESRCH) => CopyError::PeerGone,
                _ if n == 0 => CopyError::Os(Arc::new(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the peer's memory ended early",
                ))),
                _ => CopyError::Os(Arc::new(e)),
            });
        }
        // A partial read stops at a fault; the next call reports it.
        advance(pieces, |p| p.len, &mut i, &mut off, n as usize);
    }
    Ok(())
}

/// Moves past `n` bytes of `pieces` (each `len(piece)` long) from `*i` (and `*off` into it), then
/// past the pieces with nothing left.
pub(crate) fn advance<P>(
    pieces: &[P],
    len: impl Fn(&P) -> usize,
    i: &mut usize,
    off: &mut usize,
    mut n: usize,
) {
    while n > 0 && *i < pieces.len() {
        let left = len(&pieces[*i]) - *off;
        if n >= left {
            n -= left;
            *i += 1;
            *off = 0;
        } else {
            *off += n;
            n = 0;
        }
    }
    while *i < pieces.len() && len(&pieces[*i]) == *off {
        *i += 1;
        *off = 0;
    }
}

/// Fills `v` (cleared first: one buffer serves every call of a copy) with the iovecs of at most
/// `cap` bytes and [`IOV_MAX`] pieces of `pieces` (each at `at(piece)`: address, length) from `i`
/// (`off` bytes into it) on.
pub(crate) fn iovecs<'v, P>(
    v: &'v mut Vec<libc::iovec>,
    pieces: &[P],
    i: usize,
    off: usize,
    cap: usize,
    at: impl Fn(&P) -> (usize, usize),
) -> &'v [libc::iovec] {
    v.clear();
    let mut total = 0;
    for (k, p) in pieces.iter().enumerate().skip(i) {
        let (addr, len) = at(p);
        let skip = if k == i { off } else { 0 };
        let take = (len - skip).min(cap - total);
        if take > 0 {
            v.push(iov(addr + skip, take));
        }
        total += take;
        if total == cap || v.len() == IOV_MAX {
            break;
        }
    }
    v
}

/// The iovec of `len` bytes at `addr`.
fn iov(addr: usize, len: usize) -> libc::iovec {
    libc::iovec {
        iov_base: addr as *mut libc::c_void,
        iov_len: len,
    }
}

/// One `process_vm_readv` of `remote` (in `pid`) into `local`: the bytes moved, or -1 (errno set).
///
/// # Safety
/// Every `local` iovec must lie in memory this process owns and that nothing else accesses until
/// the call returns. The remote ones are only read, by the kernel, which checks them against the
/// peer's address space.
unsafe fn readv(pid: libc::pid_t, local: &[libc::iovec], remote: &[libc::iovec]) -> isize {
    // SAFETY: the caller's contract for `local`; both slices outlive the call.
    unsafe {
        libc::process_vm_readv(
            pid,
            local.as_ptr(),
            local.len() as libc::c_ulong,
            remote.as_ptr(),
            remote.len() as libc::c_ulong,
            0,
        )
    }
}

/// Ends the grant of `slot` after a copy (`COPYING -> DONE`): `Revoked` if its owner revoked it
/// meanwhile (the bytes copied are then not to be used).
pub(crate) fn finish(slot: &SlotRef) -> Result<(), CopyError> {
    if slot.table.advance(slot.idx, slot.gen, COPYING, DONE) {
        Ok(())
    } else {
        Err(CopyError::Revoked)
    }
}

/// Run once a copy has ended, with how it went.
type Done = Box<dyn FnOnce(Result<(), CopyError>) + Send>;

/// What one job of the pool does.
enum Work {
    /// Pulls these pieces.
    Pull(Vec<Piece>),
    /// Runs a part of a copy that does more than pull (a staged copy's lane: pull into pinned
    /// memory, then DMA to the device).
    Task(Arc<dyn Fn() -> Result<(), CopyError> + Send + Sync>),
}

/// What a pool thread takes at once: parts of copies of one peer, run one after another (a job of
/// many parts is small copies started in the same engine turn, handed over together).
struct Job {
    pid: libc::pid_t,
    parts: Vec<Part>,
    /// Bytes its pulls move (for batching).
    bytes: usize,
    /// Open to more small copies of the same peer (see [`Batch`]).
    batched: bool,
}

/// One part of one copy.
struct Part {
    work: Work,
    cancel: Arc<AtomicBool>,
    group: Arc<Group>,
}

/// The parts of one copy: how many are left, the first error, and what the last one to end does.
struct Group {
    left: AtomicUsize,
    error: Mutex<Option<CopyError>>,
    /// The grant it ends (`COPYING -> DONE`) when every part succeeded; none for a job that
    /// copies into no memory of ours (a pipe's feed).
    slot: Option<SlotRef>,
    done: Mutex<Option<Done>>,
}

impl Group {
    /// A copy of `parts` parts, ending `slot`, reporting to `done`.
    fn new(parts: usize, slot: Option<SlotRef>, done: Done) -> Arc<Self> {
        let (left, error, done) = (AtomicUsize::new(parts), Mutex::new(None), Mutex::new(Some(done)));
        Arc::new(Group {
            left,
            error,
            slot,
            done,
        })
    }
}

/// The process-wide copy pool.
///
/// A peer can block a copy for as long as it wants (a page backed by FUSE or an unserved
/// `userfaultfd`), and nothing interrupts `process_vm_readv`. So one peer runs at most
/// [`Pool::per_peer`] pieces at once, and when every thread is busy the pool grows by up to
/// `per_peer` threads per peer holding threads (at least [`MAX_SPARE`], at most
/// [`MAX_POOL_THREADS`]; spares leave after [`SPARE_IDLE`] idle): a stalling peer holds only its
/// own share.
struct Pool {
    state: Mutex<PoolState>,
    cv: Condvar,
    /// Threads kept (one per core, at most [`MAX_THREADS`]); also the most pieces of one peer
    /// that run at once.
    per_peer: usize,
    /// The process that made it.
    pid: u32,
    /// Jobs queued (kept equal to `state.queue.len()` under its lock), for threads that spin
    /// without it.
    queued: AtomicUsize,
}

#[derive(Default)]
struct PoolState {
    queue: VecDeque<Job>,
    threads: usize,
    /// Threads asleep on the pool's condition variable (not the kept ones spinning).
    idle: usize,
    /// Kept threads spinning for work (each takes a job as soon as `queued` shows one).
    hot: usize,
    /// For each peer with work: its jobs running and queued (kept with the queue, so growing
    /// costs a look at each peer rather than at each queued job).
    peers: HashMap<libc::pid_t, Load>,
}

/// One peer's jobs.
#[derive(Default, Clone, Copy)]
struct Load {
    running: usize,
    queued: usize,
}

impl PoolState {
    /// Queues `job`.
    fn push(&mut self, job: Job) {
        self.peers.entry(job.pid).or_default().queued += 1;
        self.queue.push_back(job);
    }

    /// The first queued job whose peer is under its limit, counted as running.
    fn take(&mut self, per_peer: usize) -> Option<Job> {
        let peers = &self.peers;
        let at = self
            .queue
            .iter()
            .position(|j| peers.get(&j.pid).map_or(0, |l| l.running) < per_peer)?;
        let job = self.queue.remove(at)?;
        let l = self.peers.entry(job.pid).or_default();
        l.queued -= 1;
        l.running += 1;
        Some(job)
    }

    /// The jobs running, and the queued ones that may run now (their peer under its share).
    fn load(&self, per_peer: usize) -> (usize, usize) {
        let (mut running, mut runnable) = (0, 0);
        for l in self.peers.values() {
            running += l.running;
            runnable += l.queued.min(per_peer.saturating_sub(l.running));
        }
        (running, runnable)
    }

    /// How many sleeping threads a submit wakes: one for every queued job that may run now beyond
    /// those the spinning threads will take. Counted over the whole queue (two submits must not
    /// both leave their job to one spinning thread); it may wake more than needed, never fewer.
    fn wakes(&self, per_peer: usize) -> usize {
        let (_, runnable) = self.load(per_peer);
        runnable.saturating_sub(self.hot).min(self.idle)
    }

    /// A job of `pid` ended.
    fn ended(&mut self, pid: libc::pid_t) {
        if let Some(l) = self.peers.get_mut(&pid) {
            l.running = l.running.saturating_sub(1);
            if l.running == 0 && l.queued == 0 {
                self.peers.remove(&pid);
            }
        }
    }
}

/// The threads the pool may add while its kept ones are busy, whatever the number of peers.
pub(crate) const MAX_SPARE: usize = 56;
/// The most threads the pool runs (a bound on what peers that stall can make this process hold:
/// each holds at most `per_peer`, so it takes this many over `per_peer` stalling processes, each
/// with a connection of its own, to make copies queue).
pub(crate) const MAX_POOL_THREADS: usize = 1024;
/// The stack of a copy thread (it only makes system calls).
const COPY_STACK: usize = 256 << 10;
/// How long an added thread waits for work before it leaves.
pub(crate) const SPARE_IDLE: Duration = Duration::from_secs(10);

/// This process's pool (null until the first copy).
static POOL: AtomicPtr<Pool> = AtomicPtr::new(std::ptr::null_mut());

/// Copies queued for this process's copy threads (0 before the first copy), for the metrics.
pub(crate) fn queued() -> usize {
    // SAFETY: a non-null pointer in POOL is a leaked, never freed Pool.
    match unsafe { POOL.load(Ordering::Acquire).as_ref() } {
        Some(p) if p.pid == std::process::id() => p.queued.load(Ordering::Relaxed),
        _ => 0,
    }
}

/// This process's pool. A child made by `fork` inherits the parent's pool without its threads
/// (and perhaps with its lock held), so the pool is per process id: a child starts its own.
fn pool() -> &'static Pool {
    let pid = std::process::id();
    let cur = POOL.load(Ordering::Acquire);
    // SAFETY: a non-null pointer in POOL is a leaked, never freed Pool.
    if let Some(p) = unsafe { cur.as_ref() } {
        if p.pid == pid {
            return p;
        }
    }
    let per_peer = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2)
        .clamp(1, MAX_THREADS);
    let fresh = Box::into_raw(Box::new(Pool {
        state: Mutex::new(PoolState::default()),
        cv: Condvar::new(),
        per_peer,
        pid,
        queued: AtomicUsize::new(0),
    }));
    let p: &'static Pool = match POOL.compare_exchange(cur, fresh, Ordering::AcqRel, Ordering::Acquire) {
        // SAFETY: `fresh` was just leaked and is never freed.
        Ok(_) => unsafe { &*fresh },
        Err(other) => {
            // SAFETY: `fresh` was never shared; `other` is a leaked pool another thread installed.
            unsafe {
                drop(Box::from_raw(fresh));
                return &*other;
            }
        }
    };
    let mut st = lock(&p.state);
    for _ in 0..per_peer {
        p.start(&mut st);
    }
    drop(st);
    p
}

impl Pool {
    /// Queues `jobs` and adds the threads they need.
    fn submit(&'static self, jobs: Vec<Job>) {
        let mut st = lock(&self.state);
        for j in jobs {
            st.push(j);
        }
        self.queued.store(st.queue.len(), Ordering::Release);
        self.grow(&mut st);
        let wake = st.wakes(self.per_peer);
        drop(st);
        for _ in 0..wake {
            self.cv.notify_one();
        }
    }

    /// Adds threads until every queued job that may run now (its peer under its share) has a
    /// thread not running one (the running ones may be stalled by their peers), within the cap:
    /// the kept threads plus `per_peer` for each peer with work and one more, at least
    /// [`MAX_SPARE`] more, at most [`MAX_POOL_THREADS`].
    fn grow(&'static self, st: &mut PoolState) {
        let (running, runnable) = st.load(self.per_peer);
        let peers = st.peers.len();
        let cap = (self.per_peer * (peers + 1))
            .max(self.per_peer + MAX_SPARE)
            .min(MAX_POOL_THREADS);
        while st.threads.saturating_sub(running) < runnable && st.threads < cap {
            let before = st.threads;
            self.start(st);
            if st.threads == before {
                break; // no thread could be started: what is queued waits for one to end
            }
        }
    }

    /// Starts one more thread (counted in `st` before it runs).
    fn start(&'static self, st: &mut PoolState) {
        let n = st.threads;
        let kept = n < self.per_peer;
        let spawned = std::thread::Builder::new()
            .name(format!("nixl-copy-{n}"))
            .stack_size(COPY_STACK)
            .spawn(move || self.worker(kept));
        if spawned.is_ok() {
            st.threads += 1;
        }
    }

    fn worker(&'static self, kept: bool) {
        // A kept thread that just ran a job stays hot a while (`Pace::hot_for`, yielding its
        // core), so back-to-back copies pay no wake-up; not while the host is oversubscribed.
        let mut hot_until: Option<Instant> = None;
        let mut st = lock(&self.state);
        loop {
            let Some(job) = st.take(self.per_peer) else {
                if let Some(t) = hot_until.take() {
                    if Instant::now() < t && crate::pace::worthwhile() {
                        st.hot += 1;
                        drop(st);
                        loop {
                            let cheap = crate::pace::yield_core();
                            if self.queued.load(Ordering::Acquire) > 0 || Instant::now() >= t || !cheap {
                                break;
                            }
                        }
                        st = lock(&self.state);
                        st.hot -= 1;
                        hot_until = Some(t);
                        continue;
                    }
                }
                st.idle += 1;
                let (g, timeout) = if kept {
                    (self.cv.wait(st).recover(), false)
                } else {
                    let (g, t) = self.cv.wait_timeout(st, SPARE_IDLE).recover();
                    (g, t.timed_out())
                };
                st = g;
                st.idle -= 1;
                if timeout && st.queue.is_empty() {
                    st.threads -= 1;
                    return;
                }
                continue;
            };
            self.queued.store(st.queue.len(), Ordering::Release);
            if !st.queue.is_empty() {
                self.grow(&mut st);
            }
            drop(st);
            let pid = job.pid;
            run(job);
            if kept {
                hot_until = Some(Instant::now() + PACE.hot_for());
            }
            st = lock(&self.state);
            st.ended(pid);
            if !st.queue.is_empty() && st.idle > 0 {
                self.cv.notify_all(); // a job held back by its peer's limit may run now
            }
        }
    }
}

/// Runs a job's parts in order. A batched job's pulls go in one system call when they fit; when it
/// moves less than all (a fault, a peer gone), each part runs again on its own, so what a part
/// reports is what its own pull found (the destination is this process's memory).
fn run(job: Job) {
    let pulled = job.parts.len() > 1 && pull_together(job.pid, &job.parts);
    for part in job.parts {
        if pulled {
            end_part(part, Ok(()));
        } else {
            run_part(job.pid, part);
        }
    }
}

/// One `process_vm_readv` of every part's pieces (all pulls, none cancelled, within [`IOV_MAX`]
/// and [`CHUNK`]); true when it moved every byte.
fn pull_together(pid: libc::pid_t, parts: &[Part]) -> bool {
    let mut local: Vec<libc::iovec> = Vec::new();
    let mut remote: Vec<libc::iovec> = Vec::new();
    let mut total = 0usize;
    for part in parts {
        let Work::Pull(pieces) = &part.work else {
            return false;
        };
        if part.cancel.load(Ordering::Relaxed) {
            return false;
        }
        for p in pieces.iter().filter(|p| p.len > 0) {
            total += p.len;
            if local.len() == IOV_MAX || total > CHUNK {
                return false;
            }
            local.push(iov(p.local, p.len));
            remote.push(iov(p.remote, p.len));
        }
    }
    // SAFETY: the local iovecs lie in memory this process owns and that each copy's owner keeps
    // valid (and not otherwise accessed) until its copy ends.
    let n = unsafe { readv(pid, &local, &remote) };
    n >= 0 && n as usize == total
}

/// Runs one part of a copy; the last part to end reports the copy's result.
fn run_part(pid: libc::pid_t, part: Part) {
    let r = match &part.work {
        Work::Pull(pieces) => pull(pid, pieces, &part.cancel),
        Work::Task(f) => std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f()))
            .unwrap_or_else(|_| Err(CopyError::Os(Arc::new(io::Error::other("a copy task panicked"))))),
    };
    end_part(part, r);
}

/// Records how `part` ended; the last part of its copy to end reports the copy's result.
fn end_part(part: Part, r: Result<(), CopyError>) {
    let g = part.group;
    if let Err(e) = r {
        part.cancel.store(true, Ordering::Relaxed); // stop the other pieces early
        lock(&g.error).get_or_insert(e);
    }
    if g.left.fetch_sub(1, Ordering::AcqRel) == 1 {
        let err = lock(&g.error).take();
        let result = match err {
            Some(e) => Err(e),
            None => g.slot.as_ref().map_or(Ok(()), finish),
        };
        if let Some(done) = lock(&g.done).take() {
            done(result);
        }
    }
}

/// The most bytes of small copies one batched job carries; a copy of at most this many bytes is
/// small (see [`Batch`]).
const BATCH_BYTES: usize = 256 << 10;

/// Copies started in one engine turn, submitted at its end, so a peer's small copies reach a pool
/// thread as one job (one hand-off, one lock of the pool). They run one after another: a peer
/// that stalls a page holds only its own batched copies.
#[derive(Default)]
pub(crate) struct Batch {
    jobs: Vec<Job>,
}

impl Batch {
    /// Adds `part` (of `bytes`) of a copy from `pid`: to an open job of the same peer when it is
    /// small and fits, else as a job of its own.
    fn add(&mut self, pid: libc::pid_t, part: Part, bytes: usize) {
        let small = bytes <= BATCH_BYTES;
        if small {
            if let Some(j) = self
                .jobs
                .iter_mut()
                .rev()
                .find(|j| j.pid == pid && j.batched && j.bytes + bytes <= BATCH_BYTES)
            {
                j.parts.push(part);
                j.bytes += bytes;
                return;
            }
        }
        self.jobs.push(Job {
            pid,
            parts: vec![part],
            bytes,
            batched: small,
        });
    }

    /// True when nothing waits to be submitted.
    pub(crate) fn is_empty(&self) -> bool {
        self.jobs.is_empty()
    }

    /// Hands what was added to the pool (one lock of it), leaving the batch empty.
    pub(crate) fn submit(&mut self) {
        if !self.jobs.is_empty() {
            pool().submit(std::mem::take(&mut self.jobs));
        }
    }
}

/// Joins pieces that continue one another on both sides (consecutive parts of one buffer
/// described as many descriptors) into one, so that a call moves them as one range; drops empty
/// ones. The union is exactly the pieces given: nothing outside them is read or written. In
/// place: a copy of one piece (every small operation) allocates nothing here.
pub(crate) fn coalesce(mut pieces: Vec<Piece>) -> Vec<Piece> {
    pieces.retain(|p| p.len > 0);
    // `dedup_by` hands the later piece first; returning true drops it into the earlier one.
    pieces.dedup_by(|next, last| {
        let joins = last.local.checked_add(last.len) == Some(next.local)
            && last.remote.checked_add(last.len) == Some(next.remote)
            && last.len.checked_add(next.len).is_some();
        if joins {
            last.len += next.len;
        }
        joins
    });
    pieces
}

/// Starts `c` on the copy pool at once (see [`spawn_into`]).
#[cfg(test)]
pub(crate) fn spawn(c: Pull, done: Done) -> Result<(), CopyError> {
    let mut b = Batch::default();
    spawn_into(&mut b, c, done)?;
    b.submit();
    Ok(())
}

/// Starts `c` into `batch` (it runs once the batch is submitted), split into pieces of at least
/// [`MIN_PIECE`]; `done` runs on a copy thread once every piece has ended. Returns the revocation
/// error at once (without calling `done`) when the grant was revoked before the copy began.
pub(crate) fn spawn_into(batch: &mut Batch, c: Pull, done: Done) -> Result<(), CopyError> {
    if !c.slot.table.advance(c.slot.idx, c.slot.gen, ARMED, COPYING) {
        return Err(CopyError::NotStarted);
    }
    let p = pool();
    let total = c.bytes();
    let pieces = coalesce(c.pieces);
    // A part is worth a thread of its own from MIN_PIECE bytes, or from MIN_RANGES ranges (the
    // kernel pins each range's pages apart: many small ranges cost more than their bytes).
    let parts = (total / MIN_PIECE)
        .max(pieces.len() / MIN_RANGES)
        .clamp(1, p.per_peer);
    let per = total.div_ceil(parts);
    let mut jobs: Vec<Vec<Piece>> = Vec::with_capacity(parts);
    let mut cur = Vec::new();
    let mut in_part = 0;
    for mut p in pieces {
        while p.len > 0 {
            let last = jobs.len() + 1 == parts;
            let take = if last { p.len } else { p.len.min(per - in_part) };
            cur.push(Piece { len: take, ..p });
            in_part += take;
            p = Piece {
                local: p.local + take,
                remote: p.remote + take,
                len: p.len - take,
            };
            if !last && in_part == per {
                jobs.push(std::mem::take(&mut cur));
                in_part = 0;
            }
        }
    }
    if !cur.is_empty() || jobs.is_empty() {
        jobs.push(cur);
    }
    let group = Group::new(jobs.len(), Some(c.slot), done);
    for pieces in jobs {
        let bytes = pieces.iter().map(|p| p.len).sum();
        let part = Part {
            work: Work::Pull(pieces),
            cancel: c.cancel.clone(),
            group: group.clone(),
        };
        batch.add(c.pid, part, bytes);
    }
    Ok(())
}

/// Runs `task` `parts` times on the copy pool under `pid`'s share of it (as pulls are), guarded
/// by `slot` (none for a job that writes no memory of this process: a pipe's feed); `done` runs
/// once every part has ended (the first error, else the slot's `COPYING -> DONE`). Returns the
/// revocation error at once (without calling `done`) when the grant was revoked before the copy
/// began.
pub(crate) fn spawn_tasks(
    pid: libc::pid_t,
    slot: Option<SlotRef>,
    cancel: Arc<AtomicBool>,
    parts: usize,
    task: Arc<dyn Fn() -> Result<(), CopyError> + Send + Sync>,
    done: Done,
) -> Result<(), CopyError> {
    if let Some(slot) = &slot {
        if !slot.table.advance(slot.idx, slot.gen, ARMED, COPYING) {
            return Err(CopyError::NotStarted);
        }
    }
    let parts = parts.max(1);
    let group = Group::new(parts, slot, done);
    let jobs = (0..parts)
        .map(|_| Job {
            pid,
            parts: vec![Part {
                work: Work::Task(task.clone()),
                cancel: cancel.clone(),
                group: group.clone(),
            }],
            bytes: 0,
            batched: false,
        })
        .collect();
    pool().submit(jobs);
    Ok(())
}

/// True when this process may `process_vm_readv` the process behind `pidfd`, found without
/// touching its memory (a page there may never come): `pidfd_getfd` runs the same ptrace check
/// first, and for a descriptor number no process has answers `EPERM` (may not) or `EBADF` (may).
pub(crate) fn may_pull(pidfd: &OwnedFd) -> bool {
    // SAFETY: pidfd_getfd only reads its integer arguments; on success (impossible for this
    // descriptor number) the descriptor it returns is closed at once.
    let r = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), libc::c_int::MAX, 0) };
    if r >= 0 {
        // SAFETY: a fresh descriptor nothing else owns.
        drop(unsafe { OwnedFd::from_raw_fd(r as libc::c_int) });
        return true;
    }
    io::Error::last_os_error().raw_os_error() == Some(libc::EBADF)
}

#[cfg(test)]
mod tests;
