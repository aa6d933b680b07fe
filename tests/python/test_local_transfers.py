"""Round trips inside one process: two Connectors (two NIXL agents) of the same module.

(A Connector cannot read from itself in Dynamo: NIXL refuses to load an agent's own metadata.)
"""
import asyncio
import base64
import zlib

import pytest

import nc_common
from conftest import is_dynamo, waited
from nc_common import SHAPES, UNEQUAL_SIZES, pattern, patterns


# Descriptor(bytearray) for every shape, Descriptor((ndarray, "cpu")) for the small ones.
SHAPE_STYLES = [(s, "bytearray") for s in SHAPES] + [("4KiB", "numpy"), ("8unequal", "numpy")]


def _bufs_equal(a, b):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert len(x) == len(y), f"descriptor {i}: size {len(x)} != {len(y)}"
        assert bytes(x) == bytes(y), f"descriptor {i}: bytes differ"


@pytest.mark.parametrize("shape,style", SHAPE_STYLES)
async def test_read_round_trip(nc, shape, style):
    sizes = SHAPES[shape]
    a, b = nc.Connector(), nc.Connector()
    src = patterns(sizes, seed=11)
    dst = [bytearray(s) for s in sizes]
    with await a.create_readable(nc_common.descriptors(nc, src, style)) as readable:
        md = readable.metadata()
        assert md.operation_kind == int(nc.OperationKind.READ) == 1
        assert [d.size for d in md.descriptors] == sizes
        with await b.begin_read(md, nc_common.descriptors(nc, dst, style)) as read_op:
            await waited(asyncio.gather(read_op.wait_for_completion(),
                                        readable.wait_for_completion()))
            assert read_op.status == nc.OperationStatus.COMPLETE
        assert readable.status == nc.OperationStatus.COMPLETE
    _bufs_equal(src, dst)


@pytest.mark.parametrize("shape,style", SHAPE_STYLES)
async def test_write_round_trip(nc, shape, style):
    sizes = SHAPES[shape]
    a, b = nc.Connector(), nc.Connector()
    src = patterns(sizes, seed=12)
    dst = [bytearray(s) for s in sizes]
    with await a.create_writable(nc_common.descriptors(nc, dst, style)) as writable:
        md = writable.metadata()
        assert md.operation_kind == int(nc.OperationKind.WRITE) == 2
        with await b.begin_write(nc_common.descriptors(nc, src, style), md) as write_op:
            await waited(asyncio.gather(write_op.wait_for_completion(),
                                        writable.wait_for_completion()))
            assert write_op.status == nc.OperationStatus.COMPLETE
        assert writable.status == nc.OperationStatus.COMPLETE
    _bufs_equal(src, dst)


async def test_expose_then_await_with_model_dump(nc):
    """The Dynamo worker pattern: metadata shipped as a dict (model_dump) and re-validated."""
    a, b = nc.Connector(), nc.Connector()
    src = pattern(4096, 21)
    readable = await a.create_readable(nc.Descriptor(src))
    wire = readable.metadata().model_dump()          # what goes into a request/response dict
    assert isinstance(wire, dict) and set(wire) == {
        "descriptors", "nixl_metadata", "notification_key", "operation_kind"}
    remote = nc.RdmaMetadata.model_validate(wire)    # the other worker
    dst = bytearray(4096)

    async def reader():
        with await b.begin_read(remote, nc.Descriptor(dst)) as op:
            await op.wait_for_completion()

    task = asyncio.create_task(reader())
    await waited(readable.wait_for_completion())     # the exposing side awaits its peer
    await waited(task)
    readable.__exit__(None, None, None)
    assert dst == src


async def test_model_validate_json_then_begin_read(nc):
    a, b = nc.Connector(), nc.Connector()
    src = pattern(8192, 22)
    with await a.create_readable(nc.Descriptor(src)) as readable:
        text = readable.metadata().model_dump_json()
        md = nc.RdmaMetadata.model_validate_json(text)
        dst = bytearray(8192)
        read_op = await b.begin_read(md, nc.Descriptor(dst))
        with read_op:
            await waited(read_op.wait_for_completion())
            results = read_op.results()
        await waited(readable.wait_for_completion())
    assert dst == src
    # results(): always a list of the local Descriptors (even for one), only once COMPLETE
    assert isinstance(results, list) and len(results) == 1
    assert isinstance(results[0], nc.Descriptor) and results[0].size == 8192


async def test_results_lists_every_descriptor(nc):
    a, b = nc.Connector(), nc.Connector()
    src = patterns(UNEQUAL_SIZES, 23)
    dst = [bytearray(s) for s in UNEQUAL_SIZES]
    with await a.create_readable(nc_common.descriptors(nc, src)) as readable:
        dds = nc_common.descriptors(nc, dst)
        with await b.begin_read(readable.metadata(), dds) as op:
            with pytest.raises(RuntimeError):
                op.results()  # not complete yet (nothing has even polled the status)
            await waited(op.wait_for_completion())
            res = op.results()
        await waited(readable.wait_for_completion())
    assert [d.size for d in res] == UNEQUAL_SIZES
    assert [d.ptr for d in res] == [d.ptr for d in dds]
    _bufs_equal(src, dst)


async def test_hand_built_metadata(nc):
    """RdmaMetadata assembled by hand from SerializedDescriptors plus a real agent blob and key."""
    a, b = nc.Connector(), nc.Connector()
    src = patterns([4096, 777], 24)
    with await a.create_readable(nc_common.descriptors(nc, src)) as readable:
        real = readable.metadata()
        sds = [nc.SerializedDescriptor(device="cpu", ptr=d.ptr, size=d.size) for d in
               nc_common.descriptors(nc, src)]
        md = nc.RdmaMetadata(descriptors=sds, nixl_metadata=real.nixl_metadata,
                             notification_key=real.notification_key, operation_kind=1)
        assert md.model_dump_json() == real.model_dump_json()
        dst = [bytearray(4096), bytearray(777)]
        with await b.begin_read(md, nc_common.descriptors(nc, dst)) as op:
            await waited(op.wait_for_completion())
        await waited(readable.wait_for_completion())
    _bufs_equal(src, dst)


async def test_hand_built_subset_and_subrange(nc):
    """Hand-built metadata naming one of the exposed descriptors, or a sub-range of one."""
    a, b = nc.Connector(), nc.Connector()
    src = patterns(UNEQUAL_SIZES, 25)
    with await a.create_readable(nc_common.descriptors(nc, src)) as readable:
        real = readable.metadata()
        s7 = real.descriptors[7]
        sub = nc.RdmaMetadata(
            descriptors=[nc.SerializedDescriptor(device="cpu", ptr=s7.ptr + 100, size=1000)],
            nixl_metadata=real.nixl_metadata, notification_key=real.notification_key, operation_kind=1)
        dr = bytearray(1000)
        with await b.begin_read(sub, nc.Descriptor(dr)) as op:
            await waited(op.wait_for_completion())
        assert dr == src[7][100:1100]
        await waited(readable.wait_for_completion())  # the read carried its key
    with await a.create_readable(nc_common.descriptors(nc, src)) as readable:
        real = readable.metadata()
        one = nc.RdmaMetadata(descriptors=[real.descriptors[3]], nixl_metadata=real.nixl_metadata,
                              notification_key=real.notification_key, operation_kind=1)
        d3 = bytearray(UNEQUAL_SIZES[3])
        with await b.begin_read(one, nc.Descriptor(d3)) as op:
            await waited(op.wait_for_completion())
        assert d3 == src[3]
        await waited(readable.wait_for_completion())


async def test_access_after_completion_or_with_another_key(nc):
    """Dynamo lets the same metadata read a readable again after its read completed, or with a key
    of the reader's own choosing. nixl_connect scopes access to one live operation (replays are
    refused where the transport allows: here, two connectors of one host): a deliberate
    difference, documented in the package."""
    a, b = nc.Connector(), nc.Connector()
    src = pattern(4096, 26)
    with await a.create_readable(nc.Descriptor(src)) as readable:
        md = readable.metadata()
        dst = bytearray(4096)
        with await b.begin_read(md, nc.Descriptor(dst)) as op:
            await waited(op.wait_for_completion())
        assert dst == src
        await waited(readable.wait_for_completion())
        other_key = nc.RdmaMetadata(descriptors=md.descriptors, nixl_metadata=md.nixl_metadata,
                                    notification_key="my-own-key", operation_kind=1)
        for again in (md, other_key):
            dst = bytearray(4096)
            if is_dynamo(nc):
                with await b.begin_read(again, nc.Descriptor(dst)) as op:
                    await waited(op.wait_for_completion())
                assert dst == src
            else:
                with pytest.raises(nc.RefusedError) as e:
                    with await b.begin_read(again, nc.Descriptor(dst)) as op:
                        await waited(op.wait_for_completion())
                assert isinstance(e.value, RuntimeError) and e.value.kind == "Refused"
                assert dst == bytearray(4096), "nothing was copied"


async def test_metadata_encoding(nc):
    """nixl_metadata is "b64:" + base64(zlib(agent metadata)); hex_encode=True gives bare hex."""
    a = nc.Connector()
    readable = await a.create_readable(nc.Descriptor(bytearray(64)))
    md = readable.metadata()
    assert md.nixl_metadata.startswith("b64:")
    blob = zlib.decompress(base64.b64decode(md.nixl_metadata[4:]))
    assert len(blob) > 0
    assert a.name.encode() in blob  # the NIXL agent is named "<worker_id>-1"
    # Dynamo computes metadata() once and caches it (a later hex_encode=True returns the b64 one);
    # only require that a second call describes the same operation.
    again = readable.metadata(hex_encode=True)
    assert again.notification_key == md.notification_key and again.descriptors == md.descriptors
    # notification keys are uuid4 strings, distinct per operation
    assert len(md.notification_key) == 36 and md.notification_key.count("-") == 4
    other = await a.create_readable(nc.Descriptor(bytearray(64)))
    assert other.metadata().notification_key != md.notification_key
    readable.__exit__(None, None, None)
    other.__exit__(None, None, None)

    w = await a.create_writable(nc.Descriptor(bytearray(64)))
    hx = w.metadata(hex_encode=True)
    assert not hx.nixl_metadata.startswith("b64:")
    assert a.name.encode() in zlib.decompress(bytes.fromhex(hx.nixl_metadata))
    assert hx.operation_kind == 2
    w.__exit__(None, None, None)


async def test_hex_encoded_metadata_is_usable(nc):
    a, b = nc.Connector(), nc.Connector()
    dst = bytearray(32)
    with await a.create_writable(nc.Descriptor(dst)) as writable:
        md = nc.RdmaMetadata.model_validate_json(writable.metadata(hex_encode=True).model_dump_json())
        with await b.begin_write(nc.Descriptor(b"0123456789abcdef0123456789abcdef"), md) as op:
            await waited(op.wait_for_completion())
        await waited(writable.wait_for_completion())
    assert dst == b"0123456789abcdef0123456789abcdef"


async def test_status_progression(nc):
    a, b = nc.Connector(), nc.Connector()
    S = nc.OperationStatus
    src = pattern(4096, 27)
    with await a.create_readable(nc.Descriptor(src)) as readable:
        assert readable.status == S.INITIALIZED       # passive: INIT until the notification
        dst = bytearray(4096)
        with await b.begin_read(readable.metadata(), nc.Descriptor(dst)) as op:
            assert op.status in (S.INITIALIZED, S.IN_PROGRESS, S.COMPLETE)
            await waited(op.wait_for_completion())
            assert op.status == S.COMPLETE
            assert op.operation_kind == nc.OperationKind.READ
        await waited(readable.wait_for_completion())
        assert readable.status == S.COMPLETE
        assert readable.operation_kind == nc.OperationKind.READ


async def test_registration_follows_the_operation(nc):
    """Descriptors are registered while an operation holds them and deregistered on exit."""
    a = nc.Connector()
    d = nc.Descriptor(bytearray(64))
    assert not d.is_registered
    with await a.create_readable(d):
        assert d.is_registered
    assert not d.is_registered
    with await a.create_writable(d):  # reusable after release
        assert d.is_registered
    assert not d.is_registered


async def test_many_sequential_operations(nc):
    """A handful of round trips on the same two Connectors (shared NIXL agent per Connector)."""
    a, b = nc.Connector(), nc.Connector()
    for i in range(4):
        src = pattern(1024 + i, 30 + i)
        dst = bytearray(len(src))
        with await a.create_readable(nc.Descriptor(src)) as readable:
            with await b.begin_read(readable.metadata(), nc.Descriptor(dst)) as op:
                await waited(op.wait_for_completion())
            await waited(readable.wait_for_completion())
        assert dst == src


async def test_concurrent_operations(nc):
    """Several readables of one Connector read concurrently by another (gathered)."""
    a, b = nc.Connector(), nc.Connector()
    srcs = [pattern(4096 * (i + 1), 40 + i) for i in range(3)]
    dsts = [bytearray(len(s)) for s in srcs]
    readables = [await a.create_readable(nc.Descriptor(s)) for s in srcs]
    ops = [await b.begin_read(r.metadata(), nc.Descriptor(d)) for r, d in zip(readables, dsts)]
    await waited(asyncio.gather(*(o.wait_for_completion() for o in ops),
                                *(r.wait_for_completion() for r in readables)))
    for o in ops + readables:
        o.__exit__(None, None, None)
    for s, d in zip(srcs, dsts):
        assert s == d


async def test_keyword_arguments(nc):
    """Dynamo's parameter names: remote_metadata, local_descriptors (and Descriptor(data=...))."""
    a, b = nc.Connector(worker_id="kw-a"), nc.Connector(worker_id="kw-b")
    src = pattern(256, 28)
    dst = bytearray(256)
    with await a.create_readable(local_descriptors=nc.Descriptor(data=src)) as readable:
        with await b.begin_read(remote_metadata=readable.metadata(hex_encode=False),
                                local_descriptors=nc.Descriptor(data=dst)) as op:
            await waited(op.wait_for_completion())
        await waited(readable.wait_for_completion())
    assert dst == src
    back = bytearray(256)
    with await a.create_writable(local_descriptors=nc.Descriptor(back)) as writable:
        with await b.begin_write(local_descriptors=nc.Descriptor(src),
                                 remote_metadata=writable.metadata()) as op:
            await waited(op.wait_for_completion())
        await waited(writable.wait_for_completion())
    assert back == src


def test_round_trips_on_uvloop(nc):
    """Dynamo runs its workers on uvloop: reads, writes, a wait that times out and a cancelled
    wait, each on a uvloop loop (the module's completions arrive through the loop's readers)."""
    import uvloop

    async def main():
        a, b = nc.Connector(), nc.Connector()
        for i in range(20):
            src, dst = pattern(4096 + i, seed=i), bytearray(4096 + i)
            with await a.create_readable(nc.Descriptor(src)) as readable:
                with await b.begin_read(readable.metadata(), nc.Descriptor(dst)) as read_op:
                    await waited(asyncio.gather(read_op.wait_for_completion(),
                                                readable.wait_for_completion()))
            assert bytes(dst) == bytes(src)
            src, dst = pattern(8192, seed=100 + i), bytearray(8192)
            with await a.create_writable(nc.Descriptor(dst)) as writable:
                with await b.begin_write(nc.Descriptor(src), writable.metadata()) as write_op:
                    await waited(asyncio.gather(write_op.wait_for_completion(),
                                                writable.wait_for_completion()))
            assert bytes(dst) == bytes(src)
        # Nobody reads this one: a bounded wait times out, a cancelled one ends quietly.
        with await a.create_readable(nc.Descriptor(pattern(4096, seed=7))) as lonely:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(lonely.wait_for_completion(), 0.05)
            task = asyncio.ensure_future(lonely.wait_for_completion())
            await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        return type(asyncio.get_running_loop()).__module__

    assert uvloop.run(main()).startswith("uvloop")
