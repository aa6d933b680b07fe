//! How the core's Rust futures complete Python's awaits: polled on their asyncio loop's own
//! thread with the GIL held, woken by the engines through a socket the loop watches (see the
//! crate's docs), or answered at the call.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use nixl_connect::Error;
use pyo3::gc::PyVisit;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::pyclass_init::PyClassInitializer;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyWeakrefMethods, PyWeakrefReference};
use pyo3::{PyClass, PyTraverseError};

use crate::errors::{err, CoreError};
use crate::forks::FORKS;

/// What a Rust future that succeeded hands its asyncio future (an error is raised in Python as
/// `CoreError`).
pub(crate) enum Outcome {
    /// A wait that ended: `None` in Python.
    Done,
    /// A Python object, made on the loop's thread with the GIL held (an operation's handle).
    Object(MakeObject),
}

/// Makes an outcome's Python object once the GIL is held.
pub(crate) type MakeObject = Box<dyn for<'py> FnOnce(Python<'py>) -> PyResult<Bound<'py, PyAny>> + Send>;

impl Outcome {
    /// `value`, a `#[pyclass]` value, as the object the await returns.
    pub(crate) fn object<T>(value: T) -> Self
    where
        T: PyClass + Into<PyClassInitializer<T>> + Send + 'static,
    {
        Outcome::Object(Box::new(move |py| Ok(Bound::new(py, value)?.into_any())))
    }
}

type Work = Pin<Box<dyn Future<Output = Result<Outcome, Error>> + Send>>;

/// The runtime whose driver serves the futures' timers (and any task they spawn); the futures
/// themselves are polled on their event loop's thread.
///
/// One per process: a child of `fork()` has none of its parent's threads, so it starts its own
/// (the parent's is leaked there, never dropped).
pub(crate) fn runtime() -> PyResult<&'static tokio::runtime::Runtime> {
    static RT: Mutex<Option<(u64, &'static tokio::runtime::Runtime)>> = Mutex::new(None);
    let image = FORKS.load(Ordering::Relaxed);
    let mut slot = lock(&RT);
    if let Some((p, rt)) = *slot {
        if p == image {
            return Ok(rt);
        }
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("nixl-connect-py")
        .enable_all()
        .build()
        .map_err(|e| CoreError::new_err(("Io", format!("cannot start the tokio runtime: {e}"))))?;
    let rt: &'static tokio::runtime::Runtime = Box::leak(Box::new(rt));
    *slot = Some((image, rt));
    Ok(rt)
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// One Rust future, resolving an asyncio future that its loop's [`Completions`] holds (under the
/// task's `id`) while it is pending.
struct Task {
    id: u64,
    work: Mutex<Option<Work>>,
    queued: AtomicBool,
    queue: Arc<Queue>,
}

impl Wake for Task {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    /// Called from any thread (the engine's, a timer's), never with the GIL: queues the task for
    /// its loop's thread.
    fn wake_by_ref(self: &Arc<Self>) {
        if !self.queued.swap(true, Ordering::AcqRel) {
            self.queue.push(self.clone());
        }
    }
}

impl Task {
    /// Whether the task is woken within `limit`, while `keep` holds (both checked between yields
    /// of this thread's core, so an engine thread that shares it runs). On an oversubscribed host,
    /// where one yield takes a time slice, it does not wait.
    fn woken_within(&self, limit: Duration, keep: &dyn Fn() -> bool) -> bool {
        nixl_connect::__spin_until(limit, || self.queued.load(Ordering::Acquire) || !keep());
        self.queued.load(Ordering::Acquire)
    }

    /// Polls the future once with this task as its waker (on the loop's thread, GIL held; polls
    /// never block): its result once it is ready (the future is then dropped), else `None`. It
    /// leaves `queued` as it is: a task woken meanwhile is in the queue already, and queueing it
    /// twice would poll it twice a turn.
    fn poll_here(self: &Arc<Self>, rt: &tokio::runtime::Runtime) -> Option<Result<Outcome, Error>> {
        let mut slot = lock(&self.work);
        let work = slot.as_mut()?;
        let waker = Waker::from(self.clone());
        let poll = {
            let _timers = rt.enter();
            work.as_mut().poll(&mut Context::from_waker(&waker))
        };
        match poll {
            Poll::Ready(result) => {
                *slot = None;
                Some(result)
            }
            Poll::Pending => None,
        }
    }

    /// The loop's poll of a task it took from its queue (so a wake-up from now on queues it
    /// again): resolves the asyncio future once the work is ready.
    fn run(self: &Arc<Self>, py: Python<'_>, rt: &tokio::runtime::Runtime) {
        self.queued.store(false, Ordering::Release);
        if let Some(result) = self.poll_here(rt) {
            // The lock is let go before `resolve` runs Python code.
            let target = self.queue.take(self.id);
            match target {
                Some(target) => resolve(target.bind(py), result),
                None => py.detach(move || drop(result)),
            }
        }
    }
}

/// Tasks woken since the loop last drained them, the socket that wakes the loop, and the asyncio
/// futures of the loop's pending tasks.
struct Queue {
    ready: Mutex<VecDeque<Arc<Task>>>,
    signal: UnixStream,
    /// The futures pending tasks resolve, by task id. They are the loop's: held here (and shown
    /// to Python's collector by [`Completions`]), a task nobody holds that awaits one lives on as
    /// long as the loop does (asyncio holds tasks only weakly), and they go with the loop's
    /// `Completions` when the loop closes.
    pending: Mutex<HashMap<u64, Pending>>,
}

/// A pending task's asyncio future, and the task (which the engine's wakers hold).
type Pending = (Py<PyAny>, Weak<Task>);

impl Queue {
    /// The pending future of task `id`, no longer held here.
    fn take(&self, id: u64) -> Option<Py<PyAny>> {
        lock(&self.pending).remove(&id).map(|(future, _)| future)
    }

    fn push(&self, task: Arc<Task>) {
        let mut ready = lock(&self.ready);
        let was_empty = ready.is_empty();
        ready.push_back(task);
        drop(ready);
        if was_empty {
            // One byte per batch: the loop empties the socket before it takes the queue, so a task
            // queued after that finds the queue empty and writes again. WouldBlock means unread
            // bytes are there already; any other error leaves the task queued for the next wake.
            let _ = (&self.signal).write(&[1]);
        }
    }
}

/// One asyncio loop's executor (internal; created on the loop's first coroutine). The loop's
/// reader callback is its one strong reference, so it lives as long as the loop watches its
/// socket: until the loop closes (or is collected), when it ends every task still pending.
#[pyclass(frozen, weakref, module = "nixl_connect._core")]
pub(crate) struct Completions {
    queue: Arc<Queue>,
    wake: UnixStream,
    /// [`FORKS`] when it was made: a child of `fork()` must not end its parent's work (see
    /// `forks.rs`), only forget it.
    image: u64,
}

impl Completions {
    /// Ends every pending task: drops its future and its work (the work on the runtime's
    /// blocking pool: ending an exposure may wait for this process's own copy into it to stop,
    /// and the GIL is held here). A work this thread is polling right now is left to that poll.
    fn end_all(&self) {
        let pending = std::mem::take(&mut *lock(&self.queue.pending));
        let forked = FORKS.load(Ordering::Relaxed) != self.image;
        for (_, (future, task)) in pending {
            drop(future);
            let Some(task) = task.upgrade() else { continue };
            let work = match task.work.try_lock() {
                Ok(mut work) => work.take(),
                Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner().take(),
                Err(std::sync::TryLockError::WouldBlock) => None,
            };
            match work {
                None => {}
                Some(work) if forked => std::mem::forget(work),
                Some(work) => match runtime() {
                    Ok(rt) => drop(rt.spawn_blocking(move || drop(work))),
                    Err(_) => drop(work),
                },
            }
        }
    }
}

impl Drop for Completions {
    fn drop(&mut self) {
        self.end_all();
    }
}

#[pymethods]
impl Completions {
    /// The socket the loop watches.
    fn fileno(&self) -> i32 {
        self.wake.as_raw_fd()
    }

    /// The pending futures (skipped while their table is locked, which no Python code runs under:
    /// the collector then takes them for reachable, which is safe).
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        if let Ok(pending) = self.queue.pending.try_lock() {
            for (future, _) in pending.values() {
                visit.call(future)?;
            }
        }
        Ok(())
    }

    /// A loop collected without being closed: its pending tasks end.
    fn __clear__(&self) {
        self.end_all();
    }

    /// Polls every woken task (the loop's reader callback).
    fn drain(&self, py: Python<'_>) -> PyResult<()> {
        let mut buf = [0u8; 256];
        loop {
            match (&self.wake).read(&mut buf) {
                Ok(n) if n == buf.len() => continue,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                _ => break,
            }
        }
        let rt = runtime()?;
        let ready = std::mem::take(&mut *lock(&self.queue.ready));
        for task in ready {
            task.run(py, rt);
        }
        Ok(())
    }
}

/// Sets an asyncio future's result or exception (skipped if it was cancelled meanwhile: the
/// outcome, an operation for instance, is then dropped, which releases it, without the GIL: an
/// exposure's drop may wait for this process's own same-host copy into its memory to stop).
fn resolve(future: &Bound<'_, PyAny>, outcome: Result<Outcome, Error>) {
    let py = future.py();
    if future
        .call_method0("done")
        .and_then(|d| d.is_truthy())
        .unwrap_or(true)
    {
        py.detach(move || drop(outcome));
        return;
    }
    let set = match outcome {
        Ok(Outcome::Done) => future.call_method1("set_result", (py.None(),)),
        Ok(Outcome::Object(make)) => make(py).and_then(|o| future.call_method1("set_result", (o,))),
        Err(e) => future.call_method1("set_exception", (err(e).into_value(py),)),
    };
    if let Err(e) = set {
        e.write_unraisable(py, Some(future));
    }
}

/// Drops the Rust future when its asyncio future is done (a no-op unless it was cancelled:
/// a resolved task has dropped its future already), without the GIL, as `release()` does.
#[pyclass(frozen, module = "nixl_connect._core")]
struct Abort(Arc<Task>);

#[pymethods]
impl Abort {
    fn __call__(&self, future: &Bound<'_, PyAny>) {
        let work = lock(&self.0.work).take();
        if work.is_some() {
            future.py().detach(move || drop(work));
        }
        drop(self.0.queue.take(self.0.id));
    }
}

thread_local! {
    /// This thread's last event loop and its `Completions`, both held weakly (a closed loop and
    /// its socket pair go when the loop does: the loop's reader callback is what keeps a
    /// `Completions` alive). A thread runs one loop at a time, so this answers nearly every lookup
    /// with a comparison, where the loops' `WeakKeyDictionary` makes a weak reference per call.
    /// (Weak references dropped at the thread's exit are released through pyo3's reference pool,
    /// its default, when no GIL is held there.)
    static LAST_LOOP: RefCell<Option<(Py<PyWeakrefReference>, Py<PyWeakrefReference>)>> = const { RefCell::new(None) };
}

/// The running loop's `Completions`, created and registered with the loop the first time.
fn completions<'py>(py: Python<'py>, event_loop: &Bound<'py, PyAny>) -> PyResult<Bound<'py, Completions>> {
    let last = LAST_LOOP.with(|last| {
        let last = last.borrow();
        let (weak_loop, weak_c) = last.as_ref()?;
        let target = weak_loop.bind(py).upgrade()?;
        if !target.is(event_loop) {
            return None;
        }
        weak_c.bind(py).upgrade()?.cast_into::<Completions>().ok()
    });
    if let Some(c) = last {
        return Ok(c);
    }
    let c = completions_of(py, event_loop)?;
    let entry = (
        PyWeakrefReference::new(event_loop)?.unbind(),
        PyWeakrefReference::new(&c)?.unbind(),
    );
    // The entry it replaces is dropped after the borrow ends (dropping runs Python code).
    let old = LAST_LOOP.with(|last| last.replace(Some(entry)));
    drop(old);
    Ok(c)
}

/// [`completions`] found in (or added to) the table of every loop's.
fn completions_of<'py>(py: Python<'py>, event_loop: &Bound<'py, PyAny>) -> PyResult<Bound<'py, Completions>> {
    static LOOPS: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    let loops = LOOPS
        .get_or_try_init(py, || {
            Ok::<_, PyErr>(
                py.import("weakref")?
                    .getattr("WeakKeyDictionary")?
                    .call0()?
                    .unbind(),
            )
        })?
        .bind(py);
    // The table holds each loop's `Completions` weakly too: held strongly, it would keep its
    // pending futures, and through them their loop, alive for good.
    if let Ok(weak) = loops
        .call_method1("get", (event_loop,))?
        .cast_into::<PyWeakrefReference>()
    {
        if let Some(c) = weak.upgrade().and_then(|c| c.cast_into::<Completions>().ok()) {
            return Ok(c);
        }
    }
    let (wake, signal) = UnixStream::pair()
        .and_then(|(a, b)| {
            a.set_nonblocking(true)?;
            b.set_nonblocking(true)?;
            Ok((a, b))
        })
        .map_err(|e| CoreError::new_err(("Io", format!("cannot create the completion socket: {e}"))))?;
    let queue = Arc::new(Queue {
        ready: Mutex::new(VecDeque::new()),
        signal,
        pending: Mutex::new(HashMap::new()),
    });
    let image = FORKS.load(Ordering::Relaxed);
    let c = Bound::new(py, Completions { queue, wake, image })?;
    event_loop.call_method1("add_reader", (c.get().fileno(), c.getattr("drain")?))?;
    loops.set_item(event_loop, PyWeakrefReference::new(&c)?)?;
    Ok(c)
}

/// Whether a coroutine-like call of this module may return its outcome itself when it is known
/// before an asyncio future is needed: the operation (`Passive`, `Active`), `None` for a finished
/// wait, or its error raised at the call. The Python layer asks for it on every call and awaits
/// only what is not an outcome, which spares a small operation's calls the making, resolving and
/// awaiting of a future each (about 2 us a call here). Without it every call returns an awaitable,
/// as a coroutine would.
#[derive(Clone, Copy)]
pub(crate) struct Now(pub(crate) bool);

/// What an outcome known at the call becomes: itself under [`Now`], else a resolved future.
fn known<'py>(
    event_loop: &Bound<'py, PyAny>,
    result: Result<Outcome, Error>,
    now: Now,
) -> PyResult<Bound<'py, PyAny>> {
    let py = event_loop.py();
    if !now.0 {
        let future = event_loop.call_method0(intern!(py, "create_future"))?;
        resolve(&future, result);
        return Ok(future);
    }
    match result {
        Ok(Outcome::Done) => Ok(py.None().into_bound(py)),
        Ok(Outcome::Object(make)) => make(py),
        Err(e) => Err(err(e)),
    }
}

/// Returns an asyncio future of the running loop that `work` resolves (or, under [`Now`], the
/// outcome itself when it is known before a future is needed).
///
/// `work` is polled once before anything else (which starts it: an operation's command reaches
/// its engine), then again with its waker. A future that is ready by then, like waiting for a
/// finished transfer, or an exposure a hot engine answered meanwhile, resolves without a trip
/// through the loop (a trip costs a wake-up of its thread and two turns of the loop). After that
/// it is polled on the loop's thread whenever it is woken.
pub(crate) fn spawn<'py, F>(py: Python<'py>, work: F, now: Now) -> PyResult<Bound<'py, PyAny>>
where
    F: Future<Output = Result<Outcome, Error>> + Send + 'static,
{
    spawn_within(py, work, None, now)
}

/// The longest the loop's thread waits at the call for an answer that takes no more than one turn
/// of this process's engine (an exposure: registering the memory and making its metadata) or one
/// round trip between two engines (a small same-host operation), before it hands the loop a
/// pending future instead.
pub(crate) const LOCAL_WAIT: Duration = Duration::from_micros(50);

/// [`spawn`] for work that no peer takes part in: when the engine has not answered after the
/// first polls, the loop's thread waits up to [`LOCAL_WAIT`] for it (yielding its core to the
/// engine; not on an oversubscribed host), which spares the loop the wake-up of its thread and
/// two of its turns.
pub(crate) fn spawn_local<'py, F>(py: Python<'py>, work: F, now: Now) -> PyResult<Bound<'py, PyAny>>
where
    F: Future<Output = Result<Outcome, Error>> + Send + 'static,
{
    spawn_within(py, work, Some((LOCAL_WAIT, &|| true)), now)
}

/// How long the loop's thread may wait at the call, and while what holds.
type LocalWait<'a> = Option<(Duration, &'a dyn Fn() -> bool)>;

/// [`spawn`], waiting at the call as `local` says (see [`spawn_local`]).
pub(crate) fn spawn_within<'py, F>(
    py: Python<'py>,
    work: F,
    local: LocalWait<'_>,
    now: Now,
) -> PyResult<Bound<'py, PyAny>>
where
    F: Future<Output = Result<Outcome, Error>> + Send + 'static,
{
    static GET_RUNNING_LOOP: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    // No running loop (a call outside a coroutine) raises here, before anything has started.
    let event_loop = GET_RUNNING_LOOP
        .get_or_try_init(py, || {
            Ok::<_, PyErr>(py.import("asyncio")?.getattr("get_running_loop")?.unbind())
        })?
        .bind(py)
        .call0()?;
    let rt = runtime()?;
    let mut work: Work = Box::pin(work);
    // The first poll only starts the work: the next, with the task's waker, is the one whose
    // wake-ups count. Should anything fail after it, the work is dropped (below, once the task
    // holds it), which ends what it started (every operation is cancel safe).
    let first = {
        let _timers = rt.enter();
        work.as_mut().poll(&mut Context::from_waker(Waker::noop()))
    };
    if let Poll::Ready(result) = first {
        return known(&event_loop, result, now);
    }
    let queue = completions(py, &event_loop)?.get().queue.clone();
    static IDS: AtomicU64 = AtomicU64::new(0);
    let task = Arc::new(Task {
        id: IDS.fetch_add(1, Ordering::Relaxed),
        work: Mutex::new(Some(work)),
        queued: AtomicBool::new(false),
        queue,
    });
    // Until the asyncio future exists only this thread polls the task: the loop's `drain`, which
    // runs on this thread, cannot run before this call returns.
    if let Some(result) = task.poll_here(rt) {
        return known(&event_loop, result, now);
    }
    if let Some((limit, keep)) = local {
        // The GIL stays held: no thread of the module takes it, and releasing it could hand it to
        // another Python thread for a whole switch interval (5 ms) before this one got it back.
        if task.woken_within(limit, keep) {
            if let Some(result) = task.poll_here(rt) {
                return known(&event_loop, result, now);
            }
        }
    }
    // Pending: from here on the loop polls the task when it is woken (a wake-up since the last
    // poll has queued it already) and resolves this future.
    let pending = (|| {
        let future = event_loop.call_method0(intern!(py, "create_future"))?;
        lock(&task.queue.pending).insert(task.id, (future.clone().unbind(), Arc::downgrade(&task)));
        future.call_method1(intern!(py, "add_done_callback"), (Abort(task.clone()),))?;
        Ok(future)
    })();
    if pending.is_err() {
        // No one will await it (a KeyboardInterrupt inside `create_future`, say): the engine's
        // wakers still hold the task, so its work is ended here, not left running unseen.
        drop(lock(&task.work).take());
        drop(task.queue.take(task.id));
    }
    pending
}
