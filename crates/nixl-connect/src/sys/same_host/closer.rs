//! The closer pools: descriptors whose close may block (a pipe whose lock a peer holds, a
//! lingering socket, a FUSE file whose flush never returns) close on threads kept for that.
//!
//! Each kind of close has a pool ([`ClosePool`]) that grows while closes outnumber idle threads,
//! up to [`THREADS`], so a close that never returns holds one thread. Closes waiting are counted
//! over all pools ([`backlogged`]): past the bound the same-host path reads, drains and accepts
//! nothing that can pass descriptors until they drain, so a peer wedges at most the bound and a
//! message's descriptors more per reader. A child of `fork()` starts pools and count anew.

use std::sync::atomic::{AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Mutex;

/// A close to make, with what it does first (drain a socket, defuse it, untrack it).
pub(super) type Job = Box<dyn FnOnce() + Send>;

/// The most threads one pool starts: as many of its closes as this may be held by peers at once
/// before the rest wait behind them (counted, and bounded by [`backlogged`]).
const THREADS: usize = 16;
/// Each closer thread's stack: a close, a drain's 4 KiB chunk and control buffer.
const STACK: usize = 256 << 10;

/// The pools, one per kind of close; replaced in a child of `fork()` (the parent's are leaked:
/// their threads are not in the child).
static POOLS: [AtomicPtr<ClosePool>; 3] = [const { AtomicPtr::new(std::ptr::null_mut()) }; 3];
/// Bumped in a child of `fork()`: a pool of another generation is its parent's.
static GENERATION: AtomicU64 = AtomicU64::new(0);
/// Closes handed over and not yet made, in all pools.
static WAITING: AtomicUsize = AtomicUsize::new(0);
/// The most closes that may wait before [`backlogged`] says so ([`set_bound`]).
static BOUND: AtomicUsize = AtomicUsize::new(1024);

/// One kind of close: its queue and the threads that take from it.
struct ClosePool {
    tx: Sender<Job>,
    rx: Mutex<Receiver<Job>>,
    /// Threads started (at most [`THREADS`]).
    threads: AtomicUsize,
    /// Threads waiting for a close (not in one).
    idle: AtomicUsize,
    /// Closes queued and not yet taken by a thread.
    queued: AtomicUsize,
    /// The process generation this pool belongs to ([`GENERATION`]).
    generation: u64,
    /// Its threads' name.
    name: &'static str,
}

impl ClosePool {
    /// Pool `which` of this process, made on first use (and again in a child of `fork()`).
    fn get(which: usize, name: &'static str) -> &'static ClosePool {
        static AT_FORK: std::sync::Once = std::sync::Once::new();
        AT_FORK.call_once(|| {
            // SAFETY: registers a child handler that only touches atomics (async-signal-safe).
            unsafe { libc::pthread_atfork(None, None, Some(in_child)) };
        });
        let generation = GENERATION.load(Ordering::Acquire);
        let cur = POOLS[which].load(Ordering::Acquire);
        // SAFETY: a pool, once installed, is never freed (leaked when replaced).
        if let Some(p) = unsafe { cur.as_ref() } {
            if p.generation == generation {
                return p;
            }
        }
        let (tx, rx) = channel();
        let new = Box::into_raw(Box::new(ClosePool {
            tx,
            rx: Mutex::new(rx),
            threads: AtomicUsize::new(0),
            idle: AtomicUsize::new(0),
            queued: AtomicUsize::new(0),
            generation,
            name,
        }));
        match POOLS[which].compare_exchange(cur, new, Ordering::AcqRel, Ordering::Acquire) {
            // SAFETY: installed just now, never freed from here on.
            Ok(_) => unsafe { &*new },
            Err(other) => {
                // SAFETY: `new` was never shared; `other` is installed, never freed.
                unsafe {
                    drop(Box::from_raw(new));
                    &*other
                }
            }
        }
    }

    /// Queues `job`, and starts a thread if more closes wait than threads are idle and the pool
    /// may have one more.
    fn hand(&'static self, job: Job) {
        WAITING.fetch_add(1, Ordering::AcqRel);
        self.queued.fetch_add(1, Ordering::AcqRel);
        if let Err(e) = self.tx.send(job) {
            // Never: the receiver lives as long as the pool. Leaked rather than closed here.
            self.queued.fetch_sub(1, Ordering::AcqRel);
            WAITING.fetch_sub(1, Ordering::AcqRel);
            std::mem::forget(e.0);
            return;
        }
        if self.queued.load(Ordering::Acquire) <= self.idle.load(Ordering::Acquire) {
            return;
        }
        let more = self
            .threads
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| {
                (t < THREADS).then_some(t + 1)
            });
        if more.is_err() {
            return;
        }
        self.idle.fetch_add(1, Ordering::AcqRel);
        let thread = std::thread::Builder::new()
            .name(self.name.into())
            .stack_size(STACK);
        if thread.spawn(move || self.run()).is_err() {
            // The close waits for a thread of this pool (none may ever come: then it is leaked,
            // never made here).
            self.threads.fetch_sub(1, Ordering::AcqRel);
            self.idle.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// A thread of the pool: makes the closes queued, one at a time (a close that panics is
    /// counted as made).
    fn run(&self) {
        loop {
            let job = {
                let Ok(rx) = self.rx.lock() else { return };
                rx.recv()
            };
            let Ok(job) = job else { return };
            self.queued.fetch_sub(1, Ordering::AcqRel);
            self.idle.fetch_sub(1, Ordering::AcqRel);
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
            WAITING.fetch_sub(1, Ordering::AcqRel);
            self.idle.fetch_add(1, Ordering::AcqRel);
        }
    }
}

/// Hands `job` to pool `which` (0, 1 or 2; its threads named `name`).
pub(super) fn hand(which: usize, name: &'static str, job: Job) {
    ClosePool::get(which, name).hand(job);
}

/// Sets how many closes may wait before [`backlogged`] says so (from the descriptor limit).
pub(super) fn set_bound(bound: usize) {
    BOUND.store(bound, Ordering::Release);
}

/// Whether more closes wait than the bound: no connection that can pass descriptors is read,
/// nothing is taken from a socket being closed, and no connection is accepted until they drain.
pub(crate) fn backlogged() -> bool {
    WAITING.load(Ordering::Acquire) > BOUND.load(Ordering::Acquire)
}

/// Runs in a child of `fork()`: the parent's pools and count are not the child's.
extern "C" fn in_child() {
    GENERATION.fetch_add(1, Ordering::AcqRel);
    WAITING.store(0, Ordering::Release);
}

#[cfg(test)]
mod tests;
