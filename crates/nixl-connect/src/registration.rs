//! [`Registration`]: memory registered with a connector's NIXL agent ahead of its transfers.

use crate::reg::RegToken;

/// Memory registered with a [`Connector`](crate::Connector)'s NIXL agent ahead of the active
/// operations that will use it ([`Connector::register`](crate::Connector::register)), as Dynamo's
/// `Descriptor.register_with_connector` does.
///
/// While it lives, a [`begin_read`](crate::Connector::begin_read) or
/// [`begin_write`](crate::Connector::begin_write) whose local memory lies inside one of its ranges
/// reuses the registration instead of registering the memory again (a pooled buffer, or the start
/// of one, is registered once).
///
/// The registration is the initiating agent's: NIXL never publishes it to a peer, so it exposes
/// nothing. It does not keep the memory alive either.
///
/// # Drop
/// Dropping it queues the deregistration; an operation still using a range keeps that range
/// registered until it ends. Dropping never blocks.
#[must_use = "the memory is deregistered when the Registration is dropped"]
pub struct Registration {
    tokens: Vec<RegToken>,
    bytes: usize,
}

impl Registration {
    pub(crate) fn new(tokens: Vec<RegToken>, bytes: usize) -> Self {
        Self { tokens, bytes }
    }

    /// How many ranges are registered.
    pub fn ranges(&self) -> usize {
        self.tokens.len()
    }

    /// How many bytes the registered ranges cover together.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("ranges", &self.tokens.len())
            .field("bytes", &self.bytes)
            .finish()
    }
}
