//! The rendezvous in a directory both sides mount, for processes that share a volume but no
//! network namespace (pods on one node): the same-host socket is a file there.
//!
//! Each user has a folder there (`nixl-connect.<uid>`, checked to be a real 0700 directory of this
//! user: volumes are often open to all). A socket (`<stem>.sock`, 0600, named from its connector's
//! identity) has beside it a `.lock` its process holds (`flock`) for life: a lock nobody holds
//! marks a dead process's files, which the next start removes, and a held one keeps the name.
//! Binding a name proves nothing: the handshake still checks the identity's signature.

use std::fs::{self, File, OpenOptions, TryLockError};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use super::{uid, unix_socket, Tracked};

/// Lock files a sweep looks at, at most (a directory full of other files costs a start nothing
/// more).
const MAX_SWEPT: usize = 4096;

/// This user's folder inside the shared directory `base`.
pub(crate) fn user_dir(base: &Path) -> PathBuf {
    base.join(format!("nixl-connect.{}", uid()))
}

/// The socket of the connector whose identity's stem is `stem`, in the shared directory `base`.
pub(crate) fn socket_path(base: &Path, stem: &str) -> PathBuf {
    user_dir(base).join(format!("{stem}.sock"))
}

/// Makes (or checks) this user's folder in `base` (made too if missing): a real directory (not a
/// link), of this user, mode 0700.
fn own_dir(base: &Path) -> io::Result<PathBuf> {
    // The shared directory itself is usually a mounted volume; made (as `mkdir -p`) if missing.
    fs::create_dir_all(base)?;
    let d = user_dir(base);
    unless(
        fs::DirBuilder::new().mode(0o700).create(&d),
        io::ErrorKind::AlreadyExists,
    )?;
    check_own(
        &d,
        &fs::symlink_metadata(&d)?,
        "remove it and let the connector make it",
    )?;
    Ok(d)
}

/// `r`, with an error of kind `kind` counted as success.
fn unless(r: io::Result<()>, kind: io::ErrorKind) -> io::Result<()> {
    r.or_else(|e| if e.kind() == kind { Ok(()) } else { Err(e) })
}

/// A listening socket bound in a shared directory, and the lock that says its process lives.
/// Dropping it removes both files.
pub(crate) struct DirListener {
    sock: Tracked,
    sock_path: PathBuf,
    lock_path: PathBuf,
    /// Held locked for the listener's life.
    _lock: File,
}

impl DirListener {
    /// The listening socket.
    pub(crate) fn fd(&self) -> RawFd {
        self.sock.as_raw_fd()
    }

    /// Where it is bound.
    pub(crate) fn path(&self) -> &Path {
        &self.sock_path
    }
}

impl Drop for DirListener {
    fn drop(&mut self) {
        // Still ours: the lock is held until the fields drop, after this.
        let _ = fs::remove_file(&self.sock_path);
        let _ = fs::remove_file(&self.lock_path);
    }
}

/// Binds and listens on the socket named `stem` in this user's folder of `base` (made 0700 if
/// missing), after removing what dead processes left there. `EADDRINUSE` when a live process
/// holds `stem`.
pub(crate) fn listen_in(base: &Path, stem: &str) -> io::Result<DirListener> {
    let d = own_dir(base)?;
    sweep(&d);
    let lock_path = d.join(format!("{stem}.lock"));
    let sock_path = d.join(format!("{stem}.sock"));
    let lock = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&lock_path)?;
    match lock.try_lock() {
        Ok(()) => {}
        Err(TryLockError::WouldBlock) => return Err(io::Error::from_raw_os_error(libc::EADDRINUSE)),
        Err(TryLockError::Error(e)) => return Err(e),
    }
    // A socket file of this name is a dead process's (its lock was free): ours now.
    unless(fs::remove_file(&sock_path), io::ErrorKind::NotFound)?;
    let fd = unix_socket()?;
    super::bind_to(fd.as_raw_fd(), &path_addr(&sock_path)?)?;
    let listener = DirListener {
        sock: Tracked::new(fd),
        sock_path,
        lock_path,
        _lock: lock,
    };
    // The folder (0700) already keeps others out; the socket itself says so too.
    fs::set_permissions(&listener.sock_path, fs::Permissions::from_mode(0o600))?;
    super::listen_on(listener.fd(), super::BACKLOG)?;
    Ok(listener)
}

/// Removes the sockets of dead processes from `d`: each whose lock file nobody holds (taken here
/// while its files go, so that no process can take the name meanwhile).
fn sweep(d: &Path) {
    let Ok(entries) = fs::read_dir(d) else { return };
    for e in entries.flatten().take(MAX_SWEPT) {
        let path = e.path();
        if path.extension().and_then(|x| x.to_str()) != Some("lock") {
            continue;
        }
        let Ok(lock) = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
            .open(&path)
        else {
            continue;
        };
        // Taken here (an exclusive `flock`, released when its last descriptor closes, so when
        // its process dies) only where nobody holds it.
        if lock.try_lock().is_ok() {
            tracing::debug!(path = %path.display(), "removing a same-host socket its process left behind");
            let _ = fs::remove_file(path.with_extension("sock"));
            let _ = fs::remove_file(&path);
        }
    }
}

/// The address of the filesystem socket at `p` (not abstract); `InvalidInput` when the path does
/// not fit `sockaddr_un`.
fn path_addr(p: &Path) -> io::Result<(libc::sockaddr_un, libc::socklen_t)> {
    // SAFETY: sockaddr_un is plain old data; all-zero is a valid value.
    let mut a: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    a.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = p.as_os_str().as_bytes();
    if bytes.len() >= a.sun_path.len() || bytes.contains(&0) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "the socket path {} is longer than the {} bytes a Unix socket takes: use a shorter socket directory",
                p.display(),
                a.sun_path.len() - 1
            ),
        ));
    }
    for (i, b) in bytes.iter().enumerate() {
        a.sun_path[i] = *b as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + bytes.len() + 1;
    Ok((a, len as libc::socklen_t))
}

/// Checks that `m` (of this user's folder, not followed if a link) is what [`own_dir`] makes: a
/// directory of this user, mode 0700. `what_to_do` ends the error.
fn check_own(d: &Path, m: &fs::Metadata, what_to_do: &str) -> io::Result<()> {
    if m.file_type().is_dir() && m.uid() == uid() && m.mode() & 0o077 == 0 {
        return Ok(());
    }
    Err(io::Error::new(
        io::ErrorKind::PermissionDenied,
        format!(
            "{} must be a directory of uid {} with mode 0700 (it is {}a directory, uid {}, mode {:o}): {what_to_do}",
            d.display(),
            uid(),
            if m.is_dir() { "" } else { "not " },
            m.uid(),
            m.mode() & 0o7777
        ),
    ))
}

/// Connects the socket `fd` to the socket named `stem` in this user's folder of `base`, checked
/// as serving checks it and with nothing swapped between check and connect: the folder and then
/// the socket in it are opened without following links (`O_PATH | O_NOFOLLOW`), must be this
/// user's (the folder 0700), and the connection goes to that very file (`/proc/self/fd/N`).
/// `PermissionDenied` says what was found; without `/proc`, `NotFound` says it is needed.
pub(crate) fn connect_in(fd: RawFd, base: &Path, stem: &str) -> io::Result<()> {
    let proc_fd = Path::new("/proc/self/fd");
    if !proc_fd.is_dir() {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            "connecting through the socket directory needs /proc mounted (it connects to the \
             socket it checked, through /proc/self/fd)",
        ));
    }
    let opened = |p: &Path| {
        OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(p)
    };
    let d = user_dir(base);
    let folder = opened(&d)?;
    check_own(
        &d,
        &folder.metadata()?,
        "this user's peers serving there cannot be reached; another user may have made it first",
    )?;
    // A link in the socket's place opens as the link itself (`O_PATH | O_NOFOLLOW`): refused below.
    let sock = opened(
        &proc_fd
            .join(folder.as_raw_fd().to_string())
            .join(format!("{stem}.sock")),
    )?;
    let m = sock.metadata()?;
    if !m.file_type().is_socket() || m.uid() != uid() {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "{} is not a socket of uid {} (a link, or another user's file): not a connector's",
                socket_path(base, stem).display(),
                uid()
            ),
        ));
    }
    connect_path(fd, &proc_fd.join(sock.as_raw_fd().to_string()))
}

/// Connects the socket `fd` to the filesystem socket at `p`.
pub(crate) fn connect_path(fd: RawFd, p: &Path) -> io::Result<()> {
    super::connect_to(fd, &path_addr(p)?)
}

#[cfg(test)]
mod tests;
