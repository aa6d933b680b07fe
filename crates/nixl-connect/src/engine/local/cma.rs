//! Copies between processes of one host with cross-memory attach (`process_vm_readv`): always a
//! pull into this process's own memory from the peer's.
//!
//! Small copies run on the engine thread; large ones are split across a process-wide pool of
//! copy threads (one per core, at most [`MAX_THREADS`]) in pieces of at least [`MIN_PIECE`] bytes.
//! Each system call moves at most [`CHUNK`] bytes, so a cancelled copy stops within a chunk.
#![allow(unsafe_code)]

use std::collections::VecDeque;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};

use super::slots::{SlotTable, ARMED, COPYING, DONE};

/// Copies up to this size run inline on the engine thread.
pub(crate) const INLINE_MAX: usize = 256 << 10;
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
#[derive(Debug, Clone, PartialEq, Eq)]
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
    Os(String),
    /// This path cannot do it (a device copy: no CUDA here, the peer's GPU not visible, the
    /// handle not openable), found out before any byte moved: the operation may take NIXL.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Unsupported(String),
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
                _ if n == 0 => CopyError::Os("the peer's memory ended early".into()),
                _ => CopyError::Os(e.to_string()),
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

/// Runs a whole copy on this thread under the slot protocol.
pub(crate) fn run_inline(c: &Copy) -> Result<(), CopyError> {
    if !c.slot.table.advance(c.slot.idx, c.slot.gen, ARMED, COPYING) {
        return Err(CopyError::NotStarted);
    }
    pull(c.pid, &c.pieces, &c.cancel)?;
    finish(&c.slot)
}

fn finish(slot: &SlotRef) -> Result<(), CopyError> {
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

struct Pool {
    queue: Mutex<VecDeque<Job>>,
    cv: Condvar,
    threads: usize,
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<&'static Pool> = OnceLock::new();
    POOL.get_or_init(|| {
        let threads = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(2)
            .clamp(1, MAX_THREADS);
        let p: &'static Pool = Box::leak(Box::new(Pool {
            queue: Mutex::new(VecDeque::new()),
            cv: Condvar::new(),
            threads,
        }));
        for i in 0..threads {
            let _ = std::thread::Builder::new()
                .name(format!("nixl-copy-{i}"))
                .spawn(move || worker(p));
        }
        p
    })
}

fn worker(p: &'static Pool) {
    loop {
        let job = {
            let mut q = p.queue.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                if let Some(j) = q.pop_front() {
                    break j;
                }
                q = p.cv.wait(q).unwrap_or_else(|e| e.into_inner());
            }
        };
        let r = pull(job.pid, &job.pieces, &job.cancel);
        let g = job.group;
        if let Err(e) = r {
            job.cancel.store(true, Ordering::Relaxed); // stop the other pieces early
            g.error.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(e);
        }
        if g.left.fetch_sub(1, Ordering::AcqRel) == 1 {
            let err = g.error.lock().unwrap_or_else(|e| e.into_inner()).take();
            let result = match err {
                Some(e) => Err(e),
                None => finish(&g.slot),
            };
            if let Some(done) = g.done.lock().unwrap_or_else(|e| e.into_inner()).take() {
                done(result);
            }
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
    let parts = (total / MIN_PIECE).clamp(1, p.threads);
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
    let mut q = p.queue.lock().unwrap_or_else(|e| e.into_inner());
    for pieces in jobs {
        q.push_back(Job {
            pid: c.pid,
            pieces,
            cancel: c.cancel.clone(),
            group: group.clone(),
        });
    }
    drop(q);
    p.cv.notify_all();
    Ok(())
}

/// True when this process may read `pid`'s memory: reads `probe` there and compares.
pub(crate) fn can_read(pid: libc::pid_t, probe_addr: usize, expect: u64) -> bool {
    let mut got = 0u64;
    let piece = Piece {
        local: &mut got as *mut u64 as usize,
        remote: probe_addr,
        len: 8,
    };
    pull(pid, &[piece], &AtomicBool::new(false)).is_ok() && got == expect
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
