//! The library's one error type, grouped by who can act on it.

use std::path::PathBuf;
use std::sync::Arc;

/// The underlying cause an error carries (a NIXL status, ...), shared so that [`Error`] stays
/// `Clone`.
///
/// `std::error::Error::source` hands back this `Arc` itself (or `Arc<io::Error>` for
/// [`Error::Os`]): downcast to it first, then to the concrete error inside, for example
/// `e.source()?.downcast_ref::<ErrorSource>()?.downcast_ref::<serde_json::Error>()`.
pub type ErrorSource = Arc<dyn std::error::Error + Send + Sync>;

/// A specialised `Result` for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong, grouped by who can fix it.
///
/// - **The caller** passed something that cannot work: [`Error::InvalidArgument`],
///   [`Error::WrongPairing`], [`Error::DescriptorMismatch`], [`Error::DeviceMismatch`].
/// - **The peer** sent metadata that does not parse or that NIXL rejects: [`Error::Metadata`].
/// - **The host** lacks NIXL or a working backend: [`Error::NixlNotFound`], [`Error::NixlLoad`],
///   [`Error::NixlBackend`], [`Error::Os`], [`Error::CudaUnavailable`].
/// - **The peer's side of the operation** refused it: [`Error::Refused`] (its operation has ended,
///   a replayed metadata string, or the request breaks its scope).
/// - **The transfer** failed or its peer went away: [`Error::Nixl`], [`Error::Transfer`],
///   [`Error::RemoteGone`], [`Error::Interrupted`], [`Error::PathUnavailable`],
///   [`Error::EngineStopped`].
/// - **The operation** ended without data moving: [`Error::Cancelled`], [`Error::TimedOut`].
/// - **A metadata channel** (HTTP, NATS) failed: [`Error::Channel`], [`Error::NotPublished`].
///
/// `Display` says what happened at this level only; the error behind it (an OS, NIXL, CUDA, HTTP
/// or JSON error) is `source()`, never repeated in the text. [`Error::report`] prints the whole
/// chain, each cause once, as does any reporter that walks `source()` (anyhow's `{:#}`).
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An argument can never work (empty descriptor list, mixed devices, read-only destination...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// A device string that names no device (`"tpu:0"`): [`ParseDeviceError`] itself, kind
    /// [`ErrorKind::InvalidArgument`].
    ///
    /// [`ParseDeviceError`]: crate::ParseDeviceError
    #[error(transparent)]
    InvalidDevice(crate::device::ParseDeviceError),

    /// A read was paired with a writable's metadata, or a write with a readable's.
    #[error(
        "wrong pairing: {operation} needs metadata from a {expected} operation, but this metadata \
         comes from a {found} operation (operation_kind {kind}); use {hint}"
    )]
    WrongPairing {
        /// The operation being started (`begin_read` or `begin_write`).
        operation: &'static str,
        /// The passive kind it pairs with.
        expected: &'static str,
        /// The passive kind the metadata describes.
        found: &'static str,
        /// The raw `operation_kind`.
        kind: u8,
        /// What to call instead.
        hint: &'static str,
    },

    /// A descriptor claims a device its memory is not on (per the CUDA driver).
    #[error("device mismatch: the descriptor claims {claimed} but the pointer is on {actual}")]
    DeviceMismatch {
        /// The device the descriptor names.
        claimed: crate::device::Device,
        /// Where the driver says the memory is.
        actual: crate::device::Device,
    },

    /// Local and remote descriptors do not line up.
    #[error("descriptor mismatch: {0}")]
    DescriptorMismatch(Mismatch),

    /// `RdmaMetadata` that does not parse, breaks a field rule, or that NIXL rejects.
    #[error("bad metadata in `{field}`: {problem}")]
    Metadata {
        /// The offending field (`descriptors[].ptr`, `nixl_metadata`, `json`, ...).
        field: &'static str,
        /// What is wrong with it.
        problem: MetadataProblem,
        /// The decoder's own error, when one found it (serde_json's, base64's, zlib's, UTF-8's).
        #[source]
        source: Option<ErrorSource>,
    },

    /// The operation was refused, by the peer's passive side (its operation has ended, or the
    /// request breaks its scope) or by this connector (it already completed an operation with
    /// the same metadata): [`Refusal`] says which; [`Refusal::is_replay`] tells a replay.
    #[error("peer {agent} refused the operation ({refusal}): {reason}")]
    Refused {
        /// The peer's NIXL agent name.
        agent: String,
        /// Why, as the owner's refusal code says.
        refusal: Refusal,
        /// What the refusing side said, in its words.
        reason: String,
    },

    /// No NIXL library was found.
    #[error(
        "the NIXL library (libnixl_capi.so) was not found; run `bash scripts/setup.sh` in the \
         nixl-connect checkout, or `pip install nixl-cu13==1.5.1`, or point NIXL_CONNECT_LIB at the \
         folder holding libnixl_capi.so (searched: {})",
        searched.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
    )]
    NixlNotFound {
        /// Every path that was tried.
        searched: Vec<PathBuf>,
    },

    /// The NIXL library was found but could not be loaded.
    #[error("loading {path} failed: {reason}; reinstall NIXL with `bash scripts/setup.sh`")]
    NixlLoad {
        /// The library file.
        path: PathBuf,
        /// The dynamic loader's message.
        reason: String,
    },

    /// CUDA was asked for but no usable driver or device is present.
    #[error("CUDA is unavailable: {reason}")]
    CudaUnavailable {
        /// What is missing or failed.
        reason: String,
        /// The driver's error, when it gave one.
        #[source]
        source: Option<ErrorSource>,
    },

    /// NIXL loaded but its UCX backend is unusable.
    #[error("NIXL backend unavailable: {reason}")]
    NixlBackend {
        /// What failed.
        reason: String,
        /// NIXL's own error, when the call returned one.
        #[source]
        source: Option<ErrorSource>,
    },

    /// The operating system refused memory or I/O (for example mapping a [`HostBuffer`]).
    ///
    /// [`HostBuffer`]: crate::HostBuffer
    #[error("the OS refused {what}")]
    Os {
        /// What was being done.
        what: String,
        /// The operating system's error (`Error::source` gives this `Arc`).
        #[source]
        source: Arc<std::io::Error>,
    },

    /// A NIXL call failed.
    #[error("NIXL {op} failed{}", if status.is_empty() { String::new() } else { format!(": {status}") })]
    Nixl {
        /// The NIXL call.
        op: &'static str,
        /// What the failure means here (empty when NIXL's own error, the source, says it all).
        status: String,
        /// NIXL's own error, when the call returned one.
        #[source]
        source: Option<ErrorSource>,
    },

    /// The peer's process (or its connector) is gone: its connection closed, it could not be
    /// connected to, or it exited mid-transfer.
    #[error("remote agent {agent} is gone: {reason}")]
    RemoteGone {
        /// The peer's NIXL agent name.
        agent: String,
        /// What was observed.
        reason: String,
        /// The transport's own error, when it gave one (NIXL's status).
        #[source]
        source: Option<ErrorSource>,
    },

    /// The transfer failed for another reason than the peer's exit (the kernel refused a copy,
    /// the peer's memory went away under it...).
    #[error("the transfer with {agent} failed: {reason}")]
    Transfer {
        /// The peer's NIXL agent name.
        agent: String,
        /// What failed.
        reason: String,
        /// The transport's own error, when it gave one.
        #[source]
        source: Option<ErrorSource>,
    },

    /// The connector cut this NIXL transfer off to release another operation's memory from an
    /// unresponsive peer (NIXL can only end posted transfers by destroying the agent that posted
    /// them); the operation can be started again.
    #[error("the transfer with {agent} was interrupted: {reason}")]
    Interrupted {
        /// The peer's NIXL agent name.
        agent: String,
        /// Why.
        reason: String,
    },

    /// The connector's [`PathPolicy`](crate::PathPolicy) allows no path to this peer (for
    /// example `Local` for a peer on another host, or a Python peer).
    #[error("no allowed path to {agent}: {reason}")]
    PathUnavailable {
        /// The peer's NIXL agent name.
        agent: String,
        /// Why the allowed paths cannot reach it.
        reason: String,
        /// What the last path ran into, when it was an error of its own (the OS refusing the
        /// same-host socket, the CUDA driver, [`PathRefusal`]).
        #[source]
        source: Option<ErrorSource>,
    },

    /// The connector's engine thread has stopped (it panicked or the process is exiting), or
    /// does not exist in this process: a child of `fork()` using a connector its parent made.
    #[error(
        "the connector's engine has stopped (in a child of fork(), a connector made before the \
         fork has none: make a new Connector in this process)"
    )]
    EngineStopped,

    /// The operation was cancelled (by `cancel()` or by dropping it).
    #[error("the operation was cancelled")]
    Cancelled,

    /// The deadline passed first; the operation is still live and may be awaited again.
    #[error(
        "timed out after {after:?} waiting for the operation to complete{}",
        peer.as_deref().map(|p| format!(" (peer {p} has not finished)")).unwrap_or_default()
    )]
    TimedOut {
        /// The deadline that passed.
        after: std::time::Duration,
        /// The peer's agent name, when the operation has one (active operations).
        peer: Option<String>,
    },

    /// A metadata channel failed (unreachable server, protocol error, oversized document);
    /// [`ChannelError`] keeps the HTTP, NATS, I/O or JSON error behind it as its source.
    #[error(transparent)]
    Channel(ChannelError),

    /// Nothing is published there: the operation completed, was dropped, or never existed.
    #[error("nothing is published at {location}: the operation completed, was dropped, or never existed")]
    NotPublished {
        /// The URL or subject asked for.
        location: String,
    },
}

/// What [`Error::Channel`] carries: what the channel was doing and, when another library's error
/// caused it, that error as `source()`. `Display` is `metadata channel: ` and the message
/// (`"cannot reach http://..."`); [`Error::report`] prints both.
#[derive(Debug, Clone)]
pub struct ChannelError {
    message: String,
    source: Option<ErrorSource>,
}

impl ChannelError {
    /// A channel error with no underlying error (a refusal of the channel's own rules).
    pub fn new(message: impl Into<String>) -> Self {
        ChannelError {
            message: message.into(),
            source: None,
        }
    }

    /// A channel error caused by `source`; the message names what was being done (the source's
    /// own text is not repeated in it: [`Error::report`] prints each cause once).
    pub fn with_source(
        message: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        ChannelError::shared(message, Arc::new(source))
    }

    /// As [`ChannelError::with_source`], for a source already shared (or boxed, then shared).
    pub(crate) fn shared(message: impl Into<String>, source: ErrorSource) -> Self {
        ChannelError {
            message: message.into(),
            source: Some(source),
        }
    }

    /// The message, without the `metadata channel: ` prefix that `Display` adds.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl From<String> for ChannelError {
    fn from(message: String) -> Self {
        ChannelError::new(message)
    }
}

impl From<&str> for ChannelError {
    fn from(message: &str) -> Self {
        ChannelError::new(message)
    }
}

impl std::fmt::Display for ChannelError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "metadata channel: {}", self.message)
    }
}

impl std::error::Error for ChannelError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        // The `Arc` itself, as every variant of `Error` hands back its `ErrorSource`.
        self.source.as_ref().map(|e| e as _)
    }
}

/// Why an operation was refused ([`Error::Refused`]): the same-host protocol's refusal codes, and
/// this connector's own single-use rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
#[non_exhaustive]
pub enum Refusal {
    /// The peer has no live operation with this key: it completed, was cancelled or dropped (the
    /// metadata was used after its operation ended).
    #[error("no live operation with this key")]
    NotLive,
    /// This connector already completed an operation with this metadata (it is single-use).
    #[error("metadata already used")]
    AlreadyCompleted,
    /// A range lies outside the operation's descriptors.
    #[error("outside the operation's descriptors")]
    OutOfRange,
    /// A read of a writable, or a write of a readable.
    #[error("wrong direction")]
    WrongDirection,
    /// Another writer holds the writable.
    #[error("another writer holds it")]
    Busy,
}

impl Refusal {
    /// True when the metadata was used after its operation ended (a replay): asking again with
    /// the same metadata cannot succeed; the peer must expose the memory again.
    pub fn is_replay(self) -> bool {
        matches!(self, Refusal::NotLive | Refusal::AlreadyCompleted)
    }
}

/// How an active operation's descriptors fail to line up with the peer's ([`Error::DescriptorMismatch`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Mismatch {
    /// Not one local descriptor per remote one.
    #[error(
        "{local} local descriptors for {remote} remote descriptors; pass one local descriptor per \
         remote one"
    )]
    Count {
        /// Local descriptors.
        local: usize,
        /// Remote descriptors.
        remote: usize,
    },
    /// A local descriptor's size differs from its remote one's.
    #[error("descriptor {index}: local size {local} != remote size {remote}")]
    Size {
        /// The descriptor's position.
        index: usize,
        /// The local size in bytes.
        local: u64,
        /// The remote size in bytes.
        remote: u64,
    },
}

/// What is wrong with a field of a peer's metadata ([`Error::Metadata`]); the decoder's own
/// error, when one found it, is the error's `source()`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MetadataProblem {
    /// The document is not UTF-8.
    #[error("the document is not UTF-8")]
    NotUtf8,
    /// The JSON does not parse, has a key the model does not, or a value breaks a field's type
    /// or range (serde_json's error, naming it, is the source).
    #[error("does not parse as RdmaMetadata JSON")]
    Json,
    /// The descriptor list is empty.
    #[error("must contain at least one descriptor")]
    NoDescriptors,
    /// The descriptors name more than one kind of device.
    #[error("mixes device kinds; one operation moves one kind of memory")]
    MixedDevices,
    /// A range wraps past the end of the address space.
    #[error("a range wraps past the end of the address space")]
    RangeWraps,
    /// A field that must not be empty is.
    #[error("is empty")]
    Empty,
    /// `operation_kind` is neither READ (1) nor WRITE (2).
    #[error("{0} is neither READ (1) nor WRITE (2)")]
    UnknownKind(u8),
    /// Bad base64 after `b64:` (base64's error is the source).
    #[error("bad base64 after `b64:`")]
    Base64,
    /// Neither `b64:`-prefixed base64 nor hex.
    #[error("is neither `b64:`-prefixed base64 nor hex")]
    NotBase64NorHex,
    /// The bytes do not decompress as zlib data (zlib's error is the source).
    #[error("does not decompress as zlib data")]
    Zlib,
    /// The bytes decompress to more than `limit` bytes.
    #[error("decompresses to more than {limit} bytes; refusing it")]
    TooLarge {
        /// The bound ([`MAX_NIXL_METADATA`](crate::MAX_NIXL_METADATA)).
        limit: usize,
    },
    /// The bytes decompress to nothing.
    #[error("decompresses to nothing")]
    DecompressesToNothing,
    /// Not a loopback connector's metadata (`loopback:<agent name>`, feature `testing`).
    #[error(
        "not a loopback connector's metadata (`loopback:<agent name>`); a loopback connector \
         pairs only with loopback connectors"
    )]
    NotLoopback,
    /// The bytes are not NIXL's serialised agent metadata.
    #[error(
        "not NIXL agent metadata ({what} at byte {at}); pass the nixl_metadata a NIXL Connect \
         operation published"
    )]
    NotAgentMetadata {
        /// What the reader ran into.
        what: &'static str,
        /// The byte offset where it did.
        at: usize,
    },
    /// Two metadata blobs that must come from one agent come from two.
    #[error("metadata of agents {0} and {1} cannot be spliced")]
    AgentsDiffer(String, String),
}

/// Why the same-host path cannot move memory from one device to another in this build and
/// process ([`same_host_path`](crate::same_host_path)); such an operation takes NIXL.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
#[non_exhaustive]
#[error("{}", self.message())]
pub enum PathRefusal {
    /// Host memory into device memory in a build without the `cuda` feature: NIXL moves it (with
    /// it, the device memory's owner pulls the bytes through pinned staging).
    HostIntoDevice,
    /// Device memory, but this build has no CUDA support (feature `cuda`).
    NoCudaSupport,
    /// Device memory, but this process has no usable CUDA driver or GPU.
    NoCudaDevice,
    /// Memory the same-host path does not move (XPU memory).
    UnsupportedMemory,
}

impl PathRefusal {
    /// The reason, as text.
    pub fn message(&self) -> &'static str {
        match self {
            PathRefusal::HostIntoDevice => {
                "host memory into device memory takes the NIXL path in a build without CUDA support"
            }
            PathRefusal::NoCudaSupport => "this build has no CUDA support (feature `cuda`)",
            PathRefusal::NoCudaDevice => "no usable CUDA driver or GPU in this process",
            PathRefusal::UnsupportedMemory => {
                "the same-host path moves host and CUDA memory only; other memory takes the NIXL path"
            }
        }
    }
}

impl From<crate::device::ParseDeviceError> for Error {
    fn from(e: crate::device::ParseDeviceError) -> Self {
        Error::InvalidDevice(e)
    }
}

/// [`ErrorKind`] from the kinds' names: the enum, its names and the list of them from one list,
/// so none can be misspelt or left out of [`ErrorKind::ALL`].
macro_rules! kinds {
    ($($kind:ident),* $(,)?) => {
        /// What kind of error an [`Error`] is, as bindings, logs and metrics need it: one kind per
        /// variant of [`Error`], except [`Error::InvalidDevice`], which is an
        /// [`ErrorKind::InvalidArgument`]. The Python module chooses its exception class by it.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum ErrorKind {
            $(#[doc = concat!("[`Error::", stringify!($kind), "`].")] $kind,)*
        }

        impl ErrorKind {
            /// Every kind, in the order of [`Error`]'s variants.
            pub const ALL: &'static [ErrorKind] = &[$(ErrorKind::$kind,)*];

            /// The kind's name (`"TimedOut"`, `"RemoteGone"`, ...): the name of its variant.
            pub fn as_str(self) -> &'static str {
                match self {
                    $(ErrorKind::$kind => stringify!($kind),)*
                }
            }
        }

        impl Error {
            /// The error's [`ErrorKind`] (its variant, for bindings, logs and metrics).
            pub fn kind(&self) -> ErrorKind {
                match self {
                    Error::InvalidDevice(_) => ErrorKind::InvalidArgument,
                    $(Error::$kind { .. } => ErrorKind::$kind,)*
                }
            }
        }
    };
}

kinds! {
    InvalidArgument, WrongPairing, DeviceMismatch, DescriptorMismatch, Metadata, Refused,
    NixlNotFound, NixlLoad, CudaUnavailable, NixlBackend, Os, Nixl, RemoteGone, Transfer,
    Interrupted, PathUnavailable, EngineStopped, Cancelled, TimedOut, Channel, NotPublished,
}

impl std::fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg_attr(
    not(any(feature = "http", feature = "nats", feature = "etcd")),
    allow(dead_code)
)]
impl Error {
    /// An [`Error::Channel`] with no underlying error.
    pub(crate) fn channel(message: impl Into<String>) -> Self {
        Error::Channel(ChannelError::new(message))
    }

    /// An [`Error::Channel`] caused by `source` while doing `what`.
    pub(crate) fn channel_from(
        what: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Error::channel_shared(what, Arc::new(source))
    }

    /// An [`Error::Channel`] caused by `source` (already shared or boxed) while doing `what`.
    pub(crate) fn channel_shared(what: impl Into<String>, source: ErrorSource) -> Self {
        Error::Channel(ChannelError::shared(what, source))
    }

    /// An [`Error::TimedOut`] after `after`, with no peer named.
    pub(crate) fn timed_out(after: std::time::Duration) -> Self {
        Error::TimedOut { after, peer: None }
    }
}

impl Error {
    /// Why the peer refused the operation, for [`Error::Refused`].
    pub fn refusal(&self) -> Option<Refusal> {
        match self {
            Error::Refused { refusal, .. } => Some(*refusal),
            _ => None,
        }
    }

    /// An [`Error::Metadata`] about `field`, found by this crate's own rules.
    pub(crate) fn metadata(field: &'static str, problem: MetadataProblem) -> Self {
        Error::Metadata {
            field,
            problem,
            source: None,
        }
    }

    /// An [`Error::Metadata`] about `field`, found by a decoder whose error is `source`.
    pub(crate) fn metadata_from(
        field: &'static str,
        problem: MetadataProblem,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Error::Metadata {
            field,
            problem,
            source: Some(Arc::new(source)),
        }
    }

    /// An [`Error::Os`]: the OS refused `what` with `source`.
    pub fn os(what: impl Into<String>, source: std::io::Error) -> Self {
        Error::Os {
            what: what.into(),
            source: Arc::new(source),
        }
    }

    /// An [`Error::CudaUnavailable`] for `reason`, with the driver's error when there is one.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn cuda_unavailable(reason: impl Into<String>, source: Option<ErrorSource>) -> Self {
        Error::CudaUnavailable {
            reason: reason.into(),
            source,
        }
    }

    /// True for errors that retrying the same call cannot fix (caller, peer metadata, host setup).
    pub fn is_permanent(&self) -> bool {
        matches!(
            self,
            Error::InvalidArgument(_)
                | Error::InvalidDevice(_)
                | Error::WrongPairing { .. }
                | Error::DescriptorMismatch(_)
                | Error::DeviceMismatch { .. }
                | Error::Metadata { .. }
                | Error::NixlNotFound { .. }
                | Error::NixlLoad { .. }
                | Error::NixlBackend { .. }
                | Error::Refused { .. }
                | Error::PathUnavailable { .. }
        )
    }
}

/// An error and each cause under it, once each, joined by `": "`: what a log line or a user
/// should see ([`Error::report`]). A cause whose text the report already ends with (another
/// library that repeats its own source) is left out.
pub struct Report<'a>(&'a (dyn std::error::Error + 'static));

impl std::fmt::Display for Report<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut out = self.0.to_string();
        let mut cause = self.0.source();
        while let Some(c) = cause {
            let text = c.to_string();
            if !text.is_empty() && !out.ends_with(&text) {
                out.push_str(": ");
                out.push_str(&text);
            }
            cause = c.source();
        }
        f.write_str(&out)
    }
}

impl std::fmt::Debug for Report<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

impl Error {
    /// This error with its causes, each once (`"the OS refused mapping 1 GiB: Cannot allocate
    /// memory (os error 12)"`). `Display` alone says only what happened at this level.
    pub fn report(&self) -> Report<'_> {
        Report(self)
    }
}

#[cfg(test)]
mod tests;
