//! Grant slots: atomic words shared by the two ends of a same-host connection, through which the
//! owner of a copy's *source* memory revokes it at any instant, without waiting.
//!
//! Only the side whose memory is written copies (it pulls), so no peer makes this process write
//! memory it does not own. The copier moves `ARMED -> COPYING` before and `COPYING -> DONE` after;
//! if the owner moved the slot to `REVOKED` meanwhile, the bytes are discarded. Neither side waits
//! on the other. A word is `generation << 3 | state` (the connecting side bumps the generation per
//! grant, so a late revocation never touches a new one), in a sealed memfd it creates and passes.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

/// Slots per connection (operations in flight on one connection at once): the slot table's
/// size.
pub(crate) const SLOTS: usize = 4096;

// A slot's states (the low 3 bits of its word).
pub(crate) const FREE: u64 = 0;
pub(crate) const ARMED: u64 = 1;
pub(crate) const COPYING: u64 = 2;
pub(crate) const DONE: u64 = 3;
pub(crate) const REVOKED: u64 = 4;

/// The word of generation `gen` in `state`.
fn word(gen: u64, state: u64) -> u64 {
    gen << 3 | state
}

/// One connection's slot table, mapped in this process.
pub(crate) struct SlotTable {
    /// [`SLOTS`] words mapped shared (unmapped when dropped).
    map: memmap2::MmapRaw,
    fd: OwnedFd,
}

impl SlotTable {
    /// Creates a sealed table (the connecting side).
    pub(crate) fn create() -> io::Result<Self> {
        let size = SLOTS * 8;
        let flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
        // SAFETY: memfd_create with a static NUL-terminated name makes a new descriptor.
        let fd = crate::sys::owned(unsafe { libc::memfd_create(c"nixl-connect-slots".as_ptr(), flags) })?;
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

    /// Maps `fd`, a sealed memfd of the table's size (it cannot shrink, so every word stays
    /// valid while mapped), shared and read-write.
    fn map(fd: OwnedFd) -> io::Result<Self> {
        let map = memmap2::MmapOptions::new().len(SLOTS * 8).map_raw(&fd)?;
        Ok(Self { map, fd })
    }

    /// The memfd, to pass to the peer.
    pub(crate) fn fd(&self) -> &OwnedFd {
        &self.fd
    }

    /// Slot `idx`'s word, if there is one.
    fn at(&self, idx: u32) -> Option<&AtomicU64> {
        ((idx as usize) < SLOTS).then(|| {
            // SAFETY: idx < SLOTS and the (page-aligned) mapping holds SLOTS u64 words, accessed
            // only as atomics, for as long as `self` lives.
            unsafe { &*self.map.as_ptr().cast::<AtomicU64>().add(idx as usize) }
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

#[cfg(test)]
mod tests;
