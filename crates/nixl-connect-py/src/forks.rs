//! Which process image this is, and Rust state that belongs to the image that made it: a child of
//! `fork()` has none of its parent's threads (the engines, the timers), so it must neither use
//! nor drop its parent's state.

use std::sync::atomic::{AtomicU64, Ordering};

use pyo3::prelude::*;

use crate::errors::{CoreError, FORKED};

/// Which process image this is: 0 in the process that loaded the module, one more in each child
/// of `fork()` (a `pthread_atfork` handler counts them). Reading it is a load, where asking the
/// kernel for the pid is a system call (about 0.2 us here, and an operation asked ~19 times).
pub(crate) static FORKS: AtomicU64 = AtomicU64::new(0);

extern "C" fn forked() {
    FORKS.fetch_add(1, Ordering::Relaxed);
}

/// Counts the children of `fork()` from now on (once; at module load).
pub(crate) fn watch_forks() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: registers a child handler that only increments an atomic counter
        // (async-signal-safe); the handler is a plain `extern "C"` function of this library,
        // which Python never unloads.
        #[allow(unsafe_code)]
        unsafe {
            libc::pthread_atfork(None, None, Some(forked));
        }
    });
}

/// Rust state tied to the process that made it. After `fork()` the child has none of the parent's
/// threads (the engine, the timers), so it must neither use such state (it would wait forever) nor
/// drop it (dropping may wait for those threads): it gets `Forked` errors, and the state is leaked.
pub(crate) struct Owned<T> {
    /// [`FORKS`] when it was made.
    image: u64,
    inner: Option<T>,
}

impl<T> Owned<T> {
    pub(crate) fn new(t: T) -> Self {
        Self {
            image: FORKS.load(Ordering::Relaxed),
            inner: Some(t),
        }
    }

    fn here(&self) -> bool {
        FORKS.load(Ordering::Relaxed) == self.image
    }

    pub(crate) fn get(&self) -> PyResult<&T> {
        match &self.inner {
            Some(t) if self.here() => Ok(t),
            _ => Err(CoreError::new_err((
                FORKED.0,
                "this object was created in a parent of this process before it forked; objects \
                 of the parent cannot be used in a child: create a new Connector (and operations) \
                 in this process"
                    .to_string(),
                FORKED.1,
            ))),
        }
    }
}

impl<T> Drop for Owned<T> {
    fn drop(&mut self) {
        if !self.here() {
            std::mem::forget(self.inner.take());
        }
    }
}
