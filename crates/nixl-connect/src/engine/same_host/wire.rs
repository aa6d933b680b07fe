//! The same-host negotiation protocol: length-prefixed binary frames over a Unix stream socket.
//!
//! Frame: `u32` length of what follows (little-endian), `u8` type, payload, and for every frame
//! that concerns one operation (`Req`, `Grant`, `GrantIpc`, `Refuse`, `Fallback`, `Done`) a
//! trailing 32-byte MAC under *that operation's* key over the type and payload
//! ([`auth::frame_mac`](super::auth::frame_mac)). Every field is checked on decode; a peer that
//! sends anything malformed is disconnected. The codec knows nothing of keys: it hands the signed
//! bytes and the MAC to the connection core (`link`), which checks them.
//!
//! | frame | from | meaning |
//! |---|---|---|
//! | `Hello` (+ slot-table fd) | active | protocol version; the first operation's key id and a nonce |
//! | `Welcome` | passive | proof that it holds that operation's key (or none), signed by the identity its agent name advertises |
//! | `Trusted` | active | the proof checks: requests follow |
//! | `Reject` | passive | the same-host path is refused for this connection (different user...) |
//! | `Req` | active | access to the operation named by a key id, with proof of its key: direction, ranges, (writes) the source, (device-memory writes) its CUDA IPC export; (small host reads) whether the bytes may come back in the answer; (small host writes) the bytes themselves |
//! | `Grant` | passive | a read may copy now |
//! | `Data` | passive | a small host read's bytes, copied by their owner (ends the read: no `Done`) |
//! | `GrantIpc` | passive | a read of device memory may copy now, through these CUDA IPC exports |
//! | `Refuse` | passive | the request breaks the operation's scope (ended, range, direction, busy) |
//! | `Fallback` | passive | this operation cannot take the same-host path: use NIXL |
//! | `Done` | both | the copier finished (reads: the active side; writes: the passive side) |
//! | `Forgot` | both | the sender gave back these VMM exports: the peer's mappings of them may go |

use super::auth::{KeyId, Nonce, Tag};
use super::identity::{PublicKey, Sig};
use super::violation::Violation;
use crate::device::Device;

mod req;
pub(crate) use req::Req;

/// Protocol version; a `Hello` with another one is rejected, and the peer falls back to NIXL.
pub(crate) const VERSION: u32 = 9;
/// The largest frame accepted (10,000 ranges need ~320 KiB).
pub(crate) const MAX_FRAME: usize = 16 << 20;
/// The longest reason string a frame carries, in bytes (longer ones are cut at a character
/// boundary when encoded; the decoder refuses longer ones).
pub(crate) const MAX_REASON: usize = 4096;
/// The length of the trailing MAC of an operation's frames.
pub(crate) const MAC_LEN: usize = 32;
/// The most bytes a small host operation carries in its frame ([`Msg::Req`]'s `data` for a write,
/// [`Msg::Data`] for a read; see `eager`). A decoder refuses a longer field.
pub(crate) const EAGER_MAX: usize = 8 << 10;
/// The most pipes one copy uses.
pub(crate) use super::limits::MAX_LANES;
/// The most passed descriptors a connection holds before the frames that take them are read:
/// those of two frames (one frame's tail and the next frame's start can come in one read).
pub(crate) const MAX_PENDING_DESCRIPTORS: usize = 2 * MAX_LANES;
/// The most export ids one [`Msg::Forgot`] names.
pub(crate) const MAX_FORGOT: usize = 64;
/// Encoded size of one [`IpcSource`].
pub(crate) const SOURCE_BYTES: usize = 16 + 64 + 5 * 8 + 1;

/// Why a request for a key this side has no live operation for is refused.
pub(crate) const NOT_LIVE: &str = "no live operation has this notification key: it completed, was cancelled \
                        or dropped (a replayed metadata string?)";

/// Why a request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum RefuseCode {
    /// No live operation has this key (completed, cancelled, dropped: a replay).
    NotLive = 1,
    /// A range lies outside the operation's descriptors.
    OutOfRange = 2,
    /// A read of a writable or a write of a readable.
    WrongDirection = 3,
    /// Another writer holds the writable.
    Busy = 4,
}

impl RefuseCode {
    fn from_u8(v: u8) -> Option<Self> {
        [Self::NotLive, Self::OutOfRange, Self::WrongDirection, Self::Busy]
            .into_iter()
            .find(|c| *c as u8 == v)
    }
}

pub(crate) use crate::ipc_source::IpcSource;

/// How many descriptors a frame carrying `sources` passes: the highest `fd` index, when the
/// indices used are exactly `1..=n` (`None` when one is skipped: such a frame is malformed).
pub(crate) fn passed_fds(sources: &[IpcSource]) -> Option<usize> {
    let n = sources.iter().map(|s| s.fd as usize).max().unwrap_or(0);
    let mut seen = [false; MAX_LANES + 1];
    for s in sources {
        *seen.get_mut(s.fd as usize)? = true;
    }
    seen[1..=n].iter().all(|&b| b).then_some(n)
}

/// One frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Msg {
    Hello {
        version: u32,
        /// The key id of the operation that opens the connection.
        key_id: KeyId,
        nonce: Nonce,
    },
    Welcome {
        /// [`super::auth::welcome_proof`] of that operation's key; `None` if no live operation
        /// has that key id.
        proof: Option<Tag>,
        /// The server's identity key, whose fingerprint the agent name advertises.
        public: PublicKey,
        /// Its signature over the client's nonce, both pids and `proof`
        /// ([`super::identity::verify_welcome`]).
        sig: Sig,
        /// This side cannot read the client's memory (another PID namespace, ptrace): its writes
        /// should pass pipes (signed with the rest).
        pipes: bool,
    },
    /// The client checked the server's proof; its requests follow.
    Trusted {
        /// Its writes will pass pipes' read ends with their requests (it cannot read the
        /// server's memory, so it supposes the server cannot read its own: another PID
        /// namespace); the server takes descriptors from then on, at most
        /// [`MAX_PENDING_DESCRIPTORS`] at once.
        pipes: bool,
    },
    Reject {
        reason: String,
    },
    /// Access to one operation's memory (see [`Req`]).
    Req(Req),
    Grant {
        slot: u32,
        gen: u64,
    },
    GrantIpc {
        slot: u32,
        gen: u64,
        /// One per requested range, in the request's order.
        sources: Vec<IpcSource>,
    },
    /// A host read through pipes: `lanes` read ends passed with this frame, fed by the server.
    GrantPipe {
        slot: u32,
        gen: u64,
        lanes: u8,
    },
    /// The answer to an eager read: the requested ranges' bytes, in order.
    Data {
        slot: u32,
        gen: u64,
        data: Vec<u8>,
    },
    Refuse {
        slot: u32,
        gen: u64,
        code: RefuseCode,
        reason: String,
    },
    Fallback {
        slot: u32,
        gen: u64,
        reason: String,
    },
    Done {
        slot: u32,
        gen: u64,
        ok: bool,
        reason: String,
    },
    /// The sender gave back the VMM exports it named by these ids on this connection (at most
    /// [`MAX_FORGOT`]): the receiver's mappings of them may go. Unsigned (about no operation):
    /// it only ever makes the receiver drop what this same peer gave it.
    Forgot {
        ids: Vec<u64>,
    },
}

/// Declares [`Kind`] from one list of `Msg` variants and their wire values (encode, decode and
/// [`Msg::kind`] all read it).
macro_rules! kinds {
    ($($K:ident = $v:literal,)*) => {
        /// The frames' types, as their first byte says: the one table encode and decode both read.
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        #[repr(u8)]
        pub(crate) enum Kind {
            $($K = $v,)*
        }

        impl Kind {
            const ALL: &'static [Kind] = &[$(Kind::$K),*];

            /// The type of frame `m` is.
            fn of(m: &Msg) -> Kind {
                match m {
                    $(Msg::$K { .. } => Kind::$K,)*
                }
            }

            fn from_u8(v: u8) -> Option<Self> {
                Self::ALL.iter().copied().find(|k| *k as u8 == v)
            }

            /// True for the frames that concern one operation and so carry its MAC.
            pub(crate) fn signed(self) -> bool {
                !matches!(
                    self,
                    Kind::Hello | Kind::Welcome | Kind::Trusted | Kind::Reject | Kind::Forgot
                )
            }
        }
    };
}

kinds! {
    Hello = 1, Welcome = 2, Reject = 3, Req = 4, Grant = 5, Refuse = 6, Fallback = 7,
    Done = 8, GrantIpc = 9, Trusted = 10, Data = 11, GrantPipe = 12, Forgot = 13,
}

/// One decoded frame: the message, the bytes its MAC covers (type and payload), and the MAC
/// (signed frames only).
#[derive(Debug)]
pub(crate) struct Frame<'a> {
    pub(crate) msg: Msg,
    pub(crate) signed: &'a [u8],
    pub(crate) mac: Option<Tag>,
}

struct W<'a>(&'a mut Vec<u8>);

impl W<'_> {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn bytes(&mut self, b: &[u8]) {
        self.0.extend_from_slice(b);
    }
    fn str(&mut self, s: &str) {
        let b = clip(s).as_bytes();
        self.0.extend_from_slice(&(b.len() as u16).to_le_bytes());
        self.0.extend_from_slice(b);
    }
    fn ranges(&mut self, r: &[(u64, u64)]) {
        self.u32(r.len() as u32);
        for &(a, l) in r {
            self.u64(a);
            self.u64(l);
        }
    }
    fn data(&mut self, d: &[u8]) {
        self.u32(d.len() as u32);
        self.0.extend_from_slice(d);
    }
    fn sources(&mut self, v: &[IpcSource]) {
        self.u32(v.len() as u32);
        for s in v {
            self.0.extend_from_slice(&s.uuid);
            self.0.extend_from_slice(&s.handle);
            for x in [s.base, s.alloc_len, s.buffer_id, s.offset, s.len] {
                self.u64(x);
            }
            self.u8(s.fd);
        }
    }
}

/// `s` cut to at most [`MAX_REASON`] bytes at a character boundary.
fn clip(s: &str) -> &str {
    let mut n = s.len().min(MAX_REASON);
    while !s.is_char_boundary(n) {
        n -= 1;
    }
    &s[..n]
}

struct R<'a> {
    b: &'a [u8],
}

impl<'a> R<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.b.len() < n {
            return None;
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Some(h)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    fn u32(&mut self) -> Option<u32> {
        self.array().map(u32::from_le_bytes)
    }
    fn u64(&mut self) -> Option<u64> {
        self.array().map(u64::from_le_bytes)
    }
    fn bool(&mut self) -> Option<bool> {
        match self.u8()? {
            0 => Some(false),
            1 => Some(true),
            _ => None,
        }
    }
    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.take(N)?.try_into().ok()
    }
    fn str(&mut self, max: usize) -> Option<String> {
        let n = u16::from_le_bytes(self.array()?) as usize;
        if n > max {
            return None;
        }
        String::from_utf8(self.take(n)?.to_vec()).ok()
    }
    /// An eager operation's bytes: at most [`EAGER_MAX`].
    fn data(&mut self) -> Option<Vec<u8>> {
        let n = self.u32()? as usize;
        if n > EAGER_MAX {
            return None;
        }
        Some(self.take(n)?.to_vec())
    }
    fn ranges(&mut self) -> Option<Vec<(u64, u64)>> {
        let n = self.u32()? as usize;
        if n.checked_mul(16)? > self.b.len() {
            return None;
        }
        (0..n).map(|_| Some((self.u64()?, self.u64()?))).collect()
    }
    fn sources(&mut self) -> Option<Vec<IpcSource>> {
        let n = self.u32()? as usize;
        if n.checked_mul(SOURCE_BYTES)? > self.b.len() {
            return None;
        }
        (0..n)
            .map(|_| {
                let s = IpcSource {
                    uuid: self.take(16)?.try_into().ok()?,
                    handle: self.take(64)?.try_into().ok()?,
                    base: self.u64()?,
                    alloc_len: self.u64()?,
                    buffer_id: self.u64()?,
                    offset: self.u64()?,
                    len: self.u64()?,
                    fd: self.u8()?,
                };
                // The range must lie inside the allocation it names; a descriptor's index within
                // what one frame may pass.
                (s.offset.checked_add(s.len)? <= s.alloc_len
                    && s.base.checked_add(s.alloc_len).is_some()
                    && s.fd as usize <= MAX_LANES)
                    .then_some(s)
            })
            .collect()
    }
}

fn device_code(d: Device) -> (u8, u32) {
    match d {
        Device::Host => (0, 0),
        Device::Cuda(n) => (1, n),
        Device::Xpu(n) => (2, n),
    }
}

fn device_from(kind: u8, id: u32) -> Option<Device> {
    Some(match kind {
        0 if id == 0 => Device::Host,
        1 => Device::Cuda(id),
        2 => Device::Xpu(id),
        _ => return None,
    })
}

impl Msg {
    /// This frame's type.
    pub(crate) fn kind(&self) -> Kind {
        Kind::of(self)
    }

    /// The request an answer (or a `Done`) is about: its slot and generation, which lead its
    /// payload; `None` for the other frames.
    pub(crate) fn slot_gen(&self) -> Option<(u32, u64)> {
        match self {
            Msg::Grant { slot, gen }
            | Msg::GrantIpc { slot, gen, .. }
            | Msg::GrantPipe { slot, gen, .. }
            | Msg::Data { slot, gen, .. }
            | Msg::Refuse { slot, gen, .. }
            | Msg::Fallback { slot, gen, .. }
            | Msg::Done { slot, gen, .. } => Some((*slot, *gen)),
            _ => None,
        }
    }

    /// True for the frames that concern one operation and so carry its MAC.
    pub(crate) fn signed(&self) -> bool {
        self.kind().signed()
    }

    /// The exact encoded size of this frame, length prefix and MAC included (a request's
    /// sender asks [`Req::frame_len`]).
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn encoded_len(&self) -> usize {
        let str_len = |s: &str| 2 + clip(s).len();
        let body = 1 + match self {
            Msg::Hello { .. } => 4 + 16 + 16,
            Msg::Welcome { proof, .. } => 1 + proof.map_or(0, |p| p.len()) + 32 + 64 + 1,
            Msg::Trusted { .. } => 1,
            Msg::Reject { reason } => str_len(reason),
            Msg::Req(req) => req.encoded_len(),
            Msg::Grant { .. } => 12,
            Msg::GrantPipe { .. } => 13,
            Msg::Data { data, .. } => 12 + 4 + data.len(),
            Msg::GrantIpc { sources, .. } => 12 + 4 + SOURCE_BYTES * sources.len(),
            Msg::Refuse { reason, .. } => 12 + 1 + str_len(reason),
            Msg::Fallback { reason, .. } => 12 + str_len(reason),
            Msg::Done { reason, .. } => 12 + 1 + str_len(reason),
            Msg::Forgot { ids } => 4 + 8 * ids.len(),
        };
        4 + body + if self.signed() { MAC_LEN } else { 0 }
    }

    /// Appends this frame to `out` (length prefix included); a signed frame ends with
    /// `sign(type and payload)`, which unsigned frames never call.
    pub(crate) fn encode_signed(&self, out: &mut Vec<u8>, sign: impl FnOnce(&[u8]) -> [u8; MAC_LEN]) {
        let at = out.len();
        self.encode_body(out);
        if self.signed() {
            let mac = sign(&out[at + 4..]);
            out.extend_from_slice(&mac);
            let len = (out.len() - at - 4) as u32;
            out[at..at + 4].copy_from_slice(&len.to_le_bytes());
        }
    }

    /// Appends this frame to `out`, signed frames with an all-zero MAC (tests, and answers that
    /// prove nothing: see `link`).
    #[cfg(test)]
    pub(crate) fn encode(&self, out: &mut Vec<u8>) {
        self.encode_signed(out, |_| [0; MAC_LEN]);
    }

    fn encode_body(&self, out: &mut Vec<u8>) {
        let at = out.len();
        out.extend_from_slice(&[0; 4]);
        let mut w = W(out);
        w.u8(self.kind() as u8);
        if let Some((slot, gen)) = self.slot_gen() {
            w.u32(slot);
            w.u64(gen);
        }
        match self {
            Msg::Hello {
                version,
                key_id,
                nonce,
            } => {
                w.u32(*version);
                w.bytes(key_id);
                w.bytes(nonce);
            }
            Msg::Welcome {
                proof,
                public,
                sig,
                pipes,
            } => {
                match proof {
                    Some(p) => {
                        w.u8(1);
                        w.bytes(p);
                    }
                    None => w.u8(0),
                }
                w.bytes(public);
                w.bytes(sig);
                w.u8(u8::from(*pipes));
            }
            Msg::Trusted { pipes } => w.u8(u8::from(*pipes)),
            Msg::Reject { reason } => w.str(reason),
            Msg::Req(req) => req.encode(&mut w),
            Msg::Forgot { ids } => {
                w.u32(ids.len() as u32);
                for id in ids {
                    w.u64(*id);
                }
            }
            // The slot and generation are written above.
            Msg::Grant { .. } => {}
            Msg::GrantPipe { lanes, .. } => w.u8(*lanes),
            Msg::GrantIpc { sources, .. } => w.sources(sources),
            Msg::Data { data, .. } => w.data(data),
            Msg::Refuse { code, reason, .. } => {
                w.u8(*code as u8);
                w.str(reason);
            }
            Msg::Fallback { reason, .. } => w.str(reason),
            Msg::Done { ok, reason, .. } => {
                w.u8(u8::from(*ok));
                w.str(reason);
            }
        }
        let len = (out.len() - at - 4) as u32;
        out[at..at + 4].copy_from_slice(&len.to_le_bytes());
    }

    /// Decodes one frame from the front of `buf`, of at most `max` bytes after its length
    /// prefix: `Ok(None)` when it is not complete yet, `Ok(Some((frame, used)))`, or `Err` for a
    /// malformed or oversized frame (a length over `max` is refused before its bytes arrive).
    pub(crate) fn decode(buf: &[u8], max: usize) -> Result<Option<(Frame<'_>, usize)>, Violation> {
        let Some(head) = buf.get(..4) else {
            return Ok(None);
        };
        let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
        if len == 0 || len > max.min(MAX_FRAME) {
            return Err(Violation::BadFrameSize);
        }
        let Some(whole) = buf.get(4..4 + len) else {
            return Ok(None);
        };
        let mut r = R { b: whole };
        let msg = Self::body(&mut r).ok_or(Violation::MalformedFrame)?;
        let (signed, mac) = if msg.signed() {
            let Ok(mac) = <[u8; MAC_LEN]>::try_from(r.b) else {
                return Err(Violation::MissingMac);
            };
            (&whole[..len - MAC_LEN], Some(mac))
        } else if r.b.is_empty() {
            (whole, None)
        } else {
            return Err(Violation::TrailingBytes);
        };
        Ok(Some((Frame { msg, signed, mac }, 4 + len)))
    }

    fn body(r: &mut R<'_>) -> Option<Msg> {
        Some(match Kind::from_u8(r.u8()?)? {
            Kind::Hello => Msg::Hello {
                version: r.u32()?,
                key_id: r.array()?,
                nonce: r.array()?,
            },
            Kind::Welcome => Msg::Welcome {
                proof: match r.u8()? {
                    0 => None,
                    1 => Some(r.array()?),
                    _ => return None,
                },
                public: r.array()?,
                sig: r.array()?,
                pipes: r.bool()?,
            },
            Kind::Trusted => Msg::Trusted { pipes: r.bool()? },
            Kind::Reject => Msg::Reject {
                reason: r.str(MAX_REASON)?,
            },
            Kind::Req => Msg::Req(Req::decode(r)?),
            Kind::Grant => Msg::Grant {
                slot: r.u32()?,
                gen: r.u64()?,
            },
            Kind::Refuse => Msg::Refuse {
                slot: r.u32()?,
                gen: r.u64()?,
                code: RefuseCode::from_u8(r.u8()?)?,
                reason: r.str(MAX_REASON)?,
            },
            Kind::Fallback => Msg::Fallback {
                slot: r.u32()?,
                gen: r.u64()?,
                reason: r.str(MAX_REASON)?,
            },
            Kind::Done => Msg::Done {
                slot: r.u32()?,
                gen: r.u64()?,
                ok: r.bool()?,
                reason: r.str(MAX_REASON)?,
            },
            Kind::GrantIpc => Msg::GrantIpc {
                slot: r.u32()?,
                gen: r.u64()?,
                sources: r.sources()?,
            },
            Kind::GrantPipe => Msg::GrantPipe {
                slot: r.u32()?,
                gen: r.u64()?,
                lanes: match r.u8()? {
                    n @ 1.. if n as usize <= MAX_LANES => n,
                    _ => return None,
                },
            },
            Kind::Data => Msg::Data {
                slot: r.u32()?,
                gen: r.u64()?,
                data: r.data()?,
            },
            Kind::Forgot => {
                let n = r.u32()? as usize;
                if n > MAX_FORGOT {
                    return None;
                }
                Msg::Forgot {
                    ids: (0..n).map(|_| r.u64()).collect::<Option<_>>()?,
                }
            }
        })
    }
}

#[cfg(test)]
mod tests;
