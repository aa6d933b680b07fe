//! The records the same-host transport keeps: its connections ([`Conn`]), a request's name
//! ([`RequestId`]), an active operation's phase, a finished copy's owner, a finished export. It
//! sits below the files that act on these records and below the transport (`transport.rs`) and
//! the server book (`server_book.rs`), so none of them imports its way back up.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use super::link::Link;
use super::wire::{IpcSource, RefuseCode};
use crate::device::Device;
use crate::engine::transport::{ActiveSpec, OpId};
use crate::error::{Error, ErrorSource};
use crate::state::OpState;
use crate::sync::Recover;
use crate::sys::same_host::cma::{Copy, CopyError};
#[cfg(feature = "cuda")]
use crate::sys::same_host::ipc;
use crate::sys::same_host::pipe;
use crate::sys::same_host::slots::{SlotTable, SLOTS};
use crate::sys::same_host::Tracked;

/// Where an active operation is on the same-host path.
pub(super) enum Phase {
    /// Waiting for the connection's handshake.
    Queued,
    /// A write from device memory: its source is being exported (CUDA thread).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Exporting,
    /// Asked; waiting for the grant (reads) or for the passive side's copy (writes).
    Requested,
    /// A read being copied here.
    Copying,
    /// Given up: any late answer is ignored.
    Abandoned,
}

/// An active operation on this transport.
pub(super) struct Act {
    pub(super) spec: ActiveSpec,
    pub(super) conn: ConnId,
    pub(super) slot: u32,
    pub(super) gen: u64,
    pub(super) phase: Phase,
    pub(super) cancel: Arc<AtomicBool>,
    /// Wakes a copy from pipes waiting for its peer, once `cancel` is set.
    pub(super) wake: Option<Arc<pipe::Wake>>,
    /// The peer's pidfd while copying (to tell afterwards that it is still the same process).
    pub(super) pidfd: Option<Arc<OwnedFd>>,
    /// The source's memory is device memory: reads get `GrantIpc`, writes send their export.
    pub(super) device: bool,
    /// A device write's exported source, once the CUDA thread has it.
    pub(super) sources: Vec<IpcSource>,
    /// The VMM descriptors `sources` name (a peer in another PID namespace), passed with the
    /// request.
    pub(super) source_fds: Vec<OwnedFd>,
}

impl Act {
    /// Stops its copy (a copy from pipes waiting for its peer wakes at once).
    pub(super) fn stop(&self) {
        self.cancel.store(true, Ordering::Relaxed);
        if let Some(w) = &self.wake {
            w.wake();
        }
    }
}

pub(super) fn refused(agent: String, code: RefuseCode, reason: String) -> Error {
    Error::Refused {
        agent,
        refusal: match code {
            RefuseCode::NotLive => crate::error::Refusal::NotLive,
            RefuseCode::OutOfRange => crate::error::Refusal::OutOfRange,
            RefuseCode::WrongDirection => crate::error::Refusal::WrongDirection,
            RefuseCode::Busy => crate::error::Refusal::Busy,
        },
        reason,
    }
}

/// The number of copies running on the pool, so the transport can stop and wait for them before
/// the memory they write is freed.
pub(super) type Outstanding = crate::sync::Watched<usize>;

/// Who a finished copy belonged to.
pub(super) enum CopyOwner {
    /// A read of this side (client).
    Read(OpId),
    /// Pipes this side fed, now empty (`feeds`).
    Fed(FeedFor),
    /// A write into this side's passive operation (server).
    Write {
        key: Arc<str>,
        id: RequestId,
        state: Arc<OpState>,
        pidfd: Option<Arc<OwnedFd>>,
    },
}

/// What other threads hand the engine (finished copies, finished exports): pushed under a lock,
/// taken by the engine, which checks a flag first so that a turn with nothing to take costs no
/// lock.
pub(super) struct Inbox<T> {
    items: Mutex<Vec<T>>,
    any: AtomicBool,
}

impl<T> Default for Inbox<T> {
    fn default() -> Self {
        Self {
            items: Mutex::new(Vec::new()),
            any: AtomicBool::new(false),
        }
    }
}

impl<T> Inbox<T> {
    /// Hands `item` to the engine (the caller wakes it).
    pub(super) fn push(&self, item: T) {
        self.items.lock().recover().push(item);
        self.any.store(true, Ordering::SeqCst);
    }

    /// Everything handed over so far.
    pub(super) fn take(&self) -> Vec<T> {
        if !self.any.swap(false, Ordering::SeqCst) {
            return Vec::new();
        }
        std::mem::take(&mut *self.items.lock().recover())
    }

    /// True when something waits to be taken (read after the engine's `prepare_sleep` fence, so
    /// an item pushed before a [`Waker::wake`](crate::engine::poller::Waker::wake) that saw the
    /// engine awake is never left behind).
    pub(super) fn is_pending(&self) -> bool {
        self.any.load(Ordering::SeqCst)
    }
}

pub(super) type Finished = Arc<Inbox<(CopyOwner, std::result::Result<(), CopyError>)>>;

/// Which operation a feed of pipes carries (`feeds`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum FeedFor {
    /// A read this side serves (server).
    Grant(RequestId),
    /// A write of this side (client).
    Write(OpId),
}

/// A copy for the host path or the device path.
pub(super) enum AnyCopy {
    Host(Copy),
    /// Host memory read from pipes the peer feeds (it cannot be pulled: another PID namespace).
    Filled(pipe::Fill),
    #[cfg(feature = "cuda")]
    Device(ipc::Copy),
    /// Host memory of the peer into device memory here (pulled through pinned staging).
    #[cfg(feature = "cuda")]
    Staged(Copy),
}

impl AnyCopy {
    /// A copy pulled from the peer's host memory (cross-memory attach) into memory here on `dst`:
    /// straight in for host memory, through pinned staging buffers for device memory.
    pub(super) fn pulled_into(c: Copy, dst: Option<Device>) -> AnyCopy {
        match dst {
            #[cfg(feature = "cuda")]
            Some(Device::Cuda(_)) => AnyCopy::Staged(c),
            _ => AnyCopy::Host(c),
        }
    }
}

/// An export's sources and the VMM descriptors they name (passed with the frame that carries
/// them).
pub(super) type Exported = (Vec<IpcSource>, Vec<OwnedFd>);

/// A finished CUDA IPC export.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(super) enum ExportDone {
    /// A read grant's source (this side serves it).
    Grant {
        key: Arc<str>,
        id: RequestId,
        /// Ranges it exported (counted against the bounds while queued).
        ranges: usize,
        result: std::result::Result<Exported, ErrorSource>,
    },
    /// A write's source (this side writes).
    Write {
        id: OpId,
        result: std::result::Result<Exported, ErrorSource>,
    },
    /// VMM exports this side gave back on connection `conn` (evicted, or their `DeviceBuffer`
    /// dropped): told to the peer at once, so its mappings of them go.
    Forgotten { conn: ConnId, ids: Vec<u64> },
}

pub(super) type Exports = Arc<Inbox<ExportDone>>;

/// A connection's id (also its token in the engine's poller); unique in the process, never reused.
pub(super) type ConnId = u64;

/// One request on one connection: the name a grant or a writer goes by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct RequestId {
    /// The connection it came on.
    pub(super) conn: ConnId,
    /// The slot of the client's table it uses.
    pub(super) slot: u32,
    /// The slot's generation for this request.
    pub(super) gen: u64,
}

/// Export ids kept per connection for its `Forgot` frames (the importer keeps at most 256
/// mappings: older ids are long unmapped).
pub(super) const MAX_NAMED: usize = 1024;

/// Stand-in pool keys: pids are positive, peers of another PID namespace take -1 ..= -2^30, feeds
/// of pipes -2^31 ..= -2^30 - 1 (a collision between two peers only shares a share).
const STAND_INS: u64 = 1 << 30;

/// One socket: a connection this side made (client, the active side) or accepted (server).
/// What the peer says is read, checked and authenticated by its protocol core ([`Link`]); this
/// record keeps what lives at the edge (the socket, the peer's process, the slot table) and the
/// transport's bookkeeping.
pub(super) struct Conn {
    pub(super) fd: Tracked,
    pub(super) client: bool,
    /// The peer's pid from here (0: another PID namespace; nothing can be pulled from it).
    pub(super) peer_pid: libc::pid_t,
    /// The peer's process id as the connection's proofs name it (`sys::self_id`).
    pub(super) peer_id: u64,
    pub(super) pidfd: Option<Arc<OwnedFd>>,
    /// The protocol core: framing, handshake, deadlines, proofs.
    pub(super) link: Link,
    pub(super) writing: bool,
    pub(super) slots: Option<Arc<SlotTable>>,
    /// Server side: read grants this connection holds (at most
    /// [`MAX_GRANTS_PER_CONN`](super::limits::MAX_GRANTS_PER_CONN)).
    pub(super) granted: usize,
    /// Server side: device ranges of this connection's reads queued for export (at most
    /// [`MAX_EXPORTING_PER_CONN`](super::limits::MAX_EXPORTING_PER_CONN)).
    pub(super) exporting: usize,
    /// This side may pull from the peer's memory.
    pub(super) can_pull: bool,
    /// The peer lives in another PID namespace than this process (a pod), visible from here or
    /// not: legacy CUDA IPC handles do not open across, so device memory moves as VMM
    /// descriptors.
    pub(super) other_pid_ns: bool,
    /// Client side: the peer's agent name, operations waiting for the handshake, free slots.
    pub(super) peer: Arc<str>,
    pub(super) queued: Vec<OpId>,
    pub(super) free_slots: Vec<u32>,
    pub(super) gens: Vec<u64>,
    /// The export ids of the VMM descriptors the peer passed on this connection (the most
    /// recent [`MAX_NAMED`] of them): its `Forgot` frames release this side's mappings of these
    /// alone, each once, so they cost this side no more work than the exports did.
    pub(super) named: VecDeque<u64>,
    /// Pipes' read ends the peer passed, in order, not yet taken by the frame they came with
    /// (the core counts them; closed off the engine thread if never taken).
    pub(super) passed: VecDeque<OwnedFd>,
    /// Pipes' read ends to pass with the byte at this offset of the stream sent (the first byte
    /// of the frame that says it passes them), in order.
    pub(super) attach: VecDeque<(u64, pipe::Ends)>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        // A peer's descriptors are never closed on the engine thread (a FUSE file's close can
        // block).
        self.passed
            .drain(..)
            .for_each(crate::sys::same_host::close_elsewhere);
    }
}

impl Conn {
    /// Sends the core's `Hello` with a fresh slot table's descriptor attached (the client's
    /// first frame), and keeps the table.
    pub(super) fn send_hello(&mut self) -> io::Result<()> {
        let table = Arc::new(SlotTable::create()?);
        // Nothing about this process but the key's hash and a nonce: the server proves it holds
        // the key before anything else is sent.
        let buf = self.link.out();
        let n = crate::sys::same_host::send_with_fds(self.fd.as_raw_fd(), buf, &[table.fd().as_raw_fd()])?;
        if n != buf.len() {
            // A fresh connection's buffer always takes a few dozen bytes; anything else is broken.
            return Err(io::Error::other("the hello did not fit the socket"));
        }
        self.link.sent(n);
        self.slots = Some(table);
        Ok(())
    }

    /// Client side: the request in `slot` of generation `gen` ended; the slot is free again (for
    /// the peer, and for this side's next request). A slot of another generation is left alone.
    pub(super) fn free_slot(&mut self, slot: u32, gen: u64) {
        if self.client && self.gens.get(slot as usize) == Some(&gen) {
            if let Some(t) = &self.slots {
                t.free(slot, gen);
            }
            self.free_slots.push(slot);
        }
    }

    /// Whose share of the copy pool this connection's copies run under: the peer's pid, or, for a
    /// peer in another PID namespace (pid 0 from here), a stand-in of its own from its id, so
    /// that no two such peers share one.
    pub(super) fn pool_key(&self) -> libc::pid_t {
        if self.peer_pid > 0 {
            self.peer_pid
        } else {
            -1 - (self.peer_id % STAND_INS) as libc::pid_t
        }
    }

    /// Whose share of the copy pool this connection's feeds of pipes run under: one apart from
    /// [`Self::pool_key`]'s, so that feeds waiting for the peer to read never hold up the fills
    /// (reads of the peer's pipes) this side owes it: two processes piping to each other at once
    /// would each wait for the other's queued fills.
    pub(super) fn feed_key(&self) -> libc::pid_t {
        let k = if self.peer_pid > 0 {
            self.peer_pid as u64
        } else {
            self.peer_id
        };
        i32::MIN + (k % STAND_INS) as libc::pid_t
    }

    /// A connection record, with the pidfd of the peer's process the caller took (the client's
    /// server, checked alive; the server's client, at accept: the handshake caps bound how many
    /// connections without a `Hello` hold one).
    pub(super) fn new(
        fd: Tracked,
        link: Link,
        peer_pid: libc::pid_t,
        peer_id: u64,
        pidfd: Option<OwnedFd>,
        peer: Arc<str>,
    ) -> Self {
        let client = link.is_client();
        Self {
            fd,
            client,
            peer_pid,
            peer_id,
            pidfd: pidfd.map(Arc::new),
            link,
            writing: false,
            slots: None,
            granted: 0,
            exporting: 0,
            can_pull: false,
            other_pid_ns: false,
            named: VecDeque::new(),
            peer,
            queued: Vec::new(),
            free_slots: if client {
                (0..SLOTS as u32).rev().collect()
            } else {
                Vec::new()
            },
            gens: if client { vec![0; SLOTS] } else { Vec::new() },
            passed: VecDeque::new(),
            attach: VecDeque::new(),
        }
    }
}
