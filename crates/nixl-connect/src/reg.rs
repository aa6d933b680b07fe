//! The floor under memory and transports: a memory range as transports see it, and the opaque
//! handle by which memory keeps a transport's registration of it alive.
//!
//! Buffers, descriptors and operations hold [`RegToken`]s without knowing which transport made
//! them; the transport (today NIXL) implements [`Registration`] and learns of the last drop
//! through its own type's `Drop`. Nothing here imports anything above it.

use std::any::Any;
use std::sync::Arc;

use crate::device::Device;

/// One memory range as the transports see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Range {
    pub(crate) addr: usize,
    pub(crate) len: usize,
    pub(crate) device: Device,
}

/// Memory (or anything) kept alive on an operation's behalf until a transport lets go of it.
pub(crate) type Hold = Box<dyn Send>;

/// A transport's registration of memory, as the memory's owner sees it.
pub(crate) trait Registration: Send + Sync + Any {
    /// True when peers may have been told about this memory (an exposure, not an initiator's
    /// private registration).
    fn exposed(&self) -> bool;

    /// Hands over memory the owner gives up (a dropped `HostBuffer`'s mapping, `bytes` long), to
    /// hold until no peer can reach it through this registration's transport; dropped at once
    /// if that transport is gone (then nothing can reach it).
    fn quarantine(&self, memory: Hold, bytes: usize);
}

/// Keeps one registration alive; the last clone's drop ends it (the transport deregisters).
#[derive(Clone)]
pub(crate) struct RegToken(Arc<dyn Registration>);

impl RegToken {
    /// Wraps a transport's registration.
    pub(crate) fn new(reg: Arc<dyn Registration>) -> Self {
        Self(reg)
    }

    /// True when both tokens keep the same registration.
    pub(crate) fn same(&self, other: &RegToken) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// See [`Registration::exposed`].
    pub(crate) fn exposed(&self) -> bool {
        self.0.exposed()
    }

    /// See [`Registration::quarantine`].
    pub(crate) fn quarantine(&self, memory: Hold, bytes: usize) {
        self.0.quarantine(memory, bytes)
    }
}
