//! The crate's floor: every system call and CUDA driver call, each `unsafe` block with its
//! `SAFETY:` line, under safe functions (NIXL's FFI is `engine/nixl/ffi.rs`'s). This file: the
//! engine's sleep (`epoll`, `eventfd`, `timerfd`), the fork count and the lock that keeps calls
//! into NIXL out of a fork, and raw memory (loopback copies through the kernel, byte views);
//! [`same_host`] is the same-host wing's; `cuda` and `loaded` (feature `cuda`) the driver's.
#![allow(unsafe_code)]

#[cfg(feature = "cuda")]
pub(crate) mod cuda;
#[cfg(feature = "cuda")]
mod loaded;
pub(crate) mod same_host;

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};
use std::time::Duration;

/// One `epoll` event: what is ready (`events`) and the token it was registered under (`u64`).
pub(crate) type EpollEvent = libc::epoll_event;

/// An empty event, to fill a buffer [`epoll_wait`] writes into.
pub(crate) const NO_EVENT: EpollEvent = libc::epoll_event { events: 0, u64: 0 };

/// A syscall's result, or the error in `errno` when it is negative.
fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    (r >= 0).then_some(r).ok_or_else(io::Error::last_os_error)
}

/// As [`cvt`], for a call that returns a byte count.
fn cvt_len(n: isize) -> io::Result<usize> {
    usize::try_from(n).map_err(|_| io::Error::last_os_error())
}

/// A new descriptor from a syscall's result, owned from here on.
fn owned(r: libc::c_int) -> io::Result<OwnedFd> {
    // SAFETY: `r` is a descriptor the kernel just created for this call, owned by no one else.
    cvt(r).map(|fd| unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A new `epoll` instance (close-on-exec).
pub(crate) fn epoll_create() -> io::Result<OwnedFd> {
    // SAFETY: a plain syscall creating a new descriptor.
    owned(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) })
}

/// A new non-blocking `eventfd` (close-on-exec), at zero.
pub(crate) fn eventfd() -> io::Result<OwnedFd> {
    // SAFETY: a plain syscall creating a new descriptor.
    owned(unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) })
}

/// A new non-blocking, disarmed `timerfd` on the monotonic clock (close-on-exec).
pub(crate) fn timerfd() -> io::Result<OwnedFd> {
    // SAFETY: a plain syscall creating a new descriptor.
    owned(unsafe { libc::timerfd_create(libc::CLOCK_MONOTONIC, libc::TFD_CLOEXEC | libc::TFD_NONBLOCK) })
}

/// `epoll_ctl(op)` of `fd` in `ep` with `ev` (none for `EPOLL_CTL_DEL`).
pub(crate) fn epoll_ctl(ep: &OwnedFd, op: libc::c_int, fd: RawFd, ev: Option<EpollEvent>) -> io::Result<()> {
    let mut ev = ev;
    let p = ev.as_mut().map_or(std::ptr::null_mut(), |e| e as *mut EpollEvent);
    // SAFETY: `p` is null or points at a live epoll_event for the call (EPOLL_CTL_DEL ignores
    // it); the kernel validates both descriptors.
    cvt(unsafe { libc::epoll_ctl(ep.as_raw_fd(), op, fd, p) }).map(drop)
}

/// Waits in `ep` up to `timeout` (`None`: until something is ready; zero: not at all) and fills
/// `events`; how many it filled (none on an error, an interrupted wait included). Waits under 10
/// ms take `epoll_pwait2`'s timespec (Linux 5.11); older kernels round them up to a millisecond.
pub(crate) fn epoll_wait(ep: &OwnedFd, events: &mut [EpollEvent], timeout: Option<Duration>) -> usize {
    let (fd, evs, len) = (
        ep.as_raw_fd(),
        events.as_mut_ptr(),
        events.len().min(i32::MAX as usize) as i32,
    );
    let n = match timeout {
        Some(t) if !t.is_zero() && t < Duration::from_millis(10) => {
            let ts = libc::timespec {
                tv_sec: 0,
                tv_nsec: t.subsec_nanos() as libc::c_long,
            };
            // SAFETY: `evs` is a live buffer of `len` epoll_events; `ts` outlives the call; a
            // null sigmask keeps the thread's mask.
            let n = unsafe {
                libc::syscall(
                    libc::SYS_epoll_pwait2,
                    fd,
                    evs,
                    len,
                    &ts,
                    std::ptr::null::<libc::sigset_t>(),
                    0,
                )
            } as i32;
            if n < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ENOSYS) {
                // SAFETY: as below.
                unsafe { libc::epoll_wait(fd, evs, len, 1) }
            } else {
                n
            }
        }
        _ => {
            let ms = match timeout {
                None => -1,
                Some(t) => t.as_millis().min(i32::MAX as u128) as i32,
            };
            // SAFETY: `evs` is a live buffer of `len` epoll_events.
            unsafe { libc::epoll_wait(fd, evs, len, ms) }
        }
    };
    n.max(0) as usize
}

/// Adds `n` to the `eventfd` `fd` (non-blocking: a counter at its maximum drops it, which still
/// leaves it readable).
pub(crate) fn eventfd_add(fd: &OwnedFd, n: u64) {
    // SAFETY: writes 8 bytes from a live u64 to the descriptor.
    unsafe { libc::write(fd.as_raw_fd(), (&n as *const u64).cast(), 8) };
}

/// Reads (and so resets) the counter of the non-blocking `eventfd` or `timerfd` `fd`; zero when
/// there was nothing to read.
pub(crate) fn read_counter(fd: &OwnedFd) -> u64 {
    let mut buf = 0u64;
    // SAFETY: reads at most 8 bytes into a live u64 from the descriptor.
    unsafe { libc::read(fd.as_raw_fd(), (&mut buf as *mut u64).cast(), 8) };
    buf
}

/// Arms the `timerfd` `fd` to expire once, `after` from now (at least a nanosecond), replacing
/// any earlier setting.
pub(crate) fn timerfd_set(fd: &OwnedFd, after: Duration) -> io::Result<()> {
    let after = after.max(Duration::from_nanos(1));
    let spec = libc::itimerspec {
        it_interval: libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        },
        it_value: libc::timespec {
            tv_sec: after.as_secs().min(i32::MAX as u64) as libc::time_t,
            tv_nsec: after.subsec_nanos() as libc::c_long,
        },
    };
    // SAFETY: `spec` is a valid itimerspec that outlives the call; the old value is not asked for.
    cvt(unsafe { libc::timerfd_settime(fd.as_raw_fd(), 0, &spec, std::ptr::null_mut()) }).map(drop)
}

/// `fork()`s made since this crate's fork handlers were registered ([`count_forks`], at an
/// engine's start; their child handler counts them).
pub(crate) fn forks() -> u64 {
    FORKS.load(Ordering::Relaxed)
}

static FORKS: AtomicU64 = AtomicU64::new(0);

/// Runs `f`, a call into NIXL (and through it UCX), where no `fork()` of this process happens.
///
/// A fork while another thread is inside UCX leaves the child UCX's process-wide locks held
/// forever. Each call holds a shared lock that a `pthread_atfork` prepare handler takes whole, so
/// forks and calls wait for each other; the lock prefers its writer (calls do not starve a
/// fork), a nested call does not take it again (that would deadlock with a fork waiting), and a
/// thread that forks from inside a call does not wait for itself.
pub(crate) fn outside_fork<T>(f: impl FnOnce() -> T) -> T {
    if CALL_DEPTH.get() > 0 {
        return f();
    }
    count_forks();
    // SAFETY: the gate is initialised (just above, once per process and again in a child).
    unsafe { libc::pthread_rwlock_rdlock(std::ptr::addr_of_mut!(FORK_GATE)) };
    CALL_DEPTH.set(1);
    // Unlocks on the way out, a panic included.
    struct Leave;
    impl Drop for Leave {
        fn drop(&mut self) {
            CALL_DEPTH.set(0);
            // SAFETY: this thread holds the gate shared (taken above, or again by the child
            // handler for a thread that forked inside a call).
            unsafe { libc::pthread_rwlock_unlock(std::ptr::addr_of_mut!(FORK_GATE)) };
        }
    }
    let _leave = Leave;
    f()
}

/// glibc's `PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP` (not in the `libc` crate).
const PREFER_WRITER_NONRECURSIVE: libc::c_int = 2;

static mut FORK_GATE: libc::pthread_rwlock_t = libc::PTHREAD_RWLOCK_INITIALIZER;

thread_local! {
    /// 1 while this thread is inside [`outside_fork`] (holding the gate shared).
    static CALL_DEPTH: std::cell::Cell<u8> = const { std::cell::Cell::new(0) };
    /// Set by the prepare handler when this thread forks from inside a call (it took nothing).
    static FORKED_INSIDE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Counts every later `fork()` in its child ([`forks`]) and makes the gate of [`outside_fork`]:
/// one set of fork handlers, registered once per process. Called at an engine's start, not at
/// the first call into NIXL: a fork while they are made would leave the child's `Once` running.
pub(crate) fn count_forks() {
    static INIT: std::sync::Once = std::sync::Once::new();
    INIT.call_once(|| {
        fork_gate_make();
        // SAFETY: registers handlers that take and release the gate (see each).
        unsafe { libc::pthread_atfork(Some(fork_prepare), Some(fork_parent), Some(fork_child)) };
    });
}

/// (Re)initialises the gate, unlocked, preferring its writer.
fn fork_gate_make() {
    // SAFETY: the attribute is initialised before use and destroyed after; the gate is not in
    // use (first made before any call, or made again in a child, where no other thread exists).
    unsafe {
        let mut attr: libc::pthread_rwlockattr_t = std::mem::zeroed();
        libc::pthread_rwlockattr_init(&mut attr);
        libc::pthread_rwlockattr_setkind_np(&mut attr, PREFER_WRITER_NONRECURSIVE);
        libc::pthread_rwlock_init(std::ptr::addr_of_mut!(FORK_GATE), &attr);
        libc::pthread_rwlockattr_destroy(&mut attr);
    }
}

/// Before a fork: waits for the calls in flight and holds new ones back.
extern "C" fn fork_prepare() {
    if CALL_DEPTH.get() > 0 {
        FORKED_INSIDE.set(true);
        return;
    }
    // SAFETY: the gate is initialised (the handler is registered after it is made).
    unsafe { libc::pthread_rwlock_wrlock(std::ptr::addr_of_mut!(FORK_GATE)) };
}

/// After a fork, in the parent: lets the calls go on.
extern "C" fn fork_parent() {
    if FORKED_INSIDE.replace(false) {
        return;
    }
    // SAFETY: this thread took the gate whole in the prepare handler.
    unsafe { libc::pthread_rwlock_unlock(std::ptr::addr_of_mut!(FORK_GATE)) };
}

/// Has `f` run in every later child of `fork()`, in its fork handler (before anything else of
/// the child runs; the one thread there, no lock of the parent's taken): one function, the last
/// given.
pub(crate) fn in_fork_children(f: extern "C" fn()) {
    count_forks();
    IN_CHILDREN.store(f as *mut (), Ordering::Release);
}

static IN_CHILDREN: AtomicPtr<()> = AtomicPtr::new(std::ptr::null_mut());

/// After a fork, in the child: one more fork counted, a fresh gate (the old one names the
/// parent's thread as its writer), held shared again if this thread forked inside a call; then
/// what [`in_fork_children`] named.
extern "C" fn fork_child() {
    // An atomic's increment, which is async-signal-safe.
    FORKS.fetch_add(1, Ordering::Relaxed);
    FORKED_INSIDE.set(false);
    fork_gate_make();
    let f = IN_CHILDREN.load(Ordering::Acquire);
    if !f.is_null() {
        // SAFETY: only `in_fork_children` stores here, an `extern "C" fn()`.
        let f: extern "C" fn() = unsafe { std::mem::transmute::<*mut (), extern "C" fn()>(f) };
        f();
    }
    if CALL_DEPTH.get() > 0 {
        // SAFETY: the gate was just made; the call this thread is inside releases it.
        unsafe { libc::pthread_rwlock_rdlock(std::ptr::addr_of_mut!(FORK_GATE)) };
    }
}

/// Copies `len` bytes from address `src` to address `dst` of this process with `process_vm_readv`
/// on itself, as a peer's pull would: the kernel checks every address (memory not mapped, or
/// `dst` not writable, is an error, never a fault); the caller vouches for what the addresses
/// mean. The ranges must not overlap.
#[cfg(any(test, feature = "testing"))]
pub(crate) fn copy_in_process(src: usize, dst: usize, len: usize) -> Result<(), same_host::cma::CopyError> {
    let piece = same_host::cma::Piece {
        local: dst,
        remote: src,
        len,
    };
    let me = std::process::id() as libc::pid_t;
    same_host::cma::pull(me, &[piece], &std::sync::atomic::AtomicBool::new(false))
}

/// The `len` bytes at address `addr`, as a slice that lives for `'s`.
///
/// # Safety
/// The memory must be live and unwritten for all of `'s` (a descriptor's own memory, borrowed
/// from it).
pub(crate) unsafe fn bytes<'s>(addr: usize, len: usize) -> &'s [u8] {
    // SAFETY: per this function's contract.
    unsafe { std::slice::from_raw_parts(addr as *const u8, len) }
}

#[cfg(test)]
mod tests;
