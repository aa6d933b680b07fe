"""Buffer lifetimes, cancellation, timeouts and cleanup."""
import asyncio
import gc
import weakref

import numpy as np
import pytest

from conftest import waited
from nc_common import MIB, pattern


# --------------------------------------------------------------------------- buffers kept alive

async def test_passive_buffer_dropped_by_user(nc):
    """The only reference to the exposed bytearray is the Descriptor inside the operation."""
    a, b = nc.Connector(), nc.Connector()
    expected = bytes(pattern(1 * MIB, 61))
    readable = await a.create_readable(nc.Descriptor(bytearray(expected)))
    gc.collect()
    # churn the allocator so freed memory would be reused and overwritten
    junk = [bytearray(b"\xee" * MIB) for _ in range(8)]
    dst = bytearray(MIB)
    with await b.begin_read(readable.metadata(), nc.Descriptor(dst)) as op:
        await waited(op.wait_for_completion())
    await waited(readable.wait_for_completion())
    readable.__exit__(None, None, None)
    del junk
    assert bytes(dst) == expected


async def test_active_destination_dropped_by_user(nc):
    """A numpy destination with no user reference left stays alive until the read is done."""
    a, b = nc.Connector(), nc.Connector()
    src = pattern(1 * MIB, 62)
    with await a.create_readable(nc.Descriptor(src)) as readable:
        arr = np.zeros(MIB, dtype=np.uint8)
        ref = weakref.ref(arr)
        desc = nc.Descriptor((arr, "cpu"))
        del arr
        gc.collect()
        assert ref() is not None, "Descriptor must keep its ndarray alive"
        op = await b.begin_read(readable.metadata(), desc)
        del desc
        gc.collect()
        assert ref() is not None, "the operation must keep its Descriptors (and arrays) alive"
        with op:
            await waited(op.wait_for_completion())
            got = ref()
            assert got is not None
            assert got.tobytes() == bytes(src)
        await waited(readable.wait_for_completion())


async def test_active_source_dropped_by_user(nc):
    a, b = nc.Connector(), nc.Connector()
    expected = bytes(pattern(MIB, 63))
    dst = bytearray(MIB)
    with await a.create_writable(nc.Descriptor(dst)) as writable:
        op = await b.begin_write(nc.Descriptor(bytes(expected)), writable.metadata())
        gc.collect()
        junk = [bytearray(b"\x11" * MIB) for _ in range(8)]
        with op:
            await waited(op.wait_for_completion())
        await waited(writable.wait_for_completion())
        del junk
    assert bytes(dst) == expected


async def test_pointer_tuple_keeps_its_reference(nc):
    """Descriptor((ptr, size, device, ref)) holds `ref`, so the memory behind ptr stays valid."""
    a, b = nc.Connector(), nc.Connector()
    arr = np.frombuffer(bytes(pattern(4096, 64)), dtype=np.uint8).copy()
    expected = arr.tobytes()
    ref = weakref.ref(arr)
    desc = nc.Descriptor((arr.__array_interface__["data"][0], arr.nbytes, "cpu", arr))
    del arr
    gc.collect()
    assert ref() is not None
    with await a.create_readable(desc) as readable:
        del desc
        gc.collect()
        dst = bytearray(4096)
        with await b.begin_read(readable.metadata(), nc.Descriptor(dst)) as op:
            await waited(op.wait_for_completion())
        await waited(readable.wait_for_completion())
    assert bytes(dst) == expected


async def test_dropping_an_unfinished_passive_operation(nc):
    """Releasing a readable nobody read (exit, then drop) must not crash or hang."""
    a = nc.Connector()
    d = nc.Descriptor(bytearray(4096))
    op = await a.create_readable(d)
    _ = op.metadata()
    op.__exit__(None, None, None)
    assert not d.is_registered
    del op
    gc.collect()
    op2 = await a.create_writable(nc.Descriptor(bytearray(16)))
    del op2  # never exited: garbage collection releases it
    gc.collect()


# --------------------------------------------------------------------------- timeouts and cancellation

async def test_wait_for_with_timeout_then_cleanup(nc):
    """asyncio.wait_for around a wait nobody completes: TimeoutError, then the with-block cleans up."""
    a = nc.Connector()
    d = nc.Descriptor(bytearray(4096))
    with pytest.raises(asyncio.TimeoutError):
        with await a.create_readable(d) as op:
            assert d.is_registered
            await asyncio.wait_for(op.wait_for_completion(), timeout=0.3)
    assert not d.is_registered
    assert op.status == nc.OperationStatus.INITIALIZED  # a timeout is not a state change


async def test_wait_for_timeout_does_not_spoil_the_operation(nc):
    """After a timed-out wait the passive operation is still live: a late read completes it."""
    a, b = nc.Connector(), nc.Connector()
    src = pattern(4096, 65)
    with await a.create_readable(nc.Descriptor(src)) as readable:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(readable.wait_for_completion(), 0.2)
        dst = bytearray(4096)
        with await b.begin_read(readable.metadata(), nc.Descriptor(dst)) as op:
            await waited(op.wait_for_completion())
        await waited(readable.wait_for_completion())
    assert dst == src


async def test_task_cancellation_mid_wait_passive(nc):
    a, b = nc.Connector(), nc.Connector()
    src = pattern(4096, 66)
    with await a.create_readable(nc.Descriptor(src)) as readable:
        task = asyncio.create_task(readable.wait_for_completion())
        await asyncio.sleep(0.05)
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # the operation survives its waiter's cancellation
        dst = bytearray(4096)
        with await b.begin_read(readable.metadata(), nc.Descriptor(dst)) as op:
            await waited(op.wait_for_completion())
        await waited(readable.wait_for_completion())
        assert readable.status == nc.OperationStatus.COMPLETE
    assert dst == src


async def test_task_cancellation_mid_wait_active(nc):
    """Cancel the task waiting on a large read, then leave the with-block: no crash, no hang."""
    a, b = nc.Connector(), nc.Connector()
    src = bytearray(64 * MIB)
    with await a.create_readable(nc.Descriptor(src)) as readable:
        dst = bytearray(64 * MIB)
        with await b.begin_read(readable.metadata(), nc.Descriptor(dst)) as op:
            task = asyncio.create_task(op.wait_for_completion())
            await asyncio.sleep(0)
            task.cancel()
            try:
                await task  # CancelledError, unless the transfer finished on its first poll
            except asyncio.CancelledError:
                pass
        assert op.status in (nc.OperationStatus.CANCELLED, nc.OperationStatus.COMPLETE)
        # wait_for_completion returns (does not raise) once the operation is CANCELLED or COMPLETE
        await waited(op.wait_for_completion(), 5)


async def test_cancel_active_operation(nc):
    a, b = nc.Connector(), nc.Connector()
    S = nc.OperationStatus
    with await a.create_readable(nc.Descriptor(pattern(4096, 67))) as readable:
        op = await b.begin_read(readable.metadata(), nc.Descriptor(bytearray(4096)))
        op.cancel()
        assert op.status in (S.CANCELLED, S.COMPLETE)
        op.cancel()  # idempotent
        await waited(op.wait_for_completion(), 5)  # returns: CANCELLED counts as finished
        if op.status == S.CANCELLED:
            with pytest.raises(RuntimeError):
                op.results()
        op.__exit__(None, None, None)


async def test_cancel_after_completion_is_a_noop(nc):
    a, b = nc.Connector(), nc.Connector()
    dst = bytearray(64)
    with await a.create_writable(nc.Descriptor(dst)) as writable:
        with await b.begin_write(nc.Descriptor(bytes(range(64))), writable.metadata()) as op:
            await waited(op.wait_for_completion())
            op.cancel()
            # Dynamo's docstring says "no effect", but its code flips COMPLETE to CANCELLED while the
            # transfer handle is still held (inside the with-block); either is accepted here.
            assert op.status in (nc.OperationStatus.COMPLETE, nc.OperationStatus.CANCELLED)
        await waited(writable.wait_for_completion())
    assert dst == bytes(range(64))


async def test_exiting_an_active_context_is_safe(nc):
    """Leaving `with` without waiting: the operation ends CANCELLED or COMPLETE, nothing leaks."""
    a, b = nc.Connector(), nc.Connector()
    with await a.create_readable(nc.Descriptor(bytearray(MIB))) as readable:
        with await b.begin_read(readable.metadata(), nc.Descriptor(bytearray(MIB))) as op:
            pass
        assert op.status in (nc.OperationStatus.CANCELLED, nc.OperationStatus.COMPLETE)


async def test_wait_for_completion_after_passive_exit_does_not_complete(nc):
    """A released passive operation is never completed; a bounded wait times out."""
    a = nc.Connector()
    op = await a.create_writable(nc.Descriptor(bytearray(8)))
    with op:
        pass
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(op.wait_for_completion(), 0.3)


# --------------------------------------------------------------------------- extras (nixl_connect only)

@pytest.mark.extra
async def test_extra_wait_timeout_raises_timeout_error(nc):
    a = nc.Connector()
    with await a.create_readable(nc.Descriptor(bytearray(64))) as op:
        with pytest.raises(TimeoutError):
            await op.wait_for_completion(timeout=0.2)
        assert op.status == nc.OperationStatus.INITIALIZED


@pytest.mark.extra
async def test_extra_wait_timeout_leaves_operation_usable(nc):
    a, b = nc.Connector(), nc.Connector()
    src = pattern(4096, 68)
    with await a.create_readable(nc.Descriptor(src)) as readable:
        with pytest.raises(TimeoutError):
            await readable.wait_for_completion(timeout=0.1)
        dst = bytearray(4096)
        with await b.begin_read(readable.metadata(), nc.Descriptor(dst)) as op:
            await op.wait_for_completion(timeout=10)
        await readable.wait_for_completion(timeout=10)
    assert dst == src


@pytest.mark.extra
async def test_extra_wait_timeout_none_waits(nc):
    a, b = nc.Connector(), nc.Connector()
    dst = bytearray(16)
    with await a.create_writable(nc.Descriptor(dst)) as writable:
        with await b.begin_write(nc.Descriptor(b"0123456789abcdef"), writable.metadata()) as op:
            await waited(op.wait_for_completion(timeout=None))
        await waited(writable.wait_for_completion(timeout=None))
    assert dst == b"0123456789abcdef"


# --------------------------------------------------------------------------- interpreter exit

_EXIT_RIGHT_AFTER = """
import asyncio, sys
import {module} as nc

async def main():
    a, b = nc.Connector(), nc.Connector()
    src = bytearray(b"x" * 100003)
    readable = await a.create_readable(nc.Descriptor(src))
    dst = bytearray(len(src))
    op = await b.begin_read(readable.metadata(), nc.Descriptor(dst))
    await asyncio.wait_for(op.wait_for_completion(), 15)
    await asyncio.wait_for(readable.wait_for_completion(), 15)
    assert dst == src
    # no release: the interpreter finalizes with both operations and connectors alive

asyncio.run(main())
"""


@pytest.mark.extra
async def test_extra_interpreter_exit_right_after_completion_is_clean(nc):
    """Completions once reached Python from a runtime thread that took the GIL while the
    interpreter was finalizing: a crash (SIGSEGV or SIGABRT) in about one exit in seven. No
    thread of the module takes the GIL now; 12 exits must all be clean."""
    import subprocess
    import sys
    code = _EXIT_RIGHT_AFTER.format(module=nc.__name__)
    for i in range(12):
        r = await asyncio.to_thread(subprocess.run, [sys.executable, "-c", code],
                                    capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, f"exit {i} ended with {r.returncode}:\n{r.stderr[-2000:]}"
