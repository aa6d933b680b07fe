//! Why a same-host connection's core closed it: every rule a peer can break, named (rustls'
//! `PeerMisbehaved`), and the ends that are nobody's fault (a deadline, the peer going away). The
//! core records one per connection ([`Link::death`](super::link::Link::death)); logs print its
//! reason.

use std::fmt;

/// Why a connection was closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Violation {
    /// Descriptors passed with anything but the server's first frame (one) or the frames that
    /// take pipes on a connection that uses them (at most
    /// [`MAX_PENDING_DESCRIPTORS`](super::wire::MAX_PENDING_DESCRIPTORS) waiting).
    PassedOutsideHello,
    /// A frame that takes pipes' read ends without as many passed before it, or pipes on a
    /// connection that did not say it uses them, or for memory other than host memory.
    MissingDescriptors,
    /// A passed descriptor that is not a pipe's read end.
    NotAPipe,
    /// A descriptor passed with device sources that is not an NVIDIA device's (a VMM export).
    NotACudaExport,
    /// More unread bytes than the largest frame allows.
    Flood,
    /// A peer that leaves more than the unsent bound queued.
    NotReading,
    /// The handshake was not done within its deadline.
    HandshakeTimedOut,
    /// A frame begun was not whole within its deadline.
    PartialFrameTimedOut,
    /// A length prefix of zero or over the limit of the state.
    BadFrameSize,
    /// A frame whose fields do not decode.
    MalformedFrame,
    /// A frame about an operation without its MAC.
    MissingMac,
    /// Bytes after a frame's last field.
    TrailingBytes,
    /// A `Hello` without exactly one descriptor (the slot table).
    HelloWithoutTable,
    /// The descriptor passed with the `Hello` is not a sealed table of the right size.
    NotATable,
    /// The slot table could not be mapped here.
    TableUnmappable,
    /// Descriptors were cut off (`MSG_CTRUNC`).
    ControlTruncated,
    /// Descriptors were passed while too many wait to be closed (peers passed ones whose close
    /// blocks).
    ClosesBacklogged,
    /// A `Hello` of another protocol version.
    OtherVersion,
    /// This server has no identity to prove (it serves no socket).
    NoIdentity,
    /// The `Hello` named no live operation (a replay): nothing more is served.
    HelloNotLive,
    /// A request for a slot that does not exist or is in use.
    BadSlot,
    /// An eager read that is not a small host read.
    EagerReadTooLarge,
    /// A write's bytes that do not match its ranges.
    WriteBytesMismatch,
    /// A request without the MAC of its operation's key.
    UnprovenRequest,
    /// A `Done` for no granted read.
    DoneForNothing,
    /// A `Done` without the MAC of its operation's key.
    UnprovenDone,
    /// A client core without the key it opened with (never from a peer).
    NoOpeningKey,
    /// The `Welcome` is not signed by the identity the agent name advertises.
    NotTheOwner,
    /// The owner has no live operation with the opening key.
    ServerNotLive,
    /// The owner's proof of the opening key does not check.
    BadProof,
    /// The server refused the connection (`Reject`).
    ServerRejected,
    /// A frame this state does not take.
    OutOfOrder,
    /// An answer to no open request.
    AnswerToNothing,
    /// An answer to a read already granted.
    AnswerAfterGrant,
    /// An answer that may not come unproven, without its operation's MAC.
    UnprovenAnswer,
    /// An answer of the wrong kind for its request.
    WrongAnswer,
    /// A grant whose exports do not fit the request.
    GrantDoesNotFit,
    /// This server rejected the connection (sent `Reject`).
    Rejected,
    /// The socket failed (not the peer's doing, as far as this side knows).
    SocketFailed,
    /// The peer closed the connection.
    PeerClosed,
}

impl Violation {
    /// What happened, in words.
    pub(crate) fn reason(self) -> &'static str {
        match self {
            Violation::PassedOutsideHello => "descriptors passed outside the hello and the pipes' frames",
            Violation::MissingDescriptors => {
                "pipes or device exports asked for or granted without their descriptors"
            }
            Violation::NotAPipe => "a passed descriptor that is not a pipe's read end",
            Violation::NotACudaExport => "a descriptor passed with device sources that is not a CUDA export",
            Violation::Flood => "a peer that floods the connection",
            Violation::NotReading => "a peer that does not read what it is sent",
            Violation::HandshakeTimedOut => "the handshake did not finish in time",
            Violation::PartialFrameTimedOut => "a frame did not arrive whole in time",
            Violation::BadFrameSize => "a frame of a bad size",
            Violation::MalformedFrame => "a malformed frame",
            Violation::MissingMac => "a frame without its MAC",
            Violation::TrailingBytes => "trailing bytes in a frame",
            Violation::HelloWithoutTable => "a hello without its slot table",
            Violation::NotATable => "the descriptor passed with the hello is no slot table",
            Violation::TableUnmappable => "the slot table cannot be mapped",
            Violation::ControlTruncated => "descriptors passed beyond what a message takes were cut off",
            Violation::ClosesBacklogged => {
                "descriptors passed while too many wait to be closed (peers passed ones whose close blocks)"
            }
            Violation::OtherVersion => "another protocol version",
            Violation::NoIdentity => "a server without an identity",
            Violation::HelloNotLive => "the hello named no live operation",
            Violation::BadSlot => "a request for a slot that does not exist or is in use",
            Violation::EagerReadTooLarge => "an eager read that is not a small host read",
            Violation::WriteBytesMismatch => "a write's bytes that do not match its ranges",
            Violation::UnprovenRequest => "a request without proof of its operation's key",
            Violation::DoneForNothing => "a done for no granted read",
            Violation::UnprovenDone => "a done without proof of its operation's key",
            Violation::NoOpeningKey => "no opening key",
            Violation::NotTheOwner => "the server could not prove it is the agent its name advertises",
            Violation::ServerNotLive => "the server has no live operation with the opening key",
            Violation::BadProof => "the server could not prove it holds the opening key",
            Violation::ServerRejected => "the server rejected the connection",
            Violation::OutOfOrder => "a frame out of order",
            Violation::AnswerToNothing => "an answer to no open request",
            Violation::AnswerAfterGrant => "an answer to a read already granted",
            Violation::UnprovenAnswer => "an answer without proof of its operation's key",
            Violation::WrongAnswer => "an answer of the wrong kind for its request",
            Violation::GrantDoesNotFit => "a grant that does not fit its request",
            Violation::Rejected => "rejected",
            Violation::SocketFailed => "the socket failed",
            Violation::PeerClosed => "the peer closed the connection",
        }
    }
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.reason())
    }
}
