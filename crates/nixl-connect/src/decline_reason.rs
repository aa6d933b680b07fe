//! [`DeclineReason`]: why a path declined an active operation, in the few words a metric's label
//! carries.

use crate::sync::label_enum;

label_enum! {
/// Why a path declined an active operation, as `nixl_connect_path_declines_total`'s `reason`
/// label says it (one of a fixed few); the operation's `path_reason()` says it in full.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DeclineReason {
    /// The peer's agent name advertises no same-host endpoint (a Python Dynamo peer, or a
    /// connector that serves none).
    NoEndpoint => "no_endpoint",
    /// No same-host socket answers for the peer: another host, another network namespace with
    /// no shared socket directory, or a peer that exited.
    NoSocket => "no_socket",
    /// The peer runs as another user.
    OtherUser => "other_user",
    /// The peer is in another PID namespace and this kernel cannot name it (no pidfs).
    PidNamespace => "pid_namespace",
    /// The path does not move this memory (the pair of devices, or descriptors of mixed kinds).
    Memory => "memory",
    /// The peer or this side was busy a moment ago (a full backlog, too many operations or pipes
    /// in flight): the next operation asks again.
    Busy => "busy",
    /// The path is off for this connector.
    Off => "off",
    /// The connection failed or was closed before it could serve (a handshake that failed, an
    /// impostor on the socket name, a connection closed under the operation).
    Handshake => "handshake",
    /// The peer refused the connection or sent the operation on to the next path.
    Refused => "refused",
    /// Anything else (a system call that failed, a request too large for one frame, a device
    /// export that failed).
    Other => "other",
}
}

impl DeclineReason {
    /// Its place in [`ALL`](Self::ALL).
    pub(crate) const fn index(self) -> usize {
        self as usize
    }
}
