//! Passive operations: memory exposed to a peer, complete when the peer's notification arrives.

use std::sync::Arc;
use std::time::Duration;

use super::{wait, OperationStatus};
use crate::descriptor::{check_local, Descriptor};
use crate::engine::{Cmd, Engine, OpState, Range};
use crate::error::Result;
use crate::metadata::{OperationKind, RdmaMetadata};

pub(crate) struct Passive<'a> {
    engine: Engine,
    state: Arc<OpState>,
    descs: Vec<Descriptor<'a>>,
    metadata: RdmaMetadata,
}

impl<'a> Passive<'a> {
    pub(crate) async fn create(
        engine: &Engine,
        mut descs: Vec<Descriptor<'a>>,
        kind: OperationKind,
    ) -> Result<Self> {
        check_local(&descs, kind == OperationKind::Write)?;
        let ranges: Vec<Range> = descs
            .iter()
            .map(|d| Range {
                addr: d.ptr(),
                len: d.size(),
                device: d.device(),
            })
            .collect();
        let key = uuid::Uuid::new_v4().to_string();
        let state = OpState::new(OperationStatus::Initialized, true);
        let reply = engine
            .call(|reply| Cmd::Passive {
                ranges,
                key: key.clone(),
                state: state.clone(),
                reply,
            })
            .await??;
        for (d, t) in descs.iter_mut().zip(reply.tokens) {
            d.attach(t);
        }
        let metadata = RdmaMetadata {
            descriptors: descs.iter().map(Descriptor::metadata).collect(),
            nixl_metadata: reply.nixl_metadata.to_string(),
            notification_key: key,
            operation_kind: kind.as_u8(),
        };
        Ok(Self {
            engine: engine.clone(),
            state,
            descs,
            metadata,
        })
    }

    fn cancel(&self) {
        if self.state.finish(OperationStatus::Cancelled, None) {
            let _ = self.engine.send(Cmd::Unwatch {
                key: self.metadata.notification_key.clone(),
            });
        }
    }
}

impl Drop for Passive<'_> {
    fn drop(&mut self) {
        // Stop watching; the descriptors' registrations are released as they drop.
        if !self.state.status().is_terminal() {
            let _ = self.engine.send(Cmd::Unwatch {
                key: self.metadata.notification_key.clone(),
            });
        }
    }
}

macro_rules! passive_op {
    ($(#[$doc:meta])* $name:ident, $kind:expr, $peer:literal) => {
        $(#[$doc])*
        ///
        /// # Drop
        /// Dropping it stops the wait and releases its registrations; if it was not complete it
        /// counts as cancelled. A peer that already holds the metadata then fails its transfer
        /// (the memory is no longer registered), but over transports that need no registration
        /// (shared memory, CMA) the peer could still reach the memory while the transfer is
        /// mid-way: keep the operation alive until it completes or until you know the peer will
        /// not start.
        pub struct $name<'a> {
            inner: Passive<'a>,
        }

        impl<'a> $name<'a> {
            pub(crate) async fn create(engine: &Engine, descs: Vec<Descriptor<'a>>) -> Result<Self> {
                Ok(Self { inner: Passive::create(engine, descs, $kind).await? })
            }

            /// The metadata to hand to the peer (print it with `to_json()`).
            pub fn metadata(&self) -> &RdmaMetadata {
                &self.inner.metadata
            }

            /// The key the peer's notification must carry.
            pub fn notification_key(&self) -> &str {
                &self.inner.metadata.notification_key
            }

            /// The current status: `Initialized` until the peer's notification arrives.
            pub fn status(&self) -> OperationStatus {
                self.inner.state.status()
            }

            #[doc = concat!("Waits until the peer's ", $peer, " completes (its notification arrives).")]
            ///
            /// # Errors
            /// [`Error::TimedOut`](crate::Error::TimedOut) when `timeout` passes first (the
            /// operation stays live: wait again or drop it); [`Error::Cancelled`](crate::Error::Cancelled)
            /// after `cancel()`; [`Error::EngineStopped`](crate::Error::EngineStopped) if the
            /// connector's engine died.
            ///
            /// # Cancel safety
            /// Cancel safe: dropping the future leaves the operation as it was.
            pub async fn wait_for_completion(&self, timeout: Option<Duration>) -> Result<()> {
                wait(&self.inner.state, timeout).await
            }

            /// Stops waiting: the status becomes `Cancelled` unless already terminal, and waiters
            /// return [`Error::Cancelled`](crate::Error::Cancelled).
            pub fn cancel(&self) {
                self.inner.cancel()
            }

            /// The local descriptors.
            pub fn descriptors(&self) -> &[Descriptor<'a>] {
                &self.inner.descs
            }

            /// Ends the operation and gives the descriptors back (their registrations stay with
            /// them, so passing them to another operation does not register again).
            pub fn into_descriptors(mut self) -> Vec<Descriptor<'a>> {
                self.inner.cancel();
                std::mem::take(&mut self.inner.descs)
            }
        }

        impl std::fmt::Debug for $name<'_> {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($name))
                    .field("engine", &self.inner.engine.name())
                    .field("notification_key", &self.inner.metadata.notification_key)
                    .field("status", &self.status())
                    .field("descriptors", &self.inner.descs)
                    .finish()
            }
        }
    };
}

passive_op!(
    /// Local memory a peer may read, made by
    /// [`Connector::create_readable`](crate::Connector::create_readable); its metadata pairs
    /// with [`Connector::begin_read`](crate::Connector::begin_read).
    ReadableOperation,
    OperationKind::Read,
    "read"
);
passive_op!(
    /// Local memory a peer may write, made by
    /// [`Connector::create_writable`](crate::Connector::create_writable); its metadata pairs
    /// with [`Connector::begin_write`](crate::Connector::begin_write). After completion, read the
    /// data through [`descriptors`](Self::descriptors) or take the memory back with
    /// [`into_descriptors`](Self::into_descriptors).
    WritableOperation,
    OperationKind::Write,
    "write"
);
