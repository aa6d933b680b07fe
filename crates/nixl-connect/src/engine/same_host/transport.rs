//! The same-host transport: the coordinator that hands what a connection's core heard, or the
//! engine asked, to the owner that acts on it (docs/ARCHITECTURE.md, "Owners"). Caps: `limits`.

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::client_book::ClientBook;
use super::conn::Conn;
use super::device::{device_path_refusal, uniform};
use super::feeds::{Feed, FeedFor, Feeds};
use super::identity::Identity;
use super::in_flight::InFlight;
use super::limits::{Caps, MAX_PIPES, MAX_PIPES_PER_CONN};
use super::link::{grant_ipc_len, Answer, Heard, Link, Request};
use super::policy::{self, Decision, Load};
use super::records::{refused, Act, AnyCopy, ConnId, CopyOwner, ExportDone, Phase, RequestId};
use super::server_book::{Claim, Scope, ServerBook};
use super::sockets::{Sockets, ACCEPT_TIMER, DEADLINE_TIMER, DIR_LISTENER, LISTENER};
use super::violation::Violation;
use super::wire::{passed_fds, IpcSource, RefuseCode, Req, EAGER_MAX, MAX_FRAME, NOT_LIVE};
use super::{auth, eager, identity};
use crate::decline_reason::DeclineReason;
use crate::device::Device;
use crate::engine::poller::{hung_up, Registrar, Waker};
use crate::engine::transport::{
    ActiveSpec, Decline, Event, Exposure, OpId, PassiveSpec, PeerInfo, Polling, Transport,
};
use crate::error::{Error, Result};
use crate::reg::Range;
use crate::state::{Mechanism, OpState, TransferPath};
use crate::stats::EngineStats;
use crate::sys::same_host::cma::{CopyError, Piece, Pull};
use crate::sys::same_host::dir::{connect_in, DirListener};
#[cfg(feature = "cuda")]
use crate::sys::same_host::ipc;
use crate::sys::same_host::{
    accept, alive, alive_fd, close_refused, closer, cma, connect, descriptor_budget, peer_cred, peer_process,
    pipe, raise_descriptor_limit, refuse_passed_descriptors, same_pid_namespace, self_id, socket_name,
    unix_socket, Tracked,
};

/// Requests open on a connection below which a small host operation carries its bytes in its
/// frames (see [`EAGER_MAX`]); at or above it, it takes a grant and the copy pool.
const EAGER_OPEN: usize = 4;

/// True when this process uses CUDA (its driver library is loaded): its device operations may
/// meet memory without a legacy IPC handle, which moves as VMM descriptors.
fn cuda_in_use() -> bool {
    #[cfg(feature = "cuda")]
    return crate::cuda::driver_loaded();
    #[cfg(not(feature = "cuda"))]
    false
}

/// Descriptors' ranges as the wire carries them.
fn wire_ranges(r: &[Range]) -> Vec<(u64, u64)> {
    r.iter().map(|r| (r.addr as u64, r.len as u64)).collect()
}

/// An active operation handed to the next transport.
fn declined(spec: ActiveSpec, reason: impl Into<Decline>) -> Event {
    Event::Declined {
        spec,
        reason: reason.into(),
    }
}

/// An active operation `a` failed for `reason` ([`Error::Transfer`]).
fn transfer_failed(a: &Act, reason: impl Into<String>) -> Error {
    Error::Transfer {
        agent: a.spec().peer.name.to_string(),
        reason: reason.into(),
        source: None,
    }
}

/// The passive operation keyed `key` completed on this path.
fn passive_completed(key: Arc<str>) -> Event {
    Event::PassiveCompleted {
        key,
        path: TransferPath::SameHost,
    }
}

/// The answer that carries a refusal or a fallback decided by the policy.
fn answer_of(d: Decision) -> Answer {
    match d {
        Decision::Refuse(code, reason) => Answer::Refuse(code, reason),
        Decision::Fallback(reason) => Answer::Fallback(reason),
        other => unreachable!("{other:?} is not an answer"),
    }
}

/// The same-host transport of one connector.
pub(crate) struct SameHostTransport {
    /// Whether active operations try this path.
    enabled: bool,
    /// The socket directory shared with peers in other network namespaces.
    socket_dir: Option<PathBuf>,
    /// The identity this connector's agent name advertises (none when it serves no socket).
    identity: Option<Arc<Identity>>,
    /// The listener, the connections and their timers.
    sockets: Sockets,
    /// What this connector serves (scopes, key ids, identities, exports queued).
    server: ServerBook,
    /// What this connector asks of others (active operations, connections by peer, peers avoided).
    client: ClientBook,
    /// Copies and exports in flight off the engine thread.
    in_flight: InFlight,
    /// Pipes this side feeds (reads it serves, writes it makes, to peers that cannot read it).
    feeds: Feeds,
    /// Peers refused (another user, over a cap, an impostor), for the engine's counters.
    refused_peers: u64,
    /// [`Self::stop_copies`] ran (the drop does not wait again).
    stopped: bool,
}

impl Drop for SameHostTransport {
    fn drop(&mut self) {
        if !self.stopped {
            self.stop_copies(None);
        }
    }
}

/// Why a read of host memory into device memory declines where this side may not read the
/// peer's memory: the device memory's owner pulls it, and pipes carry only host memory.
fn unreadable_device_read() -> Decline {
    Decline::of(
        DeclineReason::Memory,
        "the kernel does not let this process read the peer's memory (ptrace rules), and pipes \
         carry only host memory",
    )
}

/// Why nothing takes the same-host path of a connector that turned it off.
fn off() -> Decline {
    Decline::of(DeclineReason::Off, "the same-host path is off for this connector")
}

/// Why no connection is made (nor probed) by a process that cannot name itself.
fn no_self_id() -> Decline {
    "this process cannot name itself (no descriptor left for its pidfd)".into()
}

/// What reaching a peer's same-host socket learned ([`SameHostTransport::reach`]).
struct Reached {
    /// The connected socket.
    fd: Tracked,
    /// The peer's pid as this PID namespace sees it (0: another namespace).
    pid: libc::pid_t,
    /// The peer's process, named from any namespace, and its pidfd.
    server_id: u64,
    server: OwnedFd,
    /// Whether this side may read the peer's memory (cross-memory attach).
    can_pull: bool,
    /// Whether the peer is in another PID namespace.
    other_pid_ns: bool,
}

impl SameHostTransport {
    /// A transport serving on `listener` as `identity` (none: unreachable on this path) and on
    /// `dir_listener` in `socket_dir`, and, when `enabled`, trying it for active operations.
    pub(crate) fn new(
        enabled: bool,
        listener: Option<(Tracked, Arc<Identity>)>,
        dir_listener: Option<DirListener>,
        socket_dir: Option<PathBuf>,
        reg: Registrar,
        waker: Waker,
    ) -> Self {
        let (listener, identity) = listener.unzip();
        raise_descriptor_limit();
        let caps = Caps::for_budget(descriptor_budget());
        Self {
            enabled,
            socket_dir,
            identity,
            sockets: Sockets::new(listener, dir_listener, reg, caps),
            server: ServerBook::default(),
            client: ClientBook::default(),
            in_flight: InFlight::new(waker),
            feeds: Feeds::default(),
            refused_peers: 0,
            stopped: false,
        }
    }

    // ---- Dispatch: what a connection's core heard, to the owner that acts on it.

    /// Acts on what connection `i`'s core heard.
    pub(super) fn handle(&mut self, i: ConnId, h: Heard, out: &mut Vec<Event>) {
        let req = |slot, gen| RequestId { conn: i, slot, gen };
        match h {
            // `Hello`: the slot table was checked on receipt, the pull found at accept.
            Heard::Hello | Heard::Trusted { pipes: true } => {}
            Heard::Trusted { pipes: false } => {
                if let Some(c) = self.sockets.get(i) {
                    refuse_passed_descriptors(c.fd());
                }
            }
            Heard::Unused { fds } => {
                if let Some(c) = self.sockets.get_mut(i) {
                    c.drop_passed(fds);
                }
            }
            Heard::Forgot { ids } => self.on_forgot(i, ids),
            Heard::GrantPipe { slot, gen, lanes } => self.on_grant_pipe(i, slot, gen, lanes, out),
            Heard::Req(r) => {
                if self.server.knows(r.req.ident) {
                    self.on_req(i, r, out)
                } else if let Some(c) = self.sockets.get_mut(i) {
                    // Metadata of an agent of the same name elsewhere: NIXL will sort it out. The
                    // descriptors passed with it are closed, so the next frame's are the next ones.
                    c.drop_passed(r.passed);
                    let why = Answer::Fallback("the metadata names another agent of the same name".into());
                    c.link_mut().answer(r.req.slot, r.req.gen, why);
                }
            }
            Heard::ReadDone { slot, gen, ok, key } => self.on_read_done(req(slot, gen), ok, &key, out),
            Heard::Ready => self.on_ready(i, out),
            Heard::NotLive { key } => self.on_not_live(i, &key, out),
            Heard::Impostor => {
                let Some(c) = self.sockets.get(i) else { return };
                // Another process holds the socket name. It learnt a key hash and a nonce; nothing
                // else is sent, nothing it says is believed.
                let why = "the process on the peer's same-host socket could not prove it holds \
                           the operation's key (another process holds the socket name)";
                tracing::warn!(peer = %c.peer(), pid = c.peer_pid(), "{why}; using NIXL");
                self.refused_peers += 1;
                self.give_up_on(i, &Decline::of(DeclineReason::Handshake, why), out);
            }
            Heard::Rejected { reason } => {
                self.give_up_on(i, &Decline::of(DeclineReason::Refused, reason), out)
            }
            Heard::Grant { slot, gen, sources } => self.on_grant(i, slot, gen, sources),
            Heard::Data { slot, gen, data } => self.on_data(i, slot, gen, &data, out),
            Heard::Refused {
                slot,
                gen,
                code,
                reason,
            } => self.end_answered(req(slot, gen), out, |id, a| {
                Event::ended(id, Err(refused(a.spec().peer.name.to_string(), code, reason)))
            }),
            Heard::Fallback { slot, gen, reason } => self.end_answered(req(slot, gen), out, |_, a| {
                declined(a.into_spec(), Decline::of(DeclineReason::Refused, reason))
            }),
            Heard::WriteDone {
                slot,
                gen,
                ok,
                reason,
            } => self.end_answered(req(slot, gen), out, |id, a| {
                Event::ended(id, ok.then_some(()).ok_or_else(|| transfer_failed(&a, reason)))
            }),
        }
    }

    /// Client: the peer of connection `i` is not asked again for a while (it rejected us, or
    /// someone else holds its socket name), and what is queued on it declines, for `why`.
    fn give_up_on(&mut self, i: ConnId, why: &Decline, out: &mut Vec<Event>) {
        if let Some(c) = self.sockets.get(i) {
            self.client.avoid(c.peer().clone(), Instant::now(), why);
        }
        self.end_queued(i, out, |_, a| declined(a.into_spec(), why.clone()));
    }

    /// Client: the server has no live operation with the opening key. That operation is refused
    /// as a replay (it must not go on to NIXL and read stale memory); nothing was revealed; the
    /// others queued behind it take NIXL, and the connection is opened afresh next time.
    fn on_not_live(&mut self, i: ConnId, key: &str, out: &mut Vec<Event>) {
        let Some(peer) = self.sockets.get(i).map(|c| c.peer().to_string()) else {
            return;
        };
        self.end_queued(i, out, |id, a| {
            if &*a.spec().key == key {
                let replay = refused(peer.clone(), RefuseCode::NotLive, NOT_LIVE.into());
                Event::ended(id, Err(replay))
            } else {
                let why = "the same-host connection closed before its request";
                declined(a.into_spec(), Decline::of(DeclineReason::Handshake, why))
            }
        });
    }

    /// Client: ends every operation queued on connection `i`, freeing its slot, with `ev` of it
    /// (none for an abandoned one).
    fn end_queued(&mut self, i: ConnId, out: &mut Vec<Event>, mut ev: impl FnMut(OpId, Act) -> Event) {
        let Some(c) = self.sockets.get_mut(i) else { return };
        for id in c.take_queued() {
            let Some(a) = self.client.remove(id) else { continue };
            self.sockets.free_slot(i, a.slot(), a.gen());
            if !a.is_abandoned() {
                out.push(ev(id, a));
            }
        }
    }

    /// Ends the active operation that request `r` answered: frees its slot and, unless it was
    /// abandoned, reports `ev` of it (after its feed: an answer may come before the last byte).
    fn end_answered(&mut self, r: RequestId, out: &mut Vec<Event>, ev: impl FnOnce(OpId, Act) -> Event) {
        if let Some((id, a)) = self.client.take(r) {
            self.sockets.free_slot(r.conn, r.slot, r.gen);
            if !a.is_abandoned() {
                self.end_act_after_feed(id, ev(id, a), out);
            }
        }
    }

    /// Connection `i`'s socket is ready (`ev`): flushed, read and what its core heard handled;
    /// closed if its core died.
    fn on_conn_ready(&mut self, i: ConnId, ev: u32, out: &mut Vec<Event>) {
        if ev & libc::EPOLLOUT as u32 != 0 {
            self.sockets.flush(i);
        }
        if ev & libc::EPOLLIN as u32 != 0 || hung_up(ev) {
            let mut heard = Vec::new();
            self.sockets.read(i, self.server.key_ids(), &mut heard);
            for h in heard {
                self.handle(i, h, out);
            }
        }
        self.sockets.flush(i);
        match self.sockets.get(i) {
            Some(c) if c.link().is_dead() => {
                tracing::debug!(why = ?c.link().death(), "closing a same-host connection");
                self.close(i, out);
            }
            Some(_) => self.sockets.watch_deadline(i),
            None => {}
        }
    }

    // ---- Connections: accepting and making them, their deadlines, closing them.

    /// The deadline timer fired: every core past its deadline dies (and is closed), and the
    /// timer is armed for the next one.
    pub(super) fn on_deadlines(&mut self, out: &mut Vec<Event>) {
        self.sockets.deadline_fired();
        let now = Instant::now();
        for i in self.sockets.ids() {
            let c = self.sockets.get_mut(i).expect("listed");
            c.link_mut().on_timeout(now);
            if c.link().is_dead() {
                tracing::debug!(why = ?c.link().death(), "same-host connection timed out");
                self.close(i, out);
            } else {
                self.sockets.watch_deadline(i);
            }
        }
    }

    /// Accepts what waits on every listener (the abstract socket, the shared directory's).
    pub(super) fn accept(&mut self) {
        for lfd in self.sockets.listeners() {
            self.accept_from(lfd);
        }
    }

    fn accept_from(&mut self, lfd: std::os::fd::RawFd) {
        loop {
            if closer::backlogged() {
                // Whatever a new connection queued would join the closes waiting past their bound.
                let why = "too many descriptors wait to be closed (peers passed ones whose close blocks)";
                self.sockets.pause_accepting(&std::io::Error::other(why), true);
                return;
            }
            let fd = match accept(lfd) {
                Ok(fd) => fd,
                Err(e) => {
                    match e.raw_os_error() {
                        Some(libc::EINTR | libc::ECONNABORTED | libc::EPROTO) => continue,
                        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM) => {
                            self.sockets.pause_accepting(&e, false);
                        }
                        _ => {}
                    }
                    return;
                }
            };
            let pid = match peer_cred(fd.as_raw_fd()) {
                Ok((pid, uid)) if uid == self.sockets.uid() => pid,
                _ => {
                    // Another user: closed off this thread before anything is held for it (a
                    // client of another user checks our uid first and never sends a hello).
                    self.refused_peers += 1;
                    close_refused(fd);
                    continue;
                }
            };
            let (Some(identity), Some(me)) = (self.identity.clone(), self_id()) else {
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
            let mut link = Link::server(identity, peer_id, me, Instant::now());
            let peer = peer.filter(|_| refusal.is_none()).map(|p| p.1);
            // Never across PID namespaces, whatever the pidfd allows; a client this side cannot
            // read is asked, in the signed `Welcome`, to write through pipes.
            let can_pull = pid > 0 && peer.as_ref().is_some_and(cma::may_pull);
            if !can_pull {
                link.ask_piped_writes();
            }
            let other_pid_ns = !same_pid_namespace(pid);
            let conn = Conn::new(Tracked::new(fd), link, pid, peer_id, peer, "".into());
            let i = self.sockets.insert(conn);
            let c = self.sockets.get_mut(i).expect("just inserted");
            c.set_reach(can_pull, other_pid_ns);
            if let Some(reason) = refusal {
                self.refused_peers += 1;
                c.link_mut().reject(reason);
                self.sockets.flush(i);
                self.close(i, &mut Vec::new());
            }
        }
    }

    /// The back-off timer fired: watch the listener again and take what waits.
    pub(super) fn resume_accepting(&mut self) {
        if closer::backlogged() {
            self.sockets.rest_accepting();
            return;
        }
        self.sockets.resume_accepting();
        self.accept();
    }

    /// Opens (or finds) the connection to `peer`; `Err` says why there is no same-host path.
    pub(super) fn connect(&mut self, peer: &Arc<str>, key: &Arc<str>) -> Result<ConnId, Decline> {
        // A connection open to this exact name was made for its advertisement: nothing parsed again.
        if let Some(i) = self.client.conn_to(peer) {
            if self.sockets.get(i).is_some_and(|c| !c.link().is_dead()) {
                return Ok(i);
            }
        }
        let expect = self.endpoint(peer)?;
        let r = self.try_connect(peer, key, expect);
        if let Err(reason) = &r {
            // A full backlog is a moment's: the next operation asks again, not avoiding the peer.
            if !reason.busy() {
                self.client.avoid(peer.clone(), Instant::now(), reason);
            }
            tracing::trace!(peer = %peer, %reason, "no same-host path");
        }
        r
    }

    /// [`Self::connect`]'s new connection to `peer`, whose agent name advertises `expect`.
    pub(super) fn try_connect(
        &mut self,
        peer: &Arc<str>,
        key: &Arc<str>,
        expect: identity::Fingerprint,
    ) -> Result<ConnId, Decline> {
        let r = self.reach(peer, &expect)?;
        // VMM descriptors (a server in another PID namespace, memory without a legacy handle) are
        // refused (`dial`) until the server's `Welcome` is proven ([`Self::on_ready`]).
        let me = self_id().ok_or_else(no_self_id)?;
        let mut link = Link::client(
            key.clone(),
            expect,
            auth::nonce(),
            me,
            r.server_id,
            !r.can_pull,
            Instant::now(),
        );
        if r.other_pid_ns || cuda_in_use() {
            link.take_exports();
        }
        let conn = Conn::new(r.fd, link, r.pid, r.server_id, Some(r.server), peer.clone());
        let i = self.sockets.insert(conn);
        let c = self.sockets.get_mut(i).expect("just inserted");
        c.set_reach(r.can_pull, r.other_pid_ns);
        if let Err(e) = c.send_hello() {
            self.close(i, &mut Vec::new());
            let why = Decline::because("the same-host handshake failed", e);
            return Err(why.for_reason(DeclineReason::Handshake));
        }
        self.client.connected(peer.clone(), i);
        Ok(i)
    }

    /// The identity `peer`'s agent name advertises, as an operation's connection and a probe
    /// check it: `Err` when it advertises none, or was found without a path a moment ago.
    fn endpoint(&self, peer: &str) -> Result<identity::Fingerprint, Decline> {
        // Only a peer whose agent name advertises a same-host identity is ever connected to: a
        // Python Dynamo peer binds no socket, and whoever binds its name must learn nothing.
        let expect = identity::advertised(peer).ok_or_else(|| {
            Decline::expected(
                "the peer's agent name advertises no same-host endpoint (a Python Dynamo peer, or \
                 a connector that serves none)",
            )
        })?;
        match self.client.avoids(peer, Instant::now()) {
            Some((why, kind)) => Err(Decline::of(
                kind,
                format!("{why} (found a moment ago; asked again after a while)"),
            )),
            None => Ok(expect),
        }
    }

    /// [`begin`](Transport::begin)'s checks, in order: the path is on, the memory's kinds, the
    /// connection, then a slot (claimed last). `Ok`: the connection, the slot and its generation,
    /// and whether the source is device memory.
    fn admit(&mut self, spec: &ActiveSpec) -> Result<(ConnId, u32, u64, bool), Decline> {
        if !self.enabled {
            return Err(off());
        }
        let device = match (uniform(&spec.local), uniform(&spec.remote)) {
            (Some(Device::Host), Some(Device::Host)) => false,
            (Some(l), Some(r)) => {
                let (src, dst) = if spec.write { (l, r) } else { (r, l) };
                if let Some(refusal) = device_path_refusal(src, dst) {
                    return Err(refusal.into());
                }
                // Device memory as the source takes CUDA IPC; host memory into device memory
                // takes the host path's grant, pulled through pinned staging by the copier.
                src != Device::Host
            }
            _ => {
                return Err(Decline::of(
                    DeclineReason::Memory,
                    "the descriptors mix kinds of memory",
                ))
            }
        };
        let i = self.connect(&spec.peer.name, &spec.key)?;
        let busy = "too many operations in flight to this peer on the same-host path";
        let c = self.sockets.get_mut(i).expect("connected");
        let (slot, gen) = c
            .claim_slot()
            .ok_or_else(|| Decline::of(DeclineReason::Busy, busy))?;
        Ok((i, slot, gen, device))
    }

    /// Reaches `peer`'s same-host socket and learns who holds it ([`Self::try_connect`],
    /// [`Transport::probe`]): `Err` says why the same-host path cannot take the peer.
    fn reach(&self, peer: &Arc<str>, expect: &identity::Fingerprint) -> Result<Reached, Decline> {
        let fd = self.dial(peer, expect)?;
        let (pid, peer_uid) = peer_cred(fd.as_raw_fd())
            .map_err(|e| Decline::because("cannot learn who holds the peer's same-host socket", e))?;
        let uid = self.sockets.uid();
        if peer_uid != uid {
            return Err(Decline::of(
                DeclineReason::OtherUser,
                format!("the peer runs as uid {peer_uid} (this process: {uid})"),
            ));
        }
        // The process that made the listening socket (SO_PEERCRED) must still live: a child that
        // kept the socket without running its engine would leave the hello unanswered. A peer in
        // another PID namespace (pid 0 from here) is named by its pidfs id.
        let gone = || {
            Decline::of(
                DeclineReason::NoSocket,
                "the process that made the peer's same-host socket is gone (a child of it holds \
                 the socket)",
            )
        };
        let Some((server_id, server)) = peer_process(fd.as_raw_fd(), pid) else {
            return Err(if pid <= 0 {
                Decline::of(
                    DeclineReason::PidNamespace,
                    "the peer's process is in another PID namespace and this kernel cannot name it \
                     (no pidfs: Linux 6.9 or later)",
                )
            } else {
                gone()
            });
        };
        if !alive_fd(&server) {
            return Err(gone());
        }
        // A peer this side cannot read serves its reads, and takes its writes, through pipes.
        let can_pull = pid > 0 && cma::may_pull(&server);
        Ok(Reached {
            fd,
            pid,
            server_id,
            server,
            can_pull,
            other_pid_ns: !same_pid_namespace(pid),
        })
    }

    /// A socket connected to `peer`'s: its abstract socket (this network namespace), else its
    /// socket file in the shared directory (named from the identity it advertises, `expect`).
    fn dial(&self, peer: &Arc<str>, expect: &identity::Fingerprint) -> Result<Tracked, Decline> {
        let open = || {
            let fd = unix_socket().map_err(|e| Decline::because("cannot open a same-host socket", e))?;
            // Nothing passed is taken before the server's `Welcome` is proven (`on_ready`): until
            // then the kernel refuses any descriptor it tries to pass (where it can).
            refuse_passed_descriptors(fd.as_raw_fd());
            Ok::<_, Decline>(Tracked::new(fd))
        };
        let fd = open()?;
        let Err(abstract_err) = connect(fd.as_raw_fd(), &socket_name(peer)) else {
            return Ok(fd);
        };
        let Some(dir) = &self.socket_dir else {
            return Err(Decline::because(
                if abstract_err.raw_os_error() == Some(libc::EAGAIN) {
                    "the peer's same-host socket is busy (its backlog of connections is full)"
                } else {
                    "no same-host socket for this peer (it runs on another host, in another network \
                     namespace with no socket directory shared through NIXL_CONNECT_SOCKET_DIR, or \
                     has exited)"
                },
                abstract_err,
            )
            .for_reason(DeclineReason::NoSocket));
        };
        let fd = open()?;
        match connect_in(fd.as_raw_fd(), dir, &identity::stem(expect)) {
            Ok(()) => Ok(fd),
            Err(e) => Err(Decline::because(
                "no same-host socket for this peer, in this network namespace or the socket directory \
                 (it runs on another host, or has exited)",
                e,
            )
            .for_reason(DeclineReason::NoSocket)),
        }
    }

    /// Closes connection `i`, ending what depended on it.
    pub(super) fn close(&mut self, i: ConnId, out: &mut Vec<Event>) {
        let Some(c) = self.sockets.remove(i) else { return };
        // Device mappings opened for this connection are closed (after any copy using them).
        #[cfg(feature = "cuda")]
        ipc::forget(i);
        if c.is_client() {
            self.client.disconnected(c.peer(), i);
            if !c.link().shook_hands() && c.link().peer_went_away() {
                // Closed on us before the handshake: what answered will not serve us now. (A
                // proven "not live" is no reason to avoid it; impostors and rejections were.)
                let why = "the peer's same-host socket closed the connection before its handshake";
                let why = Decline::of(DeclineReason::Handshake, why);
                self.client.avoid(c.peer().clone(), Instant::now(), &why);
            }
            for id in self.client.on_conn(i) {
                let a = self.client.get(id).expect("listed");
                match a.phase() {
                    // The copy runs on; its end reports the result.
                    Phase::Copying => {}
                    Phase::Queued | Phase::Exporting | Phase::Requested | Phase::Abandoned => {
                        let a = self.client.remove(id).expect("listed");
                        if let Some(t) = c.slots() {
                            t.revoke(a.slot(), a.gen());
                        }
                        if a.is_abandoned() {
                            continue;
                        }
                        let ev = if !c.link().peer_went_away() || !c.link().shook_hands() {
                            // A protocol breach, or an end before the handshake (a silent refusal,
                            // a squatter, a dead peer): nothing was copied; NIXL may reach it.
                            let death = c.link().death().map_or("a protocol error", |v| v.reason());
                            let why = format!("the same-host connection was closed: {death}");
                            declined(a.into_spec(), Decline::of(DeclineReason::Handshake, why))
                        } else {
                            Event::ended(
                                id,
                                Err(Error::RemoteGone {
                                    agent: c.peer().to_string(),
                                    reason: "its connector closed the same-host connection (the \
                                             process exited or dropped the connector)"
                                        .into(),
                                    source: None,
                                }),
                            )
                        };
                        self.end_act_after_feed(id, ev, out);
                    }
                }
            }
        } else {
            // Reads served through pipes end; no reader's answer completes them.
            self.feeds
                .end_where(|w, f| matches!(w, FeedFor::Grant(_)) && f.conn() == i);
            // Revoke its read grants before forgetting them, so a peer still copying cannot
            // complete against memory the owner may since have given up.
            for s in self.server.scopes_mut() {
                s.retain_grants(|g| {
                    if g.conn == i {
                        if let Some(t) = c.slots() {
                            t.revoke(g.slot, g.gen);
                        }
                    }
                    g.conn != i
                });
            }
        }
    }

    // ---- The active side (client): requests, grants and answers, the operations' phases.

    /// Client: the server proved the opening key, signed by its advertised identity. Descriptors
    /// it passes (only in answers) are let in from now on, where taken; the queued requests go.
    pub(super) fn on_ready(&mut self, i: ConnId, out: &mut Vec<Event>) {
        let Some(c) = self.sockets.get_mut(i) else { return };
        c.accept_descriptors_if_taken();
        for id in c.take_queued() {
            self.request(id, out);
        }
    }

    /// Hands a queued operation to the next transport, freeing its slot.
    pub(super) fn decline_act(&mut self, id: OpId, reason: Decline, out: &mut Vec<Event>) {
        let a = self.drop_act(id);
        out.push(declined(a.into_spec(), reason));
    }

    /// Client: forgets operation `id` (present) and frees its slot.
    fn drop_act(&mut self, id: OpId) -> Act {
        let a = self.client.remove(id).expect("present");
        self.sockets.free_slot(a.conn(), a.slot(), a.gen());
        a
    }

    /// Sends the request of a queued operation (the handshake is done), or hands the operation to
    /// the next transport.
    pub(super) fn request(&mut self, id: OpId, out: &mut Vec<Event>) {
        if let Err(why) = self.try_request(id) {
            self.decline_act(id, why, out);
        }
    }

    /// [`Self::request`]'s request (`Err`: why none goes); a write from device memory exports
    /// its source first.
    fn try_request(&mut self, id: OpId) -> Result<(), Decline> {
        let Some(a) = self.client.get_mut(id) else {
            return Ok(());
        };
        #[cfg(feature = "cuda")]
        if a.spec().write && a.device() && !a.has_sources() {
            a.enter(Phase::Exporting);
            // Legacy handles do not open in another PID namespace.
            let how = match self.sockets.get(a.conn()) {
                Some(c) if c.link().passes_descriptors() => ipc::ExportAs::Descriptors {
                    other_namespace: c.other_pid_ns(),
                },
                _ => ipc::ExportAs::Handles,
            };
            let done = self.in_flight.export_done();
            let report = Box::new(move |result| done(ExportDone::Write { id, result }));
            let to = ipc::ExportTo::new(a.conn(), how, self.in_flight.teller());
            ipc::export(to, wire_ranges(&a.spec().local), report);
            return Ok(());
        }
        // A small host operation carries its bytes in a frame, while few requests are open on the
        // connection (many at once go faster as grants, batched on the pool), and always where
        // this side may not pull (a grant could not be served).
        let host = |r: &[Range]| r.iter().all(|r| r.device == Device::Host);
        let total = a
            .spec()
            .remote
            .iter()
            .fold(0usize, |t, r| t.saturating_add(r.len));
        let few = self
            .sockets
            .get(a.conn())
            .is_some_and(|c| !c.can_pull() || c.link().open_requests() < EAGER_OPEN);
        let small =
            few && (1..=EAGER_MAX).contains(&total) && host(&a.spec().local) && host(&a.spec().remote);
        let eager = small && !a.spec().write;
        let data = if small && a.spec().write {
            eager::read_act(a)
        } else {
            Vec::new()
        };
        let c = self.sockets.get_mut(a.conn()).expect("live");
        // Host memory of a peer this side cannot read (another PID namespace, ptrace rules)
        // moves through pipes: a read's fed by the server, a write's by this side.
        let piped = !small
            && host(&a.spec().local)
            && host(&a.spec().remote)
            && if a.spec().write {
                c.link().writes_piped()
            } else {
                !c.can_pull()
            };
        if !a.spec().write && !a.device() && !eager && !c.can_pull() && !piped {
            return Err(unreadable_device_read());
        }
        let lanes = if piped { pipe::lanes_for(total) } else { 0 };
        if piped
            && (self.feeds.lanes_of(a.conn()) + lanes > MAX_PIPES_PER_CONN
                || self.feeds.lanes() + lanes > MAX_PIPES)
        {
            let busy = "too many same-host pipes are open now";
            return Err(Decline::of(DeclineReason::Busy, busy));
        }
        let feeding = if piped && a.spec().write {
            let made = pipe::Lanes::new(lanes).and_then(|l| Ok((l, Arc::new(pipe::Wake::new()?))));
            Some(made.map_err(|e| Decline::because("cannot make pipes for a same-host write", e))?)
        } else {
            None
        };
        let a = self.client.get_mut(id).expect("present");
        let c = self.sockets.get_mut(a.conn()).expect("live");
        let (sources, source_fds) = a.take_sources();
        let req_sources_empty = sources.is_empty();
        // A device read by a side that takes VMM descriptors asks for them (`pipes: 1` on a
        // device read): the server then passes them where legacy handles cannot serve.
        let vmm_read = a.device() && !a.spec().write && c.link().takes_exports();
        let req = Req {
            slot: a.slot(),
            gen: a.gen(),
            write: a.spec().write,
            ident: a.spec().peer.identity,
            key_id: auth::key_id(&a.spec().key),
            device: a.spec().remote.first().map_or(Device::Host, |r| r.device),
            remote: wire_ranges(&a.spec().remote),
            local: if a.spec().write && data.is_empty() && !piped {
                wire_ranges(&a.spec().local)
            } else {
                Vec::new()
            },
            sources,
            eager,
            data,
            pipes: if vmm_read { 1 } else { lanes as u8 },
        };
        // A request the server could not accept, or whose answer could not come back in one frame
        // (too many ranges), takes NIXL rather than breaking the connection others use.
        let reply_too_long =
            a.device() && !a.spec().write && grant_ipc_len(a.spec().remote.len()) > MAX_FRAME;
        if req.frame_len() > MAX_FRAME || reply_too_long {
            return Err("too many ranges for one same-host request".into());
        }
        a.enter(Phase::Requested);
        // How the bytes move, as far as the request decides it (a read's grant says the rest).
        let mechanism = if small {
            Some(Mechanism::Frames)
        } else if piped {
            Some(Mechanism::Pipes)
        } else if a.spec().write && !source_fds.is_empty() {
            Some(Mechanism::CudaVmm)
        } else if a.spec().write && !req_sources_empty {
            Some(Mechanism::CudaIpc)
        } else if a.spec().write {
            Some(Mechanism::CrossMemoryAttach)
        } else {
            None
        };
        if let Some(m) = mechanism {
            a.spec().state.set_mechanism(m);
        }
        // Queued in the core; sent (a write's pipes with it) at the end of this turn's progress.
        let at = c.link().queued_end();
        if !c.link_mut().request(&a.spec().key, req) {
            return Err("the same-host connection cannot take the request".into());
        }
        let feed_key = c.feed_key();
        if !source_fds.is_empty() {
            c.attach(at, pipe::Ends::new(source_fds));
        }
        if let Some((mut lanes, wake)) = feeding {
            let (conn, pid) = (a.conn(), feed_key);
            let pieces = a.spec().local.iter().map(|r| (r.addr, r.len)).collect();
            c.attach(at, lanes.take_read_ends());
            let feeding = pipe::Feeding::new(pid, lanes, pieces, wake);
            self.start_feed(FeedFor::Write(id), conn, None, feeding);
        }
        Ok(())
    }

    /// Client: the read granted on (`i`, `slot`, `gen`) ends before its copy (abandoned, or `why`):
    /// the server is told, so its grant ends too, and its slot is free.
    fn end_grant(&mut self, i: ConnId, id: OpId, slot: u32, gen: u64, why: &str) {
        let a = self.client.remove(id).expect("present");
        if let Some(c) = self.sockets.get_mut(i) {
            c.link_mut().read_done(slot, gen, false, why);
        }
        self.sockets.free_slot(i, a.slot(), a.gen());
    }

    /// Client: a host read may copy from `lanes` pipes the server feeds, whose read ends came
    /// with the grant (taken here first, whatever became of the read).
    pub(super) fn on_grant_pipe(&mut self, i: ConnId, slot: u32, gen: u64, lanes: u8, out: &mut Vec<Event>) {
        let Some(fds) = self.sockets.get_mut(i).and_then(|c| c.take_pipes(lanes as usize)) else {
            return; // not pipes: the connection is killed; its operations end with it
        };
        // (`fds` dropped on a return below are closed on the pipes' closer.)
        let Some(id) = self.client.by_request(RequestId { conn: i, slot, gen }) else {
            return;
        };
        let a = self.client.get_mut(id).expect("found");
        if a.is_abandoned() {
            return self.end_grant(i, id, slot, gen, "cancelled");
        }
        let wake = match pipe::Wake::new() {
            Ok(w) => Arc::new(w),
            Err(e) => {
                self.end_grant(i, id, slot, gen, "no eventfd");
                let error = Error::os("an eventfd for a same-host read", e);
                return out.push(Event::ended(id, Err(error)));
            }
        };
        let c = self.sockets.get(i).expect("live");
        a.copying(Some(wake.clone()), c.pidfd());
        let slot = c.slot_ref(slot, gen);
        let pieces = a.spec().local.iter().map(|r| (r.addr, r.len)).collect();
        let fill = pipe::Fill::new(c.pool_key(), fds, pieces, slot, a.cancel().clone(), wake);
        self.in_flight.start(AnyCopy::Filled(fill), CopyOwner::Read(id));
    }

    /// Client: an eager read's bytes came (proven, exactly as many as requested): copied into
    /// the reader's memory here, and the read is over.
    pub(super) fn on_data(&mut self, i: ConnId, slot: u32, gen: u64, data: &[u8], out: &mut Vec<Event>) {
        let Some((id, a)) = self.client.take(RequestId { conn: i, slot, gen }) else {
            return;
        };
        self.sockets.free_slot(i, slot, gen);
        if a.is_abandoned() {
            return;
        }
        let fits = eager::write_act(&a, data).then_some(());
        let why = "the same-host answer does not fit the read's memory";
        out.push(Event::ended(id, fits.ok_or_else(|| transfer_failed(&a, why))));
    }

    /// Client: a grant for (`i`, `slot`, `gen`), checked against its request and copied from.
    pub(super) fn on_grant(&mut self, i: ConnId, slot: u32, gen: u64, sources: Option<Vec<IpcSource>>) {
        // VMM descriptors passed with the grant are taken first, whatever follows.
        let n = sources.as_deref().and_then(passed_fds).unwrap_or(0);
        let Some(c) = self.sockets.get_mut(i) else { return };
        let Some(fds) = c.take_exports_named(n, sources.as_deref().unwrap_or_default()) else {
            return;
        };
        let Some(id) = self.client.by_request(RequestId { conn: i, slot, gen }) else {
            return;
        };
        let a = self.client.get_mut(id).expect("found");
        // The grant must be of the kind asked for, and an IPC grant must match the ranges.
        let fits = match &sources {
            None => !a.device(),
            Some(v) => {
                a.device()
                    && v.len() == a.spec().local.len()
                    && v.iter().zip(&a.spec().local).all(|(s, l)| s.len == l.len as u64)
            }
        };
        if !fits && !a.is_abandoned() {
            tracing::debug!("a same-host grant that does not fit its request; closing the connection");
            if let Some(c) = self.sockets.get_mut(i) {
                c.link_mut().kill(Violation::GrantDoesNotFit);
            }
            return;
        }
        if a.is_abandoned() {
            return self.end_grant(i, id, slot, gen, "cancelled");
        }
        let c = self.sockets.get(i).expect("live");
        a.copying(None, c.pidfd());
        a.spec()
            .state
            .set_mechanism(match (&sources, a.spec().local.first().map(|r| r.device)) {
                (Some(_), _) if n > 0 => Mechanism::CudaVmm,
                (Some(_), _) => Mechanism::CudaIpc,
                (None, Some(Device::Cuda(_))) => Mechanism::PinnedStaging,
                (None, _) => Mechanism::CrossMemoryAttach,
            });
        #[cfg(feature = "cuda")]
        if let Some(sources) = sources {
            let slot = c.slot_ref(slot, gen);
            let pieces = a
                .spec()
                .local
                .iter()
                .zip(sources)
                .map(|(l, src)| ipc::Piece::new(l.addr as u64, src))
                .collect();
            let copy =
                ipc::DeviceCopy::new(i, c.peer_pid(), pieces, fds.into_vec(), slot, a.cancel().clone());
            let copy = AnyCopy::Device(copy);
            self.in_flight.start(copy, CopyOwner::Read(id));
            return;
        }
        let _ = (sources, fds);
        let pieces = a
            .spec()
            .local
            .iter()
            .zip(&a.spec().remote)
            .map(|(l, r)| Piece {
                local: l.addr,
                remote: r.addr,
                len: l.len,
            })
            .collect();
        let slot = c.slot_ref(slot, gen);
        let copy = Pull::new(c.peer_pid(), pieces, slot, a.cancel().clone());
        let copy = AnyCopy::pulled_into(copy, a.spec().local.first().map(|r| r.device));
        self.in_flight.start(copy, CopyOwner::Read(id));
    }

    // ---- The passive side (server): acting on the policy's decisions.

    /// Server side: a proven request, decided by the policy (`policy.rs`) and acted on here:
    /// answered, granted, or handed to a copy.
    pub(super) fn on_req(&mut self, i: ConnId, r: Request, out: &mut Vec<Event>) {
        let (req, key, descriptors) = (r.req, r.key, r.passed);
        let (slot, gen, write, pipes) = (req.slot, req.gen, req.write, req.pipes);
        // A write's pipes are taken first, whatever is decided, so the next frame's are the next
        // ones; dropped anywhere below, they close on the pipes' closer, never here.
        let lanes = if write { usize::from(pipes) } else { 0 };
        let Some(c) = self.sockets.get_mut(i) else { return };
        let Some(mut passed) = c.take_pipes(lanes) else {
            return;
        };
        // A device write's VMM descriptors likewise (the link checked their count).
        let Some(mut vmm_fds) = c.take_exports_named(descriptors - lanes, &req.sources) else {
            return;
        };
        // Died after the request was heard: nothing is granted, copied or completed for it.
        let Some(c) = self.sockets.get(i).filter(|c| c.link().is_ready()) else {
            return;
        };
        let (granted, exporting) = c.load();
        let load = Load {
            granted,
            exporting,
            exporting_all: self.server.exporting(),
            can_pull: c.can_pull(),
            pipes: self.feeds.lanes_of(i),
            pipes_all: self.feeds.lanes(),
        };
        let refusal = |s: Device, d: Device| device_path_refusal(s, d).map(|r| r.to_string());
        let decision = policy::decide(self.server.scope(&key), &req, &load, &refusal);
        let (remote, local, sources, data) = (req.remote, req.local, req.sources, req.data);
        let id = RequestId { conn: i, slot, gen };
        let mut completed = None;
        let answer = match decision {
            Decision::Refuse(..) | Decision::Fallback(_) => Some(answer_of(decision)),
            // This side copies its own memory here, held in use so its owner's drop waits.
            Decision::EagerRead | Decision::EagerWrite => {
                let s = self.server.scope_mut(&key).expect("decided on it");
                let answer = if decision == Decision::EagerRead {
                    eager::read_scope(s, &remote).map(Answer::Data)
                } else {
                    eager::write_scope(s, &remote, &data).then(|| Answer::WriteDone {
                        ok: true,
                        reason: String::new(),
                    })
                };
                if answer.is_some() {
                    s.set_done(true);
                    completed = self.server.key(&key);
                    answer
                } else {
                    Some(answer_of(policy::ended()))
                }
            }
            Decision::Grant => {
                let s = self.server.scope_mut(&key).expect("decided on it");
                if s.grant(id) {
                    if let Some(c) = self.sockets.get_mut(i) {
                        c.charge(1, 0);
                    }
                }
                Some(Answer::Grant)
            }
            // `Err`: answered now; `Ok`: once the export, the feed or the copy says.
            Decision::DeviceRead => self.device_read(id, &key, remote, pipes > 0).err(),
            Decision::DeviceWrite => {
                let fds = std::mem::take(&mut vmm_fds);
                self.device_write(id, &key, remote, sources, fds).err()
            }
            Decision::PullWrite => self.pull_write(id, &key, &remote, &local).err(),
            Decision::PipeRead => self.pipe_read(id, &key, &remote, pipes as usize).err(),
            Decision::PipeWrite => {
                let fds = std::mem::take(&mut passed);
                self.pipe_write(id, &key, &remote, fds).err()
            }
        };
        drop((passed, vmm_fds));
        let sent = answer.is_some_and(|a| self.answer(id, a));
        // An eager operation is complete once its answer is on its way; if the connection died
        // in queueing it, the operation stays live for a retry.
        if let Some(key) = completed {
            if sent {
                out.push(passive_completed(key));
            } else if let Some(s) = self.server.scope_mut(&key) {
                s.set_done(false);
            }
        }
    }

    /// Queues `a` to request `id`'s client; false when it cannot go (the connection is gone or dead).
    fn answer(&mut self, id: RequestId, a: Answer) -> bool {
        self.sockets
            .get_mut(id.conn)
            .is_some_and(|c| c.link_mut().answer(id.slot, id.gen, a))
    }

    /// A host write the policy let through: claims the writable ([`Self::claim_writable`]) and
    /// pulls the writer's bytes into it on the copy pool.
    fn pull_write(
        &mut self,
        id: RequestId,
        key: &str,
        remote: &[(u64, u64)],
        local: &[(u64, u64)],
    ) -> Result<(), Answer> {
        let w = self.claim_writable(id, key)?;
        let pieces = remote
            .iter()
            .zip(local)
            .map(|(&(dst, len), &(src, _))| Piece {
                local: dst as usize,
                remote: src as usize,
                len: len as usize,
            })
            .collect();
        let (copy, owner) = w.pull(pieces);
        self.in_flight.start(copy, owner);
        Ok(())
    }

    /// A host read for a peer that cannot read this side's memory: answers with `lanes` pipes'
    /// read ends and feeds them the readable's `remote` ranges; the read completes at the
    /// reader's `Done`, once the feed stopped ([`Self::fed`]).
    fn pipe_read(
        &mut self,
        id: RequestId,
        key: &str,
        remote: &[(u64, u64)],
        lanes: usize,
    ) -> Result<(), Answer> {
        if self.feeds.has(FeedFor::Grant(id)) {
            // A request id reused while its feed runs: never an honest client's (generations).
            return Err(Answer::Fallback("this request's id is still in use".into()));
        }
        let (mut lanes, wake) = pipe::Lanes::new(lanes)
            .and_then(|l| Ok((l, Arc::new(pipe::Wake::new()?))))
            .map_err(|e| Answer::Fallback(format!("the passive side cannot make pipes: {e}")))?;
        let ends = lanes.take_read_ends();
        let key = self.server.key(key).expect("decided on it");
        let s = self.server.scope_mut(&key).expect("decided on it");
        let state = s.state().clone();
        s.grant(id);
        let c = self.sockets.get_mut(id.conn).expect("decided on it");
        c.charge(1, 0);
        let pid = c.feed_key();
        let at = c.link().queued_end();
        let grant = Answer::GrantPipe(lanes.len() as u8);
        if !c.link_mut().answer(id.slot, id.gen, grant) {
            self.server.scope_mut(&key).expect("decided on it").ungrant(id);
            self.sockets.ungrant(id.conn);
            return Ok(());
        }
        if let Some(c) = self.sockets.get_mut(id.conn) {
            c.attach(at, ends);
        }
        let pieces = remote.iter().map(|&(a, l)| (a as usize, l as usize)).collect();
        let feeding = pipe::Feeding::new(pid, lanes, pieces, wake);
        self.start_feed(FeedFor::Grant(id), id.conn, Some((key, state)), feeding);
        Ok(())
    }

    /// A host write the policy let through from a peer this side cannot read: reads the pipes it
    /// passed (`fds`, checked) into the writable's `remote` ranges, in order, on the copy pool.
    fn pipe_write(
        &mut self,
        id: RequestId,
        key: &str,
        remote: &[(u64, u64)],
        fds: pipe::Ends,
    ) -> Result<(), Answer> {
        // (`fds` dropped on a return below are closed on the pipes' closer.)
        let wake = pipe::Wake::new()
            .map_err(|e| Answer::Fallback(format!("the passive side has no eventfd: {e}")))?;
        let wake = Arc::new(wake);
        let w = self.claim_writable(id, key)?;
        if let Some(s) = self.server.scope_mut(key) {
            s.wake_writer_with(wake.clone());
        }
        let pid = self.sockets.get(id.conn).map_or(w.pid(), |c| c.pool_key());
        let pieces = remote.iter().map(|&(a, l)| (a as usize, l as usize)).collect();
        let (copy, owner) = w.fill(pid, fds, pieces, wake);
        self.in_flight.start(copy, owner);
        Ok(())
    }

    /// Claims the writable keyed `key` for the write `id`: marks it in use (or answers "not
    /// live" if its owner just ended it) and makes `id` its writer.
    pub(super) fn claim_writable(&mut self, id: RequestId, key: &str) -> Result<Claim, Answer> {
        let c = self.sockets.get(id.conn).expect("decided on it");
        let (pid, pidfd, table) = (c.peer_pid(), c.pidfd(), c.slots().cloned().expect("ready"));
        let key = self.server.key(key).expect("decided on it");
        let s = self.server.scope_mut(&key).expect("decided on it");
        s.claim(id, key.clone(), pid, table, pidfd)
            .ok_or_else(|| answer_of(policy::ended()))
    }

    /// Server side: the reader finished copying a granted read of the operation keyed `key`.
    pub(super) fn on_read_done(&mut self, id: RequestId, ok: bool, key: &str, out: &mut Vec<Event>) {
        let Some(key) = self.server.key(key) else { return };
        let s = self.server.scope_mut(&key).expect("found");
        if !s.ungrant(id) {
            return;
        }
        if ok {
            // Completed: a request heard later in this turn finds it done.
            s.set_done(true);
        }
        self.sockets.ungrant(id.conn);
        match self.feeds.end(FeedFor::Grant(id)) {
            // Complete once its pipes are empty ([`Self::fed`]).
            Some(f) => f.answered(ok),
            None if ok => out.push(passive_completed(key)),
            None => {}
        }
    }

    // ---- Device memory (feature `cuda`): CUDA IPC exports.

    /// A device read the policy let through: granted once its source is exported (the answer
    /// comes then), as VMM descriptors where the reader asked for them (`vmm`).
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    fn device_read(
        &mut self,
        id: RequestId,
        key: &str,
        remote: Vec<(u64, u64)>,
        vmm: bool,
    ) -> Result<(), Answer> {
        #[cfg(not(feature = "cuda"))]
        return Err(Answer::Fallback(
            crate::error::PathRefusal::NoCudaSupport.to_string(),
        ));
        #[cfg(feature = "cuda")]
        {
            let key = self.server.key(key).expect("decided on it");
            let done = self.in_flight.export_done();
            let s = self.server.scope_mut(&key).expect("decided on it");
            let fresh = s.grant(id);
            let ranges = remote.len();
            self.server.exports_queued(ranges);
            if let Some(c) = self.sockets.get_mut(id.conn) {
                c.charge(usize::from(fresh), ranges);
            }
            let how = match self.sockets.get(id.conn) {
                Some(c) if vmm => ipc::ExportAs::Descriptors {
                    other_namespace: c.other_pid_ns(),
                },
                _ => ipc::ExportAs::Handles,
            };
            let to = ipc::ExportTo::new(id.conn, how, self.in_flight.teller());
            let report = move |result| {
                done(ExportDone::Grant {
                    key,
                    id,
                    ranges,
                    result,
                })
            };
            ipc::export(to, remote, Box::new(report));
            Ok(())
        }
    }

    /// A device write the policy let through: copied here from the writer's exported `sources`
    /// (one per range of `remote`; their VMM descriptors `fds`, passed with the request).
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    fn device_write(
        &mut self,
        id: RequestId,
        key: &str,
        remote: Vec<(u64, u64)>,
        sources: Vec<IpcSource>,
        fds: pipe::Ends,
    ) -> Result<(), Answer> {
        #[cfg(not(feature = "cuda"))]
        return Err(Answer::Fallback(
            crate::error::PathRefusal::NoCudaSupport.to_string(),
        ));
        #[cfg(feature = "cuda")]
        {
            let w = self.claim_writable(id, key)?;
            let pieces = remote
                .iter()
                .zip(sources)
                .map(|(&(dst, _), src)| ipc::Piece::new(dst, src))
                .collect();
            let (copy, owner) = w.import(id.conn, pieces, fds.into_vec());
            self.in_flight.start(copy, owner);
            Ok(())
        }
    }

    /// The peer gave back VMM exports it had passed on connection `i`: this side's mappings of
    /// them go. Only ids it passed here count, each once: a flood of `Forgot` frames makes no
    /// work on the CUDA thread beyond what the exports themselves did.
    pub(super) fn on_forgot(&mut self, i: ConnId, ids: Vec<u64>) {
        let Some(c) = self.sockets.get_mut(i) else { return };
        let ids = c.unname_exports(&ids);
        #[cfg(feature = "cuda")]
        if !ids.is_empty() {
            ipc::forget_imports(i, ids);
        }
        #[cfg(not(feature = "cuda"))]
        let _ = ids;
    }

    /// Handles finished CUDA IPC exports.
    pub(super) fn reap_exports(&mut self, out: &mut Vec<Event>) -> bool {
        let done = self.in_flight.take_exports();
        let any = !done.is_empty();
        for d in done {
            match d {
                ExportDone::Grant {
                    key,
                    id,
                    ranges,
                    result,
                } => {
                    self.server.exports_ended(ranges);
                    if let Some(c) = self.sockets.get_mut(id.conn) {
                        c.exported(ranges);
                    }
                    // Not for a scope another reader completed this turn (its grants go when
                    // the engine applies the completion and unexposes it).
                    let granted = self.server.scope(&key).is_some_and(|s| s.holds_grant(id));
                    let mut fds = Vec::new();
                    let answer = match result {
                        _ if !granted => Answer::Refuse(
                            RefuseCode::NotLive,
                            "the operation ended before its memory could be shared".into(),
                        ),
                        Ok((sources, f)) => {
                            fds = f;
                            Answer::GrantIpc(sources)
                        }
                        Err(reason) => {
                            if self.server.scope_mut(&key).is_some_and(|s| s.ungrant(id)) {
                                self.sockets.ungrant(id.conn);
                            }
                            Answer::Fallback(format!(
                                "the device memory cannot be shared through CUDA IPC: {reason}"
                            ))
                        }
                    };
                    if let Some(c) = self.sockets.get_mut(id.conn) {
                        // The descriptors go with the grant's first byte.
                        let at = c.link().queued_end();
                        if c.link_mut().answer(id.slot, id.gen, answer) && !fds.is_empty() {
                            c.attach(at, pipe::Ends::new(fds));
                        }
                    }
                }
                ExportDone::Forgotten { conn, ids } => {
                    if let Some(c) = self.sockets.get_mut(conn) {
                        c.link_mut().forgot(&ids);
                    }
                }
                ExportDone::Write { id, result } => {
                    let Some(a) = self.client.get_mut(id) else {
                        continue;
                    };
                    match (a.phase(), result) {
                        (Phase::Exporting, Ok((sources, fds))) => {
                            a.exported(sources, fds);
                            self.request(id, out);
                        }
                        (Phase::Exporting, Err(reason)) => {
                            let why = "the device memory cannot be shared through CUDA IPC";
                            self.decline_act(id, Decline::shared(why, reason), out);
                        }
                        // Abandoned while exporting: it was answered then; forget it now.
                        _ if a.is_abandoned() => drop(self.drop_act(id)),
                        _ => {}
                    }
                }
            }
        }
        any
    }

    // ---- Copies and feeds: starting them, learning they ended, waiting before memory goes.

    /// Stops every copy and waits (up to `within`; `None`: unbounded) for those running on the
    /// pool. False when some still run: the memory they write must then never be freed (leaked).
    pub(crate) fn stop_copies(&mut self, within: Option<Duration>) -> bool {
        self.stopped = true;
        for (_, a) in self.client.acts() {
            a.stop();
        }
        self.feeds.end_where(|_, _| true);
        for s in self.server.scopes() {
            s.cancel_writer();
        }
        self.in_flight.wait(within)
    }

    /// Records and starts the feed `which` over connection `conn` (its lanes' read ends go, or
    /// went, there): `f` on the copy pool. A served read names its operation (`grant`).
    pub(super) fn start_feed(
        &mut self,
        which: FeedFor,
        conn: ConnId,
        grant: Option<(Arc<str>, Arc<OpState>)>,
        f: pipe::Feeding,
    ) {
        let feed = Feed::new(conn, f.lanes(), f.ended().clone(), f.wake().clone(), grant);
        self.feeds.start(which, feed);
        self.in_flight.feed(f, CopyOwner::Fed(which));
    }

    /// Client: `ev` ends the active operation `id`, now or, if its write's pipes are still fed,
    /// once the feed stopped reading its memory ([`Self::fed`]). The first event held wins.
    pub(super) fn end_act_after_feed(&mut self, id: OpId, ev: Event, out: &mut Vec<Event>) {
        match self.feeds.end(FeedFor::Write(id)) {
            Some(f) => f.hold(ev),
            None => out.push(ev),
        }
    }

    /// Pipes this side fed are done (their job reads the memory no more): what waited for them
    /// goes on (a served read's completion, a write's end, an ended operation's release).
    fn fed(&mut self, which: FeedFor, r: Result<(), CopyError>, out: &mut Vec<Event>) {
        let Some(f) = self.feeds.finished(which) else {
            return;
        };
        let (grant, completed, held) = f.into_outcome();
        if let Err(e) = &r {
            tracing::debug!(?which, error = ?e, "feeding same-host pipes failed");
        }
        match which {
            FeedFor::Grant(_) => {
                let Some((key, state)) = grant else { return };
                if completed {
                    out.push(passive_completed(key.clone()));
                }
                if self.server.scope(&key).is_none() && !self.feeds.feeds_key(&key) {
                    // Unexposed while its pipes were fed (`unexpose` held the release back).
                    state.mark_released();
                }
            }
            FeedFor::Write(_) => {
                // Nothing held: the feed ended before the operation did (all fed, or it failed);
                // the server's answer (or the connection's end) reports the write.
                out.extend(held);
            }
        }
    }

    /// Handles finished copies and exports.
    pub(super) fn reap(&mut self, out: &mut Vec<Event>) -> bool {
        let exported = self.reap_exports(out);
        let done = self.in_flight.take_finished();
        let any = exported || !done.is_empty();
        for (owner, r) in done {
            match owner {
                CopyOwner::Fed(which) => self.fed(which, r, out),
                CopyOwner::Read(id) => {
                    let Some(a) = self.client.remove(id) else { continue };
                    let i = a.conn();
                    let live = self.sockets.get(i).is_some_and(|c| !c.link().is_dead());
                    if let Err(CopyError::Unsupported(reason)) = &r {
                        // Nothing moved: end the grant and let NIXL take the read.
                        if live {
                            let c = self.sockets.get_mut(i).expect("live");
                            c.link_mut()
                                .read_done(a.slot(), a.gen(), false, &reason.to_string());
                        }
                        self.sockets.free_slot(i, a.slot(), a.gen());
                        if a.cancel().load(Ordering::Relaxed) {
                            out.push(Event::ended(id, Err(Error::Cancelled)));
                        } else {
                            out.push(declined(
                                a.into_spec(),
                                Decline::shared("the same-host device copy cannot run here", reason.clone()),
                            ));
                        }
                        continue;
                    }
                    let same = alive(a.pidfd());
                    let result = match r {
                        Ok(()) if same => Ok(()),
                        Ok(()) | Err(CopyError::PeerGone) => Err(Error::RemoteGone {
                            agent: a.spec().peer.name.to_string(),
                            reason: "its process exited during the copy".into(),
                            source: None,
                        }),
                        Err(CopyError::Revoked | CopyError::NotStarted) => {
                            Err(if a.cancel().load(Ordering::Relaxed) {
                                Error::Cancelled
                            } else {
                                refused(
                                    a.spec().peer.name.to_string(),
                                    RefuseCode::NotLive,
                                    "the owner ended the operation during the copy".into(),
                                )
                            })
                        }
                        Err(CopyError::Os(e)) => Err(Error::Transfer {
                            agent: a.spec().peer.name.to_string(),
                            reason: "the same-host copy failed".into(),
                            source: Some(e),
                        }),
                        Err(CopyError::Unsupported(_)) => unreachable!("handled above"),
                    };
                    if live {
                        let c = self.sockets.get_mut(i).expect("live");
                        c.link_mut().read_done(a.slot(), a.gen(), result.is_ok(), "");
                    }
                    self.sockets.free_slot(i, a.slot(), a.gen());
                    out.push(Event::ended(id, result));
                }
                CopyOwner::Write {
                    key,
                    id,
                    state,
                    pidfd,
                } => {
                    let same = alive(&pidfd);
                    let ok = r.is_ok() && same;
                    // The copy into this side's memory has ended either way.
                    state.mark_released();
                    let scope = self
                        .server
                        .scope_mut(&key)
                        .and_then(|s| s.end_writer(id).then_some(s));
                    if let Err(CopyError::Unsupported(reason)) = &r {
                        // Nothing moved: the writer may take NIXL.
                        let why = format!("the passive side cannot copy from device memory: {reason}");
                        self.answer(id, Answer::Fallback(why));
                        continue;
                    }
                    if let Some(s) = scope {
                        // Completed or torn, the writable has ended: a request heard later this
                        // turn, before the engine applies the event, finds it done.
                        if !matches!(r, Err(CopyError::NotStarted)) {
                            s.set_done(true);
                        }
                        match &r {
                            Ok(()) if same => out.push(passive_completed(key.clone())),
                            // The writer cancelled before the copy began: nothing was touched.
                            Err(CopyError::NotStarted) => {}
                            _ => out.push(Event::PassiveFailed {
                                key: key.clone(),
                                error: Error::RemoteGone {
                                    agent: "(same-host writer)".into(),
                                    reason: "the writer went away in the middle of writing; the writable's \
                                             memory is torn"
                                        .into(),
                                    source: None,
                                },
                            }),
                        }
                    }
                    let reason = match &r {
                        Ok(()) => String::new(),
                        Err(e) => format!("the passive side's copy failed: {e:?}"),
                    };
                    self.answer(id, Answer::WriteDone { ok, reason });
                }
            }
        }
        any
    }
}

// ---- The engine's seam.

impl Transport for SameHostTransport {
    fn expose(&mut self, spec: &PassiveSpec, out: &mut Exposure) -> Result<()> {
        if self.sockets.listener().is_none() {
            return Ok(());
        }
        let scope = Scope::new(spec.kind, spec.ranges.clone(), spec.state.clone());
        self.server.expose(spec.key.clone(), out.identity, scope);
        Ok(())
    }

    fn unexpose(&mut self, key: &str) {
        if let Some(s) = self.server.scope(key) {
            s.cancel_writer();
        }
        let Some(s) = self.server.unexpose(key) else {
            return;
        };
        let released = !s.has_writer() && !self.feeds.feeds_key(key);
        let state = s.state().clone();
        for g in s.into_grants() {
            if let Some(t) = self.sockets.get(g.conn).and_then(|c| c.slots()) {
                t.revoke(g.slot, g.gen);
            }
            self.sockets.ungrant(g.conn);
        }
        // Pipes fed from it hold its pages until they are emptied: released then (`fed`).
        self.feeds.end_where(|_, f| f.feeds_key(key));
        if released {
            state.mark_released();
        }
    }

    /// The checks [`begin`](Self::begin), the connection and the request make, in order, hung up
    /// before the handshake; the mechanism is the one a quiet connection would use (none for a
    /// device source: its export decides). The peer's access to this side is taken to mirror
    /// this side's to the peer's, as between pods, not a parent and child under Yama's rules.
    fn probe(
        &mut self,
        peer: &PeerInfo,
        write: bool,
        local: Device,
        remote: Device,
        bytes: u64,
    ) -> Result<Option<Mechanism>, Decline> {
        if !self.enabled {
            return Err(off());
        }
        let (src, dst) = if write { (local, remote) } else { (remote, local) };
        if (src, dst) != (Device::Host, Device::Host) {
            if let Some(refusal) = device_path_refusal(src, dst) {
                return Err(refusal.into());
            }
        }
        let expect = self.endpoint(&peer.name)?;
        let reached = self.reach(&peer.name, &expect)?;
        self_id().ok_or_else(no_self_id)?;
        let pulls_both_ways = reached.can_pull && !reached.other_pid_ns;
        Ok(match (src, dst) {
            (Device::Host, Device::Host) if (1..=EAGER_MAX as u64).contains(&bytes) => {
                Some(Mechanism::Frames)
            }
            (Device::Host, Device::Host) if pulls_both_ways || (!write && reached.can_pull) => {
                Some(Mechanism::CrossMemoryAttach)
            }
            (Device::Host, Device::Host) => Some(Mechanism::Pipes),
            // Host memory into device memory is pulled by the device memory's owner (through
            // pinned staging): no pipes carry it ([`Self::request`]).
            (Device::Host, _) if !write && !reached.can_pull => return Err(unreadable_device_read()),
            (Device::Host, _) if !write => Some(Mechanism::PinnedStaging),
            (Device::Host, _) if !pulls_both_ways => {
                return Err(Decline::of(
                    DeclineReason::Memory,
                    "the peer pulls host memory into its device memory, and cannot read this \
                     process's (another PID namespace, ptrace rules); pipes carry only host memory",
                ))
            }
            // The writer reports the grant it took; the peer pulls through pinned staging.
            (Device::Host, _) => Some(Mechanism::CrossMemoryAttach),
            // Device memory as the source: a legacy CUDA IPC handle or a VMM allocation's
            // descriptor, as the memory's kind decides at its export.
            _ => None,
        })
    }

    fn begin(&mut self, spec: ActiveSpec, out: &mut Vec<Event>) {
        let (i, slot, gen, device) = match self.admit(&spec) {
            Ok(admitted) => admitted,
            Err(reason) => return out.push(declined(spec, reason)),
        };
        out.push(Event::taken(spec.id, TransferPath::SameHost));
        let id = spec.id;
        let c = self.sockets.get_mut(i).expect("connected");
        let ready = c.link().is_ready();
        if !ready {
            c.queue(id);
        }
        self.client.insert(id, Act::new(spec, i, slot, gen, device));
        if ready {
            self.request(id, out);
        } else {
            self.sockets.flush(i);
        }
    }

    fn abandon(&mut self, id: OpId, _hard: bool, out: &mut Vec<Event>) {
        let Some(a) = self.client.get_mut(id) else { return };
        let table = self.sockets.get(a.conn()).and_then(|c| c.slots().cloned());
        match a.phase() {
            Phase::Copying => {
                // Our own copy thread writes our memory: stop it; its end releases the memory.
                a.stop();
            }
            Phase::Abandoned => {}
            Phase::Queued | Phase::Exporting | Phase::Requested => {
                // Nothing of ours is written, and a revoked slot makes the peer discard what it
                // read: release at once (an eager one may still complete at its owner, as NIXL's may).
                if let Some(t) = table {
                    t.revoke(a.slot(), a.gen());
                }
                let was_queued = matches!(a.phase(), Phase::Queued);
                a.enter(Phase::Abandoned);
                let conn = a.conn();
                if was_queued {
                    if let Some(c) = self.sockets.get_mut(conn) {
                        c.unqueue(id);
                    }
                    self.drop_act(id);
                }
                self.end_act_after_feed(id, Event::ended(id, Err(Error::Cancelled)), out);
            }
        }
    }

    fn progress(&mut self, ready: &[(u64, u32)], out: &mut Vec<Event>) -> bool {
        let mut event = self.reap(out);
        for &(token, ev) in ready {
            match token {
                LISTENER | DIR_LISTENER => self.accept(),
                ACCEPT_TIMER => self.resume_accepting(),
                DEADLINE_TIMER => self.on_deadlines(out),
                i if self.sockets.get(i).is_some() => self.on_conn_ready(i, ev, out),
                _ => continue,
            }
            event = true;
        }
        event |= self.reap(out);
        self.in_flight.submit();
        // Frames queued this turn (requests, answers, copies' ends), one send per connection.
        for i in self.sockets.with_frames_queued() {
            self.sockets.flush(i);
        }
        event
    }

    fn polling(&self) -> Polling {
        Polling::EveryTurn
    }

    fn has_pending(&self) -> bool {
        // Copies are submitted at the end of the turn that started them; one left in the batch
        // (started outside a turn) is submitted by the next.
        self.in_flight.has_finished() || self.in_flight.unsubmitted()
    }

    fn stop(&mut self, within: Option<Duration>) -> bool {
        self.stop_copies(within)
    }

    fn path(&self) -> TransferPath {
        TransferPath::SameHost
    }

    /// Socket I/O, MACs and hand-offs to its pool, holding no memory's owner; with `cuda`, only
    /// where a peer's device request cannot make a caller's turn start CUDA (`ipc::settled_for_callers`).
    fn any_thread(&self) -> bool {
        #[cfg(feature = "cuda")]
        return ipc::settled_for_callers();
        #[cfg(not(feature = "cuda"))]
        true
    }

    fn add_stats(&self, stats: &mut EngineStats, completed: u64) {
        stats.local_transfers += completed;
        stats.local_refused_peers += self.refused_peers;
        stats.copy_pool_queued = crate::sys::same_host::cma::queued();
        stats.local_connections += self.sockets.open();
    }
}

#[cfg(test)]
mod tests;
