//! Whether a library is loaded in this process ([`LoadWatch`]), asked without touching the disk.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Whether a library is loaded in this process, asked for every raw descriptor.
///
/// It walks the loaded objects in memory (`dl_iterate_phdr`): `dlopen(RTLD_NOLOAD)` searches the
/// disk when the library is not loaded. Seen loaded, it stays so (never unloaded); "not loaded"
/// is kept with the loader's count of objects added (`dlpi_adds`), and while that is unchanged
/// the walk stops at the first object.
pub(crate) struct LoadWatch {
    /// The start of the library's file name.
    prefix: &'static [u8],
    loaded: AtomicBool,
    /// The loader's count of objects added when a whole walk last found no such library (MAX:
    /// never walked).
    absent_at: AtomicU64,
}

/// What one walk of the loaded objects learns.
struct Walk<'w> {
    watch: &'w LoadWatch,
    first_seen: bool,
    adds: Option<u64>,
    unchanged: bool,
}

impl LoadWatch {
    /// A watch for the library whose file name starts with `prefix`.
    pub(crate) const fn new(prefix: &'static [u8]) -> Self {
        Self {
            prefix,
            loaded: AtomicBool::new(false),
            absent_at: AtomicU64::new(u64::MAX),
        }
    }

    /// True when the library is loaded in this process.
    pub(crate) fn loaded(&self) -> bool {
        if self.loaded.load(Ordering::Relaxed) {
            return true;
        }
        let mut walk = Walk {
            watch: self,
            first_seen: false,
            adds: None,
            unchanged: false,
        };
        // SAFETY: dl_iterate_phdr calls `visit` once per loaded object, with the loader's lock
        // held; `visit` reads what it is given and writes only `walk`, which outlives the call.
        let stopped =
            unsafe { libc::dl_iterate_phdr(Some(Self::visit), std::ptr::addr_of_mut!(walk).cast()) } != 0;
        let found = stopped && !walk.unchanged;
        if found {
            self.loaded.store(true, Ordering::Relaxed);
        } else if let (false, Some(adds)) = (walk.unchanged, walk.adds) {
            self.absent_at.store(adds, Ordering::Relaxed);
        }
        found
    }

    unsafe extern "C" fn visit(
        info: *mut libc::dl_phdr_info,
        size: libc::size_t,
        data: *mut libc::c_void,
    ) -> libc::c_int {
        // SAFETY: `data` is the `Walk` that `loaded` passes, alive and not otherwise borrowed
        // during the walk.
        let walk = unsafe { &mut *data.cast::<Walk<'_>>() };
        if !walk.first_seen {
            walk.first_seen = true;
            // The count is there when the loader's structure reaches it (glibc >= 2.4).
            if size >= std::mem::offset_of!(libc::dl_phdr_info, dlpi_adds) + 8 {
                // SAFETY: the loader passes a valid dl_phdr_info of `size` bytes.
                let adds = unsafe { (*info).dlpi_adds };
                walk.adds = Some(adds);
                if walk.watch.absent_at.load(Ordering::Relaxed) == adds {
                    // Nothing was loaded since a whole walk found no such library.
                    walk.unchanged = true;
                    return 1;
                }
            }
        }
        // SAFETY: the loader passes a valid dl_phdr_info whose dlpi_name is null or a
        // NUL-terminated path, valid for the duration of this call.
        let name = unsafe { (*info).dlpi_name };
        if name.is_null() {
            return 0;
        }
        // SAFETY: as above.
        let path = unsafe { std::ffi::CStr::from_ptr(name) }.to_bytes();
        let file = path.rsplit(|&b| b == b'/').next().unwrap_or(path);
        i32::from(file.starts_with(walk.watch.prefix))
    }
}

#[cfg(test)]
mod tests;
