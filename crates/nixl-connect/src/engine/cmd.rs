//! What callers send to the engine thread, and the mailbox through which a transport's own
//! objects (registration tokens, held outside the thread) reach it.

use std::any::Any;
use std::sync::mpsc::Sender;
use std::sync::Arc;

use tokio::sync::oneshot;

use super::poller::Waker;
use super::stats::EngineStats;
use super::transport::{ActiveSpec, Exposure, OpId, PassiveSpec};
use crate::error::Result;
use crate::reg::{Hold, Range, RegToken};

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
    Begin {
        spec: ActiveSpec,
    },
    /// Stop an active operation's transfer as soon as possible; with `hard`, even at the cost of
    /// other operations (its owner cannot wait any longer).
    Abandon {
        id: OpId,
        hard: bool,
    },
    /// Hold `keep` (a dropped operation's memory) until its transfer has ended.
    Adopt {
        id: OpId,
        keep: Hold,
    },
    /// A message from outside the engine thread to the transport at position `to` (for example a
    /// registration token's drop), handed to it as it is.
    Mail {
        to: usize,
        msg: Box<dyn Any + Send>,
    },
    /// Register `ranges` ahead of the transfers that will use them, with every transport that
    /// registers memory.
    Register {
        ranges: Vec<Range>,
        reply: oneshot::Sender<Result<Vec<RegToken>>>,
    },
    /// Answer once the turn that takes this command has also progressed the transports due and
    /// applied what they reported: after it, everything sent to the engine before it has been
    /// acted on, and a transport driven on every turn (the loopback) has run once since.
    #[cfg(any(test, feature = "testing"))]
    Settle {
        reply: oneshot::Sender<()>,
    },
    /// Report the engine's counters.
    Stats {
        reply: oneshot::Sender<EngineStats>,
    },
    Shutdown,
}

/// The way back to one transport on the engine thread: a message posted here reaches its
/// [`Transport::on_mail`](super::transport::Transport::on_mail), in order with the engine's other
/// commands; nothing happens once the engine is gone.
#[derive(Clone)]
pub(crate) struct Mailbox {
    tx: Sender<Cmd>,
    waker: Waker,
    to: usize,
}

impl Mailbox {
    /// A mailbox to the transport at position `to` of the engine behind `tx`.
    pub(crate) fn new(tx: Sender<Cmd>, waker: Waker, to: usize) -> Self {
        Self { tx, waker, to }
    }

    /// Posts `msg`; false when the engine is gone.
    pub(crate) fn post(&self, msg: Box<dyn Any + Send>) -> bool {
        let sent = self.tx.send(Cmd::Mail { to: self.to, msg }).is_ok();
        if sent {
            self.waker.wake();
        }
        sent
    }
}
