//! Connections at the edge: accepting and making them, moving bytes and passed descriptors
//! between the socket and the connection's protocol core ([`Link`]), its deadlines, and closing
//! (and what closing ends).

use std::io;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Instant;

use super::auth;
use super::identity;
use super::limits::{ACCEPT_BACKOFF, MAX_HANDSHAKING, MAX_HANDSHAKING_PER_PID};
use super::link::{Heard, Link};
use super::records::{Conn, ConnId, Phase};
#[cfg(feature = "cuda")]
use super::sys::ipc;
use super::sys::slots::SlotTable;
use super::sys::{
    accept, clear_timer, close_elsewhere, close_refused, connect, peer_cred, pidfd, recv_with_fds,
    refuse_passed_descriptors, self_pid, send, set_timer, socket_name, unix_socket, Control, Tracked,
};
use super::transport::{SameHostTransport, LISTENER};
use super::violation::Violation;
use crate::engine::transport::{Decline, Event};
use crate::error::Error;

/// Bytes read from one connection in one engine turn: a few hundred small frames, or a 16 MiB
/// request in pieces over several turns (its partial frame bounded and timed by the core).
pub(super) const READ_PER_TURN: usize = 1 << 20;

impl SameHostTransport {
    pub(super) fn insert(&mut self, c: Conn) -> ConnId {
        // Ids are never reused, so a late copy or answer can never reach another connection.
        let id = self.next_conn;
        self.next_conn += 1;
        let _ = self.reg.add(c.fd.as_raw_fd(), id, true, false);
        self.conns.insert(id, c);
        self.watch_deadline(id);
        id
    }

    /// Arms the deadline timer for connection `i`'s core, if it has a deadline sooner than the
    /// one armed.
    pub(super) fn watch_deadline(&mut self, i: ConnId) {
        let Some(t) = self.conns.get(&i).and_then(|c| c.link.deadline()) else {
            return;
        };
        if self.deadline_armed.is_some_and(|a| a <= t) {
            return;
        }
        if let Some(fd) = &self.deadline_timer {
            set_timer(fd, t.saturating_duration_since(Instant::now()));
            self.deadline_armed = Some(t);
        }
    }

    /// The deadline timer fired: every core past its deadline dies (and is closed), and the
    /// timer is armed for the next one.
    pub(super) fn on_deadlines(&mut self, out: &mut Vec<Event>) {
        if let Some(t) = &self.deadline_timer {
            clear_timer(t);
        }
        self.deadline_armed = None;
        let now = Instant::now();
        let ids: Vec<ConnId> = self.conns.keys().copied().collect();
        for i in ids {
            let c = self.conns.get_mut(&i).expect("listed");
            c.link.on_timeout(now);
            if c.link.is_dead() {
                tracing::debug!(why = ?c.link.death(), "same-host connection timed out");
                self.close(i, out);
            } else {
                self.watch_deadline(i);
            }
        }
    }

    /// Sends what connection `i`'s core has queued; watches for writability if the socket is
    /// full.
    pub(super) fn flush(&mut self, i: ConnId) {
        let Some(c) = self.conns.get_mut(&i) else { return };
        while !c.link.out().is_empty() {
            let sent = send(c.fd.as_raw_fd(), c.link.out());
            if let Ok(n @ 1..) = sent {
                c.link.sent(n);
            } else {
                let e = sent.err().unwrap_or_else(|| io::ErrorKind::WriteZero.into());
                if e.kind() != io::ErrorKind::WouldBlock {
                    c.link.hang_up(Violation::SocketFailed);
                    c.link.sent(usize::MAX);
                }
                break;
            }
        }
        let want = !c.link.out().is_empty() && !c.link.is_dead();
        if want != c.writing {
            c.writing = want;
            let _ = self.reg.modify(c.fd.as_raw_fd(), i, true, want);
        }
    }

    /// Reads what is available on connection `i` into its core, at most [`READ_PER_TURN`] bytes
    /// (the rest waits for the next turn: the socket stays readable), so that a peer that keeps
    /// its socket full neither holds the engine thread nor makes `heard` grow without bound; what
    /// the core proved goes to `heard`. A descriptor is taken only where the core takes one (the
    /// client's slot table, with its `Hello`), and only if it is a sealed table of the right
    /// size; every other one is closed off this thread.
    pub(super) fn read(&mut self, i: ConnId, heard: &mut Vec<Heard>) {
        let Some(c) = self.conns.get_mut(&i) else { return };
        let mut chunk = [0u8; 64 << 10];
        let mut control = Control::new();
        let mut budget = READ_PER_TURN;
        while !c.link.is_dead() && budget > 0 {
            let mut fds = Vec::new();
            let (n, truncated) = match recv_with_fds(c.fd.as_raw_fd(), &mut chunk, &mut control, &mut fds) {
                Ok((0, _)) => {
                    c.link.hang_up(Violation::PeerClosed);
                    return;
                }
                Ok(r) => r,
                Err(e) => {
                    if e.kind() != io::ErrorKind::WouldBlock {
                        c.link.hang_up(Violation::PeerClosed);
                    }
                    return;
                }
            };
            budget = budget.saturating_sub(n);
            if truncated {
                // Descriptors were cut off (more than a message takes, or our table was full and
                // the kernel closed them): never what an honest peer sends.
                fds.into_iter().for_each(close_elsewhere);
                c.link.kill(Violation::ControlTruncated);
                return;
            }
            let passed = fds.len();
            if passed > 0 {
                if passed == 1 && c.link.takes_descriptors() {
                    // The slot table: checked (sealed memfd first, without touching any other
                    // kind of file) before anything else; from now on no descriptor is taken.
                    refuse_passed_descriptors(c.fd.as_raw_fd());
                    let fd = fds.pop().expect("one");
                    if SlotTable::check(&fd).is_err() {
                        close_elsewhere(fd);
                        c.link.kill(Violation::NotATable);
                        return;
                    }
                    match SlotTable::open(fd) {
                        Ok(t) => c.slots = Some(Arc::new(t)),
                        Err(_) => {
                            c.link.kill(Violation::TableUnmappable);
                            return;
                        }
                    }
                } else {
                    fds.into_iter().for_each(close_elsewhere);
                }
            }
            c.link
                .recv(&chunk[..n], passed, Instant::now(), self.server.key_ids(), heard);
        }
    }

    pub(super) fn accept(&mut self) {
        let Some(lfd) = self.listener.as_ref().map(AsRawFd::as_raw_fd) else {
            return;
        };
        loop {
            let fd = match accept(lfd) {
                Ok(fd) => fd,
                Err(e) => {
                    match e.raw_os_error() {
                        Some(libc::EINTR | libc::ECONNABORTED | libc::EPROTO) => continue,
                        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM) => {
                            self.pause_accepting(&e);
                        }
                        _ => {}
                    }
                    return;
                }
            };
            let pid = match peer_cred(fd.as_raw_fd()) {
                Ok((pid, uid)) if uid == self.uid => pid,
                _ => {
                    // Another user: closed before anything is held for it (no record, no pidfd,
                    // no buffer, no fork tracking), off this thread and after taking what it
                    // queued. A client of another user never sends a hello: it checks our uid
                    // first.
                    self.refused_peers += 1;
                    close_refused(fd);
                    continue;
                }
            };
            let Some(identity) = self.identity.clone() else {
                close_refused(fd);
                continue;
            };
            let (mut served, mut from_pid, mut shaking, mut shaking_pid) = (0, 0, 0, 0);
            for c in self.conns.values().filter(|c| !c.client) {
                let mine = c.peer_pid == pid;
                let unshaken = !c.link.is_ready();
                served += 1;
                from_pid += usize::from(mine);
                shaking += usize::from(unshaken);
                shaking_pid += usize::from(mine && unshaken);
            }
            let refusal = if pid <= 0 {
                // Our user in another PID namespace: its pid is not ours to see, so nothing can be
                // copied from it or checked; told so, it takes NIXL.
                Some("the peer's process is not visible from here (another PID namespace); use NIXL".into())
            } else if served >= self.caps.served || from_pid >= self.caps.per_pid {
                Some(format!(
                    "this process serves {served} same-host connections ({from_pid} from yours) \
                     already; use NIXL"
                ))
            } else if shaking_pid >= MAX_HANDSHAKING_PER_PID || shaking >= MAX_HANDSHAKING {
                // The handshake window is charged to the process that holds it: its own
                // connections that have not shaken hands are what keep it out.
                Some(format!(
                    "{shaking} same-host connections ({shaking_pid} from yours) have not finished \
                     their handshake; use NIXL"
                ))
            } else {
                None
            };
            let link = Link::server(identity, pid, self_pid(), Instant::now());
            // The pidfd is taken now, so that the process a later copy checks is the one that
            // connected (a pid freed meanwhile could name another process by the `Hello`).
            let peer = if refusal.is_none() { pidfd(pid) } else { None };
            let i = self.insert(Conn::new(Tracked::new(fd), link, pid, peer, "".into()));
            if let Some(reason) = refusal {
                self.refused_peers += 1;
                let c = self.conns.get_mut(&i).expect("just inserted");
                c.link.reject(reason);
                self.flush(i);
                self.close(i, &mut Vec::new());
            }
        }
    }

    /// Stops watching the listener for [`ACCEPT_BACKOFF`] (the pending connection stays in the
    /// backlog): an `accept` that fails for want of descriptors would otherwise wake the engine
    /// again at once, for as long as the shortage lasts.
    pub(super) fn pause_accepting(&mut self, e: &io::Error) {
        let (Some(l), Some(t)) = (&self.listener, &self.accept_timer) else {
            return;
        };
        tracing::warn!(error = %e, "cannot accept same-host peers now; retrying in 100 ms");
        self.reg.remove(l.as_raw_fd());
        set_timer(t, ACCEPT_BACKOFF);
    }

    /// The back-off timer fired: watch the listener again and take what waits.
    pub(super) fn resume_accepting(&mut self) {
        if let Some(t) = &self.accept_timer {
            clear_timer(t);
        }
        if let Some(l) = &self.listener {
            let _ = self.reg.add(l.as_raw_fd(), LISTENER, true, false);
        }
        self.accept();
    }

    /// Opens (or finds) the connection to `peer`; `Err` says why there is no same-host path.
    pub(super) fn connect(
        &mut self,
        peer: &Arc<str>,
        key: &Arc<str>,
    ) -> std::result::Result<ConnId, Decline> {
        // A connection open to this exact name was made for its advertisement (the fast path of
        // every operation after the first: nothing parsed again).
        if let Some(i) = self.client.conn_to(peer) {
            if self.conns.get(&i).is_some_and(|c| !c.link.is_dead()) {
                return Ok(i);
            }
        }
        // Only a peer whose agent name advertises a same-host identity is ever connected to: a
        // Python Dynamo peer binds no socket, and whoever binds its name must learn nothing.
        let Some(expect) = identity::advertised(peer) else {
            return Err(
                "the peer's agent name advertises no same-host endpoint (a Python Dynamo \
                        peer, or a connector that serves none)"
                    .into(),
            );
        };
        if self.client.avoids(peer, Instant::now()) {
            return Err("no same-host socket for this peer (none answered a moment ago)".into());
        }
        let r = self.try_connect(peer, key, expect);
        if let Err(reason) = &r {
            self.client.avoid(peer.clone(), Instant::now());
            tracing::trace!(peer = %peer, %reason, "no same-host path");
        }
        r
    }

    pub(super) fn try_connect(
        &mut self,
        peer: &Arc<str>,
        key: &Arc<str>,
        expect: identity::Fingerprint,
    ) -> std::result::Result<ConnId, Decline> {
        let fd = unix_socket().map_err(|e| Decline::because("cannot open a same-host socket", e))?;
        // The server never passes descriptors; the kernel refuses any it tries (where it can).
        refuse_passed_descriptors(fd.as_raw_fd());
        let fd = Tracked::new(fd);
        if let Err(e) = connect(fd.as_raw_fd(), &socket_name(peer)) {
            return Err(Decline::because("no same-host socket for this peer", e));
        }
        let (pid, peer_uid) = peer_cred(fd.as_raw_fd())
            .map_err(|e| Decline::because("cannot learn who holds the peer's same-host socket", e))?;
        if peer_uid != self.uid || pid <= 0 {
            return Err(format!("the peer runs as uid {peer_uid} (this process: {})", self.uid).into());
        }
        // The process that made the listening socket (what SO_PEERCRED names) must still live:
        // a child that kept the socket without running its engine (a raw `clone()` skips the
        // fork handlers) would leave the hello unanswered until its deadline.
        let Some(server) = pidfd(pid) else {
            return Err(
                "the process that made the peer's same-host socket is gone (a child of \
                        it holds the socket)"
                    .into(),
            );
        };
        let link = Link::client(
            key.clone(),
            expect,
            auth::nonce(),
            self_pid(),
            pid,
            Instant::now(),
        );
        let i = self.insert(Conn::new(fd, link, pid, Some(server), peer.clone()));
        if let Err(e) = self.send_hello(i) {
            self.close(i, &mut Vec::new());
            return Err(Decline::because("the same-host handshake failed", e));
        }
        self.client.connected(peer.clone(), i);
        Ok(i)
    }

    /// Closes connection `i`, ending what depended on it.
    pub(super) fn close(&mut self, i: ConnId, out: &mut Vec<Event>) {
        let Some(c) = self.conns.remove(&i) else { return };
        self.reg.remove(c.fd.as_raw_fd());
        // Device mappings opened for this connection are closed (after any copy using them).
        #[cfg(feature = "cuda")]
        ipc::forget(i);
        if c.client {
            self.client.disconnected(&c.peer, i);
            if !c.link.shook_hands() && c.link.peer_went_away() {
                // Closed on us before the handshake: not asked again for a while (what answered
                // is no owner that will serve us now). An owner's proven "not live" is no reason
                // to avoid it (its next operation may be live); an impostor or a rejection was
                // avoided when it was heard.
                self.client.avoid(c.peer.clone(), Instant::now());
            }
            for id in self.client.on_conn(i) {
                let a = self.client.get(id).expect("listed");
                match a.phase {
                    // The copy runs on; its end reports the result.
                    Phase::Copying => {}
                    Phase::Queued | Phase::Exporting | Phase::Requested | Phase::Abandoned => {
                        let a = self.client.remove(id).expect("listed");
                        if let Some(t) = &c.slots {
                            t.revoke(a.slot, a.gen);
                        }
                        if matches!(a.phase, Phase::Abandoned) {
                            continue;
                        }
                        if !c.link.peer_went_away() || !c.link.shook_hands() {
                            // The process on the socket broke the protocol, or the connection
                            // ended before the handshake (a server that refused it without a
                            // word, a squatter, a peer that died): nothing of this operation was
                            // copied, and the peer the metadata names may well be reachable
                            // through NIXL.
                            out.push(Event::Declined {
                                spec: a.spec,
                                reason: format!(
                                    "the same-host connection was closed: {}",
                                    c.link.death().map_or("a protocol error", |v| v.reason())
                                )
                                .into(),
                            });
                        } else {
                            out.push(Event::ActiveEnded {
                                id,
                                result: Err(Error::RemoteGone {
                                    agent: c.peer.to_string(),
                                    reason: "its connector closed the same-host connection (the \
                                             process exited or dropped the connector)"
                                        .into(),
                                    source: None,
                                }),
                            });
                        }
                    }
                }
            }
        } else {
            // Revoke this connection's read grants before forgetting them (its table stays mapped
            // while a copy holds it), so a peer still copying cannot complete against memory the
            // owner may since have given up.
            for s in self.server.scopes_mut() {
                s.grants.retain(|g| {
                    if g.conn == i {
                        if let Some(t) = &c.slots {
                            t.revoke(g.slot, g.gen);
                        }
                    }
                    g.conn != i
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;
    use crate::device::Device;
    use crate::engine::poller::Poller;
    use crate::engine::same_host::link::fuzz::Pair;
    use crate::engine::same_host::wire::{Msg, MAX_FRAME};

    /// A peer that keeps its socket full (here: 4 MiB of replayed requests, each refused) is read
    /// at most [`READ_PER_TURN`] bytes a turn: the engine thread goes back to its other work
    /// between turns, and what one turn decodes is bounded.
    #[test]
    fn conn_reads_at_most_a_budget_per_turn() {
        let poller = Poller::new().unwrap();
        let mut p = Pair::new(0);
        p.shake();
        let (mut t, i, mut theirs) = SameHostTransport::serving(&poller, &mut p);
        let replay = p.forge(&Pair::req(1, 1, 2, false, Device::Host, 1), Some(2), true);
        let frames = (4 << 20) / replay.len();
        let batch = replay.repeat(frames);
        let writer = std::thread::spawn(move || theirs.write_all(&batch).map(|()| theirs));
        let mut turns = 0;
        let mut answered = 0;
        while answered < frames {
            let mut heard = Vec::new();
            t.read(i, &mut heard);
            turns += 1;
            let c = t.conns.get_mut(&i).unwrap();
            assert!(!c.link.is_dead(), "{:?}", c.link.death());
            let out = c.link.out().to_vec();
            c.link.sent(out.len());
            let mut at = 0;
            while let Some((_, n)) = Msg::decode(&out[at..], MAX_FRAME).unwrap() {
                answered += 1;
                at += n;
            }
            assert!(turns < 100_000, "no progress");
        }
        assert!(turns >= 4, "4 MiB in {turns} turns");
        let _keep_open = writer.join().unwrap().unwrap();
    }
}
