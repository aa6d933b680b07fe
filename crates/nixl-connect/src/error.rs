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
    // ---- the caller ----
    /// An argument can never work (empty descriptor list, mixed devices, read-only destination...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

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
    #[error("device mismatch: the descriptor claims {claimed} but the pointer is {actual}")]
    DeviceMismatch {
        /// The device the descriptor names.
        claimed: crate::device::Device,
        /// Where the driver says the memory is.
        actual: String,
    },

    /// Local and remote descriptors do not line up.
    #[error("descriptor mismatch: {0}")]
    DescriptorMismatch(String),

    // ---- the peer ----
    /// `RdmaMetadata` that does not parse, breaks a field rule, or that NIXL rejects.
    #[error("bad metadata in `{field}`: {reason}")]
    Metadata {
        /// The offending field (`descriptors[2].ptr`, `nixl_metadata`, `json`, ...).
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },

    /// The operation was refused: the peer's passive side has no live operation with the key
    /// (it completed, was cancelled or dropped), or the request breaks its scope (a range outside
    /// its descriptors, the wrong direction, a second writer), checked by the side that owns the
    /// memory on the same-host path; or this connector already completed an operation with the
    /// same metadata. [`Refusal::is_replay`] tells a replayed metadata string.
    #[error("peer {agent} refused the operation ({refusal}): {reason}")]
    Refused {
        /// The peer's NIXL agent name.
        agent: String,
        /// Why, as the owner's refusal code says.
        refusal: Refusal,
        /// What the refusing side said, in its words.
        reason: String,
    },

    // ---- the host ----
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

    // ---- the transfer ----
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

    /// The connector's engine thread has stopped (it panicked or the process is exiting).
    #[error("the connector's engine has stopped")]
    EngineStopped,

    // ---- the operation ----
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

    // ---- a channel ----
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
/// caused it, that error (`Error::source` gives it).
///
/// `Display` is `metadata channel: ` and what the channel was doing (`"cannot reach
/// http://..."`); the library's error behind it is `source()` ([`Error::report`] prints both).
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

/// Why the same-host path cannot move memory from one device to another in this build and
/// process ([`same_host_path`](crate::same_host_path)); such an operation takes NIXL.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
#[non_exhaustive]
pub enum PathRefusal {
    /// Host memory into device memory in a build without the `cuda` feature: NIXL moves it (with
    /// it, the device memory's owner pulls the bytes through pinned staging).
    #[error("{}", self.message())]
    HostIntoDevice,
    /// Device memory, but this build has no CUDA support (feature `cuda`).
    #[error("{}", self.message())]
    NoCudaSupport,
    /// Device memory, but this process has no usable CUDA driver or GPU.
    #[error("{}", self.message())]
    NoCudaDevice,
    /// Memory the same-host path does not move (XPU memory).
    #[error("{}", self.message())]
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
        Error::InvalidArgument(e.to_string())
    }
}

/// `Error::kind` from the variants' own names: the match is exhaustive, so a new variant cannot
/// be forgotten, and each name is the variant's identifier, so none can be misspelt.
macro_rules! kinds {
    ($($variant:ident),* $(,)?) => {
        impl Error {
            /// The variant's name (`"TimedOut"`, `"RemoteGone"`, ...), for bindings and logs.
            pub fn kind(&self) -> &'static str {
                match self {
                    $(Error::$variant { .. } => stringify!($variant),)*
                }
            }
        }
    };
}

kinds!(
    InvalidArgument,
    WrongPairing,
    DeviceMismatch,
    DescriptorMismatch,
    Metadata,
    Refused,
    NixlNotFound,
    NixlLoad,
    CudaUnavailable,
    NixlBackend,
    Os,
    Nixl,
    RemoteGone,
    Transfer,
    Interrupted,
    PathUnavailable,
    EngineStopped,
    Cancelled,
    TimedOut,
    Channel,
    NotPublished,
);

impl Error {
    /// An [`Error::Os`]: the OS refused `what` with `source`.
    pub fn os(what: impl Into<String>, source: std::io::Error) -> Self {
        Error::Os {
            what: what.into(),
            source: Arc::new(source),
        }
    }

    /// An [`Error::CudaUnavailable`] for `reason`, with the driver's error when there is one.
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
/// should see ([`Error::report`]). Every error of this crate says only what happened at its own
/// level and hands back its cause as `source()`; a cause whose text the report already ends
/// with (another library that repeats its own source) is left out.
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
mod tests {

    /// Every cause under `e`, and that no level's text repeats the level under it.
    fn assert_each_cause_once(e: &Error) -> Vec<String> {
        let mut texts = vec![e.to_string()];
        let mut cause = std::error::Error::source(e);
        while let Some(c) = cause {
            texts.push(c.to_string());
            cause = c.source();
        }
        for w in texts.windows(2) {
            assert!(!w[0].contains(&w[1]), "{:?} repeats its cause {:?}", w[0], w[1]);
        }
        texts
    }

    #[test]
    fn error_refusal_is_typed_and_tells_a_replay() {
        for (r, replay) in [
            (Refusal::NotLive, true),
            (Refusal::AlreadyCompleted, true),
            (Refusal::OutOfRange, false),
            (Refusal::WrongDirection, false),
            (Refusal::Busy, false),
        ] {
            assert_eq!(r.is_replay(), replay, "{r:?}");
            let e = Error::Refused {
                agent: "peer-1".into(),
                refusal: r,
                reason: "what the peer said".into(),
            };
            assert_eq!(e.kind(), "Refused");
            assert!(e.to_string().contains(&r.to_string()), "{e}");
        }
    }

    #[test]
    fn error_report_prints_each_cause_once() {
        let io = || std::io::Error::from_raw_os_error(libc::ENOMEM);
        let os = Error::os("mapping 1 GiB", io());
        let texts = assert_each_cause_once(&os);
        assert_eq!(texts.len(), 2, "Os and its io::Error: {texts:?}");
        let report = os.report().to_string();
        assert_eq!(report, format!("the OS refused mapping 1 GiB: {}", io()));
        assert_eq!(report.matches(&io().to_string()).count(), 1, "{report}");

        let channel = Error::channel_shared("cannot reach http://127.0.0.1:9/x", Arc::new(io()));
        assert_each_cause_once(&channel);
        let report = channel.report().to_string();
        assert_eq!(
            report,
            format!("metadata channel: cannot reach http://127.0.0.1:9/x: {}", io())
        );

        let gone = Error::RemoteGone {
            agent: "peer-1".into(),
            reason: "the transfer failed in UCX".into(),
            source: Some(Arc::new(io())),
        };
        assert_each_cause_once(&gone);
        assert!(gone.report().to_string().ends_with(&io().to_string()));
        // No source: the report is the Display.
        assert_eq!(
            Error::Cancelled.report().to_string(),
            Error::Cancelled.to_string()
        );
    }

    use std::error::Error as _;

    use super::*;
    use crate::device::Device;

    #[test]
    fn error_kind_is_the_variant_name() {
        let e = Error::TimedOut {
            after: std::time::Duration::from_secs(1),
            peer: None,
        };
        assert_eq!(e.kind(), "TimedOut");
        assert_eq!(Error::InvalidArgument("x".into()).kind(), "InvalidArgument");
        assert_eq!(Error::EngineStopped.kind(), "EngineStopped");
        // Every kind is its variant's name as `Debug` prints it.
        for e in [
            Error::Cancelled,
            Error::Channel("c".into()),
            Error::os("x", std::io::Error::other("y")),
        ] {
            assert!(format!("{e:?}").starts_with(e.kind()), "{e:?}");
        }
    }

    #[test]
    fn error_os_keeps_its_io_source() {
        let e = Error::os(
            "mapping 4096 bytes",
            std::io::Error::from_raw_os_error(libc::ENOMEM),
        );
        let src = e.source().expect("a source");
        // Shared (the error is `Clone`): the source is the `Arc` around the `io::Error`.
        let io = src.downcast_ref::<Arc<std::io::Error>>().expect("the io::Error");
        assert_eq!(io.raw_os_error(), Some(libc::ENOMEM));
        assert_eq!(e.to_string(), "the OS refused mapping 4096 bytes");
        assert!(
            e.report()
                .to_string()
                .starts_with("the OS refused mapping 4096 bytes: "),
            "{}",
            e.report()
        );
        // No blanket `From<io::Error>`: every OS error names what it was refused.
        let from = Error::os(
            "opening a socket",
            std::io::Error::from_raw_os_error(libc::EMFILE),
        );
        assert!(from.source().is_some());
    }

    #[test]
    fn error_channel_keeps_its_source() {
        let json = serde_json::from_str::<serde_json::Value>("{").unwrap_err();
        let e = Error::channel_from("the reply is not JSON", json);
        assert_eq!(e.to_string(), "metadata channel: the reply is not JSON");
        assert!(
            e.report()
                .to_string()
                .starts_with("metadata channel: the reply is not JSON: "),
            "{}",
            e.report()
        );
        let src = e
            .source()
            .and_then(|s| s.downcast_ref::<ErrorSource>())
            .expect("a source");
        assert!(src.downcast_ref::<serde_json::Error>().is_some(), "{src:?}");
        let Error::Channel(c) = &e else { panic!("{e:?}") };
        // Reads as its message, as the `String` it replaced did.
        assert!(c.message().contains("not JSON") && c.message().starts_with("the reply"));
        assert!(Error::channel("the listener stopped").source().is_none());
        assert_eq!(e.kind(), "Channel");
    }

    #[test]
    fn error_path_refusal_is_typed_and_reads_as_text() {
        match crate::same_host_path(Device::Host, Device::Cuda(0)) {
            Err(r) if !cfg!(feature = "cuda") => {
                assert_eq!(r, PathRefusal::HostIntoDevice);
                assert!(r.message().contains("host memory into device memory"), "{r}");
                assert_eq!(r.to_string(), r.message());
            }
            // A CUDA build on a host without a GPU.
            Err(r) => assert_eq!(r, PathRefusal::NoCudaDevice, "{r}"),
            // A CUDA build with a GPU: pulled through pinned staging.
            Ok(()) => {
                #[cfg(not(feature = "cuda"))]
                panic!("host into device memory on the same-host path needs the `cuda` feature")
            }
        }
        let r = crate::same_host_path(Device::Xpu(0), Device::Cuda(0)).unwrap_err();
        assert_eq!(r.to_string(), r.message());
        let xpu = crate::same_host_path(Device::Xpu(0), Device::Host).unwrap_err();
        assert_eq!(xpu, PathRefusal::UnsupportedMemory);
    }
}
