//! Connections as the transport sees them: accepting and making them (who may connect is the
//! sockets' `admission`), their deadlines passing, and closing (what a connection's end means for
//! the operations on it). The bytes between a socket and its protocol core are the sockets'
//! (`sockets.rs`).

use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Instant;

use super::auth;
use super::identity;
use super::link::Link;
use super::records::{Conn, ConnId, FeedFor, Phase};
use super::sys::cma;
use super::sys::dir::{connect_path, socket_path};
#[cfg(feature = "cuda")]
use super::sys::ipc;
use super::sys::{
    accept, accept_passed_descriptors, alive_fd, close_refused, connect, peer_cred, peer_process,
    refuse_passed_descriptors, same_pid_namespace, self_id, socket_name, unix_socket, Tracked,
};
use super::transport::SameHostTransport;
use crate::engine::transport::{Decline, Event};
use crate::error::Error;

/// True when this process uses CUDA (its driver library is loaded): its device operations may
/// meet memory without a legacy IPC handle, which moves as VMM descriptors.
fn cuda_in_use() -> bool {
    #[cfg(feature = "cuda")]
    return crate::cuda::driver_loaded();
    #[cfg(not(feature = "cuda"))]
    false
}

impl SameHostTransport {
    /// The deadline timer fired: every core past its deadline dies (and is closed), and the
    /// timer is armed for the next one.
    pub(super) fn on_deadlines(&mut self, out: &mut Vec<Event>) {
        self.sockets.deadline_fired();
        let now = Instant::now();
        for i in self.sockets.ids() {
            let c = self.sockets.get_mut(i).expect("listed");
            c.link.on_timeout(now);
            if c.link.is_dead() {
                tracing::debug!(why = ?c.link.death(), "same-host connection timed out");
                self.close(i, out);
            } else {
                self.sockets.watch_deadline(i);
            }
        }
    }

    /// Accepts what waits on every listener (the abstract socket, the one in the shared
    /// directory).
    pub(super) fn accept(&mut self) {
        for lfd in self.sockets.listeners() {
            self.accept_from(lfd);
        }
    }

    fn accept_from(&mut self, lfd: std::os::fd::RawFd) {
        loop {
            let fd = match accept(lfd) {
                Ok(fd) => fd,
                Err(e) => {
                    match e.raw_os_error() {
                        Some(libc::EINTR | libc::ECONNABORTED | libc::EPROTO) => continue,
                        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM) => {
                            self.sockets.pause_accepting(&e);
                        }
                        _ => {}
                    }
                    return;
                }
            };
            let pid = match peer_cred(fd.as_raw_fd()) {
                Ok((pid, uid)) if uid == self.sockets.uid() => pid,
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
            // The pidfd is taken now, so that the process a later copy checks is the one that
            // connected (a pid freed meanwhile could name another process by the `Hello`).
            let peer = peer_process(fd.as_raw_fd(), pid);
            let peer_id = peer.as_ref().map_or(0, |p| p.0);
            let refusal = match &peer {
                Some(_) => self.sockets.admission(peer_id),
                None => Some(
                    "the peer's process cannot be named from here (another PID namespace, on a \
                     kernel without pidfs), or is gone; use NIXL"
                        .into(),
                ),
            };
            let Some(me) = self_id() else {
                close_refused(fd);
                continue;
            };
            let mut link = Link::server(identity, peer_id, me, Instant::now());
            let peer = if refusal.is_none() {
                peer.map(|p| p.1)
            } else {
                None
            };
            // Whether this side may pull from the client (ptrace rules; never a peer of another
            // PID namespace, whatever its pidfd allows), found once. One it cannot read is asked,
            // in the signed `Welcome`, to write through pipes.
            let can_pull = pid > 0 && peer.as_ref().is_some_and(cma::may_pull);
            if !can_pull {
                link.ask_piped_writes();
            }
            let other_pid_ns = !same_pid_namespace(pid);
            let i = self
                .sockets
                .insert(Conn::new(Tracked::new(fd), link, pid, peer_id, peer, "".into()));
            let c = self.sockets.get_mut(i).expect("just inserted");
            c.can_pull = can_pull;
            c.other_pid_ns = other_pid_ns;
            if let Some(reason) = refusal {
                self.refused_peers += 1;
                let c = self.sockets.get_mut(i).expect("just inserted");
                c.link.reject(reason);
                self.sockets.flush(i);
                self.close(i, &mut Vec::new());
            }
        }
    }

    /// The back-off timer fired: watch the listener again and take what waits.
    pub(super) fn resume_accepting(&mut self) {
        self.sockets.resume_accepting();
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
            if self.sockets.get(i).is_some_and(|c| !c.link.is_dead()) {
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
        let fd = self.dial(peer, &expect)?;
        let (pid, peer_uid) = peer_cred(fd.as_raw_fd())
            .map_err(|e| Decline::because("cannot learn who holds the peer's same-host socket", e))?;
        let uid = self.sockets.uid();
        if peer_uid != uid {
            return Err(format!("the peer runs as uid {peer_uid} (this process: {uid})").into());
        }
        // The process that made the listening socket (what SO_PEERCRED names) must still live:
        // a child that kept the socket without running its engine (a raw `clone()` skips the
        // fork handlers) would leave the hello unanswered until its deadline. A peer found
        // through the shared directory may be in another PID namespace (its pid is 0 from here):
        // it is named by its pidfs id, on kernels that have pidfs.
        let Some((server_id, server)) = peer_process(fd.as_raw_fd(), pid) else {
            return Err(if pid <= 0 {
                "the peer's process is in another PID namespace and this kernel cannot name it \
                 (no pidfs: Linux 6.9 or later)"
            } else {
                "the process that made the peer's same-host socket is gone (a child of it holds \
                 the socket)"
            }
            .into());
        };
        if !alive_fd(&server) {
            return Err(
                "the process that made the peer's same-host socket is gone (a child of it holds \
                 the socket)"
                    .into(),
            );
        }
        // A peer this side cannot read (another PID namespace, ptrace rules) serves its reads
        // through pipes; this side's writes go to it through pipes too (what keeps us from its
        // memory keeps it from ours, in the case this path is for: sibling pods).
        let can_pull = pid > 0 && cma::may_pull(&server);
        // Device exports come as VMM descriptors from a server in another PID namespace (even
        // one whose memory this side can pull: a namespace below this one's), and from any
        // server for memory without a legacy handle, where this process uses CUDA.
        let other_pid_ns = !same_pid_namespace(pid);
        let exports = other_pid_ns || cuda_in_use();
        if !can_pull || exports {
            accept_passed_descriptors(fd.as_raw_fd());
        }
        let Some(me) = self_id() else {
            return Err("this process cannot name itself (no descriptor left for its pidfd)".into());
        };
        let mut link = Link::client(
            key.clone(),
            expect,
            auth::nonce(),
            me,
            server_id,
            !can_pull,
            Instant::now(),
        );
        if exports {
            link.take_exports();
        }
        let i = self
            .sockets
            .insert(Conn::new(fd, link, pid, server_id, Some(server), peer.clone()));
        let c = self.sockets.get_mut(i).expect("just inserted");
        c.can_pull = can_pull;
        c.other_pid_ns = other_pid_ns;
        if let Err(e) = self.send_hello(i) {
            self.close(i, &mut Vec::new());
            return Err(Decline::because("the same-host handshake failed", e));
        }
        self.client.connected(peer.clone(), i);
        Ok(i)
    }

    /// A socket connected to `peer`'s: its abstract socket (this network namespace), else its
    /// socket file in the shared directory (named from the identity it advertises, `expect`).
    fn dial(&self, peer: &Arc<str>, expect: &identity::Fingerprint) -> std::result::Result<Tracked, Decline> {
        let open = || {
            let fd = unix_socket().map_err(|e| Decline::because("cannot open a same-host socket", e))?;
            // The server never passes descriptors; the kernel refuses any it tries (where it can).
            refuse_passed_descriptors(fd.as_raw_fd());
            Ok::<_, Decline>(Tracked::new(fd))
        };
        let fd = open()?;
        let abstract_err = match connect(fd.as_raw_fd(), &socket_name(peer)) {
            Ok(()) => return Ok(fd),
            Err(e) => e,
        };
        let Some(dir) = &self.socket_dir else {
            return Err(Decline::because(
                "no same-host socket for this peer",
                abstract_err,
            ));
        };
        let fd = open()?;
        match connect_path(fd.as_raw_fd(), &socket_path(dir, &identity::stem(expect))) {
            Ok(()) => Ok(fd),
            Err(e) => Err(Decline::because(
                "no same-host socket for this peer, in this network namespace or the socket directory",
                e,
            )),
        }
    }

    /// Closes connection `i`, ending what depended on it.
    pub(super) fn close(&mut self, i: ConnId, out: &mut Vec<Event>) {
        let Some(c) = self.sockets.remove(i) else { return };
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
                            let ev = Event::Declined {
                                spec: a.spec,
                                reason: format!(
                                    "the same-host connection was closed: {}",
                                    c.link.death().map_or("a protocol error", |v| v.reason())
                                )
                                .into(),
                            };
                            // A write's pipes may still be fed from its memory.
                            self.end_act_after_feed(id, ev, out);
                        } else {
                            let ev = Event::ActiveEnded {
                                id,
                                result: Err(Error::RemoteGone {
                                    agent: c.peer.to_string(),
                                    reason: "its connector closed the same-host connection (the \
                                             process exited or dropped the connector)"
                                        .into(),
                                    source: None,
                                }),
                            };
                            self.end_act_after_feed(id, ev, out);
                        }
                    }
                }
            }
        } else {
            // Reads it was served through pipes end: their pipes are emptied, and no reader's
            // answer completes them.
            self.feeds
                .end_where(|w, f| matches!(w, FeedFor::Grant(_)) && f.conn == i);
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
            t.sockets.read(i, t.server.key_ids(), &mut heard);
            turns += 1;
            let c = t.sockets.get_mut(i).unwrap();
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
