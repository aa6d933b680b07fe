//! NIXL's serialised agent metadata (`nixlSerDes`), read and spliced in pure Rust.
//!
//! The blob is a sequence of entries `TAG, u64 little-endian length, value, '|'` after the header
//! `nixlSerDes|`; tags are not length-prefixed, so it is read with the tags NIXL 1.5 writes:
//!
//! ```text
//! nixlSerDes| Agent<n>name| Conns<8>count| (t<n>backend| c<n>conninfo|)*count <10>MemSection|
//!   nixlSecElms<8>sections| ( bknd<n>backend| nixlDList<10>nixlSDList| t<4>memtype| n<8>count|
//!     (<n>descriptor|)*count )*sections
//! ```
//!
//! where a descriptor is its address, length and device id (three u64) followed by the backend's
//! key for it. The blob must end there: a peer's metadata is untrusted, and bytes NIXL would ignore
//! (padding, impossible counts) are refused.
//!
//! The same-host path reads a peer's agent name from it; the passive side publishes per-operation
//! metadata ([`splice`]), so its size stays flat however many registrations are live.

use crate::error::{Error, MetadataProblem, Result};
use crate::sync::fnv1a;

const HEADER: &[u8] = b"nixlSerDes|";
const MEM_SECTION: &[u8] = b"MemSection";
const DESC_LIST: &[u8] = b"nixlSDList";
/// Sections (memory type x backend pairs) any agent can have; more is not NIXL metadata.
const MAX_SECTIONS: u64 = 64;
/// The smallest serialised descriptor: an empty tag, its length, three u64 and the separator.
const MIN_DESC: usize = 8 + 24 + 1;

/// The parts of an agent metadata blob this crate uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct AgentMd<'a> {
    /// The agent's name.
    name: &'a str,
    /// How many backend connection entries it carries (0 for a sections-only blob).
    conns: u64,
    /// Byte offset of the memory-section marker (everything before it is header + connections).
    sections_at: usize,
}

impl<'a> AgentMd<'a> {
    /// The agent's name.
    pub(crate) fn name(&self) -> &'a str {
        self.name
    }

    /// Byte offset of the memory-section marker.
    #[cfg(feature = "fuzzing")]
    pub(crate) fn sections_at(&self) -> usize {
        self.sections_at
    }
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn bad(&self, what: &'static str) -> Error {
        Error::metadata(
            "nixl_metadata",
            MetadataProblem::NotAgentMetadata { what, at: self.at },
        )
    }

    /// Reads an entry whose value is one u64.
    fn u64(&mut self, tag: &[u8]) -> Result<u64> {
        let v = self.entry(tag)?;
        let v: [u8; 8] = v
            .try_into()
            .map_err(|_| self.bad("a count that is not 8 bytes"))?;
        Ok(u64::from_le_bytes(v))
    }

    /// Reads `TAG, u64 len, value, '|'`, requiring the tag.
    fn entry(&mut self, tag: &[u8]) -> Result<&'a [u8]> {
        if !self.b[self.at..].starts_with(tag) {
            return Err(self.bad("a missing entry tag"));
        }
        self.at += tag.len();
        let len_end = self.at.checked_add(8).filter(|&e| e <= self.b.len());
        let Some(len_end) = len_end else {
            return Err(self.bad("truncated length"));
        };
        let len = u64::from_le_bytes(self.b[self.at..len_end].try_into().expect("8 bytes"));
        let end = usize::try_from(len)
            .ok()
            .and_then(|l| len_end.checked_add(l))
            .filter(|&e| e < self.b.len());
        let Some(end) = end else {
            return Err(self.bad("a length past the end"));
        };
        if self.b[end] != b'|' {
            return Err(self.bad("missing separator"));
        }
        let v = &self.b[len_end..end];
        self.at = end + 1;
        Ok(v)
    }
}

/// Reads the agent name and finds the connection/section boundary.
///
/// # Errors
/// [`Error::Metadata`] on anything that is not NIXL 1.5 agent metadata.
pub(crate) fn parse(b: &[u8]) -> Result<AgentMd<'_>> {
    let mut r = Reader { b, at: 0 };
    if !b.starts_with(HEADER) {
        return Err(r.bad("missing the nixlSerDes header"));
    }
    r.at = HEADER.len();
    let name = r.entry(b"Agent")?;
    let name = std::str::from_utf8(name).map_err(|_| r.bad("an agent name that is not UTF-8"))?;
    if name.is_empty() || name.contains('\0') {
        return Err(r.bad("an empty agent name"));
    }
    let conns = r.u64(b"Conns")?;
    if conns > 64 {
        return Err(r.bad("too many connection entries"));
    }
    for _ in 0..conns {
        r.entry(b"t")?;
        r.entry(b"c")?;
    }
    let sections_at = r.at;
    if r.entry(b"")? != MEM_SECTION {
        return Err(r.bad("missing the memory section"));
    }
    let sections = r.u64(b"nixlSecElms")?;
    if sections > MAX_SECTIONS {
        return Err(r.bad("an impossible number of memory sections"));
    }
    for _ in 0..sections {
        if r.entry(b"bknd")?.is_empty() {
            return Err(r.bad("an empty backend name"));
        }
        if r.entry(b"nixlDList")? != DESC_LIST {
            return Err(r.bad("an unknown descriptor list"));
        }
        let mem = r.entry(b"t")?;
        let mem: [u8; 4] = mem
            .try_into()
            .map_err(|_| r.bad("a memory type that is not 4 bytes"))?;
        // DRAM, VRAM, BLK, OBJ, FILE: NIXL indexes a table with it unchecked.
        if u32::from_le_bytes(mem) > 4 {
            return Err(r.bad("an unknown memory type"));
        }
        let n = r.u64(b"n")?;
        let room = (b.len() - r.at) / MIN_DESC;
        if n == 0 || n > room as u64 {
            return Err(r.bad("no descriptors, or more than the bytes left can hold"));
        }
        for _ in 0..n {
            if r.entry(b"")?.len() < 24 {
                return Err(r.bad("a descriptor shorter than its address, length and device"));
            }
        }
    }
    if r.at != b.len() {
        return Err(r.bad("trailing bytes after the last section"));
    }
    Ok(AgentMd {
        name,
        conns,
        sections_at,
    })
}

/// A 64-bit fingerprint of an agent metadata's connection part (its name and the UCX worker
/// addresses): two agents that happen to share a name on different hosts differ here.
pub(crate) fn identity(b: &[u8]) -> Option<u64> {
    let md = parse(b).ok()?;
    Some(fnv1a(&b[..md.sections_at]))
}

/// Splices the connection part of `conn` (an agent's `getLocalPartialMD` of no descriptors) with
/// the sections of `sections` (its `getLocalPartialMD` of some registrations): metadata any NIXL
/// peer can load to connect and reach exactly those registrations.
///
/// # Errors
/// [`Error::Metadata`] if either blob does not parse or they name different agents.
pub(crate) fn splice(conn: &[u8], sections: &[u8]) -> Result<Vec<u8>> {
    let c = parse(conn)?;
    let s = parse(sections)?;
    if c.name != s.name {
        return Err(Error::metadata(
            "nixl_metadata",
            MetadataProblem::AgentsDiffer(c.name.into(), s.name.into()),
        ));
    }
    let mut out = Vec::with_capacity(c.sections_at + sections.len() - s.sections_at);
    out.extend_from_slice(&conn[..c.sections_at]);
    out.extend_from_slice(&sections[s.sections_at..]);
    Ok(out)
}

#[cfg(test)]
fn entry(out: &mut Vec<u8>, tag: &[u8], v: &[u8]) {
    out.extend_from_slice(tag);
    out.extend_from_slice(&(v.len() as u64).to_le_bytes());
    out.extend_from_slice(v);
    out.push(b'|');
}

/// A blob laid out as NIXL 1.5 writes it (for tests), with one UCX section of `descs` descriptors (none:
/// no section).
#[cfg(test)]
pub(crate) fn blob(name: &str, conns: &[&[u8]], descs: usize) -> Vec<u8> {
    let mut b = HEADER.to_vec();
    entry(&mut b, b"Agent", name.as_bytes());
    entry(&mut b, b"Conns", &(conns.len() as u64).to_le_bytes());
    for c in conns {
        entry(&mut b, b"t", b"UCX");
        entry(&mut b, b"c", c);
    }
    entry(&mut b, b"", MEM_SECTION);
    entry(&mut b, b"nixlSecElms", &u64::from(descs > 0).to_le_bytes());
    if descs > 0 {
        entry(&mut b, b"bknd", b"UCX");
        entry(&mut b, b"nixlDList", DESC_LIST);
        entry(&mut b, b"t", &0u32.to_le_bytes());
        entry(&mut b, b"n", &(descs as u64).to_le_bytes());
        for i in 0..descs {
            let mut d = Vec::new();
            d.extend_from_slice(&(0x1000 * (i as u64 + 1)).to_le_bytes());
            d.extend_from_slice(&4096u64.to_le_bytes());
            d.extend_from_slice(&0u64.to_le_bytes());
            d.extend_from_slice(b"rkey|with|bars");
            entry(&mut b, b"", &d);
        }
    }
    b
}

#[cfg(test)]
mod tests;
