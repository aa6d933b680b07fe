//! Locks that outlive a panicking holder: every value this crate guards with a `Mutex` stays
//! consistent between statements, so a lock poisoned by a panic elsewhere is taken over rather
//! than turned into a second panic (on the engine thread, that would abort the process).

use std::sync::{LockResult, Mutex, MutexGuard, PoisonError};

/// Takes over what a poisoned lock (or a wait on a condition variable) still holds.
pub(crate) trait Recover<T> {
    /// The guard (or the wait's result), poisoned or not.
    fn recover(self) -> T;
}

impl<T> Recover<T> for LockResult<T> {
    fn recover(self) -> T {
        self.unwrap_or_else(PoisonError::into_inner)
    }
}

/// Locks `m`, taking over a lock poisoned by a panicking holder.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().recover()
}

/// FNV-1a (64 bits) of `bytes`: a stable, dependency-free fingerprint (not for untrusted
/// collisions: callers compare what they fingerprint when it matters).
pub(crate) fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sync_fnv1a_matches_the_reference_vectors() {
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a(b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn sync_lock_takes_over_a_poisoned_mutex() {
        let m = std::sync::Arc::new(Mutex::new(1));
        let m2 = m.clone();
        let _ = std::thread::spawn(move || {
            let _g = m2.lock().unwrap();
            panic!("poison it");
        })
        .join();
        assert!(m.is_poisoned());
        *lock(&m) += 1;
        assert_eq!(*lock(&m), 2);
    }
}
