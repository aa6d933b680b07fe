//! NIXL's agent metadata as `RdmaMetadata.nixl_metadata` carries it: `b64:` followed by the
//! base64 of its zlib compression at level 6 (Dynamo's Python module and its Rust frontend write
//! this), or the older hex of the zlib bytes; and a published string decoded into the typed
//! [`PeerInfo`] the engine passes around.
//!
//! Only the NIXL transport knows this format: users reach it through the methods of
//! [`RdmaMetadata`] defined here, the engine through [`decode_peer`].

use std::cell::RefCell;
use std::sync::Arc;

use base64::Engine as _;

use super::md;
use crate::engine::transport::PeerInfo;
use crate::error::{Error, MetadataProblem, Result};
use crate::metadata::RdmaMetadata;

/// The largest NIXL agent metadata accepted after decompression (16 MiB): agent metadata is a few
/// KiB, and the cap stops a small hostile `nixl_metadata` from expanding into gigabytes (a zlib bomb).
pub const MAX_NIXL_METADATA: usize = 16 << 20;

const FIELD: &str = "nixl_metadata";

thread_local! {
    /// One zlib compressor and one decompressor per thread, reset for each use: their state is a
    /// few hundred KiB, whose allocation costs more than compressing agent metadata (much more
    /// where UCX hooks `mmap`).
    static COMPRESS: RefCell<flate2::Compress> =
        RefCell::new(flate2::Compress::new(flate2::Compression::new(6), true));
    static DECOMPRESS: RefCell<flate2::Decompress> = RefCell::new(flate2::Decompress::new(true));
}

/// `b64:` + base64(zlib(md, level 6)), as Python's `metadata()` does by default.
pub(crate) fn encode(md: &[u8]) -> String {
    let mut bytes = Vec::with_capacity(md.len() + 64);
    COMPRESS.with(|c| {
        let mut c = c.borrow_mut();
        c.reset();
        loop {
            let at = c.total_in() as usize;
            let status = c
                .compress_vec(&md[at.min(md.len())..], &mut bytes, flate2::FlushCompress::Finish)
                .expect("compressing into a Vec with room cannot fail");
            if status == flate2::Status::StreamEnd {
                break;
            }
            bytes.reserve(bytes.capacity().max(64));
        }
    });
    let mut s = String::with_capacity(4 + bytes.len() * 4 / 3 + 4);
    s.push_str("b64:");
    base64::engine::general_purpose::STANDARD.encode_string(&bytes, &mut s);
    s
}

/// The raw agent metadata in a `nixl_metadata` string, bounded at [`MAX_NIXL_METADATA`].
///
/// # Errors
/// [`Error::Metadata`] on bad base64 or hex, bad zlib, empty output or output above the bound.
pub(crate) fn decode(s: &str) -> Result<Vec<u8>> {
    let compressed = if let Some(b) = s.strip_prefix("b64:") {
        base64::engine::general_purpose::STANDARD
            .decode(b)
            .map_err(|e| Error::metadata_from(FIELD, MetadataProblem::Base64, e))?
    } else {
        decode_hex(s).ok_or_else(|| Error::metadata(FIELD, MetadataProblem::NotBase64NorHex))?
    };
    let out = DECOMPRESS.with(|d| inflate(&mut d.borrow_mut(), &compressed))?;
    if out.len() > MAX_NIXL_METADATA {
        return Err(Error::metadata(
            FIELD,
            MetadataProblem::TooLarge {
                limit: MAX_NIXL_METADATA,
            },
        ));
    }
    if out.is_empty() {
        return Err(Error::metadata(FIELD, MetadataProblem::DecompressesToNothing));
    }
    Ok(out)
}

/// The zlib stream `z` decompressed with `d` (reset first), at most `MAX_NIXL_METADATA + 1`
/// bytes (the caller refuses more). Bytes after the end of the stream are ignored.
fn inflate(d: &mut flate2::Decompress, z: &[u8]) -> Result<Vec<u8>> {
    const LIMIT: usize = MAX_NIXL_METADATA + 1;
    d.reset(true);
    let mut out = Vec::with_capacity(z.len().saturating_mul(4).clamp(1024, LIMIT));
    loop {
        let at = (d.total_in() as usize).min(z.len());
        let status = d
            .decompress_vec(&z[at..], &mut out, flate2::FlushDecompress::Finish)
            .map_err(|e| Error::metadata_from(FIELD, MetadataProblem::Zlib, e))?;
        if status == flate2::Status::StreamEnd || out.len() >= LIMIT {
            return Ok(out);
        }
        if out.len() < out.capacity() {
            // Room left and not at the end: the input ran out.
            return Err(Error::metadata_from(
                FIELD,
                MetadataProblem::Zlib,
                std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "the zlib stream is truncated"),
            ));
        }
        out.reserve_exact(out.len().min(LIMIT - out.len()));
    }
}

/// A `nixl_metadata` string in the older form, hex of the zlib bytes (what Dynamo's
/// `metadata(hex_encode=True)` writes); a hex string is returned as it is.
///
/// # Errors
/// [`Error::Metadata`] when a `b64:` string has bad base64.
pub(crate) fn to_hex(s: &str) -> Result<String> {
    let Some(b) = s.strip_prefix("b64:") else {
        return Ok(s.to_string());
    };
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(b)
        .map_err(|e| Error::metadata_from(FIELD, MetadataProblem::Base64, e))?;
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(DIGITS[usize::from(b >> 4)].into());
        out.push(DIGITS[usize::from(b & 0xf)].into());
    }
    Ok(out)
}

/// The agent name inside a `nixl_metadata` string.
///
/// # Errors
/// [`Error::Metadata`] when the string does not decode or is not NIXL agent metadata.
pub(crate) fn agent_name(s: &str) -> Result<String> {
    let raw = decode(s)?;
    Ok(md::parse(&raw)?.name().to_string())
}

/// A peer's published `nixl_metadata`, decoded once: its agent metadata (what the NIXL transport
/// loads to reach it), its agent name and the fingerprint of its connection part.
///
/// # Errors
/// [`Error::Metadata`] for anything that is not NIXL agent metadata.
pub(crate) fn decode_peer(s: &str) -> Result<PeerInfo> {
    let raw = decode(s)?;
    let name: Arc<str> = md::parse(&raw)?.name().into();
    Ok(PeerInfo {
        published: s.into(),
        identity: md::identity(&raw).unwrap_or(0),
        reach: raw.into(),
        name,
    })
}

/// NIXL's encoding of `nixl_metadata`, for users and the Python package.
impl RdmaMetadata {
    /// Encodes raw NIXL agent metadata (`nixl_agent.get_agent_metadata()`, nixl-sys'
    /// `get_local_md`) as an `RdmaMetadata`'s `nixl_metadata`: `b64:` followed by the base64 of
    /// its zlib compression at level 6, the form Dynamo's Python module and its Rust frontend
    /// (`get_nixl_metadata` in `media/rdma.rs`) write and read. The compressed bytes may differ
    /// from theirs (zlib-rs matches differently), the bytes they decode to do not.
    pub fn encode_agent_metadata(md: &[u8]) -> String {
        encode(md)
    }

    /// Decodes a `nixl_metadata` string (`b64:` base64 or the older hex form, zlib-compressed)
    /// into raw NIXL agent metadata, as Dynamo 1.7's `Remote.decode_metadata` does, bounded at
    /// [`MAX_NIXL_METADATA`] bytes.
    ///
    /// # Errors
    /// [`Error::Metadata`] on bad base64 or hex, bad zlib, empty output or output above
    /// [`MAX_NIXL_METADATA`].
    pub fn decode_agent_metadata(nixl_metadata: &str) -> Result<Vec<u8>> {
        decode(nixl_metadata)
    }

    /// The NIXL agent name inside a `nixl_metadata` string (decoded as
    /// [`decode_agent_metadata`](Self::decode_agent_metadata), then read as NIXL's serialised
    /// agent metadata, every part checked).
    ///
    /// # Errors
    /// [`Error::Metadata`] when the string does not decode or the blob is not NIXL agent
    /// metadata.
    pub fn agent_name_in(nixl_metadata: &str) -> Result<String> {
        agent_name(nixl_metadata)
    }

    /// `nixl_metadata` in the older form, hex of the zlib bytes, as Dynamo's
    /// `metadata(hex_encode=True)` publishes it (a hex string comes back as it is).
    ///
    /// # Errors
    /// [`Error::Metadata`] when a `b64:` string has bad base64.
    pub fn nixl_metadata_as_hex(&self) -> Result<String> {
        Self::agent_metadata_as_hex(&self.nixl_metadata)
    }

    /// A `nixl_metadata` string in the older hex form, as
    /// [`nixl_metadata_as_hex`](Self::nixl_metadata_as_hex) gives it, for a string held alone.
    ///
    /// # Errors
    /// [`Error::Metadata`] when a `b64:` string has bad base64.
    pub fn agent_metadata_as_hex(nixl_metadata: &str) -> Result<String> {
        to_hex(nixl_metadata)
    }

    /// Decodes `nixl_metadata` into the raw NIXL agent metadata.
    ///
    /// # Errors
    /// [`Error::Metadata`] on bad base64 or hex, bad zlib, or output above [`MAX_NIXL_METADATA`].
    pub fn decode_nixl_metadata(&self) -> Result<Vec<u8>> {
        decode(&self.nixl_metadata)
    }
}

fn decode_hex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    let b = s.as_bytes();
    let val = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    };
    b.chunks(2).map(|p| Some(val(p[0])? << 4 | val(p[1])?)).collect()
}

#[cfg(test)]
mod tests;
