//! NIXL registrations: one registry per agent, by address range, and the token that keeps a
//! registration alive outside the engine thread (its drop posts the deregistration through the
//! transport's mailbox).

use std::collections::BTreeMap;
use std::sync::{Arc, Weak};

use super::ffi::{AgentKey, AgentRegistration, NixlAgent};
use crate::engine::cmd::Mailbox;
use crate::error::Result;
use crate::reg::{self, Hold, Range};
use crate::stats::EngineStats;

/// Registrations of one agent, by address range.
pub(super) struct Registry {
    side: Side,
    gen: u64,
    /// By (device kind, device id, address, length): registrations of one start address and
    /// different lengths coexist.
    map: BTreeMap<(u8, u32, usize, usize), RegEntry>,
    next_id: u64,
}

pub(super) struct RegEntry {
    range: Range,
    id: u64,
    token: Weak<RegInner>,
    _reg: AgentRegistration,
}

/// The registry's key of `r`.
pub(super) fn key_of(r: &Range) -> (u8, u32, usize, usize) {
    (r.device.kind() as u8, r.device.id(), r.addr, r.len)
}

impl Registry {
    /// Bytes the registrations cover (each counted whole).
    pub(super) fn bytes(&self) -> u64 {
        self.map.values().map(|e| e.range.len as u64).sum()
    }

    /// Live registrations.
    pub(super) fn len(&self) -> usize {
        self.map.len()
    }

    /// No live registration.
    pub(super) fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Forgets every registration (its agent goes with them).
    pub(super) fn clear(&mut self) {
        self.map.clear();
    }

    pub(super) fn new(side: Side, gen: u64) -> Self {
        Self {
            side,
            gen,
            map: BTreeMap::new(),
            next_id: 1,
        }
    }

    /// The exposer's live registration of exactly `r`, if an earlier exposure made it: no call
    /// into NIXL (a caller's turn may look).
    pub(super) fn exposed(&self, r: &Range) -> Option<Arc<RegInner>> {
        debug_assert!(self.side == Side::Exposer);
        self.map.get(&key_of(r)).and_then(|e| e.token.upgrade())
    }

    /// The initiator's live registration containing `r`, and its range, if any: no call into
    /// NIXL (a caller's turn may look).
    pub(super) fn covering(&self, r: &Range) -> Option<(Arc<RegInner>, Range)> {
        debug_assert!(self.side == Side::Initiator);
        let k = key_of(r);
        let (lo, hi) = ((k.0, k.1, 0, 0), (k.0, k.1, r.addr, usize::MAX));
        // The registrations starting at or before r, nearest first: one of them contains r if
        // any does (32 candidates is plenty for registrations that do not overlap much).
        self.map
            .range(lo..=hi)
            .rev()
            .take(32)
            .filter(|(_, e)| e.range.addr + e.range.len >= r.addr + r.len)
            .find_map(|(_, e)| e.token.upgrade().map(|t| (t, e.range)))
    }

    /// A live registration containing `r` (exposer side: of exactly `r`, as per-operation metadata
    /// reaches the whole registration), or a new one of exactly `r`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn get(
        &mut self,
        key: &AgentKey,
        agent: &NixlAgent,
        r: Range,
        mailbox: &Mailbox<Mail>,
        stats: &mut EngineStats,
        replaced: &mut Option<Range>,
    ) -> Result<(Arc<RegInner>, Range)> {
        let k = key_of(&r);
        if self.side == Side::Exposer {
            if let Some(t) = self.exposed(&r) {
                stats.registration_hits += 1;
                return Ok((t, r));
            }
        } else if let Some(hit) = self.covering(&r) {
            stats.registration_hits += 1;
            return Ok(hit);
        }
        // A dead entry of exactly this range may still have its deregistration queued: replace it
        // now (the queued command then finds another id and does nothing); the initiator drops
        // what it prepared over it (`replaced`; the exposer's metadata is cached by ids).
        if self.map.remove(&k).is_some() {
            *replaced = Some(r);
        }
        let reg = agent.register(key, r)?;
        let id = self.next_id;
        self.next_id += 1;
        let tok = Arc::new(RegInner {
            mailbox: mailbox.clone(),
            side: self.side,
            gen: self.gen,
            range: r,
            id,
        });
        self.map.insert(
            k,
            RegEntry {
                range: r,
                id,
                token: Arc::downgrade(&tok),
                _reg: reg,
            },
        );
        stats.registrations += 1;
        Ok((tok, r))
    }

    pub(super) fn deregister(&mut self, gen: u64, range: Range, id: u64) -> bool {
        let k = key_of(&range);
        if gen == self.gen && self.map.get(&k).is_some_and(|e| e.id == id) {
            self.map.remove(&k);
            return true;
        }
        false
    }
}

/// Which NIXL agent a registration belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    /// The agent that exposes passive operations' memory.
    Exposer,
    /// The agent that posts this connector's transfers.
    Initiator,
}

/// What the NIXL transport's objects outside the engine thread post to it.
pub(crate) enum Mail {
    /// A registration token was dropped.
    Deregister {
        side: Side,
        gen: u64,
        range: Range,
        id: u64,
    },
    /// Memory given up (a dropped HostBuffer's mapping, `bytes` long) that exposer `gen` exposed,
    /// held whole until no peer can reach it: a late read gets its bytes or an error, never zeros.
    Quarantine { gen: u64, memory: Hold, bytes: usize },
}

/// One NIXL registration, kept alive by the [`RegToken`](crate::reg::RegToken)s that wrap it; its
/// drop queues the deregistration on the engine thread.
pub(super) struct RegInner {
    mailbox: Mailbox<Mail>,
    side: Side,
    /// The generation of the agent that holds it.
    pub(super) gen: u64,
    /// The memory registered.
    pub(super) range: Range,
    /// The registration's id (never reused).
    pub(super) id: u64,
}

impl reg::Registered for RegInner {
    fn exposed(&self) -> bool {
        self.side == Side::Exposer
    }

    fn quarantine(&self, memory: Hold, bytes: usize) {
        self.mailbox.post(Mail::Quarantine {
            gen: self.gen,
            memory,
            bytes,
        });
    }
}

impl Drop for RegInner {
    fn drop(&mut self) {
        self.mailbox.post(Mail::Deregister {
            side: self.side,
            gen: self.gen,
            range: self.range,
            id: self.id,
        });
    }
}
