//! The same-host transport: the struct that holds the wing's owners (the server book, the
//! connections, the active operations, the copies' inboxes) and how it starts. What it does
//! lives beside it: connections (`conn`), the access policy (`policy`) and the server's actions
//! on it (`server`), the client (`client`), copies (`copies`), device memory (`device`), frame
//! dispatch (`dispatch`) and the engine's seam (`seam`); its limits are in `limits`.

use std::path::PathBuf;
use std::sync::Arc;

use super::client_book::ClientBook;
use super::feeds::Feeds;
use super::identity::Identity;
use super::in_flight::InFlight;
use super::limits::Caps;
use super::server_book::ServerBook;
use super::sockets::Sockets;
use super::sys::dir::DirListener;
use super::sys::{descriptor_budget, raise_descriptor_limit, Tracked};
use crate::engine::poller::{Registrar, Waker};

/// The same-host transport of one connector.
pub(crate) struct SameHostTransport {
    /// Whether active operations try this path.
    pub(super) enabled: bool,
    /// The directory shared with peers in other network namespaces, where their sockets are
    /// looked for when their abstract one cannot be reached.
    pub(super) socket_dir: Option<PathBuf>,
    /// The identity this connector's agent name advertises, proven to every client (none when
    /// it serves no socket).
    pub(super) identity: Option<Arc<Identity>>,
    /// The listener, the connections and their timers.
    pub(super) sockets: Sockets,
    /// What this connector serves (scopes, key ids, identities, exports queued).
    pub(super) server: ServerBook,
    /// What this connector asks of others (active operations, connections by peer, peers
    /// avoided).
    pub(super) client: ClientBook,
    /// Copies and exports in flight off the engine thread.
    pub(super) in_flight: InFlight,
    /// Pipes this side feeds (reads it serves, writes it makes, to peers that cannot read it).
    pub(super) feeds: Feeds,
    /// Peers refused (another user, over a cap, an impostor), for the engine's counters.
    pub(super) refused_peers: u64,
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
    /// this path), and on `dir_listener` in the shared `socket_dir` if there is one, and, when
    /// `enabled`, trying it for active operations (looking in `socket_dir` too).
    pub(crate) fn new(
        enabled: bool,
        listener: Option<(Tracked, Arc<Identity>)>,
        dir_listener: Option<DirListener>,
        socket_dir: Option<PathBuf>,
        reg: Registrar,
        waker: Waker,
    ) -> Self {
        let (listener, identity) = listener.unzip();
        raise_descriptor_limit();
        let caps = Caps::for_budget(descriptor_budget());
        Self {
            enabled,
            socket_dir,
            identity,
            sockets: Sockets::new(listener, dir_listener, reg, caps),
            server: ServerBook::default(),
            client: ClientBook::default(),
            in_flight: InFlight::new(waker),
            feeds: Feeds::default(),
            refused_peers: 0,
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
    ) -> (Self, super::records::ConnId, std::os::unix::net::UnixStream) {
        let id = crate::engine::transport::TransportId::nth(0).expect("the first id");
        let mut t = Self::new(false, None, None, None, poller.registrar_for(id), poller.waker());
        t.identity = Some(Arc::new(Identity::from_seed(super::link::fuzz::SERVER_SEED)));
        let (ours, theirs) = std::os::unix::net::UnixStream::pair().expect("a socket pair");
        ours.set_nonblocking(true).expect("non-blocking");
        let spare = super::link::Link::server(
            t.identity.clone().expect("set above"),
            0,
            0,
            std::time::Instant::now(),
        );
        let link = std::mem::replace(&mut p.server, spare);
        let i = t.sockets.insert(super::records::Conn::new(
            Tracked::new(std::os::fd::OwnedFd::from(ours)),
            link,
            4100,
            4100,
            None,
            "".into(),
        ));
        (t, i, theirs)
    }
}
