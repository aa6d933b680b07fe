"""Dynamo 1.7's warm-up behaviours on nixl_connect, with the real library (run by
`scripts/test-dynamo.sh --next` beside the tests the 1.7.0.dev wheel ships).

Dynamo's own test_nixl_warmup.py checks these by patching `dynamo.nixl_connect.nixl_api` with a
mock and counting `nixl_agent` calls; this module creates its agents in its Rust core, so those
tests are deselected and the same behaviours are checked here on the connection itself: Dynamo's
media loaders (unmodified) warm one shared connection up before their first transfer, stay lazy
without frontend decoding, and a failed warm-up reaches the loader's caller, leaves no connection
and is retried.
"""
import asyncio
import os
import subprocess
import sys

import pytest

from dynamo import nixl_connect
from dynamo.common.multimodal import audio_loader, image_loader, video_loader

LOADERS = {
    "audio": (audio_loader, audio_loader.AudioLoader),
    "image": (image_loader, image_loader.ImageLoader),
    "video": (video_loader, video_loader.VideoLoader),
}


def test_next_runs_on_ours():
    assert nixl_connect.__name__ == "nixl_connect", nixl_connect.__file__
    assert hasattr(nixl_connect.Connector, "warmup")


@pytest.fixture(params=sorted(LOADERS))
def loader(request, monkeypatch):
    """A loader kind whose connector is a real nixl_connect Connector the test can see."""
    module, cls = LOADERS[request.param]
    made = []

    def factory():
        c = nixl_connect.Connector()
        made.append(c)
        return c

    monkeypatch.setattr(module, "_create_nixl_connector", factory)
    return cls, made


def test_next_loader_warms_one_connection_in_a_sync_context(loader):
    cls, made = loader
    cls(enable_frontend_decoding=True)
    assert len(made) == 1
    conn = made[0]._shared_connection
    assert conn is not None, "the loader's constructor warmed the connector up"


@pytest.mark.asyncio
async def test_next_loader_warm_connection_is_the_one_transfers_use(loader):
    cls, made = loader
    cls(enable_frontend_decoding=True)
    c = made[0]
    conn = c._shared_connection
    assert conn is not None
    op = await c.create_readable(nixl_connect.Descriptor(bytearray(b"warmup")))
    with op:
        assert op.connection is conn
    await c.warmup()
    assert c._shared_connection is conn, "a second warm-up keeps the connection"


def test_next_loader_without_frontend_decoding_stays_lazy(loader):
    cls, made = loader
    cls(enable_frontend_decoding=False)
    assert made == [], "no connector without frontend decoding"


@pytest.mark.asyncio
async def test_next_concurrent_warmups_and_a_transfer_share_one_connection():
    c = nixl_connect.Connector()
    assert c._shared_connection is None, "lazy until warm-up"
    _, _, op = await asyncio.gather(
        c.warmup(), c.warmup(), c.create_readable(nixl_connect.Descriptor(bytearray(b"x" * 64))))
    with op:
        assert op.connection is c._shared_connection is not None


@pytest.mark.parametrize("kind", sorted(LOADERS))
def test_next_failed_warmup_reaches_the_loader_and_is_retried(kind):
    # A fresh interpreter where NIXL cannot be found: the loader's constructor raises the typed
    # error (an ImportError) and leaves no connection; with NIXL back, the same connector warms up.
    script = r"""
import asyncio, os, sys
from dynamo import nixl_connect
from dynamo.common.multimodal import audio_loader, image_loader, video_loader
module, cls = {"audio": (audio_loader, audio_loader.AudioLoader),
               "image": (image_loader, image_loader.ImageLoader),
               "video": (video_loader, video_loader.VideoLoader)}[sys.argv[1]]
assert nixl_connect.__name__ == "nixl_connect"
c = nixl_connect.Connector()
module._create_nixl_connector = lambda: c
try:
    cls(enable_frontend_decoding=True)
except ImportError as e:
    assert isinstance(e, nixl_connect.NixlConnectError), type(e)
    assert c._shared_connection is None
    print("failed:", e.kind)
else:
    raise SystemExit("the loader started without NIXL")
del os.environ["NIXL_CONNECT_LIB"]
asyncio.run(c.warmup())
assert c._shared_connection is not None
print("retried: ok")
"""
    env = dict(os.environ, NIXL_CONNECT_LIB="/nonexistent/libnixl")
    r = subprocess.run([sys.executable, "-c", script, kind], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "failed: NixlNotFound" in r.stdout, r.stdout
    assert "retried: ok" in r.stdout, r.stdout
