//! Proof of the notification key on the same-host path.
//!
//! A socket name is not an identity; what only the two ends of an operation share is its
//! notification key, which never crosses the socket. The client's `Hello` names the operation by
//! [`key_id`] with a fresh [`nonce`]; the server's `Welcome` carries [`welcome_proof`], an HMAC
//! under the key over the nonce and both processes' ids (pidfs inode, else pid:
//! [`sys::self_id`](crate::sys::same_host::self_id)); every frame about one operation ends with
//! [`frame_mac`] under *that operation's* key, over its type and fields, the nonce, both ids and
//! the direction. The argument: docs/SOUNDNESS.md, "What each side proves" and "Every answer
//! proven under its own operation's key".

use hmac::{KeyInit, Mac};
use sha2::{Digest, Sha256};

/// A hash naming an operation without revealing its key.
pub(crate) type KeyId = [u8; 16];
/// A per-connection random value.
pub(crate) type Nonce = [u8; 16];
/// An HMAC-SHA256 tag.
pub(crate) type Tag = [u8; 32];

type HmacSha256 = hmac::Hmac<Sha256>;

/// The name of an operation on the wire: SHA-256 of its key, domain-separated, truncated.
pub(crate) fn key_id(key: &str) -> KeyId {
    hash16(b"nixl-connect/key-id\0", key.as_bytes())
}

/// SHA-256 of `data` under the domain `label`, truncated to 16 bytes.
pub(crate) fn hash16(label: &[u8], data: &[u8]) -> [u8; 16] {
    let d = Sha256::new().chain_update(label).chain_update(data).finalize();
    d[..16].try_into().expect("16 of 32 bytes")
}

/// A fresh random nonce (from the operating system's generator, through `uuid`).
pub(crate) fn nonce() -> Nonce {
    *uuid::Uuid::new_v4().as_bytes()
}

/// The server's proof that it holds `key`, for the client's `nonce`, bound to both processes' ids.
pub(crate) fn welcome_proof(key: &str, nonce: &Nonce, client_id: u64, server_id: u64) -> Tag {
    let mut m = Keyed::new(key).0;
    m.update(b"nixl-connect/welcome");
    for p in [&nonce[..], &client_id.to_le_bytes(), &server_id.to_le_bytes()] {
        m.update(&(p.len() as u32).to_le_bytes());
        m.update(p);
    }
    m.finalize().into_bytes().into()
}

/// An operation's key made ready to sign frames: the HMAC key schedule is computed once per
/// operation, each frame costs only its own bytes.
#[derive(Clone)]
pub(crate) struct Keyed(HmacSha256);

impl Keyed {
    /// Prepares `key` for signing.
    pub(crate) fn new(key: &str) -> Self {
        Self(HmacSha256::new_from_slice(key.as_bytes()).expect("HMAC takes any key length"))
    }
}

/// Which end of a connection: who sent a frame (part of what its MAC covers, so a frame cannot
/// be reflected back), and which role a connection's core plays.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Side {
    /// The connecting (active) side.
    Client,
    /// The serving (passive) side.
    Server,
}

/// The MAC of one frame about an operation: under that operation's `key`, over the connection's
/// `nonce`, both processes' ids, the sender's role and the frame's `signed` bytes (type and fields).
pub(crate) fn frame_mac(
    key: &Keyed,
    nonce: &Nonce,
    client_id: u64,
    server_id: u64,
    from: Side,
    signed: &[u8],
) -> Tag {
    let mut m = key.0.clone();
    m.update(b"nixl-connect/frame");
    m.update(nonce);
    m.update(&client_id.to_le_bytes());
    m.update(&server_id.to_le_bytes());
    m.update(&[from as u8]);
    m.update(&(signed.len() as u32).to_le_bytes());
    m.update(signed);
    m.finalize().into_bytes().into()
}

/// Compares two tags in constant time.
pub(crate) fn same(a: &Tag, b: &Tag) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests;
