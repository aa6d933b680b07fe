//! [`DeclineReason`]: why a path declined an active operation, in the few words a metric's label
//! carries.

/// Why a path declined an active operation, as `nixl_connect_path_declines_total`'s `reason`
/// label says it (one of a fixed few); the operation's `path_reason()` says it in full.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DeclineReason {
    /// The peer's agent name advertises no same-host endpoint (a Python Dynamo peer, or a
    /// connector that serves none).
    NoEndpoint,
    /// No same-host socket answers for the peer: another host, another network namespace with
    /// no shared socket directory, or a peer that exited.
    NoSocket,
    /// The peer runs as another user.
    OtherUser,
    /// The peer is in another PID namespace and this kernel cannot name it (no pidfs).
    PidNamespace,
    /// The path does not move this memory (the pair of devices, or descriptors of mixed kinds).
    Memory,
    /// The peer or this side was busy a moment ago (a full backlog, too many operations or pipes
    /// in flight): the next operation asks again.
    Busy,
    /// The path is off for this connector.
    Off,
    /// The connection failed or was closed before it could serve (a handshake that failed, an
    /// impostor on the socket name, a connection closed under the operation).
    Handshake,
    /// The peer refused the connection or sent the operation on to the next path.
    Refused,
    /// Anything else (a system call that failed, a request too large for one frame, a device
    /// export that failed).
    Other,
}

impl DeclineReason {
    /// Every reason, in label order.
    pub(crate) const ALL: [DeclineReason; 10] = [
        Self::NoEndpoint,
        Self::NoSocket,
        Self::OtherUser,
        Self::PidNamespace,
        Self::Memory,
        Self::Busy,
        Self::Off,
        Self::Handshake,
        Self::Refused,
        Self::Other,
    ];

    /// The reason as the metric's label prints it.
    pub(crate) const fn as_str(self) -> &'static str {
        match self {
            Self::NoEndpoint => "no_endpoint",
            Self::NoSocket => "no_socket",
            Self::OtherUser => "other_user",
            Self::PidNamespace => "pid_namespace",
            Self::Memory => "memory",
            Self::Busy => "busy",
            Self::Off => "off",
            Self::Handshake => "handshake",
            Self::Refused => "refused",
            Self::Other => "other",
        }
    }

    /// Its place in [`ALL`](Self::ALL).
    pub(crate) const fn index(self) -> usize {
        self as usize
    }
}
