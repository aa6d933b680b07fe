//! The engine thread's sleep: `epoll` over the same-host transport's sockets and an `eventfd` that
//! callers (and copy threads) write to wake it.
//!
//! A waker only makes the syscall when the engine may be asleep: the engine announces it is about
//! to sleep by setting a flag, then checks its queues once more before it does, so a wake-up is
//! never lost and a busy engine is never interrupted.
//!
//! Two epoll instances: the transports' descriptors sit in an inner one, and the engine sleeps in
//! an outer one that holds the `eventfd`, the alarm's `timerfd` ([`Alarm`]) and, unless a waiting
//! caller drives ([`Gate`]), the inner one; a driving caller polls the inner one ([`DriverPoll`]).

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::transport::TransportId;
use crate::sync::Recover;
use crate::sys::{self, EpollEvent, NO_EVENT};

/// A token's bits above this name its owner: 0 the poller itself (its waker), `n + 1` the
/// transport with id `n`; a transport chooses the bits below.
const OWNER_SHIFT: u32 = 56;
/// The largest token a transport may register.
pub(crate) const MAX_TOKEN: u64 = (1 << OWNER_SHIFT) - 1;
/// The token of the waker's eventfd (owner 0, the poller's own), in the outer instance.
const WAKE: u64 = 0;
/// The token of the inner instance in the outer one.
const INNER: u64 = 1;
/// The token of the alarm's timerfd in the outer one.
const ALARM: u64 = 2;

/// Wakes one engine thread; cheap to clone, usable from any thread.
#[derive(Clone)]
pub(crate) struct Waker(Arc<WakerInner>);

struct WakerInner {
    fd: OwnedFd,
    sleeping: AtomicBool,
}

impl Waker {
    /// True while the engine sleeps (or is about to): the moment a caller may drive it.
    pub(crate) fn is_sleeping(&self) -> bool {
        self.0.sleeping.load(Ordering::SeqCst)
    }

    /// Wakes the engine if it sleeps (or is about to).
    pub(crate) fn wake(&self) {
        // Pairs with the fence in `prepare_sleep`: either the engine sees what was queued before
        // this call, or this call sees that the engine sleeps.
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.0.sleeping.swap(false, Ordering::SeqCst) {
            sys::eventfd_add(&self.0.fd, 1);
        }
    }
}

/// The engine's epoll instances plus its waker.
pub(crate) struct Poller {
    /// What the engine sleeps in: the waker's eventfd, the alarm's timerfd and (unless a caller
    /// drives) `epoll`.
    outer: Arc<OwnedFd>,
    /// A timer a driving caller sets when its turn left work due before the engine's own wake.
    alarm: Arc<OwnedFd>,
    /// The transports' descriptors.
    epoll: Registrar,
    waker: Waker,
    events: Vec<EpollEvent>,
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
        let ev = EpollEvent {
            events: (if read { libc::EPOLLIN | libc::EPOLLRDHUP } else { 0 }
                | if write { libc::EPOLLOUT } else { 0 }) as u32,
            u64: self.owner << OWNER_SHIFT | token,
        };
        sys::epoll_ctl(&self.epoll, op, fd, Some(ev))
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
        // A stale descriptor only yields an error.
        let _ = sys::epoll_ctl(&self.epoll, libc::EPOLL_CTL_DEL, fd, None);
    }
}

impl Poller {
    pub(crate) fn new() -> io::Result<Self> {
        sys::count_forks();
        let p = Self {
            outer: Arc::new(sys::epoll_create()?),
            alarm: Arc::new(sys::timerfd()?),
            epoll: Registrar {
                epoll: Arc::new(sys::epoll_create()?),
                owner: 0,
            },
            waker: Waker(Arc::new(WakerInner {
                fd: sys::eventfd()?,
                sleeping: AtomicBool::new(false),
            })),
            events: vec![NO_EVENT; 64],
        };
        let outer = p.outer_registrar();
        outer.add(p.waker.0.fd.as_raw_fd(), WAKE, true, false)?;
        outer.add(p.epoll.epoll.as_raw_fd(), INNER, true, false)?;
        outer.add(p.alarm.as_raw_fd(), ALARM, true, false)?;
        Ok(p)
    }

    fn outer_registrar(&self) -> Registrar {
        Registrar {
            epoll: self.outer.clone(),
            owner: 0,
        }
    }

    /// A driving caller's polls of the transports' descriptors.
    pub(crate) fn driver_poll(&self) -> DriverPoll {
        DriverPoll {
            inner: self.epoll.epoll.clone(),
            events: vec![NO_EVENT; 64],
        }
    }

    /// The engine's alarm, for a driving caller whose turn left work due before the engine wakes.
    pub(crate) fn alarm(&self) -> Alarm {
        Alarm(self.alarm.clone())
    }

    /// The switch that takes the transports' descriptors out of the engine's sleep while callers
    /// drive.
    pub(crate) fn gate(&self) -> Gate {
        Gate {
            outer: self.outer_registrar(),
            inner: self.epoll.epoll.clone(),
            drivers: Mutex::new(0),
        }
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
        // A zero `timeout` is a hot engine's look: at the descriptors alone, whether or not a
        // caller drives.
        if timeout != Some(Duration::ZERO) {
            let n = sys::epoll_wait(&self.outer, &mut self.events, timeout);
            self.awake();
            for ev in &self.events[..n] {
                match ev.u64 {
                    INNER => {} // its descriptors are looked at below
                    ALARM => _ = sys::read_counter(&self.alarm),
                    _ => _ = sys::read_counter(&self.waker.0.fd),
                }
            }
        }
        // The descriptors are looked at after every sleep, whatever woke it: while callers drive,
        // the sleep does not see them, and a wake for a deadline or a command must not be blind
        // to a frame a caller has not read.
        let n = poll_now(&self.epoll.epoll, &mut self.events);
        self.awake(); // a hot look's (a sleep's came above)
        report(&self.events[..n], out);
    }
}

/// The ready descriptors of `inner`, without waiting: how many of `events` it filled.
fn poll_now(inner: &OwnedFd, events: &mut [EpollEvent]) -> usize {
    sys::epoll_wait(inner, events, Some(Duration::ZERO))
}

/// Each of `events` (the inner instance's: transports' tokens only) to its owner.
fn report(events: &[EpollEvent], out: &mut Vec<Ready>) {
    for ev in events {
        let (owner, token) = (ev.u64 >> OWNER_SHIFT, ev.u64 & MAX_TOKEN);
        if let Some(owner) = TransportId::nth((owner as usize).wrapping_sub(1)) {
            out.push(Ready {
                owner,
                token,
                events: ev.events,
            });
        }
    }
}

/// Wakes the sleeping engine at a time a driving caller (or a wait entering the gate) sets: a
/// one-shot `timerfd` in the engine's sleep.
pub(crate) struct Alarm(Arc<OwnedFd>);

impl Alarm {
    /// Rings `after` from now (a zero `after` rings at once), replacing any earlier setting.
    pub(crate) fn set(&self, after: Duration) {
        if let Err(e) = sys::timerfd_set(&self.0, after) {
            tracing::error!("setting the engine's alarm: {e}");
        }
    }
}

/// A driving caller's look at the transports' descriptors: never waits, and leaves the engine's
/// sleep flag alone (the engine still sleeps while a caller drives).
pub(crate) struct DriverPoll {
    inner: Arc<OwnedFd>,
    events: Vec<EpollEvent>,
}

impl DriverPoll {
    /// Adds the ready descriptors to `out`.
    pub(crate) fn poll(&mut self, out: &mut Vec<Ready>) {
        let n = poll_now(&self.inner, &mut self.events);
        report(&self.events[..n], out);
    }
}

/// Takes the transports' descriptors out of the engine's sleep while at least one caller drives,
/// and puts them back when the last one leaves (a descriptor ready by then wakes the engine).
pub(crate) struct Gate {
    outer: Registrar,
    inner: Arc<OwnedFd>,
    /// Callers driving now.
    drivers: Mutex<usize>,
}

impl Gate {
    /// Arms (`on`) or disarms the inner instance's registration in the engine's sleep: disarmed,
    /// not removed, as that is cheaper on every driving wait's path (docs/FIGURES.md).
    fn arm(&self, on: bool) {
        let what = ["taking the sockets out of", "putting the sockets back in"][usize::from(on)];
        if let Err(e) = self.outer.modify(self.inner.as_raw_fd(), INNER, on, false) {
            tracing::error!("{what} the engine's sleep: {e}");
        }
    }

    /// A caller starts driving.
    pub(crate) fn enter(&self) {
        let mut n = self.drivers.lock().recover();
        if *n == 0 {
            self.arm(false);
        }
        *n += 1;
    }

    /// A caller stops driving.
    pub(crate) fn leave(&self) {
        let mut n = self.drivers.lock().recover();
        *n = n.saturating_sub(1);
        if *n == 0 {
            self.arm(true);
        }
    }

    /// True while a caller drives: the engine's sleep does not see the sockets.
    pub(crate) fn driven(&self) -> bool {
        *self.drivers.lock().recover() > 0
    }

    /// Callers driving now.
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn drivers(&self) -> usize {
        *self.drivers.lock().recover()
    }
}

/// A ready descriptor, as [`Poller::wait`] reports it: the transport that registered it, its
/// token and the epoll events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ready {
    owner: TransportId,
    token: u64,
    events: u32,
}

impl Ready {
    /// Descriptor `token` of transport `owner` reported `events`.
    #[cfg(test)]
    pub(crate) fn new(owner: TransportId, token: u64, events: u32) -> Self {
        Self { owner, token, events }
    }

    /// Its token and events, if transport `owner` registered it.
    pub(crate) fn of(&self, owner: usize) -> Option<(u64, u32)> {
        (self.owner.index() == owner).then_some((self.token, self.events))
    }
}

/// True when an event mask reports a hang-up or an error.
pub(crate) fn hung_up(events: u32) -> bool {
    events & (libc::EPOLLHUP | libc::EPOLLERR | libc::EPOLLRDHUP) as u32 != 0
}

#[cfg(test)]
mod tests;
