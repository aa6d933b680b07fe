"""Dynamo 1.6.1's own callers of `dynamo.nixl_connect` (the `ai-dynamo` wheel), run unchanged on
`nixl_connect` and, as the reference, on Dynamo's module: the callers are the specification.

In this process both modules are imported side by side (the `nc` fixture), so the `dynamo_on`
fixture points `dynamo.nixl_connect` at the module under test the way `install_as_dynamo()` does,
for callers that import it when they run (the embedding classes, media_nixl). Start-up switching
(`NIXL_CONNECT_AS_DYNAMO=1`), cross-process pairs and fork run in their own interpreters.

TRT-LLM's and vLLM-omni's modules import `tensorrt_llm` / `vllm` at load time (several GB, CUDA),
so their call patterns (`with await connector.create_readable(d) as op`, `await
connector._create_connection()` as a probe, lists of descriptors, `op.__exit__(None, None, None)`)
are exercised here directly, with the same arguments.
"""
import asyncio
import base64
import json
import os
import subprocess
import sys
import textwrap
import zlib

import pytest

from conftest import HERE, is_dynamo, short, waited

torch = pytest.importorskip("torch", reason="Dynamo's callers need real torch (scripts/setup.sh --interop)")
pytest.importorskip("dynamo.common.multimodal.embedding_transfer",
                    reason="ai-dynamo is not installed (scripts/setup.sh --interop)")

PY = sys.executable
PEER = os.path.join(HERE, "dynamo_embed_peer.py")


@pytest.fixture
def dynamo_on(nc, monkeypatch):
    """`dynamo.nixl_connect` resolves to `nc` while the test runs."""
    import dynamo
    monkeypatch.setitem(sys.modules, "dynamo.nixl_connect", nc)
    monkeypatch.setattr(dynamo, "nixl_connect", nc, raising=False)
    return nc


def _env(module: str) -> dict:
    env = dict(os.environ)
    env.pop("NIXL_CONNECT_AS_DYNAMO", None)
    if module == "nixl_connect":
        env["NIXL_CONNECT_AS_DYNAMO"] = "1"
    env.setdefault("NIXL_LOG_LEVEL", "WARN")
    return env


def _run(code: str, module: str = "nixl_connect", timeout: float = 90) -> str:
    r = subprocess.run([PY, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       env=_env(module), timeout=timeout)
    assert r.returncode == 0, f"rc={r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr[-4000:]}"
    return r.stdout


# --------------------------------------------------------------------------- embedding transfer


def _tensors():
    g = torch.Generator().manual_seed(7)
    base = torch.randn(64, 256, generator=g)
    return {
        "float32": torch.randn(32, 256, generator=g),
        "bfloat16": torch.randn(48, 256, generator=g).to(torch.bfloat16),
        "int8": torch.randint(-128, 127, (16, 256), dtype=torch.int8, generator=g),
        "view": base[8:24],                       # a contiguous view into a larger tensor
        "non_contiguous": base.t()[:, :16],       # strided: Descriptor copies it (as Dynamo)
    }


@pytest.mark.parametrize("stage", [False, True], ids=["copy", "staged"])
async def test_dynamo_embedding_transfer_round_trips(dynamo_on, stage):
    """NixlReadEmbeddingSender -> NixlReadEmbeddingReceiver with a pool of pre-registered int8
    descriptors shrunk through `_data_size` and viewed through `_data_ref`, and a dynamic one."""
    from dynamo.common.multimodal.embedding_transfer import (
        NixlReadEmbeddingReceiver, NixlReadEmbeddingSender)
    sender = NixlReadEmbeddingSender()
    receiver = NixlReadEmbeddingReceiver(embedding_hidden_size=256, max_item_mm_token=64 * 4,
                                         max_items=2)
    assert sender._nixl_connect is dynamo_on and receiver._nixl_connect is dynamo_on
    for name, t in _tensors().items():
        request, done = await sender.send_embeddings(t, stage_embeddings=stage)
        tensor_id, got = await waited(receiver.receive_embeddings(request))
        await waited(done)
        assert got.dtype == t.dtype and got.shape == t.shape, name
        assert torch.equal(got, t), name
        receiver.release_tensor(tensor_id)
    # Three at once: two pooled descriptors, then a dynamically allocated one.
    ts = [torch.full((8, 256), float(i)) for i in range(3)]
    sent = [await sender.send_embeddings(t) for t in ts]
    got = await waited(asyncio.gather(*(receiver.receive_embeddings(r) for r, _ in sent)))
    await waited(asyncio.gather(*(d for _, d in sent)))
    for t, (tid, g) in zip(ts, got):
        assert torch.equal(g, t)
        receiver.release_tensor(tid)


async def test_dynamo_embedding_pool_reads_only_the_tensors_bytes(dynamo_on):
    """A pooled descriptor shrunk through `_data_size` receives exactly that many bytes into the
    start of its buffer; the rest of the pool keeps its canary, and `_data_size` is restored."""
    from dynamo.common.multimodal.embedding_transfer import (
        NixlReadEmbeddingReceiver, NixlReadEmbeddingSender)
    sender = NixlReadEmbeddingSender()
    receiver = NixlReadEmbeddingReceiver(embedding_hidden_size=256, max_item_mm_token=64,
                                         max_items=1)
    pooled = receiver.warmedup_descriptors.queue[0]
    full = pooled._data_size
    pooled._data_ref.fill_(0x5A)
    t = torch.arange(10 * 256, dtype=torch.float32).reshape(10, 256)
    request, done = await sender.send_embeddings(t)
    tid, got = await waited(receiver.receive_embeddings(request))
    await waited(done)
    assert torch.equal(got, t)
    assert got.data_ptr() == pooled._data_ref.data_ptr()
    n = t.numel() * t.element_size()
    assert bool((pooled._data_ref[n:] == 0x5A).all()), "bytes past the tensor were written"
    assert pooled._data_size == full
    receiver.release_tensor(tid)


# --------------------------------------------------------------------------- private names


async def test_dynamo_create_connection_is_an_async_no_argument_method(nc):
    """`await connector._create_connection()` (TRT-LLM's probe) returns the one shared
    Connection, the one operations use."""
    c = nc.Connector()
    conn = await c._create_connection()
    assert isinstance(conn, nc.Connection)
    assert await c._create_connection() is conn
    with await c.create_readable(nc.Descriptor(bytearray(64))) as op:
        assert op.connection is conn


def test_dynamo_create_connection_through_run_async_from_a_running_loop(nc):
    """Dynamo's `run_async(connector._create_connection)`: inside a running loop it runs the
    coroutine with asyncio.run on a throwaway loop in another thread; the Connection then serves
    operations on the caller's loop, and a read on a third loop."""
    from dynamo.common.utils.runtime import run_async

    async def main():
        a, b = nc.Connector(), nc.Connector()
        conn = run_async(b._create_connection)          # another thread, another loop
        assert isinstance(conn, nc.Connection)
        src = bytearray(os.urandom(4096))
        dst = bytearray(4096)
        d = nc.Descriptor(dst)
        d.register_with_connector(conn)
        with await a.create_readable(nc.Descriptor(src)) as readable:
            md = readable.metadata()
            read_op = await b.begin_read(md, d)
            assert read_op.connection is conn
            await waited(asyncio.gather(read_op.wait_for_completion(),
                                        readable.wait_for_completion()))
        assert dst == src
        # The same connector on yet another loop (a thread of its own).
        src2, dst2 = bytearray(os.urandom(512)), bytearray(512)

        def other_loop():
            async def go():
                with await a.create_readable(nc.Descriptor(src2)) as r:
                    op = await b.begin_read(r.metadata(), nc.Descriptor(dst2))
                    await asyncio.wait_for(asyncio.gather(op.wait_for_completion(),
                                                          r.wait_for_completion()), 15)
            asyncio.run(go())
        await asyncio.get_running_loop().run_in_executor(None, other_loop)
        assert dst2 == src2

    asyncio.run(main())


async def test_dynamo_create_connection_override_that_raises_raises(nc):
    """A subclass whose `_create_connection` raises: create_readable and begin_read raise it
    (before: TypeError inside a helper thread, and create_readable hung)."""
    class Broken(nc.Connector):
        async def _create_connection(self):
            raise ConnectionRefusedError("no NIXL for you")

    c = Broken()
    with pytest.raises(ConnectionRefusedError, match="no NIXL for you"):
        await waited(c.create_readable(nc.Descriptor(bytearray(16))), 10)


async def test_dynamo_helper_thread_failure_reaches_the_awaiting_coroutine(nc, monkeypatch):
    """Whatever the connection's creation raises on nixl_connect's helper thread is raised by the
    coroutine that waits for it, every time it is tried, never a hang."""
    if is_dynamo(nc):
        pytest.skip("Dynamo creates the connection on the caller's thread (no helper thread)")
    import nixl_connect._operations as ops

    def boom(*a, **k):
        raise MemoryError("simulated failure while creating the NIXL agent")

    monkeypatch.setattr(ops, "Connection", boom)
    c = nc.Connector()
    for _ in range(2):
        with pytest.raises(MemoryError, match="simulated"):
            await waited(c.create_readable(nc.Descriptor(bytearray(16))), 10)
    results = await waited(asyncio.gather(*(c._create_connection() for _ in range(3)),
                                          return_exceptions=True), 10)
    assert all(isinstance(r, MemoryError) for r in results), results


async def test_dynamo_register_with_connector_saves_the_registration(nc):
    """Pre-registration really makes the later read cheaper: a read into (the start of) a
    registered pooled buffer makes no NIXL registration; the same read without one makes one.
    The peer is Dynamo's module, so the read takes NIXL (a same-host peer would take CMA)."""
    if is_dynamo(nc):
        pytest.skip("Dynamo's registration counters are not observable")
    import dynamo.nixl_connect as dnc
    ours = nc.Connector()
    conn = await ours._create_connection()

    async def read_4k(desc):
        src = bytearray(os.urandom(4096))
        peer = dnc.Connector()
        with await peer.create_readable(dnc.Descriptor(src)) as readable:
            md = nc.RdmaMetadata.model_validate(readable.metadata().model_dump())
            op = await ours.begin_read(md, desc)
            await waited(asyncio.gather(op.wait_for_completion(), readable.wait_for_completion()))
        return src

    pool = torch.zeros(1 << 20, dtype=torch.int8)
    pooled = nc.Descriptor(pool)
    pooled.register_with_connector(conn)
    assert pooled.is_registered
    before = conn._core.stats()["registrations"]
    pooled._data_size = 4096
    src = await read_4k(pooled)
    assert bytes(pool[:4096].numpy().tobytes()) == bytes(src)
    assert conn._core.stats()["registrations"] == before, "the pooled buffer was registered again"
    unregistered = nc.Descriptor(torch.zeros(4096, dtype=torch.int8))
    await read_4k(unregistered)
    assert conn._core.stats()["registrations"] == before + 1
    pooled.deregister_with_connector(conn)
    assert not pooled.is_registered


async def test_dynamo_data_size_cannot_exceed_the_memory(nc):
    """`_data_size` may shrink a descriptor (Dynamo's pools) but never reach past its memory."""
    if is_dynamo(nc):
        pytest.skip("Dynamo does not check: NIXL would read past the tensor")
    a, b = nc.Connector(), nc.Connector()
    d = nc.Descriptor(torch.zeros(64, dtype=torch.int8))
    d._data_size = 128
    with await a.create_readable(nc.Descriptor(bytearray(128))) as r:
        with pytest.raises(ValueError, match="_data_size"):
            await b.begin_read(r.metadata(), d)


async def test_dynamo_trtllm_with_await_create_readable_and_direct_exit(nc):
    """TRT-LLM: `with await connector.create_readable(d) as op` then `with read_op:`; mm_kwargs:
    `op.__exit__(None, None, None)` called directly, twice, after completion; vLLM omni: lists."""
    a, b = nc.Connector(), nc.Connector()
    srcs = [torch.arange(n, dtype=torch.float32) for n in (256, 512, 1024)]
    dsts = [torch.zeros_like(s) for s in srcs]
    with await a.create_readable([nc.Descriptor(s) for s in srcs]) as readable:
        md = nc.RdmaMetadata.model_validate(readable.metadata().model_dump())
        read_op = await b.begin_read(md, [nc.Descriptor(d) for d in dsts])
        with read_op:
            await waited(read_op.wait_for_completion())
        await waited(readable.wait_for_completion())
    for s, d in zip(srcs, dsts):
        assert torch.equal(s, d)
    one = await a.create_readable(nc.Descriptor(torch.ones(64)))
    got = torch.zeros(64)
    op = await b.begin_read(one.metadata(), [nc.Descriptor(got)])  # a one-element list
    await waited(asyncio.gather(op.wait_for_completion(), one.wait_for_completion()))
    one.__exit__(None, None, None)
    one.__exit__(None, None, None)
    assert torch.equal(got, torch.ones(64))


async def test_dynamo_media_nixl_reads_from_a_raw_nixl_agent(dynamo_on):
    """media_nixl: RdmaMetadata built by hand from what Dynamo's Rust frontend sends (a raw NIXL
    agent's metadata, an address, a size, a fresh key). The frontend is played by NIXL's own Python
    agent (`nixl._api`), which registers memory and never waits for a notification."""
    from nixl._api import nixl_agent, nixl_agent_config
    import numpy as np
    from dynamo.common.utils.media_nixl import read_decoded_media_via_nixl
    img = np.random.default_rng(3).integers(0, 255, (32, 48, 4), dtype=np.uint8)
    agent = nixl_agent("media-loader-test", nixl_agent_config(backends=["UCX"]))
    reg = agent.register_memory([(img.ctypes.data, img.nbytes, 0, "")], "DRAM")
    try:
        meta = {
            "nixl_metadata": "b64:" + base64.b64encode(zlib.compress(agent.get_agent_metadata(), 6)).decode(),
            "nixl_descriptor": {"addr": img.ctypes.data, "size": img.nbytes, "mem_type": "DRAM"},
            "shape": list(img.shape), "dtype": "UINT8",
        }
        got = await waited(read_decoded_media_via_nixl(dynamo_on.Connector(), meta))
        assert np.array_equal(got, img[..., :3])
    finally:
        agent.deregister_memory(reg)


def _media_example() -> str:
    """The Rust example `media_rdma` (crates/nixl-connect/examples), built by `cargo test` (or here)."""
    root = os.path.dirname(os.path.dirname(HERE))
    for profile in ("debug", "release"):
        exe = os.path.join(root, "target", profile, "examples", "media_rdma")
        if os.path.exists(exe):
            return exe
    subprocess.run(["cargo", "build", "-q", "-p", "nixl-connect", "--example", "media_rdma"],
                   cwd=root, check=True, timeout=900)
    return os.path.join(root, "target", "debug", "examples", "media_rdma")


@pytest.mark.parametrize("mode", ["RGBA", "RGB"])
async def test_dynamo_media_nixl_reads_what_the_rust_media_example_publishes(dynamo_on, mode, tmp_path):
    """Dynamo's frontend, played by the Rust example `media_rdma` (decodes a PNG into memory,
    publishes Dynamo's media descriptor, serves reads until stdin closes), read by Dynamo's
    `read_decoded_media_via_nixl`, unmodified, three times (each read picks its own key)."""
    import numpy as np
    from PIL import Image
    from dynamo.common.utils.media_nixl import read_decoded_media_via_nixl
    rng = np.random.default_rng(11)
    img = rng.integers(0, 255, (37, 53, len(mode)), dtype=np.uint8)
    png = tmp_path / "picture.png"
    Image.fromarray(img, mode).save(png)
    p = subprocess.Popen([_media_example(), str(png)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, NIXL_LOG_LEVEL="WARN"))
    try:
        meta = json.loads(p.stdout.readline())
        assert meta["shape"] == [37, 53, len(mode)] and meta["dtype"] == "uint8", meta
        assert meta["nixl_metadata"].startswith("b64:")
        c = dynamo_on.Connector()
        for _ in range(3):
            got = await waited(read_decoded_media_via_nixl(c, meta))
            assert np.array_equal(got, img[..., :3])
    finally:
        p.stdin.close()
        rc = p.wait(timeout=60)
    assert rc == 0, p.stderr.read()[-3000:]


# --------------------------------------------------------------------------- mixed modules


async def test_dynamo_metadata_of_dynamos_module_into_our_begin_read(nc):
    """A graph that switched some workers only: Dynamo's RdmaMetadata instance (validated by
    Dynamo's class) goes straight into our begin_read, and ours into Dynamo's."""
    import dynamo.nixl_connect as dnc
    import nixl_connect as ours
    other = ours if is_dynamo(nc) else dnc
    src = bytearray(os.urandom(8192))
    dst = bytearray(8192)
    peer = other.Connector()
    with await peer.create_readable(other.Descriptor(src)) as readable:
        md = readable.metadata()
        assert type(md) is other.RdmaMetadata
        if is_dynamo(nc):
            md = dnc.RdmaMetadata.model_validate(md.model_dump())   # Dynamo takes only its own
        op = await nc.Connector().begin_read(md, nc.Descriptor(dst))
        await waited(asyncio.gather(op.wait_for_completion(), readable.wait_for_completion()))
    assert dst == src


def test_dynamo_install_switches_every_import_form():
    """NIXL_CONNECT_AS_DYNAMO=1 (the wheel's .pth hook): every way Dynamo imports the module gets
    ours, and a pydantic model typed with `dynamo.nixl_connect.RdmaMetadata` validates ours."""
    out = _run("""
        import sys
        assert sys.modules["dynamo.nixl_connect"].__name__ == "nixl_connect"  # before any import
        import nixl_connect
        import dynamo.nixl_connect as a
        from dynamo import nixl_connect as b
        from dynamo.nixl_connect import RdmaMetadata, Connector, Descriptor
        assert a is b is nixl_connect and RdmaMetadata is nixl_connect.RdmaMetadata
        from typing import Optional
        from pydantic import BaseModel
        import dynamo.nixl_connect
        class Proto(BaseModel):                                  # as Dynamo's sglang protocol
            serialized_request: Optional[dynamo.nixl_connect.RdmaMetadata] = None
        md = nixl_connect.RdmaMetadata(descriptors=[{"device": "cpu", "ptr": 4096, "size": 8}],
                                       nixl_metadata="b64:eJwDAAAAAAE=", notification_key="k",
                                       operation_kind=1)
        p = Proto(serialized_request=md)
        assert Proto.model_validate_json(p.model_dump_json()).serialized_request == md
        assert nixl_connect.is_installed_as_dynamo()
        print("ok")
    """)
    assert out.strip().endswith("ok")


def test_dynamo_install_refuses_to_half_apply():
    """Once Dynamo's own module is imported, install_as_dynamo() raises and changes nothing."""
    out = _run("""
        import sys, dynamo.nixl_connect as real, nixl_connect
        try:
            nixl_connect.install_as_dynamo()
        except RuntimeError as e:
            assert "imported before" in str(e) and "NIXL_CONNECT_AS_DYNAMO" in str(e), e
        else:
            raise AssertionError("install_as_dynamo() did not refuse")
        assert sys.modules["dynamo.nixl_connect"] is real and not nixl_connect.is_installed_as_dynamo()
        print("ok")
    """, module="dynamo.nixl_connect")
    assert out.strip().endswith("ok")


@pytest.mark.parametrize("sender,receiver", [("nixl_connect", "nixl_connect"),
                                             ("nixl_connect", "dynamo.nixl_connect"),
                                             ("dynamo.nixl_connect", "nixl_connect")],
                         ids=["ours-ours", "ours-dynamo", "dynamo-ours"])
def test_dynamo_embedding_transfer_across_processes(sender, receiver):
    """Dynamo's classes in two processes, metadata over a pipe (TransferRequest JSON lines), each
    process on its own module: every byte checked by the receiver."""
    count, size = 6, 512 * 1024
    s = subprocess.Popen([PY, PEER, "sender", str(count), str(size), "bfloat16"],
                         stdout=subprocess.PIPE, env=_env(sender), text=True)
    try:
        r = subprocess.run([PY, PEER, "receiver", str(count), str(size), "bfloat16"],
                           stdin=s.stdout, capture_output=True, text=True, env=_env(receiver),
                           timeout=120)
        assert r.returncode == 0, r.stderr[-4000:]
        report = json.loads(r.stdout.strip().splitlines()[-1])
        assert report["module"] == receiver
        assert len(report["receive_us"]) == count
        assert s.wait(timeout=60) == 0
    finally:
        if s.poll() is None:
            s.kill()


# --------------------------------------------------------------------------- fork


def test_dynamo_connector_made_before_fork_works_in_the_child():
    """A Connector used before os.fork(): in the child it makes a fresh connection and transfers
    (never a hang); the parent's operations raise ForkedError there; the parent keeps working."""
    out = _run("""
        import asyncio, os, sys
        import nixl_connect as nc

        async def transfer(a, b, n):
            src, dst = bytearray(os.urandom(n)), bytearray(n)
            with await a.create_readable(nc.Descriptor(src)) as r:
                op = await b.begin_read(r.metadata(), nc.Descriptor(dst))
                await asyncio.wait_for(asyncio.gather(op.wait_for_completion(),
                                                      r.wait_for_completion()), 20)
            assert dst == src

        a, b = nc.Connector(), nc.Connector()
        asyncio.run(transfer(a, b, 4096))
        keep = asyncio.run(a.create_readable(nc.Descriptor(bytearray(64))))
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                try:
                    keep.status
                except nc.ForkedError as e:
                    assert "before it forked" in str(e)
                else:
                    raise AssertionError("a parent's operation worked in the child")
                asyncio.run(transfer(a, b, 1 << 20))
                code = 0
            finally:
                os._exit(code)
        asyncio.run(transfer(a, b, 8192))
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
        print("ok")
    """, timeout=120)
    assert out.strip().endswith("ok")


def test_dynamo_forks_during_driven_waits_leave_every_child_working():
    """Issue 63, finding 7: 200 children forked while a thread's waits drive the engine, 8 alive
    at once, each reading through the connectors it inherited and through a fresh pair. Before,
    about 1 in 20 hung making its first NIXL agent (UCX's async handler lock, held by the
    parent's UCX thread when it forked): none may hang or fail."""
    script = os.path.join(HERE, "..", "..", "scripts", "fork_during_driven_waits.py")
    r = subprocess.run([PY, script, "200", "8"], capture_output=True, text=True,
                       env=_env("nixl_connect"), timeout=600)
    assert r.returncode == 0, f"rc={r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    assert r.stdout.strip().splitlines()[-1] == "forks=200 failed=0 hung=0", r.stdout[-8000:]
