//! A request's body: one struct for the frame (`Msg::Req`), the link's request to its owner
//! (`link::Request`), the policy's input (`policy::decide`) and the server's actions on it.

use super::{device_code, device_from, IpcSource, MAC_LEN, R, SOURCE_BYTES, W};
use crate::device::Device;
use crate::engine::same_host::auth::KeyId;
use crate::engine::same_host::limits::MAX_LANES;

/// Access to one operation's memory, as the active side asks it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Req {
    pub(crate) slot: u32,
    pub(crate) gen: u64,
    pub(crate) write: bool,
    /// The fingerprint of the connection part of the metadata the request comes from.
    pub(crate) ident: u64,
    pub(crate) key_id: KeyId,
    pub(crate) device: Device,
    /// Ranges in the passive side's memory.
    pub(crate) remote: Vec<(u64, u64)>,
    /// For writes: the source ranges in the active side's memory (one per remote range).
    pub(crate) local: Vec<(u64, u64)>,
    /// For writes from device memory: the sources exported (one per remote range), else empty.
    pub(crate) sources: Vec<IpcSource>,
    /// A host read of at most [`EAGER_MAX`](super::EAGER_MAX) bytes into host memory: the
    /// server may answer with [`Msg::Data`](super::Msg::Data) instead of a grant.
    pub(crate) eager: bool,
    /// A host write of at most [`EAGER_MAX`](super::EAGER_MAX) bytes: its bytes, the remote
    /// ranges' in order (`local` is then empty; the server copies them into its memory and
    /// answers `Done`).
    pub(crate) data: Vec<u8>,
    /// Host memory through pipes (at most [`MAX_LANES`]; 0: not): for a read, the lanes the
    /// reader asks for (the server answers [`Msg::GrantPipe`](super::Msg::GrantPipe)); for a
    /// write, the read ends passed with this frame, fed by the writer. On a device read, 1: the
    /// reader takes VMM descriptors.
    pub(crate) pipes: u8,
}

impl Req {
    /// The exact encoded size of this request's frame (`Msg::Req`'s: length prefix, type and MAC
    /// included).
    pub(crate) fn frame_len(&self) -> usize {
        4 + 1 + self.encoded_len() + MAC_LEN
    }

    /// The payload's exact encoded size (no type byte, length prefix or MAC).
    pub(super) fn encoded_len(&self) -> usize {
        4 + 8 // slot, gen
            + 1 + 8 + 16 // write, ident, key id
            + 1 + 4 // device
            + 4 + 16 * self.remote.len()
            + 4 + 16 * self.local.len()
            + 4 + SOURCE_BYTES * self.sources.len()
            + 1 // eager
            + 4 + self.data.len()
            + 1 // pipes
    }

    pub(super) fn encode(&self, w: &mut W<'_>) {
        w.u32(self.slot);
        w.u64(self.gen);
        w.u8(u8::from(self.write));
        w.u64(self.ident);
        w.bytes(&self.key_id);
        let (k, id) = device_code(self.device);
        w.u8(k);
        w.u32(id);
        w.ranges(&self.remote);
        w.ranges(&self.local);
        w.sources(&self.sources);
        w.u8(u8::from(self.eager));
        w.data(&self.data);
        w.u8(self.pipes);
    }

    /// The payload read back, every field checked; `None` for anything malformed.
    pub(super) fn decode(r: &mut R<'_>) -> Option<Req> {
        let req = Req {
            slot: r.u32()?,
            gen: r.u64()?,
            write: r.bool()?,
            ident: r.u64()?,
            key_id: r.array()?,
            device: device_from(r.u8()?, r.u32()?)?,
            remote: r.ranges()?,
            local: r.ranges()?,
            sources: r.sources()?,
            eager: r.bool()?,
            data: r.data()?,
            pipes: r.u8()?,
        };
        (req.pipes as usize <= MAX_LANES).then_some(req)
    }
}
