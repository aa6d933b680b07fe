//! The client book: active operations ([`Act`]s), the connection to each peer name, and names
//! found without a same-host path (not asked again for [`NEGATIVE_TTL`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use super::limits::{MAX_NEGATIVE, NEGATIVE_TTL};
use super::records::{Act, ConnId, RequestId};
use crate::decline_reason::DeclineReason;
use crate::engine::transport::{Decline, OpId};

/// What this connector asks: active operations, connections by peer, peers avoided.
#[derive(Default)]
pub(super) struct ClientBook {
    acts: HashMap<OpId, Act>,
    /// The connection open to each peer name (made for its advertisement).
    by_peer: HashMap<Arc<str>, ConnId>,
    /// Peer names found with no same-host path, when, and why (at most [`MAX_NEGATIVE`]).
    avoided: HashMap<Arc<str>, (Instant, Arc<str>, DeclineReason)>,
}

impl ClientBook {
    /// Starts tracking the active operation `id`.
    pub(super) fn insert(&mut self, id: OpId, act: Act) {
        self.acts.insert(id, act);
    }

    /// The active operation `id`.
    pub(super) fn get(&self, id: OpId) -> Option<&Act> {
        self.acts.get(&id)
    }

    /// The active operation `id`, to change.
    pub(super) fn get_mut(&mut self, id: OpId) -> Option<&mut Act> {
        self.acts.get_mut(&id)
    }

    /// Stops tracking the active operation `id`; it, if it was tracked.
    pub(super) fn remove(&mut self, id: OpId) -> Option<Act> {
        self.acts.remove(&id)
    }

    /// Stops tracking the active operation that sent request `r`; it and its id, if there is one.
    pub(super) fn take(&mut self, r: RequestId) -> Option<(OpId, Act)> {
        let id = self.by_request(r)?;
        self.acts.remove(&id).map(|a| (id, a))
    }

    /// Every active operation.
    pub(super) fn acts(&self) -> impl Iterator<Item = (OpId, &Act)> {
        self.acts.iter().map(|(id, a)| (*id, a))
    }

    /// The active operation that sent request `r`.
    pub(super) fn by_request(&self, r: RequestId) -> Option<OpId> {
        self.acts
            .iter()
            .find(|(_, a)| a.conn() == r.conn && a.slot() == r.slot && a.gen() == r.gen)
            .map(|(id, _)| *id)
    }

    /// The ids of the active operations on connection `conn`.
    pub(super) fn on_conn(&self, conn: ConnId) -> Vec<OpId> {
        self.acts
            .iter()
            .filter(|(_, a)| a.conn() == conn)
            .map(|(id, _)| *id)
            .collect()
    }

    /// The connection open to `peer`, if one was made.
    pub(super) fn conn_to(&self, peer: &str) -> Option<ConnId> {
        self.by_peer.get(peer).copied()
    }

    /// Connection `conn` now serves `peer`.
    pub(super) fn connected(&mut self, peer: Arc<str>, conn: ConnId) {
        self.by_peer.insert(peer, conn);
    }

    /// Connection `conn` to `peer` closed.
    pub(super) fn disconnected(&mut self, peer: &str, conn: ConnId) {
        if self.by_peer.get(peer) == Some(&conn) {
            self.by_peer.remove(peer);
        }
    }

    /// Why `peer` has no same-host path, when it was found so less than [`NEGATIVE_TTL`]
    /// before `now`.
    pub(super) fn avoids(&self, peer: &str, now: Instant) -> Option<(&Arc<str>, DeclineReason)> {
        self.avoided
            .get(peer)
            .filter(|(t, _, _)| now.saturating_duration_since(*t) < NEGATIVE_TTL)
            .map(|(_, why, kind)| (why, *kind))
    }

    /// `peer` has no same-host path as of `now`, because of `why`: it is not asked again for
    /// [`NEGATIVE_TTL`] (the memory of such names is bounded: past [`MAX_NEGATIVE`] it starts
    /// over).
    pub(super) fn avoid(&mut self, peer: Arc<str>, now: Instant, why: &Decline) {
        if self.avoided.len() >= MAX_NEGATIVE {
            self.avoided.clear();
        }
        self.avoided
            .insert(peer, (now, why.to_string().into(), why.why()));
    }
}

#[cfg(test)]
mod tests;
