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
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("nxc-dir-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        // A shared volume is often open to all (Kubernetes' emptyDir is 0777).
        fs::set_permissions(&d, fs::Permissions::from_mode(0o777)).unwrap();
        d
    }

    /// The user's folder is made 0700 inside an open volume; the socket is 0600 and reachable by
    /// path; dropping the listener removes its files.
    #[test]
    fn dir_listener_is_private_and_cleaned_up() {
        let base = scratch("private");
        let l = listen_in(&base, "nxc1-aa").unwrap();
        let dm = fs::metadata(user_dir(&base)).unwrap();
        assert_eq!(dm.mode() & 0o777, 0o700);
        assert_eq!(fs::metadata(l.path()).unwrap().mode() & 0o777, 0o600);
        let c = unix_socket().unwrap();
        connect_path(c.as_raw_fd(), &socket_path(&base, "nxc1-aa")).unwrap();
        // And as a dialling client connects: through the folder, checked.
        let c = unix_socket().unwrap();
        connect_in(c.as_raw_fd(), &base, "nxc1-aa").unwrap();
        let (sock, lock) = (l.path().to_path_buf(), l.path().with_extension("lock"));
        drop(l);
        assert!(!sock.exists() && !lock.exists());
        fs::remove_dir_all(&base).unwrap();
    }

    /// A live process's name cannot be taken; a dead one's files are swept by the next start
    /// (here: a lock file nobody holds and its socket file).
    #[test]
    fn dir_live_names_are_kept_and_dead_ones_swept() {
        let base = scratch("sweep");
        let live = listen_in(&base, "nxc1-live").unwrap();
        let Err(again) = listen_in(&base, "nxc1-live") else {
            panic!("a held name was taken again")
        };
        assert_eq!(again.raw_os_error(), Some(libc::EADDRINUSE));
        let d = user_dir(&base);
        fs::write(d.join("nxc1-dead.lock"), b"").unwrap();
        fs::write(d.join("nxc1-dead.sock"), b"").unwrap();
        let other = listen_in(&base, "nxc1-other").unwrap();
        assert!(!d.join("nxc1-dead.lock").exists() && !d.join("nxc1-dead.sock").exists());
        assert!(live.path().exists(), "the live socket stays");
        drop((live, other));
        fs::remove_dir_all(&base).unwrap();
    }

    /// A user folder that is not this user's private directory is refused, not used (a link to
    /// elsewhere, a folder others can enter).
    #[test]
    fn dir_refuses_a_folder_others_can_enter() {
        let base = scratch("open");
        fs::create_dir(user_dir(&base)).unwrap();
        fs::set_permissions(user_dir(&base), fs::Permissions::from_mode(0o755)).unwrap();
        let Err(e) = listen_in(&base, "nxc1-x") else {
            panic!("an open folder was used")
        };
        assert_eq!(e.kind(), io::ErrorKind::PermissionDenied, "{e}");
        fs::remove_dir(user_dir(&base)).unwrap();
        std::os::unix::fs::symlink("/tmp", user_dir(&base)).unwrap();
        let Err(e) = listen_in(&base, "nxc1-x") else {
            panic!("a link was followed")
        };
        assert_eq!(e.kind(), io::ErrorKind::PermissionDenied, "{e}");
        fs::remove_dir_all(&base).unwrap();
    }

    /// Issue 63, finding 3: a client dials only into this user's own folder, checked as serving
    /// checks it. Another user who made the folder first in a shared directory open to all, a
    /// link in the folder's place, or a link in the socket's place to a socket elsewhere (another
    /// user's, say): each is refused with what was found, and nothing connects.
    #[test]
    fn dir_dial_refuses_a_folder_or_socket_that_is_not_this_users() {
        let base = scratch("dial");
        let elsewhere = scratch("dial-elsewhere");
        let real = listen_in(&elsewhere, "nxc1-bb").unwrap();
        let refused = |what: &str| {
            let c = unix_socket().unwrap();
            let Err(e) = connect_in(c.as_raw_fd(), &base, "nxc1-bb") else {
                panic!("{what}: connected")
            };
            assert_eq!(e.kind(), io::ErrorKind::PermissionDenied, "{what}: {e}");
        };
        // The folder, a link to a folder holding a live socket of that name.
        std::os::unix::fs::symlink(user_dir(&elsewhere), user_dir(&base)).unwrap();
        refused("a link for the folder");
        fs::remove_file(user_dir(&base)).unwrap();
        // The folder, this user's and private, but the socket a link to the live one elsewhere.
        fs::DirBuilder::new().mode(0o700).create(user_dir(&base)).unwrap();
        std::os::unix::fs::symlink(real.path(), socket_path(&base, "nxc1-bb")).unwrap();
        refused("a link for the socket");
        fs::remove_file(socket_path(&base, "nxc1-bb")).unwrap();
        // The folder open to others.
        fs::set_permissions(user_dir(&base), fs::Permissions::from_mode(0o755)).unwrap();
        refused("a folder others can enter");
        fs::set_permissions(user_dir(&base), fs::Permissions::from_mode(0o700)).unwrap();
        // The folder made first by another user (these tests run as root: it plays uid 65534).
        if uid() == 0 {
            std::os::unix::fs::chown(user_dir(&base), Some(65534), Some(65534)).unwrap();
            refused("another user's folder");
        }
        drop(real);
        fs::remove_dir_all(&base).unwrap();
        fs::remove_dir_all(&elsewhere).unwrap();
    }

    /// A path longer than a Unix socket address takes is a typed error with what to do.
    #[test]
    fn dir_too_long_a_path_is_refused() {
        let base = PathBuf::from(format!("/tmp/{}", "d".repeat(120)));
        let Err(e) = path_addr(&base.join("x.sock")) else {
            panic!("a path too long was taken")
        };
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        assert!(e.to_string().contains("shorter socket directory"), "{e}");
    }
}
