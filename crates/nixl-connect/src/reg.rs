//! The floor under memory and transports: a memory range as transports see it, and the opaque
//! handle by which memory keeps a transport's registration of it alive.
//!
//! Buffers, descriptors and operations hold [`RegToken`]s without knowing which transport made
//! them; the transport (today NIXL) implements [`Registered`] and learns of the last drop
//! through its own type's `Drop`. Nothing here imports anything above it.

use std::any::Any;
use std::collections::HashMap;
use std::sync::Arc;

use crate::device::Device;

/// One memory range as the transports see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Range {
    pub(crate) addr: usize,
    pub(crate) len: usize,
    pub(crate) device: Device,
}

/// Memory (anything that is [`Held`]) kept alive on an operation's behalf until a transport lets
/// go of it.
pub(crate) type Hold = Box<dyn Held>;

/// What a [`Hold`] keeps: memory, and the registrations it may carry.
pub(crate) trait Held: Send {
    /// The registration tokens the held memory keeps (a registration kept by several holds is
    /// counted by each).
    fn registrations(&self) -> usize {
        0
    }

    /// Drops the registration tokens the held memory keeps, while the memory itself stays held; a
    /// registration ends with its last token (one that newer memory shares stays). A transport
    /// that holds given-up memory for a long time calls it so that memory nobody will expose again
    /// does not stay registered.
    fn release_registrations(&mut self) {}
}

/// A transport's registration of memory, as the memory's owner sees it.
pub(crate) trait Registered: Send + Sync + Any {
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
pub(crate) struct RegToken(Arc<dyn Registered>);

impl RegToken {
    /// Wraps a transport's registration.
    pub(crate) fn new(reg: Arc<dyn Registered>) -> Self {
        Self(reg)
    }

    /// True when both tokens keep the same registration.
    pub(crate) fn same(&self, other: &RegToken) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// The registration's identity (its address, unique while this token keeps it alive).
    fn id(&self) -> usize {
        Arc::as_ptr(&self.0) as *const () as usize
    }

    /// See [`Registered::exposed`].
    pub(crate) fn exposed(&self) -> bool {
        self.0.exposed()
    }

    /// See [`Registered::quarantine`].
    pub(crate) fn quarantine(&self, memory: Hold, bytes: usize) {
        self.0.quarantine(memory, bytes)
    }
}

/// The registrations one piece of memory keeps alive, each once: a buffer exposed in many parts
/// (a descriptor per part, each registered) finds a token it holds already in constant time.
#[derive(Default)]
pub(crate) struct RegSet(HashMap<usize, RegToken>);

impl RegSet {
    /// Keeps `tok` unless it keeps a registration already held.
    pub(crate) fn insert(&mut self, tok: RegToken) {
        self.0.entry(tok.id()).or_insert(tok);
    }

    /// The tokens held.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &RegToken> {
        self.0.values()
    }
}

#[cfg(test)]
mod tests;
