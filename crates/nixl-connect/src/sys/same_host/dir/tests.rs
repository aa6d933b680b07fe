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
