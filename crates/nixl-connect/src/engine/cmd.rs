//! What callers send to the engine thread, and the mailbox through which a transport's own
//! objects (registration tokens, held outside the thread) reach it.

use std::any::Any;
use std::marker::PhantomData;
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;

use super::poller::Waker;
use super::transport::{ActiveSpec, Exposure, OpId, PassiveSpec, PeerInfo, TransportId};
use crate::device::Device;
use crate::error::Result;
use crate::reg::{Hold, Range, RegToken};
use crate::state::{Mechanism, TransferPath};
use crate::stats::EngineStats;

/// One transport's answer to a [`Cmd::Probe`]: its path, and the mechanism it would use (where it
/// knows it) or why it would decline.
pub(crate) type Probed = (TransferPath, std::result::Result<Option<Mechanism>, String>);

/// Commands to the engine thread.
pub(crate) enum Cmd {
    /// Expose a passive operation's memory under its key.
    Expose {
        spec: PassiveSpec,
        reply: oneshot::Sender<Result<Exposure>>,
    },
    /// A passive operation ended (completed, cancelled or dropped): no new access; `keep` is
    /// owned memory that was exposed, to hold until no peer can reach it.
    Unexpose {
        key: Arc<str>,
        /// The generation of the exposer that exposed it.
        gen: u64,
        keep: Option<(Hold, usize)>,
    },
    /// Start an active operation (its outcome, and the registrations to keep with its memory,
    /// arrive through its state).
    Begin { spec: ActiveSpec },
    /// Stop an active operation's transfer as soon as possible; with `hard`, even at the cost of
    /// other operations (its owner cannot wait any longer).
    Abandon { id: OpId, hard: bool },
    /// Hold `keep` (a dropped operation's memory) until its transfer has ended.
    Adopt { id: OpId, keep: Hold },
    /// A message from outside the engine thread to transport `to` (for example a registration
    /// token's drop), handed to it as it is.
    Mail {
        to: TransportId,
        msg: Box<dyn Any + Send>,
    },
    /// Register `ranges` ahead of the transfers that will use them, with every transport that
    /// registers memory.
    Register {
        ranges: Vec<Range>,
        reply: oneshot::Sender<Result<Vec<RegToken>>>,
    },
    /// Answer at the end of the turn that takes it: everything sent before it has been acted on, and
    /// a transport driven on every turn (the loopback) has run once since.
    #[cfg(any(test, feature = "testing"))]
    Settle { reply: oneshot::Sender<()> },
    /// Report the engine's counters.
    Stats { reply: oneshot::Sender<EngineStats> },
    /// Ask each transport of the chain in turn what it would do with an operation with `peer`
    /// ([`Transport::probe`](super::transport::Transport::probe)), up to the first that takes it.
    Probe {
        peer: PeerInfo,
        write: bool,
        local: Device,
        remote: Device,
        bytes: u64,
        reply: oneshot::Sender<Vec<Probed>>,
    },
    /// End everything, waiting up to `within` for copies still running (then their memory is
    /// leaked rather than freed under them).
    Shutdown { within: Duration },
}

impl Cmd {
    /// False for a command over device memory: only the engine thread handles those (see
    /// `driver`), and a connector that has handled one is not driven by callers again.
    pub(crate) fn host_only(&self) -> bool {
        let host = |r: &Range| r.device == crate::Device::Host;
        match self {
            Cmd::Expose { spec, .. } => spec.ranges.iter().all(host),
            Cmd::Begin { spec } => spec.local.iter().chain(&spec.remote).all(host),
            Cmd::Register { ranges, .. } => ranges.iter().all(host),
            _ => true,
        }
    }
}

/// The way back to one transport on the engine thread: a message `M` (the transport's own type)
/// posted here reaches its [`Transport::on_mail`](super::transport::Transport::on_mail), in order
/// with the engine's other commands; nothing happens once the engine is gone.
pub(crate) struct Mailbox<M> {
    tx: Sender<Cmd>,
    waker: Waker,
    to: TransportId,
    msg: PhantomData<fn(M)>,
}

impl<M> Clone for Mailbox<M> {
    fn clone(&self) -> Self {
        Self::new(self.tx.clone(), self.waker.clone(), self.to)
    }
}

impl<M> Mailbox<M> {
    /// A mailbox to transport `to` of the engine behind `tx`.
    pub(crate) fn new(tx: Sender<Cmd>, waker: Waker, to: TransportId) -> Self {
        let msg = PhantomData;
        Self { tx, waker, to, msg }
    }

    /// Posts `msg`; false when the engine is gone.
    pub(crate) fn post(&self, msg: M) -> bool
    where
        M: Send + 'static,
    {
        let msg = Box::new(msg);
        self.tx
            .send(Cmd::Mail { to: self.to, msg })
            .inspect(|()| self.waker.wake())
            .is_ok()
    }
}

#[cfg(test)]
mod tests;
