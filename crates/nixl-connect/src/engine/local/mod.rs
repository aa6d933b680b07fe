//! The same-host transport: Rust peers on one host copy host memory directly, negotiated out of
//! band so the published metadata stays exactly NIXL's.
//!
//! Each connector listens on an abstract Unix socket named from its agent name
//! ([`socket_name`]), which scopes it to this host's network namespace. An active side that finds
//! the socket named by a metadata's agent connects, hands over a sealed slot table ([`slots`]),
//! and asks for access to the operation by its notification key ([`proto`]). The passive side
//! checks everything against its live operation: the peer's uid (`SO_PEERCRED`), the key, every
//! range inside the operation's descriptors, the direction, one writer at a time; access ends when
//! the operation completes, is cancelled or dropped (a replayed metadata string is refused).
//!
//! The side whose memory is written copies, pulling with `process_vm_readv` ([`cma`]): the reader
//! for a read, the passive side for a write. So each process writes only its own memory, and the
//! owner of the source can revoke a grant at any instant without waiting (see [`slots`]). Device
//! memory (feature `cuda`) goes the same way through CUDA IPC (`ipc`): the source's owner exports
//! it, the destination's owner opens it and copies on its own stream. No socket, a peer on another
//! host, another user, a kernel that forbids cross-memory attach, host memory into device memory,
//! or no CUDA where device memory is involved: the operation goes to NIXL instead
//! ([`Event::Declined`]).

mod auth;
pub(crate) mod cma;
#[cfg(feature = "cuda")]
pub(crate) mod ipc;
pub(crate) mod proto;
pub(crate) mod slots;

use std::collections::{HashMap, HashSet, VecDeque};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use self::auth::{KeyId, Nonce};
use self::cma::{Copy, CopyError, Piece, SlotRef};
use self::proto::{IpcSource, Msg, RefuseCode, MAX_FRAME, VERSION};
use self::slots::{SlotTable, SLOTS};
use super::poller::{hung_up, Registrar, Waker};
use super::transport::{ActiveSpec, Event, Exposure, OpId, PassiveSpec, Polling, Transport};
use super::Range;

/// A connection's id (also its token in the engine's poller); never reused.
type ConnId = u64;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::metadata::OperationKind;
use crate::operation::{OpState, TransferPath};

/// The token of the listening socket in the engine's poller.
const LISTENER: u64 = 0;
/// The poller token of the timer that re-arms the listener after running out of descriptors.
const ACCEPT_TIMER: u64 = u64::MAX - 1; // u64::MAX is the poller's own wake-up
/// How long the listener rests after `accept` ran out of descriptors or memory.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);
/// Connections this connector serves at once (same-host peers beyond it are refused and use NIXL).
const MAX_SERVED: usize = 1024;
/// Connections it serves at once to one process.
const MAX_SERVED_PER_PID: usize = 64;
/// The most read grants one connection holds at once (a well-behaved client has at most one per
/// slot of its table); past it, requests take NIXL.
const MAX_GRANTS_PER_CONN: usize = slots::SLOTS;
/// How long a peer with no same-host socket is not asked again.
const NEGATIVE_TTL: Duration = Duration::from_secs(2);
/// Negative answers remembered.
const MAX_NEGATIVE: usize = 4096;

/// Why a request for a key this side has no live operation for is refused.
const NOT_LIVE: &str = "no live operation has this notification key: it completed, was cancelled \
                        or dropped (a replayed metadata string?)";

/// This process's pid, as the kernel reports it to peers (`SO_PEERCRED`).
/// Locks `m`, taking over a lock poisoned by a panicking holder (every value guarded here stays
/// consistent between statements).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn self_pid() -> libc::pid_t {
    std::process::id() as libc::pid_t
}

/// The abstract socket name of the connector whose NIXL agent is `agent` (a rotated exposer's
/// name, `<connector>~<generation>`, names its connector's socket).
pub(crate) fn socket_name(agent: &str) -> Vec<u8> {
    let agent = agent.split_once('~').map_or(agent, |(base, _)| base);
    let mut n = b"nixl-connect.v1/".to_vec();
    if agent.len() <= 90 {
        n.extend_from_slice(agent.as_bytes());
    } else {
        // Too long for sockaddr_un: a stable hash (FNV-1a, 64 bits) names it instead.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in agent.bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
        n.extend_from_slice(format!("#{h:016x}").as_bytes());
    }
    n
}

#[allow(unsafe_code)]
fn sockaddr(name: &[u8]) -> (libc::sockaddr_un, libc::socklen_t) {
    // SAFETY: sockaddr_un is plain old data; all-zero is a valid value.
    let mut a: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    a.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (i, b) in name.iter().take(a.sun_path.len() - 1).enumerate() {
        a.sun_path[i + 1] = *b as libc::c_char; // sun_path[0] = 0: the abstract namespace
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + 1 + name.len().min(a.sun_path.len() - 1);
    (a, len as libc::socklen_t)
}

#[allow(unsafe_code)]
fn timerfd() -> io::Result<OwnedFd> {
    // SAFETY: creates a new descriptor, owned right after.
    let fd = unsafe { libc::timerfd_create(libc::CLOCK_MONOTONIC, libc::TFD_NONBLOCK | libc::TFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

#[allow(unsafe_code)]
fn unix_socket() -> io::Result<OwnedFd> {
    // SAFETY: creates a new descriptor, owned right after.
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Binds and listens on the socket for `agent`; `Ok(None)` when another connector has it.
#[allow(unsafe_code)]
pub(crate) fn listen(agent: &str) -> io::Result<Option<OwnedFd>> {
    let fd = unix_socket()?;
    let (a, len) = sockaddr(&socket_name(agent));
    // SAFETY: `a` is a valid sockaddr_un of `len` bytes.
    if unsafe { libc::bind(fd.as_raw_fd(), (&a as *const libc::sockaddr_un).cast(), len) } != 0 {
        let e = io::Error::last_os_error();
        return if e.raw_os_error() == Some(libc::EADDRINUSE) {
            Ok(None)
        } else {
            Err(e)
        };
    }
    // SAFETY: listen on our own bound socket.
    if unsafe { libc::listen(fd.as_raw_fd(), 128) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(Some(fd))
}

/// The peer's pid and uid (`SO_PEERCRED`), as the kernel recorded them at connect time.
#[allow(unsafe_code)]
fn peer_cred(fd: RawFd) -> io::Result<(libc::pid_t, libc::uid_t)> {
    // SAFETY: ucred is plain old data; getsockopt writes at most `len` bytes into it.
    let mut c: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: as above.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut c as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((c.pid, c.uid))
}

/// A pidfd for `pid`, so a copy can tell afterwards that its peer is still the same process.
#[allow(unsafe_code)]
fn pidfd(pid: libc::pid_t) -> Option<OwnedFd> {
    // SAFETY: pidfd_open returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    // SAFETY: a fresh descriptor nothing else owns.
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

#[allow(unsafe_code)]
fn alive(pidfd: &Option<Arc<OwnedFd>>) -> bool {
    match pidfd {
        // SAFETY: signal 0 only checks that the process behind the pidfd still exists.
        Some(fd) => unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                fd.as_raw_fd(),
                0,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            ) == 0
        },
        None => true,
    }
}

#[allow(unsafe_code)]
fn uid() -> libc::uid_t {
    // SAFETY: getuid cannot fail.
    unsafe { libc::getuid() }
}

/// One socket: a connection this side made (client, the active side) or accepted (server).
struct Conn {
    fd: OwnedFd,
    client: bool,
    peer_pid: libc::pid_t,
    pidfd: Option<Arc<OwnedFd>>,
    rbuf: Vec<u8>,
    wbuf: Vec<u8>,
    writing: bool,
    fds_in: VecDeque<OwnedFd>,
    slots: Option<Arc<SlotTable>>,
    /// The handshake is done (client: the server proved it holds the opening operation's key;
    /// server: `Hello` answered).
    ready: bool,
    /// Server side: the client sent `Trusted` (it checked our proof; requests may follow).
    trusted: bool,
    /// Server side: read grants this connection holds (at most [`MAX_GRANTS_PER_CONN`]).
    granted: usize,
    /// The client's nonce for this connection (sent in `Hello`).
    nonce: Nonce,
    /// Client side: the key of the operation that opened the connection (what the server must
    /// prove it holds).
    opening_key: Option<Arc<str>>,
    /// This side may pull from the peer's memory.
    can_pull: bool,
    /// Client side: the peer's agent name, operations waiting for the handshake, free slots.
    peer: Arc<str>,
    queued: Vec<OpId>,
    free_slots: Vec<u32>,
    gens: Vec<u64>,
    dead: bool,
}

impl Conn {
    fn new(fd: OwnedFd, client: bool, peer_pid: libc::pid_t, peer: Arc<str>) -> Self {
        Self {
            fd,
            client,
            peer_pid,
            pidfd: pidfd(peer_pid).map(Arc::new),
            rbuf: Vec::new(),
            wbuf: Vec::new(),
            writing: false,
            fds_in: VecDeque::new(),
            slots: None,
            ready: false,
            trusted: false,
            granted: 0,
            nonce: [0; 16],
            opening_key: None,
            can_pull: false,
            peer,
            queued: Vec::new(),
            free_slots: if client {
                (0..SLOTS as u32).rev().collect()
            } else {
                Vec::new()
            },
            gens: if client { vec![0; SLOTS] } else { Vec::new() },
            dead: false,
        }
    }

    fn send(&mut self, m: &Msg) {
        m.encode(&mut self.wbuf);
    }
}

enum Phase {
    /// Waiting for the connection's handshake.
    Queued,
    /// A write from device memory: its source is being exported (CUDA thread).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Exporting,
    /// Asked; waiting for the grant (reads) or for the passive side's copy (writes).
    Requested,
    /// A read being copied here.
    Copying,
    /// Given up: any late answer is ignored.
    Abandoned,
}

/// An active operation on this transport.
struct Act {
    spec: ActiveSpec,
    conn: ConnId,
    slot: u32,
    gen: u64,
    phase: Phase,
    cancel: Arc<AtomicBool>,
    /// The peer's pidfd while copying (to tell afterwards that it is still the same process).
    pidfd: Option<Arc<OwnedFd>>,
    /// The source's memory is device memory: reads get `GrantIpc`, writes send their export.
    device: bool,
    /// A device write's exported source, once the CUDA thread has it.
    sources: Vec<IpcSource>,
}

/// A passive operation's scope on the serving side.
struct Scope {
    kind: OperationKind,
    device: Device,
    /// The operation's descriptors, sorted by address.
    ranges: Vec<Range>,
    state: Arc<OpState>,
    /// Read grants given: `(connection, slot, generation)`.
    grants: HashSet<(ConnId, u32, u64)>,
    /// The writer copying into it now: `(connection, slot, generation, cancel)`.
    writer: Option<(ConnId, u32, u64, Arc<AtomicBool>)>,
}

impl Scope {
    /// True when `[addr, addr+len)` lies inside one descriptor.
    fn contains(&self, addr: u64, len: u64) -> bool {
        let Some(end) = addr.checked_add(len) else {
            return false;
        };
        let i = self.ranges.partition_point(|r| r.addr as u64 <= addr);
        self.ranges[..i]
            .iter()
            .rev()
            .take(16)
            .any(|r| (r.addr + r.len) as u64 >= end)
    }
}

/// Which frame a client-side operation may receive in its phase.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// A read waiting for its grant (or given up, which answers it with a failure).
    Grant,
    /// A refusal or a hand-over to NIXL: only before any copy began.
    Answer,
    /// The passive side's end of a write.
    WriteDone,
}

/// Copies running on the pool, so the transport can stop and wait for them before the memory
/// they write is freed.
#[derive(Default)]
struct Outstanding {
    count: Mutex<usize>,
    cv: std::sync::Condvar,
}

/// Who a finished copy belonged to.
enum CopyOwner {
    /// A read of this side (client).
    Read(OpId),
    /// A write into this side's passive operation (server).
    Write {
        key: Arc<str>,
        conn: ConnId,
        slot: u32,
        gen: u64,
        state: Arc<OpState>,
        pidfd: Option<Arc<OwnedFd>>,
    },
}

type Finished = Arc<Mutex<Vec<(CopyOwner, std::result::Result<(), CopyError>)>>>;

/// A copy for the host path or the device path.
enum AnyCopy {
    Host(Copy),
    #[cfg(feature = "cuda")]
    Device(ipc::Copy),
}

/// A finished CUDA IPC export.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
enum ExportDone {
    /// A read grant's source (this side serves it).
    Grant {
        key: Arc<str>,
        conn: ConnId,
        slot: u32,
        gen: u64,
        result: std::result::Result<Vec<IpcSource>, String>,
    },
    /// A write's source (this side writes).
    Write {
        id: OpId,
        result: std::result::Result<Vec<IpcSource>, String>,
    },
}

type Exports = Arc<Mutex<Vec<ExportDone>>>;

/// The one device all `ranges` are on, or `None` for none or several.
fn uniform(ranges: &[Range]) -> Option<Device> {
    let d = ranges.first()?.device;
    ranges.iter().all(|r| r.device == d).then_some(d)
}

/// Why the device path cannot move a transfer from memory on `src` into memory on `dst`, if it
/// cannot (the host path takes host-to-host).
pub(crate) fn device_path_refusal(src: Device, dst: Device) -> Option<String> {
    match (src, dst) {
        (Device::Cuda(_), Device::Cuda(_) | Device::Host) if cfg!(feature = "cuda") => {
            #[cfg(feature = "cuda")]
            if !ipc::available() {
                return Some("no usable CUDA driver or GPU in this process".into());
            }
            None
        }
        (Device::Cuda(_), _) => Some("this build has no CUDA support (feature `cuda`)".into()),
        (Device::Host, Device::Cuda(_)) => Some("host memory into device memory takes the NIXL path".into()),
        (a, b) => Some(format!("memory on {a} to {b} takes the NIXL path")),
    }
}

/// The same-host transport of one connector.
pub(crate) struct LocalTransport {
    enabled: bool,
    listener: Option<OwnedFd>,
    reg: Registrar,
    waker: Waker,
    uid: libc::uid_t,
    conns: HashMap<ConnId, Conn>,
    next_conn: ConnId,
    by_peer: HashMap<Arc<str>, ConnId>,
    negative: HashMap<Arc<str>, Instant>,
    scopes: HashMap<Arc<str>, Scope>,
    /// The key of each live scope by its key id (the name requests use on the wire).
    key_ids: HashMap<KeyId, Arc<str>>,
    /// Fingerprints of this connector's exposers' connection metadata.
    identities: HashSet<u64>,
    acts: HashMap<OpId, Act>,
    finished: Finished,
    exports: Exports,
    outstanding: Arc<Outstanding>,
    pub(crate) refused_peers: u64,
    /// A timer (made up front: there may be no descriptor left when it is needed) that re-arms
    /// the listener after `accept` ran out of descriptors, instead of spinning on it.
    accept_timer: Option<OwnedFd>,
    /// [`Self::stop`] ran (the drop does not wait again).
    stopped: bool,
}

impl Drop for LocalTransport {
    fn drop(&mut self) {
        if !self.stopped {
            self.stop(None);
        }
    }
}

impl LocalTransport {
    /// A transport serving on `listener` (none: this connector cannot be reached on this path)
    /// and, when `enabled`, trying it for active operations.
    pub(crate) fn new(enabled: bool, listener: Option<OwnedFd>, reg: Registrar, waker: Waker) -> Self {
        if let Some(l) = &listener {
            if let Err(e) = reg.add(l.as_raw_fd(), LISTENER, true, false) {
                tracing::warn!(error = %e, "cannot watch the same-host socket");
            }
        }
        let accept_timer = listener.as_ref().and_then(|_| {
            let t = timerfd().ok()?;
            reg.add(t.as_raw_fd(), ACCEPT_TIMER, true, false).ok()?;
            Some(t)
        });
        Self {
            enabled,
            listener,
            reg,
            waker,
            uid: uid(),
            conns: HashMap::new(),
            next_conn: 1,
            by_peer: HashMap::new(),
            negative: HashMap::new(),
            scopes: HashMap::new(),
            key_ids: HashMap::new(),
            identities: HashSet::new(),
            acts: HashMap::new(),
            finished: Arc::new(Mutex::new(Vec::new())),
            exports: Arc::new(Mutex::new(Vec::new())),
            outstanding: Arc::new(Outstanding::default()),
            refused_peers: 0,
            accept_timer,
            stopped: false,
        }
    }

    /// Stops every copy and waits (up to `within`; `None`: for as long as it takes) for the ones
    /// running on the pool, which end within a chunk unless their peer stalls its pages. True
    /// when none is left; false when some still run (then the memory they write must never be
    /// freed: the caller leaks it).
    pub(crate) fn stop(&mut self, within: Option<Duration>) -> bool {
        self.stopped = true;
        for a in self.acts.values() {
            a.cancel.store(true, Ordering::Relaxed);
        }
        for s in self.scopes.values() {
            if let Some(w) = &s.writer {
                w.3.store(true, Ordering::Relaxed);
            }
        }
        let n = lock(&self.outstanding.count);
        let n = match within {
            None => self
                .outstanding
                .cv
                .wait_while(n, |n| *n > 0)
                .unwrap_or_else(|p| p.into_inner()),
            Some(d) => {
                self.outstanding
                    .cv
                    .wait_timeout_while(n, d, |n| *n > 0)
                    .unwrap_or_else(|p| p.into_inner())
                    .0
            }
        };
        *n == 0
    }

    /// True when copies have finished that `progress` has not handled yet (checked before the
    /// engine sleeps, so a copy ending at that moment is never left unreaped).
    pub(crate) fn has_finished(&self) -> bool {
        !self.finished.lock().unwrap_or_else(|e| e.into_inner()).is_empty()
            || !self.exports.lock().unwrap_or_else(|e| e.into_inner()).is_empty()
    }

    /// Whether a client-side operation on `i` in its current phase may receive frame `e`.
    fn expects(&self, i: ConnId, slot: u32, gen: u64, e: Expect) -> bool {
        self.acts
            .values()
            .find(|a| a.conn == i && a.slot == slot && a.gen == gen)
            .is_some_and(|a| match (e, &a.phase) {
                (_, Phase::Abandoned) => true,
                (Expect::Grant, Phase::Requested) => !a.spec.write,
                (Expect::Answer, Phase::Requested) => true,
                (Expect::WriteDone, Phase::Requested) => a.spec.write,
                _ => false,
            })
    }

    fn insert(&mut self, c: Conn) -> ConnId {
        // Ids are never reused, so a late copy or answer can never reach another connection.
        let id = self.next_conn;
        self.next_conn += 1;
        let _ = self.reg.add(c.fd.as_raw_fd(), id, true, false);
        self.conns.insert(id, c);
        id
    }

    /// Sends what is buffered on connection `i`; watches for writability if the socket is full.
    #[allow(unsafe_code)]
    fn flush(&mut self, i: ConnId) {
        let Some(c) = self.conns.get_mut(&i) else { return };
        while !c.wbuf.is_empty() && !c.dead {
            // SAFETY: sends bytes from a live buffer on our socket; MSG_NOSIGNAL turns a closed
            // peer into EPIPE instead of SIGPIPE.
            let n = unsafe {
                libc::send(
                    c.fd.as_raw_fd(),
                    c.wbuf.as_ptr().cast(),
                    c.wbuf.len(),
                    libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
                )
            };
            if n > 0 {
                c.wbuf.drain(..n as usize);
            } else {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::WouldBlock {
                    c.dead = true;
                }
                break;
            }
        }
        let want = !c.wbuf.is_empty() && !c.dead;
        if want != c.writing {
            c.writing = want;
            let _ = self.reg.modify(c.fd.as_raw_fd(), i, true, want);
        }
    }

    /// Sends `Hello` with the slot table's descriptor attached.
    #[allow(unsafe_code)]
    fn send_hello(&mut self, i: ConnId, key: &str) -> io::Result<()> {
        let c = self.conns.get_mut(&i).expect("live connection");
        let table = Arc::new(SlotTable::create()?);
        let mut buf = Vec::new();
        // Nothing about this process but the key's hash and a nonce: the server proves it holds
        // the key before anything else is sent.
        Msg::Hello {
            version: VERSION,
            key_id: auth::key_id(key),
            nonce: c.nonce,
        }
        .encode(&mut buf);
        let fd = table.fd().as_raw_fd();
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        // SAFETY: CMSG_SPACE is a pure size computation.
        let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
        let mut cbuf = vec![0u64; space.div_ceil(8)];
        // SAFETY: msghdr is plain old data; the pointers set below outlive the sendmsg call, and
        // the control buffer is large enough for one SCM_RIGHTS descriptor (CMSG_SPACE).
        let n = unsafe {
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_iov = &mut iov;
            msg.msg_iovlen = 1;
            msg.msg_control = cbuf.as_mut_ptr().cast();
            msg.msg_controllen = space as _;
            let cm = libc::CMSG_FIRSTHDR(&msg);
            (*cm).cmsg_level = libc::SOL_SOCKET;
            (*cm).cmsg_type = libc::SCM_RIGHTS;
            (*cm).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
            std::ptr::write_unaligned(libc::CMSG_DATA(cm).cast::<RawFd>(), fd);
            libc::sendmsg(c.fd.as_raw_fd(), &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT)
        };
        if n != buf.len() as isize {
            // A fresh connection's buffer always takes a few dozen bytes; anything else is broken.
            return Err(io::Error::other("the hello did not fit the socket"));
        }
        c.slots = Some(table);
        Ok(())
    }

    /// Reads everything available on connection `i` (collecting passed descriptors).
    #[allow(unsafe_code)]
    fn read(&mut self, i: ConnId) {
        let Some(c) = self.conns.get_mut(&i) else { return };
        let mut chunk = [0u8; 64 << 10];
        // SAFETY: CMSG_SPACE is a pure size computation.
        let space = unsafe { libc::CMSG_SPACE((4 * std::mem::size_of::<RawFd>()) as u32) } as usize;
        let mut cbuf = vec![0u64; space.div_ceil(8)];
        loop {
            let mut iov = libc::iovec {
                iov_base: chunk.as_mut_ptr().cast(),
                iov_len: chunk.len(),
            };
            // SAFETY: msghdr is plain old data; iov and cbuf outlive the call and their lengths
            // are given; received descriptors are taken into OwnedFds right below.
            let (n, msg) = unsafe {
                let mut msg: libc::msghdr = std::mem::zeroed();
                msg.msg_iov = &mut iov;
                msg.msg_iovlen = 1;
                msg.msg_control = cbuf.as_mut_ptr().cast();
                msg.msg_controllen = space as _;
                let n = libc::recvmsg(
                    c.fd.as_raw_fd(),
                    &mut msg,
                    libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC,
                );
                (n, msg)
            };
            if n > 0 {
                // SAFETY: walks the control messages recvmsg filled in, within msg_controllen.
                unsafe {
                    let mut cm = libc::CMSG_FIRSTHDR(&msg);
                    while !cm.is_null() {
                        if (*cm).cmsg_level == libc::SOL_SOCKET && (*cm).cmsg_type == libc::SCM_RIGHTS {
                            let data = libc::CMSG_DATA(cm).cast::<RawFd>();
                            let count = ((*cm).cmsg_len as usize - libc::CMSG_LEN(0) as usize)
                                / std::mem::size_of::<RawFd>();
                            for k in 0..count {
                                let fd = std::ptr::read_unaligned(data.add(k));
                                c.fds_in.push_back(OwnedFd::from_raw_fd(fd));
                            }
                        }
                        cm = libc::CMSG_NXTHDR(&msg, cm);
                    }
                }
                c.rbuf.extend_from_slice(&chunk[..n as usize]);
                if c.rbuf.len() > 2 * proto::MAX_FRAME || c.wbuf.len() > 2 * proto::MAX_FRAME {
                    c.dead = true; // a peer that floods us, or never reads what we send
                    return;
                }
                if c.fds_in.len() > 4 {
                    c.dead = true; // a peer passing descriptors beyond the one slot table
                    return;
                }
                continue;
            }
            if n == 0 || io::Error::last_os_error().kind() != io::ErrorKind::WouldBlock {
                c.dead = true;
            }
            return;
        }
    }

    fn accept(&mut self) {
        let Some(lfd) = self.listener.as_ref().map(AsRawFd::as_raw_fd) else {
            return;
        };
        loop {
            // SAFETY: accept4 on our listening socket; the new descriptor is owned right after.
            #[allow(unsafe_code)]
            let fd = unsafe {
                libc::accept4(
                    lfd,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                )
            };
            if fd < 0 {
                let e = io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::EINTR | libc::ECONNABORTED | libc::EPROTO) => continue,
                    Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM) => {
                        self.pause_accepting(&e);
                    }
                    _ => {}
                }
                return;
            }
            // SAFETY: a fresh descriptor nothing else owns.
            #[allow(unsafe_code)]
            let fd = unsafe { OwnedFd::from_raw_fd(fd) };
            let Ok((pid, peer_uid)) = peer_cred(fd.as_raw_fd()) else {
                continue;
            };
            let served = self.conns.values().filter(|c| !c.client).count();
            let from_pid = self
                .conns
                .values()
                .filter(|c| !c.client && c.peer_pid == pid)
                .count();
            let i = self.insert(Conn::new(fd, false, pid, "".into()));
            if peer_uid == self.uid && (served >= MAX_SERVED || from_pid >= MAX_SERVED_PER_PID) {
                self.refused_peers += 1;
                let c = self.conns.get_mut(&i).expect("just inserted");
                c.send(&Msg::Reject {
                    reason: format!(
                        "this process serves {served} same-host connections ({from_pid} from yours) \
                         already; use NIXL"
                    ),
                });
                self.flush(i);
                self.close(i, &mut Vec::new());
                continue;
            }
            if peer_uid != self.uid {
                self.refused_peers += 1;
                let c = self.conns.get_mut(&i).expect("just inserted");
                c.send(&Msg::Reject {
                    reason: format!(
                        "the serving process runs as uid {}, the peer as uid {peer_uid}: the same-host \
                         path is only for processes of one user",
                        self.uid
                    ),
                });
                self.flush(i);
                self.close(i, &mut Vec::new());
            }
        }
    }

    /// Stops watching the listener for [`ACCEPT_BACKOFF`] (the pending connection stays in the
    /// backlog): an `accept` that fails for want of descriptors would otherwise wake the engine
    /// again at once, for as long as the shortage lasts.
    #[allow(unsafe_code)]
    fn pause_accepting(&mut self, e: &io::Error) {
        let (Some(l), Some(t)) = (&self.listener, &self.accept_timer) else {
            return;
        };
        tracing::warn!(error = %e, "cannot accept same-host peers now; retrying in 100 ms");
        self.reg.remove(l.as_raw_fd());
        let spec = libc::itimerspec {
            it_interval: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: libc::timespec {
                tv_sec: 0,
                tv_nsec: ACCEPT_BACKOFF.as_nanos() as libc::c_long,
            },
        };
        // SAFETY: a valid timerfd we own, and a fully initialised itimerspec.
        unsafe { libc::timerfd_settime(t.as_raw_fd(), 0, &spec, std::ptr::null_mut()) };
    }

    /// The back-off timer fired: watch the listener again and take what waits.
    #[allow(unsafe_code)]
    fn resume_accepting(&mut self) {
        if let Some(t) = &self.accept_timer {
            let mut n = 0u64;
            // SAFETY: reads the 8-byte expiry count of our non-blocking timerfd into `n`.
            unsafe { libc::read(t.as_raw_fd(), (&mut n as *mut u64).cast(), 8) };
        }
        if let Some(l) = &self.listener {
            let _ = self.reg.add(l.as_raw_fd(), LISTENER, true, false);
        }
        self.accept();
    }

    /// Opens (or finds) the connection to `peer`; `Err(reason)` when there is no same-host path.
    fn connect(&mut self, peer: &Arc<str>, key: &Arc<str>) -> std::result::Result<ConnId, String> {
        if let Some(&i) = self.by_peer.get(peer) {
            if self.conns.get(&i).is_some_and(|c| !c.dead) {
                return Ok(i);
            }
        }
        if let Some(t) = self.negative.get(peer) {
            if t.elapsed() < NEGATIVE_TTL {
                return Err("no same-host socket for this peer".into());
            }
        }
        let r = self.try_connect(peer, key);
        if let Err(reason) = &r {
            if self.negative.len() >= MAX_NEGATIVE {
                self.negative.clear();
            }
            self.negative.insert(peer.clone(), Instant::now());
            tracing::trace!(peer = %peer, reason, "no same-host path");
        }
        r
    }

    #[allow(unsafe_code)]
    fn try_connect(&mut self, peer: &Arc<str>, key: &Arc<str>) -> std::result::Result<ConnId, String> {
        let fd = unix_socket().map_err(|e| e.to_string())?;
        let (a, len) = sockaddr(&socket_name(peer));
        // SAFETY: `a` is a valid sockaddr_un of `len` bytes.
        let r = unsafe { libc::connect(fd.as_raw_fd(), (&a as *const libc::sockaddr_un).cast(), len) };
        if r != 0 {
            let e = io::Error::last_os_error();
            return Err(format!("no same-host socket for this peer ({e})"));
        }
        let (pid, peer_uid) = peer_cred(fd.as_raw_fd()).map_err(|e| e.to_string())?;
        if peer_uid != self.uid || pid <= 0 {
            return Err(format!(
                "the peer runs as uid {peer_uid} (this process: {})",
                self.uid
            ));
        }
        let mut conn = Conn::new(fd, true, pid, peer.clone());
        conn.nonce = auth::nonce();
        conn.opening_key = Some(key.clone());
        let i = self.insert(conn);
        if let Err(e) = self.send_hello(i, key) {
            self.close(i, &mut Vec::new());
            return Err(format!("the same-host handshake failed ({e})"));
        }
        self.by_peer.insert(peer.clone(), i);
        Ok(i)
    }

    /// Closes connection `i`, ending what depended on it.
    fn close(&mut self, i: ConnId, out: &mut Vec<Event>) {
        let Some(c) = self.conns.remove(&i) else { return };
        self.reg.remove(c.fd.as_raw_fd());
        // Device mappings opened for this connection are closed (after any copy using them).
        #[cfg(feature = "cuda")]
        ipc::forget(i);
        if c.client {
            if self.by_peer.get(&c.peer) == Some(&i) {
                self.by_peer.remove(&c.peer);
            }
            let ids: Vec<OpId> = self
                .acts
                .iter()
                .filter(|(_, a)| a.conn == i)
                .map(|(id, _)| *id)
                .collect();
            for id in ids {
                let a = self.acts.get(&id).expect("listed");
                match a.phase {
                    // The copy runs on; its end reports the result.
                    Phase::Copying => {}
                    Phase::Queued | Phase::Exporting | Phase::Requested | Phase::Abandoned => {
                        let a = self.acts.remove(&id).expect("listed");
                        if let Some(t) = &c.slots {
                            t.revoke(a.slot, a.gen);
                        }
                        if !matches!(a.phase, Phase::Abandoned) {
                            out.push(Event::ActiveEnded {
                                id,
                                result: Err(Error::RemoteGone {
                                    agent: c.peer.to_string(),
                                    reason: "its connector closed the same-host connection (the \
                                             process exited or dropped the connector)"
                                        .into(),
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
            for s in self.scopes.values_mut() {
                s.grants.retain(|g| {
                    if g.0 == i {
                        if let Some(t) = &c.slots {
                            t.revoke(g.1, g.2);
                        }
                    }
                    g.0 != i
                });
            }
        }
    }

    fn handle(&mut self, i: ConnId, m: Msg, out: &mut Vec<Event>) {
        let client = self.conns.get(&i).is_some_and(|c| c.client);
        match (client, m) {
            (
                false,
                Msg::Hello {
                    version,
                    key_id,
                    nonce,
                },
            ) => self.on_hello(i, version, key_id, nonce),
            (true, Msg::Welcome { proof }) => self.on_welcome(i, proof, out),
            (false, Msg::Trusted) => self.on_trusted(i),
            (true, Msg::Reject { reason }) if self.conns.get(&i).is_some_and(|c| !c.ready) => {
                let c = self.conns.get_mut(&i).expect("live");
                c.dead = true;
                let peer = c.peer.clone();
                self.decline_queued(i, &reason, out);
                self.negative.insert(peer, Instant::now());
            }
            (
                false,
                Msg::Req {
                    slot,
                    gen,
                    write,
                    ident,
                    key_id,
                    mac,
                    device,
                    remote,
                    local,
                    sources,
                },
            ) => {
                if self.identities.contains(&ident) {
                    let Some(key) = self.proven_key(i, slot, gen, write, &key_id, &mac) else {
                        return;
                    };
                    self.on_req(i, slot, gen, write, &key, device, remote, local, sources, out)
                } else if let Some(c) = self.conns.get_mut(&i) {
                    // Metadata of an agent of the same name elsewhere (another host, an earlier
                    // process): not this connector's to refuse; NIXL will sort it out.
                    c.send(&Msg::Fallback {
                        slot,
                        gen,
                        reason: "the metadata names another agent of the same name".into(),
                    });
                }
            }
            (true, Msg::Grant { slot, gen }) if self.expects(i, slot, gen, Expect::Grant) => {
                self.on_grant(i, slot, gen, None, out)
            }
            (true, Msg::GrantIpc { slot, gen, sources }) if self.expects(i, slot, gen, Expect::Grant) => {
                self.on_grant(i, slot, gen, Some(sources), out)
            }
            (
                true,
                Msg::Refuse {
                    slot,
                    gen,
                    code,
                    reason,
                },
            ) if self.expects(i, slot, gen, Expect::Answer) => {
                if let Some((id, a)) = self.take_act(i, slot, gen) {
                    let peer = a.spec.peer.to_string();
                    self.free_slot(i, slot, gen);
                    if !matches!(a.phase, Phase::Abandoned) {
                        out.push(Event::ActiveEnded {
                            id,
                            result: Err(refused(peer, code, reason)),
                        });
                    }
                }
            }
            (true, Msg::Fallback { slot, gen, reason }) if self.expects(i, slot, gen, Expect::Answer) => {
                if let Some((_, a)) = self.take_act(i, slot, gen) {
                    self.free_slot(i, slot, gen);
                    if !matches!(a.phase, Phase::Abandoned) {
                        out.push(Event::Declined { spec: a.spec, reason });
                    }
                }
            }
            (
                true,
                Msg::Done {
                    slot,
                    gen,
                    ok,
                    reason,
                },
            ) if self.expects(i, slot, gen, Expect::WriteDone) => {
                // The passive side finished copying our write.
                if let Some((id, a)) = self.take_act(i, slot, gen) {
                    let peer = a.spec.peer.to_string();
                    self.free_slot(i, slot, gen);
                    if !matches!(a.phase, Phase::Abandoned) {
                        out.push(Event::ActiveEnded {
                            id,
                            result: if ok {
                                Ok(())
                            } else {
                                Err(Error::Transfer { agent: peer, reason })
                            },
                        });
                    }
                }
            }
            (false, Msg::Done { slot, gen, ok, .. }) => self.on_read_done(i, slot, gen, ok, out),
            // Anything else breaks the protocol (a frame out of order, for an operation in another
            // phase, or for none): the connection is closed; copies already running end on their
            // own and nothing of theirs is released before that.
            (_, other) => {
                tracing::debug!(?other, "unexpected same-host frame; closing the connection");
                if let Some(c) = self.conns.get_mut(&i) {
                    c.dead = true;
                }
            }
        }
    }

    fn on_hello(&mut self, i: ConnId, version: u32, key_id: KeyId, nonce: Nonce) {
        let key = self.key_ids.get(&key_id).cloned();
        let c = self.conns.get_mut(&i).expect("live");
        if c.ready || c.slots.is_some() {
            c.dead = true;
            return;
        }
        let table = match c.fds_in.pop_front().map(SlotTable::open) {
            Some(Ok(t)) => t,
            _ => {
                c.dead = true;
                return;
            }
        };
        if version != VERSION {
            c.send(&Msg::Reject {
                reason: format!("protocol version {version}; this side speaks {VERSION}"),
            });
            c.dead = true;
            return;
        }
        c.slots = Some(Arc::new(table));
        c.nonce = nonce;
        c.ready = true;
        // The proof that this process holds the opening operation's key (none if it has no such
        // live operation: the client then refuses that operation as a replay).
        let proof = key.map(|k| auth::welcome_proof(&k, &nonce, c.peer_pid, self_pid()));
        c.send(&Msg::Welcome { proof });
    }

    /// Server side: the client trusted our proof; its requests follow.
    fn on_trusted(&mut self, i: ConnId) {
        let c = self.conns.get_mut(&i).expect("live");
        if !c.ready || c.trusted {
            c.dead = true;
            return;
        }
        c.trusted = true;
        c.can_pull = c.pidfd.as_deref().is_some_and(cma::may_pull);
    }

    /// Server side: the key a request names, if the client proved it holds it. Otherwise the
    /// request is refused (an unknown key id: a replay) or the connection closed (a bad proof).
    fn proven_key(
        &mut self,
        i: ConnId,
        slot: u32,
        gen: u64,
        write: bool,
        key_id: &KeyId,
        mac: &auth::Tag,
    ) -> Option<Arc<str>> {
        let key = self.key_ids.get(key_id).cloned();
        let c = self.conns.get_mut(&i).expect("live");
        if !c.trusted {
            c.dead = true;
            return None;
        }
        let Some(key) = key else {
            c.send(&Msg::Refuse {
                slot,
                gen,
                code: RefuseCode::NotLive,
                reason: NOT_LIVE.into(),
            });
            self.flush(i);
            return None;
        };
        let want = auth::req_mac(&key, &c.nonce, c.peer_pid, self_pid(), slot, gen, write);
        if !auth::same(&want, mac) {
            tracing::warn!(
                pid = c.peer_pid,
                "a same-host request without proof of its key; closing"
            );
            c.dead = true;
            return None;
        }
        Some(key)
    }

    fn on_welcome(&mut self, i: ConnId, proof: Option<auth::Tag>, out: &mut Vec<Event>) {
        let c = self.conns.get_mut(&i).expect("live");
        if c.ready {
            c.dead = true;
            return;
        }
        let key = c.opening_key.take().expect("set by try_connect");
        let Some(proof) = proof else {
            // The server has no live operation with the opening key: refuse that operation as a
            // replay (it must not go on to NIXL and read stale memory). Nothing was revealed; the
            // others queued behind it take NIXL, and the connection is opened afresh next time.
            c.dead = true;
            let peer = c.peer.clone();
            let queued = std::mem::take(&mut c.queued);
            for id in queued {
                let Some(a) = self.acts.remove(&id) else { continue };
                self.free_slot(i, a.slot, a.gen);
                if matches!(a.phase, Phase::Abandoned) {
                    continue;
                }
                if a.spec.key == key {
                    out.push(Event::ActiveEnded {
                        id,
                        result: Err(refused(peer.to_string(), RefuseCode::NotLive, NOT_LIVE.into())),
                    });
                } else {
                    out.push(Event::Declined {
                        spec: a.spec,
                        reason: "the same-host connection closed before its request".into(),
                    });
                }
            }
            return;
        };
        if !auth::same(
            &proof,
            &auth::welcome_proof(&key, &c.nonce, self_pid(), c.peer_pid),
        ) {
            // Not the process that made the operation: another one holds the socket name. It
            // learnt a key hash and a nonce; nothing else is sent, nothing it says is believed.
            tracing::warn!(
                peer = %c.peer,
                pid = c.peer_pid,
                "the process on this peer's same-host socket could not prove it holds the \
                 operation's key (an impostor?); using NIXL"
            );
            c.dead = true;
            let peer = c.peer.clone();
            self.refused_peers += 1;
            self.decline_queued(
                i,
                "the process on the peer's same-host socket could not prove it holds the \
                 operation's key (another process holds the socket name)",
                out,
            );
            if self.negative.len() >= MAX_NEGATIVE {
                self.negative.clear();
            }
            self.negative.insert(peer, Instant::now());
            return;
        }
        c.can_pull = c.pidfd.as_deref().is_some_and(cma::may_pull);
        c.ready = true;
        c.send(&Msg::Trusted);
        let queued = std::mem::take(&mut c.queued);
        for id in queued {
            self.request(id, out);
        }
    }

    fn decline_queued(&mut self, i: ConnId, reason: &str, out: &mut Vec<Event>) {
        let queued = self
            .conns
            .get_mut(&i)
            .map(|c| std::mem::take(&mut c.queued))
            .unwrap_or_default();
        for id in queued {
            if let Some(a) = self.acts.remove(&id) {
                self.free_slot(i, a.slot, a.gen);
                if !matches!(a.phase, Phase::Abandoned) {
                    out.push(Event::Declined {
                        spec: a.spec,
                        reason: reason.to_string(),
                    });
                }
            }
        }
    }

    /// Hands a queued operation to the next transport, freeing its slot.
    fn decline_act(&mut self, id: OpId, reason: &str, out: &mut Vec<Event>) {
        let a = self.acts.remove(&id).expect("present");
        self.free_slot(a.conn, a.slot, a.gen);
        out.push(Event::Declined {
            spec: a.spec,
            reason: reason.into(),
        });
    }

    fn take_act(&mut self, i: ConnId, slot: u32, gen: u64) -> Option<(OpId, Act)> {
        let id = self
            .acts
            .iter()
            .find(|(_, a)| a.conn == i && a.slot == slot && a.gen == gen)
            .map(|(id, _)| *id)?;
        self.acts.remove(&id).map(|a| (id, a))
    }

    fn free_slot(&mut self, i: ConnId, slot: u32, gen: u64) {
        if let Some(c) = self.conns.get_mut(&i) {
            if c.client && c.gens.get(slot as usize) == Some(&gen) {
                if let Some(t) = &c.slots {
                    t.free(slot, gen);
                }
                c.free_slots.push(slot);
            }
        }
    }

    /// Sends the request of a queued operation (the handshake is done); a write from device
    /// memory exports its source first.
    fn request(&mut self, id: OpId, out: &mut Vec<Event>) {
        let Some(a) = self.acts.get_mut(&id) else { return };
        #[cfg(feature = "cuda")]
        if a.spec.write && a.device && a.sources.is_empty() {
            a.phase = Phase::Exporting;
            let ranges = a
                .spec
                .local
                .iter()
                .map(|r| (r.addr as u64, r.len as u64))
                .collect();
            let (exports, waker) = (self.exports.clone(), self.waker.clone());
            ipc::export(
                ranges,
                Box::new(move |result| {
                    exports
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push(ExportDone::Write { id, result });
                    waker.wake_always();
                }),
            );
            return;
        }
        let c = self.conns.get_mut(&a.conn).expect("live");
        if !a.spec.write && !a.device && !c.can_pull {
            self.decline_act(
                id,
                "the kernel does not let this process read the peer's memory (ptrace rules)",
                out,
            );
            return;
        }
        // A request the server could not accept (too many ranges for one frame) takes NIXL,
        // rather than breaking the connection every other operation uses.
        let frame = 64 + 16 * (a.spec.remote.len() + a.spec.local.len()) + 128 * a.sources.len();
        if frame > MAX_FRAME {
            self.decline_act(id, "too many ranges for one same-host request", out);
            return;
        }
        a.phase = Phase::Requested;
        let req = Msg::Req {
            slot: a.slot,
            gen: a.gen,
            write: a.spec.write,
            ident: a.spec.remote_ident,
            key_id: auth::key_id(&a.spec.key),
            mac: auth::req_mac(
                &a.spec.key,
                &c.nonce,
                self_pid(),
                c.peer_pid,
                a.slot,
                a.gen,
                a.spec.write,
            ),
            device: a.spec.remote.first().map_or(Device::Host, |r| r.device),
            remote: a
                .spec
                .remote
                .iter()
                .map(|r| (r.addr as u64, r.len as u64))
                .collect(),
            local: if a.spec.write {
                a.spec
                    .local
                    .iter()
                    .map(|r| (r.addr as u64, r.len as u64))
                    .collect()
            } else {
                Vec::new()
            },
            sources: std::mem::take(&mut a.sources),
        };
        c.send(&req);
        let i = a.conn;
        self.flush(i);
    }

    #[allow(clippy::too_many_arguments)]
    fn on_req(
        &mut self,
        i: ConnId,
        slot: u32,
        gen: u64,
        write: bool,
        key: &str,
        device: Device,
        remote: Vec<(u64, u64)>,
        local: Vec<(u64, u64)>,
        sources: Vec<IpcSource>,
        out: &mut Vec<Event>,
    ) {
        let c = self.conns.get_mut(&i).expect("live");
        if !c.ready {
            c.dead = true;
            return;
        }
        let (can_pull, peer_pid, peer_pidfd) = (c.can_pull, c.peer_pid, c.pidfd.clone());
        let refuse = |code, reason: String| Msg::Refuse {
            slot,
            gen,
            code,
            reason,
        };
        let answer = match self.scopes.get_mut(key) {
            None => Some(refuse(RefuseCode::NotLive, NOT_LIVE.into())),
            Some(s) if (s.kind == OperationKind::Write) != write => Some(refuse(
                RefuseCode::WrongDirection,
                format!(
                    "the operation is a {}able; a {} cannot use it",
                    if s.kind == OperationKind::Write {
                        "writ"
                    } else {
                        "read"
                    },
                    if write { "write" } else { "read" }
                ),
            )),
            Some(s) if device != s.device => Some(Msg::Fallback {
                slot,
                gen,
                reason: format!(
                    "the request names memory on {device}; the operation's is on {}",
                    s.device
                ),
            }),
            Some(s) if s.state.status().is_terminal() => Some(refuse(
                RefuseCode::NotLive,
                "the operation has ended (completed, cancelled or dropped)".into(),
            )),
            Some(s) if remote.is_empty() || !remote.iter().all(|&(a, l)| s.contains(a, l)) => Some(refuse(
                RefuseCode::OutOfRange,
                "a requested range lies outside the operation's descriptors".into(),
            )),
            Some(_)
                if write
                    && (local.len() != remote.len()
                        || local
                            .iter()
                            .zip(&remote)
                            .any(|(l, r)| l.1 != r.1 || l.0.checked_add(l.1).is_none())
                        || (!sources.is_empty()
                            && (sources.len() != remote.len()
                                || sources.iter().zip(&remote).any(|(s, r)| s.len != r.1)))) =>
            {
                Some(refuse(
                    RefuseCode::OutOfRange,
                    "the write's source ranges do not match its destination ranges".into(),
                ))
            }
            // The device path: which side's memory is device memory decides who must have CUDA.
            Some(s)
                if (!write && s.device != Device::Host) || (write && !sources.is_empty()) || {
                    write && s.device != Device::Host
                } =>
            {
                let src = if write {
                    if sources.is_empty() {
                        Device::Host
                    } else {
                        Device::Cuda(0)
                    }
                } else {
                    s.device
                };
                match device_path_refusal(src, if write { s.device } else { Device::Host }) {
                    Some(reason) => Some(Msg::Fallback { slot, gen, reason }),
                    None => self.device_req(i, slot, gen, write, key, remote, sources),
                }
            }
            Some(_) if write && !can_pull => Some(Msg::Fallback {
                slot,
                gen,
                reason: "the kernel does not let the passive side read this process (ptrace rules)".into(),
            }),
            Some(s) if write && s.writer.is_some() => Some(refuse(
                RefuseCode::Busy,
                "another writer is writing this writable now".into(),
            )),
            Some(_) if !write && c.granted >= MAX_GRANTS_PER_CONN => Some(Msg::Fallback {
                slot,
                gen,
                reason: format!("this connection holds {MAX_GRANTS_PER_CONN} same-host read grants already"),
            }),
            Some(s) if !write => {
                if s.grants.insert((i, slot, gen)) {
                    c.granted += 1;
                }
                Some(Msg::Grant { slot, gen })
            }
            // The owner ended it an instant ago (its Unexpose is still queued).
            Some(s) if write && !s.state.try_mark_in_use() => Some(refuse(
                RefuseCode::NotLive,
                "the operation has ended (completed, cancelled or dropped)".into(),
            )),
            Some(s) => {
                // A write: this side copies from the writer into its own memory (marked in use
                // just above).
                let cancel = Arc::new(AtomicBool::new(false));
                s.writer = Some((i, slot, gen, cancel.clone()));
                let state = s.state.clone();
                let table = self.conns.get(&i).and_then(|c| c.slots.clone()).expect("ready");
                let key = self.scopes.get_key_value(key).expect("present").0.clone();
                let copy = AnyCopy::Host(Copy {
                    pid: peer_pid,
                    pieces: remote
                        .iter()
                        .zip(&local)
                        .map(|(&(dst, len), &(src, _))| Piece {
                            local: dst as usize,
                            remote: src as usize,
                            len: len as usize,
                        })
                        .collect(),
                    slot: SlotRef {
                        table,
                        idx: slot,
                        gen,
                    },
                    cancel,
                });
                let owner = CopyOwner::Write {
                    key,
                    conn: i,
                    slot,
                    gen,
                    state,
                    pidfd: peer_pidfd,
                };
                self.start_copy(copy, owner);
                None
            }
        };
        if let Some(m) = answer {
            if let Some(c) = self.conns.get_mut(&i) {
                c.send(&m);
            }
        }
        let _ = out;
    }

    fn on_grant(
        &mut self,
        i: ConnId,
        slot: u32,
        gen: u64,
        sources: Option<Vec<IpcSource>>,
        out: &mut Vec<Event>,
    ) {
        let Some((&id, a)) = self
            .acts
            .iter_mut()
            .find(|(_, a)| a.conn == i && a.slot == slot && a.gen == gen)
        else {
            return;
        };
        // The grant must be of the kind asked for, and an IPC grant must match the ranges.
        let fits = match &sources {
            None => !a.device,
            Some(v) => {
                a.device
                    && v.len() == a.spec.local.len()
                    && v.iter().zip(&a.spec.local).all(|(s, l)| s.len == l.len as u64)
            }
        };
        if !fits && !matches!(a.phase, Phase::Abandoned) {
            tracing::debug!("a same-host grant that does not fit its request; closing the connection");
            if let Some(c) = self.conns.get_mut(&i) {
                c.dead = true;
            }
            return;
        }
        if matches!(a.phase, Phase::Abandoned) {
            let a = self.acts.remove(&id).expect("present");
            if let Some(c) = self.conns.get_mut(&i) {
                c.send(&Msg::Done {
                    slot,
                    gen,
                    ok: false,
                    reason: "cancelled".into(),
                });
            }
            self.free_slot(i, a.slot, a.gen);
            return;
        }
        a.phase = Phase::Copying;
        let c = self.conns.get(&i).expect("live");
        a.pidfd = c.pidfd.clone();
        #[cfg(feature = "cuda")]
        if let Some(sources) = sources {
            let copy = AnyCopy::Device(ipc::Copy {
                conn: i,
                pid: c.peer_pid,
                pieces: a
                    .spec
                    .local
                    .iter()
                    .zip(sources)
                    .map(|(l, src)| ipc::Piece {
                        dst: l.addr as u64,
                        src,
                    })
                    .collect(),
                slot: SlotRef {
                    table: c.slots.clone().expect("ready"),
                    idx: slot,
                    gen,
                },
                cancel: a.cancel.clone(),
            });
            self.start_copy(copy, CopyOwner::Read(id));
            return;
        }
        let _ = sources;
        let copy = AnyCopy::Host(Copy {
            pid: c.peer_pid,
            pieces: a
                .spec
                .local
                .iter()
                .zip(&a.spec.remote)
                .map(|(l, r)| Piece {
                    local: l.addr,
                    remote: r.addr,
                    len: l.len,
                })
                .collect(),
            slot: SlotRef {
                table: c.slots.clone().expect("ready"),
                idx: slot,
                gen,
            },
            cancel: a.cancel.clone(),
        });
        self.start_copy(copy, CopyOwner::Read(id));
        let _ = out;
    }

    fn start_copy(&mut self, copy: AnyCopy, owner: CopyOwner) {
        #[cfg_attr(not(feature = "cuda"), allow(clippy::infallible_destructuring_match))]
        let copy = match copy {
            AnyCopy::Host(c) => c,
            #[cfg(feature = "cuda")]
            AnyCopy::Device(c) => {
                let (done, owner) = self.on_copy_end(owner);
                if let Err(e) = ipc::spawn(c, done) {
                    self.abort_start(&owner, e);
                }
                return;
            }
        };
        let (done, owner) = self.on_copy_end(owner);
        if let Err(e) = cma::spawn(copy, done) {
            self.abort_start(&owner, e);
        }
    }

    /// A copy's completion callback (run on the thread that ends the copy), counted as
    /// outstanding until it runs.
    #[allow(clippy::type_complexity)]
    fn on_copy_end(
        &self,
        owner: CopyOwner,
    ) -> (
        Box<dyn FnOnce(std::result::Result<(), CopyError>) + Send>,
        Arc<Mutex<Option<CopyOwner>>>,
    ) {
        let finished = self.finished.clone();
        let waker = self.waker.clone();
        let outstanding = self.outstanding.clone();
        let owner = Arc::new(Mutex::new(Some(owner)));
        let o2 = owner.clone();
        *outstanding.count.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        let done = Box::new(move |r| {
            if let Some(o) = o2.lock().unwrap_or_else(|e| e.into_inner()).take() {
                finished.lock().unwrap_or_else(|e| e.into_inner()).push((o, r));
            }
            waker.wake_always();
            *outstanding.count.lock().unwrap_or_else(|p| p.into_inner()) -= 1;
            outstanding.cv.notify_all();
        });
        (done, owner)
    }

    /// A copy that never started (its callback will not run): reported as finished with `e`.
    fn abort_start(&mut self, owner: &Arc<Mutex<Option<CopyOwner>>>, e: CopyError) {
        *self.outstanding.count.lock().unwrap_or_else(|p| p.into_inner()) -= 1;
        if let Some(o) = owner.lock().unwrap_or_else(|e| e.into_inner()).take() {
            self.finished
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((o, Err(e)));
        }
    }

    /// The device path of a request that passed every scope check: a read is granted once its
    /// source is exported (the answer comes later); a write is copied here from its export.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    #[allow(clippy::too_many_arguments)]
    fn device_req(
        &mut self,
        i: ConnId,
        slot: u32,
        gen: u64,
        write: bool,
        key: &str,
        remote: Vec<(u64, u64)>,
        sources: Vec<IpcSource>,
    ) -> Option<Msg> {
        #[cfg(not(feature = "cuda"))]
        return Some(Msg::Fallback {
            slot,
            gen,
            reason: "this build has no CUDA support (feature `cuda`)".into(),
        });
        #[cfg(feature = "cuda")]
        {
            let (key, s) = self.scopes.get_key_value(key).expect("checked");
            let key = key.clone();
            if !write {
                let (exports, waker) = (self.exports.clone(), self.waker.clone());
                if self
                    .scopes
                    .get_mut(&key)
                    .expect("checked")
                    .grants
                    .insert((i, slot, gen))
                {
                    if let Some(c) = self.conns.get_mut(&i) {
                        c.granted += 1;
                    }
                }
                ipc::export(
                    remote,
                    Box::new(move |result| {
                        exports
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .push(ExportDone::Grant {
                                key,
                                conn: i,
                                slot,
                                gen,
                                result,
                            });
                        waker.wake_always();
                    }),
                );
                return None;
            }
            if s.writer.is_some() {
                return Some(Msg::Refuse {
                    slot,
                    gen,
                    code: RefuseCode::Busy,
                    reason: "another writer is writing this writable now".into(),
                });
            }
            if !s.state.try_mark_in_use() {
                return Some(Msg::Refuse {
                    slot,
                    gen,
                    code: RefuseCode::NotLive,
                    reason: "the operation has ended (completed, cancelled or dropped)".into(),
                });
            }
            let c = self.conns.get(&i).expect("live");
            let (table, peer_pid, pidfd) = (c.slots.clone().expect("ready"), c.peer_pid, c.pidfd.clone());
            let cancel = Arc::new(AtomicBool::new(false));
            let s = self.scopes.get_mut(&key).expect("checked");
            s.writer = Some((i, slot, gen, cancel.clone()));
            let state = s.state.clone();
            let copy = AnyCopy::Device(ipc::Copy {
                conn: i,
                pid: peer_pid,
                pieces: remote
                    .iter()
                    .zip(sources)
                    .map(|(&(dst, _), src)| ipc::Piece { dst, src })
                    .collect(),
                slot: SlotRef {
                    table,
                    idx: slot,
                    gen,
                },
                cancel,
            });
            let owner = CopyOwner::Write {
                key,
                conn: i,
                slot,
                gen,
                state,
                pidfd,
            };
            self.start_copy(copy, owner);
            None
        }
    }

    /// Handles finished CUDA IPC exports.
    fn reap_exports(&mut self, out: &mut Vec<Event>) -> bool {
        let done = std::mem::take(&mut *self.exports.lock().unwrap_or_else(|e| e.into_inner()));
        let any = !done.is_empty();
        for d in done {
            match d {
                ExportDone::Grant {
                    key,
                    conn,
                    slot,
                    gen,
                    result,
                } => {
                    let granted = self
                        .scopes
                        .get(&key)
                        .is_some_and(|s| s.grants.contains(&(conn, slot, gen)));
                    let answer = match result {
                        Ok(sources) if granted => Msg::GrantIpc { slot, gen, sources },
                        _ if !granted => Msg::Refuse {
                            slot,
                            gen,
                            code: RefuseCode::NotLive,
                            reason: "the operation ended before its memory could be shared".into(),
                        },
                        Ok(_) => unreachable!("granted is checked above"),
                        Err(reason) => {
                            if self
                                .scopes
                                .get_mut(&key)
                                .is_some_and(|s| s.grants.remove(&(conn, slot, gen)))
                            {
                                self.ungrant(conn);
                            }
                            Msg::Fallback {
                                slot,
                                gen,
                                reason: format!(
                                    "the device memory cannot be shared through CUDA IPC: {reason}"
                                ),
                            }
                        }
                    };
                    if let Some(c) = self.conns.get_mut(&conn).filter(|c| !c.dead) {
                        c.send(&answer);
                        self.flush(conn);
                    }
                }
                ExportDone::Write { id, result } => {
                    let Some(a) = self.acts.get_mut(&id) else { continue };
                    match (&a.phase, result) {
                        (Phase::Exporting, Ok(sources)) => {
                            a.sources = sources;
                            a.phase = Phase::Requested;
                            self.request(id, out);
                        }
                        (Phase::Exporting, Err(reason)) => {
                            let a = self.acts.remove(&id).expect("present");
                            self.free_slot(a.conn, a.slot, a.gen);
                            out.push(Event::Declined {
                                spec: a.spec,
                                reason: format!(
                                    "the device memory cannot be shared through CUDA IPC: {reason}"
                                ),
                            });
                        }
                        // Abandoned while exporting: it was answered then; forget it now.
                        (_, _) => {
                            if matches!(a.phase, Phase::Abandoned) {
                                let a = self.acts.remove(&id).expect("present");
                                self.free_slot(a.conn, a.slot, a.gen);
                            }
                        }
                    }
                }
            }
        }
        any
    }

    /// A read grant of connection `i` ended.
    fn ungrant(&mut self, i: ConnId) {
        if let Some(c) = self.conns.get_mut(&i) {
            c.granted = c.granted.saturating_sub(1);
        }
    }

    fn on_read_done(&mut self, i: ConnId, slot: u32, gen: u64, ok: bool, out: &mut Vec<Event>) {
        let key = self
            .scopes
            .iter()
            .find(|(_, s)| s.grants.contains(&(i, slot, gen)))
            .map(|(k, _)| k.clone());
        let Some(key) = key else { return };
        let s = self.scopes.get_mut(&key).expect("found");
        s.grants.remove(&(i, slot, gen));
        self.ungrant(i);
        if ok {
            out.push(Event::PassiveCompleted { key });
        }
    }

    /// Handles finished copies and exports.
    fn reap(&mut self, out: &mut Vec<Event>) -> bool {
        let exported = self.reap_exports(out);
        let done = std::mem::take(&mut *self.finished.lock().unwrap_or_else(|e| e.into_inner()));
        let any = exported || !done.is_empty();
        for (owner, r) in done {
            match owner {
                CopyOwner::Read(id) => {
                    let Some(a) = self.acts.remove(&id) else { continue };
                    let i = a.conn;
                    let live = self.conns.get(&i).is_some_and(|c| !c.dead);
                    if let Err(CopyError::Unsupported(reason)) = &r {
                        // Nothing moved: end the grant and let NIXL take the read.
                        if live {
                            let c = self.conns.get_mut(&i).expect("live");
                            c.send(&Msg::Done {
                                slot: a.slot,
                                gen: a.gen,
                                ok: false,
                                reason: reason.clone(),
                            });
                            self.flush(i);
                        }
                        self.free_slot(i, a.slot, a.gen);
                        if a.cancel.load(Ordering::Relaxed) {
                            out.push(Event::ActiveEnded {
                                id,
                                result: Err(Error::Cancelled),
                            });
                        } else {
                            out.push(Event::Declined {
                                spec: a.spec,
                                reason: format!("the same-host device copy cannot run here: {reason}"),
                            });
                        }
                        continue;
                    }
                    let same = alive(&a.pidfd);
                    let result = match r {
                        Ok(()) if same => Ok(()),
                        Ok(()) | Err(CopyError::PeerGone) => Err(Error::RemoteGone {
                            agent: a.spec.peer.to_string(),
                            reason: "its process exited during the copy".into(),
                        }),
                        Err(CopyError::Revoked | CopyError::NotStarted) => {
                            Err(if a.cancel.load(Ordering::Relaxed) {
                                Error::Cancelled
                            } else {
                                refused(
                                    a.spec.peer.to_string(),
                                    RefuseCode::NotLive,
                                    "the owner ended the operation during the copy".into(),
                                )
                            })
                        }
                        Err(CopyError::Os(e)) => Err(Error::Transfer {
                            agent: a.spec.peer.to_string(),
                            reason: format!("the same-host copy failed: {e}"),
                        }),
                        Err(CopyError::Unsupported(_)) => unreachable!("handled above"),
                    };
                    if live {
                        let c = self.conns.get_mut(&i).expect("live");
                        c.send(&Msg::Done {
                            slot: a.slot,
                            gen: a.gen,
                            ok: result.is_ok(),
                            reason: String::new(),
                        });
                        self.flush(i);
                    }
                    self.free_slot(i, a.slot, a.gen);
                    out.push(Event::ActiveEnded { id, result });
                }
                CopyOwner::Write {
                    key,
                    conn,
                    slot,
                    gen,
                    state,
                    pidfd,
                } => {
                    let same = alive(&pidfd);
                    let ok = r.is_ok() && same;
                    // The copy into this side's memory has ended either way.
                    state.mark_released();
                    if let Err(CopyError::Unsupported(reason)) = &r {
                        // Nothing moved: the writer may take NIXL.
                        if let Some(s) = self.scopes.get_mut(&key) {
                            if s.writer
                                .as_ref()
                                .is_some_and(|w| (w.0, w.1, w.2) == (conn, slot, gen))
                            {
                                s.writer = None;
                            }
                        }
                        if let Some(c) = self.conns.get_mut(&conn).filter(|c| !c.dead) {
                            c.send(&Msg::Fallback {
                                slot,
                                gen,
                                reason: format!("the passive side cannot copy from device memory: {reason}"),
                            });
                            self.flush(conn);
                        }
                        continue;
                    }
                    if let Some(s) = self.scopes.get_mut(&key) {
                        if s.writer
                            .as_ref()
                            .is_some_and(|w| (w.0, w.1, w.2) == (conn, slot, gen))
                        {
                            s.writer = None;
                            match &r {
                                Ok(()) if same => out.push(Event::PassiveCompleted { key: key.clone() }),
                                // The writer cancelled before the copy began: nothing was touched.
                                Err(CopyError::NotStarted) => {}
                                _ => out.push(Event::PassiveFailed {
                                    key: key.clone(),
                                    error: Error::RemoteGone {
                                        agent: "(same-host writer)".into(),
                                        reason: "the writer went away in the middle of writing; the \
                                                 writable's memory is torn"
                                            .into(),
                                    },
                                }),
                            }
                        }
                    }
                    if let Some(c) = self.conns.get_mut(&conn).filter(|c| !c.dead) {
                        c.send(&Msg::Done {
                            slot,
                            gen,
                            ok,
                            reason: match &r {
                                Ok(()) => String::new(),
                                Err(e) => format!("the passive side's copy failed: {e:?}"),
                            },
                        });
                        self.flush(conn);
                    }
                }
            }
        }
        any
    }

    fn release_writer(&mut self, key: &str) {
        if let Some(s) = self.scopes.get(key) {
            if let Some(w) = &s.writer {
                w.3.store(true, Ordering::Relaxed);
            }
        }
    }
}

fn refused(agent: String, code: RefuseCode, reason: String) -> Error {
    Error::Refused {
        agent,
        replay: code == RefuseCode::NotLive,
        reason,
    }
}

impl Transport for LocalTransport {
    fn path(&self) -> TransferPath {
        TransferPath::Local
    }

    fn expose(&mut self, spec: &PassiveSpec, out: &mut Exposure) -> Result<()> {
        if self.listener.is_none() {
            return Ok(());
        }
        self.identities.insert(out.identity);
        let mut ranges = spec.ranges.clone();
        ranges.sort_by_key(|r| r.addr);
        self.key_ids.insert(auth::key_id(&spec.key), spec.key.clone());
        self.scopes.insert(
            spec.key.clone(),
            Scope {
                kind: spec.kind,
                device: spec.ranges.first().map_or(Device::Host, |r| r.device),
                ranges,
                state: spec.state.clone(),
                grants: HashSet::new(),
                writer: None,
            },
        );
        Ok(())
    }

    fn unexpose(&mut self, key: &str) {
        self.release_writer(key);
        let Some(s) = self.scopes.remove(key) else { return };
        self.key_ids.remove(&auth::key_id(key));
        for (i, slot, gen) in s.grants {
            if let Some(t) = self.conns.get(&i).and_then(|c| c.slots.as_ref()) {
                t.revoke(slot, gen);
            }
            self.ungrant(i);
        }
        if s.writer.is_none() {
            s.state.mark_released();
        }
    }

    fn begin(&mut self, spec: ActiveSpec, out: &mut Vec<Event>) {
        if !self.enabled {
            out.push(Event::Declined {
                spec,
                reason: "the same-host path is off for this connector".into(),
            });
            return;
        }
        let (local, remote) = (uniform(&spec.local), uniform(&spec.remote));
        let device = match (local, remote) {
            (Some(Device::Host), Some(Device::Host)) => false,
            (Some(l), Some(r)) => {
                let (src, dst) = if spec.write { (l, r) } else { (r, l) };
                if let Some(reason) = device_path_refusal(src, dst) {
                    out.push(Event::Declined { spec, reason });
                    return;
                }
                true
            }
            _ => {
                out.push(Event::Declined {
                    spec,
                    reason: "the descriptors mix kinds of memory".into(),
                });
                return;
            }
        };
        let i = match self.connect(&spec.peer, &spec.key) {
            Ok(i) => i,
            Err(reason) => {
                out.push(Event::Declined { spec, reason });
                return;
            }
        };
        let c = self.conns.get_mut(&i).expect("connected");
        let Some(slot) = c.free_slots.pop() else {
            out.push(Event::Declined {
                spec,
                reason: "too many operations in flight to this peer on the same-host path".into(),
            });
            return;
        };
        c.gens[slot as usize] += 1;
        let gen = c.gens[slot as usize];
        if let Some(t) = &c.slots {
            t.arm(slot, gen);
        }
        spec.state.set_path(TransferPath::Local);
        let id = spec.id;
        let ready = c.ready;
        if !ready {
            c.queued.push(id);
        }
        self.acts.insert(
            id,
            Act {
                spec,
                conn: i,
                slot,
                gen,
                phase: Phase::Queued,
                cancel: Arc::new(AtomicBool::new(false)),
                pidfd: None,
                device,
                sources: Vec::new(),
            },
        );
        if ready {
            self.request(id, out);
        } else {
            self.flush(i);
        }
    }

    fn abandon(&mut self, id: OpId, _hard: bool, out: &mut Vec<Event>) {
        let Some(a) = self.acts.get_mut(&id) else { return };
        let table = self.conns.get(&a.conn).and_then(|c| c.slots.clone());
        match a.phase {
            Phase::Copying => {
                // Our own copy thread writes our memory: stop it; its end releases the memory.
                a.cancel.store(true, Ordering::Relaxed);
            }
            Phase::Abandoned => {}
            Phase::Queued | Phase::Exporting | Phase::Requested => {
                // Nothing of ours is being written: a write's source is only read by the peer, and
                // revoking its slot makes the peer discard what it read. Release at once.
                if let Some(t) = table {
                    t.revoke(a.slot, a.gen);
                }
                let was_queued = matches!(a.phase, Phase::Queued);
                a.phase = Phase::Abandoned;
                let conn = a.conn;
                if was_queued {
                    if let Some(c) = self.conns.get_mut(&conn) {
                        c.queued.retain(|q| *q != id);
                    }
                    let a = self.acts.remove(&id).expect("present");
                    self.free_slot(conn, a.slot, a.gen);
                }
                out.push(Event::ActiveEnded {
                    id,
                    result: Err(Error::Cancelled),
                });
            }
        }
    }

    fn progress(&mut self, ready: &[(u64, u32)], out: &mut Vec<Event>) -> bool {
        let mut event = self.reap(out);
        for &(token, ev) in ready {
            if token == LISTENER {
                self.accept();
                event = true;
                continue;
            }
            if token == ACCEPT_TIMER {
                self.resume_accepting();
                event = true;
                continue;
            }
            let i: ConnId = token;
            if !self.conns.contains_key(&i) {
                continue;
            }
            event = true;
            if ev & libc::EPOLLOUT as u32 != 0 {
                self.flush(i);
            }
            if ev & libc::EPOLLIN as u32 != 0 || hung_up(ev) {
                self.read(i);
            }
            while let Some(c) = self.conns.get_mut(&i) {
                match Msg::decode(&c.rbuf) {
                    Ok(Some((m, used))) => {
                        c.rbuf.drain(..used);
                        self.handle(i, m, out);
                    }
                    Ok(None) => break,
                    Err(e) => {
                        tracing::debug!(error = e, "malformed same-host frame; closing the connection");
                        c.dead = true;
                        break;
                    }
                }
            }
            self.flush(i);
            if self.conns.get(&i).is_some_and(|c| c.dead) {
                self.close(i, out);
            }
        }
        // Answers queued while handling other connections.
        let pending: Vec<ConnId> = self
            .conns
            .iter()
            .filter(|(_, c)| !c.wbuf.is_empty() && !c.writing)
            .map(|(i, _)| *i)
            .collect();
        for i in pending {
            self.flush(i);
        }
        event |= self.reap(out);
        event
    }

    fn polling(&self) -> Polling {
        Polling::Never
    }
}
