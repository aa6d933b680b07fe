//! [`HostBuffer`]: page-aligned host memory, on transparent huge pages when large (NIXL moves
//! those faster), that keeps its NIXL registrations for as long as it lives.

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex};

use memmap2::{Advice, MmapMut};

use crate::reg::{RegSet, RegToken};
use crate::sync::Recover;

const PAGE: usize = 4096;
/// Transparent huge page size on x86-64.
pub const HUGE_PAGE: usize = 2 << 20;

/// Page-aligned, zero-initialised host memory, advised onto huge pages when at least 2 MiB.
///
/// Dereferences to `[u8]`. Dropping it deregisters it from every connector that registered it,
/// then unmaps it; memory that a connector exposed to peers (a readable or writable over NIXL) is
/// instead kept mapped, as it was, until each such connector has destroyed the agent that exposed
/// it (at most its `quarantine_limit`), so that no peer holding old metadata can make this process
/// fault, nor a read still in flight complete with zeros.
///
/// ```
/// use nixl_connect::HostBuffer;
/// let mut b = HostBuffer::new(1 << 20).unwrap();
/// b[..4].copy_from_slice(b"abcd");
/// assert_eq!(&b[..4], b"abcd");
/// assert_eq!(b.as_ptr() as usize % 4096, 0);
/// ```
pub struct HostBuffer {
    /// The anonymous mapping (`None` only once dropped): the buffer is `offset..offset + len` of
    /// it, aligned to a huge page where the mapping's slack allowed.
    map: Option<MmapMut>,
    offset: usize,
    len: usize,
    huge: bool,
    regs: Mutex<RegSet>,
}

impl HostBuffer {
    /// Keeps `tok` (a registration of this buffer's memory) as long as the buffer lives.
    pub(crate) fn keep_registration(&self, tok: RegToken) {
        self.regs.lock().recover().insert(tok);
    }

    /// Maps `len` zeroed bytes (at least one page); 2 MiB-aligned and `MADV_HUGEPAGE` when
    /// `len >= 2 MiB`.
    ///
    /// # Errors
    /// [`Error::Os`](crate::Error::Os) naming the mapping when it fails (out of memory, limits),
    /// with the OS error as its source.
    pub fn new(len: usize) -> crate::Result<Self> {
        let huge = len >= HUGE_PAGE;
        let align = if huge { HUGE_PAGE } else { PAGE };
        let rounded = len.max(1).div_ceil(align) * align;
        let map_len = rounded + if huge { HUGE_PAGE } else { 0 };
        let map = MmapMut::map_anon(map_len)
            .map_err(|e| crate::Error::os(format!("mapping {map_len} bytes for a HostBuffer of {len}"), e))?;
        let offset = (align - (map.as_ptr() as usize % align)) % align;
        if huge {
            // Only how the kernel backs the pages: a refusal leaves 4 KiB pages.
            let _ = map.advise_range(Advice::HugePage, offset, rounded);
        }
        Ok(Self {
            map: Some(map),
            offset,
            len,
            huge,
            regs: Mutex::new(RegSet::default()),
        })
    }

    /// A buffer holding a copy of `data`.
    ///
    /// # Errors
    /// As [`HostBuffer::new`].
    pub fn from_slice(data: &[u8]) -> crate::Result<Self> {
        let mut b = Self::new(data.len())?;
        b.copy_from_slice(data);
        Ok(b)
    }

    /// The length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the length is zero.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// True when the buffer was advised onto transparent huge pages.
    pub fn is_huge(&self) -> bool {
        self.huge
    }
}

impl Deref for HostBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        let map = self.map.as_ref().expect("mapped until dropped");
        &map[self.offset..self.offset + self.len]
    }
}

impl DerefMut for HostBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        let (offset, len) = (self.offset, self.len);
        let map = self.map.as_mut().expect("mapped until dropped");
        &mut map[offset..offset + len]
    }
}

impl std::fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBuffer")
            .field("ptr", &self.as_ptr())
            .field("len", &self.len)
            .field("huge", &self.huge)
            .finish()
    }
}

/// The mapping of a dropped [`HostBuffer`] that connectors exposed, kept mapped until the last
/// engine that exposed it has destroyed the agent that did (it is unmapped with the last `Arc`).
struct Quarantined {
    _map: MmapMut,
}

// Its registrations were dropped with the buffer's (see `HostBuffer`'s drop).
impl crate::reg::Held for Arc<Quarantined> {}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        let regs = std::mem::take(self.regs.get_mut().recover());
        let map = self.map.take().expect("dropped once");
        if regs.iter().any(RegToken::exposed) {
            // UCX checks no registration when a peer reaches exposed memory over TCP, CMA or
            // shared memory, so each engine that exposed it holds the mapping whole (see the
            // type's doc) until it has destroyed the agent that exposed it.
            let len = map.len();
            let q = Arc::new(Quarantined { _map: map });
            for t in regs.iter().filter(|t| t.exposed()) {
                t.quarantine(Box::new(q.clone()), len);
            }
            // If no engine took it (all gone, so no peer can reach it), this unmaps it.
            drop(q);
        } else {
            drop(map);
        }
        // Deregistrations queue after the quarantine on each engine, ahead of any registration
        // of a later buffer.
        drop(regs);
    }
}

#[cfg(test)]
mod tests;
