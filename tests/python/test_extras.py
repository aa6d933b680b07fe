"""Behaviour of nixl_connect beyond Dynamo 1.6.1 (skipped for dynamo.nixl_connect: "extra beyond
Dynamo"): no torch import, typed exceptions, wait timeouts, op.path, read-only and pinned buffers,
extra Descriptor sources. Everything here must also leave Dynamo-style code working unchanged."""
import array
import asyncio
import base64
import builtins
import os
import pickle
import re
import subprocess
import sys
import zlib

import numpy as np
import pytest

from conftest import DYNAMO, require_peer_module, start_peer, waited
from nc_common import pattern

pytestmark = pytest.mark.extra

KINDS = {
    # kind -> the builtin the typed class also derives from
    "InvalidArgument": ValueError,
    "WrongPairing": RuntimeError,
    "DeviceMismatch": ValueError,
    "DescriptorMismatch": ValueError,
    "Metadata": ValueError,
    "Refused": RuntimeError,
    "NixlNotFound": ImportError,
    "NixlLoad": ImportError,
    "CudaUnavailable": RuntimeError,
    "NixlBackend": RuntimeError,
    "Os": OSError,
    "Nixl": RuntimeError,
    "RemoteGone": RuntimeError,
    "Transfer": RuntimeError,
    "Interrupted": RuntimeError,
    "PathUnavailable": RuntimeError,
    "EngineStopped": RuntimeError,
    "Cancelled": RuntimeError,
    "TimedOut": builtins.TimeoutError,
    "Channel": RuntimeError,
    "NotPublished": RuntimeError,
}

DYNAMO_NAMES = [
    "AbstractOperation", "ActiveOperation", "PassiveOperation", "Connection", "Connector",
    "Descriptor", "Device", "DeviceKind", "OperationKind", "OperationStatus", "RdmaMetadata",
    "SerializedDescriptor", "ReadOperation", "WriteOperation", "ReadableOperation",
    "WritableOperation", "Remote",
]


# --------------------------------------------------------------------------- module level

def test_import_does_not_import_torch(nc):
    """Dynamo needs torch at import; nixl_connect must not import it (real torch is installed in
    the suite's venv, so an import would show)."""
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(nc.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_parent, env.get("PYTHONPATH", "")) if p)
    code = (f"import sys, {nc.__name__}\n"
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
            "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.returncode == 0, r.stderr


def test_version(nc):
    assert isinstance(nc.__version__, str) and nc.__version__


def test_every_dynamo_name_importable(nc):
    ns = {}
    exec(f"from {nc.__name__} import " + ", ".join(DYNAMO_NAMES), ns)
    assert all(ns[n] is getattr(nc, n) for n in DYNAMO_NAMES)


def test_star_import_does_not_shadow_builtins(nc):
    ns = {}
    exec(f"from {nc.__name__} import *", ns)
    for n in DYNAMO_NAMES:
        assert n in ns, n
    # never shadow builtins.TimeoutError or asyncio.CancelledError in the importer's namespace
    assert "TimeoutError" not in ns and "CancelledError" not in ns
    assert nc.TimeoutError is not builtins.TimeoutError


# --------------------------------------------------------------------------- exception classes

@pytest.mark.parametrize("kind", sorted(KINDS))
def test_error_class_per_kind(nc, kind):
    cls = nc.ERROR_CLASSES[kind]
    assert issubclass(cls, nc.NixlConnectError)
    assert issubclass(cls, KINDS[kind])
    assert cls.kind == kind
    e = cls("boom")
    assert str(e) == "boom" and e.args == ("boom",) and e.kind == kind and e.message == "boom"
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is cls and back.kind == kind and str(back) == "boom"


def test_timeout_and_cancelled_classes(nc):
    assert issubclass(nc.TimeoutError, builtins.TimeoutError)
    assert issubclass(nc.TimeoutError, asyncio.TimeoutError)  # what asyncio.wait_for users catch
    assert issubclass(nc.CancelledError, RuntimeError)
    # a RuntimeError, not asyncio's BaseException-based task cancellation
    assert not issubclass(nc.CancelledError, asyncio.CancelledError)


def test_core_coroutine_outside_a_running_loop_starts_nothing(nc):
    """A core coroutine called with no running loop raises before its operation starts: no
    exposure reaches the engine (nothing is registered), so nothing is left to undo."""
    core = nc._core.Connector("outside-a-loop")
    desc = nc.Descriptor(bytearray(4096))
    with pytest.raises(RuntimeError, match="no running event loop"):
        core.create_readable([desc._core_desc()])
    assert core.stats()["registrations"] == 0


def test_core_errors_are_translated(nc):
    """A _core.CoreError(kind, message) becomes the typed class of its kind."""
    from nixl_connect._errors import from_core  # noqa: PLC0415 - internal helper
    for kind, base in KINDS.items():
        err = from_core(nc._core.CoreError(kind, f"message for {kind}"))
        assert type(err) is nc.ERROR_CLASSES[kind]
        assert isinstance(err, base) and err.kind == kind and str(err) == f"message for {kind}"
    err = from_core(nc._core.CoreError("SomethingNew", "from a newer core"))
    assert isinstance(err, nc.NixlConnectError) and isinstance(err, RuntimeError)
    assert err.kind == "SomethingNew"


def test_core_chooses_the_class_of_every_kind(nc):
    """The Rust core names the class for each of its kinds (args[2]); each names a class of
    this module, the one the kind's table entry and the docs give."""
    if not hasattr(nc._core, "error_classes"):
        pytest.skip("Dynamo's module has no Rust core")
    from nixl_connect import _errors  # noqa: PLC0415 - internal module
    pairs = dict(nc._core.error_classes())
    assert set(pairs) == set(KINDS) | {"Forked"}, set(pairs) ^ (set(KINDS) | {"Forked"})
    for kind, name in pairs.items():
        cls = getattr(_errors, name)
        assert cls is nc.ERROR_CLASSES[kind], kind
        err = _errors.from_core(nc._core.CoreError(kind, "m", name))
        assert type(err) is cls and err.kind == kind
    # A class this module lacks (a newer core) falls back to the kind's entry.
    err = _errors.from_core(nc._core.CoreError("Refused", "m", "NoSuchClass"))
    assert type(err) is nc.ERROR_CLASSES["Refused"]


# --------------------------------------------------------------------------- typed errors in use

async def test_wrong_pairing_is_typed(nc):
    a, b = nc.Connector(), nc.Connector()
    with await a.create_readable(nc.Descriptor(pattern(64, 91))) as readable:
        with pytest.raises(RuntimeError) as info:
            await b.begin_write(nc.Descriptor(bytearray(64)), readable.metadata())
        assert isinstance(info.value, nc.NixlConnectError)
        assert isinstance(info.value, nc.WrongPairingError)
        assert info.value.kind == "WrongPairing"
    with await a.create_writable(nc.Descriptor(bytearray(64))) as writable:
        with pytest.raises(nc.WrongPairingError) as info:
            await b.begin_read(writable.metadata(), nc.Descriptor(bytearray(64)))
        assert isinstance(info.value, RuntimeError) and info.value.kind == "WrongPairing"


async def test_descriptor_mismatch_is_typed(nc):
    a, b = nc.Connector(), nc.Connector()
    with await a.create_readable(nc.Descriptor(pattern(64, 92))) as readable:
        with pytest.raises(ValueError, match="same size") as info:
            await b.begin_read(readable.metadata(), nc.Descriptor(bytearray(63)))
        assert isinstance(info.value, nc.DescriptorMismatchError)
        assert info.value.kind == "DescriptorMismatch"


async def test_given_up_exposures_keep_a_bounded_number_of_registrations(nc):
    # Dynamo's multimodal callers expose a fresh tensor per operation: the memory of each
    # given-up exposure stays held until its NIXL agent is gone, but only the newest 4,096
    # registrations stay (REGISTERED_QUARANTINE), where before every one stayed registered (and
    # each new registration got slower as NIXL's sorted list grew); memory reused per operation
    # still registers once.
    a = nc.Connector()
    core = (await a._create_connection())._core
    bound, n = 4096, 5000
    for i in range(n):
        with await a.create_readable(nc.Descriptor(bytearray([i % 251]) * 4096)):
            pass
    stats = core.stats()
    assert stats["registrations"] >= n, stats
    assert stats["quarantined_bytes"] >= n * 4096, stats
    assert stats["live_registrations"] <= bound + 1, stats
    reused = bytearray(4096)
    before = core.stats()["registrations"]
    for _ in range(500):
        with await a.create_readable(nc.Descriptor(reused)):
            pass
    assert core.stats()["registrations"] - before == 1, core.stats()


async def test_wait_of_a_task_nobody_holds_completes(nc):
    # asyncio holds tasks only weakly: a task nobody keeps, awaiting an operation, lives on what
    # the loop holds for it (Dynamo's module waits on the loop's timers). The futures this module's
    # waits resolve are the running loop's to hold, so a collection meanwhile must not end them.
    import gc

    a, b = nc.Connector(), nc.Connector()
    dst = bytearray(4096)
    done = []

    async def waiter(op):
        with op:
            await op.wait_for_completion()
        done.append(bytes(dst[:4]))

    writable = await a.create_writable(nc.Descriptor(dst))
    md = writable.metadata()
    asyncio.ensure_future(waiter(writable))  # no reference kept
    del writable
    await asyncio.sleep(0.05)  # the wait is pending now
    gc.collect()
    with await b.begin_write(nc.Descriptor(bytearray(b"abcd" * 1024)), md) as w:
        await waited(w.wait_for_completion())
    for _ in range(1500):
        if done:
            break
        await asyncio.sleep(0.01)
    assert done == [b"abcd"], "the unreferenced task's wait did not complete"


def test_wait_left_pending_on_a_closed_loop_is_collected(nc):
    # A loop closed without cancelling the coroutines that await operations (a caller's own
    # `run_until_complete`, then `close()`): the coroutines are garbage, as they would be with
    # Dynamo's pure-Python module, and the collector must free them and end their exposures. The
    # Rust task holds the asyncio future its wait resolves, so without the collector seeing that
    # reference each one kept its operation, its memory and its registration for good.
    import gc
    import time
    import weakref

    a = nc.Connector()

    async def start():
        op = await a.create_writable(nc.Descriptor(bytearray(4096)))
        task = asyncio.ensure_future(op.wait_for_completion())  # waits for a writer never sent
        task._log_destroy_pending = False  # the loop closes under it on purpose
        await asyncio.sleep(0.01)
        core = (await a._create_connection())._core
        return op, core

    ops, n = [], 3
    for _ in range(n):
        loop = asyncio.new_event_loop()
        op, core = loop.run_until_complete(start())
        ops.append(weakref.ref(op))
        del op
        loop.close()
        del loop
    gc.collect()
    assert all(op() is None for op in ops), "an operation left waiting on a closed loop was kept"
    # Each exposure was given up (its memory stays held until the agent goes, as after a cancel).
    deadline = time.monotonic() + 15
    while core.stats()["quarantined_bytes"] < n * 4096 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert core.stats()["quarantined_bytes"] >= n * 4096, core.stats()


async def test_descriptor_on_two_connectors_is_typed(nc):
    a, b = nc.Connector(), nc.Connector()
    d = nc.Descriptor(bytearray(16))
    with await a.create_readable(d):
        with pytest.raises(RuntimeError, match="more than one connection") as info:
            await b.create_readable(d)
        assert isinstance(info.value, nc.NixlConnectError)


async def test_null_pointer_is_typed(nc):
    a = nc.Connector()
    with pytest.raises(ValueError, match="null pointer") as info:
        await a.create_readable(nc.Descriptor((0, 8)))
    assert isinstance(info.value, nc.InvalidArgumentError) and info.value.kind == "InvalidArgument"


async def test_timeout_is_typed(nc):
    a = nc.Connector()
    with await a.create_writable(nc.Descriptor(bytearray(64))) as op:
        with pytest.raises(nc.TimeoutError) as info:
            await op.wait_for_completion(timeout=0.05)
        e = info.value
        assert isinstance(e, builtins.TimeoutError) and isinstance(e, asyncio.TimeoutError)
        assert isinstance(e, nc.NixlConnectError) and e.kind == "TimedOut"
        assert op.status == nc.OperationStatus.INITIALIZED
        with pytest.raises(ValueError):
            await op.wait_for_completion(timeout=-1)
        with pytest.raises(TypeError):
            await op.wait_for_completion(timeout="1")


async def test_timeout_longer_than_any_duration_is_no_limit(nc):
    # 1e300 seconds is finite but past what a Rust Duration holds: it waits without a limit,
    # like inf or None (it once raised a PanicException from the core).
    a = nc.Connector()
    with await a.create_writable(nc.Descriptor(bytearray(64))) as op:
        waiter = asyncio.ensure_future(op.wait_for_completion(timeout=1e300))
        await asyncio.sleep(0.1)
        assert not waiter.done(), waiter.exception() if waiter.done() else None
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert op.status == nc.OperationStatus.INITIALIZED


async def test_wait_after_passive_release_times_out(nc):
    a = nc.Connector()
    op = await a.create_readable(nc.Descriptor(bytearray(64)))
    op.__exit__(None, None, None)
    with pytest.raises(nc.TimeoutError):
        await waited(op.wait_for_completion(timeout=0.1), 5)


# --------------------------------------------------------------------------- operations

async def test_path_and_cancel_after_completion(nc):
    a, b = nc.Connector(), nc.Connector()
    src = pattern(4096, 93)
    dst = bytearray(4096)
    with await a.create_readable(nc.Descriptor(src)) as readable:
        assert readable.path is None or readable.path in ("local", "nixl")
        with await b.begin_read(readable.metadata(), nc.Descriptor(dst)) as op:
            await waited(op.wait_for_completion(timeout=10))
            assert op.path in ("local", "nixl")
            op.cancel()  # no effect once complete (Rust semantics; Dynamo flips it to CANCELLED)
            assert op.status == nc.OperationStatus.COMPLETE
            assert len(op.results()) == 1
        await waited(readable.wait_for_completion(timeout=10))
    assert dst == src


async def test_path_reason_says_why_the_same_host_path_declined(nc):
    # Two nixl_connect peers on this host: the same-host path takes it, with nothing to explain.
    a, b = nc.Connector(), nc.Connector()
    src, dst = pattern(4096, 95), bytearray(4096)
    with await a.create_readable(nc.Descriptor(src)) as readable:
        with await b.begin_read(readable.metadata(), nc.Descriptor(dst)) as op:
            await waited(op.wait_for_completion(timeout=10))
            assert (op.path, op.path_reason) == ("local", None)
        await waited(readable.wait_for_completion(timeout=10))
    assert readable.path_reason is None  # passive operations choose no path
    # A Python Dynamo worker (another process) serves no same-host endpoint: NIXL takes the read,
    # and the operation says why, before and after its release.
    peer = await start_peer(require_peer_module(DYNAMO), "readable", [4096], seed=96)
    try:
        md = nc.RdmaMetadata.model_validate_json(await peer.expect("MD"))
        op = await b.begin_read(md, nc.Descriptor(bytearray(4096)))
        with op:
            await waited(op.wait_for_completion(timeout=20))
            assert op.path == "nixl"
            reason = op.path_reason
            assert reason and "advertises no same-host endpoint" in reason, reason
        assert op.path_reason == reason
        assert (await peer.result())["ok"]
    finally:
        await peer.close()


async def test_metadata_hex_flag_is_honoured(nc):
    a = nc.Connector()
    with await a.create_readable(nc.Descriptor(bytearray(64))) as op:
        b64 = op.metadata()
        hx = op.metadata(hex_encode=True)
        assert b64.nixl_metadata.startswith("b64:") and not hx.nixl_metadata.startswith("b64:")
        assert bytes.fromhex(hx.nixl_metadata) == base64.b64decode(b64.nixl_metadata[4:])
        assert zlib.decompress(bytes.fromhex(hx.nixl_metadata))
        assert op.metadata() is b64 and op.metadata(hex_encode=True) is hx
        assert hx.model_copy(update={"nixl_metadata": b64.nixl_metadata}) == b64


# --------------------------------------------------------------------------- memory sources

async def test_bytes_cannot_be_a_destination(nc):
    a, b = nc.Connector(), nc.Connector()
    frozen = bytes(4096)
    with await a.create_readable(nc.Descriptor(pattern(4096, 94))) as readable:
        with pytest.raises(ValueError) as info:
            op = await b.begin_read(readable.metadata(), nc.Descriptor(frozen))
            with op:
                await waited(op.wait_for_completion(timeout=5))
        assert isinstance(info.value, nc.NixlConnectError)
        assert info.value.kind == "InvalidArgument"
    with pytest.raises(ValueError):
        await a.create_writable(nc.Descriptor(b"\x00" * 64))
    assert frozen == bytes(4096)


async def test_memoryview_and_array_sources(nc):
    a, b = nc.Connector(), nc.Connector()
    src = array.array("I", range(1024))  # 4 KiB, not bytes/bytearray: buffer protocol
    dst = bytearray(4096)
    with await a.create_readable(nc.Descriptor(src)) as readable:
        with await b.begin_read(readable.metadata(), nc.Descriptor(memoryview(dst))) as op:
            await waited(op.wait_for_completion(timeout=10))
        await waited(readable.wait_for_completion(timeout=10))
    assert bytes(dst) == src.tobytes()
    ro = nc.Descriptor(memoryview(bytearray(8)).toreadonly())
    assert ro.size == 8 and ro.ptr != 0


def test_strided_memory_is_refused(nc):
    grid = np.zeros((4, 4), dtype=np.float64)
    with pytest.raises(ValueError):
        nc.Descriptor((grid[:, :2], "cpu"))
    with pytest.raises(ValueError):
        nc.Descriptor(memoryview(bytearray(16))[::2])
    f = np.asfortranarray(np.zeros((4, 3), dtype=np.float32))  # one dense block: accepted
    d = nc.Descriptor((f, "cpu"))
    assert d.size == f.nbytes and d.ptr == f.__array_interface__["data"][0]


async def test_bytearray_is_pinned_while_in_use(nc):
    a = nc.Connector()
    buf = bytearray(64)
    with await a.create_readable(nc.Descriptor(buf)):
        with pytest.raises(BufferError):
            buf.extend(b"more")  # the memory cannot move under a transfer
    assert len(buf) == 64


async def test_resized_buffer_is_refused(nc):
    a = nc.Connector()
    buf = bytearray(64)
    d = nc.Descriptor(buf)
    buf.extend(bytes(1 << 16))  # reallocates: d's pointer is stale
    with pytest.raises(ValueError):
        await a.create_readable(d)
    assert not d.is_registered


async def test_descriptor_shared_by_two_operations(nc):
    """Stays registered until the last operation using it ends (Dynamo: until the first)."""
    a = nc.Connector()
    d = nc.Descriptor(bytearray(64))
    first = await a.create_readable(d)
    second = await a.create_readable(d)
    first.__exit__(None, None, None)
    assert d.is_registered
    second.__exit__(None, None, None)
    assert not d.is_registered


def test_tensor_is_duck_typed(nc):
    """Without torch, an object shaped like a tensor is described like one."""
    backing = np.arange(16, dtype=np.float32)

    class Dev:
        type = "cpu"
        index = None

    class FakeTensor:
        device = Dev()

        def data_ptr(self):
            return backing.__array_interface__["data"][0]

        def numel(self):
            return 16

        def element_size(self):
            return 4

        def is_contiguous(self):
            return True

    t = FakeTensor()
    d = nc.Descriptor(t)
    assert (d.ptr, d.size, str(d.device)) == (backing.__array_interface__["data"][0], 64, "cpu")
    Dev.type, Dev.index = "cuda", 1
    assert str(nc.Descriptor(FakeTensor()).device) == "cuda:1"


# A second result set on an asyncio future (an InvalidStateError inside the loop's reader callback)
# reaches sys.unraisablehook or the loop's exception handler: either fails the test.
@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
async def test_exposures_and_small_reads_resolve_once_whichever_way(nc):
    """An exposure, or the wait of a small read, that the engine answers while the caller waits at
    the call resolves there; one answered later resolves through the loop. Either way each
    resolves once, with its own memory: a task run during the wait stays queued for the loop,
    whose later run must not resolve it again (the loop's exception handler would hear of it)."""
    loop = asyncio.get_running_loop()
    heard = []
    loop.set_exception_handler(lambda _loop, context: heard.append(context))
    a, b = nc.Connector(), nc.Connector()
    core_a = (await a._create_connection())._core
    core_b = (await b._create_connection())._core
    at_call = {"exposure": 0, "wait": 0}
    try:
        for i in range(300):
            src = bytearray(pattern(4096, i))  # fresh memory every time
            dst = bytearray(4096)
            pending = core_a.create_readable([nc.Descriptor(src)._core_desc()])
            at_call["exposure"] += pending.done()
            readable = await pending
            op = await core_b.begin_read(readable.metadata_json(), [nc.Descriptor(dst)._core_desc()])
            pending = op.wait(30.0)
            at_call["wait"] += pending.done()
            await waited(pending)
            await waited(readable.wait(30.0))
            readable.release()
            op.release()
            assert dst == src, f"exposure {i} moved other bytes"
        await asyncio.sleep(0.01)  # the loop's last drains run
    finally:
        loop.set_exception_handler(None)
    assert not heard, heard[:3]
    # Which way each went depends on the machine's load: reported, not asserted.
    print(f"resolved at the call, of 300: {at_call}")


async def test_core_now_returns_the_outcome_or_an_awaitable(nc):
    """With `now=True` a core call returns what is known at the call (the operation, None for a
    finished wait, its error raised there), and an awaitable only for what is still pending: the
    layer awaits only those. Each way gives the outcome the awaitable form gives."""
    core = sys.modules[nc.__name__ + "._core"]
    a, b = nc.Connector(), nc.Connector()
    core_a = (await a._create_connection())._core
    core_b = (await b._create_connection())._core
    ways = {"exposure": [0, 0], "begin": [0, 0], "read wait": [0, 0], "readable wait": [0, 0]}

    async def outcome(name, got, kind):
        at_call = got is None or isinstance(got, kind)
        ways[name][0 if at_call else 1] += 1
        return got if at_call else await waited(got)

    for i in range(200):
        src = bytearray(pattern(4096, i))
        dst = bytearray(4096)
        readable = await outcome("exposure", core_a.create_readable([nc.Descriptor(src)._core_desc()], True),
                                 core.Passive)
        assert isinstance(readable, core.Passive)
        op = await outcome("begin", core_b.begin_read(readable.metadata_json(),
                                                      [nc.Descriptor(dst)._core_desc()], True), core.Active)
        assert isinstance(op, core.Active)
        assert await outcome("read wait", op.wait(30.0, True), type(None)) is None
        assert await outcome("readable wait", readable.wait(30.0, True), type(None)) is None
        assert dst == src, f"operation {i} moved other bytes"
        readable.release()
        op.release()
    # An outcome known at the call that is an error is raised there, not handed over as a future.
    with pytest.raises(core.CoreError) as e:
        op.wait(1.0, True)
    assert e.value.args[0] == "Cancelled"
    readable = await waited(core_a.create_readable([nc.Descriptor(bytearray(4096))._core_desc()]))
    try:
        got = None
        with pytest.raises(core.CoreError) as e:
            got = core_b.begin_read(readable.metadata_json(), [nc.Descriptor(bytearray(100))._core_desc()], True)
            await waited(got)  # only if the refusal came later than the call
        assert e.value.args[0] == "DescriptorMismatch", e.value.args
    finally:
        readable.release()
    # Which way each went depends on the machine's load: reported, not asserted.
    print(f"(at the call, pending) of 200: {ways}")


def _bent(md, nc, **change):
    """`md` with fields changed past its model's validators (as a caller's own model could be),
    or as a subclass with a field of its own: of the model (`note`), or of its descriptor's
    (`subclass="descriptor"`)."""
    sd = md.descriptors[0]
    fields = dict(device=sd.device, ptr=sd.ptr, size=sd.size)
    for k in ("device", "ptr", "size"):
        if k in change:
            fields[k] = change.pop(k)
    descriptor_model = nc.SerializedDescriptor
    if change.pop("subclass", None) == "descriptor":
        class Noted(nc.SerializedDescriptor):
            note: str = "mine"
        descriptor_model = Noted
    descriptors = change.pop("descriptors", [descriptor_model.model_construct(**fields)])
    if "note" in change:  # the metadata model's own subclass
        class NotedMetadata(type(md)):
            note: str = "mine"
        return NotedMetadata.model_construct(**dict(md.__dict__, descriptors=descriptors, **change))
    return md.model_copy(update=dict(descriptors=descriptors, **change))


@pytest.mark.filterwarnings("ignore::UserWarning")  # pydantic's serializer warns of bent fields
@pytest.mark.parametrize("change", [
    {}, {"ptr": 0}, {"ptr": -5}, {"ptr": 2**70}, {"size": -1}, {"size": 2**64}, {"device": "cuda:x"},
    {"device": "tpu"}, {"device": " CPU "}, {"operation_kind": 9}, {"operation_kind": 2},
    {"operation_kind": 300}, {"nixl_metadata": ""}, {"nixl_metadata": "b64:!!"},
    {"notification_key": ""}, {"descriptors": []}, {"ptr": True}, {"size": True},
    {"operation_kind": True}, {"note": "mine"}, {"subclass": "descriptor"},
], ids=lambda c: ",".join(f"{k}={v!r}" for k, v in c.items()) or "unchanged")
async def test_core_reads_metadata_models_as_their_json(nc, change):
    """The layer hands the core the peer's `RdmaMetadata` model itself, whose fields the core
    reads (no JSON per operation): a model that breaks any rule is refused exactly as its JSON is
    (the same kind and message), and one that keeps them reads the same memory. That includes
    values pydantic's JSON writes otherwise than an integer reads (a bool) and models with fields
    of their own (their JSON has a key the wire format refuses)."""
    core = sys.modules[nc.__name__ + "._core"]
    a, b = nc.Connector(), nc.Connector()
    core_b = (await b._create_connection())._core
    results = []
    for as_json in (False, True):
        src = bytearray(pattern(4096, len(results)))
        dst = bytearray(4096)
        with await a.create_readable(nc.Descriptor(src)) as readable:
            real = readable.metadata()
            md = _bent(real, nc, **change)
            given = md.model_dump_json() if as_json else md

            def said(e):  # what differs between the two readables is not what is compared
                text = e.args[1].replace(real.notification_key, "<key>")
                text = re.sub(r" at line \d+ column \d+", "", text)  # the metadata's length varies
                return ("refused", e.args[0], text.replace(str(real.descriptors[0].ptr), "<ptr>"))

            try:
                op = core_b.begin_read(given, [nc.Descriptor(dst)._core_desc()], True)
                if not isinstance(op, core.Active):
                    op = await waited(op)
            except core.CoreError as e:
                results.append(said(e))
                continue
            try:
                await waited(op.wait(30.0))
                results.append(("read", dst == src))
            except core.CoreError as e:
                results.append(said(e))
            finally:
                op.release()
    assert results[0] == results[1], results
    # pydantic writes True in an int field as 1, and a descriptor as its declared model's fields.
    if change in ({}, {"device": " CPU "}, {"operation_kind": True}, {"subclass": "descriptor"}):
        assert results[0] == ("read", True), results
    else:
        assert results[0][0] == "refused", results


async def test_core_refuses_metadata_that_is_neither_json_nor_a_model(nc):
    """Anything else given as the peer's metadata is a TypeError naming what is wanted."""
    b = nc.Connector()
    core_b = (await b._create_connection())._core
    for given in (42, None, b"{}", {"descriptors": []}):
        with pytest.raises(TypeError, match="RdmaMetadata"):
            core_b.begin_read(given, [nc.Descriptor(bytearray(16))._core_desc()], True)


def test_each_loop_of_a_thread_gets_its_own_completions(nc):
    """The core remembers each thread's last event loop to find its completions quickly: a loop
    that ends and a new one on the same thread (asyncio, then uvloop, and back), with the same
    connectors, each get their own, so a wait that is pending (a reader that comes 50 ms later)
    is woken through the loop that awaits it. A stale entry would wake a closed loop: a hang."""
    import threading

    a, b = nc.Connector(), nc.Connector()
    done, failures = [], []

    async def late_reader(i):
        src, dst = bytearray(pattern(4096, i)), bytearray(4096)
        with await a.create_readable(nc.Descriptor(src)) as readable:
            async def read():
                await asyncio.sleep(0.05)
                with await b.begin_read(readable.metadata(), nc.Descriptor(dst)) as op:
                    await op.wait_for_completion()
            reader = asyncio.ensure_future(read())
            await asyncio.wait_for(readable.wait_for_completion(), 10)
            await asyncio.wait_for(reader, 10)
        assert dst == src, f"loop {i} moved other bytes"
        done.append(i)

    def loops():
        try:
            import uvloop
        except ImportError:
            uvloop = None
        kept = []  # ended loops stay alive (closed), so a stale entry would still point at one
        try:
            for i in range(6):
                loop = (uvloop.new_event_loop() if i % 2 and uvloop is not None
                        else asyncio.new_event_loop())
                kept.append(loop)
                asyncio.set_event_loop(loop)
                try:
                    loop.run_until_complete(late_reader(i))
                finally:
                    loop.close()
        except BaseException as e:  # noqa: BLE001 - reported by the test's thread
            failures.append(e)
        finally:
            asyncio.set_event_loop(None)

    threads = [threading.Thread(target=loops) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a loop hung"
    assert not failures, failures
    assert sorted(done) == sorted(list(range(6)) * 2)


# --------------------------------------------------------------------------- waits that stay awake

WAIT_SPIN_CODE = r"""
import asyncio, sys
import {module} as nc

async def main():
    a, b = nc.Connector(), nc.Connector()
    src, dst = bytearray(range(256)) * 16, bytearray(4096)
    for _ in range(20):
        with await a.create_readable(nc.Descriptor(src)) as r:
            with await b.begin_read(r.metadata(), nc.Descriptor(dst)) as op:
                await asyncio.gather(op.wait_for_completion(), r.wait_for_completion())
        assert dst == src
    # A readable nobody reads: its wait spins, then parks, then times out as without a spin.
    with await a.create_readable(nc.Descriptor(src)) as r:
        try:
            await r.wait_for_completion(timeout=0.05)
        except TimeoutError:
            print("timed out")

try:
    asyncio.run(main())
except nc.InvalidArgumentError as e:
    print("refused:", e)
"""


@pytest.mark.parametrize("value, says", [("300", "timed out"), ("lots", "refused: "),
                                         ("20000", "refused: ")])
def test_wait_spin_env_is_honoured_or_refused(nc, value, says):
    """NIXL_CONNECT_WAIT_SPIN_US keeps waits awake (reads still move the bytes, a wait's timeout
    still ends it), and a value that is not microseconds up to 10,000 is refused when the
    connection is made, as InvalidArgumentError naming the variable."""
    env = dict(os.environ, NIXL_CONNECT_WAIT_SPIN_US=value)
    r = subprocess.run([sys.executable, "-c", WAIT_SPIN_CODE.replace("{module}", nc.__name__)],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert says in r.stdout, (r.stdout, r.stderr[-2000:])
    if says.startswith("refused"):
        assert "wait spin" in r.stdout or "NIXL_CONNECT_WAIT_SPIN_US" in r.stdout, r.stdout


@pytest.mark.parametrize("value, want", [(None, 0), ("", 0), ("  ", 0), ("0", 0), ("300", 300)])
def test_wait_spin_is_off_unless_the_env_sets_it(nc, value, want):
    """Python waits do not take the Rust default spin: 0 unless NIXL_CONNECT_WAIT_SPIN_US is set to
    something other than blanks, then what it says (read from the connection the core made)."""
    env = dict(os.environ)
    env.pop("NIXL_CONNECT_WAIT_SPIN_US", None)
    if value is not None:
        env["NIXL_CONNECT_WAIT_SPIN_US"] = value
    code = (f"import asyncio, {nc.__name__} as nc\n"
            "async def main():\n"
            "    c = await nc.Connector()._create_connection()\n"
            "    print('spin', c._core.wait_spin_us)\n"
            "asyncio.run(main())\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"spin {want}" in r.stdout, (r.stdout, r.stderr[-2000:])
