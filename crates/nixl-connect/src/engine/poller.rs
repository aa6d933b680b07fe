//! The engine thread's sleep: `epoll` over the same-host transport's sockets and an `eventfd` that
//! callers (and copy threads) write to wake it.
//!
//! A waker only makes the syscall when the engine may be asleep: the engine announces it is about
//! to sleep by setting a flag, then checks its queues once more before it does, so a wake-up is
//! never lost and a busy engine is never interrupted.
#![allow(unsafe_code)]

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::transport::TransportId;

/// A token's bits above this name its owner: 0 the poller itself (its waker), `n + 1` the
/// transport with id `n`; a transport chooses the bits below.
const OWNER_SHIFT: u32 = 56;
/// The largest token a transport may register.
pub(crate) const MAX_TOKEN: u64 = (1 << OWNER_SHIFT) - 1;
/// The token of the waker's eventfd (owner 0, the poller's own).
const WAKE: u64 = 0;

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// Wakes one engine thread; cheap to clone, usable from any thread.
#[derive(Clone)]
pub(crate) struct Waker(Arc<WakerInner>);

struct WakerInner {
    fd: OwnedFd,
    sleeping: AtomicBool,
}

impl Waker {
    /// Wakes the engine if it sleeps (or is about to).
    pub(crate) fn wake(&self) {
        // Pairs with the fence in `prepare_sleep`: either the engine sees what was queued before
        // this call, or this call sees that the engine sleeps.
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.0.sleeping.swap(false, Ordering::SeqCst) {
            let one: u64 = 1;
            // SAFETY: writes 8 bytes from a live u64 to an eventfd this waker owns.
            unsafe { libc::write(self.0.fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
        }
    }
}

/// An epoll instance plus the engine's waker.
pub(crate) struct Poller {
    epoll: Registrar,
    waker: Waker,
    events: Vec<libc::epoll_event>,
}

/// Adds and removes descriptors of one epoll instance on behalf of one owner (a transport keeps
/// its own): [`Poller::wait`] reports a descriptor's readiness to that owner only, under the
/// token it chose.
#[derive(Clone)]
pub(crate) struct Registrar {
    epoll: Arc<OwnedFd>,
    /// The owner's tag in the token's top bits.
    owner: u64,
}

impl Registrar {
    fn ctl(&self, op: libc::c_int, fd: RawFd, token: u64, read: bool, write: bool) -> io::Result<()> {
        if token > MAX_TOKEN {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a poll token above MAX_TOKEN",
            ));
        }
        let mut ev = libc::epoll_event {
            events: (if read { libc::EPOLLIN | libc::EPOLLRDHUP } else { 0 }
                | if write { libc::EPOLLOUT } else { 0 }) as u32,
            u64: self.owner << OWNER_SHIFT | token,
        };
        // SAFETY: `ev` is a valid epoll_event; the kernel validates both descriptors.
        cvt(unsafe { libc::epoll_ctl(self.epoll.as_raw_fd(), op, fd, &mut ev) }).map(drop)
    }

    /// Watches `fd` (level-triggered) under `token`.
    pub(crate) fn add(&self, fd: RawFd, token: u64, read: bool, write: bool) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_ADD, fd, token, read, write)
    }

    /// Changes what `fd` is watched for.
    pub(crate) fn modify(&self, fd: RawFd, token: u64, read: bool, write: bool) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_MOD, fd, token, read, write)
    }

    /// Stops watching `fd` (closing it does that too).
    pub(crate) fn remove(&self, fd: RawFd) {
        // SAFETY: EPOLL_CTL_DEL ignores the event argument; a stale fd only yields an error.
        unsafe {
            libc::epoll_ctl(
                self.epoll.as_raw_fd(),
                libc::EPOLL_CTL_DEL,
                fd,
                std::ptr::null_mut(),
            )
        };
    }
}

impl Poller {
    pub(crate) fn new() -> io::Result<Self> {
        // SAFETY: plain syscalls creating new descriptors; each is owned right after.
        let (ep, ev) = unsafe {
            let ep = cvt(libc::epoll_create1(libc::EPOLL_CLOEXEC))?;
            let ep = OwnedFd::from_raw_fd(ep);
            let ev = cvt(libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK))?;
            (ep, OwnedFd::from_raw_fd(ev))
        };
        let p = Self {
            epoll: Registrar {
                epoll: Arc::new(ep),
                owner: 0,
            },
            waker: Waker(Arc::new(WakerInner {
                fd: ev,
                sleeping: AtomicBool::new(false),
            })),
            events: vec![libc::epoll_event { events: 0, u64: 0 }; 64],
        };
        p.epoll.add(p.waker.0.fd.as_raw_fd(), WAKE, true, false)?;
        Ok(p)
    }

    pub(crate) fn waker(&self) -> Waker {
        self.waker.clone()
    }

    /// A registrar for transport `owner`: what it registers is reported to it alone.
    pub(crate) fn registrar_for(&self, owner: TransportId) -> Registrar {
        Registrar {
            epoll: self.epoll.epoll.clone(),
            owner: owner.index() as u64 + 1,
        }
    }

    /// Announces that the engine is about to sleep; it must re-check its queues afterwards and
    /// then call [`wait`](Self::wait) (or [`awake`](Self::awake) if it found work).
    pub(crate) fn prepare_sleep(&self) {
        self.waker.0.sleeping.store(true, Ordering::SeqCst);
        std::sync::atomic::fence(Ordering::SeqCst);
    }

    /// Cancels [`prepare_sleep`](Self::prepare_sleep).
    pub(crate) fn awake(&self) {
        self.waker.0.sleeping.store(false, Ordering::SeqCst);
    }

    /// Waits up to `timeout` (`None`: until woken) and adds the ready descriptors to `out`, as
    /// their owner, its token and the epoll events.
    pub(crate) fn wait(&mut self, timeout: Option<Duration>, out: &mut Vec<Ready>) {
        let (ep, evs, len) = (
            self.epoll.epoll.as_raw_fd(),
            self.events.as_mut_ptr(),
            self.events.len() as i32,
        );
        let n = match timeout {
            // Sub-millisecond sleeps need epoll_pwait2's timespec (Linux 5.11); older kernels
            // round up to a millisecond with epoll_wait.
            Some(t) if !t.is_zero() && t < Duration::from_millis(10) => {
                let ts = libc::timespec {
                    tv_sec: 0,
                    tv_nsec: t.subsec_nanos() as libc::c_long,
                };
                // SAFETY: `evs` is a live buffer of `len` epoll_events; `ts` outlives the call;
                // a null sigmask keeps the thread's mask.
                let n = unsafe {
                    libc::syscall(
                        libc::SYS_epoll_pwait2,
                        ep,
                        evs,
                        len,
                        &ts,
                        std::ptr::null::<libc::sigset_t>(),
                        0,
                    )
                } as i32;
                if n < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ENOSYS) {
                    // SAFETY: as below.
                    unsafe { libc::epoll_wait(ep, evs, len, 1) }
                } else {
                    n
                }
            }
            _ => {
                let ms = match timeout {
                    None => -1,
                    Some(t) if t.is_zero() => 0,
                    Some(t) => t.as_millis().clamp(1, i32::MAX as u128) as i32,
                };
                // SAFETY: `evs` is a live buffer of `len` epoll_events.
                unsafe { libc::epoll_wait(ep, evs, len, ms) }
            }
        };
        self.awake();
        for ev in &self.events[..n.max(0) as usize] {
            let (owner, token) = (ev.u64 >> OWNER_SHIFT, ev.u64 & MAX_TOKEN);
            match TransportId::nth((owner as usize).wrapping_sub(1)) {
                Some(owner) => out.push(Ready {
                    owner,
                    token,
                    events: ev.events,
                }),
                None => {
                    let mut buf = 0u64;
                    // SAFETY: reads 8 bytes into a live u64 from the waker's own nonblocking
                    // eventfd.
                    unsafe { libc::read(self.waker.0.fd.as_raw_fd(), (&mut buf as *mut u64).cast(), 8) };
                }
            }
        }
    }
}

/// A ready descriptor, as [`Poller::wait`] reports it: the transport that registered it, its
/// token and the epoll events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ready {
    pub(crate) owner: TransportId,
    pub(crate) token: u64,
    pub(crate) events: u32,
}

/// True when an event mask reports a hang-up or an error.
pub(crate) fn hung_up(events: u32) -> bool {
    events & (libc::EPOLLHUP | libc::EPOLLERR | libc::EPOLLRDHUP) as u32 != 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poller_wakes_only_when_asleep() {
        let mut p = Poller::new().unwrap();
        let w = p.waker();
        let mut out = Vec::new();
        w.wake(); // not sleeping: no syscall, nothing pending
        p.wait(Some(Duration::ZERO), &mut out);
        assert!(out.is_empty());
        p.prepare_sleep();
        let t = std::thread::spawn(move || w.wake());
        t.join().unwrap();
        let t0 = std::time::Instant::now();
        p.wait(Some(Duration::from_secs(5)), &mut out);
        assert!(t0.elapsed() < Duration::from_secs(4), "the wake-up was not lost");
    }

    #[test]
    fn poller_reports_a_descriptor_to_its_owner_under_its_own_token() {
        let mut p = Poller::new().unwrap();
        let (a, b) = (TransportId::nth(0).unwrap(), TransportId::nth(3).unwrap());
        let (ra, rb) = (p.registrar_for(a), p.registrar_for(b));
        let (x, y) = (
            std::os::unix::net::UnixStream::pair().unwrap(),
            std::os::unix::net::UnixStream::pair().unwrap(),
        );
        // The same token, chosen by two owners.
        ra.add(x.0.as_raw_fd(), 5, false, true).unwrap();
        rb.add(y.0.as_raw_fd(), 5, false, true).unwrap();
        assert!(ra.add(x.1.as_raw_fd(), MAX_TOKEN + 1, true, false).is_err());
        let mut out = Vec::new();
        p.wait(Some(Duration::ZERO), &mut out);
        out.sort_by_key(|r| r.owner.index());
        let owners: Vec<_> = out.iter().map(|r| (r.owner, r.token)).collect();
        assert_eq!(owners, [(a, 5), (b, 5)]);
    }
}
