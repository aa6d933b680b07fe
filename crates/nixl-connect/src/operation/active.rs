//! Active operations: read from a readable or write into a writable, described by its metadata.

use std::sync::Arc;
use std::time::Duration;

use super::{OpState, OperationStatus};
use crate::descriptor::{check_local, Descriptor};
use crate::engine::transport::ActiveSpec;
use crate::engine::transport::OpId;
use crate::engine::{Cmd, Engine, Range};
use crate::error::{Error, Mismatch, Result};
use crate::metadata::{OperationKind, RdmaMetadata};
use crate::metrics::families::Side;

pub(crate) struct Active<'a> {
    engine: Engine,
    state: Arc<OpState>,
    descs: Vec<Descriptor<'a>>,
    key: Arc<str>,
    id: OpId,
    /// The peer's agent name, from its metadata.
    peer: Arc<str>,
}

/// Checks that `local` pairs with `remote` for `kind` before anything is posted.
pub(crate) fn check_pairing(
    remote: &RdmaMetadata,
    local: &[Descriptor<'_>],
    kind: OperationKind,
) -> Result<()> {
    remote.validate()?;
    let found = remote.kind()?;
    if found != kind {
        let read = kind == OperationKind::Read;
        return Err(Error::WrongPairing {
            operation: if read { "begin_read" } else { "begin_write" },
            expected: if read { "readable" } else { "writable" },
            found: if read { "writable" } else { "readable" },
            kind: remote.operation_kind,
            hint: if read {
                "begin_write to fill a writable"
            } else {
                "begin_read to read a readable"
            },
        });
    }
    check_local(local, kind == OperationKind::Read)?;
    if local.len() != remote.descriptors.len() {
        return Err(Error::DescriptorMismatch(Mismatch::Count {
            local: local.len(),
            remote: remote.descriptors.len(),
        }));
    }
    for (i, (l, r)) in local.iter().zip(&remote.descriptors).enumerate() {
        if l.size() as u64 != r.size {
            return Err(Error::DescriptorMismatch(Mismatch::Size {
                index: i,
                local: l.size() as u64,
                remote: r.size,
            }));
        }
    }
    Ok(())
}

impl<'a> Active<'a> {
    /// Begins the operation; an error is counted in the connector's metrics (an operation that
    /// began is counted when it ends).
    ///
    /// # Cancel safety
    /// Dropping the future before it returns drops the operation (as dropping it would).
    pub(crate) async fn begin(
        engine: &Engine,
        remote: &RdmaMetadata,
        descs: Vec<Descriptor<'a>>,
        kind: OperationKind,
    ) -> Result<Self> {
        let r = Self::start(engine, remote, descs, kind).await;
        if let (Err(e), Some(m)) = (&r, engine.metrics()) {
            m.error(kind, Side::Active, e);
        }
        r
    }

    async fn start(
        engine: &Engine,
        remote: &RdmaMetadata,
        descs: Vec<Descriptor<'a>>,
        kind: OperationKind,
    ) -> Result<Self> {
        check_pairing(remote, &descs, kind)?;
        super::producers_done(&descs).await?;
        let local: Vec<Range> = descs.iter().map(Descriptor::range).collect();
        let peer = engine.decode(&remote.nixl_metadata)?;
        let state = OpState::new(OperationStatus::InProgress);
        let bytes: u64 = descs.iter().map(|d| d.size() as u64).sum();
        if let Some(m) = engine.metrics() {
            state.observe(m.begin(kind, Side::Active, bytes));
        }
        let key: Arc<str> = remote.notification_key.as_str().into();
        let id = engine.next_op();
        state.trace(super::span(kind, "active", Some(id), bytes, descs.len()));
        // From here on, dropping `op` is the operation's own drop: owned memory goes to the
        // engine, borrowed memory waits until no transport touches it.
        let op = Active {
            engine: engine.clone(),
            state: state.clone(),
            descs,
            key: key.clone(),
            id,
            peer: peer.name.clone(),
        };
        state.mark_in_use();
        let spec = ActiveSpec {
            id,
            // A READ operation reads the readable; a WRITE operation writes the writable.
            write: kind == OperationKind::Write,
            local,
            remote: remote
                .descriptors
                .iter()
                .map(|d| Range {
                    addr: d.ptr as usize,
                    len: d.size as usize,
                    device: d.device,
                })
                .collect(),
            peer,
            key,
            state: state.clone(),
        };
        if let Err(e) = engine.send(Cmd::Begin { spec }) {
            // No engine, no transport: nothing can touch the memory. Ended here (the error is
            // counted once, by `begin`), so the drop below finds nothing to cancel.
            state.finish(OperationStatus::Errored, None);
            state.mark_released();
            return Err(e);
        }
        Ok(op)
    }

    /// Moves the registrations the engine made into the descriptors (so that reusing the memory
    /// does not register it again).
    fn attach_tokens(&mut self) {
        for (d, t) in self.descs.iter_mut().zip(self.state.take_tokens()) {
            d.attach(t);
        }
    }

    fn cancel(&self) {
        if self.state.finish(OperationStatus::Cancelled, None) {
            let _ = self.abandon(false);
        }
    }

    /// Tells the engine the operation is abandoned (`hard`: cut its transfer off).
    fn abandon(&self, hard: bool) -> Result<()> {
        self.engine.send(Cmd::Abandon { id: self.id, hard })
    }
}

impl Drop for Active<'_> {
    fn drop(&mut self) {
        if self.state.is_released() {
            // Borrowed HostBuffers keep the registrations for their next operation.
            self.attach_tokens();
            return;
        }
        self.state.finish(OperationStatus::Cancelled, None);
        let descs = std::mem::take(&mut self.descs);
        let mut owned = Vec::with_capacity(descs.len());
        let mut borrowed = Vec::new();
        for d in descs {
            match d.try_into_static() {
                Ok(s) if s.owns_memory() => owned.push(s),
                // Raw memory is borrowed too: its owner frees it once the descriptor is gone.
                Ok(raw) => borrowed.push(raw),
                Err(b) => borrowed.push(b),
            }
        }
        if self.abandon(false).is_err() {
            return; // no engine, no transport: nothing touches the memory
        }
        if borrowed.is_empty() {
            // Owned memory: the engine frees it once the transfer has ended. The command follows
            // the Begin in the engine's queue, so the engine always finds the operation (or has
            // already released it, and drops the memory at once).
            let _ = self.engine.send(Cmd::Adopt {
                id: self.id,
                keep: Box::new(owned),
            });
            return;
        }
        // Borrowed memory must not go back to its owner while a transport may still write it.
        // Give the transfer `cancel_grace` to end; then make the transport cut it off (for NIXL:
        // destroy the agent that posted it, the only way a posted transfer ends for sure).
        if !self.state.wait_released(Some(self.engine.cancel_grace())) {
            let _ = self.abandon(true);
            self.state.wait_released(None);
        }
    }
}

macro_rules! active_op {
    ($(#[$doc:meta])* $name:ident, $kind:expr) => {
        $(#[$doc])*
        ///
        /// # Drop
        /// Dropping it before completion cancels it, and never lets the memory go while a
        /// transport may still touch it. Owned memory is handed to the engine and freed once the
        /// transfer has ended (the drop does not block). Borrowed memory, and raw memory
        /// ([`Descriptor::from_raw_parts`]), makes the drop block
        /// until the transfer has stopped: the same-host path stops at once; a NIXL transfer gets
        /// [`ConnectorBuilder::cancel_grace`](crate::ConnectorBuilder::cancel_grace) to end, after
        /// which the connector destroys the NIXL agent that posted it (other NIXL transfers of
        /// this connector in flight then fail with [`Error::Interrupted`]).
        #[must_use = "dropping the operation cancels its transfer; await `wait_for_completion`"]
        pub struct $name<'a> {
            inner: Active<'a>,
        }

        impl<'a> $name<'a> {
            pub(crate) async fn begin(
                engine: &Engine,
                remote: &RdmaMetadata,
                descs: Vec<Descriptor<'a>>,
            ) -> Result<Self> {
                Ok(Self { inner: Active::begin(engine, remote, descs, $kind).await? })
            }

            /// The current status: `InProgress`, then `Complete`, `Cancelled` or `Errored`.
            pub fn status(&self) -> OperationStatus {
                self.inner.state.status()
            }

            /// The notification key this transfer sends to the peer.
            pub fn notification_key(&self) -> &str {
                &self.inner.key
            }

            /// Which path moves the bytes (`None` until a transport has taken the operation).
            pub fn path(&self) -> Option<crate::state::TransferPath> {
                self.inner.state.path()
            }

            /// Why a faster path declined this operation, when one did (it then went to the next
            /// path, NIXL): in words a user can act on, for example that the peer's socket
            /// directory is another user's. `None` when the first path offered took it. The
            /// connector also warns once per peer (`tracing`, level `warn`) with the same reason.
            pub fn path_reason(&self) -> Option<&str> {
                self.inner.state.declined()
            }

            /// How the same-host path moves the bytes, once it decided (`None` on another path,
            /// or before the peer answered): in its frames, by cross-memory attach, through
            /// pipes (a peer in another PID namespace), CUDA IPC or pinned staging.
            pub fn mechanism(&self) -> Option<crate::state::Mechanism> {
                self.inner.state.mechanism()
            }

            /// Waits until the transfer has completed.
            ///
            /// # Errors
            /// [`Error::TimedOut`] (naming the peer) when `timeout` passes first: the transfer
            /// goes on, wait again or drop it; [`Error::Refused`] when the peer's operation has
            /// ended or the request breaks its scope (a replayed metadata string);
            /// [`Error::RemoteGone`] when the peer's process or connector is gone;
            /// [`Error::Transfer`] or [`Error::Nixl`] when the transfer failed otherwise;
            /// [`Error::Interrupted`] when the connector cut off NIXL transfers for another
            /// operation's sake; [`Error::Cancelled`] after `cancel()`.
            /// A wait spin ([`ConnectorBuilder::wait_spin`](crate::ConnectorBuilder::wait_spin))
            /// applies.
            ///
            /// # Cancel safety
            /// Cancel safe: dropping the future leaves the transfer running.
            pub async fn wait_for_completion(&self, timeout: Option<Duration>) -> Result<()> {
                let bytes = self.inner.descs.iter().map(Descriptor::size).sum();
                self.inner
                    .engine
                    .wait(&self.inner.state, timeout, Some(&self.inner.peer), bytes).await
            }

            /// Marks the operation cancelled and wakes its waiters; the same-host path stops its
            /// copy at once. NIXL cannot stop a posted transfer, so over NIXL the memory stays in
            /// use until the transfer ends (dropping the operation then waits, see Drop).
            pub fn cancel(&self) {
                self.inner.cancel()
            }

            /// Gives the local descriptors back once NIXL has released them.
            ///
            /// # Errors
            /// Returns the operation unchanged while the transfer is still in flight.
            pub fn into_descriptors(mut self) -> Result<Vec<Descriptor<'a>>, Self> {
                if !self.inner.state.is_released() {
                    return Err(self);
                }
                self.inner.attach_tokens();
                Ok(std::mem::take(&mut self.inner.descs))
            }
        }

        impl std::fmt::Debug for $name<'_> {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($name))
                    .field("engine", &self.inner.engine.name())
                    .field("notification_key", &self.inner.key)
                    .field("status", &self.status())
                    .field("descriptors", &self.inner.descs)
                    .finish()
            }
        }
    };
}

active_op!(
    /// Reads a peer's [`ReadableOperation`](crate::ReadableOperation) into local memory; made by
    /// [`Connector::begin_read`](crate::Connector::begin_read).
    ReadOperation,
    OperationKind::Read
);
active_op!(
    /// Writes local memory into a peer's [`WritableOperation`](crate::WritableOperation); made by
    /// [`Connector::begin_write`](crate::Connector::begin_write).
    WriteOperation,
    OperationKind::Write
);

impl<'a> ReadOperation<'a> {
    /// The local descriptors the data is read into (Python's `results()`); complete once
    /// [`wait_for_completion`](Self::wait_for_completion) has returned `Ok`.
    pub fn results(&self) -> &[Descriptor<'a>] {
        &self.inner.descs
    }
}
