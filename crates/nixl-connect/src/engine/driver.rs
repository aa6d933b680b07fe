//! The engine thread: the edge around [`EngineCore`]. It receives the callers' commands, reads
//! the clock, sleeps in `epoll` on the transports' descriptors and its wake-up `eventfd`, and
//! wakes for a command, a ready descriptor or a transport's deadline; every decision is the
//! core's. After any event it keeps spinning for [`SPIN`] so that back-to-back operations pay no
//! wake-up (unless the host is oversubscribed: see [`crate::spin`]); an idle connector costs no
//! CPU.

use std::sync::mpsc::{Receiver, TryRecvError};
use std::time::{Duration, Instant};

use super::cmd::Cmd;
use super::core::{EngineCore, STOP_WAIT};
use super::poller::{Poller, Ready};

/// How long the engine keeps spinning after the last event before it sleeps.
pub(crate) const SPIN: Duration = Duration::from_millis(2);

/// The engine thread's loop: a core, the channel its commands arrive on, and the poller it sleeps
/// in.
pub(crate) struct EngineLoop {
    core: EngineCore,
    rx: Receiver<Cmd>,
    poller: Poller,
    ready: Vec<Ready>,
    pending: Option<Cmd>,
}

impl EngineLoop {
    /// A loop driving `core` with the commands of `rx`, sleeping in `poller`.
    pub(crate) fn new(core: EngineCore, rx: Receiver<Cmd>, poller: Poller) -> Self {
        Self {
            core,
            rx,
            poller,
            ready: Vec::new(),
            pending: None,
        }
    }

    /// Runs until every handle is gone or [`Cmd::Shutdown`], then ends everything.
    pub(crate) fn run(mut self) {
        let mut last_event = Instant::now();
        let mut shutdown = None;
        // Something happened since the counters were last published with force.
        let mut unpublished = true;
        loop {
            let mut event = false;
            while let Some(cmd) = self.pending.take().or_else(|| self.next_cmd()) {
                if let Cmd::Shutdown { within } = cmd {
                    shutdown = Some(within);
                    break;
                }
                self.core.handle(cmd);
                event = true;
            }
            if shutdown.is_some() {
                break;
            }
            let now = Instant::now();
            if event {
                self.core.wake_all(now);
            }
            // While the engine is hot: transfers in flight are progressed on every turn,
            // operations waiting for a completion every WATCH_GAP; otherwise by the schedule.
            let hot = now.saturating_duration_since(last_event) < SPIN && crate::spin::worthwhile();
            event |= self.core.turn(now, hot, &self.ready);
            self.ready.clear();
            if event {
                self.core.publish(now, false);
                unpublished = true;
                last_event = Instant::now();
                self.poller.wait(Some(Duration::ZERO), &mut self.ready);
                continue;
            }
            if last_event.elapsed() < SPIN && crate::spin::worthwhile() {
                // Recently active: stay hot (yielding the core) so the next command, socket
                // message or completion is picked up without a wake-up; not while the host is
                // oversubscribed (a yield then costs a time slice, see `spin`).
                crate::spin::yield_core();
                self.poller.wait(Some(Duration::ZERO), &mut self.ready);
                continue;
            }
            let now = Instant::now();
            if std::mem::take(&mut unpublished) {
                // Going idle: the counters as they stand.
                self.core.publish(now, true);
            }
            let timeout = self.core.sleep_for(now);
            self.poller.prepare_sleep();
            if self.core.has_pending() {
                self.poller.awake();
                continue;
            }
            match self.rx.try_recv() {
                Ok(cmd) => {
                    self.poller.awake();
                    self.pending = Some(cmd);
                    continue;
                }
                Err(TryRecvError::Disconnected) => break,
                Err(TryRecvError::Empty) => {}
            }
            self.poller.wait(timeout, &mut self.ready);
        }
        self.core.shutdown(shutdown.unwrap_or(STOP_WAIT));
    }

    /// The next command; a disconnected channel (every handle gone) reads as `Shutdown`.
    fn next_cmd(&mut self) -> Option<Cmd> {
        match self.rx.try_recv() {
            Ok(c) => Some(c),
            Err(TryRecvError::Empty) => None,
            Err(TryRecvError::Disconnected) => Some(Cmd::Shutdown { within: STOP_WAIT }),
        }
    }
}
