//! Passive operations: memory exposed to a peer, complete when the peer reports its transfer done
//! (a NIXL notification carrying the key, or the same-host path's completion message).

use std::sync::Arc;
use std::time::Duration;

use super::{OpState, OperationStatus};
use crate::buffer::HostBuffer;
use crate::descriptor::{check_local, Descriptor};
use crate::engine::transport::PassiveSpec;
use crate::engine::{Cmd, Engine, Range};
use crate::error::{Error, Result};
use crate::metadata::{OperationKind, RdmaMetadata};
use crate::metrics::families::Side;

pub(crate) struct Passive<'a> {
    engine: Engine,
    state: Arc<OpState>,
    descs: Vec<Descriptor<'a>>,
    /// Borrowed slices that `descs` stages through library memory, by index: the caller's memory
    /// is never exposed (a peer holding the metadata could reach it after the borrow ends).
    staged: Vec<(usize, Descriptor<'a>)>,
    metadata: Option<RdmaMetadata>,
    key: Arc<str>,
    /// The generation of the NIXL exposer that exposed the memory.
    gen: u64,
    kind_is_write: bool,
}

impl<'a> Passive<'a> {
    /// Exposes the memory; an error is counted in the connector's metrics (an operation that
    /// was created is counted when it ends).
    ///
    /// # Cancel safety
    /// Dropping the future before it returns ends the exposure (as dropping the operation would).
    pub(crate) async fn create(
        engine: &Engine,
        descs: Vec<Descriptor<'a>>,
        kind: OperationKind,
    ) -> Result<Self> {
        let r = Self::expose(engine, descs, kind).await;
        if let (Err(e), Some(m)) = (&r, engine.metrics()) {
            m.error(kind, Side::Passive, e);
        }
        r
    }

    async fn expose(engine: &Engine, mut descs: Vec<Descriptor<'a>>, kind: OperationKind) -> Result<Self> {
        check_local(&descs, kind == OperationKind::Write)?;
        super::producers_done(&descs).await?;
        // Borrowed slices go through a HostBuffer of the library's: one copy in for a readable,
        // one copy back for a completed writable.
        let mut staged = Vec::new();
        for (i, d) in descs.iter_mut().enumerate() {
            if d.is_plain_borrow() {
                let buf = match kind {
                    OperationKind::Read => HostBuffer::from_slice(d.as_slice().expect("host slice")),
                    _ => HostBuffer::new(d.size()),
                }?;
                staged.push((i, std::mem::replace(d, Descriptor::from(buf))));
            }
        }
        let ranges: Vec<Range> = descs.iter().map(Descriptor::range).collect();
        let key: Arc<str> = uuid::Uuid::new_v4().to_string().into();
        let state = OpState::new(OperationStatus::Initialized);
        let bytes: u64 = descs.iter().map(|d| d.size() as u64).sum();
        let begun = std::time::Instant::now();
        state.trace(super::span(kind, "passive", None, bytes, descs.len()));
        // From here on, dropping `op` (with this future) ends the exposure and hands owned memory
        // to the engine: the memory is never freed while a transport may reach it.
        let mut op = Passive {
            engine: engine.clone(),
            state: state.clone(),
            descs,
            staged,
            metadata: None,
            key: key.clone(),
            gen: 0,
            kind_is_write: kind == OperationKind::Write,
        };
        let spec = PassiveSpec {
            key: key.clone(),
            kind,
            ranges,
            state,
        };
        let exposed = engine.call(|reply| Cmd::Expose { spec, reply }).await??;
        op.gen = exposed.exposer_gen;
        // One token per descriptor, in order (the NIXL transport registers each range).
        for (d, t) in op.descs.iter_mut().zip(exposed.tokens) {
            d.attach(t);
        }
        let nixl_metadata = exposed.published.ok_or_else(|| Error::Nixl {
            op: "expose memory",
            status: "no transport published metadata for it".into(),
            source: None,
        })?;
        op.metadata = Some(RdmaMetadata {
            descriptors: op.descs.iter().map(Descriptor::metadata).collect(),
            nixl_metadata: nixl_metadata.to_string(),
            notification_key: key.to_string(),
            operation_kind: kind.as_u8(),
        });
        // Counted from here (timed from the start): a create that failed above is an error, not
        // an operation cancelled. No peer can end it before it has the metadata, but the engine
        // can (an evicted exposer): then it is not counted at all.
        if let Some(m) = engine.metrics() {
            op.state
                .observe_unless_ended(|| m.begin_at(kind, Side::Passive, bytes, begun));
        }
        Ok(op)
    }

    fn metadata(&self) -> &RdmaMetadata {
        self.metadata
            .as_ref()
            .expect("set by create before the operation is handed out")
    }

    fn cancel(&self) {
        if self.state.finish(OperationStatus::Cancelled, None) {
            let _ = self.unexpose(None);
        }
    }

    /// Tells the engine to end the exposure, handing it `keep` to hold until no peer can reach it.
    fn unexpose(&self, keep: Option<(crate::reg::Hold, usize)>) -> Result<()> {
        let (key, gen) = (self.key.clone(), self.gen);
        self.engine.send(Cmd::Unexpose { key, gen, keep })
    }

    /// Ends the exposure and takes the descriptors back once no copy of this process writes them.
    fn take(&mut self) -> Vec<Descriptor<'a>> {
        self.state.finish(OperationStatus::Cancelled, None);
        let _ = self.unexpose(None);
        // A same-host write into this memory runs on this process's copy threads; ending the
        // exposure stops it within one chunk.
        self.state.wait_released(None);
        self.unstage();
        std::mem::take(&mut self.descs)
    }

    /// Puts the caller's borrowed slices back in place of their staging buffers, copying a
    /// completed writable's data into them; the staging buffers are dropped (quarantined).
    fn unstage(&mut self) {
        let copy_back = self.kind_is_write && self.state.status() == OperationStatus::Complete;
        for (i, mut original) in std::mem::take(&mut self.staged) {
            let stage = std::mem::replace(&mut self.descs[i], Descriptor::from(&[][..]));
            if copy_back {
                if let (Some(dst), Some(src)) = (original.as_mut_slice(), stage.as_slice()) {
                    dst.copy_from_slice(src);
                }
            }
            self.descs[i] = original;
            drop(stage);
        }
    }
}

impl Drop for Passive<'_> {
    fn drop(&mut self) {
        if self.descs.is_empty() {
            return; // given back by into_descriptors
        }
        self.state.finish(OperationStatus::Cancelled, None);
        // Owned memory other than HostBuffers (and staging buffers) that was exposed is held by
        // the engine until no peer can reach it; HostBuffers quarantine their own pages when
        // dropped, below, once the exposure has ended.
        let staged: Vec<usize> = self.staged.iter().map(|(i, _)| *i).collect();
        let mut owned = Vec::new();
        let mut kept = Vec::new();
        for (i, d) in std::mem::take(&mut self.descs).into_iter().enumerate() {
            if staged.contains(&i) {
                kept.push(Some(d));
                continue;
            }
            match d.try_into_static() {
                // Raw memory is borrowed too: its owner frees it once the descriptor is gone.
                Ok(s) if s.owns_memory() && !s.is_host_buffer() => {
                    owned.push(s);
                    kept.push(None);
                }
                Ok(s) => kept.push(Some(s)),
                Err(b) => kept.push(Some(b)),
            }
        }
        let bytes: usize = owned.iter().map(Descriptor::size).sum();
        let keep: Option<(crate::reg::Hold, usize)> =
            (!owned.is_empty()).then(|| (Box::new(owned) as crate::reg::Hold, bytes));
        let sent = self.unexpose(keep).is_ok();
        if sent && kept.iter().any(Option::is_some) {
            // Only this process's own copy threads can be writing it (same-host writes); ending
            // the exposure stops them within one chunk.
            self.state.wait_released(None);
        }
        // Staged slices get a completed writable's data; then everything is dropped.
        self.descs = kept
            .into_iter()
            .map(|d| d.unwrap_or_else(|| Descriptor::from(&[][..])))
            .collect();
        self.unstage();
        self.descs.clear();
    }
}

macro_rules! passive_op {
    ($(#[$doc:meta])* $name:ident, $kind:expr, $peer:literal) => {
        $(#[$doc])*
        ///
        /// # Drop
        /// Dropping it ends the exposure: the same-host path refuses the key from then on and
        /// revokes copies in progress; the peer's NIXL transfer, if one is running, fails or ends.
        /// If it was not complete it counts as cancelled. Memory it owns that NIXL exposed is not
        /// returned to the allocator while a peer could still reach it (quarantine, see
        /// `docs/SOUNDNESS.md`); borrowed memory is given back to its owner, and over NIXL's TCP,
        /// CMA and shared-memory transports a peer that kept the metadata can still reach it
        /// while this connector lives (UCX checks no registration at the target).
        #[must_use = "dropping the operation ends the exposure; hand its metadata to the peer and \
                      await `wait_for_completion`"]
        pub struct $name<'a> {
            inner: Passive<'a>,
        }

        impl<'a> $name<'a> {
            pub(crate) async fn create(engine: &Engine, descs: Vec<Descriptor<'a>>) -> Result<Self> {
                Ok(Self { inner: Passive::create(engine, descs, $kind).await? })
            }

            /// The metadata to hand to the peer (print it with `to_json()`).
            pub fn metadata(&self) -> &RdmaMetadata {
                self.inner.metadata()
            }

            /// The key the peer's completion must carry.
            pub fn notification_key(&self) -> &str {
                &self.inner.key
            }

            /// The current status: `Initialized` until the peer completes.
            pub fn status(&self) -> OperationStatus {
                self.inner.state.status()
            }

            /// Which path the completing peer used, once complete.
            pub fn path(&self) -> Option<crate::state::TransferPath> {
                self.inner.state.path()
            }

            #[doc = concat!("Waits until the peer's ", $peer, " completes.")]
            ///
            /// # Errors
            /// [`Error::TimedOut`](crate::Error::TimedOut) when `timeout` passes first (the
            /// operation stays live: wait again or drop it); [`Error::Cancelled`](crate::Error::Cancelled)
            /// after `cancel()`; [`Error::RemoteGone`](crate::Error::RemoteGone) when a same-host
            /// writer died in the middle of writing (the memory is torn);
            /// [`Error::EngineStopped`](crate::Error::EngineStopped) if the connector's engine died.
            /// A wait spin ([`ConnectorBuilder::wait_spin`](crate::ConnectorBuilder::wait_spin))
            /// applies.
            ///
            /// # Cancel safety
            /// Cancel safe: dropping the future leaves the operation as it was.
            pub async fn wait_for_completion(&self, timeout: Option<Duration>) -> Result<()> {
                let bytes = self.inner.descs.iter().map(Descriptor::size).sum();
                self.inner
                    .engine
                    .wait(&self.inner.state, timeout, None, bytes).await
            }

            /// Ends the exposure: the status becomes `Cancelled` unless already terminal, and
            /// waiters return [`Error::Cancelled`](crate::Error::Cancelled).
            pub fn cancel(&self) {
                self.inner.cancel()
            }

            /// The local descriptors.
            pub fn descriptors(&self) -> &[Descriptor<'a>] {
                &self.inner.descs
            }

            /// Ends the operation and gives the descriptors back (their registrations stay with
            /// them, so passing them to another operation does not register again). Blocks while
            /// a same-host copy of this process still writes them (at most one copy chunk).
            pub fn into_descriptors(mut self) -> Vec<Descriptor<'a>> {
                self.inner.take()
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
