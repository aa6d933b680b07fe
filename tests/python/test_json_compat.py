"""JSON byte compatibility: metadata produced by one module (in a peer process) validates in the
other and re-dumps to identical bytes; its shape is exactly Dynamo's."""
import base64
import json
import re
import zlib

import pytest

from conftest import start_peer
from nc_common import UNEQUAL_SIZES

_EMITTED = {}
UUID4 = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


async def emitted(producer: str) -> dict:
    """MD (readable, 8 descriptors), MDW (writable) and MDHEX (hex_encode=True) lines of `producer`."""
    if producer not in _EMITTED:
        peer = await start_peer(producer, "emit", seed=81)
        try:
            lines = {tag: await peer.expect(tag) for tag in ("MD", "MDW", "MDHEX")}
            await peer.result()
        finally:
            await peer.close()
        _EMITTED[producer] = lines
    return _EMITTED[producer]


@pytest.mark.parametrize("tag", ["MD", "MDW", "MDHEX"])
async def test_validates_and_redumps_identically(nc, peer_module, tag):
    line = (await emitted(peer_module))[tag]
    md = nc.RdmaMetadata.model_validate_json(line)
    assert md.model_dump_json() == line
    assert md.model_dump() == json.loads(line)
    assert nc.RdmaMetadata.model_validate(json.loads(line)).model_dump_json() == line
    assert nc.RdmaMetadata.model_validate(md.model_dump()).model_dump_json() == line


async def test_producer_shape_is_dynamos(nc, peer_module):
    """The producer's JSON has Dynamo's exact layout (checked with the consumer `nc` too)."""
    lines = await emitted(peer_module)
    for tag, kind in (("MD", 1), ("MDW", 2), ("MDHEX", 1)):
        line = lines[tag]
        obj = json.loads(line)
        assert list(obj) == ["descriptors", "nixl_metadata", "notification_key", "operation_kind"]
        assert obj["operation_kind"] == kind
        assert UUID4.match(obj["notification_key"]), obj["notification_key"]
        for d in obj["descriptors"]:
            assert list(d) == ["device", "ptr", "size"]
            assert d["device"] == "cpu" and isinstance(d["ptr"], int) and d["ptr"] > 0
        # compact separators, no spaces (pydantic's model_dump_json)
        assert json.dumps(obj, separators=(",", ":"), ensure_ascii=False) == line
        if tag == "MDHEX":
            assert re.fullmatch(r"[0-9a-f]+", obj["nixl_metadata"])
            blob = zlib.decompress(bytes.fromhex(obj["nixl_metadata"]))
        else:
            assert obj["nixl_metadata"].startswith("b64:")
            blob = zlib.decompress(base64.b64decode(obj["nixl_metadata"][4:], validate=True))
        assert len(blob) > 0
    sizes = [d["size"] for d in json.loads(lines["MD"])["descriptors"]]
    assert sizes == UNEQUAL_SIZES
    assert [d["size"] for d in json.loads(lines["MDW"])["descriptors"]] == UNEQUAL_SIZES
    # the consumer agrees on the kinds
    assert nc.RdmaMetadata.model_validate_json(lines["MDW"]).operation_kind == int(
        nc.OperationKind.WRITE)


async def test_nixl_metadata_is_a_zlib_stream(nc, peer_module):
    """Dynamo: zlib.compress(level=6), header 78 9c; any zlib stream (not raw deflate/gzip) decodes."""
    lines = await emitted(peer_module)
    raw = base64.b64decode(json.loads(lines["MD"])["nixl_metadata"][4:])
    assert raw[:1] == b"\x78"
    assert len(zlib.decompress(raw)) > 0
