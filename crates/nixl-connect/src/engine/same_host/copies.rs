//! Copies on the pool: starting them, learning that they ended, and waiting for them before the
//! memory they write may go.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::feeds::Feed;
use super::link::Answer;
use super::records::{refused, ConnId, CopyOwner, FeedFor};
use super::sys::alive;
use super::sys::cma::CopyError;
use super::sys::pipe;
use super::transport::SameHostTransport;
use super::wire::RefuseCode;
use crate::engine::transport::OpId;
use crate::engine::transport::{Decline, Event};
use crate::error::Error;
use crate::state::{OpState, TransferPath};

impl SameHostTransport {
    /// Stops every copy and waits (up to `within`; `None`: for as long as it takes) for the ones
    /// running on the pool, which end within a chunk unless their peer stalls its pages. True
    /// when none is left; false when some still run (then the memory they write must never be
    /// freed: the caller leaks it).
    pub(crate) fn stop_copies(&mut self, within: Option<Duration>) -> bool {
        self.stopped = true;
        for (_, a) in self.client.acts() {
            a.stop();
        }
        self.feeds.end_all();
        for s in self.server.scopes() {
            s.cancel_writer();
        }
        self.in_flight.wait(within)
    }

    /// Records and starts the feed `which` over connection `conn` (its lanes' read ends go, or
    /// went, there): `f` on the copy pool. A served read names its operation (`grant`).
    pub(super) fn start_feed(
        &mut self,
        which: FeedFor,
        conn: ConnId,
        grant: Option<(Arc<str>, Arc<OpState>)>,
        f: pipe::Feeding,
    ) {
        let mut feed = Feed::new(conn, f.lanes.len(), f.ended.clone(), f.wake.clone());
        if let Some((key, state)) = grant {
            feed.key = Some(key);
            feed.state = Some(state);
        }
        self.feeds.start(which, feed);
        self.in_flight.feed(f, CopyOwner::Fed(which));
    }

    /// Client: `ev` ends the active operation `id`; if its write's pipes are still fed, the feed is
    /// ended and `ev` waits for its job (which reads the operation's memory) to stop
    /// ([`Self::fed`]); else it goes out now. The first event held wins (an abandoned write stays
    /// cancelled).
    pub(super) fn end_act_after_feed(&mut self, id: OpId, ev: Event, out: &mut Vec<Event>) {
        match self.feeds.end(FeedFor::Write(id)) {
            Some(f) => {
                f.held.get_or_insert(ev);
            }
            None => out.push(ev),
        }
    }

    /// Pipes this side fed are done (their job reported: it reads the operation's memory no
    /// more): what waited for it goes on. A served read completes if its reader said so; a write
    /// reports what its answer or its end gave; an ended operation's memory is released once no
    /// feed of it runs.
    fn fed(&mut self, which: FeedFor, r: Result<(), CopyError>, out: &mut Vec<Event>) {
        let Some(f) = self.feeds.finished(which) else {
            return;
        };
        if let Err(e) = &r {
            tracing::debug!(?which, error = ?e, "feeding same-host pipes failed");
        }
        match which {
            FeedFor::Grant(_) => {
                let Some(key) = f.key else { return };
                if f.answered == Some(true) {
                    out.push(Event::PassiveCompleted {
                        key: key.clone(),
                        path: TransferPath::SameHost,
                    });
                }
                if self.server.scope(&key).is_none() && !self.feeds.feeds_key(&key) {
                    // Unexposed while its pipes were fed (`seam.rs` held the release back).
                    if let Some(state) = f.state {
                        state.mark_released();
                    }
                }
            }
            FeedFor::Write(_) => {
                // Nothing held: the feed ended before the operation did (all fed, or it failed);
                // the server's answer (or the connection's end) reports the write.
                if let Some(ev) = f.held {
                    out.push(ev);
                }
            }
        }
    }

    /// Handles finished copies and exports.
    pub(super) fn reap(&mut self, out: &mut Vec<Event>) -> bool {
        let exported = self.reap_exports(out);
        let done = self.in_flight.take_finished();
        let any = exported || !done.is_empty();
        for (owner, r) in done {
            match owner {
                CopyOwner::Fed(which) => self.fed(which, r, out),
                CopyOwner::Read(id) => {
                    let Some(a) = self.client.remove(id) else { continue };
                    let i = a.conn;
                    let live = self.sockets.get(i).is_some_and(|c| !c.link.is_dead());
                    if let Err(CopyError::Unsupported(reason)) = &r {
                        // Nothing moved: end the grant and let NIXL take the read.
                        if live {
                            let c = self.sockets.get_mut(i).expect("live");
                            c.link.read_done(a.slot, a.gen, false, &reason.to_string());
                        }
                        self.free_slot(i, a.slot, a.gen);
                        if a.cancel.load(Ordering::Relaxed) {
                            out.push(Event::ActiveEnded {
                                id,
                                result: Err(Error::Cancelled),
                            });
                        } else {
                            out.push(Event::Declined {
                                spec: a.spec,
                                reason: Decline::shared(
                                    "the same-host device copy cannot run here",
                                    reason.clone(),
                                ),
                            });
                        }
                        continue;
                    }
                    let same = alive(&a.pidfd);
                    let result = match r {
                        Ok(()) if same => Ok(()),
                        Ok(()) | Err(CopyError::PeerGone) => Err(Error::RemoteGone {
                            agent: a.spec.peer.name.to_string(),
                            reason: "its process exited during the copy".into(),
                            source: None,
                        }),
                        Err(CopyError::Revoked | CopyError::NotStarted) => {
                            Err(if a.cancel.load(Ordering::Relaxed) {
                                Error::Cancelled
                            } else {
                                refused(
                                    a.spec.peer.name.to_string(),
                                    RefuseCode::NotLive,
                                    "the owner ended the operation during the copy".into(),
                                )
                            })
                        }
                        Err(CopyError::Os(e)) => Err(Error::Transfer {
                            agent: a.spec.peer.name.to_string(),
                            reason: "the same-host copy failed".into(),
                            source: Some(e),
                        }),
                        Err(CopyError::Unsupported(_)) => unreachable!("handled above"),
                    };
                    if live {
                        let c = self.sockets.get_mut(i).expect("live");
                        c.link.read_done(a.slot, a.gen, result.is_ok(), "");
                    }
                    self.free_slot(i, a.slot, a.gen);
                    out.push(Event::ActiveEnded { id, result });
                }
                CopyOwner::Write {
                    key,
                    id,
                    state,
                    pidfd,
                } => {
                    let same = alive(&pidfd);
                    let ok = r.is_ok() && same;
                    // The copy into this side's memory has ended either way.
                    state.mark_released();
                    if let Err(CopyError::Unsupported(reason)) = &r {
                        // Nothing moved: the writer may take NIXL.
                        if let Some(s) = self.server.scope_mut(&key) {
                            if s.is_writer(id) {
                                s.writer = None;
                            }
                        }
                        if let Some(c) = self.sockets.get_mut(id.conn) {
                            c.link.answer(
                                id.slot,
                                id.gen,
                                Answer::Fallback(format!(
                                    "the passive side cannot copy from device memory: {reason}"
                                )),
                            );
                        }
                        continue;
                    }
                    if let Some(s) = self.server.scope_mut(&key) {
                        if s.is_writer(id) {
                            s.writer = None;
                            // Completed or torn, the writable has ended from here on: a request
                            // heard later in this turn, before the engine applies the event,
                            // finds it done (it used to find no writer and start a copy into the
                            // memory of an operation that had just completed).
                            if !matches!(r, Err(CopyError::NotStarted)) {
                                s.done = true;
                            }
                            match &r {
                                Ok(()) if same => out.push(Event::PassiveCompleted {
                                    key: key.clone(),
                                    path: TransferPath::SameHost,
                                }),
                                // The writer cancelled before the copy began: nothing was touched.
                                Err(CopyError::NotStarted) => {}
                                _ => out.push(Event::PassiveFailed {
                                    key: key.clone(),
                                    error: Error::RemoteGone {
                                        agent: "(same-host writer)".into(),
                                        reason: "the writer went away in the middle of writing; the \
                                                 writable's memory is torn"
                                            .into(),
                                        source: None,
                                    },
                                }),
                            }
                        }
                    }
                    if let Some(c) = self.sockets.get_mut(id.conn) {
                        let reason = match &r {
                            Ok(()) => String::new(),
                            Err(e) => format!("the passive side's copy failed: {e:?}"),
                        };
                        c.link.answer(id.slot, id.gen, Answer::WriteDone { ok, reason });
                    }
                }
            }
        }
        any
    }
}
