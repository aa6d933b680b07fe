//! The seam between the engine and the transports that move bytes.
//!
//! A transport exposes passive operations' memory under their keys, starts active operations
//! towards a peer, drives its own progress, and reports what ended as [`Event`]s. The engine, the
//! only writer of an operation's state, tries the transports in order for each active operation;
//! one that cannot move it hands it back ([`Event::Declined`]) and the engine offers it to the next.

use std::any::Any;
use std::sync::Arc;
use std::time::Duration;

use crate::decline_reason::DeclineReason;
use crate::device::Device;
use crate::error::{Error, ErrorSource, PathRefusal, Result};
use crate::metadata::OperationKind;
use crate::pace::PACE;
use crate::reg::{Hold, Range, RegToken};
use crate::state::{Mechanism, OpState, TransferPath};
use crate::stats::EngineStats;

/// True for host memory of a small operation in all ([`Pace::small`](crate::pace::Pace::small)),
/// whose waiter spins and may drive the engine.
pub(crate) fn small_host(ranges: &[Range]) -> bool {
    ranges.iter().all(|r| r.device == Device::Host) && small(ranges)
}

/// True for a small operation's bytes in all ([`Pace::small`](crate::pace::Pace::small)),
/// whatever memory.
pub(crate) fn small(ranges: &[Range]) -> bool {
    PACE.small(ranges.iter().map(|r| r.len).fold(0usize, usize::saturating_add))
}

/// An active operation's id within its engine.
pub(crate) type OpId = u64;

/// A transport's name within its engine, handed out (in order) as the engine's transports are
/// made: active operations' chain, a transport's mail and its poll tokens name it by this id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct TransportId(u8);

impl TransportId {
    /// The most transports one engine has.
    pub(crate) const MAX: usize = 32;

    /// The `n`th transport made (`None` past [`TransportId::MAX`]).
    pub(crate) fn nth(n: usize) -> Option<Self> {
        (n < Self::MAX).then_some(TransportId(n as u8))
    }

    /// Its place in the engine's list of transports.
    pub(crate) fn index(self) -> usize {
        self.0 as usize
    }
}

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
    /// The string peers reach this connector by (`RdmaMetadata.nixl_metadata`), written by the
    /// publishing transport (the engine's first, which every peer uses; decoded by [`DecodePeer`]).
    pub(crate) published: Option<Arc<str>>,
    /// The generation of the publisher's exposure, for [`Transport::hold`] of memory given up later.
    pub(crate) exposer_gen: u64,
    /// The fingerprint of the publisher's connection metadata, by which a later transport (the
    /// same-host path) tells its own metadata from another host's agent of the same name.
    pub(crate) identity: u64,
}

/// A peer, as the transport that published its metadata decoded it: decoded once per string
/// (the engine caches it), then passed to every transport an active operation tries.
#[derive(Clone)]
pub(crate) struct PeerInfo {
    /// The string the peer published, as received.
    pub(crate) published: Arc<str>,
    /// What the publishing transport needs to reach the peer (NIXL: its agent metadata).
    pub(crate) reach: Arc<[u8]>,
    /// The peer's agent name.
    pub(crate) name: Arc<str>,
    /// The fingerprint of the peer's connection part: two agents of one name on two hosts differ.
    pub(crate) identity: u64,
}

/// The publishing transport's decoder of a peer's published string.
pub(crate) type DecodePeer = fn(&str) -> Result<PeerInfo>;

/// An active operation as the transports see it.
pub(crate) struct ActiveSpec {
    pub(crate) id: OpId,
    /// A write (into a writable) rather than a read (of a readable).
    pub(crate) write: bool,
    pub(crate) local: Vec<Range>,
    pub(crate) remote: Vec<Range>,
    /// The peer, decoded from its published metadata.
    pub(crate) peer: PeerInfo,
    pub(crate) key: Arc<str>,
    pub(crate) state: Arc<OpState>,
}

/// What a transport reports to the engine.
pub(crate) enum Event {
    /// This transport has taken an active operation and moves its bytes (for reporting,
    /// [`TransferPath`]); a later hand-over to the next transport reports that one's path.
    PathTaken { id: OpId, path: TransferPath },
    /// An active operation ended on this transport: no transport touches its memory any more.
    ActiveEnded { id: OpId, result: Result<()> },
    /// Registrations made for an active operation, to keep with its memory (reusing it registers
    /// nothing again).
    Registered { id: OpId, tokens: Vec<RegToken> },
    /// A peer completed the passive operation with this key (its data is in place), over `path`.
    PassiveCompleted { key: Arc<str>, path: TransferPath },
    /// A passive operation's memory was torn (a writer died mid-write).
    PassiveFailed { key: Arc<str>, error: Error },
    /// This transport cannot move the operation; the engine offers it to the next one.
    Declined { spec: ActiveSpec, reason: Decline },
}

impl Event {
    /// [`Event::ActiveEnded`] of `id`.
    pub(crate) fn ended(id: OpId, result: Result<()>) -> Self {
        Event::ActiveEnded { id, result }
    }

    /// [`Event::PathTaken`] of `id`.
    pub(crate) fn taken(id: OpId, path: TransferPath) -> Self {
        Event::PathTaken { id, path }
    }
}

/// Why a transport declined an operation: the text the user reads in
/// [`Error::PathUnavailable`] when no transport is left, and the error behind it, if any.
#[derive(Debug, Clone)]
pub(crate) struct Decline {
    pub(crate) reason: String,
    pub(crate) source: Option<ErrorSource>,
    /// The next path is the only one this peer offers (a Python Dynamo peer advertises no
    /// same-host endpoint): nothing a user could change, so no warning.
    pub(crate) expected: bool,
    /// Why, in a metric label's few words ([`Decline::why`]).
    why: DeclineReason,
}

impl Decline {
    /// A decline caused by `source` (an OS or driver error); `reason` says what was being done.
    pub(crate) fn because(
        reason: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Decline::shared(reason, Arc::new(source))
    }

    /// As [`Decline::because`], for a source already shared.
    pub(crate) fn shared(reason: impl Into<String>, source: ErrorSource) -> Self {
        let mut d = Decline::from(reason.into());
        d.source = Some(source);
        d
    }

    /// A decline where the next path is the only one the peer offers (see `expected`).
    pub(crate) fn expected(reason: impl Into<String>) -> Self {
        Decline {
            expected: true,
            why: DeclineReason::NoEndpoint,
            ..Decline::from(reason.into())
        }
    }

    /// The decline `reason`, for the reason `why`.
    pub(crate) fn of(why: DeclineReason, reason: impl Into<String>) -> Self {
        Decline::from(reason.into()).for_reason(why)
    }

    /// This decline, for the reason `why`.
    pub(crate) fn for_reason(mut self, why: DeclineReason) -> Self {
        self.why = why;
        self
    }

    /// Why, in a metric label's few words: [`DeclineReason::Busy`] whenever the peer was busy
    /// ([`busy`](Self::busy)), whatever the decline was made for.
    pub(crate) fn why(&self) -> DeclineReason {
        if self.busy() {
            DeclineReason::Busy
        } else {
            self.why
        }
    }

    /// Whether the peer was only busy a moment ago: its listening socket's backlog was full (`EAGAIN`
    /// from `connect`); the next operation asks again.
    pub(crate) fn busy(&self) -> bool {
        self.source
            .as_ref()
            .and_then(|s| s.downcast_ref::<std::io::Error>())
            .is_some_and(|e| e.raw_os_error() == Some(libc::EAGAIN))
    }

    /// The error an operation ends with when no transport is left to take it.
    pub(crate) fn into_error(self, agent: &str) -> Error {
        Error::PathUnavailable {
            agent: agent.to_string(),
            reason: self.reason,
            source: self.source,
        }
    }
}

impl From<String> for Decline {
    fn from(reason: String) -> Self {
        Decline {
            reason,
            source: None,
            expected: false,
            why: DeclineReason::Other,
        }
    }
}

impl From<&str> for Decline {
    fn from(reason: &str) -> Self {
        reason.to_string().into()
    }
}

impl From<PathRefusal> for Decline {
    fn from(refusal: PathRefusal) -> Self {
        Decline::because("the same-host path does not move this memory", refusal)
            .for_reason(DeclineReason::Memory)
    }
}

impl std::fmt::Display for Decline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.source {
            Some(s) => write!(f, "{}: {s}", self.reason),
            None => f.write_str(&self.reason),
        }
    }
}

/// How soon a transport needs [`Transport::progress`] called without being woken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Polling {
    /// Only when it has work pending ([`Transport::has_pending`]).
    Never,
    /// Now and then: peers may need this side to act (exposed memory), at most this far apart.
    Every(Duration),
    /// Every few tens of microseconds while the engine is hot: operations wait for a peer's message.
    Watching,
    /// On every turn while the engine is hot (and on every caller's turn that watches): transfers
    /// are in flight, or (NIXL) peers complete small exposures now.
    Busy,
    /// On every turn of the engine, hot or not: it learns of its work from its descriptors and
    /// [`Transport::has_pending`], and is cheap when there is none.
    EveryTurn,
}

/// One way of moving bytes (NIXL, same-host), owned by the engine: used by one thread at a time,
/// its own or a caller's that drives it (`driver`), so `Send`.
pub(crate) trait Transport: Send {
    /// What this transport would do now with such an operation with `peer`, without starting one
    /// ([`Connector::probe`](crate::Connector::probe)): `Ok` with the mechanism where it knows it,
    /// `Err` why it would decline. It may reach the peer as an operation would. Takes it, by default.
    fn probe(
        &mut self,
        peer: &PeerInfo,
        write: bool,
        local: Device,
        remote: Device,
        bytes: u64,
    ) -> std::result::Result<Option<Mechanism>, Decline> {
        let _ = (peer, write, local, remote, bytes);
        Ok(None)
    }

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

    /// Stops touching `id`'s memory as soon as it can (`hard`: even at the cost of other operations),
    /// ending it, now or later, with an [`Event::ActiveEnded`].
    fn abandon(&mut self, id: OpId, hard: bool, out: &mut Vec<Event>);

    /// Drives progress with the ready descriptors `ready` (`(token, epoll events)`); reports what
    /// ended. Returns whether anything happened.
    fn progress(&mut self, ready: &[(u64, u32)], out: &mut Vec<Event>) -> bool;

    /// How soon it needs polling.
    fn polling(&self) -> Polling;

    /// True when the last [`progress`](Self::progress) call did work that produced no event: the
    /// engine progresses it again soon instead of backing off, without staying hot for it.
    fn did_work(&self) -> bool {
        false
    }

    /// True when work arrived that [`progress`](Self::progress) has not handled (checked before a sleep).
    fn has_pending(&self) -> bool {
        false
    }

    /// Takes a message posted from outside the engine thread to this transport's `cmd::Mailbox`.
    fn on_mail(&mut self, msg: Box<dyn Any + Send>) {
        drop(msg);
    }

    /// Memory given up after the exposure of generation `gen` published it: a transport through
    /// which peers may still reach it keeps it (`None`) until they no longer can; otherwise it
    /// is handed back (`Some`) for the next transport, or to be freed.
    fn hold(&mut self, gen: u64, keep: Hold, bytes: usize) -> Option<Hold> {
        let _ = (gen, bytes);
        Some(keep)
    }

    /// Registers `ranges` ahead of the transfers that will use them, if this transport
    /// registers memory; the tokens keep the registrations alive.
    ///
    /// # Errors
    /// The transport's failure to register.
    fn preregister(&mut self, ranges: &[Range]) -> Result<Vec<RegToken>> {
        let _ = ranges;
        Ok(Vec::new())
    }

    /// Stops touching memory, waiting up to `within` (`None`: no limit) for work that cannot be
    /// interrupted. False when some still runs (the memory it may write must then never be freed).
    fn stop(&mut self, within: Option<Duration>) -> bool {
        let _ = within;
        true
    }

    /// Adds this transport's counters to `stats`; `completed` is how many active operations the
    /// engine saw it complete.
    fn add_stats(&self, stats: &mut EngineStats, completed: u64);

    /// The path this transport is (what its operations report).
    fn path(&self) -> TransferPath;

    /// True when any thread may make this transport's calls, one at a time: they are short, keep
    /// no state per thread, create nothing slow and drop no memory's owner. False, the default,
    /// keeps them on the engine thread but for its [`caller`](Self::caller) part.
    fn any_thread(&self) -> bool {
        false
    }

    /// The part a waiter driving the engine may use of a transport not [`any_thread`](Self::any_thread).
    fn caller(&mut self) -> Option<&mut dyn CallerPart> {
        None
    }
}

/// What a waiter's thread may do with a transport whose calls are the engine thread's (NIXL's):
/// lookups, bookkeeping, posts over what is made already, and polls; nothing that creates an
/// agent or registers, describes, loads or prepares memory (NIXL's part holds no `AgentKey`).
pub(crate) trait CallerPart {
    /// Exposes a passive operation's memory when that is only bookkeeping: `None`, nothing done,
    /// when the engine thread must [`expose`](Transport::expose) it.
    ///
    /// # Errors
    /// As [`Transport::expose`].
    fn expose(&mut self, spec: &PassiveSpec, out: &mut Exposure) -> Option<Result<()>>;

    /// The bookkeeping of [`Transport::unexpose`] (NIXL lets the exposure's registrations go);
    /// the engine thread calls `unexpose` after it all the same.
    fn unexpose(&mut self, key: &str);

    /// Begins an operation when everything it needs is ready, as [`Transport::begin`] would;
    /// otherwise the spec back, nothing done.
    fn begin(&mut self, spec: ActiveSpec, out: &mut Vec<Event>) -> Option<ActiveSpec>;

    /// Watches exposed operations and small transfers in flight, adding what ended to `out` (and
    /// freeing nothing but ended transfers' requests). True if anything happened.
    fn watch(&mut self, out: &mut Vec<Event>) -> bool;

    /// True when [`begin`](Self::begin) may take operations at all (asked once, at start).
    fn starts(&self) -> bool;

    /// True when [`watch`](Self::watch) would see everything in flight end: the engine may then
    /// stand down for the waits that drive.
    fn sees_every_end(&self) -> bool;
}

#[cfg(test)]
mod tests;
