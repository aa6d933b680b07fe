//! The server book: what this connector serves: scopes by key ([`Scope`]), key ids, exposers'
//! identities and exports queued. The policy (`policy.rs`) only reads a [`Scope`].

use std::collections::{HashMap, HashSet};
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::auth::{self, KeyId};
use super::records::{AnyCopy, CopyOwner, RequestId};
use crate::device::Device;
use crate::metadata::OperationKind;
use crate::reg::Range;
use crate::state::OpState;
use crate::sys::same_host::cma::{Piece, Pull, SlotRef};
#[cfg(feature = "cuda")]
use crate::sys::same_host::ipc;
use crate::sys::same_host::mem;
use crate::sys::same_host::pipe::{Ends, Fill, Wake};
use crate::sys::same_host::slots::SlotTable;

/// The writer copying into a writable now.
#[derive(Debug, Clone)]
pub(super) struct Writer {
    /// Its request.
    id: RequestId,
    /// Set to stop its copy (the owner unexposed, the connector stops).
    cancel: Arc<AtomicBool>,
    /// Wakes its copy if it waits on pipes, once `cancel` is set.
    wake: Option<Arc<Wake>>,
}

/// A passive operation's scope on the serving side.
pub(super) struct Scope {
    kind: OperationKind,
    device: Device,
    /// The operation's descriptors, sorted by address.
    ranges: Vec<Range>,
    state: Arc<OpState>,
    /// Read grants given.
    grants: HashSet<RequestId>,
    /// The writer copying into it now.
    writer: Option<Writer>,
    /// An operation completed (or tore) it this turn: an eager answer, a reader's `ReadDone`, the
    /// end of a writer's copy. The engine applies the completion after the turn; requests heard
    /// before then are refused as if it had ended.
    done: bool,
}

impl Scope {
    /// The scope of a passive operation of `kind` over `ranges` (all on one device).
    pub(super) fn new(kind: OperationKind, mut ranges: Vec<Range>, state: Arc<OpState>) -> Self {
        ranges.sort_by_key(|r| r.addr);
        Self {
            kind,
            device: ranges.first().map_or(Device::Host, |r| r.device),
            ranges,
            state,
            grants: HashSet::new(),
            writer: None,
            done: false,
        }
    }

    /// Its operation's kind.
    pub(super) fn kind(&self) -> OperationKind {
        self.kind
    }

    /// Where its memory is.
    pub(super) fn device(&self) -> Device {
        self.device
    }

    /// Its descriptors, sorted by address.
    pub(super) fn ranges(&self) -> &[Range] {
        &self.ranges
    }

    /// Its operation's state.
    pub(super) fn state(&self) -> &Arc<OpState> {
        &self.state
    }

    /// An operation completed (or tore) it this turn (see `done`).
    pub(super) fn is_done(&self) -> bool {
        self.done
    }

    /// Whether an operation completed (or tore) it this turn.
    pub(super) fn set_done(&mut self, done: bool) {
        self.done = done;
    }

    /// A writer copies into it now.
    pub(super) fn has_writer(&self) -> bool {
        self.writer.is_some()
    }

    /// Its writer `id`, if that is its writer, copies no more.
    pub(super) fn end_writer(&mut self, id: RequestId) -> bool {
        self.writer.take_if(|w| w.id == id).is_some()
    }

    /// Its writer's copy waits on pipes: `wake` wakes it once it is told to stop.
    pub(super) fn wake_writer_with(&mut self, wake: Arc<Wake>) {
        if let Some(w) = &mut self.writer {
            w.wake = Some(wake);
        }
    }

    /// Read `id` is granted; false if it was already.
    pub(super) fn grant(&mut self, id: RequestId) -> bool {
        self.grants.insert(id)
    }

    /// Read `id`'s grant ends; false if it held none.
    pub(super) fn ungrant(&mut self, id: RequestId) -> bool {
        self.grants.remove(&id)
    }

    /// Read `id` holds a grant of a scope not completed this turn.
    pub(super) fn holds_grant(&self, id: RequestId) -> bool {
        !self.done && self.grants.contains(&id)
    }

    /// Keeps the grants `keep` says to keep.
    pub(super) fn retain_grants(&mut self, keep: impl FnMut(&RequestId) -> bool) {
        self.grants.retain(keep);
    }

    /// Its grants, as it is given up.
    pub(super) fn into_grants(self) -> HashSet<RequestId> {
        self.grants
    }

    /// Claims it for the write `id` from the process `pid` (whose request is in slot `id.slot`
    /// of `table`): marks it in use and makes `id` its writer. What the copy into it needs;
    /// `None` when its owner ended it an instant ago.
    pub(super) fn claim(
        &mut self,
        id: RequestId,
        key: Arc<str>,
        pid: i32,
        table: Arc<SlotTable>,
        pidfd: Option<Arc<OwnedFd>>,
    ) -> Option<Claim> {
        if !self.state.try_mark_in_use() {
            return None;
        }
        let cancel = Arc::new(AtomicBool::new(false));
        self.writer = Some(Writer {
            id,
            cancel: cancel.clone(),
            wake: None,
        });
        Some(Claim {
            device: self.device,
            pid,
            slot: SlotRef {
                table,
                idx: id.slot,
                gen: id.gen,
            },
            cancel,
            owner: CopyOwner::Write {
                state: self.state.clone(),
                key,
                id,
                pidfd,
            },
        })
    }

    /// Makes `id` its writer, as a claim does (tests of what follows a claim).
    #[cfg(test)]
    pub(super) fn set_writer(&mut self, id: RequestId) {
        self.writer = Some(Writer {
            id,
            cancel: Arc::new(AtomicBool::new(false)),
            wake: None,
        });
    }

    /// Read grants given.
    #[cfg(test)]
    pub(super) fn grants(&self) -> usize {
        self.grants.len()
    }

    /// True when `[addr, addr+len)` lies inside one descriptor.
    pub(super) fn contains(&self, addr: u64, len: u64) -> bool {
        mem::inside(&self.ranges, addr, len)
    }

    /// Tells its writer, if any, to stop copying.
    pub(super) fn cancel_writer(&self) {
        if let Some(w) = &self.writer {
            w.cancel.store(true, Ordering::Relaxed);
            if let Some(wake) = &w.wake {
                wake.wake();
            }
        }
    }
}

/// What this connector serves: scopes, key ids, identities, exports queued.
#[derive(Default)]
pub(super) struct ServerBook {
    scopes: HashMap<Arc<str>, Scope>,
    /// The key of each live scope by its key id (the name requests use on the wire).
    key_ids: HashMap<KeyId, Arc<str>>,
    /// Fingerprints of this connector's exposers' connection metadata.
    identities: HashSet<u64>,
    /// Device ranges queued for export now (at most
    /// [`MAX_EXPORTING`](super::limits::MAX_EXPORTING)).
    exporting: usize,
}

impl ServerBook {
    /// Serves `scope` under `key`, for metadata of the exposer identified by `identity`.
    pub(super) fn expose(&mut self, key: Arc<str>, identity: u64, scope: Scope) {
        self.identities.insert(identity);
        self.key_ids.insert(auth::key_id(&key), key.clone());
        self.scopes.insert(key, scope);
    }

    /// Stops serving `key`; its scope, if it was served.
    pub(super) fn unexpose(&mut self, key: &str) -> Option<Scope> {
        let s = self.scopes.remove(key)?;
        self.key_ids.remove(&auth::key_id(key));
        Some(s)
    }

    /// The keys of live scopes by key id (what a connection's core resolves requests with).
    pub(super) fn key_ids(&self) -> &HashMap<KeyId, Arc<str>> {
        &self.key_ids
    }

    /// True when `identity` is one of this connector's exposers' (a request naming another is
    /// for an agent of the same name elsewhere).
    pub(super) fn knows(&self, identity: u64) -> bool {
        self.identities.contains(&identity)
    }

    /// The scope served under `key`.
    pub(super) fn scope(&self, key: &str) -> Option<&Scope> {
        self.scopes.get(key)
    }

    /// The scope served under `key`, to change.
    pub(super) fn scope_mut(&mut self, key: &str) -> Option<&mut Scope> {
        self.scopes.get_mut(key)
    }

    /// The book's own copy of `key` (shared with the events that name it).
    pub(super) fn key(&self, key: &str) -> Option<Arc<str>> {
        self.scopes.get_key_value(key).map(|(k, _)| k.clone())
    }

    /// Every scope served, to change.
    pub(super) fn scopes_mut(&mut self) -> impl Iterator<Item = &mut Scope> {
        self.scopes.values_mut()
    }

    /// Every scope served.
    pub(super) fn scopes(&self) -> impl Iterator<Item = &Scope> {
        self.scopes.values()
    }

    /// Device ranges queued for export now, over every connection.
    pub(super) fn exporting(&self) -> usize {
        self.exporting
    }

    /// `n` more device ranges are queued for export.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(super) fn exports_queued(&mut self, n: usize) {
        self.exporting += n;
    }

    /// `n` device ranges' exports ended.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(super) fn exports_ended(&mut self, n: usize) {
        self.exporting = self.exporting.saturating_sub(n);
    }
}

/// A writable claimed for one write: what the copy into it needs.
pub(super) struct Claim {
    /// Where the writable's memory is.
    device: Device,
    /// The writer's pid (its memory is read by it).
    pid: i32,
    /// The writer's slot for this request (the copy checks and ends it).
    slot: SlotRef,
    /// Set to stop the copy.
    cancel: Arc<AtomicBool>,
    /// Who learns of the copy's end.
    owner: CopyOwner,
}

impl Claim {
    /// The writer's pid.
    pub(super) fn pid(&self) -> i32 {
        self.pid
    }

    /// The copy that pulls `pieces` of the writer's memory into the writable, and who learns of
    /// its end.
    pub(super) fn pull(self, pieces: Vec<Piece>) -> (AnyCopy, CopyOwner) {
        let copy = Pull::new(self.pid, pieces, self.slot, self.cancel);
        (AnyCopy::pulled_into(copy, Some(self.device)), self.owner)
    }

    /// The copy that fills the writable's `pieces` from the writer's pipes `lanes` (on the pool
    /// share `pid`; `wake` wakes it when told to stop), and who learns of its end.
    pub(super) fn fill(
        self,
        pid: libc::pid_t,
        lanes: Ends,
        pieces: Vec<(usize, usize)>,
        wake: Arc<Wake>,
    ) -> (AnyCopy, CopyOwner) {
        let fill = Fill::new(pid, lanes, pieces, self.slot, self.cancel, wake);
        (AnyCopy::Filled(fill), self.owner)
    }

    /// The copy that maps the writer's device `pieces` (their VMM descriptors `fds`, passed on
    /// connection `conn`) and copies them into the writable, and who learns of its end.
    #[cfg(feature = "cuda")]
    pub(super) fn import(
        self,
        conn: u64,
        pieces: Vec<ipc::Piece>,
        fds: Vec<OwnedFd>,
    ) -> (AnyCopy, CopyOwner) {
        let copy = ipc::DeviceCopy::new(conn, self.pid, pieces, fds, self.slot, self.cancel);
        (AnyCopy::Device(copy), self.owner)
    }
}
