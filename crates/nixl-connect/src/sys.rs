//! The crate's floor for the system calls outside the same-host wing (whose own floor is
//! `engine/same_host/sys/`): the engine's sleep (`epoll`, an `eventfd`, a `timerfd`), the count
//! of `fork()`s, and raw memory (the loopback transport's copies, byte views of raw descriptors).
//! Every `unsafe` block of these is here, each with its `SAFETY:` line; the modules above call
//! safe functions, but for the raw memory's two (`unsafe fn`s: only their callers know the memory
//! is live). NIXL's FFI is `engine/nixl/ffi.rs`; the CUDA driver's calls are `cuda`'s.
#![allow(unsafe_code)]

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// One `epoll` event: what is ready (`events`) and the token it was registered under (`u64`).
pub(crate) type EpollEvent = libc::epoll_event;

/// An empty event, to fill a buffer [`epoll_wait`] writes into.
pub(crate) const NO_EVENT: EpollEvent = libc::epoll_event { events: 0, u64: 0 };

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
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

/// `fork()`s made since [`count_forks`] was first called (its `pthread_atfork` handler counts
/// them in the child).
pub(crate) fn forks() -> u64 {
    FORKS.load(Ordering::Relaxed)
}

static FORKS: AtomicU64 = AtomicU64::new(0);

/// The child's handler: an atomic's increment, which is async-signal-safe.
extern "C" fn forked() {
    FORKS.fetch_add(1, Ordering::Relaxed);
}

/// Counts every later `fork()` in its child ([`forks`]); registered once, whoever calls it.
pub(crate) fn count_forks() {
    static AT_FORK: std::sync::Once = std::sync::Once::new();
    // SAFETY: registers a child handler that only increments an atomic (async-signal-safe).
    AT_FORK.call_once(|| unsafe {
        libc::pthread_atfork(None, None, Some(forked));
    });
}

/// Copies `len` bytes from address `src` to address `dst` of this process (they may overlap).
///
/// # Safety
/// Both ranges must be live memory of this process for the copy, `src` readable and `dst`
/// writable, and nothing else may write `dst` meanwhile.
#[cfg(any(test, feature = "testing"))]
pub(crate) unsafe fn copy_raw(src: usize, dst: usize, len: usize) {
    // SAFETY: per this function's contract; `ptr::copy` allows overlap.
    unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len) };
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
