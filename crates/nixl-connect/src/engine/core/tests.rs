//! The engine core stepped by hand: commands in, `now` from a manual clock, no thread, no
//! poller, no sleep. The transports are probes behind the real seam that do what each test
//! scripts (take or decline an operation, keep or pass on memory, ask for a polling rate) and
//! record what the core asked of them.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::EngineCore;
use crate::device::Device;
use crate::engine::cmd::Cmd;
use crate::engine::poller::Ready;
use crate::engine::transport::{
    ActiveSpec, CallerPart, Decline, Event, Exposure, OpId, PassiveSpec, PeerInfo, Polling, Transport,
    TransportId,
};
use crate::error::{Error, ErrorKind, Refusal, Result};
use crate::metadata::OperationKind;
use crate::pace::PACE;
use crate::reg::{Hold, Range};
use crate::state::{OpState, OperationStatus, TransferPath};
use crate::stats::EngineStats;

const MIN_PARK: Duration = PACE.first_poll();
const WATCH_GAP: Duration = PACE.turn_gap();

/// What a probe records and how it behaves, shared with the test that scripted it.
#[derive(Default)]
struct Script {
    /// Declines every operation offered, with this reason.
    decline: Option<&'static str>,
    /// Keeps memory handed to its hold (rather than passing it on).
    keeps: bool,
    /// Completes the operations it took on its next progress.
    complete: bool,
    polling: Option<Polling>,
    /// Reports work without events after each progress ([`Transport::did_work`]).
    worked: bool,
    /// Calls seen, in order.
    log: Vec<String>,
    progressed: usize,
    /// The ready descriptors each progress was handed.
    ready: Vec<Vec<(u64, u32)>>,
    held: Vec<Hold>,
    /// Events its next progress reports (a passive operation's completion, say).
    emit: Vec<Event>,
    /// The state of each operation it exposed, by key.
    exposed: Vec<(Arc<str>, Arc<OpState>)>,
    /// Each key it was told to unexpose, with its operation's status at that moment.
    unexposed: Vec<(String, OperationStatus)>,
    /// Says a caller may drive it ([`Transport::any_thread`]; read when the core is made).
    drivable: bool,
    /// Refuses every exposure ([`Transport::expose`] fails).
    refuse_exposure: bool,
    /// Caller's turns that watched it ([`CallerPart::watch`]; what `emit` holds is what
    /// a watch sees).
    watched: usize,
    /// Takes an exposure on a caller's turn though a caller may not drive it (as NIXL does for
    /// memory it registered before: [`CallerPart::expose`]).
    cached: bool,
    /// Says a caller's turn may begin operations on it ([`CallerPart::starts`]; read
    /// when the core is made).
    starts: bool,
    /// Takes the operations a caller's turn begins ([`CallerPart::begin`]), rather
    /// than handing them back.
    starts_taken: bool,
    /// A caller's watch completes the operations it took, as its progress would when `complete`.
    watch_completes: bool,
    /// Says a caller's watch would see everything it has in flight end
    /// ([`CallerPart::sees_every_end`]).
    watched_whole: bool,
}

struct Probe {
    name: &'static str,
    path: TransferPath,
    script: Arc<Mutex<Script>>,
    taken: Vec<OpId>,
}

fn probe(name: &'static str, path: TransferPath) -> (Box<dyn Transport>, Arc<Mutex<Script>>) {
    let script = Arc::new(Mutex::new(Script::default()));
    let p = Probe {
        name,
        path,
        script: script.clone(),
        taken: Vec::new(),
    };
    (Box::new(p), script)
}

impl Probe {
    fn log(&self, what: String) {
        self.script
            .lock()
            .unwrap()
            .log
            .push(format!("{}:{what}", self.name));
    }
}

impl Transport for Probe {
    fn expose(&mut self, spec: &PassiveSpec, out: &mut Exposure) -> Result<()> {
        self.log(format!("expose {}", spec.key));
        if self.script.lock().unwrap().refuse_exposure {
            return Err(Error::Nixl {
                op: "expose memory",
                status: "refused by the test".into(),
                source: None,
            });
        }
        let state = spec.state.clone();
        self.script
            .lock()
            .unwrap()
            .exposed
            .push((spec.key.clone(), state));
        if out.published.is_none() {
            out.published = Some(format!("probe:{}", self.name).into());
        }
        Ok(())
    }

    fn unexpose(&mut self, key: &str) {
        self.log(format!("unexpose {key}"));
        let mut s = self.script.lock().unwrap();
        let status = s
            .exposed
            .iter()
            .find(|(k, _)| &**k == key)
            .map(|(_, st)| st.status());
        if let Some(status) = status {
            s.unexposed.push((key.to_string(), status));
        }
    }

    fn begin(&mut self, spec: ActiveSpec, out: &mut Vec<Event>) {
        self.log(format!("begin {}", spec.id));
        let decline = self.script.lock().unwrap().decline;
        match decline {
            Some(reason) => out.push(Event::Declined {
                spec,
                reason: Decline::from(reason),
            }),
            None => {
                out.push(Event::PathTaken {
                    id: spec.id,
                    path: self.path,
                });
                self.taken.push(spec.id);
            }
        }
    }

    fn abandon(&mut self, id: OpId, _hard: bool, out: &mut Vec<Event>) {
        self.log(format!("abandon {id}"));
        if let Some(i) = self.taken.iter().position(|&t| t == id) {
            self.taken.remove(i);
            out.push(Event::ActiveEnded {
                id,
                result: Err(Error::Cancelled),
            });
        }
    }

    fn progress(&mut self, ready: &[(u64, u32)], out: &mut Vec<Event>) -> bool {
        let mut s = self.script.lock().unwrap();
        s.progressed += 1;
        s.ready.push(ready.to_vec());
        let emitted = !s.emit.is_empty();
        out.append(&mut s.emit);
        if emitted {
            return true;
        }
        if !s.complete || self.taken.is_empty() {
            return false;
        }
        for id in self.taken.drain(..) {
            out.push(Event::ActiveEnded { id, result: Ok(()) });
        }
        true
    }

    fn polling(&self) -> Polling {
        self.script.lock().unwrap().polling.unwrap_or(Polling::Never)
    }

    fn did_work(&self) -> bool {
        self.script.lock().unwrap().worked
    }

    fn hold(&mut self, gen: u64, keep: Hold, bytes: usize) -> Option<Hold> {
        self.log(format!("hold gen {gen} {bytes} bytes"));
        let mut s = self.script.lock().unwrap();
        if s.keeps {
            s.held.push(keep);
            return None;
        }
        Some(keep)
    }

    fn path(&self) -> TransferPath {
        TransferPath::Nixl
    }

    fn add_stats(&self, stats: &mut EngineStats, completed: u64) {
        stats.transfers += completed;
    }

    fn any_thread(&self) -> bool {
        self.script.lock().unwrap().drivable
    }

    fn caller(&mut self) -> Option<&mut dyn CallerPart> {
        Some(self)
    }
}

impl CallerPart for Probe {
    fn expose(&mut self, spec: &PassiveSpec, out: &mut Exposure) -> Option<Result<()>> {
        let cached = self.script.lock().unwrap().cached;
        cached.then(|| Transport::expose(self, spec, out))
    }

    fn unexpose(&mut self, key: &str) {
        self.log(format!("forget {key}"));
    }

    fn watch(&mut self, out: &mut Vec<Event>) -> bool {
        let mut s = self.script.lock().unwrap();
        s.watched += 1;
        let mut saw = !s.emit.is_empty();
        out.append(&mut s.emit);
        if s.watch_completes {
            for id in self.taken.drain(..) {
                out.push(Event::ActiveEnded { id, result: Ok(()) });
                saw = true;
            }
        }
        saw
    }

    fn begin(&mut self, spec: ActiveSpec, out: &mut Vec<Event>) -> Option<ActiveSpec> {
        self.log(format!("start {}", spec.id));
        if !self.script.lock().unwrap().starts_taken {
            return Some(spec);
        }
        out.push(Event::PathTaken {
            id: spec.id,
            path: self.path,
        });
        self.taken.push(spec.id);
        None
    }

    fn starts(&self) -> bool {
        self.script.lock().unwrap().starts
    }

    fn sees_every_end(&self) -> bool {
        self.script.lock().unwrap().watched_whole
    }
}

fn peer() -> PeerInfo {
    PeerInfo {
        published: "probe:peer".into(),
        reach: Arc::from(&[][..]),
        name: "peer".into(),
        identity: 1,
    }
}

fn active(id: OpId, key: &str) -> (ActiveSpec, Arc<OpState>) {
    let state = OpState::new(OperationStatus::InProgress);
    state.mark_in_use();
    let range = Range {
        addr: 0x1000,
        len: 64,
        device: Device::Host,
    };
    let spec = ActiveSpec {
        id,
        write: false,
        local: vec![range],
        remote: vec![range],
        peer: peer(),
        key: key.into(),
        state: state.clone(),
    };
    (spec, state)
}

/// Memory whose drop the test can see.
struct Canary(Arc<AtomicBool>);

impl crate::reg::Held for Canary {}

impl Drop for Canary {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

fn canary() -> (Hold, Arc<AtomicBool>) {
    let freed = Arc::new(AtomicBool::new(false));
    (Box::new(Canary(freed.clone())), freed)
}

/// The end a transport reports of passive operation `key`: failed, or completed over `path`.
fn passive_end(key: &str, failed: bool, path: TransferPath) -> Event {
    if failed {
        Event::PassiveFailed {
            key: key.into(),
            error: Error::Cancelled,
        }
    } else {
        Event::PassiveCompleted {
            key: key.into(),
            path,
        }
    }
}

const MS: Duration = Duration::from_millis(1);

/// A chain of transport ids, by their places.
fn ids(places: &[usize]) -> Vec<TransportId> {
    places.iter().map(|&i| TransportId::nth(i).unwrap()).collect()
}

#[test]
fn core_schedule_backs_off_to_the_polling_rate_and_wakes_on_activity() {
    let t0 = Instant::now();
    let (t, script) = probe("a", TransferPath::Nixl);
    script.lock().unwrap().polling = Some(Polling::Every(5 * MS));
    let mut core = EngineCore::new(vec![t], ids(&[0]), MS, t0);
    let progressed = || script.lock().unwrap().progressed;

    // Due at once, then again after MIN_PARK, the gap doubling up to the polling rate (5 ms,
    // above the 1 ms progress delay); never progressed before it is due.
    core.turn(t0, false, &[]);
    assert_eq!(progressed(), 1);
    let mut now = t0;
    let mut gap = MIN_PARK * 2;
    let mut gaps = Vec::new();
    for _ in 0..20 {
        assert_eq!(core.sleep_for(now), Some(gap), "after {gaps:?}");
        let before = progressed();
        core.turn(now + gap - Duration::from_nanos(1), false, &[]);
        assert_eq!(progressed(), before, "progressed before it was due");
        now += gap;
        core.turn(now, false, &[]);
        assert_eq!(progressed(), before + 1);
        gaps.push(gap);
        gap = (gap * 2).min(5 * MS);
    }
    assert_eq!(*gaps.last().unwrap(), 5 * MS, "{gaps:?}");

    // Activity (a command) makes it due again at once, back at the shortest gap.
    core.wake_all(now + MS);
    assert_eq!(core.sleep_for(now + MS), Some(Duration::ZERO));
    core.turn(now + MS, false, &[]);
    assert_eq!(core.sleep_for(now + MS), Some(MIN_PARK * 2));
}

#[test]
fn core_schedule_stays_short_while_a_transport_works_without_events() {
    let t0 = Instant::now();
    let (t, script) = probe("a", TransferPath::Nixl);
    script.lock().unwrap().polling = Some(Polling::Watching);
    let mut core = EngineCore::new(vec![t], ids(&[0]), MS, t0);
    // Backing off while nothing happens: 40, 80, 160 us.
    let mut now = t0;
    assert!(!core.turn(now, false, &[]));
    for gap in [MIN_PARK * 2, MIN_PARK * 4, MIN_PARK * 8] {
        assert_eq!(core.sleep_for(now), Some(gap));
        now += gap;
        assert!(!core.turn(now, false, &[]));
    }
    // Work without an event (bytes of a peer's write taken in): due again after the shortest
    // gap, every time, and the turn reports no event (the engine is not kept hot for it).
    script.lock().unwrap().worked = true;
    for _ in 0..5 {
        now += core.sleep_for(now).unwrap();
        assert!(!core.turn(now, false, &[]), "work alone is not an event");
        assert_eq!(core.sleep_for(now), Some(MIN_PARK));
    }
    // A hot engine keeps watching at its shorter gap: work does not lengthen it.
    now += MIN_PARK;
    core.turn(now, true, &[]);
    assert_eq!(core.sleep_for(now), Some(WATCH_GAP));
    // Once it stops, the back-off goes on from the last gap.
    script.lock().unwrap().worked = false;
    now += WATCH_GAP;
    core.turn(now, false, &[]);
    assert_eq!(core.sleep_for(now), Some(WATCH_GAP * 2));
}

#[test]
fn core_schedule_leaves_an_idle_transport_alone() {
    let t0 = Instant::now();
    let (t, script) = probe("a", TransferPath::Nixl);
    let mut core = EngineCore::new(vec![t], ids(&[0]), MS, t0);
    // Polling::Never with nothing pending: no deadline, never progressed, at any time.
    assert_eq!(core.sleep_for(t0), None);
    for k in 0..10 {
        core.turn(t0 + k * 100 * MS, false, &[]);
    }
    assert_eq!(script.lock().unwrap().progressed, 0);
}

#[test]
fn core_hand_over_chain_offers_a_declined_operation_to_the_next_transport() {
    let t0 = Instant::now();
    let (a, sa) = probe("local", TransferPath::SameHost);
    let (b, sb) = probe("nixl", TransferPath::Nixl);
    sa.lock().unwrap().decline = Some("no same-host socket");
    sb.lock().unwrap().complete = true;
    sb.lock().unwrap().polling = Some(Polling::Busy);
    let mut core = EngineCore::new(vec![b, a], ids(&[1, 0]), MS, t0);

    let (spec, state) = active(1, "k1");
    core.handle(Cmd::Begin { spec });
    // Offered to the chain's first (local), which declined; taken by the next at once.
    assert_eq!(sa.lock().unwrap().log, ["local:begin 1"]);
    assert_eq!(sb.lock().unwrap().log, ["nixl:begin 1"]);
    assert_eq!(state.status(), OperationStatus::InProgress);
    core.wake_all(t0);
    core.turn(t0, true, &[]);
    assert_eq!(state.path(), Some(TransferPath::Nixl));
    assert_eq!(state.status(), OperationStatus::Complete);
    assert!(state.is_released());

    // Every transport declines: the operation fails with the last one's reason.
    sb.lock().unwrap().decline = Some("the peer's agent cannot be loaded");
    let (spec, state) = active(2, "k2");
    core.handle(Cmd::Begin { spec });
    core.turn(t0 + MS, true, &[]);
    assert_eq!(state.status(), OperationStatus::Errored);
    let e = state.error().unwrap();
    assert_eq!(e.kind(), ErrorKind::PathUnavailable);
    assert!(e.to_string().contains("cannot be loaded"), "{e}");
    assert!(state.is_released());
    assert_eq!(state.path(), None, "no transport took it");
}

#[test]
fn core_completed_metadata_is_refused_and_a_cancelled_operation_is_offered_nowhere() {
    let t0 = Instant::now();
    let (a, sa) = probe("a", TransferPath::Nixl);
    sa.lock().unwrap().complete = true;
    sa.lock().unwrap().polling = Some(Polling::Busy);
    let mut core = EngineCore::new(vec![a], ids(&[0]), MS, t0);
    let (spec, state) = active(1, "key");
    core.handle(Cmd::Begin { spec });
    core.turn(t0, true, &[]);
    assert_eq!(state.status(), OperationStatus::Complete);

    // The same key again: refused without reaching a transport.
    let (spec, again) = active(2, "key");
    core.handle(Cmd::Begin { spec });
    assert!(matches!(
        again.error(),
        Some(Error::Refused {
            refusal: Refusal::AlreadyCompleted,
            ..
        })
    ));
    // Cancelled before the engine took it: no transport is offered it.
    let (spec, cancelled) = active(3, "other");
    cancelled.finish(OperationStatus::Cancelled, None);
    core.handle(Cmd::Begin { spec });
    core.turn(t0 + MS, true, &[]);
    assert_eq!(sa.lock().unwrap().log, ["a:begin 1"]);
    assert!(cancelled.is_released());
    assert_eq!(cancelled.status(), OperationStatus::Cancelled);
}

#[test]
fn core_abandon_reaches_the_transport_that_holds_the_operation() {
    let t0 = Instant::now();
    let (a, sa) = probe("a", TransferPath::SameHost);
    let (b, sb) = probe("b", TransferPath::Nixl);
    sa.lock().unwrap().decline = Some("declined");
    let mut core = EngineCore::new(vec![a, b], ids(&[0, 1]), MS, t0);
    let (spec, state) = active(7, "k");
    core.handle(Cmd::Begin { spec });
    let (keep, freed) = canary();
    core.handle(Cmd::Adopt { id: 7, keep });
    state.finish(OperationStatus::Cancelled, None);
    core.handle(Cmd::Abandon { id: 7, hard: false });
    assert!(!freed.load(Ordering::SeqCst), "freed before the transport let go");
    core.turn(t0, false, &[]);
    assert_eq!(sb.lock().unwrap().log, ["b:begin 7", "b:abandon 7"]);
    assert!(!sa.lock().unwrap().log.iter().any(|l| l.contains("abandon")));
    assert!(
        freed.load(Ordering::SeqCst),
        "the adopted memory is freed once it ended"
    );
    assert!(state.is_released());
}

#[test]
fn core_hold_chain_gives_memory_to_the_first_transport_that_keeps_it() {
    let t0 = Instant::now();
    let (a, sa) = probe("a", TransferPath::Nixl);
    let (b, sb) = probe("b", TransferPath::SameHost);
    sb.lock().unwrap().keeps = true;
    let mut core = EngineCore::new(vec![a, b], ids(&[0, 1]), MS, t0);
    let (keep, freed) = canary();
    core.handle(Cmd::Unexpose {
        key: "gone".into(),
        gen: 3,
        keep: Some((keep, 4096)),
    });
    assert_eq!(
        sa.lock().unwrap().log,
        ["a:unexpose gone", "a:hold gen 3 4096 bytes"]
    );
    assert_eq!(
        sb.lock().unwrap().log,
        ["b:unexpose gone", "b:hold gen 3 4096 bytes"]
    );
    assert!(!freed.load(Ordering::SeqCst), "b keeps it");
    sb.lock().unwrap().held.clear();
    assert!(freed.load(Ordering::SeqCst));

    // Nobody keeps it: freed at once.
    sb.lock().unwrap().keeps = false;
    let (keep, freed) = canary();
    core.handle(Cmd::Unexpose {
        key: "other".into(),
        gen: 4,
        keep: Some((keep, 1)),
    });
    assert!(freed.load(Ordering::SeqCst));
}

#[test]
fn core_exposed_memory_under_a_copy_waits_for_the_copy_before_the_hold() {
    let t0 = Instant::now();
    let (a, _sa) = probe("a", TransferPath::Nixl);
    let mut core = EngineCore::new(vec![a], ids(&[0]), MS, t0);
    let state = OpState::new(OperationStatus::Initialized);
    let (reply, mut exposed) = oneshot::channel();
    core.handle(Cmd::Expose {
        spec: PassiveSpec {
            key: "w".into(),
            kind: OperationKind::Write,
            ranges: Vec::new(),
            state: state.clone(),
        },
        reply,
    });
    let out = exposed.try_recv().unwrap().unwrap();
    assert_eq!(out.published.as_deref(), Some("probe:a"));
    // A peer's copy into the memory is running (the memory is in use) when its owner drops it.
    state.mark_in_use();
    let (keep, freed) = canary();
    core.handle(Cmd::Unexpose {
        key: "w".into(),
        gen: 1,
        keep: Some((keep, 64)),
    });
    for k in 0..3 {
        core.turn(t0 + k * MS, false, &[]);
        assert!(!freed.load(Ordering::SeqCst), "freed under a running copy");
    }
    state.mark_released();
    core.turn(t0 + 3 * MS, false, &[]);
    assert!(
        freed.load(Ordering::SeqCst),
        "handed to the hold once the copy stopped"
    );
}

#[test]
fn core_settle_answers_at_the_end_of_the_turn_that_took_it() {
    let t0 = Instant::now();
    let (a, sa) = probe("a", TransferPath::Nixl);
    sa.lock().unwrap().polling = Some(Polling::EveryTurn);
    let mut core = EngineCore::new(vec![a], ids(&[0]), MS, t0);
    let (reply, mut settled) = oneshot::channel();
    core.handle(Cmd::Settle { reply });
    assert!(settled.try_recv().is_err(), "answered before the transports ran");
    core.turn(t0, false, &[]);
    assert_eq!(sa.lock().unwrap().progressed, 1);
    assert!(settled.try_recv().is_ok());
}

#[test]
fn core_ready_descriptors_reach_only_the_transport_that_registered_them() {
    let t0 = Instant::now();
    let (a, sa) = probe("a", TransferPath::Nixl);
    let (b, sb) = probe("b", TransferPath::SameHost);
    // Neither asks to be polled: only its own ready descriptors make one due.
    let mut core = EngineCore::new(vec![a, b], ids(&[0, 1]), MS, t0);
    let ready =
        |owner: usize, token: u64| Ready::new(TransportId::nth(owner).unwrap(), token, libc::EPOLLIN as u32);
    core.turn(t0, false, &[ready(1, 0), ready(1, 7)]);
    assert_eq!(sa.lock().unwrap().progressed, 0, "a was handed b's descriptors");
    assert_eq!(
        sb.lock().unwrap().ready,
        [vec![(0, libc::EPOLLIN as u32), (7, libc::EPOLLIN as u32)]]
    );
    // The same token under another owner is another descriptor.
    core.turn(t0 + MS, false, &[ready(0, 7)]);
    assert_eq!(sa.lock().unwrap().ready, [vec![(7, libc::EPOLLIN as u32)]]);
    assert_eq!(sb.lock().unwrap().progressed, 1);
}

/// The loopback replay race (1 in ~300 runs of `loopback_replay_after_completion_is_refused`): the
/// core marked a passive operation complete (waking its waiter) before the transports forgot its
/// key, so a replay begun by the woken owner's peer in that window found the key still exposed and
/// was served. Every transport must have forgotten the key before any waiter sees the end.
#[test]
fn core_passive_end_unexposes_before_any_waiter_sees_it() {
    let t0 = Instant::now();
    for failed in [false, true] {
        let (a, sa) = probe("a", TransferPath::Nixl);
        sa.lock().unwrap().polling = Some(Polling::EveryTurn);
        let mut core = EngineCore::new(vec![a], ids(&[0]), MS, t0);
        let state = OpState::new(OperationStatus::Initialized);
        let (reply, mut exposed) = oneshot::channel();
        core.handle(Cmd::Expose {
            spec: PassiveSpec {
                key: "k".into(),
                kind: OperationKind::Read,
                ranges: Vec::new(),
                state: state.clone(),
            },
            reply,
        });
        exposed.try_recv().unwrap().unwrap();
        sa.lock()
            .unwrap()
            .emit
            .push(passive_end("k", failed, TransferPath::Nixl));
        core.turn(t0, false, &[]);
        let want = if failed {
            OperationStatus::Errored
        } else {
            OperationStatus::Complete
        };
        assert_eq!(state.status(), want);
        assert_eq!(
            sa.lock().unwrap().unexposed,
            [("k".to_string(), OperationStatus::Initialized)],
            "the key was still exposed when the operation's end became visible (failed: {failed})"
        );
    }
}

/// A core over a transport a caller may drive ("local", first in the chain) and one it may not
/// ("nixl"), both progressed on every turn.
fn caller_pair(t0: Instant) -> (EngineCore, Arc<Mutex<Script>>, Arc<Mutex<Script>>) {
    let (local, sl) = probe("local", TransferPath::SameHost);
    let (nixl, sn) = probe("nixl", TransferPath::Nixl);
    for s in [&sl, &sn] {
        s.lock().unwrap().polling = Some(Polling::EveryTurn);
    }
    sl.lock().unwrap().drivable = true;
    // NIXL publishes first; active operations try the same-host path first.
    let core = EngineCore::new(vec![nixl, local], ids(&[1, 0]), MS, t0);
    (core, sl, sn)
}

/// A small exposure's command for `key`, its state and where its answer comes.
fn exposure(key: &str) -> (Cmd, Arc<OpState>, oneshot::Receiver<Result<Exposure>>) {
    let state = OpState::new(OperationStatus::Initialized);
    let (reply, exposed) = oneshot::channel();
    let cmd = Cmd::Expose {
        spec: PassiveSpec {
            key: key.into(),
            kind: OperationKind::Read,
            ranges: vec![Range {
                addr: 4096,
                len: 4096,
                device: Device::Host,
            }],
            state: state.clone(),
        },
        reply,
    };
    (cmd, state, exposed)
}

/// `k1` was exposed on both transports of a [`caller_pair`], the publisher first, and answered
/// with the publisher's metadata.
fn exposed_on_both(
    core: &EngineCore,
    sl: &Mutex<Script>,
    sn: &Mutex<Script>,
    exposed: &mut oneshot::Receiver<Result<Exposure>>,
) {
    assert_eq!(sn.lock().unwrap().log, ["nixl:expose k1"]);
    assert_eq!(sl.lock().unwrap().log, ["local:expose k1"]);
    assert_eq!(
        &*exposed.try_recv().unwrap().unwrap().published.unwrap(),
        "probe:nixl"
    );
    assert_eq!(core.in_flight(), 1);
}

/// Exposes `key` on every transport (an engine's command).
fn expose(core: &mut EngineCore, key: &str) -> Arc<OpState> {
    let (cmd, state, mut exposed) = exposure(key);
    core.handle(cmd);
    exposed.try_recv().unwrap().unwrap();
    state
}

#[test]
fn core_caller_exposure_is_left_whole_to_the_engine_when_nixl_cannot_take_it() {
    let t0 = Instant::now();
    let (mut core, sl, sn) = caller_pair(t0);
    let (cmd, _state, mut exposed) = exposure("k1");
    assert!(EngineCore::for_a_caller(&cmd));
    let back = core
        .handle_as_caller(cmd)
        .expect("NIXL must register: the command comes back");
    // Nothing was done on the caller's turn: no transport saw it, no answer, nothing in flight.
    assert!(sl.lock().unwrap().log.is_empty() && sn.lock().unwrap().log.is_empty());
    assert!(exposed.try_recv().is_err());
    assert_eq!(core.in_flight(), 0);
    // The engine thread exposes it on both, the publisher first.
    core.handle(back);
    exposed_on_both(&core, &sl, &sn, &mut exposed);
}

#[test]
fn core_caller_exposure_of_registered_memory_is_made_on_the_callers_turn() {
    let t0 = Instant::now();
    let (mut core, sl, sn) = caller_pair(t0);
    sn.lock().unwrap().cached = true;
    let (cmd, state, mut exposed) = exposure("k1");
    assert!(core.handle_as_caller(cmd).is_none());
    exposed_on_both(&core, &sl, &sn, &mut exposed);
    assert!(!core.has_deferred());
    // Its end, on a caller's turn too: the same-host path forgets it there, NIXL on the
    // engine's next turn (deferred), and only then is nothing left for the engine.
    state.finish(OperationStatus::Cancelled, None);
    let end = Cmd::Unexpose {
        key: "k1".into(),
        gen: 0,
        keep: None,
    };
    assert!(EngineCore::for_a_caller(&end));
    assert!(core.handle_as_caller(end).is_none());
    assert_eq!(sl.lock().unwrap().log, ["local:expose k1", "local:unexpose k1"]);
    // NIXL lets the exposure's registrations go at once (memory freed and allocated again at the
    // same address must not find them), and is called for the rest on the engine's turn only.
    assert_eq!(sn.lock().unwrap().log, ["nixl:expose k1", "nixl:forget k1"]);
    assert!(core.has_deferred() && core.engine_bound());
    assert_eq!(core.in_flight(), 0);
    core.run_deferred();
    assert_eq!(
        sn.lock().unwrap().log,
        ["nixl:expose k1", "nixl:forget k1", "nixl:unexpose k1"]
    );
    assert!(!core.has_deferred());
}

#[test]
fn core_caller_exposure_that_fails_ends_on_every_transport() {
    let t0 = Instant::now();
    let (local, sl) = probe("local", TransferPath::SameHost);
    let (nixl, sn) = probe("nixl", TransferPath::Nixl);
    sl.lock().unwrap().drivable = true;
    sn.lock().unwrap().cached = true;
    // A third transport a caller may drive, which refuses the exposure.
    let (failing, sf) = probe("failing", TransferPath::SameHost);
    sf.lock().unwrap().drivable = true;
    sf.lock().unwrap().refuse_exposure = true;
    let mut core = EngineCore::new(vec![nixl, local, failing], ids(&[1, 0]), MS, t0);
    let (cmd, _state, mut exposed) = exposure("k1");
    assert!(core.handle_as_caller(cmd).is_none());
    assert!(exposed.try_recv().unwrap().is_err(), "the refusal is the answer");
    assert_eq!(core.in_flight(), 0);
    assert_eq!(sl.lock().unwrap().log, ["local:expose k1", "local:unexpose k1"]);
    // NIXL's end of it waits for the engine thread (but for its bookkeeping).
    assert_eq!(sn.lock().unwrap().log, ["nixl:expose k1", "nixl:forget k1"]);
    core.run_deferred();
    assert_eq!(
        sn.lock().unwrap().log,
        ["nixl:expose k1", "nixl:forget k1", "nixl:unexpose k1"]
    );
}

#[test]
fn core_caller_exposure_behind_a_second_transport_callers_may_not_drive_goes_to_the_engine() {
    let t0 = Instant::now();
    let (local, sl) = probe("local", TransferPath::SameHost);
    let (nixl, sn) = probe("nixl", TransferPath::Nixl);
    let (other, so) = probe("other", TransferPath::Nixl);
    sl.lock().unwrap().drivable = true;
    sn.lock().unwrap().cached = true;
    let mut core = EngineCore::new(vec![nixl, local, other], ids(&[1, 0]), MS, t0);
    let (cmd, _state, _exposed) = exposure("k1");
    assert!(core.handle_as_caller(cmd).is_some());
    for s in [&sl, &sn, &so] {
        assert!(
            s.lock().unwrap().log.is_empty(),
            "a transport saw a returned exposure"
        );
    }
}

#[test]
fn core_caller_turn_leaves_a_hand_over_to_nixl_to_the_engine() {
    let t0 = Instant::now();
    let (mut core, sl, sn) = caller_pair(t0);
    sl.lock().unwrap().decline = Some("the peer is on another host");
    sn.lock().unwrap().complete = true;
    assert!(core.callers_may_begin());
    let (spec, state) = active(1, "k1");
    assert!(core.handle_as_caller(Cmd::Begin { spec }).is_none());
    // Declined by the same-host path on the caller's thread; NIXL (whose begin may create an
    // agent) is not called there, and the engine has work to do now.
    assert_eq!(sl.lock().unwrap().log, ["local:begin 1"]);
    assert!(
        sn.lock().unwrap().log.is_empty(),
        "NIXL was called on a caller's turn"
    );
    assert!(core.has_pending() && core.engine_bound());
    assert!(
        core.hand_over_deferred(),
        "the operation waits: the engine must wake now"
    );
    // More caller turns neither hand it over nor progress NIXL.
    for k in 0..3 {
        core.turn_as_caller(t0 + k * MS, &[], false);
    }
    assert!(sn.lock().unwrap().log.is_empty());
    assert_eq!(
        sn.lock().unwrap().progressed,
        0,
        "NIXL progressed on a caller's turn"
    );
    assert_eq!(state.status(), OperationStatus::InProgress);
    // The engine's turn hands it over and NIXL completes it.
    core.run_deferred();
    assert_eq!(sn.lock().unwrap().log, ["nixl:begin 1"]);
    assert!(!core.has_pending());
    assert!(
        core.engine_bound(),
        "an operation on NIXL needs the engine thread"
    );
    core.turn(t0 + 5 * MS, true, &[]);
    assert_eq!(state.status(), OperationStatus::Complete);
    assert_eq!(state.path(), Some(TransferPath::Nixl));
    assert!(!core.engine_bound());
}

#[test]
fn core_caller_turn_hands_a_cancelled_operation_to_nobody() {
    let t0 = Instant::now();
    let (mut core, sl, sn) = caller_pair(t0);
    sl.lock().unwrap().decline = Some("the peer is on another host");
    let (spec, state) = active(1, "k1");
    assert!(core.handle_as_caller(Cmd::Begin { spec }).is_none());
    // Dropped before the engine took the hand-over: its cancel comes after the deferred work.
    state.finish(OperationStatus::Cancelled, None);
    let (keep, freed) = canary();
    core.run_deferred();
    core.handle(Cmd::Abandon { id: 1, hard: false });
    core.handle(Cmd::Adopt { id: 1, keep });
    core.turn(t0, false, &[]);
    assert!(
        sn.lock().unwrap().log.is_empty(),
        "a cancelled operation was offered to NIXL"
    );
    assert!(state.is_released());
    assert!(freed.load(Ordering::SeqCst));
}

#[test]
fn core_caller_turn_progresses_only_the_transports_callers_may_drive() {
    let t0 = Instant::now();
    let (mut core, sl, sn) = caller_pair(t0);
    for k in 0..4 {
        core.turn_as_caller(t0 + k * MS, &[], false);
    }
    assert_eq!(sl.lock().unwrap().progressed, 4);
    assert_eq!(sn.lock().unwrap().progressed, 0);
    core.turn(t0 + 5 * MS, false, &[]);
    assert_eq!(sn.lock().unwrap().progressed, 1);
}

#[test]
fn core_caller_turn_ends_an_exposure_on_its_transports_and_leaves_nixl_to_the_engine() {
    let t0 = Instant::now();
    for failed in [false, true] {
        let (mut core, sl, sn) = caller_pair(t0);
        let state = expose(&mut core, "k");
        sl.lock()
            .unwrap()
            .emit
            .push(passive_end("k", failed, TransferPath::SameHost));
        core.turn_as_caller(t0, &[], false);
        assert!(state.status().is_terminal());
        // The transport the caller drove forgot the key before the end was visible; NIXL's end
        // of the exposure (it may rotate an exposer) waits for the engine.
        assert_eq!(
            sl.lock().unwrap().unexposed,
            [("k".to_string(), OperationStatus::Initialized)],
            "failed: {failed}"
        );
        assert!(
            sn.lock().unwrap().unexposed.is_empty(),
            "NIXL unexposed on a caller's turn"
        );
        assert!(core.has_pending() && core.has_deferred());
        assert!(
            !core.hand_over_deferred(),
            "nothing waits for this: no wake-up now"
        );
        core.run_deferred();
        assert_eq!(sn.lock().unwrap().unexposed.len(), 1);
        assert!(!core.has_pending());
        assert_eq!(core.in_flight(), 0);
    }
}

#[test]
fn core_caller_turn_frees_adopted_memory_on_the_engines_turn_only() {
    let t0 = Instant::now();
    let (mut core, sl, _) = caller_pair(t0);
    let (spec, state) = active(3, "k3");
    core.handle(Cmd::Begin { spec });
    let (keep, freed) = canary();
    core.handle(Cmd::Adopt { id: 3, keep });
    sl.lock().unwrap().complete = true;
    core.turn_as_caller(t0, &[], false);
    assert_eq!(state.status(), OperationStatus::Complete);
    assert!(state.is_released());
    // Its owner may be a Python object: freed on the engine's turn, not the caller's.
    assert!(
        !freed.load(Ordering::SeqCst),
        "adopted memory freed on a caller's turn"
    );
    assert!(core.has_pending() && !core.hand_over_deferred());
    core.run_deferred();
    assert!(freed.load(Ordering::SeqCst));
}

#[test]
fn core_caller_turn_leaves_an_ended_exposures_memory_to_the_engine() {
    let t0 = Instant::now();
    let (mut core, _, sn) = caller_pair(t0);
    sn.lock().unwrap().keeps = true;
    let state = expose(&mut core, "k");
    // A peer's copy holds the memory.
    state.mark_in_use();
    let (keep, freed) = canary();
    // The exposure ends with owned memory a same-host copy may still be writing.
    core.handle(Cmd::Unexpose {
        key: "k".into(),
        gen: 0,
        keep: Some((keep, 64)),
    });
    state.mark_released();
    core.turn_as_caller(t0, &[], false);
    assert!(
        !sn.lock().unwrap().log.iter().any(|l| l.contains("hold")),
        "memory handed to NIXL's hold on a caller's turn"
    );
    assert!(core.copies_released(), "the engine must be kept due for it");
    core.turn(t0 + MS, false, &[]);
    assert!(sn.lock().unwrap().log.iter().any(|l| l.contains("hold")));
    assert!(!freed.load(Ordering::SeqCst), "NIXL's hold keeps it");
}

#[test]
fn core_caller_turn_watches_nixl_every_watch_gap_and_ends_what_it_sees() {
    let t0 = Instant::now();
    let (mut core, _sl, sn) = caller_pair(t0);
    let state = expose(&mut core, "k1");
    // A turn the driver does not let watch (no wait drives, or waits do not spin) does not.
    core.turn_as_caller(t0, &[], false);
    assert_eq!(sn.lock().unwrap().watched, 0);
    // Caller turns within WATCH_GAP of each other watch once; NIXL is never progressed there.
    for k in 0..3 {
        core.turn_as_caller(t0 + k * (WATCH_GAP / 4), &[], true);
    }
    assert_eq!(sn.lock().unwrap().watched, 1);
    assert_eq!(
        sn.lock().unwrap().progressed,
        0,
        "NIXL progressed on a caller's turn"
    );
    // A NIXL peer's completion, seen by the next watch, ends the operation on that turn; NIXL
    // lets its registrations go there, and is asked for the rest on the engine's turn.
    sn.lock().unwrap().emit.push(Event::PassiveCompleted {
        key: "k1".into(),
        path: TransferPath::Nixl,
    });
    assert!(core.turn_as_caller(t0 + WATCH_GAP * 2, &[], true));
    assert_eq!(sn.lock().unwrap().watched, 2);
    assert_eq!(state.status(), OperationStatus::Complete);
    assert_eq!(state.path(), Some(TransferPath::Nixl));
    assert!(sn.lock().unwrap().log.ends_with(&["nixl:forget k1".to_string()]));
    assert!(core.has_deferred());
    core.run_deferred();
    assert!(sn
        .lock()
        .unwrap()
        .log
        .ends_with(&["nixl:unexpose k1".to_string()]));
}

/// A core over one NIXL-like probe that a caller may not drive but may begin on (as NIXL, when
/// the peer is loaded, the memory registered and both lists prepared), with transfers in flight
/// polled on every turn (`Busy`) and a caller's watch that sees them end.
fn starting_core(t0: Instant) -> (EngineCore, Arc<Mutex<Script>>) {
    let (nixl, sn) = probe("nixl", TransferPath::Nixl);
    {
        let mut s = sn.lock().unwrap();
        s.polling = Some(Polling::Busy);
        s.starts = true;
        s.starts_taken = true;
        s.watch_completes = true;
        s.watched_whole = true;
    }
    (EngineCore::new(vec![nixl], ids(&[0]), MS, t0), sn)
}

#[test]
fn core_caller_begins_on_a_transport_that_starts_for_callers_only_where_they_reach_it() {
    let t0 = Instant::now();
    let (mut core, sn) = starting_core(t0);
    assert!(
        !core.callers_may_begin(),
        "callers may begin on NIXL where the driver did not let them reach it (waits that do not spin)"
    );
    core.let_callers_reach(true);
    assert!(core.callers_may_begin());
    let (spec, state) = active(1, "k1");
    assert!(core.handle_as_caller(Cmd::Begin { spec }).is_none());
    assert_eq!(sn.lock().unwrap().log, ["nixl:start 1"]);
    assert!(!core.has_deferred() && !core.hand_over_deferred());
    // The driver learns, once, that a caller started one: a wait that will not drive wakes the
    // engine for it.
    assert!(core.take_callers_started());
    assert!(!core.take_callers_started());
    assert!(
        !core.engine_bound(),
        "an operation a caller's watch sees end needs no engine thread"
    );
    // The caller's turn that may watch sees it end; NIXL's own progress is never called.
    core.turn_as_caller(t0, &[], true);
    assert_eq!(state.status(), OperationStatus::Complete);
    assert_eq!(state.path(), Some(TransferPath::Nixl));
    let s = sn.lock().unwrap();
    assert_eq!((s.watched, s.progressed), (1, 0));
    assert_eq!(s.log, ["nixl:start 1"]);
}

/// A caller's `Begin` of operation 1 on [`starting_core`]'s probe, whose watches see nothing
/// end: `taken` by the probe on the caller's turn, or handed back (NIXL, when something the
/// transfer needs is not ready).
fn caller_begun(t0: Instant, taken: bool) -> (EngineCore, Arc<Mutex<Script>>, Arc<OpState>) {
    let (mut core, sn) = starting_core(t0);
    core.let_callers_reach(true);
    {
        let mut s = sn.lock().unwrap();
        s.starts_taken = taken;
        s.watch_completes = false;
    }
    let (spec, state) = active(1, "k1");
    assert!(core.handle_as_caller(Cmd::Begin { spec }).is_none());
    (core, sn, state)
}

#[test]
fn core_caller_start_handed_back_waits_for_the_engine_where_it_was() {
    let t0 = Instant::now();
    let (mut core, sn, state) = caller_begun(t0, false);
    assert!(
        core.hand_over_deferred(),
        "a start handed back must wake the engine at once"
    );
    assert!(!core.take_callers_started(), "nothing was started by the caller");
    assert!(core.engine_bound());
    core.run_deferred();
    assert_eq!(sn.lock().unwrap().log, ["nixl:start 1", "nixl:begin 1"]);
    assert!(!core.has_deferred());
    sn.lock().unwrap().complete = true;
    core.turn(t0, true, &[]);
    assert_eq!(state.status(), OperationStatus::Complete);
}

#[test]
fn core_caller_start_handed_back_then_cancelled_is_offered_to_nobody() {
    let t0 = Instant::now();
    let (mut core, sn, state) = caller_begun(t0, false);
    state.finish(OperationStatus::Cancelled, None);
    core.run_deferred();
    core.handle(Cmd::Abandon { id: 1, hard: true });
    core.turn(t0, false, &[]);
    // (Its abandon reaches the chain's first transport, which never had it: nothing to stop.)
    assert!(
        !sn.lock().unwrap().log.iter().any(|l| l.starts_with("nixl:begin")),
        "a cancelled operation the transport handed back was begun there: {:?}",
        sn.lock().unwrap().log
    );
    assert!(state.is_released());
}

#[test]
fn core_caller_watch_of_transfers_in_flight_runs_on_every_turn() {
    let t0 = Instant::now();
    let (mut core, sn, _state) = caller_begun(t0, true);
    // In flight (`Busy`): each turn watches, however close together.
    for _ in 0..3 {
        core.turn_as_caller(t0, &[], true);
    }
    assert_eq!(sn.lock().unwrap().watched, 3);
    // Only exposures waiting (`Watching`): once per WATCH_GAP.
    sn.lock().unwrap().polling = Some(Polling::Watching);
    for _ in 0..3 {
        core.turn_as_caller(t0 + MS, &[], true);
    }
    assert_eq!(sn.lock().unwrap().watched, 4);
    core.turn_as_caller(t0 + MS + WATCH_GAP, &[], true);
    assert_eq!(sn.lock().unwrap().watched, 5);
}

#[test]
fn core_caller_started_operation_binds_the_engine_unless_callers_watch_it_whole() {
    let t0 = Instant::now();
    let (mut core, sn, _state) = caller_begun(t0, true);
    assert!(!core.engine_bound());
    // A large transfer in flight beside it, say: callers' watches would not see it end.
    sn.lock().unwrap().watched_whole = false;
    assert!(core.engine_bound());
    sn.lock().unwrap().watched_whole = true;
    core.let_callers_reach(false);
    assert!(
        core.engine_bound(),
        "the engine stood down for an operation callers do not watch"
    );
}

#[test]
fn core_caller_fallback_to_a_transport_that_starts_for_callers_is_posted_there() {
    // The same-host path declines on the caller's turn (the peer is on another host); NIXL, which
    // has everything ready, takes it on that turn, and from then on has it: its cancel reaches
    // NIXL, and nothing waits for the engine thread.
    let t0 = Instant::now();
    let (local, sl) = probe("local", TransferPath::SameHost);
    let (nixl, sn) = probe("nixl", TransferPath::Nixl);
    {
        let mut s = sl.lock().unwrap();
        s.drivable = true;
        s.decline = Some("the peer is on another host");
    }
    {
        let mut s = sn.lock().unwrap();
        s.starts = true;
        s.starts_taken = true;
    }
    let mut core = EngineCore::new(vec![nixl, local], ids(&[1, 0]), MS, t0);
    core.let_callers_reach(true);
    let (spec, state) = active(1, "k1");
    assert!(core.handle_as_caller(Cmd::Begin { spec }).is_none());
    assert_eq!(sl.lock().unwrap().log, ["local:begin 1"]);
    assert_eq!(sn.lock().unwrap().log, ["nixl:start 1"]);
    assert!(
        !core.has_deferred(),
        "a fallback NIXL took was left to the engine"
    );
    assert!(core.take_callers_started());
    core.turn_as_caller(t0, &[], false);
    assert_eq!(state.path(), Some(TransferPath::Nixl));
    core.handle(Cmd::Abandon { id: 1, hard: true });
    core.turn(t0, false, &[]);
    assert_eq!(sn.lock().unwrap().log, ["nixl:start 1", "nixl:abandon 1"]);
    assert_eq!(state.status(), OperationStatus::Cancelled);
}

#[test]
fn core_commands_callers_may_handle_are_a_small_host_operations_and_no_memory_handed_on() {
    let expose = |len: usize, device| {
        let (reply, _) = oneshot::channel();
        Cmd::Expose {
            spec: PassiveSpec {
                key: "k".into(),
                kind: OperationKind::Read,
                ranges: vec![Range {
                    addr: 4096,
                    len,
                    device,
                }],
                state: OpState::new(OperationStatus::Initialized),
            },
            reply,
        }
    };
    let small = 64 << 10; // the most bytes `Pace::small` takes
    assert!(EngineCore::for_a_caller(&expose(small, Device::Host)));
    assert!(
        !EngineCore::for_a_caller(&expose(small + 1, Device::Host)),
        "a large exposure is the engine's"
    );
    assert!(
        !EngineCore::for_a_caller(&expose(4096, Device::Cuda(0))),
        "device memory is the engine's"
    );
    let end = |keep: Option<(Hold, usize)>| Cmd::Unexpose {
        key: "k".into(),
        gen: 0,
        keep,
    };
    assert!(EngineCore::for_a_caller(&end(None)));
    let handed_on = end(Some((
        Box::new(Vec::<crate::Descriptor<'static>>::new()) as Hold,
        8,
    )));
    assert!(
        !EngineCore::for_a_caller(&handed_on),
        "memory handed on (its owner may be a Python object) is the engine's"
    );
    let (reply, _) = oneshot::channel();
    let register = Cmd::Register {
        ranges: vec![Range {
            addr: 4096,
            len: 4096,
            device: Device::Host,
        }],
        reply,
    };
    assert!(
        !EngineCore::for_a_caller(&register),
        "registration is the engine's"
    );
}
