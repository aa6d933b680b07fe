//! Requests and their answers once the handshake is done: the client's requests and the
//! server's answers going out, the answers coming in (each proven under its operation's key).

use super::*;

impl Link {
    pub(super) fn on_answer(&mut self, m: Msg, signed: &[u8], mac: Option<Tag>, heard: &mut Vec<Heard>) {
        let (slot, gen) = match &m {
            Msg::Grant { slot, gen }
            | Msg::GrantIpc { slot, gen, .. }
            | Msg::GrantPipe { slot, gen, .. }
            | Msg::Data { slot, gen, .. }
            | Msg::Refuse { slot, gen, .. }
            | Msg::Fallback { slot, gen, .. }
            | Msg::Done { slot, gen, .. } => (*slot, *gen),
            _ => return self.kill(Violation::OutOfOrder),
        };
        let Some(o) = self.open.get(&(slot, gen)) else {
            return self.kill(Violation::AnswerToNothing);
        };
        if o.granted {
            return self.kill(Violation::AnswerAfterGrant);
        }
        let proven = self.proven(&o.key, Side::Server, signed, mac);
        // Only answers that can make an operation fail or take NIXL may come unproven.
        let unproven_ok = matches!(
            m,
            Msg::Refuse {
                code: RefuseCode::NotLive,
                ..
            } | Msg::Fallback { .. }
        );
        if !proven && !unproven_ok {
            return self.kill(Violation::UnprovenAnswer);
        }
        let fits = match &m {
            Msg::Grant { .. } => !o.write && !o.device && o.pipes == 0,
            Msg::GrantPipe { lanes, .. } => !o.write && !o.device && *lanes <= o.pipes,
            Msg::GrantIpc { sources, .. } => !o.write && o.device && sources.len() == o.ranges,
            Msg::Data { data, .. } => !o.write && !o.device && o.eager && data.len() as u64 == o.total,
            Msg::Done { .. } => o.write,
            _ => true,
        };
        if !fits {
            return self.kill(Violation::WrongAnswer);
        }
        match m {
            Msg::Grant { .. } => {
                self.open.get_mut(&(slot, gen)).expect("checked").granted = true;
                heard.push(Heard::Grant {
                    slot,
                    gen,
                    sources: None,
                });
            }
            Msg::GrantPipe { lanes, .. } => {
                if lanes as usize > self.pending {
                    return self.kill(Violation::MissingDescriptors);
                }
                self.pending -= lanes as usize;
                self.open.get_mut(&(slot, gen)).expect("checked").granted = true;
                heard.push(Heard::GrantPipe { slot, gen, lanes });
            }
            Msg::GrantIpc { sources, .. } => {
                // Exports as passed descriptors only where the reader asked for them (then
                // legacy handles too, for memory that has one), exactly as many as named.
                let asked = self.open.get(&(slot, gen)).expect("checked").pipes > 0;
                let n = passed_fds(&sources).unwrap_or(usize::MAX);
                if (asked && n > self.pending) || (!asked && n != 0) {
                    return self.kill(Violation::MissingDescriptors);
                }
                self.pending -= n;
                self.open.get_mut(&(slot, gen)).expect("checked").granted = true;
                heard.push(Heard::Grant {
                    slot,
                    gen,
                    sources: Some(sources),
                });
            }
            Msg::Data { data, .. } => {
                self.open.remove(&(slot, gen));
                heard.push(Heard::Data { slot, gen, data });
            }
            Msg::Refuse { code, reason, .. } => {
                self.open.remove(&(slot, gen));
                heard.push(Heard::Refused {
                    slot,
                    gen,
                    code,
                    reason,
                });
            }
            Msg::Fallback { reason, .. } => {
                self.open.remove(&(slot, gen));
                heard.push(Heard::Fallback { slot, gen, reason });
            }
            Msg::Done { ok, reason, .. } => {
                self.open.remove(&(slot, gen));
                heard.push(Heard::WriteDone {
                    slot,
                    gen,
                    ok,
                    reason,
                });
            }
            _ => unreachable!("matched above"),
        }
    }

    /// Client: sends request `req` for the operation keyed `key`. False (nothing sent) when
    /// the connection is not ready or the slot is in use.
    pub(crate) fn request(&mut self, key: &str, req: Req) -> bool {
        let (slot, gen) = (req.slot, req.gen);
        if self.side != Side::Client || self.state != State::Ready || self.open.contains_key(&(slot, gen)) {
            return false;
        }
        let (write, device, ranges, eager, pipes) = (
            req.write,
            req.device != Device::Host,
            req.remote.len(),
            req.eager,
            req.pipes,
        );
        let total = req.remote.iter().fold(0u64, |t, r| t.saturating_add(r.1));
        let keyed = Keyed::new(key);
        self.push_signed(&Msg::Req(req), &keyed);
        self.open.insert(
            (slot, gen),
            Open {
                key: keyed,
                name: key.into(),
                write,
                device,
                ranges,
                granted: false,
                eager,
                total,
                pipes,
            },
        );
        true
    }

    /// Client: sends `m` if it is a request (tests and the fuzz harness, which forge frames as
    /// messages); false otherwise, or as [`request`](Self::request) says.
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn request_msg(&mut self, key: &str, m: &Msg) -> bool {
        match m {
            Msg::Req(r) => self.request(key, r.clone()),
            _ => false,
        }
    }

    /// Client: the copy of granted read (`slot`, `gen`) ended; tells the server.
    pub(crate) fn read_done(&mut self, slot: u32, gen: u64, ok: bool, reason: &str) {
        if self.state != State::Ready {
            return;
        }
        let Some(o) = self.open.remove(&(slot, gen)) else {
            return;
        };
        if o.granted {
            let m = Msg::Done {
                slot,
                gen,
                ok,
                reason: reason.into(),
            };
            self.push_signed(&m, &o.key);
        }
    }

    /// Server: answers open request (`slot`, `gen`) under its operation's key. A grant keeps it
    /// open until the reader's `Done`; every other answer (an eager read's bytes included) ends
    /// it. Nothing happens for a request that is not open (the connection died, or it was
    /// answered already). True when the answer is queued on a live connection (the owner of an
    /// eager operation completes it only then).
    pub(crate) fn answer(&mut self, slot: u32, gen: u64, a: Answer) -> bool {
        if self.side != Side::Server || self.state != State::Ready {
            return false;
        }
        let Some(o) = self.open.get_mut(&(slot, gen)) else {
            return false;
        };
        let m = match a {
            Answer::Grant | Answer::GrantIpc(_) | Answer::GrantPipe(_) if o.write || o.granted => {
                return false
            }
            Answer::GrantPipe(n) if o.device || n == 0 || n > o.pipes || n as usize > MAX_LANES => {
                return false
            }
            Answer::GrantPipe(lanes) => {
                o.granted = true;
                Msg::GrantPipe { slot, gen, lanes }
            }
            Answer::Grant => {
                o.granted = true;
                Msg::Grant { slot, gen }
            }
            Answer::GrantIpc(sources) => {
                o.granted = true;
                Msg::GrantIpc { slot, gen, sources }
            }
            Answer::Data(data)
                if !o.write && !o.granted && !o.device && o.eager && data.len() as u64 == o.total =>
            {
                Msg::Data { slot, gen, data }
            }
            Answer::Data(_) => Msg::Fallback {
                slot,
                gen,
                reason: "the passive side's eager answer did not fit the request".into(),
            },
            Answer::Refuse(code, reason) => Msg::Refuse {
                slot,
                gen,
                code,
                reason,
            },
            Answer::Fallback(reason) => Msg::Fallback { slot, gen, reason },
            Answer::WriteDone { ok, reason } => Msg::Done {
                slot,
                gen,
                ok,
                reason,
            },
        };
        let key = if matches!(
            m,
            Msg::Grant { .. } | Msg::GrantIpc { .. } | Msg::GrantPipe { .. }
        ) {
            o.key.clone()
        } else {
            self.open.remove(&(slot, gen)).expect("present").key
        };
        self.push_signed(&m, &key);
        self.state == State::Ready
    }
}
