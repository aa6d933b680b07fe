//! [`PathProbe`]: which path an operation with a peer would take from a connector, and why each
//! path before it declines ([`Connector::probe`](crate::Connector::probe)).

use crate::state::{Mechanism, TransferPath};

/// Which path an operation with the peer that published a metadata would take from a connector
/// now, and why each path tried before it declines, in the connector's order (the same-host
/// path, then NIXL). What `nixl-connect doctor --peer` prints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathProbe {
    peer: String,
    write: bool,
    taken: Option<(TransferPath, Option<Mechanism>)>,
    declined: Vec<(TransferPath, String)>,
}

impl PathProbe {
    pub(crate) fn new(
        peer: String,
        write: bool,
        taken: Option<(TransferPath, Option<Mechanism>)>,
        declined: Vec<(TransferPath, String)>,
    ) -> Self {
        Self {
            peer,
            write,
            taken,
            declined,
        }
    }

    /// The peer's NIXL agent name.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// True for a write into the peer's writable, false for a read of its readable.
    pub fn is_write(&self) -> bool {
        self.write
    }

    /// The path the operation would take; `None` when every path this connector may take
    /// declines (the operation would fail with [`Error::PathUnavailable`](crate::Error::PathUnavailable)).
    pub fn path(&self) -> Option<TransferPath> {
        self.taken.map(|(p, _)| p)
    }

    /// How that path would move the bytes, where it says before the operation (the same-host
    /// path does for host memory; device memory's kind decides at its export, and NIXL's UCX
    /// chooses its transports as it connects).
    pub fn mechanism(&self) -> Option<Mechanism> {
        self.taken.and_then(|(_, m)| m)
    }

    /// Each path tried before [`path`](Self::path), with why it declines, in a user's words.
    pub fn declined(&self) -> &[(TransferPath, String)] {
        &self.declined
    }
}
