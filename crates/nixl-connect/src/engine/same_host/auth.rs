//! Proof of the notification key on the same-host path.
//!
//! A socket name is not an identity: any process of the same user can bind a connector's name
//! first. What only the two ends of an operation share is its notification key (a random UUID in
//! the metadata). So the key itself never crosses the socket; each side proves it holds it:
//!
//! - the client's `Hello` names the operation by [`key_id`] (a hash: learning it reveals nothing
//!   usable) and carries a fresh [`nonce`];
//! - the server's `Welcome` carries [`welcome_proof`], an HMAC keyed by the notification key over
//!   the nonce and both processes' ids (so a relaying impostor, whose id differs, cannot pass a
//!   real server's proof on). A process's id is its pidfs inode number where the kernel has
//!   pidfs (Linux 6.9: one number per process on the host, the same from every PID namespace, so
//!   it binds pods too), else its pid ([`sys::self_id`](crate::sys::same_host::self_id)). The client reveals nothing else (no ranges, no
//!   device export) and trusts no answer until the proof checks;
//! - every frame about one operation, in either direction (`Req`, `Grant`, `GrantIpc`, `Refuse`,
//!   `Fallback`, `Done`), ends with [`frame_mac`] under *that operation's* key, over the frame's
//!   type and fields, the nonce, both ids and the direction. A process that proved one key on a
//!   connection cannot answer for another operation on it, nor replay a frame onto another
//!   connection (the nonce and ids differ), nor reflect a frame back (the direction differs).

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

fn tag(key: &str, label: &[u8], parts: &[&[u8]]) -> Tag {
    let mut m = HmacSha256::new_from_slice(key.as_bytes()).expect("HMAC takes any key length");
    m.update(label);
    for p in parts {
        m.update(&(p.len() as u32).to_le_bytes());
        m.update(p);
    }
    m.finalize().into_bytes().into()
}

/// The server's proof that it holds `key`, for the client's `nonce`, bound to both processes' ids.
pub(crate) fn welcome_proof(key: &str, nonce: &Nonce, client_id: u64, server_id: u64) -> Tag {
    tag(
        key,
        b"nixl-connect/welcome",
        &[nonce, &client_id.to_le_bytes(), &server_id.to_le_bytes()],
    )
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
mod tests {
    use super::*;

    #[test]
    fn auth_proofs_bind_key_nonce_and_pids() {
        let n = nonce();
        assert_ne!(n, nonce(), "nonces are fresh");
        let p = welcome_proof("k1", &n, 10, 20);
        assert!(same(&p, &welcome_proof("k1", &n, 10, 20)));
        assert!(!same(&p, &welcome_proof("k2", &n, 10, 20)));
        assert!(!same(&p, &welcome_proof("k1", &nonce(), 10, 20)));
        assert!(
            !same(&p, &welcome_proof("k1", &n, 10, 21)),
            "a relay's pid differs"
        );
        let k1 = Keyed::new("k1");
        let r = frame_mac(&k1, &n, 10, 20, Side::Client, b"frame");
        assert!(same(
            &r,
            &frame_mac(&Keyed::new("k1"), &n, 10, 20, Side::Client, b"frame")
        ));
        assert!(!same(
            &r,
            &frame_mac(&Keyed::new("k2"), &n, 10, 20, Side::Client, b"frame")
        ));
        assert!(
            !same(&r, &frame_mac(&k1, &n, 10, 20, Side::Server, b"frame")),
            "direction"
        );
        assert!(
            !same(&r, &frame_mac(&k1, &n, 10, 21, Side::Client, b"frame")),
            "pids"
        );
        assert!(
            !same(&r, &frame_mac(&k1, &nonce(), 10, 20, Side::Client, b"frame")),
            "nonce"
        );
        assert!(
            !same(&r, &frame_mac(&k1, &n, 10, 20, Side::Client, b"frame!")),
            "fields"
        );
        assert_ne!(key_id("k1"), key_id("k2"));
        assert!(!key_id("k1").windows(2).any(|w| w == b"k1"));
    }
}
