//! The same-host transport: Rust peers on one host copy memory directly, negotiated out of band
//! over a Unix socket named from the agent name
//! ([`socket_name`](crate::sys::same_host::socket_name)), so the published metadata stays exactly
//! NIXL's. The passive side checks every request ([`wire`]) against its live operation; the side
//! whose memory is written copies ([`cma`](crate::sys::same_host::cma)), under a slot the other
//! side can revoke at any instant ([`slots`](crate::sys::same_host::slots)); small host operations
//! ride in the frames (up to [`wire::EAGER_MAX`]). What this path cannot take goes to NIXL
//! ([`Event::Declined`](crate::engine::transport::Event::Declined)).
//!
//! How it works, its owners and layers: docs/ARCHITECTURE.md, "The same-host wing"; why it is
//! sound: docs/SOUNDNESS.md, "The same-host path". The syscalls and every `unsafe` block are the
//! floor's (`sys/same_host/`), so the wing is `forbid(unsafe_code)`.
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
