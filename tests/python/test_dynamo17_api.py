"""What Dynamo 1.7 adds to `dynamo.nixl_connect`, on this project's module (Dynamo 1.6.1, the other
module these tests run beside, has none of it: "extra beyond Dynamo"): `Connector.warmup()` creates
the shared connection eagerly and raises setup errors to its caller, `initialize()` stays a lazy
no-op, `Remote.decode_metadata()` checks a peer's `nixl_metadata` without loading anything, and
`Connector._shared_connection` is the connection the operations use."""
import asyncio
import base64
import os
import subprocess
import sys
import zlib

import pytest

pytestmark = pytest.mark.extra


def _reference_decode(text: str) -> bytes:
    """Dynamo 1.7's decode, as its source has it: "b64:"+base64 or hex, then zlib."""
    raw = base64.b64decode(text[4:]) if text.startswith("b64:") else bytes.fromhex(text)
    return zlib.decompress(raw)


async def test_dynamo17_warmup_creates_the_shared_connection_once(nc):
    c = nc.Connector()
    assert c._shared_connection is None
    assert await c.initialize() is None
    assert c._shared_connection is None, "initialize() stays the deprecated no-op: still lazy"
    assert await c.warmup() is None
    conn = c._shared_connection
    assert conn is not None and conn.is_initialized
    await c.warmup()
    assert c._shared_connection is conn, "a repeated warmup reuses the connection"
    with await c.create_readable(nc.Descriptor(bytearray(b"warmup"))) as op:
        assert op.connection is conn, "operations use the warmed connection"


async def test_dynamo17_concurrent_warmups_and_an_operation_share_one_connection(nc):
    c = nc.Connector()
    _, _, op = await asyncio.gather(
        c.warmup(), c.warmup(), c.create_readable(nc.Descriptor(bytearray(b"warmup"))))
    with op:
        assert op.connection is c._shared_connection is not None


def test_dynamo17_warmup_raises_setup_errors_and_can_be_retried():
    # In a fresh interpreter: NIXL cannot be found while NIXL_CONNECT_LIB names nothing, so the
    # first warmup fails with the typed error (an ImportError, as Dynamo's missing bindings raise)
    # and leaves no connection; with the variable gone the same Connector warms up.
    script = r"""
import asyncio, os
import nixl_connect as nc

async def main():
    c = nc.Connector()
    try:
        await c.warmup()
    except ImportError as e:
        assert isinstance(e, nc.NixlConnectError), type(e)
        assert c._shared_connection is None
        print("failed:", e.kind)
    else:
        raise SystemExit("warmup did not fail without NIXL")
    del os.environ["NIXL_CONNECT_LIB"]
    await c.warmup()
    assert c._shared_connection is not None
    print("retried: ok")

asyncio.run(main())
"""
    env = dict(os.environ, NIXL_CONNECT_LIB="/nonexistent/libnixl")
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "failed: NixlNotFound" in r.stdout, r.stdout
    assert "retried: ok" in r.stdout


async def test_dynamo17_decode_metadata_matches_dynamos_decoding(nc):
    c = nc.Connector()
    with await c.create_readable(nc.Descriptor(bytearray(64))) as op:
        text = op.metadata().nixl_metadata
        raw = nc.Remote.decode_metadata(text)
        assert raw == _reference_decode(text)
        assert raw.startswith(b"nixlSerDes|Agent"), "the NIXL agent metadata itself"
        # Legacy hex (Dynamo's `metadata(hex_encode=True)`), and bytes taken as decoded already.
        hex_text = op.metadata(hex_encode=True).nixl_metadata
        assert nc.Remote.decode_metadata(hex_text) == raw
        assert nc.Remote.decode_metadata(raw) is raw


def test_dynamo17_decode_metadata_refuses_what_is_not_metadata(nc):
    with pytest.raises(TypeError, match="bytes` or `str"):
        nc.Remote.decode_metadata(5)
    for empty in ("", b""):
        with pytest.raises(ValueError, match="cannot be empty"):
            nc.Remote.decode_metadata(empty)
    for bad in ("b64:!!!!", "zz", "b64:" + base64.b64encode(b"not zlib").decode(),
                zlib.compress(b"x").hex()[:-4]):
        with pytest.raises(nc.MetadataError, match="nixl_metadata"):
            nc.Remote.decode_metadata(bad)


def test_dynamo17_decode_metadata_refuses_a_zlib_bomb_on_ours():
    # A peer's 64 KiB string that inflates to 256 MiB: our module's decoder (the core's) stops at
    # 16 MiB instead of allocating it all, and says so.
    import nixl_connect as ours

    bomb = "b64:" + base64.b64encode(zlib.compress(bytes(256 << 20), 9)).decode()
    assert len(bomb) < 1 << 20
    with pytest.raises(ours.MetadataError, match="more than 16777216 bytes"):
        ours.Remote.decode_metadata(bomb)
