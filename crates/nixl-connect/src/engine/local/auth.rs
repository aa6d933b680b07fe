//! Proof of the notification key on the same-host path.
//!
//! A socket name is not an identity: any process of the same user can bind a connector's name
//! first. What only the two ends of an operation share is its notification key (a random UUID in
//! the metadata). So the key itself never crosses the socket; each side proves it holds it:
//!
//! - the client's `Hello` names the operation by [`key_id`] (a hash: learning it reveals nothing
//!   usable) and carries a fresh [`nonce`];
//! - the server's `Welcome` carries [`welcome_proof`], an HMAC keyed by the notification key over
//!   the nonce and both processes' pids (so a relaying impostor, whose pid differs, cannot pass a
//!   real server's proof on). The client reveals nothing else (no ranges, no
//!   device export) and trusts no answer until the proof checks;
//! - every `Req` carries [`req_mac`], proving the client holds its operation's key.

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
    let mut h = Sha256::new();
    h.update(b"nixl-connect/key-id\0");
    h.update(key.as_bytes());
    let d = h.finalize();
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

/// The server's proof that it holds `key`, for the client's `nonce`, bound to both pids.
pub(crate) fn welcome_proof(key: &str, nonce: &Nonce, client_pid: i32, server_pid: i32) -> Tag {
    tag(
        key,
        b"nixl-connect/welcome",
        &[nonce, &client_pid.to_le_bytes(), &server_pid.to_le_bytes()],
    )
}

/// The client's proof that it holds `key`, for one request on a connection.
pub(crate) fn req_mac(
    key: &str,
    nonce: &Nonce,
    client_pid: i32,
    server_pid: i32,
    slot: u32,
    gen: u64,
    write: bool,
) -> Tag {
    tag(
        key,
        b"nixl-connect/req",
        &[
            nonce,
            &client_pid.to_le_bytes(),
            &server_pid.to_le_bytes(),
            &slot.to_le_bytes(),
            &gen.to_le_bytes(),
            &[u8::from(write)],
        ],
    )
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
        let r = req_mac("k1", &n, 10, 20, 3, 4, true);
        assert!(!same(&r, &req_mac("k1", &n, 10, 20, 3, 4, false)));
        assert!(!same(&r, &req_mac("k1", &n, 10, 20, 3, 5, true)));
        assert_ne!(key_id("k1"), key_id("k2"));
        assert!(!key_id("k1").windows(2).any(|w| w == b"k1"));
    }
}
