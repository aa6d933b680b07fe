//! The same-host transport: Rust peers on one host copy host memory directly, negotiated out of
//! band so the published metadata stays exactly NIXL's.
//!
//! Each connector listens on an abstract Unix socket named from its agent name
//! ([`socket_name`](sys::socket_name)), which scopes it to this host's network namespace. An active side that finds
//! the socket named by a metadata's agent connects, hands over a sealed slot table ([`slots`](sys::slots)),
//! and asks for access to the operation by its notification key ([`wire`]). The passive side
//! checks everything against its live operation: the peer's uid (`SO_PEERCRED`), the key, every
//! range inside the operation's descriptors, the direction, one writer at a time; access ends when
//! the operation completes, is cancelled or dropped (a replayed metadata string is refused).
//!
//! The side whose memory is written copies, pulling with `process_vm_readv` ([`cma`](sys::cma)): the reader
//! for a read, the passive side for a write. So each process writes only its own memory, and the
//! owner of the source can revoke a grant at any instant without waiting (see [`slots`](sys::slots)). A small
//! host operation (up to [`wire::EAGER_MAX`]) carries its bytes in its frames instead, each side
//! copying only its own memory on its engine thread: one round trip (`eager`). Device
//! memory (feature `cuda`) goes the same way through CUDA IPC (`ipc`): the source's owner exports
//! it, the destination's owner opens it and copies on its own stream. No socket, a peer on another
//! host, another user, a kernel that forbids cross-memory attach, host memory into device memory,
//! or no CUDA where device memory is involved: the operation goes to NIXL instead
//! ([`Event::Declined`](crate::engine::transport::Event::Declined)).
//!
//! # Layout
//! One owner per piece of state, and the metal floor apart (docs/ARCHITECTURE.md has the map):
//! - the protocol core, sans-IO: `link` (one connection's state machine, with `link/events.rs`),
//!   [`wire`] (the frame codec), `auth` (MACs), `identity` (Ed25519), [`violation`] (what a peer
//!   broke);
//! - the access policy, sans-IO: `policy` (`decide(scope, request, load) -> Decision`);
//! - the owners: `sockets` (the listeners, the connections and their timers), `server_book`
//!   (scopes, key ids, identities, exports), `client_book` (active operations, connections by
//!   peer, peers avoided), `in_flight` (copies and exports off the engine thread), `feeds` (pipes
//!   this side fills), `records` (connections, active operations, finished copies), `limits`
//!   (every cap);
//! - the coordinator: `transport` (the [`SameHostTransport`], one `impl`: what a core heard or
//!   the engine asked, to the owner that acts on it, and the engine's
//!   [`Transport`](crate::engine::transport::Transport)), with `eager` and `device` (what its
//!   small and device actions use);
//! - `sys/`: every syscall and every `unsafe` block; the modules above are compiled with
//!   `forbid(unsafe_code)`.

#[forbid(unsafe_code)]
mod auth;
#[forbid(unsafe_code)]
mod client_book;
#[forbid(unsafe_code)]
mod device;
#[forbid(unsafe_code)]
mod eager;
#[forbid(unsafe_code)]
mod feeds;
#[forbid(unsafe_code)]
mod identity;
#[forbid(unsafe_code)]
mod in_flight;
#[forbid(unsafe_code)]
mod limits;
#[forbid(unsafe_code)]
pub(crate) mod link;
#[forbid(unsafe_code)]
mod policy;
#[forbid(unsafe_code)]
mod records;
#[forbid(unsafe_code)]
mod server_book;
#[forbid(unsafe_code)]
mod sockets;
// The metal floor: the only module of the wing with `unsafe` (each block with its `SAFETY:` line).
#[allow(unsafe_code)]
mod sys;
#[forbid(unsafe_code)]
mod transport;
#[forbid(unsafe_code)]
pub(crate) mod violation;
#[forbid(unsafe_code)]
pub(crate) mod wire;

pub(crate) use self::device::device_path_refusal;
pub(crate) use self::identity::Identity;
pub(crate) use self::sys::cma::queued as copy_pool_queued;
pub(crate) use self::sys::dir::listen_in;
pub(crate) use self::sys::{listen, pidfs, Tracked};
pub(crate) use self::transport::SameHostTransport;

#[cfg(test)]
mod tests;
