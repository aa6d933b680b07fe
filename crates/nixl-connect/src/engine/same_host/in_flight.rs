//! What is in flight off the engine thread: copies queued, running and finished, and CUDA IPC
//! exports finished; the transport's `reap` says what each end means.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::records::{AnyCopy, CopyOwner, ExportDone, Exports, Finished, Outstanding};
use crate::engine::poller::Waker;
use crate::sync::Recover;
use crate::sys::same_host::cma::{self, CopyError};
#[cfg(feature = "cuda")]
use crate::sys::same_host::ipc;
use crate::sys::same_host::pipe;
#[cfg(feature = "cuda")]
use crate::sys::same_host::staged;

/// Copies and exports in flight.
pub(super) struct InFlight {
    waker: Waker,
    finished: Finished,
    exports: Exports,
    outstanding: Arc<Outstanding>,
    /// Host copies started this turn, not yet on the pool.
    batch: cma::Batch,
}

/// A copy's result, or an export's, as the thread that ended it hands it over.
type CopyResult = std::result::Result<(), CopyError>;

impl InFlight {
    /// Nothing in flight; `waker` wakes the engine when something ends.
    pub(super) fn new(waker: Waker) -> Self {
        Self {
            waker,
            finished: Arc::default(),
            exports: Arc::default(),
            outstanding: Arc::new(Outstanding::new(0)),
            batch: cma::Batch::default(),
        }
    }

    /// Starts `copy` for `owner`. A host copy joins this turn's batch, handed to the pool by
    /// [`Self::submit`] at the turn's end. A copy that cannot start is reported as finished with
    /// its error, like any other.
    pub(super) fn start(&mut self, copy: AnyCopy, owner: CopyOwner) {
        let (done, owner) = self.on_end(owner);
        let started = match copy {
            AnyCopy::Host(c) => cma::spawn_into(&mut self.batch, c, done),
            AnyCopy::Filled(c) => pipe::spawn_fill(c, done),
            #[cfg(feature = "cuda")]
            AnyCopy::Device(c) => ipc::spawn(c, done),
            #[cfg(feature = "cuda")]
            AnyCopy::Staged(c) => staged::spawn(c, done),
        };
        if let Err(e) = started {
            // Its callback will not run.
            self.outstanding.update(|n| *n -= 1);
            if let Some(o) = owner.lock().recover().take() {
                self.finished.push((o, Err(e)));
            }
        }
    }

    /// Starts feeding pipes for `owner` (a [`CopyOwner::Fed`]): its end is reported like a
    /// copy's, once the pipes are empty.
    pub(super) fn feed(&mut self, f: pipe::Feeding, owner: CopyOwner) {
        let (done, _) = self.on_end(owner);
        pipe::spawn_feed(f, done);
    }

    /// A copy's completion callback (run on the thread that ends the copy), counted as
    /// outstanding until it runs.
    #[allow(clippy::type_complexity)]
    fn on_end(
        &self,
        owner: CopyOwner,
    ) -> (Box<dyn FnOnce(CopyResult) + Send>, Arc<Mutex<Option<CopyOwner>>>) {
        let finished = self.finished.clone();
        let waker = self.waker.clone();
        let outstanding = self.outstanding.clone();
        let owner = Arc::new(Mutex::new(Some(owner)));
        let o2 = owner.clone();
        outstanding.update(|n| *n += 1);
        let done = Box::new(move |r| {
            if let Some(o) = o2.lock().recover().take() {
                finished.push((o, r));
            }
            // The engine takes finished copies on every turn while it is awake, and checks for
            // them after announcing a sleep: a wake-up is needed only if it sleeps.
            waker.wake();
            outstanding.update(|n| *n -= 1);
        });
        (done, owner)
    }

    /// Hands the copies started this turn to the pool.
    pub(super) fn submit(&mut self) {
        self.batch.submit();
    }

    /// True when copies started this turn wait to be handed to the pool.
    pub(super) fn unsubmitted(&self) -> bool {
        !self.batch.is_empty()
    }

    /// The callback an export's thread reports its end through (it wakes the engine).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(super) fn export_done(&self) -> impl Fn(ExportDone) + Send + 'static {
        let (exports, waker) = (self.exports.clone(), self.waker.clone());
        move |d| {
            exports.push(d);
            waker.wake();
        }
    }

    /// What tells the transport, from the CUDA thread, of VMM exports given back on one of its
    /// connections (it then tells the peer).
    #[cfg(feature = "cuda")]
    pub(super) fn teller(&self) -> ipc::Teller {
        let done = self.export_done();
        Arc::new(move |conn, ids| done(ExportDone::Forgotten { conn, ids }))
    }

    /// True when copies or exports have finished that were not taken yet (checked before the
    /// engine sleeps, so one ending at that moment is never left unhandled).
    pub(super) fn has_finished(&self) -> bool {
        self.finished.is_pending() || self.exports.is_pending()
    }

    /// The copies finished since the last call.
    pub(super) fn take_finished(&self) -> Vec<(CopyOwner, CopyResult)> {
        self.finished.take()
    }

    /// The exports finished since the last call.
    pub(super) fn take_exports(&self) -> Vec<ExportDone> {
        self.exports.take()
    }

    /// Hands over what was started and waits (up to `within`; `None`: for as long as it takes)
    /// until no copy runs. True when none is left. The caller cancelled them first: they end
    /// within a chunk unless their peer stalls its pages.
    pub(super) fn wait(&mut self, within: Option<Duration>) -> bool {
        // Copies started but not handed over yet hold a count too: they run, see `cancel` and
        // end without moving a byte.
        self.batch.submit();
        // A limit too far to represent waits as long as it takes.
        self.outstanding
            .wait_until(|n| *n == 0, within.and_then(|d| Instant::now().checked_add(d)))
    }

    /// Tests: a copy of `owner` finished with `result` (as the pool would report it).
    #[cfg(test)]
    pub(super) fn finish(&self, owner: CopyOwner, result: CopyResult) {
        self.finished.push((owner, result));
    }
}
