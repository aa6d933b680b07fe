//! The sockets: the listener, every connection ([`Conn`]) by id, their timers and their place in
//! the engine's poller; decides who may connect (`admission`).

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::time::Instant;

use super::auth::KeyId;
use super::conn::Conn;
use super::limits::{Caps, ACCEPT_BACKOFF, MAX_HANDSHAKING, MAX_HANDSHAKING_PER_PID};
use super::link::Heard;
use super::records::ConnId;
use crate::engine::poller::{Registrar, MAX_TOKEN};
use crate::sys::same_host::dir::DirListener;
use crate::sys::same_host::{accept, close_refused, plug, set_backlog, uid, Tracked, BACKLOG};
use crate::sys::{read_counter, timerfd, timerfd_set};

/// The token of the listening socket in the engine's poller.
pub(super) const LISTENER: u64 = 0;
/// The token of the listening socket in the shared directory.
pub(super) const DIR_LISTENER: u64 = MAX_TOKEN - 2;
/// The poller token of the timer that re-arms the listener after running out of descriptors.
pub(super) const ACCEPT_TIMER: u64 = MAX_TOKEN;
/// The poller token of the timer that fires at the earliest deadline of a connection's core.
pub(super) const DEADLINE_TIMER: u64 = MAX_TOKEN - 1;

/// The listener, the connections and their timers.
pub(super) struct Sockets {
    listener: Option<Tracked>,
    /// The same socket as a file in the shared directory, if there is one.
    dir: Option<DirListener>,
    reg: Registrar,
    /// The caps on served connections.
    caps: Caps,
    /// This process's uid (peers of another are closed at once).
    uid: libc::uid_t,
    conns: HashMap<ConnId, Conn>,
    /// A timer (made up front: there may be no descriptor left when it is needed) that re-arms
    /// the listener after `accept` ran out of descriptors, instead of spinning on it.
    accept_timer: Option<OwnedFd>,
    /// While accepting rests: connections of our own that fill the listeners' queues ([`plug`]).
    plugs: Vec<OwnedFd>,
    /// Whether accepting rests ([`Self::pause_accepting`]), and whether its queues are shed.
    paused: Option<bool>,
    /// A timer for the connections' deadlines (handshakes, partial frames), and when it is armed
    /// to fire.
    deadline_timer: Option<OwnedFd>,
    deadline_armed: Option<Instant>,
}

impl Sockets {
    /// Connections open now (to peers and from them).
    pub(super) fn open(&self) -> usize {
        self.conns.len()
    }

    /// The sockets of a transport serving on `listener` (none: it serves nothing) and on `dir`
    /// (in a shared directory), watched through `reg`, with `caps` on served connections.
    pub(super) fn new(
        listener: Option<Tracked>,
        dir: Option<DirListener>,
        reg: Registrar,
        caps: Caps,
    ) -> Self {
        if let Some(l) = &listener {
            if let Err(e) = reg.add(l.as_raw_fd(), LISTENER, true, false) {
                tracing::warn!(error = %e, "cannot watch the same-host socket");
            }
        }
        if let Some(d) = &dir {
            if let Err(e) = reg.add(d.fd(), DIR_LISTENER, true, false) {
                tracing::warn!(error = %e, "cannot watch the same-host socket in the socket directory");
            }
        }
        let accept_timer = listener.as_ref().and_then(|_| {
            let t = timerfd().ok()?;
            reg.add(t.as_raw_fd(), ACCEPT_TIMER, true, false).ok()?;
            Some(t)
        });
        let deadline_timer = timerfd().ok().and_then(|t| {
            reg.add(t.as_raw_fd(), DEADLINE_TIMER, true, false).ok()?;
            Some(t)
        });
        Self {
            listener,
            dir,
            reg,
            caps,
            uid: uid(),
            conns: HashMap::new(),
            accept_timer,
            plugs: Vec::new(),
            paused: None,
            deadline_timer,
            deadline_armed: None,
        }
    }

    /// The listening socket, when this transport serves.
    pub(super) fn listener(&self) -> Option<RawFd> {
        self.listener.as_ref().map(AsRawFd::as_raw_fd)
    }

    /// Every listening socket: the abstract one and the one in the shared directory.
    pub(super) fn listeners(&self) -> Vec<RawFd> {
        self.listener()
            .into_iter()
            .chain(self.dir.as_ref().map(DirListener::fd))
            .collect()
    }

    /// This process's uid.
    pub(super) fn uid(&self) -> libc::uid_t {
        self.uid
    }

    /// Connection `i`.
    pub(super) fn get(&self, i: ConnId) -> Option<&Conn> {
        self.conns.get(&i)
    }

    /// Connection `i`, to change.
    pub(super) fn get_mut(&mut self, i: ConnId) -> Option<&mut Conn> {
        self.conns.get_mut(&i)
    }

    /// The ids of every connection.
    pub(super) fn ids(&self) -> Vec<ConnId> {
        self.conns.keys().copied().collect()
    }

    /// The connections with frames queued and no wait for writability armed.
    pub(super) fn with_frames_queued(&self) -> Vec<ConnId> {
        self.conns
            .iter()
            .filter(|(_, c)| c.has_unwatched_frames())
            .map(|(i, _)| *i)
            .collect()
    }

    /// Takes `c` in and watches it; its id (never reused, so a late copy or answer can never
    /// reach another connection).
    pub(super) fn insert(&mut self, c: Conn) -> ConnId {
        // Unique in the process, not only in this connector: the CUDA thread, which all
        // connectors share, keeps peers' mappings and this side's exports per connection.
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let _ = self.reg.add(c.fd(), id, true, false);
        self.conns.insert(id, c);
        self.watch_deadline(id);
        id
    }

    /// Stops watching connection `i` and hands it back (the caller ends what depended on it).
    pub(super) fn remove(&mut self, i: ConnId) -> Option<Conn> {
        let c = self.conns.remove(&i)?;
        self.reg.remove(c.fd());
        Some(c)
    }

    /// Client side: the request in connection `i`'s `slot` of generation `gen` ended (see
    /// [`Conn::free_slot`]).
    pub(super) fn free_slot(&mut self, i: ConnId, slot: u32, gen: u64) {
        if let Some(c) = self.conns.get_mut(&i) {
            c.free_slot(slot, gen);
        }
    }

    /// Server side: a read grant of connection `i` ended.
    pub(super) fn ungrant(&mut self, i: ConnId) {
        if let Some(c) = self.conns.get_mut(&i) {
            c.ungrant();
        }
    }

    /// Why a connection from the process named `id` (of our user; see `sys::self_id`) is not
    /// served, if it is not: the served caps (in all, per process), the handshake places (in
    /// all, per process: the handshake window is charged to the process that holds it). A
    /// process in another PID namespace is counted by its id like any other.
    pub(super) fn admission(&self, id: u64) -> Option<String> {
        let (mut served, mut from_pid, mut shaking, mut shaking_pid) = (0, 0, 0, 0);
        for c in self.conns.values().filter(|c| !c.is_client()) {
            let mine = c.peer_id() == id;
            let unshaken = !c.link().is_ready();
            served += 1;
            from_pid += usize::from(mine);
            shaking += usize::from(unshaken);
            shaking_pid += usize::from(mine && unshaken);
        }
        if self.caps.full(served, from_pid) {
            Some(format!(
                "this process serves {served} same-host connections ({from_pid} from yours) \
                 already; use NIXL"
            ))
        } else if shaking_pid >= MAX_HANDSHAKING_PER_PID || shaking >= MAX_HANDSHAKING {
            Some(format!(
                "{shaking} same-host connections ({shaking_pid} from yours) have not finished \
                 their handshake; use NIXL"
            ))
        } else {
            None
        }
    }

    /// Arms the deadline timer for connection `i`'s core, if it has a deadline sooner than the
    /// one armed.
    pub(super) fn watch_deadline(&mut self, i: ConnId) {
        let Some(t) = self.conns.get(&i).and_then(|c| c.link().deadline()) else {
            return;
        };
        if self.deadline_armed.is_some_and(|a| a <= t) {
            return;
        }
        if let Some(fd) = &self.deadline_timer {
            let _ = timerfd_set(fd, t.saturating_duration_since(Instant::now()));
            self.deadline_armed = Some(t);
        }
    }

    /// The deadline timer fired: it is disarmed (the caller times every core out and watches
    /// the deadlines of those left).
    pub(super) fn deadline_fired(&mut self) {
        if let Some(t) = &self.deadline_timer {
            read_counter(t);
        }
        self.deadline_armed = None;
    }

    /// Stops watching the listeners for [`ACCEPT_BACKOFF`], so a failing `accept` does not wake
    /// the engine at once again; with `shed`, their queues are emptied and plugged ([`Self::shed`]).
    pub(super) fn pause_accepting(&mut self, e: &io::Error, shed: bool) {
        let Some(t) = &self.accept_timer else {
            return;
        };
        if self.paused.is_none() {
            tracing::warn!(error = %e, "cannot accept same-host peers now; retrying in 100 ms");
            let _ = timerfd_set(t, ACCEPT_BACKOFF);
            for l in self.listeners() {
                self.reg.remove(l);
            }
            self.paused = Some(false);
        }
        if shed {
            self.shed();
        }
    }

    /// While closes are past their bound: each listener's backlog is 0, queued connections are
    /// closed unread on the closer (their clients take NIXL), and the queue is plugged ([`plug`])
    /// so a client's `connect` fails at once. Once per pause.
    fn shed(&mut self) {
        if self.paused != Some(false) {
            return;
        }
        self.paused = Some(true);
        for l in self.listeners() {
            set_backlog(l, 0);
            for _ in 0..=BACKLOG {
                let Ok(c) = accept(l) else { break };
                close_refused(c);
            }
            self.plugs.extend(plug(l));
        }
    }

    /// Accepting, paused while closes wait past their bound, rests for another
    /// [`ACCEPT_BACKOFF`], shed ([`Self::shed`]) if it paused for a shortage first.
    pub(super) fn rest_accepting(&mut self) {
        if let Some(t) = &self.accept_timer {
            read_counter(t);
            let _ = timerfd_set(t, ACCEPT_BACKOFF);
        }
        self.shed();
    }

    /// The back-off timer fired: the listener is watched again (the caller accepts what waits).
    pub(super) fn resume_accepting(&mut self) {
        if let Some(t) = &self.accept_timer {
            read_counter(t);
        }
        // Our own connections leave the queues (accepted next, they end at once).
        if self.paused.take() == Some(true) {
            self.plugs.clear();
            for l in self.listeners() {
                set_backlog(l, BACKLOG);
            }
        }
        if let Some(l) = &self.listener {
            let _ = self.reg.add(l.as_raw_fd(), LISTENER, true, false);
        }
        if let Some(d) = &self.dir {
            let _ = self.reg.add(d.fd(), DIR_LISTENER, true, false);
        }
    }

    /// Sends what connection `i`'s core has queued ([`Conn::flush`]); watches for writability
    /// while the socket is full.
    pub(super) fn flush(&mut self, i: ConnId) {
        let Some(c) = self.conns.get_mut(&i) else { return };
        if let Some(want) = c.flush() {
            let _ = self.reg.modify(c.fd(), i, true, want);
        }
    }

    /// Reads what is available on connection `i` into its core ([`Conn::read`]).
    pub(super) fn read(&mut self, i: ConnId, key_ids: &HashMap<KeyId, Arc<str>>, heard: &mut Vec<Heard>) {
        if let Some(c) = self.conns.get_mut(&i) {
            c.read(key_ids, heard);
        }
    }
}
