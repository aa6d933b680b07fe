//! The seam between the engine and the transports that move bytes.
//!
//! A transport exposes passive operations' memory under their keys, starts active operations
//! towards a peer, drives its own progress, and reports what ended as [`Event`]s. The engine keeps
//! the operations' state and tries the transports in order for each active operation: the
//! same-host path first (when the peer's socket answers), NIXL otherwise; a transport that cannot
//! move an operation hands it back with [`Event::Declined`] and the engine offers it to the next.
//! Nothing outside the engine knows which transport moved the bytes, except through
//! [`TransferPath`](crate::TransferPath) for reporting.

use std::sync::Arc;
use std::time::Duration;

use super::{Range, RegToken};
use crate::error::{Error, Result};
use crate::metadata::OperationKind;
use crate::operation::{OpState, TransferPath};

/// An active operation's id within its engine.
pub(crate) type OpId = u64;

/// A passive operation as the transports see it.
pub(crate) struct PassiveSpec {
    pub(crate) key: Arc<str>,
    pub(crate) kind: OperationKind,
    pub(crate) ranges: Vec<Range>,
    pub(crate) state: Arc<OpState>,
}

/// What exposing a passive operation produced.
#[derive(Default)]
pub(crate) struct Exposure {
    /// Registrations that should live as long as the memory (attached to the descriptors).
    pub(crate) tokens: Vec<RegToken>,
    /// The agent metadata to publish, from the transport peers must be able to use (NIXL).
    pub(crate) nixl_metadata: Option<Arc<str>>,
    /// The generation of the NIXL exposer that exposed it.
    pub(crate) exposer_gen: u64,
    /// The fingerprint of that exposer's connection metadata ([`md::identity`]), by which the
    /// same-host path tells its own metadata from another host's agent of the same name.
    ///
    /// [`md::identity`]: super::nixl::md::identity
    pub(crate) identity: u64,
}

/// An active operation as the transports see it.
pub(crate) struct ActiveSpec {
    pub(crate) id: OpId,
    /// A write (into a writable) rather than a read (of a readable).
    pub(crate) write: bool,
    pub(crate) local: Vec<Range>,
    pub(crate) remote: Vec<Range>,
    /// The peer's `nixl_metadata` string, as published.
    pub(crate) remote_md: Arc<str>,
    /// The peer's agent metadata, decoded.
    pub(crate) remote_raw: Arc<[u8]>,
    /// The peer's agent name (read from its metadata).
    pub(crate) peer: Arc<str>,
    /// The fingerprint of the peer's connection metadata (computed once per metadata string).
    pub(crate) remote_ident: u64,
    pub(crate) key: Arc<str>,
    pub(crate) state: Arc<OpState>,
}

/// What a transport reports to the engine.
pub(crate) enum Event {
    /// An active operation ended on this transport: no transport touches its memory any more.
    ActiveEnded { id: OpId, result: Result<()> },
    /// Registrations made for an active operation, to keep with its memory (so that reusing the
    /// memory does not register it again).
    Registered { id: OpId, tokens: Vec<RegToken> },
    /// A peer completed the passive operation with this key (its data is in place).
    PassiveCompleted { key: Arc<str> },
    /// A passive operation's memory was torn (a writer died mid-write).
    PassiveFailed { key: Arc<str>, error: Error },
    /// This transport cannot move the operation; the engine offers it to the next one.
    Declined { spec: ActiveSpec, reason: String },
}

/// How soon a transport needs [`Transport::progress`] called without being woken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Polling {
    /// Only when woken (a command, a socket, a copy thread).
    Never,
    /// Now and then: peers may need this side to act (exposed memory), at most this far apart.
    Every(Duration),
    /// Every few tens of microseconds while the engine is hot: operations wait for a peer's
    /// completion message.
    Watching,
    /// On every turn while the engine is hot: transfers are in flight.
    Busy,
}

/// One way of moving bytes (NIXL, same-host), owned by the engine thread.
pub(crate) trait Transport {
    /// Which path this is.
    fn path(&self) -> TransferPath;

    /// Exposes a passive operation's memory under its key, adding to `out`.
    ///
    /// # Errors
    /// The transport's failure to expose (registration refused, ...).
    fn expose(&mut self, spec: &PassiveSpec, out: &mut Exposure) -> Result<()>;

    /// Ends a passive operation: from now on nothing new may reach its memory through this
    /// transport, and any access that can be revoked is.
    fn unexpose(&mut self, key: &str);

    /// Starts an active operation. Its end (or its hand-over to the next transport) comes as an
    /// [`Event`] from this call or from a later [`progress`](Self::progress).
    fn begin(&mut self, spec: ActiveSpec, out: &mut Vec<Event>);

    /// Stops touching `id`'s memory as soon as it can: `hard` when the owner cannot wait any
    /// longer, even at the cost of other operations of this transport. Ends (or will end) it with
    /// an [`Event::ActiveEnded`].
    fn abandon(&mut self, id: OpId, hard: bool, out: &mut Vec<Event>);

    /// Drives progress with the ready descriptors `ready` (`(token, epoll events)`); reports what
    /// ended. Returns whether anything happened.
    fn progress(&mut self, ready: &[(u64, u32)], out: &mut Vec<Event>) -> bool;

    /// How soon it needs polling.
    fn polling(&self) -> Polling;
}
