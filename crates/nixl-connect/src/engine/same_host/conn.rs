//! One same-host connection ([`Conn`]): the socket and its edge (the peer's process, the slot
//! table, descriptors passed either way), moving bytes and descriptors to its core ([`Link`]).

use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::time::Instant;

use super::auth::KeyId;
use super::link::{Heard, Link};
use super::violation::Violation;
use super::wire::IpcSource;
use crate::engine::transport::OpId;
use crate::sys::same_host::cma::SlotRef;
use crate::sys::same_host::slots::{SlotTable, SLOTS};
use crate::sys::same_host::{
    accept_passed_descriptors, close_elsewhere, closer, is_cuda_export, passes_rights, pipe, recv_with_fds,
    send, send_with_fds, Control, Tracked,
};

/// Bytes read from one connection in one engine turn: a few hundred small frames, or a 16 MiB
/// request in pieces over several turns (its partial frame bounded and timed by the core).
pub(super) const READ_PER_TURN: usize = 1 << 20;

/// Export ids kept per connection for its `Forgot` frames (the importer keeps at most 256
/// mappings: older ids are long unmapped).
const MAX_NAMED: usize = 1024;

/// Stand-in pool keys: pids are positive, peers of another PID namespace take -1 ..= -2^30, feeds
/// of pipes -2^31 ..= -2^30 - 1 (a collision between two peers only shares a share).
const STAND_INS: u64 = 1 << 30;

/// One socket, made (client) or accepted (server), and its bookkeeping; its core ([`Link`]) checks
/// what the peer says.
pub(super) struct Conn {
    fd: Tracked,
    peer_pid: libc::pid_t,
    peer_id: u64,
    pidfd: Option<Arc<OwnedFd>>,
    /// The protocol core: framing, handshake, deadlines, proofs.
    link: Link,
    writing: bool,
    slots: Option<Arc<SlotTable>>,
    /// Server side: read grants this connection holds (at most
    /// [`MAX_GRANTS_PER_CONN`](super::limits::MAX_GRANTS_PER_CONN)).
    granted: usize,
    /// Server side: device ranges of this connection's reads queued for export (at most
    /// [`MAX_EXPORTING_PER_CONN`](super::limits::MAX_EXPORTING_PER_CONN)).
    exporting: usize,
    can_pull: bool,
    /// The peer lives in another PID namespace (a pod): legacy CUDA IPC handles do not open
    /// across, so device memory moves as VMM descriptors.
    other_pid_ns: bool,
    /// Client side: the peer's agent name, operations waiting for the handshake, free slots.
    peer: Arc<str>,
    queued: Vec<OpId>,
    free_slots: Vec<u32>,
    gens: Vec<u64>,
    /// Export ids of the VMM descriptors the peer passed here (the latest [`MAX_NAMED`]): its
    /// `Forgot` frames release this side's mappings of these alone, each once.
    named: VecDeque<u64>,
    /// Pipes' read ends the peer passed, in order, not yet taken by the frame they came with
    /// (the core counts them; closed off the engine thread if never taken).
    passed: VecDeque<OwnedFd>,
    /// Pipes' read ends to pass with the byte at this offset of the stream sent (the first byte
    /// of the frame that says it passes them), in order.
    attach: VecDeque<(u64, pipe::Ends)>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        // A peer's descriptors never close on the engine thread (a FUSE file's close can block).
        self.passed.drain(..).for_each(close_elsewhere);
    }
}

impl Conn {
    /// Sends the core's `Hello` with a fresh slot table's descriptor attached (the client's
    /// first frame), and keeps the table.
    pub(super) fn send_hello(&mut self) -> io::Result<()> {
        let table = Arc::new(SlotTable::create()?);
        // Nothing about this process but the key's hash and a nonce: the server proves it holds
        // the key before anything else is sent.
        let buf = self.link.out();
        let n = send_with_fds(self.fd.as_raw_fd(), buf, &[table.fd().as_raw_fd()])?;
        if n != buf.len() {
            // A fresh connection's buffer always takes a few dozen bytes; anything else is broken.
            return Err(io::Error::other("the hello did not fit the socket"));
        }
        self.link.sent(n);
        self.slots = Some(table);
        Ok(())
    }

    /// Client side: the request in `slot` of generation `gen` ended; the slot is free again (for
    /// the peer, and for this side's next request). A slot of another generation is left alone.
    pub(super) fn free_slot(&mut self, slot: u32, gen: u64) {
        if self.link.is_client() && self.gens.get(slot as usize) == Some(&gen) {
            if let Some(t) = &self.slots {
                t.free(slot, gen);
            }
            self.free_slots.push(slot);
        }
    }

    /// Whose share of the copy pool this connection's copies run under: the peer's pid, or, for a
    /// peer in another PID namespace (pid 0 from here), a stand-in of its own from its id, so
    /// that no two such peers share one.
    pub(super) fn pool_key(&self) -> libc::pid_t {
        if self.peer_pid > 0 {
            self.peer_pid
        } else {
            -1 - (self.peer_id % STAND_INS) as libc::pid_t
        }
    }

    /// Whose share of the copy pool this connection's feeds run under: apart from
    /// [`Self::pool_key`]'s, so feeds waiting for the peer never hold up fills this side owes it
    /// (two processes piping to each other would each wait for the other's).
    pub(super) fn feed_key(&self) -> libc::pid_t {
        let k = if self.peer_pid > 0 {
            self.peer_pid as u64
        } else {
            self.peer_id
        };
        i32::MIN + (k % STAND_INS) as libc::pid_t
    }

    /// A connection record, with the pidfd of the peer's process the caller took (the handshake
    /// caps bound how many connections without a `Hello` hold one).
    pub(super) fn new(
        fd: Tracked,
        link: Link,
        peer_pid: libc::pid_t,
        peer_id: u64,
        pidfd: Option<OwnedFd>,
        peer: Arc<str>,
    ) -> Self {
        let slots = if link.is_client() { SLOTS } else { 0 };
        Self {
            fd,
            peer_pid,
            peer_id,
            pidfd: pidfd.map(Arc::new),
            link,
            writing: false,
            slots: None,
            granted: 0,
            exporting: 0,
            can_pull: false,
            other_pid_ns: false,
            named: VecDeque::new(),
            peer,
            queued: Vec::new(),
            free_slots: (0..slots as u32).rev().collect(),
            gens: vec![0; slots],
            passed: VecDeque::new(),
            attach: VecDeque::new(),
        }
    }

    /// The protocol core.
    pub(super) fn link(&self) -> &Link {
        &self.link
    }

    /// The protocol core, to feed or to act on.
    pub(super) fn link_mut(&mut self) -> &mut Link {
        &mut self.link
    }

    /// The socket.
    pub(super) fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// This side made the connection (the active side).
    pub(super) fn is_client(&self) -> bool {
        self.link.is_client()
    }

    /// The peer's agent name (client side; the server's is what the peer's proofs named).
    pub(super) fn peer(&self) -> &Arc<str> {
        &self.peer
    }

    /// The peer's pid from here (0: another PID namespace; nothing can be pulled from it).
    pub(super) fn peer_pid(&self) -> libc::pid_t {
        self.peer_pid
    }

    /// The peer's process id as the connection's proofs name it (`sys::self_id`).
    pub(super) fn peer_id(&self) -> u64 {
        self.peer_id
    }

    /// The pidfd of the peer's process, when one was taken.
    pub(super) fn pidfd(&self) -> Option<Arc<OwnedFd>> {
        self.pidfd.clone()
    }

    /// The slot table, once the client's `Hello` carried it.
    pub(super) fn slots(&self) -> Option<&Arc<SlotTable>> {
        self.slots.as_ref()
    }

    /// The table's slot `slot` at `gen`, for a copy (the table is there once the `Hello` was).
    pub(super) fn slot_ref(&self, slot: u32, gen: u64) -> SlotRef {
        SlotRef {
            table: self.slots.clone().expect("ready"),
            idx: slot,
            gen,
        }
    }

    /// This side may pull from the peer's memory.
    pub(super) fn can_pull(&self) -> bool {
        self.can_pull
    }

    /// Sets what this side found it can reach of the peer (`can_pull`, `other_pid_ns`).
    pub(super) fn set_reach(&mut self, can_pull: bool, other_pid_ns: bool) {
        self.can_pull = can_pull;
        self.other_pid_ns = other_pid_ns;
    }

    /// The peer lives in another PID namespace than this process.
    #[cfg(feature = "cuda")]
    pub(super) fn other_pid_ns(&self) -> bool {
        self.other_pid_ns
    }

    /// Server side: read grants this connection holds, and device ranges of its reads queued
    /// for export.
    pub(super) fn load(&self) -> (usize, usize) {
        (self.granted, self.exporting)
    }

    /// Server side: this connection holds `grants` more read grants and `ranges` more device
    /// ranges queued for export.
    pub(super) fn charge(&mut self, grants: usize, ranges: usize) {
        self.granted += grants;
        self.exporting += ranges;
    }

    /// Server side: a read grant of this connection ended.
    pub(super) fn ungrant(&mut self) {
        self.granted = self.granted.saturating_sub(1);
    }

    /// Server side: `ranges` device ranges of this connection's reads are exported (or failed).
    pub(super) fn exported(&mut self, ranges: usize) {
        self.exporting = self.exporting.saturating_sub(ranges);
    }

    /// Client side: operation `id` waits for the handshake.
    pub(super) fn queue(&mut self, id: OpId) {
        self.queued.push(id);
    }

    /// Client side: operation `id` no longer waits for the handshake.
    pub(super) fn unqueue(&mut self, id: OpId) {
        self.queued.retain(|q| *q != id);
    }

    /// Client side: the operations that waited for the handshake, now theirs to go or decline.
    pub(super) fn take_queued(&mut self) -> Vec<OpId> {
        std::mem::take(&mut self.queued)
    }

    /// Client side: a free slot and its next generation, armed in the table; `None` when every
    /// slot is in use.
    pub(super) fn claim_slot(&mut self) -> Option<(u32, u64)> {
        let slot = self.free_slots.pop()?;
        self.gens[slot as usize] += 1;
        let gen = self.gens[slot as usize];
        if let Some(t) = &self.slots {
            t.arm(slot, gen);
        }
        Some((slot, gen))
    }

    /// Client side, once the server is proven: its descriptors are let in from now on where this
    /// side takes any (pipes from a server it cannot read, device exports).
    pub(super) fn accept_descriptors_if_taken(&self) {
        if !self.can_pull || self.link.takes_exports() {
            accept_passed_descriptors(self.fd.as_raw_fd());
        }
    }

    /// Takes the next `n` descriptors the peer passed (its core counted them for the frame just
    /// heard), each checked by `ok`. `None` (the connection killed for `why`, and what was taken
    /// closed off this thread) when one fails.
    fn take_checked(&mut self, n: usize, ok: fn(&OwnedFd) -> bool, why: Violation) -> Option<pipe::Ends> {
        let fds: Vec<OwnedFd> = self.passed.drain(..n.min(self.passed.len())).collect();
        if fds.len() == n && fds.iter().all(ok) {
            return Some(pipe::Ends::new(fds));
        }
        fds.into_iter().for_each(close_elsewhere);
        self.link.kill(why);
        None
    }

    /// [`Self::take_checked`] for `n` pipes' read ends.
    pub(super) fn take_pipes(&mut self, n: usize) -> Option<pipe::Ends> {
        self.take_checked(n, pipe::is_read_end, Violation::NotAPipe)
    }

    /// [`Self::take_checked`] for the `n` VMM descriptors passed with device `sources` (each an
    /// NVIDIA device's), their export ids then noted; none taken when `n` is 0. Called before
    /// anything else about the frame, so the next frame's are the next ones.
    pub(super) fn take_exports_named(&mut self, n: usize, sources: &[IpcSource]) -> Option<pipe::Ends> {
        if n == 0 {
            return Some(pipe::Ends::default());
        }
        let fds = self.take_checked(n, is_cuda_export, Violation::NotACudaExport)?;
        for s in sources.iter().filter(|s| s.fd > 0) {
            if !self.named.contains(&s.buffer_id) {
                // The oldest id goes to make room (see `MAX_NAMED`).
                self.named.drain(..self.named.len().saturating_sub(MAX_NAMED - 1));
                self.named.push_back(s.buffer_id);
            }
        }
        Some(fds)
    }

    /// Closes the next `n` descriptors the peer passed (off this thread).
    pub(super) fn drop_passed(&mut self, n: usize) {
        let k = n.min(self.passed.len());
        self.passed.drain(..k).for_each(close_elsewhere);
    }

    /// Of `ids` the peer says it gave back, those it had passed here (each answered once).
    pub(super) fn unname_exports(&mut self, ids: &[u64]) -> Vec<u64> {
        let named = &mut self.named;
        let mut unname = |id: &u64| named.iter().position(|n| n == id).and_then(|k| named.remove(k));
        ids.iter().copied().filter(|id| unname(id).is_some()).collect()
    }

    /// Queues `fds` to go with the next frame the core queues (at stream offset `at`,
    /// [`Link::queued_end`] before it was queued).
    pub(super) fn attach(&mut self, at: u64, fds: pipe::Ends) {
        self.attach.push_back((at, fds));
    }

    /// Frames are queued and no wait for writability is armed.
    pub(super) fn has_unwatched_frames(&self) -> bool {
        !self.link.out().is_empty() && !self.writing
    }

    /// Sends what the core has queued. `Some(want)` when whether the socket should be watched
    /// for writability changed (it is full, or no longer).
    pub(super) fn flush(&mut self) -> Option<bool> {
        while !self.link.out().is_empty() {
            // Descriptors go with the first byte of the frame that passes them: the bytes before
            // it are sent on their own, then that frame's with them.
            let base = self.link.sent_total();
            while self.attach.front().is_some_and(|(at, _)| *at < base) {
                self.attach.pop_front(); // its frame is gone (never the case on a live link)
            }
            let fd = self.fd.as_raw_fd();
            let out = self.link.out();
            let sent = match self.attach.front() {
                Some((at, fds)) if *at == base => {
                    let upto = self
                        .attach
                        .get(1)
                        .map_or(out.len(), |(next, _)| (next - base) as usize);
                    let raw: Vec<RawFd> = fds.raw();
                    let r = send_with_fds(fd, &out[..upto.min(out.len())], &raw);
                    if matches!(r, Ok(1..)) {
                        // Ours are closed (on the pipes' closer): the peer holds its own now.
                        self.attach.pop_front();
                    }
                    r
                }
                Some((at, _)) => send(fd, &out[..((at - base) as usize).min(out.len())]),
                None => send(fd, out),
            };
            if let Ok(n @ 1..) = sent {
                self.link.sent(n);
            } else {
                let e = sent.err().unwrap_or_else(|| io::ErrorKind::WriteZero.into());
                if e.kind() != io::ErrorKind::WouldBlock {
                    self.link.hang_up(Violation::SocketFailed);
                    self.link.sent(usize::MAX);
                }
                break;
            }
        }
        let want = !self.link.out().is_empty() && !self.link.is_dead();
        (want != self.writing).then(|| {
            self.writing = want;
            want
        })
    }

    /// Reads into the core at most [`READ_PER_TURN`] bytes (a full socket neither holds the engine
    /// nor grows `heard` unbounded); what the core proved (requests resolved through `key_ids`)
    /// goes to `heard`. Descriptors are kept only where the core takes them (the `Hello`'s sealed
    /// table of the right size); every other one is closed off this thread.
    pub(super) fn read(&mut self, key_ids: &HashMap<KeyId, Arc<str>>, heard: &mut Vec<Heard>) {
        let mut chunk = [0u8; 64 << 10];
        let mut control = Control::new();
        let mut budget = READ_PER_TURN;
        let fd = self.fd.as_raw_fd();
        while !self.link.is_dead() && budget > 0 {
            if closer::backlogged() && passes_rights(fd) {
                // Closes wait past their bound: a connection that can pass descriptors is not read
                // (that would take them in); closed, what it queued goes with its socket, untaken.
                self.link.kill(Violation::ClosesBacklogged);
                return;
            }
            let mut fds = Vec::new();
            let (n, truncated) = match recv_with_fds(fd, &mut chunk, &mut control, &mut fds) {
                Ok((0, _)) => {
                    self.link.hang_up(Violation::PeerClosed);
                    return;
                }
                Ok(r) => r,
                Err(e) => {
                    if e.kind() != io::ErrorKind::WouldBlock {
                        self.link.hang_up(Violation::PeerClosed);
                    }
                    return;
                }
            };
            budget = budget.saturating_sub(n);
            if truncated {
                // Descriptors were cut off (more than a message takes, or our table was full and
                // the kernel closed them): never what an honest peer sends.
                fds.into_iter().for_each(close_elsewhere);
                self.link.kill(Violation::ControlTruncated);
                return;
            }
            let passed = fds.len();
            if passed > 0 {
                if passed == 1 && self.link.takes_descriptors() {
                    // The slot table: checked (a sealed memfd, before any other kind of file is
                    // touched) before anything else; the client's `Trusted` says if more are taken.
                    let fd = fds.pop().expect("one");
                    if SlotTable::check(&fd).is_err() {
                        close_elsewhere(fd);
                        self.link.kill(Violation::NotATable);
                        return;
                    }
                    match SlotTable::open(fd) {
                        Ok(t) => self.slots = Some(Arc::new(t)),
                        Err(_) => {
                            self.link.kill(Violation::TableUnmappable);
                            return;
                        }
                    }
                } else {
                    // Pipes' read ends, held in order for their frame (the core checks and bounds them).
                    self.passed.extend(fds);
                }
            }
            self.link
                .recv(&chunk[..n], passed, Instant::now(), key_ids, heard);
        }
    }

    /// A slot table, as a client's `Hello` would have carried it (tests of the server's side).
    #[cfg(test)]
    pub(super) fn set_slots(&mut self, table: Arc<SlotTable>) {
        self.slots = Some(table);
    }

    /// How many descriptors the peer passed wait for their frame.
    #[cfg(test)]
    pub(super) fn passed(&self) -> usize {
        self.passed.len()
    }
}
