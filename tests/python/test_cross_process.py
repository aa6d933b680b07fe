"""Round trips across two OS processes: this test (module `nc`) and a peer.py subprocess (module
`peer_module`), metadata passed over the peer's stdin/stdout. Both modules are parametrised
independently, so dynamo<->dynamo, dynamo<->nixl_connect (both ways) and nixl_connect<->nixl_connect
all run once nixl_connect is importable.
"""
import asyncio

import pytest

import nc_common
from conftest import start_peer, waited
from nc_common import SHAPES, patterns, sha256_of

SHAPE_IDS = list(SHAPES)


@pytest.mark.parametrize("shape", SHAPE_IDS)
async def test_local_reads_peer_readable(nc, peer_module, shape):
    sizes = SHAPES[shape]
    peer = await start_peer(peer_module, "readable", sizes, seed=71)
    try:
        md = nc.RdmaMetadata.model_validate_json(await peer.expect("MD"))
        assert [d.size for d in md.descriptors] == sizes
        dst = [bytearray(s) for s in sizes]
        conn = nc.Connector()
        with await conn.begin_read(md, nc_common.descriptors(nc, dst, "numpy")) as op:
            await waited(op.wait_for_completion())
            assert op.status == nc.OperationStatus.COMPLETE
        res = await peer.result()
        assert res["ok"]
        assert sha256_of(dst) == sha256_of(patterns(sizes, 71))
    finally:
        await peer.close()


@pytest.mark.parametrize("shape", SHAPE_IDS)
async def test_local_writes_peer_writable(nc, peer_module, shape):
    sizes = SHAPES[shape]
    peer = await start_peer(peer_module, "writable", sizes)
    try:
        md = nc.RdmaMetadata.model_validate_json(await peer.expect("MD"))
        assert md.operation_kind == 2
        src = patterns(sizes, 72)
        conn = nc.Connector()
        with await conn.begin_write(nc_common.descriptors(nc, src, "numpy"), md) as op:
            await waited(op.wait_for_completion())
        res = await peer.result()
        assert res["sha256"] == sha256_of(src), "peer's buffers differ from what was written"
    finally:
        await peer.close()


@pytest.mark.parametrize("shape", SHAPE_IDS)
async def test_peer_reads_local_readable(nc, peer_module, shape):
    sizes = SHAPES[shape]
    src = patterns(sizes, 73)
    conn = nc.Connector()
    with await conn.create_readable(nc_common.descriptors(nc, src)) as readable:
        peer = await start_peer(peer_module, "read", style="numpy")
        try:
            await peer.send(readable.metadata().model_dump_json())
            await waited(readable.wait_for_completion(), 20)
            res = await peer.result()
            assert res["sha256"] == sha256_of(src), "peer read different bytes"
        finally:
            await peer.close()
        assert readable.status == nc.OperationStatus.COMPLETE


@pytest.mark.parametrize("shape", SHAPE_IDS)
async def test_peer_writes_local_writable(nc, peer_module, shape):
    sizes = SHAPES[shape]
    dst = [bytearray(s) for s in sizes]
    conn = nc.Connector()
    with await conn.create_writable(nc_common.descriptors(nc, dst)) as writable:
        peer = await start_peer(peer_module, "write", seed=74, style="numpy")
        try:
            await peer.send(writable.metadata().model_dump_json())
            await waited(writable.wait_for_completion(), 20)
            res = await peer.result()
        finally:
            await peer.close()
    assert res["sha256"] == sha256_of(patterns(sizes, 74))
    assert sha256_of(dst) == res["sha256"], "local buffers differ from what the peer wrote"


async def test_read_from_exited_peer_raises(nc, peer_module):
    """The peer prints its metadata and is killed: reading must raise, not hang."""
    peer = await start_peer(peer_module, "readable", [1 << 20], seed=75)
    try:
        md = nc.RdmaMetadata.model_validate_json(await peer.expect("MD"))
    finally:
        await peer.close()  # kills it
    conn = nc.Connector()
    with pytest.raises(Exception) as info:
        op = await waited(conn.begin_read(md, nc.Descriptor(bytearray(1 << 20))), 15)
        with op:
            await waited(op.wait_for_completion(), 15)
    assert not isinstance(info.value, asyncio.TimeoutError), "read from a dead peer hung"
