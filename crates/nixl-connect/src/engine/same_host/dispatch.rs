//! Dispatch: what a connection's protocol core heard (well-formed, in order, proven), to the part
//! of the transport that acts on it (the client's answers, the server's requests, the
//! handshake's outcome).

use std::time::Instant;

use super::link::{Answer, Heard};
use super::records::{refused, ConnId, Phase, RequestId};
use super::sys::close_elsewhere;
use super::transport::SameHostTransport;
use super::wire::{RefuseCode, NOT_LIVE};
use crate::engine::transport::Event;
use crate::error::Error;

impl SameHostTransport {
    /// Acts on what connection `i`'s core heard.
    pub(super) fn handle(&mut self, i: ConnId, h: Heard, out: &mut Vec<Event>) {
        match h {
            // The slot table was checked on receipt, and whether this side may pull from the
            // client was found at accept (`conn.rs`): nothing left to do.
            Heard::Hello => {}
            Heard::Trusted { pipes } => {
                if !pipes {
                    self.sockets.refuse_descriptors(i);
                }
            }
            Heard::Unused { fds } => self.sockets.drop_passed(i, fds),
            Heard::Forgot { ids } => self.on_forgot(i, ids),
            Heard::GrantPipe { slot, gen, lanes } => self.on_grant_pipe(i, slot, gen, lanes, out),
            Heard::Req(r) => {
                if self.server.knows(r.req.ident) {
                    self.on_req(i, r, out)
                } else if let Some(c) = self.sockets.get_mut(i) {
                    // Metadata of an agent of the same name elsewhere (another host, an earlier
                    // process): not this connector's to refuse; NIXL will sort it out. A write's
                    // pipes or VMM descriptors came with it (its core counted them off): closed,
                    // so the next frame's are the next ones.
                    let n = r.passed;
                    c.passed.drain(..n.min(c.passed.len())).for_each(close_elsewhere);
                    c.link.answer(
                        r.req.slot,
                        r.req.gen,
                        Answer::Fallback("the metadata names another agent of the same name".into()),
                    );
                }
            }
            Heard::ReadDone { slot, gen, ok, key } => {
                self.on_read_done(RequestId { conn: i, slot, gen }, ok, &key, out)
            }
            Heard::Ready => self.on_ready(i, out),
            Heard::NotLive { key } => self.on_not_live(i, &key, out),
            Heard::Impostor => {
                let Some(c) = self.sockets.get(i) else { return };
                // Not the process that made the operation: another one holds the socket name. It
                // learnt a key hash and a nonce; nothing else is sent, nothing it says is believed.
                tracing::warn!(
                    peer = %c.peer,
                    pid = c.peer_pid,
                    "the process on this peer's same-host socket could not prove it holds the \
                     operation's key (an impostor?); using NIXL"
                );
                self.refused_peers += 1;
                self.avoid(i);
                self.decline_queued(
                    i,
                    "the process on the peer's same-host socket could not prove it holds the \
                     operation's key (another process holds the socket name)",
                    out,
                );
            }
            Heard::Rejected { reason } => {
                self.avoid(i);
                self.decline_queued(i, &reason, out);
            }
            Heard::Grant { slot, gen, sources } => self.on_grant(i, slot, gen, sources, out),
            Heard::Data { slot, gen, data } => self.on_data(i, slot, gen, &data, out),
            Heard::Refused {
                slot,
                gen,
                code,
                reason,
            } => self.end_answered(i, slot, gen, out, |peer| Err(refused(peer, code, reason))),
            Heard::Fallback { slot, gen, reason } => {
                if let Some((id, a)) = self.take_act(i, slot, gen) {
                    self.free_slot(i, slot, gen);
                    if !matches!(a.phase, Phase::Abandoned) {
                        let ev = Event::Declined {
                            spec: a.spec,
                            reason: reason.into(),
                        };
                        // A write's pipes may still be fed from its memory.
                        self.end_act_after_feed(id, ev, out);
                    }
                }
            }
            Heard::WriteDone {
                slot,
                gen,
                ok,
                reason,
            } => {
                // The passive side finished copying our write.
                self.end_answered(i, slot, gen, out, |peer| {
                    if ok {
                        Ok(())
                    } else {
                        Err(Error::Transfer {
                            agent: peer,
                            reason,
                            source: None,
                        })
                    }
                });
            }
        }
    }

    /// Client: the peer of connection `i` is not asked again for a while (it rejected us, or
    /// someone else holds its socket name).
    fn avoid(&mut self, i: ConnId) {
        let Some(peer) = self.sockets.get(i).map(|c| c.peer.clone()) else {
            return;
        };
        self.client.avoid(peer, Instant::now());
    }

    /// Client: the server has no live operation with the opening key. That operation is refused
    /// as a replay (it must not go on to NIXL and read stale memory); nothing was revealed; the
    /// others queued behind it take NIXL, and the connection is opened afresh next time.
    fn on_not_live(&mut self, i: ConnId, key: &str, out: &mut Vec<Event>) {
        let Some(c) = self.sockets.get_mut(i) else { return };
        let peer = c.peer.clone();
        let queued = std::mem::take(&mut c.queued);
        for id in queued {
            let Some(a) = self.client.remove(id) else { continue };
            self.free_slot(i, a.slot, a.gen);
            if matches!(a.phase, Phase::Abandoned) {
                continue;
            }
            if &*a.spec.key == key {
                out.push(Event::ActiveEnded {
                    id,
                    result: Err(refused(peer.to_string(), RefuseCode::NotLive, NOT_LIVE.into())),
                });
            } else {
                out.push(Event::Declined {
                    spec: a.spec,
                    reason: "the same-host connection closed before its request".into(),
                });
            }
        }
    }

    /// Ends the active operation that (`i`, `slot`, `gen`) answered: frees its slot and, unless it
    /// was abandoned, reports `result` (given the peer's agent name).
    fn end_answered(
        &mut self,
        i: ConnId,
        slot: u32,
        gen: u64,
        out: &mut Vec<Event>,
        result: impl FnOnce(String) -> crate::error::Result<()>,
    ) {
        if let Some((id, a)) = self.take_act(i, slot, gen) {
            self.free_slot(i, slot, gen);
            if !matches!(a.phase, Phase::Abandoned) {
                let ev = Event::ActiveEnded {
                    id,
                    result: result(a.spec.peer.name.to_string()),
                };
                // A write's pipes may still be fed from its memory (an answer before the last
                // byte: a refusal, a server that lies).
                self.end_act_after_feed(id, ev, out);
            }
        }
    }
}
