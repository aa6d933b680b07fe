//! Frame dispatch: each message from a same-host peer, to the part of the transport that acts on
//! it (the client's answers, the server's requests, the handshake).

use std::time::Instant;

use super::proto::Msg;
use super::records::{refused, ConnId, Expect, Phase};
use super::state::LocalTransport;
use crate::engine::transport::Event;
use crate::error::Error;

impl LocalTransport {
    /// Acts on message `m` from connection `i`.
    pub(super) fn handle(&mut self, i: ConnId, m: Msg, out: &mut Vec<Event>) {
        let client = self.conns.get(&i).is_some_and(|c| c.client);
        match (client, m) {
            (
                false,
                Msg::Hello {
                    version,
                    key_id,
                    nonce,
                },
            ) => self.on_hello(i, version, key_id, nonce),
            (true, Msg::Welcome { proof }) => self.on_welcome(i, proof, out),
            (false, Msg::Trusted) => self.on_trusted(i),
            (true, Msg::Reject { reason }) if self.conns.get(&i).is_some_and(|c| !c.ready) => {
                let c = self.conns.get_mut(&i).expect("live");
                c.dead = true;
                let peer = c.peer.clone();
                self.decline_queued(i, &reason, out);
                self.negative.insert(peer, Instant::now());
            }
            (
                false,
                Msg::Req {
                    slot,
                    gen,
                    write,
                    ident,
                    key_id,
                    mac,
                    device,
                    remote,
                    local,
                    sources,
                },
            ) => {
                if self.identities.contains(&ident) {
                    let Some(key) = self.proven_key(i, slot, gen, write, &key_id, &mac) else {
                        return;
                    };
                    self.on_req(i, slot, gen, write, &key, device, remote, local, sources, out)
                } else if let Some(c) = self.conns.get_mut(&i) {
                    // Metadata of an agent of the same name elsewhere (another host, an earlier
                    // process): not this connector's to refuse; NIXL will sort it out.
                    c.send(&Msg::Fallback {
                        slot,
                        gen,
                        reason: "the metadata names another agent of the same name".into(),
                    });
                }
            }
            (true, Msg::Grant { slot, gen }) if self.expects(i, slot, gen, Expect::Grant) => {
                self.on_grant(i, slot, gen, None, out)
            }
            (true, Msg::GrantIpc { slot, gen, sources }) if self.expects(i, slot, gen, Expect::Grant) => {
                self.on_grant(i, slot, gen, Some(sources), out)
            }
            (
                true,
                Msg::Refuse {
                    slot,
                    gen,
                    code,
                    reason,
                },
            ) if self.expects(i, slot, gen, Expect::Answer) => {
                self.end_answered(i, slot, gen, out, |peer| Err(refused(peer, code, reason)));
            }
            (true, Msg::Fallback { slot, gen, reason }) if self.expects(i, slot, gen, Expect::Answer) => {
                if let Some((_, a)) = self.take_act(i, slot, gen) {
                    self.free_slot(i, slot, gen);
                    if !matches!(a.phase, Phase::Abandoned) {
                        out.push(Event::Declined {
                            spec: a.spec,
                            reason: reason.into(),
                        });
                    }
                }
            }
            (
                true,
                Msg::Done {
                    slot,
                    gen,
                    ok,
                    reason,
                },
            ) if self.expects(i, slot, gen, Expect::WriteDone) => {
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
            (false, Msg::Done { slot, gen, ok, .. }) => self.on_read_done(i, slot, gen, ok, out),
            // Anything else breaks the protocol (a frame out of order, for an operation in another
            // phase, or for none): the connection is closed; copies already running end on their
            // own and nothing of theirs is released before that.
            (_, other) => {
                tracing::debug!(?other, "unexpected same-host frame; closing the connection");
                if let Some(c) = self.conns.get_mut(&i) {
                    c.dead = true;
                }
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
                out.push(Event::ActiveEnded {
                    id,
                    result: result(a.spec.peer.to_string()),
                });
            }
        }
    }
}
