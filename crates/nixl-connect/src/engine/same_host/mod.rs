//! The same-host transport: Rust peers on one host copy host memory directly, negotiated out of
//! band so the published metadata stays exactly NIXL's.
//!
//! Each connector listens on an abstract Unix socket named from its agent name
//! ([`socket_name`](crate::sys::same_host::socket_name)), which scopes it to this host's network
//! namespace. An active side that finds the socket named by a metadata's agent connects, hands
//! over a sealed slot table ([`slots`](crate::sys::same_host::slots)), and asks for access to the operation by its notification key ([`wire`]). The passive side
//! checks everything against its live operation: the peer's uid (`SO_PEERCRED`), the key, every
//! range inside the operation's descriptors, the direction, one writer at a time; access ends when
//! the operation completes, is cancelled or dropped (a replayed metadata string is refused).
//!
//! The side whose memory is written copies, pulling with `process_vm_readv`
//! ([`cma`](crate::sys::same_host::cma)): the reader for a read, the passive side for a write. So
//! each process writes only its own memory, and the owner of the source can revoke a grant at any
//! instant without waiting (see [`slots`](crate::sys::same_host::slots)). A small host operation (up to [`wire::EAGER_MAX`]) carries its bytes in its frames instead, each side
//! copying only its own memory on its engine thread: one round trip (`eager`). Device
//! memory (feature `cuda`) goes the same way through CUDA IPC (`ipc`): the source's owner exports
//! it, the destination's owner opens it and copies on its own stream. No socket, a peer on another
//! host, another user, a kernel that forbids cross-memory attach, host memory into device memory,
//! or no CUDA where device memory is involved: the operation goes to NIXL instead
//! ([`Event::Declined`](crate::engine::transport::Event::Declined)).
//!
//! Layout, owners and layers: docs/ARCHITECTURE.md, "The same-host wing"; the syscalls and every
//! `unsafe` block are the floor's (`sys/same_host/`), so the wing is `forbid(unsafe_code)`.
#![forbid(unsafe_code)]

mod auth;
mod client_book;
mod conn;
mod device;
mod eager;
mod feeds;
mod identity;
mod in_flight;
mod limits;
pub(crate) mod link;
mod policy;
mod records;
mod server_book;
mod sockets;
mod transport;
pub(crate) mod violation;
pub(crate) mod wire;

pub(crate) use self::device::device_path_refusal;
pub(crate) use self::identity::Identity;
pub(crate) use self::transport::SameHostTransport;
pub(crate) use crate::sys::same_host::cma::queued as copy_pool_queued;
pub(crate) use crate::sys::same_host::dir::listen_in;
pub(crate) use crate::sys::same_host::{listen, pidfs, Tracked};

#[cfg(test)]
mod tests;
