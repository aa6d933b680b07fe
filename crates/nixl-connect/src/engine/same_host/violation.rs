//! Why a same-host connection's core closed it: every rule a peer can break, named (rustls'
//! `PeerMisbehaved`), and the ends that are nobody's fault (a deadline, the peer going away). The
//! core records one per connection ([`Link::death`](super::link::Link::death)); logs print its
//! reason.

use std::fmt;

/// Declares [`Violation`]: each variant's reason is its doc and what [`Violation::reason`] returns.
macro_rules! violations {
    ($($(#[$more:meta])* $v:ident => $why:literal,)*) => {
        /// Why a connection was closed.
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub(crate) enum Violation {
            $(#[doc = $why] $(#[$more])* $v,)*
        }

        impl Violation {
            /// What happened, in words.
            pub(crate) fn reason(self) -> &'static str {
                match self {
                    $(Violation::$v => $why,)*
                }
            }
        }
    };
}

violations! {
    /// (at most [`MAX_PENDING_DESCRIPTORS`](super::wire::MAX_PENDING_DESCRIPTORS) waiting).
    PassedOutsideHello => "descriptors passed outside the hello and the pipes' frames",
    MissingDescriptors => "pipes or device exports asked for or granted without their descriptors",
    NotAPipe => "a passed descriptor that is not a pipe's read end",
    NotACudaExport => "a descriptor passed with device sources that is not a CUDA export",
    Flood => "a peer that floods the connection",
    NotReading => "a peer that does not read what it is sent",
    HandshakeTimedOut => "the handshake did not finish in time",
    PartialFrameTimedOut => "a frame did not arrive whole in time",
    BadFrameSize => "a frame of a bad size",
    MalformedFrame => "a malformed frame",
    MissingMac => "a frame without its MAC",
    TrailingBytes => "trailing bytes in a frame",
    HelloWithoutTable => "a hello without its slot table",
    NotATable => "the descriptor passed with the hello is no slot table",
    TableUnmappable => "the slot table cannot be mapped",
    /// (`MSG_CTRUNC`).
    ControlTruncated => "descriptors passed beyond what a message takes were cut off",
    ClosesBacklogged =>
        "descriptors passed while too many wait to be closed (peers passed ones whose close blocks)",
    OtherVersion => "another protocol version",
    NoIdentity => "a server without an identity",
    HelloNotLive => "the hello named no live operation",
    BadSlot => "a request for a slot that does not exist or is in use",
    EagerReadTooLarge => "an eager read that is not a small host read",
    WriteBytesMismatch => "a write's bytes that do not match its ranges",
    UnprovenRequest => "a request without proof of its operation's key",
    DoneForNothing => "a done for no granted read",
    UnprovenDone => "a done without proof of its operation's key",
    /// (never from a peer).
    NoOpeningKey => "no opening key",
    NotTheOwner => "the server could not prove it is the agent its name advertises",
    ServerNotLive => "the server has no live operation with the opening key",
    BadProof => "the server could not prove it holds the opening key",
    /// (`Reject` received).
    ServerRejected => "the server rejected the connection",
    OutOfOrder => "a frame out of order",
    AnswerToNothing => "an answer to no open request",
    AnswerAfterGrant => "an answer to a read already granted",
    UnprovenAnswer => "an answer without proof of its operation's key",
    WrongAnswer => "an answer of the wrong kind for its request",
    GrantDoesNotFit => "a grant that does not fit its request",
    /// This server rejected the connection (sent `Reject`).
    Rejected => "rejected",
    /// (not the peer's doing, as far as this side knows).
    SocketFailed => "the socket failed",
    PeerClosed => "the peer closed the connection",
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.reason())
    }
}
