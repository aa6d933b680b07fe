//! The same-host transport behind the engine's seam ([`Transport`]).

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use super::device::{device_path_refusal, uniform};
use super::records::{Act, ConnId, Phase};
use super::server_book::Scope;
use super::sockets::{ACCEPT_TIMER, DEADLINE_TIMER, DIR_LISTENER, LISTENER};
#[cfg(feature = "cuda")]
use super::sys::ipc;
use super::transport::SameHostTransport;
use crate::device::Device;
use crate::engine::poller::hung_up;
use crate::engine::transport::{ActiveSpec, Event, Exposure, OpId, PassiveSpec, Polling, Transport};
use crate::error::{Error, Result};
use crate::state::TransferPath;
use crate::stats::EngineStats;

impl Transport for SameHostTransport {
    fn expose(&mut self, spec: &PassiveSpec, out: &mut Exposure) -> Result<()> {
        if self.sockets.listener().is_none() {
            return Ok(());
        }
        let scope = Scope::new(spec.kind, spec.ranges.clone(), spec.state.clone());
        self.server.expose(spec.key.clone(), out.identity, scope);
        Ok(())
    }

    fn unexpose(&mut self, key: &str) {
        self.server.release_writer(key);
        let Some(s) = self.server.unexpose(key) else {
            return;
        };
        for g in s.grants {
            if let Some(t) = self.sockets.get(g.conn).and_then(|c| c.slots.as_ref()) {
                t.revoke(g.slot, g.gen);
            }
            self.sockets.ungrant(g.conn);
        }
        // Pipes fed from it hold its pages until they are emptied: released then (`SameHostTransport::fed`).
        self.feeds.end_where(|_, f| f.key.as_deref() == Some(key));
        if s.writer.is_none() && !self.feeds.feeds_key(key) {
            s.state.mark_released();
        }
    }

    fn begin(&mut self, spec: ActiveSpec, out: &mut Vec<Event>) {
        if !self.enabled {
            out.push(Event::Declined {
                spec,
                reason: "the same-host path is off for this connector".into(),
            });
            return;
        }
        let (local, remote) = (uniform(&spec.local), uniform(&spec.remote));
        let device = match (local, remote) {
            (Some(Device::Host), Some(Device::Host)) => false,
            (Some(l), Some(r)) => {
                let (src, dst) = if spec.write { (l, r) } else { (r, l) };
                if let Some(refusal) = device_path_refusal(src, dst) {
                    out.push(Event::Declined {
                        spec,
                        reason: refusal.into(),
                    });
                    return;
                }
                // Device memory as the source takes CUDA IPC; host memory into device memory
                // takes the host path's grant, pulled through pinned staging by the copier.
                src != Device::Host
            }
            _ => {
                out.push(Event::Declined {
                    spec,
                    reason: "the descriptors mix kinds of memory".into(),
                });
                return;
            }
        };
        let i = match self.connect(&spec.peer.name, &spec.key) {
            Ok(i) => i,
            Err(reason) => {
                out.push(Event::Declined { spec, reason });
                return;
            }
        };
        let c = self.sockets.get_mut(i).expect("connected");
        let Some(slot) = c.free_slots.pop() else {
            out.push(Event::Declined {
                spec,
                reason: "too many operations in flight to this peer on the same-host path".into(),
            });
            return;
        };
        c.gens[slot as usize] += 1;
        let gen = c.gens[slot as usize];
        if let Some(t) = &c.slots {
            t.arm(slot, gen);
        }
        out.push(Event::PathTaken {
            id: spec.id,
            path: TransferPath::SameHost,
        });
        let id = spec.id;
        let ready = c.link.is_ready();
        if !ready {
            c.queued.push(id);
        }
        self.client.insert(
            id,
            Act {
                spec,
                conn: i,
                slot,
                gen,
                phase: Phase::Queued,
                cancel: Arc::new(AtomicBool::new(false)),
                wake: None,
                pidfd: None,
                device,
                sources: Vec::new(),
                source_fds: Vec::new(),
            },
        );
        if ready {
            self.request(id, out);
        } else {
            self.sockets.flush(i);
        }
    }

    fn abandon(&mut self, id: OpId, _hard: bool, out: &mut Vec<Event>) {
        let Some(a) = self.client.get_mut(id) else { return };
        let table = self.sockets.get(a.conn).and_then(|c| c.slots.clone());
        match a.phase {
            Phase::Copying => {
                // Our own copy thread writes our memory: stop it; its end releases the memory.
                a.stop();
            }
            Phase::Abandoned => {}
            Phase::Queued | Phase::Exporting | Phase::Requested => {
                // Nothing of ours is being written: a write's source is only read by the peer, and
                // revoking its slot makes the peer discard what it read. Release at once. (A small
                // operation's request already carried or asked for its bytes: the owner may still
                // complete it, as a posted NIXL transfer may still land; an eager read's answer is
                // then not copied here.)
                if let Some(t) = table {
                    t.revoke(a.slot, a.gen);
                }
                let was_queued = matches!(a.phase, Phase::Queued);
                a.phase = Phase::Abandoned;
                let conn = a.conn;
                if was_queued {
                    if let Some(c) = self.sockets.get_mut(conn) {
                        c.queued.retain(|q| *q != id);
                    }
                    let a = self.client.remove(id).expect("present");
                    self.sockets.free_slot(conn, a.slot, a.gen);
                }
                // A write's pipes may still be fed from its memory: released once they are not.
                self.end_act_after_feed(
                    id,
                    Event::ActiveEnded {
                        id,
                        result: Err(Error::Cancelled),
                    },
                    out,
                );
            }
        }
    }

    fn progress(&mut self, ready: &[(u64, u32)], out: &mut Vec<Event>) -> bool {
        let mut event = self.reap(out);
        for &(token, ev) in ready {
            if token == LISTENER || token == DIR_LISTENER {
                self.accept();
                event = true;
                continue;
            }
            if token == ACCEPT_TIMER {
                self.resume_accepting();
                event = true;
                continue;
            }
            if token == DEADLINE_TIMER {
                self.on_deadlines(out);
                event = true;
                continue;
            }
            let i: ConnId = token;
            if self.sockets.get(i).is_none() {
                continue;
            }
            event = true;
            if ev & libc::EPOLLOUT as u32 != 0 {
                self.sockets.flush(i);
            }
            if ev & libc::EPOLLIN as u32 != 0 || hung_up(ev) {
                let mut heard = Vec::new();
                self.sockets.read(i, self.server.key_ids(), &mut heard);
                for h in heard {
                    self.handle(i, h, out);
                }
            }
            self.sockets.flush(i);
            match self.sockets.get(i) {
                Some(c) if c.link.is_dead() => {
                    tracing::debug!(why = ?c.link.death(), "closing a same-host connection");
                    self.close(i, out);
                }
                Some(_) => self.sockets.watch_deadline(i),
                None => {}
            }
        }
        event |= self.reap(out);
        self.in_flight.submit();
        // Frames queued this turn (requests, answers, copies' ends), one send per connection.
        for i in self.sockets.with_frames_queued() {
            self.sockets.flush(i);
        }
        event
    }

    fn polling(&self) -> Polling {
        Polling::EveryTurn
    }

    fn has_pending(&self) -> bool {
        // Copies are submitted at the end of the turn that started them; one left in the batch
        // (started outside a turn) is submitted by the next.
        self.in_flight.has_finished() || self.in_flight.unsubmitted()
    }

    fn stop(&mut self, within: Option<Duration>) -> bool {
        self.stop_copies(within)
    }

    fn path(&self) -> TransferPath {
        TransferPath::SameHost
    }

    /// Its calls are socket reads and writes, MACs, and hand-offs to its copy pool; it holds no
    /// memory's owner (the core does) and device memory stays the engine thread's (`driver`).
    /// With the `cuda` feature, only where a peer's device request cannot make a caller's turn
    /// start CUDA (`ipc::settled_for_callers`, asked when the engine starts).
    fn callers_may_drive(&self) -> bool {
        #[cfg(feature = "cuda")]
        return ipc::settled_for_callers();
        #[cfg(not(feature = "cuda"))]
        true
    }

    fn add_stats(&self, stats: &mut EngineStats, completed: u64) {
        stats.local_transfers += completed;
        stats.local_refused_peers += self.refused_peers;
        stats.copy_pool_queued = super::sys::cma::queued();
        stats.local_connections += self.sockets.open();
    }
}
