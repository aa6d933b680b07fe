use super::*;
use std::os::fd::FromRawFd;

#[test]
fn slots_revocation_beats_or_follows_the_copy() {
    let a = SlotTable::create().unwrap();
    let dup = a.fd().try_clone().unwrap();
    let b = SlotTable::open(dup).unwrap();
    a.arm(7, 1);
    assert!(b.advance(7, 1, ARMED, COPYING));
    assert_eq!(a.revoke(7, 1), COPYING, "revoked mid-copy");
    assert!(!b.advance(7, 1, COPYING, DONE), "the copier sees the revocation");
    a.free(7, 1);
    a.arm(7, 2);
    assert_eq!(
        b.revoke(7, 1),
        FREE,
        "an old generation never touches a new grant"
    );
    assert!(b.advance(7, 2, ARMED, COPYING) && b.advance(7, 2, COPYING, DONE));
    assert_eq!(a.revoke(7, 2), DONE, "a finished copy cannot be revoked");
    assert!(
        !b.advance(SLOTS as u32, 1, ARMED, COPYING),
        "out of range is refused"
    );
}

#[test]
fn slots_refuse_an_unsealed_table() {
    // SAFETY: a test-only memfd, owned right after it is made, then sized.
    let fd = unsafe {
        let fd = OwnedFd::from_raw_fd(libc::memfd_create(c"x".as_ptr(), libc::MFD_CLOEXEC));
        libc::ftruncate(fd.as_raw_fd(), (SLOTS * 8) as libc::off_t);
        fd
    };
    assert!(SlotTable::open(fd).is_err());
}
