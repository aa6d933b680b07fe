//! What a connection's core tells its owner: what the peer said, checked ([`Heard`], with a
//! server's [`Request`]), and what the owner answers a request with ([`Answer`]).

use std::sync::Arc;

use crate::engine::same_host::wire::{IpcSource, RefuseCode, Req};

/// What the peer said, checked: well-formed, expected in its state, proven where it must be.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Heard {
    /// Server: the client's `Hello` (the descriptor passed with it is its slot table; `Welcome`
    /// is queued behind whatever the owner does with it).
    Hello,
    /// Server: the client trusts this side; it uses pipes (then its writes' requests pass
    /// descriptors) or not (then no descriptor is taken again).
    Trusted { pipes: bool },
    /// Server: a request proven under its operation's key.
    Req(Request),
    /// Server: the next `fds` passed descriptors came with a request that is not served (no
    /// live operation has its key, too many open): they are closed.
    Unused { fds: usize },
    /// Either side: the peer gave back these VMM exports; this side's mappings of them may go.
    Forgot { ids: Vec<u64> },
    /// Server: the reader finished copying a granted read.
    ReadDone {
        slot: u32,
        gen: u64,
        ok: bool,
        key: Arc<str>,
    },
    /// Client: the server proved it is the advertised owner and holds the opening operation's
    /// key; requests may follow.
    Ready,
    /// Client: the server proved it is the advertised owner and has no live operation with the
    /// opening key `key` (a replayed metadata string); the connection is closed.
    NotLive { key: Arc<str> },
    /// Client: the server could not prove it is the owner its agent name advertises (another
    /// process holds the socket name: a metadata holder, a squatter), or the owner's proof of the
    /// opening key failed; the connection is closed.
    Impostor,
    /// Client: the server refused the connection (another user, too many connections, version).
    Rejected { reason: String },
    /// Client: a read may copy now (`sources`: the device memory's CUDA IPC exports).
    Grant {
        slot: u32,
        gen: u64,
        sources: Option<Vec<IpcSource>>,
    },
    /// Client: a host read may copy now from the `lanes` pipes whose read ends came with it
    /// (the next `lanes` passed descriptors).
    GrantPipe { slot: u32, gen: u64, lanes: u8 },
    /// Client: the request was refused.
    Refused {
        slot: u32,
        gen: u64,
        code: RefuseCode,
        reason: String,
    },
    /// Client: the operation cannot take this path; use NIXL.
    Fallback { slot: u32, gen: u64, reason: String },
    /// Client: an eager read's bytes, proven, exactly as many as requested (the read is over: no
    /// `Done` is sent).
    Data { slot: u32, gen: u64, data: Vec<u8> },
    /// Client: the server finished copying a write.
    WriteDone {
        slot: u32,
        gen: u64,
        ok: bool,
        reason: String,
    },
}

/// A proven request, as the server's scope policy receives it.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Request {
    /// What the frame asked.
    pub(crate) req: Req,
    /// The operation's notification key (the frame named its key id).
    pub(crate) key: Arc<str>,
    /// The descriptors that came with this request (a write's pipes' read ends or VMM
    /// descriptors), counted off by the core: the owner takes or closes exactly these.
    pub(crate) passed: usize,
}

/// The server's answer to an open request.
#[derive(Debug)]
pub(crate) enum Answer {
    /// A host read may copy now.
    Grant,
    /// A device read may copy now, through these exports (one per requested range).
    GrantIpc(Vec<IpcSource>),
    /// A host read may copy now from this many pipes (their read ends go with the answer).
    GrantPipe(u8),
    /// An eager read's bytes (ends the request; anything but exactly the bytes requested, for an
    /// eager read, is sent as a `Fallback` instead).
    Data(Vec<u8>),
    /// Refused (ends the request).
    Refuse(RefuseCode, String),
    /// Take NIXL (ends the request).
    Fallback(String),
    /// The write was copied (or failed) here (ends the request).
    WriteDone { ok: bool, reason: String },
}
