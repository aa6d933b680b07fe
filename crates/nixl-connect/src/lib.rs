//! # nixl-connect
//!
//! Move tensors and buffers between inference workers through [NIXL], the way NVIDIA Dynamo's
//! Python `dynamo.nixl_connect` does, with the same names and the same JSON, so Rust and Python
//! workers pair freely.
//!
//! A worker exposes memory with [`Connector::create_readable`] or [`Connector::create_writable`],
//! hands the operation's [`RdmaMetadata`] (a small JSON document) to its peer over any channel,
//! and awaits completion. The peer passes that metadata to [`Connector::begin_read`] or
//! [`Connector::begin_write`], which moves the data directly through NIXL (UCX underneath: RDMA
//! where the hardware has it, shared memory or TCP where it does not).
//!
//! ```no_run
//! # async fn demo(json_from_peer: &str) -> nixl_connect::Result<()> {
//! use nixl_connect::{Connector, Descriptor, RdmaMetadata};
//! let conn = Connector::new()?;
//! let remote: RdmaMetadata = json_from_peer.parse()?;
//! let size = remote.descriptors[0].size as usize;
//! let read = conn.begin_read(&remote, Descriptor::from(vec![0u8; size])).await?;
//! read.wait_for_completion(None).await?;
//! let bytes = read.results()[0].as_slice().unwrap();
//! # let _ = bytes; Ok(()) }
//! ```
//!
//! ## What differs from the Python module
//! - Completion is event-driven: a per-connector engine thread polls NIXL only while something is
//!   outstanding and wakes exactly the waiting operation (no 5-100 ms sleep).
//! - Memory registrations and remote agents are cached; a reused buffer is registered once.
//! - `wait_for_completion` takes an optional timeout, and a dead peer is an error, not a hang.
//! - NIXL is loaded at run time from the `nixl-cu13`/`nixl-cu12` wheel (see
//!   [`Error::NixlNotFound`] for where it is looked for); its absence is an error, never an abort.
//!
//! [NIXL]: https://github.com/ai-dynamo/nixl
#![deny(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs)]

mod buffer;
pub mod channel;
mod connector;
#[cfg(feature = "cuda")]
pub mod cuda;
mod decline_reason;
mod descriptor;
mod device;
mod engine;
mod error;
mod ipc_source;
#[cfg(test)]
mod layers;
mod metadata;
pub mod metrics;
mod operation;
mod pace;
mod path_probe;
mod reg;
mod registration;
mod settings;
mod state;
mod stats;
mod sync;
mod sys;

/// Entry points for the coverage-guided fuzz targets under `fuzz/`: each takes untrusted bytes
/// as a peer would send them and must return (never panic, hang or allocate without bound).
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing {
    use crate::engine::nixl::md;
    use crate::engine::same_host::wire::{Msg, MAX_FRAME};

    /// A peer's `RdmaMetadata` JSON, then its `nixl_metadata` decoded and parsed.
    pub fn metadata_json(data: &[u8]) {
        let Ok(s) = std::str::from_utf8(data) else { return };
        if let Ok(m) = crate::RdmaMetadata::from_json(s) {
            if let Ok(raw) = crate::engine::nixl::encoding::decode(&m.nixl_metadata) {
                let _ = md::parse(&raw);
            }
        }
    }

    /// NIXL agent metadata as a peer sends it (decompressed): parsed strictly, fingerprinted, and
    /// spliced with itself.
    pub fn agent_metadata(data: &[u8]) {
        if let Ok(m) = md::parse(data) {
            assert!(m.sections_at() <= data.len());
            let _ = md::identity(data);
            let out = md::splice(data, data).expect("a blob splices with itself");
            assert_eq!(out, data, "splicing a blob with itself gives it back");
        }
    }

    /// A stream of same-host frames as either side reads it: every frame that decodes encodes
    /// back to the same bytes (its MAC kept), and its encoded length is exact.
    pub fn wire_frames(data: &[u8]) {
        let mut at = 0;
        while let Ok(Some((f, used))) = Msg::decode(&data[at..], MAX_FRAME) {
            let mut again = Vec::new();
            f.msg.encode_signed(&mut again, |_| f.mac.unwrap_or_default());
            assert_eq!(
                &again[..],
                &data[at..at + used],
                "{:?} re-encodes differently",
                f.msg
            );
            assert_eq!(f.msg.encoded_len(), used);
            at += used;
        }
    }

    /// Sequences of frames, honest and forged, into a connected pair of same-host protocol
    /// cores (the driver and its invariants: `engine/same_host/link/fuzz.rs`).
    pub fn link_sequences(data: &[u8]) {
        crate::engine::same_host::link::fuzz::run(data);
    }
}

pub use buffer::{HostBuffer, HUGE_PAGE};
pub use connector::{
    Connector, ConnectorBuilder, DEFAULT_CANCEL_GRACE, DEFAULT_PROGRESS_DELAY, DEFAULT_QUARANTINE_LIMIT,
    DEFAULT_WAIT_SPIN, MAX_PROGRESS_DELAY, MAX_WAIT_SPIN,
};
pub use descriptor::{Descriptor, Descriptors, OwnedMemory, Plain};
pub use device::{Device, DeviceKind, ParseDeviceError};
pub use engine::nixl::encoding::MAX_NIXL_METADATA;
pub use engine::nixl::{MAX_RETIRED_EXPOSERS, REGISTERED_QUARANTINE};
pub use error::{
    ChannelError, Error, ErrorKind, ErrorSource, MetadataProblem, Mismatch, PathRefusal, Refusal, Report,
    Result,
};
pub use metadata::{OperationKind, RdmaMetadata, SerializedDescriptor};
pub use operation::{
    Mechanism, OperationStatus, PathPolicy, ReadOperation, ReadableOperation, TransferPath,
    WritableOperation, WriteOperation,
};
pub use path_probe::PathProbe;
pub use registration::Registration;
pub use settings::WAIT_SPIN_ENV;
pub use stats::EngineStats;

/// Whether the same-host path can move bytes from memory on `src` into memory on `dst` in this
/// build and process (the peer must agree too: same user, same host, and for device memory CUDA
/// in both processes); `Err` says why not, and the operation then takes NIXL.
///
/// Host to host goes through cross-memory attach; device memory as a source goes through CUDA
/// IPC (feature `cuda`), into device or host memory; host memory into device memory is pulled
/// through pinned staging by the device memory's owner (feature `cuda`; NIXL without it).
///
/// # Errors
/// The [`PathRefusal`] that says why the same-host path cannot take the pair.
pub fn same_host_path(src: Device, dst: Device) -> std::result::Result<(), PathRefusal> {
    match (src, dst) {
        (Device::Host, Device::Host) => Ok(()),
        (s, d) => engine::same_host::device_path_refusal(s, d).map_or(Ok(()), Err),
    }
}

/// Whether the same-host path reaches Rust peers in another PID namespace of this host (pods on
/// one node that share only a socket directory, `NIXL_CONNECT_SOCKET_DIR`): `Ok` where the kernel
/// names processes by their pidfs ids (Linux 6.9 or later), which bind a connection to its two
/// processes from any namespace; host memory then moves through pipes. `Err` says why not: such
/// peers take NIXL.
pub fn same_host_across_pid_namespaces() -> std::result::Result<(), String> {
    let why = "this kernel has no pidfs (Linux 6.9 or later), so a peer in another PID namespace cannot be \
               named";
    engine::same_host::pidfs().then_some(()).ok_or_else(|| why.into())
}

/// For users' own tests (feature `testing`): connectors over an in-process loopback transport
/// that need no NIXL library and no socket.
///
/// A loopback connector ([`ConnectorBuilder::build_loopback`]) pairs with the other loopback
/// connectors of its process, by agent name, and copies bytes through the kernel
/// (`process_vm_readv` on itself). Every operation runs the same engine and the same state
/// machines as over NIXL: completion exactly once on both sides, deadlines, cancel, drop at any
/// point, replayed metadata refused, a gone peer reported as [`Error::RemoteGone`]. Its metadata
/// is `loopback:<agent name>` in `nixl_metadata`, which only loopback connectors read, and its
/// operations report [`TransferPath::Loopback`].
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> nixl_connect::Result<()> {
/// use nixl_connect::{Connector, Descriptor};
/// let (a, b) = (Connector::builder().build_loopback()?, Connector::builder().build_loopback()?);
/// let readable = a.create_readable(Descriptor::from(vec![7u8; 64])).await?;
/// let read = b.begin_read(readable.metadata(), Descriptor::from(vec![0u8; 64])).await?;
/// read.wait_for_completion(None).await?;
/// readable.wait_for_completion(None).await?;
/// assert_eq!(read.results()[0].as_slice(), Some(&[7u8; 64][..]));
/// # Ok(()) }
/// ```
#[cfg(any(test, feature = "testing"))]
pub mod testing {
    use crate::Connector;

    /// Holds (`true`) or releases (`false`) the active transfers of a loopback connector: while
    /// held, its reads and writes stay in flight, which is how a test reaches the in-flight
    /// states (cancel, drop, the peer's operation ending under a transfer). Returns false when
    /// `connector` is not a live loopback connector.
    pub fn stall(connector: &Connector, on: bool) -> bool {
        crate::engine::loopback::node(connector.name())
            .map(|n| n.stall(on))
            .is_some()
    }

    /// Makes every spin of this process (a small operation's wait, the engine's after an event,
    /// the copy pool's, the Python module's at the call) go on as if no yield ever overran, for
    /// as long as the process lives, so that tests of spins do not depend on the machine's load.
    pub fn keep_spinning() {
        crate::pace::keep_spinning();
    }

    /// How many turns callers have taken of `connector`'s engine (a small operation's waiter
    /// drives its engine: see docs/decisions/0005-who-drives.md).
    pub fn driven_turns(connector: &Connector) -> u64 {
        connector.engine().drive().turns()
    }

    /// How many times a caller's turn of `connector`'s engine, watching NIXL while the engine
    /// stood down, saw a peer's completion or a transfer in flight end (see [`driven_turns`]).
    pub fn caller_watch_events(connector: &Connector) -> u64 {
        connector.engine().drive().watch_events()
    }

    /// How many NIXL transfers callers have posted on their own turns of `connector`'s engine
    /// (see [`driven_turns`]): small ones over peers, memory and lists NIXL had ready.
    pub fn caller_starts(connector: &Connector) -> u64 {
        connector.engine().drive().caller_starts()
    }

    /// How many commands (a small begin or exposure, an exposure's end) callers have handled on
    /// their own turns of `connector`'s engine (see [`driven_turns`]).
    pub fn caller_commands(connector: &Connector) -> u64 {
        connector.engine().drive().commands()
    }

    /// How many waits drive `connector`'s engine now: while any does, the engine's sleep does
    /// not see its sockets (see [`driven_turns`]).
    pub fn driving_waits(connector: &Connector) -> usize {
        connector.engine().drive().driving_waits()
    }

    /// Returns once `connector`'s engine has acted on everything sent to it before this call
    /// (an operation begun, dropped or cancelled, a stall released) and run its transports once
    /// more: a deterministic step for tests, in place of sleeping. Over the loopback transport, a
    /// transfer that is not stalled has then run and reached its peer; the peer's own engine
    /// takes it up on its next turn (settle the peer too).
    ///
    /// # Errors
    /// [`crate::Error::EngineStopped`] when the connector's engine has stopped.
    ///
    /// # Cancel safety
    /// Cancel-safe: dropping the future only drops the answer.
    pub async fn settle(connector: &Connector) -> crate::Result<()> {
        connector
            .engine()
            .call(|reply| crate::engine::Cmd::Settle { reply })
            .await
    }
}

/// The Python module's wait at the call (not a public API): yields this thread's core until
/// `done` says so or `limit` passes, and returns at once where spinning does not pay on this
/// core (an oversubscribed host). True when `done` said so.
#[doc(hidden)]
pub fn __spin_until(limit: std::time::Duration, mut done: impl FnMut() -> bool) -> bool {
    if !pace::worthwhile() {
        return done();
    }
    let until = std::time::Instant::now() + limit;
    loop {
        if done() {
            return true;
        }
        if std::time::Instant::now() >= until || !pace::yield_core() {
            return false;
        }
    }
}

/// Where NIXL is looked for, and what was loaded.
pub mod nixl_library {
    pub use crate::engine::nixl::ffi::{NIXL_SYS_VERSION, SUPPORTED_RELEASES};
    pub use crate::settings::{NIXL_LIB_ENV, SKIP_VERSION_ENV};

    /// Every path searched for `libnixl_capi.so`, in order (see [`NIXL_LIB_ENV`]).
    pub fn candidates() -> Vec<std::path::PathBuf> {
        crate::engine::nixl::ffi::candidates()
    }

    /// Names folders holding `libnixl_capi.so` to search before the default places (after
    /// `$NIXL_CONNECT_LIB`); for host programs that know where NIXL is (the Python module names
    /// its environment's `nixl_cu13` package). Has no effect once NIXL is loaded.
    pub fn prefer(dirs: Vec<std::path::PathBuf>) {
        crate::engine::nixl::ffi::prefer(dirs)
    }

    /// Finds and loads NIXL (once per process); returns the library's path.
    ///
    /// # Errors
    /// [`crate::Error::NixlNotFound`] or [`crate::Error::NixlLoad`].
    pub fn load() -> crate::Result<std::path::PathBuf> {
        crate::engine::nixl::ffi::load()
    }
}

#[cfg(test)]
mod send_sync {
    use super::*;

    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>(_: &T) {}

    #[test]
    fn api_types_are_send_and_sync() {
        send_sync::<Connector>();
        send_sync::<Descriptor<'static>>();
        send_sync::<HostBuffer>();
        send_sync::<ReadableOperation<'static>>();
        send_sync::<WritableOperation<'static>>();
        send_sync::<ReadOperation<'static>>();
        send_sync::<WriteOperation<'static>>();
        send_sync::<RdmaMetadata>();
        send_sync::<Error>();
    }

    #[allow(dead_code, unreachable_code, clippy::diverging_sub_expression)]
    fn futures_are_send(c: Connector, md: RdmaMetadata, r: ReadableOperation<'static>) {
        send(&c.create_readable(Descriptor::from(vec![0u8; 1])));
        send(&c.create_writable(Descriptor::from(vec![0u8; 1])));
        send(&c.begin_read(&md, Descriptor::from(vec![0u8; 1])));
        send(&c.begin_write(Descriptor::from(vec![0u8; 1]), &md));
        send(&r.wait_for_completion(None));
    }
}
