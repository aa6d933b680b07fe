//! Grant slots: a small table of atomic words shared by the two ends of one same-host connection,
//! through which the owner of the *source* memory of a copy revokes it at any instant.
//!
//! The side whose memory is written always copies (it pulls with `process_vm_readv`), so each
//! process writes only its own memory. The other side's memory is only read, and its owner may end
//! the operation at any time without waiting: it moves the slot to `REVOKED` and frees. The copier
//! moves `ARMED -> COPYING` before copying and `COPYING -> DONE` after; if the second move fails,
//! the source was revoked during the copy and the bytes are discarded. Neither side ever waits on
//! the other, so a stopped or dead peer cannot stall a drop, and no peer can make this process
//! write memory it does not own.
//!
//! A word is `generation << 3 | state`; the connecting side allocates slots and bumps the
//! generation each time, so a late revocation of an old grant never touches a new one. The table
//! lives in a sealed memfd (it cannot shrink under the other process), created by the connecting
//! side and passed over the socket.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

/// Slots per connection (operations in flight on one connection at once): the slot table's
/// size.
pub(crate) const SLOTS: usize = 4096;

pub(crate) const FREE: u64 = 0;
pub(crate) const ARMED: u64 = 1;
pub(crate) const COPYING: u64 = 2;
pub(crate) const DONE: u64 = 3;
pub(crate) const REVOKED: u64 = 4;

fn word(gen: u64, state: u64) -> u64 {
    gen << 3 | state
}

/// One connection's slot table, mapped in this process.
pub(crate) struct SlotTable {
    base: *const AtomicU64,
    len: usize,
    fd: OwnedFd,
}

// SAFETY: the table is a fixed shared mapping of atomics; every access goes through AtomicU64.
unsafe impl Send for SlotTable {}
// SAFETY: as above.
unsafe impl Sync for SlotTable {}

impl SlotTable {
    /// Creates a sealed table (the connecting side).
    pub(crate) fn create() -> io::Result<Self> {
        let size = SLOTS * 8;
        // SAFETY: memfd_create with a static NUL-terminated name; the fd is owned right after.
        let fd = unsafe {
            libc::memfd_create(
                c"nixl-connect-slots".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd was just created and is owned by nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: plain fcntl/ftruncate calls on our own descriptor.
        unsafe {
            if libc::ftruncate(fd.as_raw_fd(), size as libc::off_t) != 0
                || libc::fcntl(
                    fd.as_raw_fd(),
                    libc::F_ADD_SEALS,
                    libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL,
                ) != 0
            {
                return Err(io::Error::last_os_error());
            }
        }
        Self::map(fd)
    }

    /// Checks that `fd` is a table: a sealed memfd (asked first: `F_GET_SEALS` touches no other
    /// kind of file, so a FUSE file or a socket is refused without a call that could block)
    /// that cannot shrink, of the table's size.
    pub(crate) fn check(fd: &OwnedFd) -> io::Result<()> {
        let bad = || {
            io::Error::new(
                io::ErrorKind::InvalidData,
                "the peer's slot table has the wrong size or is not sealed",
            )
        };
        // SAFETY: fcntl only inspects the descriptor.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            return Err(bad());
        }
        // SAFETY: fstat of a memfd (checked above) fills a zeroed stat.
        let size = unsafe {
            let mut st: libc::stat = std::mem::zeroed();
            if libc::fstat(fd.as_raw_fd(), &mut st) != 0 {
                return Err(io::Error::last_os_error());
            }
            st.st_size as usize
        };
        if size != SLOTS * 8 {
            return Err(bad());
        }
        Ok(())
    }

    /// Maps a table received from a peer, after [`Self::check`].
    pub(crate) fn open(fd: OwnedFd) -> io::Result<Self> {
        Self::check(&fd)?;
        Self::map(fd)
    }

    fn map(fd: OwnedFd) -> io::Result<Self> {
        let len = SLOTS * 8;
        // SAFETY: a shared mapping of a sealed memfd of exactly `len` bytes; it cannot shrink, so
        // every access within it stays valid while the mapping lives (until Drop).
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Self {
            base: p.cast(),
            len,
            fd,
        })
    }

    pub(crate) fn fd(&self) -> &OwnedFd {
        &self.fd
    }

    fn at(&self, idx: u32) -> Option<&AtomicU64> {
        ((idx as usize) < SLOTS).then(|| {
            // SAFETY: idx < SLOTS and the mapping holds SLOTS aligned u64 words.
            unsafe { &*self.base.add(idx as usize) }
        })
    }

    /// Arms slot `idx` for a new grant of generation `gen` (connecting side only).
    pub(crate) fn arm(&self, idx: u32, gen: u64) {
        if let Some(a) = self.at(idx) {
            a.store(word(gen, ARMED), Ordering::SeqCst);
        }
    }

    /// Frees slot `idx` (connecting side only, once both ends are done with it).
    pub(crate) fn free(&self, idx: u32, gen: u64) {
        if let Some(a) = self.at(idx) {
            a.store(word(gen, FREE), Ordering::SeqCst);
        }
    }

    /// Moves `from -> to` for generation `gen`; false if the slot is elsewhere (revoked, reused).
    pub(crate) fn advance(&self, idx: u32, gen: u64, from: u64, to: u64) -> bool {
        self.at(idx).is_some_and(|a| {
            a.compare_exchange(word(gen, from), word(gen, to), Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
        })
    }

    /// Revokes generation `gen` of slot `idx` unless its copy already finished. Returns the state
    /// it found (`DONE`: the copy completed before the revocation).
    pub(crate) fn revoke(&self, idx: u32, gen: u64) -> u64 {
        let Some(a) = self.at(idx) else { return FREE };
        let mut cur = a.load(Ordering::SeqCst);
        loop {
            if cur >> 3 != gen {
                return FREE;
            }
            let st = cur & 7;
            if st != ARMED && st != COPYING {
                return st;
            }
            match a.compare_exchange(cur, word(gen, REVOKED), Ordering::SeqCst, Ordering::SeqCst) {
                Ok(_) => return st,
                Err(now) => cur = now,
            }
        }
    }
}

impl Drop for SlotTable {
    fn drop(&mut self) {
        // SAFETY: base/len are exactly the mapping made in `map`; no reference outlives self.
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
