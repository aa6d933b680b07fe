//! What callers send to the engine thread, and the mailbox through which a transport's own
//! objects (registration tokens, held outside the thread) reach it.

use std::any::Any;
use std::marker::PhantomData;
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;

use super::poller::Waker;
use super::transport::{small, ActiveSpec, Exposure, OpId, PassiveSpec, PeerInfo, TransportId};
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
    /// Answer once the turn that takes this command has also progressed the transports due and
    /// applied what they reported: after it, everything sent to the engine before it has been
    /// acted on, and a transport driven on every turn (the loopback) has run once since.
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

    /// True for the commands a driving caller may handle on its own thread (see `driver`), those
    /// of a small operation over host memory ([`Pace::small`](crate::pace::Pace::small)), whose
    /// wait will drive what it starts):
    /// - its [`Cmd::Begin`];
    /// - its [`Cmd::Expose`], which the core may still leave to the engine thread (when NIXL
    ///   would have to register the memory or make its metadata:
    ///   [`EngineCore::handle_as_caller`](super::core::EngineCore::handle_as_caller));
    /// - the end of an exposure that hands no memory on ([`Cmd::Unexpose`] without `keep`; NIXL's
    ///   part of it is deferred to the engine thread).
    ///
    /// Everything else stays the engine thread's: registrations, cancels and adoptions (they may
    /// free memory a Python object owns), an exposure's end that hands memory on, mail, larger
    /// operations and the end.
    pub(crate) fn for_a_caller(&self) -> bool {
        match self {
            Cmd::Begin { spec } => self.host_only() && small(&spec.local),
            Cmd::Expose { spec, .. } => self.host_only() && small(&spec.ranges),
            Cmd::Unexpose { keep, .. } => keep.is_none(),
            _ => false,
        }
    }
}

/// The way back to one transport on the engine thread: a message posted here reaches its
/// [`Transport::on_mail`](super::transport::Transport::on_mail), in order with the engine's other
/// commands; nothing happens once the engine is gone.
///
/// Typed by the transport's own message `M`: only that type can be posted, and the transport
/// reads back exactly that type.
pub(crate) struct Mailbox<M> {
    tx: Sender<Cmd>,
    waker: Waker,
    to: TransportId,
    msg: PhantomData<fn(M)>,
}

impl<M> Clone for Mailbox<M> {
    fn clone(&self) -> Self {
        Self {
            tx: self.tx.clone(),
            waker: self.waker.clone(),
            to: self.to,
            msg: PhantomData,
        }
    }
}

impl<M: Send + 'static> Mailbox<M> {
    /// A mailbox to transport `to` of the engine behind `tx`.
    pub(crate) fn new(tx: Sender<Cmd>, waker: Waker, to: TransportId) -> Self {
        Self {
            tx,
            waker,
            to,
            msg: PhantomData,
        }
    }

    /// Posts `msg`; false when the engine is gone.
    pub(crate) fn post(&self, msg: M) -> bool {
        let sent = self
            .tx
            .send(Cmd::Mail {
                to: self.to,
                msg: Box::new(msg),
            })
            .is_ok();
        if sent {
            self.waker.wake();
        }
        sent
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_commands_over_device_memory_stay_on_the_engine_thread() {
        let register = |device| {
            let (reply, _) = oneshot::channel();
            Cmd::Register {
                ranges: vec![
                    Range {
                        addr: 4096,
                        len: 4096,
                        device: crate::Device::Host,
                    },
                    Range {
                        addr: 8192,
                        len: 4096,
                        device,
                    },
                ],
                reply,
            }
        };
        assert!(register(crate::Device::Host).host_only());
        assert!(!register(crate::Device::Cuda(0)).host_only());
        assert!(
            !register(crate::Device::Host).for_a_caller(),
            "registration is the engine's"
        );
        assert!(Cmd::Shutdown {
            within: Duration::ZERO
        }
        .host_only());
    }

    #[test]
    fn engine_commands_callers_may_handle_are_a_small_host_operations_and_no_memory_handed_on() {
        use crate::engine::transport::PassiveSpec;
        use crate::metadata::OperationKind;
        use crate::state::{OpState, OperationStatus};
        let expose = |len: usize, device| {
            let (reply, _) = oneshot::channel();
            Cmd::Expose {
                spec: PassiveSpec {
                    key: "k".into(),
                    kind: OperationKind::Read,
                    ranges: vec![Range {
                        addr: 4096,
                        len,
                        device,
                    }],
                    state: OpState::new(OperationStatus::Initialized),
                },
                reply,
            }
        };
        let small = 64 << 10; // the most bytes `Pace::small` takes
        assert!(expose(small, crate::Device::Host).for_a_caller());
        assert!(
            !expose(small + 1, crate::Device::Host).for_a_caller(),
            "a large exposure is the engine's"
        );
        assert!(
            !expose(4096, crate::Device::Cuda(0)).for_a_caller(),
            "device memory is the engine's"
        );
        let end = |keep: Option<(Hold, usize)>| Cmd::Unexpose {
            key: "k".into(),
            gen: 0,
            keep,
        };
        assert!(end(None).for_a_caller());
        assert!(
            !end(Some((
                Box::new(Vec::<crate::Descriptor<'static>>::new()) as Hold,
                8
            )))
            .for_a_caller(),
            "memory handed on (its owner may be a Python object) is the engine's"
        );
    }
}
