//! Locks that outlive a panicking holder: every value this crate guards with a `Mutex` stays
//! consistent between statements, so a lock poisoned by a panic elsewhere is taken over rather
//! than turned into a second panic (on the engine thread, that would abort the process); and the
//! small helpers every layer shares.

use std::sync::{Condvar, LockResult, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

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

/// A value that threads may block on until it satisfies a condition. Changing it makes no system
/// call while nobody waits (`Condvar::notify_all` makes one every time, waiters or not), which
/// matters on paths taken once per operation.
pub(crate) struct Watched<T> {
    inner: Mutex<WatchedInner<T>>,
    cv: Condvar,
}

struct WatchedInner<T> {
    value: T,
    /// Threads blocked in [`Watched::wait_until`].
    waiters: usize,
}

impl<T> Watched<T> {
    /// Starts at `value`.
    pub(crate) const fn new(value: T) -> Self {
        Self {
            inner: Mutex::new(WatchedInner { value, waiters: 0 }),
            cv: Condvar::new(),
        }
    }

    /// Runs `f` on the value under its lock, then wakes the waiters (if any) to look again.
    pub(crate) fn update<R>(&self, f: impl FnOnce(&mut T) -> R) -> R {
        let mut g = lock(&self.inner);
        let r = f(&mut g.value);
        let wake = g.waiters > 0;
        drop(g);
        if wake {
            self.cv.notify_all();
        }
        r
    }

    /// Runs `f` on the value under its lock, waking nobody.
    pub(crate) fn read<R>(&self, f: impl FnOnce(&T) -> R) -> R {
        f(&lock(&self.inner).value)
    }

    /// Blocks until `done` holds of the value or `deadline` passes (none: for as long as it
    /// takes); returns whether it holds.
    pub(crate) fn wait_until(&self, mut done: impl FnMut(&T) -> bool, deadline: Option<Instant>) -> bool {
        let mut g = lock(&self.inner);
        while !done(&g.value) {
            let left = match deadline {
                None => None,
                Some(d) => match d.checked_duration_since(Instant::now()) {
                    Some(left) if !left.is_zero() => Some(left),
                    _ => return false,
                },
            };
            g.waiters += 1;
            g = match left {
                None => self.cv.wait(g).recover(),
                Some(left) => self.cv.wait_timeout(g, left).recover().0,
            };
            g.waiters -= 1;
        }
        true
    }
}

/// FNV-1a (64 bits) of `bytes`: a stable, dependency-free fingerprint (not for untrusted
/// collisions: callers compare what they fingerprint when it matters).
pub(crate) fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Declares a fieldless enum whose variants carry a label (`Variant [= code] => "label"`), with
/// `ALL` (every variant, in order), `as_str` (the label) and `Display` (the label).
macro_rules! label_enum {
    (
        $(#[$m:meta])* $vis:vis enum $name:ident {
            $($(#[$vm:meta])* $v:ident $(= $code:literal)? => $label:literal,)*
        }
    ) => {
        $(#[$m])* $vis enum $name {
            $($(#[$vm])* $v $(= $code)?,)*
        }

        #[allow(dead_code)]
        impl $name {
            /// Every variant, in declaration order.
            pub(crate) const ALL: [$name; [$(stringify!($v)),*].len()] = [$($name::$v),*];

            /// The name logs, reports and metrics' labels print.
            pub(crate) const fn as_str(self) -> &'static str {
                match self {
                    $($name::$v => $label,)*
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}
pub(crate) use label_enum;

#[cfg(test)]
mod tests;
