//! The same-host transport: the struct that holds the wing's owners (the server book, the
//! connections, the active operations, the copies' inboxes) and how it starts. What it does
//! lives beside it: connections (`conn`), the access policy (`policy`) and the server's actions
//! on it (`server`), the client (`client`), copies (`copies`), device memory (`device`), frame
//! dispatch (`dispatch`) and the engine's seam (`seam`); its limits are in `limits`.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::time::Instant;

use super::client_book::ClientBook;
use super::identity::Identity;
use super::in_flight::InFlight;
use super::limits::Caps;
use super::records::{Conn, ConnId};
use super::server_book::ServerBook;
use super::sys::{descriptor_budget, raise_descriptor_limit, timerfd, uid, Tracked};
use crate::engine::poller::{Registrar, Waker, MAX_TOKEN};

/// The token of the listening socket in the engine's poller.
pub(super) const LISTENER: u64 = 0;
/// The poller token of the timer that re-arms the listener after running out of descriptors.
pub(super) const ACCEPT_TIMER: u64 = MAX_TOKEN;
/// The poller token of the timer that fires at the earliest deadline of a connection's core.
pub(super) const DEADLINE_TIMER: u64 = MAX_TOKEN - 1;
/// The same-host transport of one connector.
pub(crate) struct SameHostTransport {
    pub(super) enabled: bool,
    pub(super) listener: Option<Tracked>,
    /// The identity this connector's agent name advertises, proven to every client (none when
    /// it serves no socket).
    pub(super) identity: Option<Arc<Identity>>,
    /// The caps on served connections.
    pub(super) caps: Caps,
    pub(super) reg: Registrar,
    pub(super) uid: libc::uid_t,
    pub(super) conns: HashMap<ConnId, Conn>,
    pub(super) next_conn: ConnId,
    /// What this connector serves (scopes, key ids, identities, exports queued).
    pub(super) server: ServerBook,
    /// What this connector asks of others (active operations, connections by peer, peers
    /// avoided).
    pub(super) client: ClientBook,
    /// Copies and exports in flight off the engine thread.
    pub(super) in_flight: InFlight,
    pub(super) refused_peers: u64,
    /// A timer (made up front: there may be no descriptor left when it is needed) that re-arms
    /// the listener after `accept` ran out of descriptors, instead of spinning on it.
    pub(super) accept_timer: Option<OwnedFd>,
    /// A timer for the connections' deadlines (handshakes, partial frames), and when it is armed
    /// to fire.
    pub(super) deadline_timer: Option<OwnedFd>,
    pub(super) deadline_armed: Option<Instant>,
    /// [`Self::stop_copies`] ran (the drop does not wait again).
    pub(super) stopped: bool,
}

impl Drop for SameHostTransport {
    fn drop(&mut self) {
        if !self.stopped {
            self.stop_copies(None);
        }
    }
}

impl SameHostTransport {
    /// A transport serving on `listener` as `identity` (none: this connector cannot be reached on
    /// this path) and, when `enabled`, trying it for active operations.
    pub(crate) fn new(
        enabled: bool,
        listener: Option<(Tracked, Arc<Identity>)>,
        reg: Registrar,
        waker: Waker,
    ) -> Self {
        let (listener, identity) = listener.unzip();
        raise_descriptor_limit();
        let caps = Caps::for_budget(descriptor_budget());
        if let Some(l) = &listener {
            if let Err(e) = reg.add(l.as_raw_fd(), LISTENER, true, false) {
                tracing::warn!(error = %e, "cannot watch the same-host socket");
            }
        }
        let accept_timer = listener.as_ref().and_then(|_| {
            let t = timerfd().ok()?;
            reg.add(t.as_raw_fd(), ACCEPT_TIMER, true, false).ok()?;
            Some(t)
        });
        let deadline_timer = timerfd().ok().and_then(|t| {
            reg.add(t.as_raw_fd(), DEADLINE_TIMER, true, false).ok()?;
            Some(t)
        });
        let in_flight = InFlight::new(waker);
        Self {
            enabled,
            listener,
            identity,
            caps,
            reg,

            uid: uid(),
            conns: HashMap::new(),
            next_conn: 1,
            server: ServerBook::default(),
            client: ClientBook::default(),
            in_flight,
            refused_peers: 0,
            accept_timer,
            deadline_timer,
            deadline_armed: None,
            stopped: false,
        }
    }
}

#[cfg(test)]
impl SameHostTransport {
    /// A transport serving one connection for tests: `p`'s (shaken) server core over one end of
    /// a socket pair, non-blocking; returns the transport, the connection's id and the other end
    /// (the peer's).
    pub(super) fn serving(
        poller: &crate::engine::poller::Poller,
        p: &mut super::link::fuzz::Pair,
    ) -> (Self, ConnId, std::os::unix::net::UnixStream) {
        let id = crate::engine::transport::TransportId::nth(0).expect("the first id");
        let mut t = Self::new(false, None, poller.registrar_for(id), poller.waker());
        t.identity = Some(Arc::new(Identity::from_seed(super::link::fuzz::SERVER_SEED)));
        let (ours, theirs) = std::os::unix::net::UnixStream::pair().expect("a socket pair");
        ours.set_nonblocking(true).expect("non-blocking");
        let spare = super::link::Link::server(t.identity.clone().expect("set above"), 0, 0, Instant::now());
        let link = std::mem::replace(&mut p.server, spare);
        let i = t.insert(Conn::new(
            Tracked::new(OwnedFd::from(ours)),
            link,
            4100,
            None,
            "".into(),
        ));
        (t, i, theirs)
    }
}
