//! Who the owner of an agent name is: the same-host path's identity binding.
//!
//! Every holder of the metadata knows an operation's key, so the key proves nothing about *who*
//! answers. A serving connector makes an Ed25519 key pair at start and writes its public key's
//! [`Fingerprint`] into its agent name ([`Identity::advertise`]: `<name>.nxc1-<32 hex digits>`);
//! an active side connects only to names that carry one ([`advertised`]), and believes a
//! `Welcome` only when signed by that key over its nonce, both processes' ids and the proof
//! ([`verify_welcome`]). The argument: docs/SOUNDNESS.md, "Who is on the other end".

use std::fmt;

use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};

use super::auth::{self, Nonce, Tag};

/// The advertisement's marker in an agent name, before the fingerprint.
const MARK: &str = ".nxc1-";
/// The first 16 bytes of SHA-256 over a connector's public key (domain-separated).
pub(crate) type Fingerprint = [u8; 16];
/// An Ed25519 public key.
pub(crate) type PublicKey = [u8; 32];
/// An Ed25519 signature.
pub(crate) type Sig = [u8; 64];

/// A connector's same-host identity: the private key only this process holds.
pub(crate) struct Identity {
    key: SigningKey,
    public: PublicKey,
    fingerprint: Fingerprint,
}

impl fmt::Debug for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the private key.
        write!(f, "Identity({})", hex(&self.fingerprint))
    }
}

impl Identity {
    /// A fresh identity from the operating system's random generator.
    pub(crate) fn generate() -> std::io::Result<Self> {
        let mut seed = [0u8; 32];
        getrandom::getrandom(&mut seed).map_err(std::io::Error::other)?;
        Ok(Self::from_seed(seed))
    }

    /// The identity of a fixed seed (tests).
    pub(crate) fn from_seed(seed: [u8; 32]) -> Self {
        let key = SigningKey::from_bytes(&seed);
        let public = key.verifying_key().to_bytes();
        Self {
            key,
            fingerprint: fingerprint(&public),
            public,
        }
    }

    /// The public key's fingerprint, as advertised.
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn fingerprint(&self) -> Fingerprint {
        self.fingerprint
    }

    /// `name` with this identity's advertisement appended.
    pub(crate) fn advertise(&self, name: &str) -> String {
        format!("{name}{MARK}{}", hex(&self.fingerprint))
    }

    /// The name of this identity's socket in a shared directory ([`stem`]).
    pub(crate) fn stem(&self) -> String {
        stem(&self.fingerprint)
    }

    /// The server's signed `Welcome`: its public key and a signature over `w` (the client's nonce,
    /// both processes' ids, the Welcome's proof or its absence, the pipes flag).
    pub(crate) fn sign_welcome(&self, w: &Welcome<'_>) -> (PublicKey, Sig) {
        let m = welcome_message(w);
        (self.public, self.key.sign(&m).to_bytes())
    }
}

/// The name of the socket, in a shared directory, of the connector whose agent name advertises
/// `f`: `nxc1-<32 hex digits>`.
pub(crate) fn stem(f: &Fingerprint) -> String {
    format!("nxc1-{}", hex(f))
}

/// The fingerprint of `public`.
pub(crate) fn fingerprint(public: &PublicKey) -> Fingerprint {
    auth::hash16(b"nixl-connect/identity\0", public)
}

/// The fingerprint an agent name advertises, if it advertises the same-host path (a rotated
/// exposer's name, `<connector>~<generation>`, advertises its connector's). `None` for a Python
/// Dynamo peer's name, or any name without a well-formed advertisement.
pub(crate) fn advertised(agent: &str) -> Option<Fingerprint> {
    let base = agent.split_once('~').map_or(agent, |(base, _)| base);
    let (_, tail) = base.rsplit_once(MARK)?;
    if tail.len() != 32 || !tail.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return None;
    }
    let mut f = [0u8; 16];
    for (i, b) in f.iter_mut().enumerate() {
        *b = u8::from_str_radix(&tail[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(f)
}

/// What a `Welcome`'s signature covers besides the key that makes it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Welcome<'a> {
    /// The client's nonce.
    pub(crate) nonce: &'a Nonce,
    /// Both processes' ids (see `auth`).
    pub(crate) client_id: u64,
    pub(crate) server_id: u64,
    /// The proof of the opening key, or none (no live operation).
    pub(crate) proof: Option<&'a Tag>,
    /// The server asks for piped writes.
    pub(crate) pipes: bool,
}

/// True when `public` is the key `expected` names and `sig` is its signature of `w`.
pub(crate) fn verify_welcome(expected: &Fingerprint, public: &PublicKey, sig: &Sig, w: &Welcome<'_>) -> bool {
    if fingerprint(public) != *expected {
        return false;
    }
    let Ok(key) = VerifyingKey::from_bytes(public) else {
        return false;
    };
    let m = welcome_message(w);
    key.verify_strict(&m, &Signature::from_bytes(sig)).is_ok()
}

fn welcome_message(w: &Welcome<'_>) -> Vec<u8> {
    let mut m = Vec::with_capacity(64 + 16 + 8 + 33);
    m.extend_from_slice(b"nixl-connect/welcome-identity\0");
    m.extend_from_slice(w.nonce);
    m.extend_from_slice(&w.client_id.to_le_bytes());
    m.extend_from_slice(&w.server_id.to_le_bytes());
    match w.proof {
        Some(p) => {
            m.push(1);
            m.extend_from_slice(p);
        }
        None => m.push(0),
    }
    m.push(u8::from(w.pipes));
    m
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[cfg(test)]
mod tests;
