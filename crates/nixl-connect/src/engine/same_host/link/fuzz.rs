//! Two protocol cores connected in memory, with a manual clock: the harness the core's tests
//! step by hand, and the structure-aware fuzz target over frame sequences (both roles), which
//! interleaves honest traffic with forged (one to three copies in one write), replayed, truncated
//! and raw frames and checks after every step that nothing unproven got through.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Answer, Heard, Link, MAX_OPEN, MAX_UNSENT};
use crate::device::Device;
use crate::engine::same_host::auth::{self, KeyId, Keyed, Nonce, Side};
use crate::engine::same_host::identity::Identity;
use crate::engine::same_host::wire::{
    passed_fds, IpcSource, Msg, RefuseCode, Req, EAGER_MAX, MAX_FRAME, VERSION,
};

/// The operation keys a pair knows: the server holds the first two live; the third is held by
/// the client only (a replayed or foreign operation).
pub(crate) const KEYS: [&str; 3] = [
    "0c9a5a0e-4f4e-4c55-9d5d-1b7b2f1e6a01",
    "5b1e2f3a-7d6c-4e9b-8a2f-3c4d5e6f7a02",
    "9f8e7d6c-5b4a-4392-8170-6f5e4d3c2b03",
];
const CLIENT_PID: u64 = 4100;
const SERVER_PID: u64 = 4200;
/// The seed of the identity the client's metadata advertises (the owner's).
pub(crate) const SERVER_SEED: [u8; 32] = [42; 32];
/// The seed of another process's identity (a metadata holder squatting on the owner's name).
pub(crate) const IMPOSTOR_SEED: [u8; 32] = [43; 32];

/// The identity of `seed`, made once per process (a key pair costs tens of microseconds, and the
/// fuzz target makes a pair of cores per input).
pub(crate) fn identity_of(seed: [u8; 32]) -> Arc<Identity> {
    use std::sync::OnceLock;
    static OWNER: OnceLock<Arc<Identity>> = OnceLock::new();
    static IMPOSTOR: OnceLock<Arc<Identity>> = OnceLock::new();
    let cell = match seed {
        SERVER_SEED => &OWNER,
        IMPOSTOR_SEED => &IMPOSTOR,
        _ => return Arc::new(Identity::from_seed(seed)),
    };
    cell.get_or_init(|| Arc::new(Identity::from_seed(seed))).clone()
}

/// A client core and a server core, what each heard, and the clock.
pub(crate) struct Pair {
    pub(crate) client: Link,
    pub(crate) server: Link,
    /// The server's live operations, by key id.
    pub(crate) keys: HashMap<KeyId, Arc<str>>,
    pub(crate) nonce: Nonce,
    pub(crate) now: Instant,
    pub(crate) at_client: Vec<Heard>,
    pub(crate) at_server: Vec<Heard>,
}

impl Pair {
    /// A client opening with `KEYS[opening]` and a server holding `KEYS[0]` and `KEYS[1]`, the
    /// owner of the identity the client expects.
    pub(crate) fn new(opening: usize) -> Self {
        Self::serving_as(opening, SERVER_SEED)
    }

    /// As [`Self::new`], with a server proving the identity of `seed` (the owner's is
    /// [`SERVER_SEED`]).
    pub(crate) fn serving_as(opening: usize, seed: [u8; 32]) -> Self {
        let now = Instant::now();
        let nonce = [7; 16];
        let keys = KEYS[..2]
            .iter()
            .map(|k| (auth::key_id(k), Arc::<str>::from(*k)))
            .collect();
        Self {
            client: Link::client(
                KEYS[opening].into(),
                identity_of(SERVER_SEED).fingerprint(),
                nonce,
                CLIENT_PID,
                SERVER_PID,
                false,
                now,
            ),
            server: Link::server(identity_of(seed), CLIENT_PID, SERVER_PID, now),
            keys,
            nonce,
            now,
            at_client: Vec::new(),
            at_server: Vec::new(),
        }
    }

    /// As [`Self::new`], with a client that uses pipes (it cannot read the server's memory).
    pub(crate) fn piped(opening: usize) -> Self {
        let mut p = Self::new(opening);
        p.client = Link::client(
            KEYS[opening].into(),
            identity_of(SERVER_SEED).fingerprint(),
            p.nonce,
            CLIENT_PID,
            SERVER_PID,
            true,
            p.now,
        );
        p
    }

    /// A pair whose client takes device exports as VMM descriptors (it uses CUDA) but can read
    /// the server's memory (no pipes).
    #[cfg(test)]
    pub(crate) fn exporting(opening: usize) -> Self {
        let mut p = Self::new(opening);
        p.client.take_exports();
        p
    }

    /// Delivers what the server queued to the client, with `fds` descriptors.
    pub(crate) fn deliver_to_client_with(&mut self, fds: usize) {
        let bytes = self.server.out().to_vec();
        self.server.sent(bytes.len());
        self.client
            .recv(&bytes, fds, self.now, &HashMap::new(), &mut self.at_client);
    }

    /// Delivers what the client queued to the server (`fds` descriptors with it).
    pub(crate) fn deliver_to_server(&mut self, fds: usize) {
        let bytes = self.client.out().to_vec();
        self.client.sent(bytes.len());
        self.server
            .recv(&bytes, fds, self.now, &self.keys, &mut self.at_server);
    }

    /// Delivers what the server queued to the client.
    #[cfg(test)]
    pub(crate) fn deliver_to_client(&mut self) {
        let bytes = self.server.out().to_vec();
        self.server.sent(bytes.len());
        self.client
            .recv(&bytes, 0, self.now, &HashMap::new(), &mut self.at_client);
    }

    /// Hello (with the slot table), Welcome, Trusted.
    #[cfg(test)]
    pub(crate) fn shake(&mut self) {
        self.deliver_to_server(1);
        self.deliver_to_client();
        self.deliver_to_server(0);
    }

    /// `m` encoded as a peer would forge it: signed under `KEYS[key]` (or an all-zero MAC),
    /// as if sent by the client (`from_client`) or the server.
    pub(crate) fn forge(&self, m: &Msg, key: Option<usize>, from_client: bool) -> Vec<u8> {
        let from = if from_client { Side::Client } else { Side::Server };
        let mut out = Vec::new();
        m.encode_signed(&mut out, |b| match key {
            Some(k) => auth::frame_mac(&Keyed::new(KEYS[k]), &self.nonce, CLIENT_PID, SERVER_PID, from, b),
            None => [0; 32],
        });
        out
    }

    /// A `Welcome` signed by the identity of `seed`, proving `KEYS[proof_key]` (or no live
    /// operation), as a server would send it on this pair's connection.
    pub(crate) fn welcome(&self, proof_key: Option<usize>, seed: [u8; 32]) -> Msg {
        let proof = proof_key.map(|k| auth::welcome_proof(KEYS[k], &self.nonce, CLIENT_PID, SERVER_PID));
        let (public, sig) = identity_of(seed).sign_welcome(&crate::engine::same_host::identity::Welcome {
            nonce: &self.nonce,
            client_id: CLIENT_PID,
            server_id: SERVER_PID,
            proof: proof.as_ref(),
            pipes: false,
        });
        Msg::Welcome {
            proof,
            public,
            sig,
            pipes: false,
        }
    }

    /// A request for a read (or write) of `ranges` host ranges, as the client would send it.
    pub(crate) fn req(slot: u32, gen: u64, key: usize, write: bool, device: Device, ranges: usize) -> Msg {
        Msg::Req(Req {
            slot,
            gen,
            write,
            ident: 1,
            key_id: auth::key_id(KEYS[key]),
            device,
            remote: vec![(0x1000, 4096); ranges],
            local: if write {
                vec![(0x9000, 4096); ranges]
            } else {
                Vec::new()
            },
            sources: Vec::new(),
            eager: false,
            data: Vec::new(),
            pipes: 0,
        })
    }

    /// A small host request of `len` bytes as the client would send it: an eager read (its bytes
    /// may come back in the answer) or a write carrying its bytes.
    pub(crate) fn eager_req(slot: u32, gen: u64, key: usize, write: bool, len: usize) -> Msg {
        let mut m = Self::req(slot, gen, key, write, Device::Host, 1);
        if let Msg::Req(Req {
            remote,
            local,
            eager,
            data,
            ..
        }) = &mut m
        {
            *remote = vec![(0x1000, len as u64)];
            local.clear();
            *eager = !write;
            *data = if write { vec![0x5a; len] } else { Vec::new() };
        }
        m
    }

    /// Moves the clock on by `d` and lets both cores see it.
    pub(crate) fn advance(&mut self, d: Duration) {
        self.now += d;
        self.client.on_timeout(self.now);
        self.server.on_timeout(self.now);
    }
}

/// Reads the fuzzer's bytes as a program.
struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn u8(&mut self) -> Option<u8> {
        let (b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(*b)
    }
    fn bytes(&mut self, n: usize) -> &[u8] {
        let n = n.min(self.0.len());
        let (h, t) = self.0.split_at(n);
        self.0 = t;
        h
    }
    fn small(&mut self) -> u32 {
        u32::from(self.u8().unwrap_or(0) % 4)
    }
    /// How many copies of a forged frame go in one write (1-3): a peer's frames arrive together,
    /// and what the first does to the connection must hold for the ones after it in the buffer.
    fn times(&mut self) -> usize {
        1 + usize::from(self.u8().unwrap_or(0) % 3)
    }
}

pub(crate) fn source(len: u64) -> IpcSource {
    IpcSource {
        uuid: [1; 16],
        handle: [2; 64],
        base: 0x7000_0000,
        alloc_len: 1 << 30,
        buffer_id: 3,
        offset: 0,
        len,
        fd: 0,
    }
}

/// The sizes of eager requests and answers the target tries: ones that fit, the limit, one past
/// it, and one that matches nothing asked.
const EAGER_SIZES: [usize; 4] = [16, 4096, EAGER_MAX, EAGER_MAX + 1];

/// One answer frame of kind `k` for (`slot`, `gen`).
fn answer_frame(k: u8, slot: u32, gen: u64, n: usize) -> Msg {
    match k % 8 {
        7 => Msg::GrantPipe {
            slot,
            gen,
            lanes: 1 + (n % 4) as u8,
        },
        6 => Msg::Data {
            slot,
            gen,
            data: vec![0xa5; [16, 4096, EAGER_MAX, 17][n % 4]],
        },
        0 => Msg::Grant { slot, gen },
        1 => Msg::GrantIpc {
            slot,
            gen,
            // Legacy handles and VMM descriptors (some indices skipped, some past what came).
            sources: (0..n)
                .map(|i| IpcSource {
                    fd: ((n + i) % 3) as u8,
                    ..source(4096)
                })
                .collect(),
        },
        2 => Msg::Refuse {
            slot,
            gen,
            code: RefuseCode::NotLive,
            reason: "gone".into(),
        },
        3 => Msg::Refuse {
            slot,
            gen,
            code: RefuseCode::OutOfRange,
            reason: "range".into(),
        },
        4 => Msg::Fallback {
            slot,
            gen,
            reason: "nixl".into(),
        },
        _ => Msg::Done {
            slot,
            gen,
            ok: true,
            reason: String::new(),
        },
    }
}

/// The fuzz target: `data` is a program of steps over a fresh pair (see the module's doc).
/// Panics only when an invariant breaks.
pub(crate) fn run(data: &[u8]) {
    let mut input = Input(data);
    let first = input.u8().unwrap_or(0);
    let opening = usize::from(first % 3);
    // A client that reads through pipes, a server that asks for piped writes, both or neither.
    let mut p = if first & 0x10 == 0x10 {
        Pair::piped(opening)
    } else {
        Pair::new(opening)
    };
    if first & 0x20 == 0x20 {
        p.server.ask_piped_writes();
    }
    // What the client asked, by (slot, gen): the key it used, whether it was a write, whether it
    // was an eager read, and how many bytes.
    let mut asked: HashMap<(u32, u64), (usize, bool, bool, usize)> = HashMap::new();
    while let Some(op) = input.u8() {
        let (client_dead, server_dead) = (p.client.is_dead(), p.server.is_dead());
        let (nc, ns) = (p.at_client.len(), p.at_server.len());
        // Which key a forged frame of this step was signed under (none: honest traffic).
        let mut forged_client: Option<Option<usize>> = None;
        // Whether a forged frame of this step was a `Welcome` signed by the owner's identity.
        let mut honest_welcome = false;
        let mut forged_server: Option<Option<usize>> = None;
        let (slot, gen) = (input.small(), u64::from(input.small()));
        match op % 12 {
            0 => {
                let fds = usize::from(input.u8().unwrap_or(0) % 3);
                p.deliver_to_server(fds);
            }
            1 => {
                let fds = usize::from(input.u8().unwrap_or(0) % 3);
                p.deliver_to_client_with(fds);
            }
            2 => {
                let key = usize::from(input.u8().unwrap_or(0) % 3);
                let b = input.u8().unwrap_or(0);
                let (write, device) = (
                    b & 1 == 1,
                    if b & 2 == 2 { Device::Cuda(0) } else { Device::Host },
                );
                let (mut m, eager, total) = if b & 4 == 4 {
                    let len = EAGER_SIZES[usize::from(b >> 6)];
                    (Pair::eager_req(slot, gen, key, write, len), !write, len)
                } else {
                    let n = 1 + usize::from(b >> 6);
                    (Pair::req(slot, gen, key, write, device, n), false, 4096 * n)
                };
                if b & 8 == 8 {
                    // Through pipes: lanes asked (a read) or read ends passed (a write).
                    if let Msg::Req(Req { local, pipes, .. }) = &mut m {
                        local.clear();
                        *pipes = 1 + (b >> 4) % 4;
                    }
                }
                if p.client.request_msg(KEYS[key], &m) {
                    asked.insert((slot, gen), (key, write, eager, total));
                }
            }
            3 => {
                let k = input.u8().unwrap_or(0);
                let a = match k % 7 {
                    6 => Answer::GrantPipe(k >> 5),
                    5 => Answer::Data(vec![0xa5; EAGER_SIZES[usize::from(k >> 6)]]),
                    0 => Answer::Grant,
                    1 => Answer::GrantIpc(vec![source(4096)]),
                    2 => Answer::Refuse(RefuseCode::Busy, "busy".into()),
                    3 => Answer::Fallback("nixl".into()),
                    _ => Answer::WriteDone {
                        ok: true,
                        reason: String::new(),
                    },
                };
                p.server.answer(slot, gen, a);
            }
            4 => p
                .client
                .read_done(slot, gen, input.u8().unwrap_or(0) & 1 == 1, ""),
            5 => {
                // A forged frame to the client.
                let k = input.u8().unwrap_or(0);
                let key = match k >> 6 {
                    3 => None,
                    n => Some(usize::from(n)),
                };
                honest_welcome = k & 0x20 == 0x20 && k % 8 == 0;
                let m = match k % 8 {
                    0 => p.welcome(
                        key,
                        if honest_welcome {
                            SERVER_SEED
                        } else {
                            IMPOSTOR_SEED
                        },
                    ),
                    1 => Msg::Reject { reason: "no".into() },
                    2 => Msg::Hello {
                        version: VERSION,
                        key_id: [0; 16],
                        nonce: [0; 16],
                    },
                    _ => answer_frame(k, slot, gen, 1 + usize::from(input.small() as u8)),
                };
                let fds = usize::from(input.u8().unwrap_or(0) % 5);
                let bytes = p.forge(&m, key, false).repeat(input.times());
                p.client
                    .recv(&bytes, fds, p.now, &HashMap::new(), &mut p.at_client);
                forged_client = Some(key);
            }
            6 => {
                // A forged frame to the server.
                let k = input.u8().unwrap_or(0);
                let key = match k >> 6 {
                    3 => None,
                    n => Some(usize::from(n)),
                };
                let m = match k % 6 {
                    5 => Pair::eager_req(
                        slot,
                        gen,
                        key.unwrap_or(2),
                        k & 16 == 16,
                        EAGER_SIZES[usize::from(input.small() as u8)],
                    ),
                    0 => Msg::Hello {
                        version: if k & 8 == 8 { VERSION + 1 } else { VERSION },
                        key_id: auth::key_id(KEYS[key.unwrap_or(2)]),
                        nonce: p.nonce,
                    },
                    1 => Msg::Trusted { pipes: k & 16 == 16 },
                    2 if k & 32 == 32 => {
                        // A device request: a write with a VMM source (its descriptor passed or
                        // not), or a read asking for descriptors.
                        let write = k & 16 == 16;
                        let mut m = Pair::req(slot, gen, key.unwrap_or(2), write, Device::Cuda(0), 1);
                        if let Msg::Req(Req { sources, pipes, .. }) = &mut m {
                            if write {
                                sources.push(IpcSource {
                                    fd: 1,
                                    ..source(4096)
                                });
                            } else {
                                *pipes = 1;
                            }
                        }
                        m
                    }
                    2 => Pair::req(slot, gen, key.unwrap_or(2), k & 16 == 16, Device::Host, 1),
                    3 => Msg::Done {
                        slot,
                        gen,
                        ok: true,
                        reason: String::new(),
                    },
                    _ if k & 32 == 32 => Msg::Forgot {
                        ids: vec![u64::from(slot); usize::from(input.u8().unwrap_or(0) % 70)],
                    },
                    _ => Msg::Grant { slot, gen },
                };
                let fds = usize::from(input.u8().unwrap_or(0) % 2);
                let bytes = p.forge(&m, key, true).repeat(input.times());
                p.server.recv(&bytes, fds, p.now, &p.keys, &mut p.at_server);
                forged_server = Some(key);
            }
            7 | 8 => {
                let n = usize::from(input.u8().unwrap_or(0));
                let fds = usize::from(input.u8().unwrap_or(0) % 2);
                let bytes = input.bytes(n).to_vec();
                if op % 12 == 7 {
                    p.server.recv(&bytes, fds, p.now, &p.keys, &mut p.at_server);
                    forged_server = Some(None);
                } else {
                    p.client
                        .recv(&bytes, fds, p.now, &HashMap::new(), &mut p.at_client);
                    forged_client = Some(None);
                }
            }
            9 => {
                let ms = u64::from(input.u8().unwrap_or(0)) * 40;
                p.advance(Duration::from_millis(ms));
            }
            10 => {
                // Part of what the client queued (a frame cut anywhere).
                let n = usize::from(input.u8().unwrap_or(0));
                let bytes = p.client.out()[..n.min(p.client.out().len())].to_vec();
                p.client.sent(bytes.len());
                p.server.recv(&bytes, 0, p.now, &p.keys, &mut p.at_server);
            }
            _ => {
                // The owner's answer delivered twice (a replay on the same connection).
                let bytes = p.server.out().to_vec();
                p.server.sent(bytes.len());
                for _ in 0..2 {
                    p.client.recv(&bytes, 0, p.now, &HashMap::new(), &mut p.at_client);
                }
            }
        }
        // A dead core hears nothing more.
        if client_dead {
            assert_eq!(p.at_client.len(), nc, "a dead client core heard something");
        }
        if server_dead {
            assert_eq!(p.at_server.len(), ns, "a dead server core heard something");
        }
        // No handshake outcome is believed from anyone but the owner of the advertised identity.
        if forged_client.is_some() && !honest_welcome {
            assert!(
                !p.at_client[nc..]
                    .iter()
                    .any(|h| matches!(h, Heard::Ready | Heard::NotLive { .. })),
                "a Welcome believed without the owner's signature: {:?}",
                &p.at_client[nc..]
            );
        }
        // Nothing that makes an operation succeed gets through unless signed under that
        // operation's own key.
        for h in &p.at_client[nc..] {
            let (slot, gen) = match h {
                Heard::Grant { slot, gen, .. }
                | Heard::GrantPipe { slot, gen, .. }
                | Heard::WriteDone { slot, gen, .. }
                | Heard::Data { slot, gen, .. } => (*slot, *gen),
                Heard::Refused {
                    slot,
                    gen,
                    code: RefuseCode::NotLive,
                    ..
                }
                | Heard::Fallback { slot, gen, .. } => {
                    assert!(asked.contains_key(&(*slot, *gen)), "{h:?} answers nothing asked");
                    continue;
                }
                Heard::Refused { slot, gen, .. } => (*slot, *gen),
                _ => continue,
            };
            let Some(&(key, write, eager, total)) = asked.get(&(slot, gen)) else {
                panic!("{h:?} answers nothing asked");
            };
            if let Some(forged) = forged_client {
                assert_eq!(forged, Some(key), "{h:?} believed under another key");
            }
            if matches!(h, Heard::Grant { .. } | Heard::GrantPipe { .. }) {
                assert!(!write, "a write granted as a read");
            }
            if let Heard::Data { data, .. } = h {
                assert!(
                    eager && !write,
                    "bytes believed for a request that did not ask for them"
                );
                assert_eq!(
                    data.len(),
                    total,
                    "an eager read's bytes of the wrong size believed"
                );
            }
        }
        for h in &p.at_server[ns..] {
            // A small operation's fields reach the owner only as the link's rules allow.
            if let Heard::Req(r) = h {
                let total: u64 = r.req.remote.iter().map(|x| x.1).sum();
                if r.req.eager {
                    assert!(!r.req.write && r.req.data.is_empty() && total <= EAGER_MAX as u64);
                }
                if !r.req.data.is_empty() {
                    assert!(r.req.write && r.req.local.is_empty() && total == r.req.data.len() as u64);
                }
                if r.req.pipes > 0 && r.req.device != Device::Host {
                    assert!(
                        !r.req.write && r.req.pipes == 1 && r.req.sources.is_empty(),
                        "a device request asking for more than VMM descriptors: {r:?}"
                    );
                } else if r.req.pipes > 0 {
                    assert!(
                        !r.req.eager && r.req.data.is_empty() && r.req.local.is_empty(),
                        "pipes for something else than a host copy: {r:?}"
                    );
                }
                let expect = if r.req.write {
                    usize::from(r.req.pipes) + passed_fds(&r.req.sources).unwrap_or(usize::MAX)
                } else {
                    0
                };
                assert_eq!(
                    r.passed, expect,
                    "descriptors counted off for another frame: {r:?}"
                );
                if r.req.sources.iter().any(|s| s.fd > 0) {
                    assert!(
                        r.req.write
                            && r.req.device != Device::Host
                            && r.req.pipes == 0
                            && passed_fds(&r.req.sources).is_some(),
                        "VMM descriptors with something else than a device write: {r:?}"
                    );
                }
            }
            if let (Some(forged), Heard::Req(r)) = (forged_server, h) {
                assert_eq!(
                    forged.map(|k| KEYS[k]),
                    Some(&*r.key),
                    "a request believed under another key"
                );
            }
            if let (Some(forged), Heard::ReadDone { key, .. }) = (forged_server, h) {
                assert_eq!(
                    forged.map(|k| KEYS[k]),
                    Some(&**key),
                    "a done believed under another key"
                );
            }
        }
        // Every peer-driven resource stays bounded.
        for l in [&p.client, &p.server] {
            assert!(l.rbuf.len() <= MAX_FRAME + 4 + (64 << 10));
            assert!(l.out().len() <= MAX_UNSENT + MAX_FRAME);
            assert!(l.open.len() <= MAX_OPEN);
        }
    }
}
