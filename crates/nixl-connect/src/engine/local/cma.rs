//! Copies between processes of one host with cross-memory attach (`process_vm_readv`): always a
//! pull into this process's own memory from the peer's.
//!
//! Every copy runs on a process-wide pool of copy threads (never on the engine thread: the peer
//! chooses the addresses, and a page it stalls would stall the thread); large ones are split in
//! pieces of at least [`MIN_PIECE`] bytes across one thread per core (at most [`MAX_THREADS`]).
//! Each system call moves at most [`CHUNK`] bytes, so a cancelled copy stops within a chunk.
#![allow(unsafe_code)]

use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use super::slots::{SlotTable, ARMED, COPYING, DONE};
use crate::error::ErrorSource;
use crate::sync::lock;
use crate::sync::Recover;

/// The smallest piece a large copy is split into for another thread.
pub(crate) const MIN_PIECE: usize = 8 << 20;
/// The most bytes one `process_vm_readv` call moves (the cancellation granularity).
pub(crate) const CHUNK: usize = 8 << 20;
/// The most copy threads the pool starts.
pub(crate) const MAX_THREADS: usize = 8;
const IOV_MAX: usize = 1024;

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
pub(crate) struct Copy {
    pub(crate) pid: libc::pid_t,
    pub(crate) pieces: Vec<Piece>,
    pub(crate) slot: SlotRef,
    pub(crate) cancel: Arc<AtomicBool>,
}

impl Copy {
    pub(crate) fn bytes(&self) -> usize {
        self.pieces.iter().map(|p| p.len).sum()
    }
}

/// Pulls `pieces` from `pid`, in calls of at most [`CHUNK`] bytes and [`IOV_MAX`] pieces.
pub(crate) fn pull(pid: libc::pid_t, pieces: &[Piece], cancel: &AtomicBool) -> Result<(), CopyError> {
    let mut local: Vec<libc::iovec> = Vec::with_capacity(pieces.len().min(IOV_MAX));
    let mut remote: Vec<libc::iovec> = Vec::with_capacity(pieces.len().min(IOV_MAX));
    let mut i = 0;
    let mut off = 0; // bytes of pieces[i] already copied
    while i < pieces.len() {
        if cancel.load(Ordering::Relaxed) {
            return Err(CopyError::Revoked);
        }
        while i < pieces.len() && pieces[i].len == off {
            i += 1; // zero-length pieces (and finished ones) need no system call
            off = 0;
        }
        if i == pieces.len() {
            break;
        }
        local.clear();
        remote.clear();
        let mut batch = 0;
        let (mut j, mut joff) = (i, off);
        while j < pieces.len() && local.len() < IOV_MAX && batch < CHUNK {
            let p = pieces[j];
            let take = (p.len - joff).min(CHUNK - batch);
            if take > 0 {
                local.push(libc::iovec {
                    iov_base: (p.local + joff) as *mut libc::c_void,
                    iov_len: take,
                });
                remote.push(libc::iovec {
                    iov_base: (p.remote + joff) as *mut libc::c_void,
                    iov_len: take,
                });
                batch += take;
            }
            joff += take;
            if joff == p.len {
                j += 1;
                joff = 0;
            }
        }
        // SAFETY: the local iovecs lie in memory this process owns and that the copy's owner keeps
        // valid (and not otherwise accessed) until the copy ends; the remote ones are only read by
        // the kernel, which checks them against the peer's address space.
        let n = unsafe {
            libc::process_vm_readv(
                pid,
                local.as_ptr(),
                local.len() as libc::c_ulong,
                remote.as_ptr(),
                remote.len() as libc::c_ulong,
                0,
            )
        };
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
        // Advance by what was read (a partial read stops at a fault; the next call reports it).
        let mut left = n as usize;
        while left > 0 {
            let rem = pieces[i].len - off;
            if left >= rem {
                left -= rem;
                i += 1;
                off = 0;
            } else {
                off += left;
                left = 0;
            }
        }
        while i < pieces.len() && pieces[i].len == 0 {
            i += 1;
        }
    }
    Ok(())
}

pub(crate) fn finish(slot: &SlotRef) -> Result<(), CopyError> {
    if slot.table.advance(slot.idx, slot.gen, COPYING, DONE) {
        Ok(())
    } else {
        Err(CopyError::Revoked)
    }
}

type Done = Box<dyn FnOnce(Result<(), CopyError>) + Send>;

struct Job {
    pid: libc::pid_t,
    pieces: Vec<Piece>,
    cancel: Arc<AtomicBool>,
    group: Arc<Group>,
}

struct Group {
    left: AtomicUsize,
    error: Mutex<Option<CopyError>>,
    slot: SlotRef,
    done: Mutex<Option<Done>>,
}

/// The process-wide copy pool.
///
/// A copy can block for as long as its peer wants (a page backed by FUSE or by a `userfaultfd`
/// range nobody serves), and nothing interrupts `process_vm_readv` short of killing the process.
/// So no copy runs on the engine thread, one peer (process) runs at most [`Pool::per_peer`] pieces
/// at once, and when every thread is busy the pool grows (to [`MAX_SPARE`] more threads, which
/// leave again after [`SPARE_IDLE`] without work): a peer that stalls its pages holds its own
/// copies and the threads running them, never another peer's.
struct Pool {
    state: Mutex<PoolState>,
    cv: Condvar,
    /// Threads kept (one per core, at most [`MAX_THREADS`]); also the most pieces of one peer
    /// that run at once.
    per_peer: usize,
    /// The process that made it.
    pid: u32,
}

#[derive(Default)]
struct PoolState {
    queue: VecDeque<Job>,
    threads: usize,
    idle: usize,
    busy: HashMap<libc::pid_t, usize>,
}

impl PoolState {
    /// The first queued job whose peer is under its limit.
    fn take(&mut self, per_peer: usize) -> Option<Job> {
        let busy = &self.busy;
        let at = self
            .queue
            .iter()
            .position(|j| busy.get(&j.pid).copied().unwrap_or(0) < per_peer)?;
        let job = self.queue.remove(at)?;
        *self.busy.entry(job.pid).or_default() += 1;
        Some(job)
    }
}

/// The most threads the pool adds while its kept ones are busy.
pub(crate) const MAX_SPARE: usize = 56;
/// How long an added thread waits for work before it leaves.
pub(crate) const SPARE_IDLE: Duration = Duration::from_secs(10);

/// This process's pool. A child made by `fork` inherits the parent's pool without its threads
/// (and perhaps with its lock held), so the pool is per process id: a child starts its own.
fn pool() -> &'static Pool {
    static POOL: AtomicPtr<Pool> = AtomicPtr::new(std::ptr::null_mut());
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
    /// Starts one more thread (counted in `st` before it runs).
    fn start(&'static self, st: &mut PoolState) {
        let n = st.threads;
        let kept = n < self.per_peer;
        let spawned = std::thread::Builder::new()
            .name(format!("nixl-copy-{n}"))
            .spawn(move || self.worker(kept));
        if spawned.is_ok() {
            st.threads += 1;
        }
    }

    fn worker(&'static self, kept: bool) {
        let mut st = lock(&self.state);
        loop {
            let Some(job) = st.take(self.per_peer) else {
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
            drop(st);
            let pid = job.pid;
            run(job);
            st = lock(&self.state);
            if let Some(n) = st.busy.get_mut(&pid) {
                *n -= 1;
                if *n == 0 {
                    st.busy.remove(&pid);
                }
            }
            if !st.queue.is_empty() {
                self.cv.notify_all(); // a job held back by its peer's limit may run now
            }
        }
    }
}

/// Runs one piece of a copy; the last piece to end reports the copy's result.
fn run(job: Job) {
    let r = pull(job.pid, &job.pieces, &job.cancel);
    let g = job.group;
    if let Err(e) = r {
        job.cancel.store(true, Ordering::Relaxed); // stop the other pieces early
        lock(&g.error).get_or_insert(e);
    }
    if g.left.fetch_sub(1, Ordering::AcqRel) == 1 {
        let err = lock(&g.error).take();
        let result = match err {
            Some(e) => Err(e),
            None => finish(&g.slot),
        };
        if let Some(done) = lock(&g.done).take() {
            done(result);
        }
    }
}

/// Starts `c` on the copy pool, split into pieces of at least [`MIN_PIECE`]; `done` runs on a
/// copy thread once every piece has ended. Returns the revocation error at once (without calling
/// `done`) when the grant was revoked before the copy began.
pub(crate) fn spawn(c: Copy, done: Done) -> Result<(), CopyError> {
    if !c.slot.table.advance(c.slot.idx, c.slot.gen, ARMED, COPYING) {
        return Err(CopyError::NotStarted);
    }
    let p = pool();
    let total = c.bytes();
    let parts = (total / MIN_PIECE).clamp(1, p.per_peer);
    let per = total.div_ceil(parts);
    let mut jobs: Vec<Vec<Piece>> = Vec::with_capacity(parts);
    let mut cur = Vec::new();
    let mut in_part = 0;
    for mut p in c.pieces {
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
    let group = Arc::new(Group {
        left: AtomicUsize::new(jobs.len()),
        error: Mutex::new(None),
        slot: c.slot,
        done: Mutex::new(Some(done)),
    });
    let mut st = lock(&p.state);
    let added = jobs.len();
    for pieces in jobs {
        st.queue.push_back(Job {
            pid: c.pid,
            pieces,
            cancel: c.cancel.clone(),
            group: group.clone(),
        });
    }
    // Every thread busy (some perhaps stalled by their peers): add threads for what came.
    let want = added.saturating_sub(st.idle);
    for _ in 0..want {
        if st.threads >= p.per_peer + MAX_SPARE {
            break;
        }
        p.start(&mut st);
    }
    drop(st);
    p.cv.notify_all();
    Ok(())
}

/// True when this process may read the memory of the process behind `pidfd` with
/// `process_vm_readv`, found out without touching that memory (an address the peer chose could
/// be backed by a page that never comes: a FUSE file, a `userfaultfd` range).
///
/// `pidfd_getfd` runs the same check as `process_vm_readv` (`PTRACE_MODE_ATTACH_REALCREDS`: uid,
/// capabilities, Yama's `ptrace_scope`) before it looks up the descriptor; asking for a descriptor
/// number no process has tells the two answers apart: `EPERM` (may not) or `EBADF` (may).
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
mod tests {
    use super::*;

    #[test]
    fn cma_pull_copies_many_pieces_in_batches() {
        let src: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let mut dst = vec![0u8; src.len()];
        // 2,000 pieces (more than IOV_MAX) of unequal sizes, plus a zero-length one.
        let mut pieces = Vec::new();
        let mut at = 0;
        let mut n = 1;
        while at < src.len() {
            let len = (n * 37 % 3000).min(src.len() - at);
            pieces.push(Piece {
                local: dst.as_mut_ptr() as usize + at,
                remote: src.as_ptr() as usize + at,
                len,
            });
            at += len;
            n += 1;
        }
        pull(std::process::id() as i32, &pieces, &AtomicBool::new(false)).unwrap();
        assert!(dst == src);
    }

    #[test]
    fn cma_pull_of_nothing_succeeds() {
        let mut dst = [0u8; 1];
        let empty = Piece {
            local: dst.as_mut_ptr() as usize,
            remote: dst.as_ptr() as usize,
            len: 0,
        };
        pull(std::process::id() as i32, &[], &AtomicBool::new(false)).unwrap();
        pull(
            std::process::id() as i32,
            &[empty, empty],
            &AtomicBool::new(false),
        )
        .unwrap();
    }

    #[test]
    fn cma_pull_reports_a_bad_address() {
        let mut dst = [0u8; 16];
        let p = Piece {
            local: dst.as_mut_ptr() as usize,
            remote: 8,
            len: 16,
        };
        assert!(matches!(
            pull(std::process::id() as i32, &[p], &AtomicBool::new(false)),
            Err(CopyError::Os(_))
        ));
    }

    #[test]
    fn cma_spawn_splits_and_reports_once() {
        let src = vec![9u8; 40 << 20];
        let mut dst = vec![0u8; 40 << 20];
        let table = Arc::new(SlotTable::create().unwrap());
        table.arm(1, 5);
        let (tx, rx) = std::sync::mpsc::channel();
        spawn(
            Copy {
                pid: std::process::id() as i32,
                pieces: vec![Piece {
                    local: dst.as_mut_ptr() as usize,
                    remote: src.as_ptr() as usize,
                    len: src.len(),
                }],
                slot: SlotRef {
                    table: table.clone(),
                    idx: 1,
                    gen: 5,
                },
                cancel: Arc::new(AtomicBool::new(false)),
            },
            Box::new(move |r| tx.send(r).unwrap()),
        )
        .unwrap();
        assert_eq!(rx.recv().unwrap(), Ok(()));
        assert!(rx.try_recv().is_err(), "done runs once");
        assert!(dst == src);
        assert_eq!(table.revoke(1, 5), DONE);
    }
}
