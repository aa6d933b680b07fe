//! The same-host wing's part of the floor: every syscall and `unsafe` block the wing
//! (`engine/same_host/`, `forbid(unsafe_code)`) needs. This file: abstract Unix sockets,
//! descriptors passed over them, peer credentials, pidfds, timers, the descriptor limit, and what
//! each closer does; the submodules say what they hold.

pub(crate) mod closer;
pub(crate) mod cma;
pub(crate) mod dir;
#[cfg(feature = "cuda")]
pub(crate) mod ipc;
#[cfg(feature = "cuda")]
pub(crate) mod ipc_error;
pub(crate) mod mem;
pub(crate) mod pipe;
pub(crate) mod slots;
#[cfg(feature = "cuda")]
pub(crate) mod staged;
#[cfg(feature = "cuda")]
pub(crate) mod vmm;

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use std::sync::Arc;

use super::{cvt, cvt_len, owned};
use crate::sync::fnv1a;

/// Sends `buf` on the socket `fd` with the descriptors `pass` attached (`SCM_RIGHTS`, at most
/// [`MAX_PASSED`]), without blocking and without `SIGPIPE`: the bytes sent (the descriptors went
/// with them when any byte did).
pub(crate) fn send_with_fds(fd: RawFd, buf: &[u8], pass: &[RawFd]) -> io::Result<usize> {
    if pass.is_empty() || pass.len() > MAX_PASSED || buf.is_empty() {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    }
    let mut iov = libc::iovec {
        iov_base: buf.as_ptr() as *mut libc::c_void,
        iov_len: buf.len(),
    };
    let bytes = std::mem::size_of_val(pass) as u32;
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(bytes) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    // SAFETY: msghdr is plain old data; the pointers set below outlive the sendmsg call (the
    // kernel only reads through iov_base), and the control buffer is large enough for
    // `pass.len()` SCM_RIGHTS descriptors (CMSG_SPACE).
    let n = unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        let cm = libc::CMSG_FIRSTHDR(&msg);
        (*cm).cmsg_level = libc::SOL_SOCKET;
        (*cm).cmsg_type = libc::SCM_RIGHTS;
        (*cm).cmsg_len = libc::CMSG_LEN(bytes) as _;
        for (k, &p) in pass.iter().enumerate() {
            std::ptr::write_unaligned(libc::CMSG_DATA(cm).cast::<RawFd>().add(k), p);
        }
        libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT)
    };
    cvt_len(n)
}

/// Sends `buf` on the socket `fd` without blocking and without `SIGPIPE` (a closed peer is
/// `EPIPE`): the bytes sent.
pub(crate) fn send(fd: RawFd, buf: &[u8]) -> io::Result<usize> {
    let flags = libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT;
    // SAFETY: sends bytes from a live buffer of `buf.len()` bytes on a socket we hold.
    cvt_len(unsafe { libc::send(fd, buf.as_ptr().cast(), buf.len(), flags) })
}

/// Connects the socket `fd` to the abstract socket `name`.
pub(crate) fn connect(fd: RawFd, name: &[u8]) -> io::Result<()> {
    connect_to(fd, &sockaddr(name))
}

/// `connect` of socket `fd` to the address `a` of `len` bytes.
fn connect_to(fd: RawFd, (a, len): &(libc::sockaddr_un, libc::socklen_t)) -> io::Result<()> {
    // SAFETY: `a` is a valid sockaddr_un of `len` bytes.
    cvt(unsafe { libc::connect(fd, (a as *const libc::sockaddr_un).cast(), *len) }).map(drop)
}

/// `bind` of socket `fd` to the address `a` of `len` bytes.
fn bind_to(fd: RawFd, (a, len): &(libc::sockaddr_un, libc::socklen_t)) -> io::Result<()> {
    // SAFETY: `a` is a valid sockaddr_un of `len` bytes.
    cvt(unsafe { libc::bind(fd, (a as *const libc::sockaddr_un).cast(), *len) }).map(drop)
}

/// `listen` on our own bound socket `fd` with `backlog` (again: changes only the backlog).
fn listen_on(fd: RawFd, backlog: libc::c_int) -> io::Result<()> {
    // SAFETY: listen takes no memory; the kernel validates the descriptor.
    cvt(unsafe { libc::listen(fd, backlog) }).map(drop)
}

/// `SO_PEERPIDFD` (Linux 6.5): a pidfd of the process at the other end of a Unix socket (the one
/// `SO_PEERCRED` names), from any PID namespace.
const SO_PEERPIDFD: libc::c_int = 77;
/// `PID_FS_MAGIC`: the file system of pidfds on kernels with pidfs (Linux 6.9).
const PID_FS_MAGIC: i64 = 0x5049_4446;

/// True when processes are named by their pidfs inode numbers: one number per process on the
/// host, never reused while the kernel runs, the same from every PID namespace (Linux 6.9's pidfs).
/// Both ends of a same-host connection run on one kernel, so they agree on it.
pub(crate) fn pidfs() -> bool {
    static PIDFS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PIDFS.get_or_init(|| {
        let Some(fd) = pidfd(std::process::id() as libc::pid_t) else {
            return false;
        };
        // SAFETY: statfs is plain old data; fstatfs writes it for a descriptor we own.
        let mut st: libc::statfs = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let r = unsafe { libc::fstatfs(fd.as_raw_fd(), &mut st) };
        r == 0 && st.f_type as i64 == PID_FS_MAGIC
    })
}

/// The inode number of the process behind `pidfd` (its pidfs id).
fn inode(pidfd: &OwnedFd) -> Option<u64> {
    // SAFETY: stat is plain old data; fstat writes it for a descriptor we own (a pidfd: no file
    // system a peer controls).
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    (unsafe { libc::fstat(pidfd.as_raw_fd(), &mut st) } == 0).then_some(st.st_ino)
}

/// The id that names this process in a connection's proofs (see `auth`): its pidfs inode number
/// where the kernel has pidfs ([`pidfs`]), else its pid. Found once per process (a child of
/// `fork()` finds its own: the cache is keyed by pid); `None` only if the kernel has pidfs and
/// this process's pidfd cannot be had (no descriptor left): the connection is then not made.
pub(crate) fn self_id() -> Option<u64> {
    // The id, then the pid it is for (written in that order, read in the other).
    static CACHED: AtomicU64 = AtomicU64::new(0);
    static CACHED_PID: AtomicU64 = AtomicU64::new(0);
    let pid = std::process::id();
    if !pidfs() {
        return Some(u64::from(pid));
    }
    if CACHED_PID.load(Ordering::Acquire) == u64::from(pid) {
        return Some(CACHED.load(Ordering::Acquire));
    }
    let id = pidfd(pid as libc::pid_t).as_ref().and_then(inode)?;
    CACHED.store(id, Ordering::Release);
    CACHED_PID.store(u64::from(pid), Ordering::Release);
    Some(id)
}

/// The process at the other end of the Unix socket `sock`, whose pid from here is `pid` (0: not
/// visible, another PID namespace): its id (as [`self_id`] names it) and a pidfd of it, taken
/// from the socket (`SO_PEERPIDFD`) where the kernel can, else from the pid. `None` when it is
/// gone, or cannot be named from here (not visible, and no pidfs).
pub(crate) fn peer_process(sock: RawFd, pid: libc::pid_t) -> Option<(u64, OwnedFd)> {
    let pidfd = match get_option(sock, SO_PEERPIDFD, -1) {
        // SAFETY: a fresh descriptor nothing else owns.
        Ok(fd) if fd >= 0 => unsafe { OwnedFd::from_raw_fd(fd) },
        // A kernel without SO_PEERPIDFD. Any other failure means the process is gone: its pid
        // may name another process by now.
        Err(e) if pid > 0 && matches!(e.raw_os_error(), Some(libc::ENOPROTOOPT | libc::EINVAL)) => {
            pidfd(pid)?
        }
        _ => return None,
    };
    if pidfs() {
        Some((inode(&pidfd)?, pidfd))
    } else if pid > 0 {
        Some((pid as u64, pidfd))
    } else {
        None
    }
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
        let h = fnv1a(agent.as_bytes());
        n.extend_from_slice(format!("#{h:016x}").as_bytes());
    }
    n
}

/// The address of the abstract socket `name` (cut to what `sockaddr_un` holds).
pub(crate) fn sockaddr(name: &[u8]) -> (libc::sockaddr_un, libc::socklen_t) {
    // SAFETY: sockaddr_un is plain old data; all-zero is a valid value.
    let mut a: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    a.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (i, b) in name.iter().take(a.sun_path.len() - 1).enumerate() {
        a.sun_path[i + 1] = *b as libc::c_char; // sun_path[0] = 0: the abstract namespace
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + 1 + name.len().min(a.sun_path.len() - 1);
    (a, len as libc::socklen_t)
}

/// A new same-host socket (non-blocking, closed-on-exec), reading out-of-band bytes inline
/// ([`oob_inline`]).
pub(crate) fn unix_socket() -> io::Result<OwnedFd> {
    let kind = libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC;
    // SAFETY: a plain syscall creating a new descriptor.
    let fd = owned(unsafe { libc::socket(libc::AF_UNIX, kind, 0) })?;
    oob_inline(fd.as_raw_fd())?;
    Ok(fd)
}

/// Makes connection `fd` read out-of-band bytes inline (`SO_OOBINLINE`), before any `recvmsg`, so
/// descriptors passed with a `MSG_OOB` byte arrive as any others (to the closers). Otherwise
/// `recvmsg` skips that byte and the kernel releases its descriptors on the reading thread, which
/// could then wait on a pipe whose lock the peer holds.
fn oob_inline(fd: RawFd) -> io::Result<()> {
    set_option(fd, libc::SO_OOBINLINE, 1)
}

/// Sets the `SOL_SOCKET` option `option` of socket `fd` to `value` (plain old data: a `c_int`,
/// a `linger`).
fn set_option<T>(fd: RawFd, option: libc::c_int, value: T) -> io::Result<()> {
    let len = std::mem::size_of::<T>() as libc::socklen_t;
    let p = (&value as *const T).cast();
    // SAFETY: setsockopt reads `len` bytes, one `T`, from a live local.
    cvt(unsafe { libc::setsockopt(fd, libc::SOL_SOCKET, option, p, len) }).map(drop)
}

/// The `SOL_SOCKET` option `option` of socket `fd`, read into `value` (plain old data: a
/// `c_int`, a `ucred`), which keeps what it held where the kernel writes less.
fn get_option<T>(fd: RawFd, option: libc::c_int, mut value: T) -> io::Result<T> {
    let mut len = std::mem::size_of::<T>() as libc::socklen_t;
    let p = (&mut value as *mut T).cast();
    // SAFETY: getsockopt writes at most `len` bytes, one `T`, into a live local.
    cvt(unsafe { libc::getsockopt(fd, libc::SOL_SOCKET, option, p, &mut len) })?;
    Ok(value)
}

/// Connections a listener holds for `accept`.
pub(crate) const BACKLOG: libc::c_int = 128;

/// Sets how many connections listener `fd` holds for `accept` (0 while accepting rests: a client
/// then finds it busy at once, instead of waiting out its handshake's deadline in the queue).
pub(crate) fn set_backlog(fd: RawFd, backlog: libc::c_int) {
    let _ = listen_on(fd, backlog);
}

/// A connection of our own that fills listener `fd`'s queue while accepting rests with a backlog
/// of 0 ([`set_backlog`]), so a client's `connect` finds it busy at once (it takes NIXL). `None`
/// when the queue is full already (or the socket cannot be named).
pub(crate) fn plug(fd: RawFd) -> Option<OwnedFd> {
    // SAFETY: a zeroed sockaddr_un is valid; getsockname writes at most `len` bytes into it.
    let mut a: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
    // SAFETY: as above, on our own listening socket.
    if unsafe { libc::getsockname(fd, (&mut a as *mut libc::sockaddr_un).cast(), &mut len) } != 0 {
        return None;
    }
    let s = unix_socket().ok()?;
    connect_to(s.as_raw_fd(), &(a, len)).ok().map(|()| s)
}

/// Binds and listens on the socket for `agent`; `Ok(None)` when another connector has it.
pub(crate) fn listen(agent: &str) -> io::Result<Option<Tracked>> {
    let fd = unix_socket()?;
    match bind_to(fd.as_raw_fd(), &sockaddr(&socket_name(agent))) {
        Err(e) if e.raw_os_error() == Some(libc::EADDRINUSE) => return Ok(None),
        r => r?,
    }
    listen_on(fd.as_raw_fd(), BACKLOG)?;
    Ok(Some(Tracked::new(fd)))
}

/// The peer's pid and uid (`SO_PEERCRED`), as the kernel recorded them at connect time.
pub(crate) fn peer_cred(fd: RawFd) -> io::Result<(libc::pid_t, libc::uid_t)> {
    // SAFETY: ucred is plain old data; all-zero is a valid value.
    let c: libc::ucred = get_option(fd, libc::SO_PEERCRED, unsafe { std::mem::zeroed() })?;
    Ok((c.pid, c.uid))
}

/// A pidfd for `pid`, so a copy can tell afterwards that its peer is still the same process.
pub(crate) fn pidfd(pid: libc::pid_t) -> Option<OwnedFd> {
    // SAFETY: pidfd_open returns a new descriptor or -1.
    owned(unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) } as RawFd).ok()
}

/// True while the process behind `pidfd` (if any) lives.
pub(crate) fn alive(pidfd: &Option<Arc<OwnedFd>>) -> bool {
    pidfd.as_deref().is_none_or(alive_fd)
}

/// True while the process behind `fd` lives: its pidfd is not readable yet (it becomes readable
/// when the process exits). Unlike a signal, this answers for a process in any PID namespace.
pub(crate) fn alive_fd(fd: &OwnedFd) -> bool {
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: poll reads and writes one live local pollfd, without waiting.
    unsafe { libc::poll(&mut p, 1, 0) == 0 }
}

/// This process's real uid.
pub(crate) fn uid() -> libc::uid_t {
    // SAFETY: getuid cannot fail.
    unsafe { libc::getuid() }
}

/// `SO_PASSRIGHTS` (Linux 6.16): whether a socket accepts descriptors passed to it.
const SO_PASSRIGHTS: libc::c_int = 83;

/// Whether descriptors passed to `fd` reach it: false only where the kernel refuses them
/// (`SO_PASSRIGHTS` off, Linux 6.16); older kernels always deliver them.
pub(crate) fn passes_rights(fd: RawFd) -> bool {
    !matches!(get_option(fd, SO_PASSRIGHTS, 1), Ok(0))
}

/// Makes the kernel refuse descriptors passed to `fd` from now on (the sender's `sendmsg` fails),
/// where the kernel knows `SO_PASSRIGHTS`; older kernels deliver them and the connection core
/// refuses them instead (they are closed off the engine thread, [`close_elsewhere`]).
pub(crate) fn refuse_passed_descriptors(fd: RawFd) {
    let _ = set_option(fd, SO_PASSRIGHTS, 0);
}

/// True when process `pid` (as seen from here; 0: not visible) lives in this process's PID
/// namespace (their `/proc/<pid>/ns/pid` are one inode). A peer whose namespace cannot be read
/// counts as in another: that only makes device memory move as VMM descriptors, which work in
/// either case (memory that cannot be exported so takes NIXL).
pub(crate) fn same_pid_namespace(pid: libc::pid_t) -> bool {
    use std::os::unix::fs::MetadataExt;
    if pid <= 0 {
        return false;
    }
    static MINE: std::sync::OnceLock<Option<(u64, u64)>> = std::sync::OnceLock::new();
    let mine = *MINE.get_or_init(|| {
        std::fs::metadata("/proc/self/ns/pid")
            .ok()
            .map(|m| (m.dev(), m.ino()))
    });
    let theirs = std::fs::metadata(format!("/proc/{pid}/ns/pid"))
        .ok()
        .map(|m| (m.dev(), m.ino()));
    mine.is_some() && mine == theirs
}

/// Makes the kernel deliver descriptors passed to `fd` again (a connection that takes pipes'
/// read ends; see [`refuse_passed_descriptors`]).
pub(crate) fn accept_passed_descriptors(fd: RawFd) {
    // ENOPROTOOPT before Linux 6.16, where every socket takes them anyway.
    let _ = set_option(fd, SO_PASSRIGHTS, 1);
}

/// Closes a descriptor a peer passed us on [`Closer::Passed`], which first [`defuse`]s a socket.
/// Nothing here touches the descriptor (even an `fstat` may wait on a peer's FUSE daemon); a
/// close that blocks holds only that pool, never one of our sockets.
pub(crate) fn close_elsewhere(fd: OwnedFd) {
    to_closer(Closer::Passed, fd, false);
}

/// Makes closing `fd` return at once if it is a socket (`SO_LINGER` {on, 0}: a reset instead of
/// a wait for a reader that never reads). On anything else `setsockopt` fails with `ENOTSOCK`
/// without touching the file.
fn defuse(fd: RawFd) {
    let _ = set_option(
        fd,
        libc::SO_LINGER,
        libc::linger {
            l_onoff: 1,
            l_linger: 0,
        },
    );
}

/// The most descriptors one `recvmsg` takes (the kernel's own limit per message, `SCM_MAX_FD`):
/// none is ever truncated for want of room here.
pub(crate) const MAX_PASSED: usize = 253;

/// A control buffer for [`recv_with_fds`]: room for [`MAX_PASSED`] descriptors.
pub(crate) struct Control(Vec<u64>);

impl Control {
    pub(crate) fn new() -> Self {
        // SAFETY: CMSG_SPACE is a pure size computation.
        let space = unsafe { libc::CMSG_SPACE((MAX_PASSED * std::mem::size_of::<RawFd>()) as u32) } as usize;
        Self(vec![0u64; space.div_ceil(8)])
    }
}

/// One non-blocking `recvmsg` on `fd` into `buf`: the bytes read (0 at the end of the stream),
/// whether descriptors were cut off (`MSG_CTRUNC`), and the descriptors passed with them, each
/// owned (closed-on-exec) and appended to `fds`.
pub(crate) fn recv_with_fds(
    fd: RawFd,
    buf: &mut [u8],
    control: &mut Control,
    fds: &mut Vec<OwnedFd>,
) -> io::Result<(usize, bool)> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: msghdr is plain old data; iov and the control buffer outlive the call and their
    // lengths are given.
    let (n, msg) = unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.0.as_mut_ptr().cast();
        msg.msg_controllen = (control.0.len() * 8) as _;
        let n = libc::recvmsg(fd, &mut msg, libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC);
        (n, msg)
    };
    let n = cvt_len(n)?;
    // SAFETY: walks the control messages recvmsg filled in, within msg_controllen; each
    // descriptor is new in this process and owned once.
    unsafe {
        let mut cm = libc::CMSG_FIRSTHDR(&msg);
        while !cm.is_null() {
            if (*cm).cmsg_level == libc::SOL_SOCKET && (*cm).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cm).cast::<RawFd>();
                let count =
                    ((*cm).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / std::mem::size_of::<RawFd>();
                for k in 0..count {
                    fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(k))));
                }
            }
            cm = libc::CMSG_NXTHDR(&msg, cm);
        }
    }
    Ok((n, msg.msg_flags & libc::MSG_CTRUNC != 0))
}

/// Accepts a pending connection on listener `fd`, non-blocking and closed-on-exec, reading
/// out-of-band bytes inline ([`oob_inline`]; set before anything is read, it takes effect for
/// what the peer queued before the accept too).
pub(crate) fn accept(fd: RawFd) -> io::Result<OwnedFd> {
    let flags = libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC;
    // SAFETY: accept4 on a socket of ours, asking no address; the new descriptor is owned here.
    let c = owned(unsafe { libc::accept4(fd, std::ptr::null_mut(), std::ptr::null_mut(), flags) })?;
    if let Err(e) = oob_inline(c.as_raw_fd()) {
        // What the peer queued is released where the socket closes: not here.
        close_refused(c);
        return Err(e);
    }
    Ok(c)
}

/// Takes the descriptors peers left queued on our socket `fd` to the closer of passed descriptors
/// (closing `fd` would release them here, which can block). A listener's pending connections are
/// drained first (at most twice its backlog).
fn drain_passed(fd: RawFd) {
    for _ in 0..256 {
        // EINVAL at once if `fd` is no listener.
        let Ok(c) = accept(fd) else { break };
        drain_connection(c.as_raw_fd());
    }
    drain_connection(fd);
}

/// Shuts connection `fd` down both ways (its peer can queue nothing more) and takes what was
/// queued on it, to its end. Nothing is taken while [`closer::backlogged`]: what is left is
/// released with the socket, on this closer thread. One drain runs at a time, so past the bound at
/// most one message's descriptors more come in.
fn drain_connection(fd: RawFd) {
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    // SAFETY: shutdown of our own socket (ENOTCONN, harmless, for anything but a connection).
    unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
    let mut chunk = [0u8; 4096];
    let mut control = Control::new();
    let mut fds = Vec::new();
    let _one = ONE_AT_A_TIME.lock();
    while !closer::backlogged() {
        let r = recv_with_fds(fd, &mut chunk, &mut control, &mut fds);
        fds.drain(..).for_each(close_elsewhere);
        if !matches!(r, Ok((n, _)) if n > 0) {
            return;
        }
    }
}

/// The three kinds of close, each with a pool of its own ([`closer`]), off the engine and copy
/// threads: a close can block (a pipe's lock the other end holds, a lingering socket, a FUSE
/// flush).
#[derive(Clone, Copy)]
enum Closer {
    /// Our own same-host sockets (listeners, connections): drained of passed descriptors first.
    Own,
    /// Descriptors peers passed us: whatever they are, they wait only for each other.
    Passed,
    /// Pipe ends, ours and peers' (checked to be pipes): closing one takes the pipe's lock, which
    /// a peer holding the other end can hold; they wait only for each other.
    Pipes,
}

/// Hands `fd` to `closer`'s pool, which untracks it first if `tracked` (so a child of `fork()`
/// is told to replace it for as long as it is open here).
fn to_closer(kind: Closer, fd: OwnedFd, tracked: bool) {
    let (which, name) = match kind {
        Closer::Own => (0, "nixl-connect-closer"),
        Closer::Passed => (1, "nixl-connect-closer-passed"),
        Closer::Pipes => (2, "nixl-connect-closer-pipes"),
    };
    closer::hand(
        which,
        name,
        Box::new(move || {
            match kind {
                Closer::Own => drain_passed(fd.as_raw_fd()),
                Closer::Passed => defuse(fd.as_raw_fd()),
                Closer::Pipes => {}
            }
            if tracked {
                untrack(fd.as_raw_fd());
            }
            drop(fd);
        }),
    );
}

/// Closes a pipe end (ours, or a peer's checked to be a pipe's) on [`Closer::Pipes`].
pub(crate) fn close_pipe_end(fd: OwnedFd) {
    to_closer(Closer::Pipes, fd, false);
}

/// Closes `fd`, a socket of ours never tracked (an accepted connection refused at once), on
/// [`Closer::Own`], which drains it first.
pub(crate) fn close_refused(fd: OwnedFd) {
    to_closer(Closer::Own, fd, false);
}

/// Raises this process's soft limit on open descriptors to its hard limit, once: the caps on
/// same-host connections ([`descriptor_budget`]) stay far below it, so a flood of connections
/// cannot fill the table (the kernel would close passed descriptors on the engine thread).
pub(crate) fn raise_descriptor_limit() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if let Some(mut r) = nofile().filter(|r| r.rlim_cur < r.rlim_max) {
            let old = r.rlim_cur;
            r.rlim_cur = r.rlim_max.min(1 << 20);
            // SAFETY: setrlimit reads one rlimit from a live local.
            if r.rlim_cur > old && unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &r) } == 0 {
                tracing::debug!(
                    from = old,
                    to = r.rlim_cur,
                    "raised the soft limit on open descriptors"
                );
            }
        }
        // As the caps on served connections: an eighth of the limit may wait to be closed.
        closer::set_bound(descriptor_budget() / 8);
    });
}

/// The soft limit on open descriptors now (1,024 if it cannot be read).
pub(crate) fn descriptor_budget() -> usize {
    nofile().map_or(1024, |r| r.rlim_cur.min(1 << 20) as usize)
}

/// This process's limits on open descriptors (`RLIMIT_NOFILE`), if they can be read.
fn nofile() -> Option<libc::rlimit> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into a live local.
    (unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } == 0).then_some(r)
}

/// A same-host socket (listener or connection) that a child of `fork()` must not keep serving:
/// there every tracked descriptor becomes `/dev/null` before the child runs on. Dropped, it is
/// drained and closed on [`Closer::Own`] (closing releases what the peer queued, which can block).
pub(crate) struct Tracked(Option<OwnedFd>);

const TRACKED: usize = 8192;
static TRACKED_FDS: [AtomicI32; TRACKED] = [const { AtomicI32::new(-1) }; TRACKED];
static PLACEHOLDER: AtomicI32 = AtomicI32::new(-1);

/// Runs in a child of `fork()` before anything else there (async-signal-safe calls only).
extern "C" fn in_child() {
    let null = PLACEHOLDER.load(Ordering::Relaxed);
    if null < 0 {
        return;
    }
    for slot in &TRACKED_FDS {
        let fd = slot.load(Ordering::Relaxed);
        if fd >= 0 {
            // SAFETY: dup2 is async-signal-safe; it atomically replaces our reference to the
            // parent's socket with /dev/null, keeping the number taken (the leaked owner in the
            // child never closes a number that something else now uses).
            unsafe { libc::dup2(null, fd) };
        }
    }
}

impl Tracked {
    /// Tracks `fd` (untracked when dropped, before it is closed).
    pub(crate) fn new(fd: OwnedFd) -> Self {
        static INIT: std::sync::Once = std::sync::Once::new();
        INIT.call_once(|| {
            // SAFETY: opens /dev/null (a static C string) and registers a handler that only
            // calls dup2.
            unsafe {
                let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC);
                PLACEHOLDER.store(null, Ordering::Relaxed);
                libc::pthread_atfork(None, None, Some(in_child));
            }
        });
        let raw = fd.as_raw_fd();
        let tracked = TRACKED_FDS.iter().any(|s| {
            s.compare_exchange(-1, raw, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        });
        if !tracked {
            tracing::debug!("more than {TRACKED} same-host sockets: a child of fork() keeps this one");
        }
        Self(Some(fd))
    }
}

impl AsRawFd for Tracked {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_ref().map_or(-1, AsRawFd::as_raw_fd)
    }
}

/// Stops telling children of `fork()` to replace `raw` (just before it is closed).
fn untrack(raw: RawFd) {
    if let Some(s) = TRACKED_FDS.iter().find(|s| s.load(Ordering::Relaxed) == raw) {
        let _ = s.compare_exchange(raw, -1, Ordering::AcqRel, Ordering::Relaxed);
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        if let Some(fd) = self.0.take() {
            to_closer(Closer::Own, fd, true);
        }
    }
}

/// The character devices' major number NVIDIA's driver registers (`/dev/nvidiactl` is 195:255).
const NVIDIA_MAJOR: u32 = 195;

/// True when `fd` is a descriptor of an NVIDIA character device (what an export is), found with
/// `statx(AT_STATX_DONT_SYNC)`: no filesystem is asked (a FUSE server could answer slowly), and a
/// file can only present itself as such a device by being one.
pub(crate) fn is_cuda_export(fd: &OwnedFd) -> bool {
    // SAFETY: statx of an open descriptor (empty path, AT_EMPTY_PATH) into a zeroed local.
    let mut st: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: as above; the path is a valid empty C string, `st` is writable.
    let r = unsafe {
        libc::statx(
            fd.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH | libc::AT_STATX_DONT_SYNC,
            libc::STATX_TYPE,
            &mut st,
        )
    };
    r == 0 && u32::from(st.stx_mode) & libc::S_IFMT == libc::S_IFCHR && st.stx_rdev_major == NVIDIA_MAJOR
}

#[cfg(test)]
mod tests;
