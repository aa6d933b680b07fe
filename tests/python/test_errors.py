"""What Dynamo raises on misuse. Each test uses fresh Connectors: a NIXL agent that failed a
registration can leave later metadata unusable (see dynamo_api.md), so no state is shared."""
import asyncio

import pytest

from conftest import waited
from nc_common import pattern


async def _readable(nc, size=4096):
    a = nc.Connector()
    buf = pattern(size, 51)
    op = await a.create_readable(nc.Descriptor(buf))
    return a, buf, op


async def _writable(nc, size=4096):
    a = nc.Connector()
    buf = bytearray(size)
    op = await a.create_writable(nc.Descriptor(buf))
    return a, buf, op


async def test_read_a_writable_raises(nc):
    _, _, w = await _writable(nc)
    b = nc.Connector()
    with pytest.raises(RuntimeError, match="WritableOperation"):
        await b.begin_read(w.metadata(), nc.Descriptor(bytearray(4096)))
    w.__exit__(None, None, None)


async def test_write_a_readable_raises(nc):
    _, _, r = await _readable(nc)
    b = nc.Connector()
    with pytest.raises(RuntimeError, match="ReadableOperation"):
        await b.begin_write(nc.Descriptor(bytearray(4096)), r.metadata())
    r.__exit__(None, None, None)


async def test_pairing_checked_on_hand_built_kind(nc):
    _, _, r = await _readable(nc)
    md = r.metadata()
    as_write = nc.RdmaMetadata(descriptors=md.descriptors, nixl_metadata=md.nixl_metadata,
                               notification_key=md.notification_key, operation_kind=2)
    b = nc.Connector()
    with pytest.raises(RuntimeError):
        await b.begin_read(as_write, nc.Descriptor(bytearray(4096)))
    r.__exit__(None, None, None)


@pytest.mark.parametrize("local_size", [4095, 4097, 1])
async def test_read_size_mismatch_raises(nc, local_size):
    _, _, r = await _readable(nc)
    b = nc.Connector()
    with pytest.raises(ValueError, match="same size"):
        await b.begin_read(r.metadata(), nc.Descriptor(bytearray(local_size)))
    r.__exit__(None, None, None)


async def test_write_size_mismatch_raises(nc):
    _, _, w = await _writable(nc)
    b = nc.Connector()
    with pytest.raises(ValueError, match="same size"):
        await b.begin_write(nc.Descriptor(bytearray(100)), w.metadata())
    w.__exit__(None, None, None)


async def test_list_mismatches_raise(nc):
    a, b = nc.Connector(), nc.Connector()
    bufs = [pattern(s, 52 + i) for i, s in enumerate((10, 20, 30))]
    r = await a.create_readable([nc.Descriptor(x) for x in bufs])
    md = r.metadata()
    with pytest.raises(ValueError, match="same length"):
        await b.begin_read(md, [nc.Descriptor(bytearray(10)), nc.Descriptor(bytearray(50))])
    with pytest.raises(ValueError, match="at 1"):
        await b.begin_read(md, [nc.Descriptor(bytearray(s)) for s in (10, 30, 20)])
    with pytest.raises(ValueError, match="lists or single"):
        await b.begin_read(md, nc.Descriptor(bytearray(60)))
    # still usable after the refused attempts
    dst = [bytearray(s) for s in (10, 20, 30)]
    with await b.begin_read(md, [nc.Descriptor(x) for x in dst]) as op:
        await waited(op.wait_for_completion())
    await waited(r.wait_for_completion())
    r.__exit__(None, None, None)
    assert dst == bufs


async def test_single_element_list_is_a_single_descriptor(nc):
    a, b = nc.Connector(), nc.Connector()
    src = pattern(4096, 53)
    with await a.create_readable(nc.Descriptor(src)) as r:
        dst = bytearray(4096)
        with await b.begin_read(r.metadata(), [nc.Descriptor(dst)]) as op:  # [d] against one remote
            await waited(op.wait_for_completion())
        await waited(r.wait_for_completion())
    assert dst == src


async def test_bad_argument_types(nc):
    _, _, r = await _readable(nc)
    md = r.metadata()
    b = nc.Connector()
    d = nc.Descriptor(bytearray(4096))
    with pytest.raises(TypeError, match="RdmaMetadata"):
        await b.begin_read(md.model_dump(), d)          # a dict is not metadata
    with pytest.raises(TypeError, match="RdmaMetadata"):
        await b.begin_read(md.model_dump_json(), d)     # nor is its JSON
    with pytest.raises(TypeError, match="RdmaMetadata"):
        await b.begin_read(None, d)
    with pytest.raises(TypeError, match="RdmaMetadata"):
        await b.begin_read(d, md)                       # swapped arguments
    with pytest.raises(TypeError, match="RdmaMetadata"):
        await b.begin_write(md, d)                      # swapped arguments
    with pytest.raises(TypeError, match="local_descriptors"):
        await b.begin_read(md, bytearray(4096))         # a buffer, not a Descriptor
    r.__exit__(None, None, None)


async def test_create_passive_bad_arguments(nc):
    a = nc.Connector()
    with pytest.raises(ValueError, match="empty"):
        await a.create_readable([])
    with pytest.raises(ValueError, match="empty"):
        await a.create_writable([])
    with pytest.raises(TypeError):
        await a.create_readable(bytearray(8))
    with pytest.raises(TypeError):
        await a.create_writable(None)
    with pytest.raises(ValueError, match="null pointer"):
        await a.create_readable(nc.Descriptor((0, 8)))


async def test_descriptor_on_two_connectors_raises(nc):
    a, b = nc.Connector(), nc.Connector()
    d = nc.Descriptor(bytearray(16))
    with await a.create_readable(d):
        with pytest.raises(RuntimeError, match="more than one connection"):
            await b.create_readable(d)


async def test_metadata_without_descriptors_cannot_be_read(nc):
    _, _, r = await _readable(nc)
    md = r.metadata()
    empty = nc.RdmaMetadata(descriptors=[], nixl_metadata=md.nixl_metadata,
                            notification_key=md.notification_key, operation_kind=1)
    b = nc.Connector()
    with pytest.raises(ValueError, match="at least one"):
        await b.begin_read(empty, nc.Descriptor(bytearray(4096)))
    r.__exit__(None, None, None)


async def test_garbage_nixl_metadata_raises(nc):
    b = nc.Connector()
    for blob in ("", "b64:AAAA", "zz-not-hex"):
        md = nc.RdmaMetadata(descriptors=[nc.SerializedDescriptor(ptr=4096, size=16)],
                             nixl_metadata=blob, notification_key="k", operation_kind=1)
        with pytest.raises(Exception):
            await b.begin_read(md, nc.Descriptor(bytearray(16)))


async def test_results_before_completion_raises(nc):
    a, b = nc.Connector(), nc.Connector()
    with await a.create_readable(nc.Descriptor(pattern(64, 54))) as r:
        op = await b.begin_read(r.metadata(), nc.Descriptor(bytearray(64)))
        with pytest.raises(RuntimeError, match="not completed"):
            op.results()
        await waited(op.wait_for_completion())
        assert len(op.results()) == 1
        op.__exit__(None, None, None)
        await waited(r.wait_for_completion())


async def test_read_after_readable_released_does_not_hang(nc):
    """Metadata of a readable that was already released: raise or complete, never hang."""
    a = nc.Connector()
    r = await a.create_readable(nc.Descriptor(pattern(4096, 55)))
    md = nc.RdmaMetadata.model_validate_json(r.metadata().model_dump_json())
    r.__exit__(None, None, None)
    b = nc.Connector()
    dst = bytearray(4096)
    # Same process: the agent object of `a` still exists, so Dynamo can still complete this read;
    # the cross-process variant (peer exited) is in test_cross_process.py. Here only require no hang.
    try:
        with await b.begin_read(md, nc.Descriptor(dst)) as op:
            await waited(op.wait_for_completion(), 10)
    except asyncio.TimeoutError:
        pytest.fail("read of a released readable hung")
    except Exception:
        pass
