//! The protocol core of one same-host connection, without I/O (quinn-proto's shape).
//!
//! A [`Link`] takes what the socket delivered ([`Link::recv`]: bytes, how many descriptors came
//! with them, the time) and what its owner decides ([`Link::request`], [`Link::answer`],
//! [`Link::read_done`]), and gives back bytes to send ([`Link::out`]) and what the peer said,
//! checked ([`Heard`]: well-formed, expected in its state, proven under its operation's key). Its
//! owner (the transport, at the edge) keeps sockets, descriptors, copies and CUDA.
//!
//! Rules it enforces, whatever the peer sends (the argument: docs/SOUNDNESS.md, "The protocol core"):
//! - once dead, nothing more is handled;
//! - the client believes a `Welcome` only when signed by the identity its peer's agent name
//!   advertises ([`identity`]), not even "no live operation" from anyone else;
//! - nothing but `Hello` before `Hello` (server), nothing but `Welcome`/`Reject` before `Welcome`
//!   (client), each at most once and at most [`MAX_HANDSHAKE_FRAME`] bytes;
//! - descriptors arrive only with the `Hello` (one: the slot table) and, once the client's
//!   `Trusted` said it passes them, with the frames that pass pipes' read ends or VMM descriptors
//!   (`GrantPipe`, a `GrantIpc` that asked for them, a write's `Req`), exactly as many as each
//!   says, at most [`MAX_PENDING_DESCRIPTORS`] waiting; any other dies;
//! - a handshake not done within [`HANDSHAKE_TIMEOUT`], or a frame not whole within
//!   [`PARTIAL_FRAME_TIMEOUT`] of its first byte, kills the connection;
//! - an answer must match an open request of this connection (slot, generation, direction, kind
//!   of memory, number of ranges) and carry its operation's MAC; unproven, only a `Refuse` with
//!   [`RefuseCode::NotLive`] or a `Fallback`, and only once the server proved the owner's identity;
//! - open requests per connection are bounded ([`MAX_OPEN`]); past it the server answers
//!   `Fallback` itself.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::auth::{self, KeyId, Keyed, Nonce, Side, Tag};
use super::identity::{self, Fingerprint, Identity};
use super::limits::SLOTS;
use super::violation::Violation;
use super::wire::{
    passed_fds, Kind, Msg, RefuseCode, Req, EAGER_MAX, MAC_LEN, MAX_FORGOT, MAX_FRAME, MAX_LANES,
    MAX_PENDING_DESCRIPTORS, MAX_REASON, NOT_LIVE, SOURCE_BYTES, VERSION,
};
use crate::device::Device;

pub(crate) use self::events::{Answer, Heard, Request};

/// How long a connection may take to shake hands.
pub(crate) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a frame may take to arrive whole once its first byte has.
pub(crate) const PARTIAL_FRAME_TIMEOUT: Duration = Duration::from_secs(5);
/// The largest frame accepted before the handshake is done (a `Reject` with its reason).
pub(crate) const MAX_HANDSHAKE_FRAME: usize = 16 + MAX_REASON;
/// Requests open on one connection at once (one per slot of its table).
pub(crate) const MAX_OPEN: usize = SLOTS;
/// Unsent bytes a connection may hold for a peer that does not read them.
pub(crate) const MAX_UNSENT: usize = 2 * MAX_FRAME;
/// The most capacity an empty read or write buffer keeps (beyond it, it is freed).
const KEEP_CAPACITY: usize = 256 << 10;
/// The largest reply frame of a device read of `n` ranges (`GrantIpc`).
pub(crate) fn grant_ipc_len(n: usize) -> usize {
    4 + 1 + 12 + 4 + SOURCE_BYTES * n + MAC_LEN
}

/// Where the handshake is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Server: waiting for `Hello`.
    AwaitHello,
    /// Server: `Welcome` sent, waiting for `Trusted`.
    AwaitTrusted,
    /// Client: `Hello` sent, waiting for `Welcome` (or `Reject`).
    AwaitWelcome,
    /// Requests and answers may flow.
    Ready,
    /// Closed: nothing more is handled or sent.
    Dead,
}

/// A request this side sent (client) or accepted (server) that is not finished yet.
struct Open {
    key: Keyed,
    /// The operation's key (the server reports it with the request's end).
    name: Arc<str>,
    write: bool,
    /// Reads of device memory are granted with CUDA IPC exports (client: what it asked for).
    device: bool,
    /// Ranges requested (a device grant carries one export per range).
    ranges: usize,
    /// Reads: the grant came (client) or went (server); the reader's `Done` ends it.
    granted: bool,
    /// A small host read whose bytes may come back in the answer ([`Msg::Data`]).
    eager: bool,
    /// Bytes requested (the ranges' lengths added up, saturating).
    total: u64,
    /// Host memory through pipes: the lanes a read asked for (its grant is a `GrantPipe` of at
    /// most as many), or the read ends a write passed.
    pipes: u8,
}

impl Open {
    /// The open request `req` of the operation keyed `key` (`name`), for `total` bytes.
    fn new(req: &Req, key: Keyed, name: Arc<str>, total: u64) -> Self {
        Self {
            key,
            name,
            write: req.write,
            device: req.device != Device::Host,
            ranges: req.remote.len(),
            granted: false,
            eager: req.eager,
            total,
            pipes: req.pipes,
        }
    }
}

/// The protocol state of one connection.
pub(crate) struct Link {
    side: Side,
    state: State,
    /// Client: the key the server must prove it holds.
    opening: Option<Arc<str>>,
    /// Client: the identity the server must prove it is (its agent name's advertisement).
    expect: Option<Fingerprint>,
    /// Server: the identity it signs its `Welcome` with.
    identity: Option<Arc<Identity>>,
    nonce: Nonce,
    client_id: u64,
    server_id: u64,
    rbuf: Vec<u8>,
    /// Bytes of `rbuf` already handled.
    rpos: usize,
    out: Vec<u8>,
    /// How much of `out` was sent already (compacted once it passes half).
    wpos: usize,
    /// Bytes sent over the connection's life (the stream offset of `out`'s first unsent byte).
    sent_total: u64,
    /// Descriptors received with the `Hello`.
    fds: usize,
    /// Client: it takes descriptors (pipes' read ends: it cannot read the server's memory; VMM
    /// exports: the server is in another PID namespace).
    /// Server: before `Trusted`, it cannot read the client's memory (its `Welcome` asks for
    /// piped writes); after, the client said its requests pass descriptors (it takes them).
    pipes: bool,
    /// Client: its writes pass pipes (it or the server cannot read the other's memory).
    writes_piped: bool,
    /// Client: it takes device exports as VMM descriptors (with a `GrantIpc` its device read
    /// asked them for), and its device writes may pass them (its `Trusted` says it passes
    /// descriptors): the server is in another PID namespace, or this process uses CUDA.
    exports: bool,
    /// Descriptors received and not yet taken by their frame (the owner holds them, in order).
    pending: usize,
    handshake_by: Option<Instant>,
    /// When the first byte of the frame still incomplete arrived.
    partial_since: Option<Instant>,
    open: HashMap<(u32, u64), Open>,
    death: Option<Violation>,
    /// It died because the peer went away (end of stream, a socket error), not for a broken rule.
    gone: bool,
    /// The handshake finished (requests could flow) at some point.
    shaken: bool,
}

impl Link {
    /// The connecting side, opening the connection for the operation keyed `opening` to the
    /// agent whose name advertises `expect`: `Hello` is queued in [`Self::out`] (the owner sends
    /// it with its slot table attached).
    pub(crate) fn client(
        opening: Arc<str>,
        expect: Fingerprint,
        nonce: Nonce,
        client_id: u64,
        server_id: u64,
        pipes: bool,
        now: Instant,
    ) -> Self {
        let mut l = Self::new(Side::Client, nonce, client_id, server_id, now);
        l.state = State::AwaitWelcome;
        l.expect = Some(expect);
        l.pipes = pipes;
        l.push(&Msg::Hello {
            version: VERSION,
            key_id: auth::key_id(&opening),
            nonce,
        });
        l.opening = Some(opening);
        l
    }

    /// The serving side of an accepted connection, proving `identity` in its `Welcome`.
    pub(crate) fn server(identity: Arc<Identity>, client_id: u64, server_id: u64, now: Instant) -> Self {
        let mut l = Self::new(Side::Server, [0; 16], client_id, server_id, now);
        l.identity = Some(identity);
        l
    }

    /// A link of `side` awaiting `Hello` (a client moves on at once), its handshake begun `now`.
    fn new(side: Side, nonce: Nonce, client_id: u64, server_id: u64, now: Instant) -> Self {
        Self {
            side,
            state: State::AwaitHello,
            opening: None,
            expect: None,
            identity: None,
            nonce,
            client_id,
            server_id,
            rbuf: Vec::new(),
            rpos: 0,
            out: Vec::new(),
            wpos: 0,
            sent_total: 0,
            fds: 0,
            pipes: false,
            writes_piped: false,
            exports: false,
            pending: 0,
            handshake_by: Some(now + HANDSHAKE_TIMEOUT),
            partial_since: None,
            open: HashMap::new(),
            death: None,
            gone: false,
            shaken: false,
        }
    }

    /// Requests open on this connection (sent and not yet answered or done).
    pub(crate) fn open_requests(&self) -> usize {
        self.open.len()
    }

    /// True for the connecting (active) side.
    pub(crate) fn is_client(&self) -> bool {
        self.side == Side::Client
    }

    /// Server, before `Hello`: refuses the connection with `reason` (sent, then closed).
    pub(crate) fn reject(&mut self, reason: String) {
        if self.side == Side::Server && self.state == State::AwaitHello {
            self.push(&Msg::Reject { reason });
            self.kill(Violation::Rejected);
        }
    }

    /// True once the connection is closed (the owner closes its socket).
    pub(crate) fn is_dead(&self) -> bool {
        self.state == State::Dead
    }

    /// Why it died, for logs.
    pub(crate) fn death(&self) -> Option<Violation> {
        self.death
    }

    /// True once requests may flow (client: the server's proof checked; server: `Trusted` came).
    pub(crate) fn is_ready(&self) -> bool {
        self.state == State::Ready
    }

    /// True while a descriptor passed now would be taken (server, before `Hello`, none yet).
    pub(crate) fn takes_descriptors(&self) -> bool {
        self.side == Side::Server && self.state == State::AwaitHello && self.fds == 0
    }

    /// Closes the connection for `why` (the owner found something the core cannot see: a slot
    /// table that is not one, a socket error).
    pub(crate) fn kill(&mut self, why: Violation) {
        if self.state != State::Dead {
            self.state = State::Dead;
            self.death = Some(why);
            self.open.clear();
            self.rbuf = Vec::new();
            self.rpos = 0;
        }
    }

    /// Closes the connection because the peer went away (`why`: end of stream, a socket error).
    pub(crate) fn hang_up(&mut self, why: Violation) {
        if self.state != State::Dead {
            self.gone = true;
        }
        self.kill(why);
    }

    /// True when it died because the peer went away rather than for a rule it broke (or a
    /// deadline it missed): what was waiting on it failed with the peer, where otherwise it may
    /// take NIXL.
    pub(crate) fn peer_went_away(&self) -> bool {
        self.gone
    }

    /// True once the handshake finished (even if the connection died since). A connection that
    /// ends before it (whoever closed it: a server that refuses silently, a squatter, a peer that
    /// died) says nothing about the operations queued on it: they take NIXL.
    pub(crate) fn shook_hands(&self) -> bool {
        self.shaken
    }

    /// Bytes to send.
    pub(crate) fn out(&self) -> &[u8] {
        &self.out[self.wpos..]
    }

    /// The first `n` bytes of [`Self::out`] were sent. Amortised O(n): what was sent is dropped
    /// from the buffer only once it is half of it, so a peer that reads a byte at a time cannot
    /// make each send move everything queued behind it.
    pub(crate) fn sent(&mut self, n: usize) {
        let n = n.min(self.out.len() - self.wpos);
        self.sent_total += n as u64;
        self.wpos += n;
        if self.wpos == self.out.len() {
            self.out.clear();
            self.wpos = 0;
            if self.out.capacity() > KEEP_CAPACITY {
                self.out = Vec::new();
            }
        } else if self.wpos >= self.out.len() / 2 {
            self.out.drain(..self.wpos);
            self.wpos = 0;
        }
    }

    /// Server, before `Hello`: this side cannot read the client's memory (another PID namespace,
    /// ptrace rules), so its `Welcome` asks the client to write through pipes.
    pub(crate) fn ask_piped_writes(&mut self) {
        if self.side == Side::Server && self.state == State::AwaitHello {
            self.pipes = true;
        }
    }

    /// Client, once ready: its writes pass pipes (it cannot read the server's memory, or the
    /// server's `Welcome` said it cannot read this side's).
    pub(crate) fn writes_piped(&self) -> bool {
        self.writes_piped
    }

    /// Client, before `Hello`: this side takes device exports as VMM descriptors and may pass
    /// its own (see [`Link::takes_exports`]).
    pub(crate) fn take_exports(&mut self) {
        if self.side == Side::Client && self.state == State::AwaitWelcome && !self.shaken {
            self.exports = true;
        }
    }

    /// Client: its device reads ask for VMM descriptors, which it takes.
    pub(crate) fn takes_exports(&self) -> bool {
        self.exports
    }

    /// Client, once ready: the server takes descriptors with this side's requests (its
    /// `Trusted` said so: piped writes, or device exports).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn passes_descriptors(&self) -> bool {
        self.state == State::Ready && (self.writes_piped || self.exports)
    }

    /// Tells the peer this side gave back the VMM exports `ids` (in frames of at most
    /// [`MAX_FORGOT`] ids), once ready.
    pub(crate) fn forgot(&mut self, ids: &[u64]) {
        if self.state != State::Ready {
            return;
        }
        for chunk in ids.chunks(MAX_FORGOT) {
            self.push(&Msg::Forgot { ids: chunk.to_vec() });
        }
    }

    /// This side takes descriptors now (beside the `Hello`'s).
    fn takes_passed(&self) -> bool {
        self.state == State::Ready && (self.pipes || self.exports)
    }

    /// The stream offset of the first unsent byte of [`Self::out`].
    pub(crate) fn sent_total(&self) -> u64 {
        self.sent_total
    }

    /// The stream offset the next frame queued will start at.
    pub(crate) fn queued_end(&self) -> u64 {
        self.sent_total + (self.out.len() - self.wpos) as u64
    }

    /// When [`Self::on_timeout`] must run next, if ever.
    pub(crate) fn deadline(&self) -> Option<Instant> {
        if self.state == State::Dead {
            return None;
        }
        let partial = self.partial_since.map(|t| t + PARTIAL_FRAME_TIMEOUT);
        match (self.handshake_by, partial) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// The clock reached `now`: a handshake or a frame past its deadline kills the connection.
    pub(crate) fn on_timeout(&mut self, now: Instant) {
        if self.handshake_by.is_some_and(|t| now >= t) {
            self.kill(Violation::HandshakeTimedOut);
        } else if self
            .partial_since
            .is_some_and(|t| now >= t + PARTIAL_FRAME_TIMEOUT)
        {
            self.kill(Violation::PartialFrameTimedOut);
        }
    }

    /// Takes `data` read from the socket (with `fds` descriptors passed alongside) at `now`;
    /// what it proved goes to `heard`. `keys` names the live operations by key id (server).
    ///
    /// Never panics, whatever the bytes; a peer that breaks a rule kills the connection, and
    /// nothing after that is handled.
    pub(crate) fn recv(
        &mut self,
        data: &[u8],
        fds: usize,
        now: Instant,
        keys: &HashMap<KeyId, Arc<str>>,
        heard: &mut Vec<Heard>,
    ) {
        if self.state == State::Dead {
            return;
        }
        if fds > 0 {
            if self.takes_descriptors() {
                if fds > 1 {
                    return self.kill(Violation::PassedOutsideHello);
                }
                self.fds += fds;
            } else {
                // Pipes' read ends, for a frame in these bytes or the next; checked against the
                // frames once they are handled (below), and bounded now.
                self.pending += fds;
                // Only where pipes are used, or may be from a `Trusted` in these same bytes.
                let may =
                    self.takes_passed() || (self.side == Side::Server && self.state == State::AwaitTrusted);
                if !may || self.pending > MAX_PENDING_DESCRIPTORS {
                    return self.kill(Violation::PassedOutsideHello);
                }
            }
        }
        let max = self.max_frame();
        if self.rbuf.len() - self.rpos + data.len() > max + 4 + MAX_FRAME.min(64 << 10) {
            return self.kill(Violation::Flood);
        }
        self.rbuf.extend_from_slice(data);
        // Taken out while its frames are handled (they borrow it); put back below.
        let buf = std::mem::take(&mut self.rbuf);
        while self.state != State::Dead {
            match Msg::decode(&buf[self.rpos..], self.max_frame()) {
                Ok(Some((frame, used))) => {
                    self.rpos += used;
                    self.handle(frame.msg, frame.signed, frame.mac, keys, heard);
                }
                Ok(None) => break,
                Err(why) => self.kill(why),
            }
        }
        self.rbuf = buf;
        if self.pending > 0 && !self.takes_passed() {
            self.kill(Violation::PassedOutsideHello);
        }
        if self.state == State::Dead {
            self.rbuf = Vec::new();
            self.rpos = 0;
            return;
        }
        if self.rpos == self.rbuf.len() {
            self.rbuf.clear();
            self.rpos = 0;
            self.partial_since = None;
            if self.rbuf.capacity() > KEEP_CAPACITY {
                // One large frame does not pin its size in memory for the connection's life.
                self.rbuf = Vec::new();
            }
        } else {
            if self.rpos > 0 {
                self.rbuf.drain(..self.rpos);
                self.rpos = 0;
            }
            self.partial_since.get_or_insert(now);
        }
    }

    fn max_frame(&self) -> usize {
        match self.state {
            State::Ready => MAX_FRAME,
            _ => MAX_HANDSHAKE_FRAME,
        }
    }

    fn mac(&self, key: &Keyed, from: Side, signed: &[u8]) -> Tag {
        auth::frame_mac(key, &self.nonce, self.client_id, self.server_id, from, signed)
    }

    fn proven(&self, key: &Keyed, from: Side, signed: &[u8], mac: Option<Tag>) -> bool {
        mac.is_some_and(|m| auth::same(&m, &self.mac(key, from, signed)))
    }

    fn push(&mut self, m: &Msg) {
        m.encode_signed(&mut self.out, |_| [0; MAC_LEN]);
        self.check_unsent();
    }

    /// A peer that sends without reading what it is answered (a replay's `Refuse`, say) cannot
    /// make this side hold more than [`MAX_UNSENT`] bytes for it.
    fn check_unsent(&mut self) {
        if self.out.len() - self.wpos > MAX_UNSENT {
            self.kill(Violation::NotReading);
        }
    }

    fn push_signed(&mut self, m: &Msg, key: &Keyed) {
        let from = self.side;
        let (nonce, cp, sp) = (self.nonce, self.client_id, self.server_id);
        m.encode_signed(&mut self.out, |b| auth::frame_mac(key, &nonce, cp, sp, from, b));
        self.check_unsent();
    }

    fn handle(
        &mut self,
        m: Msg,
        signed: &[u8],
        mac: Option<Tag>,
        keys: &HashMap<KeyId, Arc<str>>,
        heard: &mut Vec<Heard>,
    ) {
        match (self.side, self.state, m) {
            // The server's handshake.
            (
                Side::Server,
                State::AwaitHello,
                Msg::Hello {
                    version,
                    key_id,
                    nonce,
                },
            ) => {
                if self.fds != 1 {
                    return self.kill(Violation::HelloWithoutTable);
                }
                if version != VERSION {
                    self.push(&Msg::Reject {
                        reason: format!("protocol version {version}; this side speaks {VERSION}"),
                    });
                    return self.kill(Violation::OtherVersion);
                }
                self.nonce = nonce;
                // The proof that this process holds the opening operation's key (none if it has
                // no such live operation: the client then refuses that operation as a replay).
                let proof = keys
                    .get(&key_id)
                    .map(|k| auth::welcome_proof(k, &nonce, self.client_id, self.server_id));
                let live = proof.is_some();
                let Some(id) = &self.identity else {
                    return self.kill(Violation::NoIdentity);
                };
                let pipes = self.pipes;
                let (public, sig) = id.sign_welcome(&identity::Welcome {
                    nonce: &nonce,
                    client_id: self.client_id,
                    server_id: self.server_id,
                    proof: proof.as_ref(),
                    pipes,
                });
                self.state = State::AwaitTrusted;
                heard.push(Heard::Hello);
                self.push(&Msg::Welcome {
                    proof,
                    public,
                    sig,
                    pipes,
                });
                if !live {
                    // The client refuses its opening operation as a replay and closes; nothing
                    // more of this connection is served (no `Trusted` can make it ready).
                    self.kill(Violation::HelloNotLive);
                }
            }
            (Side::Server, State::AwaitTrusted, Msg::Trusted { pipes }) => {
                self.state = State::Ready;
                self.shaken = true;
                self.handshake_by = None;
                self.pipes = pipes;
                heard.push(Heard::Trusted { pipes });
            }
            (Side::Server, State::Ready, Msg::Req(req)) => {
                let Req {
                    slot,
                    gen,
                    write,
                    key_id,
                    device,
                    ref remote,
                    ref local,
                    ref sources,
                    eager,
                    ref data,
                    pipes,
                    ..
                } = req;
                if slot as usize >= SLOTS || self.open.contains_key(&(slot, gen)) {
                    return self.kill(Violation::BadSlot);
                }
                // Descriptors come only with a write, on a connection that said it passes them;
                // pipes carry host memory, never beside eager bytes or a write's addresses. A
                // device read passes none; its `pipes: 1` asks for the exports as VMM descriptors.
                let Some(vmm) = passed_fds(sources) else {
                    return self.kill(Violation::MissingDescriptors);
                };
                let passed = if write { pipes as usize + vmm } else { 0 };
                let device_read = !write && device != Device::Host;
                if device_read && pipes > 1 {
                    return self.kill(Violation::MissingDescriptors);
                }
                if (pipes > 0 || vmm > 0) && passed > 0 && (!self.pipes || passed > self.pending) {
                    return self.kill(Violation::MissingDescriptors);
                }
                if (vmm > 0 && (!write || pipes > 0))
                    || (pipes > 0
                        && !device_read
                        && (device != Device::Host
                            || eager
                            || !data.is_empty()
                            || !local.is_empty()
                            || !sources.is_empty()))
                {
                    return self.kill(Violation::MissingDescriptors);
                }
                self.pending -= passed;
                let total = remote.iter().try_fold(0u64, |t, r| t.checked_add(r.1));
                let host = device == Device::Host;
                if eager
                    && (write
                        || !host
                        || !data.is_empty()
                        || !local.is_empty()
                        || !sources.is_empty()
                        || total.is_none_or(|t| t > EAGER_MAX as u64))
                {
                    return self.kill(Violation::EagerReadTooLarge);
                }
                if !data.is_empty()
                    && (!write
                        || !host
                        || !local.is_empty()
                        || !sources.is_empty()
                        || total != Some(data.len() as u64))
                {
                    return self.kill(Violation::WriteBytesMismatch);
                }
                let Some(name) = keys.get(&key_id).cloned() else {
                    // No live operation has this key: a replay. Nothing to prove it with.
                    if passed > 0 {
                        heard.push(Heard::Unused { fds: passed });
                    }
                    self.push(&Msg::Refuse {
                        slot,
                        gen,
                        code: RefuseCode::NotLive,
                        reason: NOT_LIVE.into(),
                    });
                    return;
                };
                let key = Keyed::new(&name);
                if !self.proven(&key, Side::Client, signed, mac) {
                    return self.kill(Violation::UnprovenRequest);
                }
                if self.open.len() >= MAX_OPEN {
                    if passed > 0 {
                        heard.push(Heard::Unused { fds: passed });
                    }
                    let m = Msg::Fallback {
                        slot,
                        gen,
                        reason: format!("this connection has {MAX_OPEN} requests open already"),
                    };
                    return self.push_signed(&m, &key);
                }
                let open = Open::new(&req, key, name.clone(), total.unwrap_or(u64::MAX));
                self.open.insert((slot, gen), open);
                heard.push(Heard::Req(Request {
                    req,
                    key: name,
                    passed,
                }));
            }
            (Side::Server, State::Ready, Msg::Done { slot, gen, ok, .. }) => {
                let proven = match self.open.get(&(slot, gen)) {
                    Some(o) if o.granted && !o.write => self.proven(&o.key, Side::Client, signed, mac),
                    _ => return self.kill(Violation::DoneForNothing),
                };
                if !proven {
                    return self.kill(Violation::UnprovenDone);
                }
                let o = self.open.remove(&(slot, gen)).expect("checked just above");
                heard.push(Heard::ReadDone {
                    slot,
                    gen,
                    ok,
                    key: o.name,
                });
            }
            // The client's handshake.
            (
                Side::Client,
                State::AwaitWelcome,
                Msg::Welcome {
                    proof,
                    public,
                    sig,
                    pipes,
                },
            ) => {
                let (Some(opening), Some(expect)) = (self.opening.take(), self.expect) else {
                    return self.kill(Violation::NoOpeningKey);
                };
                // First who answers: only the owner of the advertised identity is believed,
                // whatever it says (a live operation's proof, or none).
                let signed = identity::Welcome {
                    nonce: &self.nonce,
                    client_id: self.client_id,
                    server_id: self.server_id,
                    proof: proof.as_ref(),
                    pipes,
                };
                if !identity::verify_welcome(&expect, &public, &sig, &signed) {
                    heard.push(Heard::Impostor);
                    return self.kill(Violation::NotTheOwner);
                }
                match proof {
                    None => {
                        heard.push(Heard::NotLive { key: opening });
                        self.kill(Violation::ServerNotLive);
                    }
                    Some(p)
                        if auth::same(
                            &p,
                            &auth::welcome_proof(&opening, &self.nonce, self.client_id, self.server_id),
                        ) =>
                    {
                        self.state = State::Ready;
                        self.shaken = true;
                        self.handshake_by = None;
                        // Writes pass pipes where either side cannot read the other.
                        self.writes_piped = self.pipes || pipes;
                        // The server takes descriptors from here on where this side passes any.
                        self.push(&Msg::Trusted {
                            pipes: self.writes_piped || self.exports,
                        });
                        heard.push(Heard::Ready);
                    }
                    Some(_) => {
                        heard.push(Heard::Impostor);
                        self.kill(Violation::BadProof);
                    }
                }
            }
            (Side::Client, State::AwaitWelcome, Msg::Reject { reason }) => {
                heard.push(Heard::Rejected { reason });
                self.kill(Violation::ServerRejected);
            }
            (_, State::Ready, Msg::Forgot { ids }) => heard.push(Heard::Forgot { ids }),
            (Side::Client, State::Ready, m) => self.on_answer(m, signed, mac, heard),
            _ => self.kill(Violation::OutOfOrder),
        }
    }

    // Requests and their answers once the handshake is done: the client's requests and the
    // server's answers going out, the answers coming in (each proven under its operation's key).

    fn on_answer(&mut self, m: Msg, signed: &[u8], mac: Option<Tag>, heard: &mut Vec<Heard>) {
        let Some((slot, gen)) = m.slot_gen() else {
            return self.kill(Violation::OutOfOrder);
        };
        let Some(o) = self.open.get(&(slot, gen)) else {
            return self.kill(Violation::AnswerToNothing);
        };
        if o.granted {
            return self.kill(Violation::AnswerAfterGrant);
        }
        let proven = self.proven(&o.key, Side::Server, signed, mac);
        // Only answers that can make an operation fail or take NIXL may come unproven.
        let unproven_ok = matches!(
            m,
            Msg::Refuse {
                code: RefuseCode::NotLive,
                ..
            } | Msg::Fallback { .. }
        );
        if !proven && !unproven_ok {
            return self.kill(Violation::UnprovenAnswer);
        }
        let fits = match &m {
            Msg::Grant { .. } => !o.write && !o.device && o.pipes == 0,
            Msg::GrantPipe { lanes, .. } => !o.write && !o.device && *lanes <= o.pipes,
            Msg::GrantIpc { sources, .. } => !o.write && o.device && sources.len() == o.ranges,
            Msg::Data { data, .. } => !o.write && !o.device && o.eager && data.len() as u64 == o.total,
            Msg::Done { .. } => o.write,
            _ => true,
        };
        if !fits {
            return self.kill(Violation::WrongAnswer);
        }
        match m {
            Msg::Grant { .. } => {
                self.open.get_mut(&(slot, gen)).expect("checked").granted = true;
                heard.push(Heard::Grant {
                    slot,
                    gen,
                    sources: None,
                });
            }
            Msg::GrantPipe { lanes, .. } => {
                if lanes as usize > self.pending {
                    return self.kill(Violation::MissingDescriptors);
                }
                self.pending -= lanes as usize;
                self.open.get_mut(&(slot, gen)).expect("checked").granted = true;
                heard.push(Heard::GrantPipe { slot, gen, lanes });
            }
            Msg::GrantIpc { sources, .. } => {
                // Exports as passed descriptors only where the reader asked for them (then
                // legacy handles too, for memory that has one), exactly as many as named.
                let asked = self.open.get(&(slot, gen)).expect("checked").pipes > 0;
                let n = passed_fds(&sources).unwrap_or(usize::MAX);
                if (asked && n > self.pending) || (!asked && n != 0) {
                    return self.kill(Violation::MissingDescriptors);
                }
                self.pending -= n;
                self.open.get_mut(&(slot, gen)).expect("checked").granted = true;
                heard.push(Heard::Grant {
                    slot,
                    gen,
                    sources: Some(sources),
                });
            }
            Msg::Data { data, .. } => {
                self.open.remove(&(slot, gen));
                heard.push(Heard::Data { slot, gen, data });
            }
            Msg::Refuse { code, reason, .. } => {
                self.open.remove(&(slot, gen));
                heard.push(Heard::Refused {
                    slot,
                    gen,
                    code,
                    reason,
                });
            }
            Msg::Fallback { reason, .. } => {
                self.open.remove(&(slot, gen));
                heard.push(Heard::Fallback { slot, gen, reason });
            }
            Msg::Done { ok, reason, .. } => {
                self.open.remove(&(slot, gen));
                heard.push(Heard::WriteDone {
                    slot,
                    gen,
                    ok,
                    reason,
                });
            }
            _ => unreachable!("matched above"),
        }
    }

    /// Client: sends request `req` for the operation keyed `key`. False (nothing sent) when
    /// the connection is not ready or the slot is in use.
    pub(crate) fn request(&mut self, key: &str, req: Req) -> bool {
        let (slot, gen) = (req.slot, req.gen);
        if self.side != Side::Client || self.state != State::Ready || self.open.contains_key(&(slot, gen)) {
            return false;
        }
        let total = req.remote.iter().fold(0u64, |t, r| t.saturating_add(r.1));
        let open = Open::new(&req, Keyed::new(key), key.into(), total);
        self.push_signed(&Msg::Req(req), &open.key);
        self.open.insert((slot, gen), open);
        true
    }

    /// Client: sends `m` if it is a request (tests and the fuzz harness, which forge frames as
    /// messages); false otherwise, or as [`request`](Self::request) says.
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn request_msg(&mut self, key: &str, m: &Msg) -> bool {
        match m {
            Msg::Req(r) => self.request(key, r.clone()),
            _ => false,
        }
    }

    /// Client: the copy of granted read (`slot`, `gen`) ended; tells the server.
    pub(crate) fn read_done(&mut self, slot: u32, gen: u64, ok: bool, reason: &str) {
        if self.state != State::Ready {
            return;
        }
        let Some(o) = self.open.remove(&(slot, gen)) else {
            return;
        };
        if o.granted {
            let m = Msg::Done {
                slot,
                gen,
                ok,
                reason: reason.into(),
            };
            self.push_signed(&m, &o.key);
        }
    }

    /// Server: answers open request (`slot`, `gen`) under its operation's key (nothing happens for
    /// one not open). True when the answer is queued on a live connection (the owner of an eager
    /// operation completes it only then).
    pub(crate) fn answer(&mut self, slot: u32, gen: u64, a: Answer) -> bool {
        if self.side != Side::Server || self.state != State::Ready {
            return false;
        }
        let Some(o) = self.open.get_mut(&(slot, gen)) else {
            return false;
        };
        let m = match a {
            Answer::Grant | Answer::GrantIpc(_) | Answer::GrantPipe(_) if o.write || o.granted => {
                return false
            }
            Answer::GrantPipe(n) if o.device || n == 0 || n > o.pipes || n as usize > MAX_LANES => {
                return false
            }
            Answer::GrantPipe(lanes) => Msg::GrantPipe { slot, gen, lanes },
            Answer::Grant => Msg::Grant { slot, gen },
            Answer::GrantIpc(sources) => Msg::GrantIpc { slot, gen, sources },
            Answer::Data(data)
                if !o.write && !o.granted && !o.device && o.eager && data.len() as u64 == o.total =>
            {
                Msg::Data { slot, gen, data }
            }
            Answer::Data(_) => Msg::Fallback {
                slot,
                gen,
                reason: "the passive side's eager answer did not fit the request".into(),
            },
            Answer::Refuse(code, reason) => Msg::Refuse {
                slot,
                gen,
                code,
                reason,
            },
            Answer::Fallback(reason) => Msg::Fallback { slot, gen, reason },
            Answer::WriteDone { ok, reason } => Msg::Done {
                slot,
                gen,
                ok,
                reason,
            },
        };
        // A grant keeps the request open until the reader's `Done`; any other answer ends it.
        let key = if matches!(m.kind(), Kind::Grant | Kind::GrantIpc | Kind::GrantPipe) {
            o.granted = true;
            o.key.clone()
        } else {
            self.open.remove(&(slot, gen)).expect("present").key
        };
        self.push_signed(&m, &key);
        self.state == State::Ready
    }
}

mod events;
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) mod fuzz;
#[cfg(test)]
mod tests;
