//! The operating system under the same-host path: abstract Unix sockets, peer credentials,
//! pidfds, and the poisoned-lock helper.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;

use crate::sync::fnv1a;

/// This process's pid, as the kernel reports it to peers (`SO_PEERCRED`).
pub(super) fn self_pid() -> libc::pid_t {
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
        let h = fnv1a(agent.as_bytes());
        n.extend_from_slice(format!("#{h:016x}").as_bytes());
    }
    n
}

#[allow(unsafe_code)]
pub(super) fn sockaddr(name: &[u8]) -> (libc::sockaddr_un, libc::socklen_t) {
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
pub(super) fn timerfd() -> io::Result<OwnedFd> {
    // SAFETY: creates a new descriptor, owned right after.
    let fd = unsafe { libc::timerfd_create(libc::CLOCK_MONOTONIC, libc::TFD_NONBLOCK | libc::TFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

#[allow(unsafe_code)]
pub(super) fn unix_socket() -> io::Result<OwnedFd> {
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
pub(super) fn peer_cred(fd: RawFd) -> io::Result<(libc::pid_t, libc::uid_t)> {
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
pub(super) fn pidfd(pid: libc::pid_t) -> Option<OwnedFd> {
    // SAFETY: pidfd_open returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    // SAFETY: a fresh descriptor nothing else owns.
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

#[allow(unsafe_code)]
pub(super) fn alive(pidfd: &Option<Arc<OwnedFd>>) -> bool {
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
pub(super) fn uid() -> libc::uid_t {
    // SAFETY: getuid cannot fail.
    unsafe { libc::getuid() }
}
