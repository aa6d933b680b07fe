//! Active operations: read from a readable or write into a writable, described by its metadata.

use std::sync::Arc;
use std::time::Duration;

use super::{wait, OperationStatus};
use crate::descriptor::{check_local, Descriptor};
use crate::engine::{Cmd, Engine, OpState, Range};
use crate::error::{Error, Result};
use crate::metadata::{OperationKind, RdmaMetadata};

pub(crate) struct Active<'a> {
    engine: Engine,
    state: Arc<OpState>,
    descs: Vec<Descriptor<'a>>,
    key: String,
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
        return Err(match kind {
            OperationKind::Read => Error::WrongPairing {
                operation: "begin_read",
                expected: "readable",
                found: "writable",
                kind: remote.operation_kind,
                hint: "begin_write to fill a writable",
            },
            OperationKind::Write => Error::WrongPairing {
                operation: "begin_write",
                expected: "writable",
                found: "readable",
                kind: remote.operation_kind,
                hint: "begin_read to read a readable",
            },
        });
    }
    check_local(local, kind == OperationKind::Read)?;
    if local.len() != remote.descriptors.len() {
        return Err(Error::DescriptorMismatch(format!(
            "{} local descriptors for {} remote descriptors; pass one local descriptor per remote one",
            local.len(),
            remote.descriptors.len()
        )));
    }
    for (i, (l, r)) in local.iter().zip(&remote.descriptors).enumerate() {
        if l.size() as u64 != r.size {
            return Err(Error::DescriptorMismatch(format!(
                "descriptor {i}: local size {} != remote size {}",
                l.size(),
                r.size
            )));
        }
    }
    Ok(())
}

impl<'a> Active<'a> {
    pub(crate) async fn begin(
        engine: &Engine,
        remote: &RdmaMetadata,
        mut descs: Vec<Descriptor<'a>>,
        kind: OperationKind,
    ) -> Result<Self> {
        check_pairing(remote, &descs, kind)?;
        let local: Vec<Range> = descs
            .iter()
            .map(|d| Range {
                addr: d.ptr(),
                len: d.size(),
                device: d.device(),
            })
            .collect();
        let remote_ranges: Vec<Range> = remote
            .descriptors
            .iter()
            .map(|d| Range {
                addr: d.ptr as usize,
                len: d.size as usize,
                device: d.device,
            })
            .collect();
        let state = OpState::new(OperationStatus::InProgress, false);
        let key = remote.notification_key.clone();
        let tokens = engine
            .call(|reply| Cmd::Active {
                // A READ operation reads the readable; a WRITE operation writes the writable.
                write: kind == OperationKind::Write,
                local,
                remote: remote_ranges,
                remote_md: remote.nixl_metadata.clone(),
                key: key.clone(),
                state: state.clone(),
                reply,
            })
            .await??;
        for (d, t) in descs.iter_mut().zip(tokens) {
            d.attach(t);
        }
        Ok(Self {
            engine: engine.clone(),
            state,
            descs,
            key,
        })
    }
}

impl Drop for Active<'_> {
    fn drop(&mut self) {
        if self.state.is_released() {
            return;
        }
        self.state.finish(OperationStatus::Cancelled, None);
        let descs = std::mem::take(&mut self.descs);
        let mut owned = Vec::with_capacity(descs.len());
        let mut borrowed = Vec::new();
        for d in descs {
            match d.try_into_static() {
                Ok(s) => owned.push(s),
                Err(b) => borrowed.push(b),
            }
        }
        if borrowed.is_empty() {
            // Owned memory: hand it to the engine, which frees it once NIXL lets go.
            if self
                .engine
                .send(Cmd::Adopt {
                    state: self.state.clone(),
                    keep: Box::new(owned),
                })
                .is_ok()
            {
                return;
            }
        }
        // Borrowed memory must not be released to its owner while NIXL may still write it.
        self.state.wait_released();
        drop(borrowed);
    }
}

macro_rules! active_op {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        ///
        /// # Drop
        /// Dropping it before completion cancels it. Owned memory is handed to the engine and
        /// freed once NIXL lets go of it; borrowed memory makes the drop block until NIXL has
        /// released the transfer (its end or its failure), so the borrow never ends while NIXL
        /// can still touch it.
        pub struct $name<'a> {
            inner: Active<'a>,
        }

        impl<'a> $name<'a> {
            /// The current status: `InProgress`, then `Complete`, `Cancelled` or `Errored`.
            pub fn status(&self) -> OperationStatus {
                self.inner.state.status()
            }

            /// The notification key this transfer sends to the peer.
            pub fn notification_key(&self) -> &str {
                &self.inner.key
            }

            /// Waits until the transfer has completed.
            ///
            /// # Errors
            /// [`Error::TimedOut`] when `timeout` passes first (the transfer goes on: wait again
            /// or drop); [`Error::RemoteGone`] or [`Error::Nixl`] when the transfer failed;
            /// [`Error::Cancelled`] after `cancel()`.
            ///
            /// # Cancel safety
            /// Cancel safe: dropping the future leaves the transfer running.
            pub async fn wait_for_completion(&self, timeout: Option<Duration>) -> Result<()> {
                wait(&self.inner.state, timeout).await
            }

            /// Marks the operation cancelled and wakes its waiters. NIXL has no way to stop a
            /// posted transfer, so the memory stays in use until it ends; dropping the operation
            /// afterwards is safe at any time.
            pub fn cancel(&self) {
                self.inner.state.finish(OperationStatus::Cancelled, None);
            }

            /// Gives the local descriptors back once NIXL has released them.
            ///
            /// # Errors
            /// Returns the operation unchanged while the transfer is still in flight.
            pub fn into_descriptors(mut self) -> Result<Vec<Descriptor<'a>>, Self> {
                if !self.inner.state.is_released() {
                    return Err(self);
                }
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
    ReadOperation
);
active_op!(
    /// Writes local memory into a peer's [`WritableOperation`](crate::WritableOperation); made by
    /// [`Connector::begin_write`](crate::Connector::begin_write).
    WriteOperation
);

impl<'a> ReadOperation<'a> {
    pub(crate) async fn begin(
        engine: &Engine,
        remote: &RdmaMetadata,
        descs: Vec<Descriptor<'a>>,
    ) -> Result<Self> {
        Ok(Self {
            inner: Active::begin(engine, remote, descs, OperationKind::Read).await?,
        })
    }

    /// The local descriptors the data is read into (Python's `results()`); complete once
    /// [`wait_for_completion`](Self::wait_for_completion) has returned `Ok`.
    pub fn results(&self) -> &[Descriptor<'a>] {
        &self.inner.descs
    }
}

impl<'a> WriteOperation<'a> {
    pub(crate) async fn begin(
        engine: &Engine,
        remote: &RdmaMetadata,
        descs: Vec<Descriptor<'a>>,
    ) -> Result<Self> {
        Ok(Self {
            inner: Active::begin(engine, remote, descs, OperationKind::Write).await?,
        })
    }
}
