//! An in-process transport behind the same seam, compiled for tests and for the `testing`
//! feature: connectors of one process find each other by agent name in a process-wide hub and
//! copy bytes with `memcpy`, so the engine's and the operations' state machines (completion
//! exactly once, cancel, drop at every point, deadlines, replay) are tested in milliseconds
//! without the NIXL library, as quinn tests its protocol with an in-memory pair.
//!
//! It publishes its own metadata, `loopback:<agent name>`, and decodes peers' with
//! [`decode_peer`]: nothing of NIXL's format is used or loaded. A node can be *stalled*: its
//! active transfers stay in flight until it is released, which is how tests reach the in-flight
//! states.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use super::poller::Waker;
use super::transport::{ActiveSpec, Event, Exposure, OpId, PassiveSpec, PeerInfo, Polling, Transport};
use crate::error::{Error, MetadataProblem, Result};
use crate::metadata::OperationKind;
use crate::reg::Range;
use crate::state::{OperationStatus, TransferPath};
use crate::stats::EngineStats;
use crate::sync::lock;
use crate::sys::same_host::cma::CopyError;

/// What a loopback connector's published metadata starts with; its agent name follows.
const PREFIX: &str = "loopback:";
/// The longest agent name a loopback peer's metadata may carry.
const MAX_NAME: usize = 1024;

/// Decodes a loopback peer's published metadata (`loopback:<agent name>`).
///
/// # Errors
/// [`Error::Metadata`] for anything else (NIXL metadata included: a loopback connector pairs
/// only with loopback connectors).
pub(crate) fn decode_peer(s: &str) -> Result<PeerInfo> {
    let bad = || Error::metadata("nixl_metadata", MetadataProblem::NotLoopback);
    let name = s.strip_prefix(PREFIX).ok_or_else(bad)?;
    if name.is_empty() || name.len() > MAX_NAME {
        return Err(bad());
    }
    Ok(PeerInfo {
        published: s.into(),
        reach: Arc::from(&[][..]),
        name: name.into(),
        identity: crate::sync::fnv1a(name.as_bytes()),
    })
}

/// Every live loopback node of this process, by agent name.
fn hub() -> &'static Mutex<HashMap<String, Weak<Node>>> {
    static HUB: OnceLock<Mutex<HashMap<String, Weak<Node>>>> = OnceLock::new();
    HUB.get_or_init(Default::default)
}

/// A live passive operation as the hub sees it: its kind and ranges.
type Exposed = (OperationKind, Vec<Range>);

/// One connector's side of the hub.
pub(crate) struct Node {
    name: String,
    waker: Waker,
    /// Live passive operations: their kind and ranges.
    exposed: Mutex<HashMap<Arc<str>, Exposed>>,
    /// Keys of passive operations a peer completed, for this node's engine.
    completed: Mutex<Vec<Arc<str>>>,
    /// While set, this node's active transfers stay in flight.
    stalled: AtomicBool,
}

impl Node {
    /// Holds (`true`) or releases this node's active transfers.
    pub(crate) fn stall(&self, on: bool) {
        self.stalled.store(on, Ordering::SeqCst);
        self.waker.wake();
    }
}

/// The node of the loopback connector with agent name `name`, if it lives.
pub(crate) fn node(name: &str) -> Option<Arc<Node>> {
    lock(hub()).get(name).and_then(Weak::upgrade)
}

/// The loopback transport of one connector.
pub(crate) struct LoopbackTransport {
    node: Arc<Node>,
    /// The metadata it publishes (the same for every operation).
    published: Arc<str>,
    identity: u64,
    /// Active transfers in flight.
    inflight: Vec<ActiveSpec>,
    transfers: u64,
}

impl LoopbackTransport {
    /// Joins the hub as `name`, waking the engine through `waker`.
    pub(crate) fn new(name: &str, waker: Waker) -> Self {
        let node = Arc::new(Node {
            name: name.to_string(),
            waker,
            exposed: Mutex::default(),
            completed: Mutex::default(),
            stalled: AtomicBool::new(false),
        });
        lock(hub()).insert(name.to_string(), Arc::downgrade(&node));
        Self {
            identity: crate::sync::fnv1a(name.as_bytes()),
            published: format!("{PREFIX}{name}").into(),
            node,
            inflight: Vec::new(),
            transfers: 0,
        }
    }

    /// Moves one transfer's bytes, if its peer still exposes what it asks for.
    fn run(&self, spec: &ActiveSpec) -> Result<()> {
        let refused = |refusal, reason: &str| Error::Refused {
            agent: spec.peer.name.to_string(),
            refusal,
            reason: reason.into(),
        };
        let Some(peer) = node(&spec.peer.name) else {
            return Err(Error::RemoteGone {
                agent: spec.peer.name.to_string(),
                reason: "no loopback connector has this name any more".into(),
                source: None,
            });
        };
        // The peer's map stays locked while copying: its operation cannot end (and its memory
        // cannot go) under the copy.
        let mut exposed = lock(&peer.exposed);
        let Some((kind, ranges)) = exposed.get(&spec.key) else {
            return Err(Error::Refused {
                agent: spec.peer.name.to_string(),
                refusal: crate::error::Refusal::NotLive,
                reason: "no live operation has this notification key".into(),
            });
        };
        if (*kind == OperationKind::Write) != spec.write {
            return Err(refused(
                crate::error::Refusal::WrongDirection,
                "the operation's direction does not match",
            ));
        }
        let inside = |r: &Range| {
            ranges
                .iter()
                .any(|x| x.addr <= r.addr && r.addr + r.len <= x.addr + x.len)
        };
        if spec.local.len() != spec.remote.len()
            || !spec.remote.iter().all(inside)
            || spec.local.iter().zip(&spec.remote).any(|(l, r)| l.len != r.len)
        {
            return Err(refused(
                crate::error::Refusal::OutOfRange,
                "a requested range lies outside the operation's descriptors",
            ));
        }
        for (l, r) in spec.local.iter().zip(&spec.remote) {
            let (src, dst) = if spec.write { (l, r) } else { (r, l) };
            // Both ranges are live memory of this process: the local one is held by the active
            // operation until the engine sees it end, the remote one by the peer's live passive
            // operation, which cannot end while its map is locked here; the lengths were checked
            // equal.
            crate::sys::copy_in_process(src.addr, dst.addr, src.len).map_err(|e| Error::Transfer {
                agent: spec.peer.name.to_string(),
                reason: "the kernel refused the loopback copy".into(),
                source: match e {
                    CopyError::Os(s) | CopyError::Unsupported(s) => Some(s),
                    _ => None,
                },
            })?;
        }
        // One transfer completes a passive operation (as NIXL's notification does): the key is
        // gone before the map is unlocked, so a second reader, on any connector, is refused
        // whatever its owner's engine has applied yet (loopback_concurrent_readers_one_succeeds).
        exposed.remove(&spec.key);
        drop(exposed);
        lock(&peer.completed).push(spec.key.clone());
        peer.waker.wake();
        Ok(())
    }
}

impl Drop for LoopbackTransport {
    fn drop(&mut self) {
        let mut hub = lock(hub());
        if hub
            .get(&self.node.name)
            .is_some_and(|w| w.as_ptr() == Arc::as_ptr(&self.node))
        {
            hub.remove(&self.node.name);
        }
    }
}

impl Transport for LoopbackTransport {
    fn expose(&mut self, spec: &PassiveSpec, out: &mut Exposure) -> Result<()> {
        lock(&self.node.exposed).insert(spec.key.clone(), (spec.kind, spec.ranges.clone()));
        out.published = Some(self.published.clone());
        out.identity = self.identity;
        Ok(())
    }

    fn unexpose(&mut self, key: &str) {
        lock(&self.node.exposed).remove(key);
    }

    fn begin(&mut self, spec: ActiveSpec, out: &mut Vec<Event>) {
        out.push(Event::taken(spec.id, TransferPath::Loopback));
        self.inflight.push(spec);
        self.node.waker.wake();
    }

    fn abandon(&mut self, id: OpId, _hard: bool, out: &mut Vec<Event>) {
        if let Some(i) = self.inflight.iter().position(|s| s.id == id) {
            self.inflight.swap_remove(i);
            out.push(Event::ended(id, Err(Error::Cancelled)));
        }
    }

    fn progress(&mut self, _ready: &[(u64, u32)], out: &mut Vec<Event>) -> bool {
        let mut any = false;
        for key in std::mem::take(&mut *lock(&self.node.completed)) {
            out.push(Event::PassiveCompleted {
                key,
                path: TransferPath::Loopback,
            });
            any = true;
        }
        if !self.node.stalled.load(Ordering::SeqCst) {
            for spec in std::mem::take(&mut self.inflight) {
                // Cancelled, its abandon still on the way here: nothing moves (as on the same-host
                // path, which sees the cancel at once too).
                let result = if spec.state.status() == OperationStatus::Cancelled {
                    Err(Error::Cancelled)
                } else {
                    self.transfers += 1;
                    self.run(&spec)
                };
                out.push(Event::ended(spec.id, result));
                any = true;
            }
        }
        any
    }

    fn polling(&self) -> Polling {
        Polling::EveryTurn
    }

    fn has_pending(&self) -> bool {
        !lock(&self.node.completed).is_empty()
            || (!self.inflight.is_empty() && !self.node.stalled.load(Ordering::SeqCst))
    }

    fn path(&self) -> TransferPath {
        TransferPath::Loopback
    }

    /// Its calls are a copy through the kernel and a process-wide table's lock.
    fn any_thread(&self) -> bool {
        true
    }

    fn add_stats(&self, stats: &mut EngineStats, _completed: u64) {
        stats.transfers += self.transfers;
    }
}
