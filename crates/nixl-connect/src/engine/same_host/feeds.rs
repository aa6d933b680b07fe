//! The pipes this side feeds (`sys::pipe`), for a peer that cannot read its memory; owned from
//! their making until their job stopped. A served read's completion, a write's end and an ended
//! operation's memory wait for that stop (what is already in a pipe is a copy).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::records::ConnId;
pub(super) use super::records::FeedFor;
use crate::engine::transport::Event;
use crate::state::OpState;
use crate::sys::same_host::pipe::Wake;

/// A served read's operation: its key and state.
pub(super) type Grant = (Arc<str>, Arc<OpState>);

/// One feed: its pipes are being fed, or wait for the operation's end to be emptied.
pub(super) struct Feed {
    conn: ConnId,
    /// Its pipes.
    lanes: usize,
    ended: Arc<AtomicBool>,
    wake: Arc<Wake>,
    /// A served read: the operation's key and state (released once emptied, if it ended).
    key: Option<Arc<str>>,
    state: Option<Arc<OpState>>,
    /// A served read: the reader's answer (`Done`), once it came.
    answered: Option<bool>,
    /// A write: what ends it (its result, or a decline to NIXL), held until the feed stops.
    held: Option<Event>,
}

impl Feed {
    /// A feed over connection `conn`'s `lanes` pipes, ended through `ended` and `wake` (what its
    /// job waits on); a served read names its operation's key and state (`grant`).
    pub(super) fn new(
        conn: ConnId,
        lanes: usize,
        ended: Arc<AtomicBool>,
        wake: Arc<Wake>,
        grant: Option<Grant>,
    ) -> Self {
        let (key, state) = grant.unzip();
        Self {
            conn,
            lanes,
            ended,
            wake,
            key,
            state,
            answered: None,
            held: None,
        }
    }

    /// The connection its read ends went over.
    pub(super) fn conn(&self) -> ConnId {
        self.conn
    }

    /// A served read: the reader answered (`Done`), `ok` or not.
    pub(super) fn answered(&mut self, ok: bool) {
        self.answered = Some(ok);
    }

    /// A write: `ev` ends it once the feed stops (the first event held wins).
    pub(super) fn hold(&mut self, ev: Event) {
        self.held.get_or_insert(ev);
    }

    /// What waited for the feed to stop: a served read's key, state and whether its reader said
    /// it is done; a write's held end.
    pub(super) fn into_outcome(self) -> (Option<Grant>, bool, Option<Event>) {
        (self.key.zip(self.state), self.answered == Some(true), self.held)
    }

    /// A served read of the operation keyed `key`.
    pub(super) fn feeds_key(&self, key: &str) -> bool {
        self.key.as_deref() == Some(key)
    }

    fn end(&self) {
        self.ended.store(true, Ordering::Release);
        self.wake.wake();
    }
}

/// Every feed of this side.
#[derive(Default)]
pub(super) struct Feeds {
    by: HashMap<FeedFor, Feed>,
    /// Pipes held, over every feed.
    lanes: usize,
}

impl Feeds {
    /// True while `id` is fed (its job has not reported).
    pub(super) fn has(&self, id: FeedFor) -> bool {
        self.by.contains_key(&id)
    }

    /// Records `feed`, started for `id`, which the caller checked is not fed ([`Self::has`]: a
    /// request id is the peer's to choose, and a feed replaced would run on unseen).
    pub(super) fn start(&mut self, id: FeedFor, feed: Feed) {
        debug_assert!(!self.by.contains_key(&id), "{id:?} fed twice");
        self.lanes += feed.lanes;
        self.by.entry(id).or_insert(feed);
    }

    /// Ends `id`'s feed (its job empties the pipes and reports); the feed, to record why.
    pub(super) fn end(&mut self, id: FeedFor) -> Option<&mut Feed> {
        let f = self.by.get_mut(&id)?;
        f.end();
        Some(f)
    }

    /// Ends every feed for which `which` holds.
    pub(super) fn end_where(&mut self, which: impl Fn(&FeedFor, &Feed) -> bool) {
        for (_, f) in self.by.iter().filter(|(id, f)| which(id, f)) {
            f.end();
        }
    }

    /// `id`'s job reported: its pipes are empty and closed. The feed, forgotten.
    pub(super) fn finished(&mut self, id: FeedFor) -> Option<Feed> {
        let f = self.by.remove(&id)?;
        self.lanes -= f.lanes;
        Some(f)
    }

    /// Pipes held, over every feed.
    pub(super) fn lanes(&self) -> usize {
        self.lanes
    }

    /// Pipes held for connection `conn`.
    pub(super) fn lanes_of(&self, conn: ConnId) -> usize {
        self.by.values().filter(|f| f.conn == conn).map(|f| f.lanes).sum()
    }

    /// True while a served read of the operation keyed `key` is fed or not yet emptied.
    pub(super) fn feeds_key(&self, key: &str) -> bool {
        self.by.values().any(|f| f.feeds_key(key))
    }
}
