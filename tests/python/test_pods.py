"""nixl_connect between pods (issue 41): two processes, each in its own network, PID, mount and IPC
namespaces (its own /proc), sharing only the socket directory (NIXL_CONNECT_SOCKET_DIR), as two
pods on one node: this project's Python module on one side, the Rust CLI (`nixl-connect serve`,
`read`) or the Python module on the other. Neither sees the other's pid, so host memory moves
through pipes on the same-host path; every byte checked. Needs root (`ip netns`, `unshare`), as CI
has; Dynamo's module has no same-host path, so only nixl_connect runs here.
"""
import asyncio
import hashlib
import itertools
import json
import os
import subprocess
import tempfile
import time

import pytest

from conftest import start_peer
from nc_common import pattern, sha256_of

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The Rust CLI: $NIXL_CONNECT_CLI, else the one `cargo test` builds (scripts/test.sh runs it first).
CLI = os.environ.get("NIXL_CONNECT_CLI") or os.path.join(ROOT, "target", "debug", "nixl-connect")
SIZE = 3 << 20
_n = itertools.count()


def _ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _wait_up(dev, ns, within=10.0):
    """Waits until `dev` in network namespace `ns` has its carrier: UCX cannot use it before."""
    until, out = time.monotonic() + within, ""
    while time.monotonic() < until:
        out = subprocess.run(["ip", "-n", ns, "-o", "link", "show", dev], capture_output=True,
                             text=True).stdout
        if "LOWER_UP" in out and "state UP" in out:
            return
        time.sleep(0.05)
    pytest.fail(f"{dev} did not come up: {out}")


@pytest.fixture
def pods():
    """Two network namespaces joined by a veth pair (NIXL's TCP path between them), a shared
    socket directory open to all (as a hostPath volume is); yields, for each pod, the command
    prefix that starts a process in a pod of its own there and that pod's environment."""
    if os.geteuid() != 0:
        pytest.fail("the pods tests run as root (ip netns, unshare), as CI does")
    if not os.path.exists(CLI):
        subprocess.run(["cargo", "build", "-q", "-p", "nixl-connect-cli"], cwd=ROOT, check=True,
                       timeout=1800)
    tag = f"{os.getpid() % 10000}x{next(_n)}"
    names = [(f"nxcpy{tag}{s}", f"nxv{tag}{s}") for s in "ab"]
    shared = tempfile.mkdtemp(prefix="nxc-pypods-")
    os.chmod(shared, 0o777)
    try:
        for ns, _ in names:
            _ip("netns", "add", ns)
        (na, da), (nb, db) = names
        _ip("link", "add", da, "type", "veth", "peer", "name", db)
        for (ns, dev), addr in zip(names, ("10.231.9.1/30", "10.231.9.2/30")):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", addr, "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        for ns, dev in names:
            _wait_up(dev, ns)
        out = []
        for ns, dev in names:
            env = dict(os.environ, NIXL_CONNECT_SOCKET_DIR=shared, UCX_TLS="tcp", UCX_NET_DEVICES=dev)
            prefix = ["ip", "netns", "exec", ns, "unshare", "--pid", "--ipc", "--mount", "--fork",
                      "--kill-child", "--mount-proc"]
            out.append((prefix, env))
        yield out
    finally:
        for ns, _ in names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["rm", "-rf", shared])


async def _cli(prefix, env, *args, stdin=None):
    """Starts the Rust CLI in a pod; returns the process (stdout piped)."""
    return await asyncio.create_subprocess_exec(
        *prefix, CLI, *args, env=env, stdin=asyncio.subprocess.PIPE if stdin else None,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)


async def _line(proc, timeout=30.0) -> str:
    line = await asyncio.wait_for(proc.stdout.readline(), timeout)
    if not line:
        err = (await proc.stderr.read()).decode(errors="replace")[-2000:]
        pytest.fail(f"the CLI ended early: {err}")
    return line.decode().strip()


async def test_pods_python_reads_a_rust_readable_through_pipes(pods, tmp_path):
    (pa, ea), (pb, eb) = pods
    data = pattern(SIZE, 91)
    src = tmp_path / "src"
    src.write_bytes(data)
    os.chmod(tmp_path, 0o755)
    serve = await _cli(pa, ea, "serve", "--file", str(src), "--json", "--timeout", "30")
    try:
        md = await _line(serve)
        peer = await start_peer("nixl_connect", "read", prefix=pb, env=eb)
        try:
            await peer.send(md)
            res = await peer.result()
            assert (res["path"], res["mechanism"]) == ("local", "pipes"), res
            assert res["sha256"] == hashlib.sha256(data).hexdigest()
        finally:
            await peer.close()
        done = json.loads(await _line(serve))
        assert done["bytes"] == SIZE, done
    finally:
        if serve.returncode is None:
            serve.kill()
        await serve.wait()


async def test_pods_rust_reads_a_python_readable_through_pipes(pods, tmp_path):
    (pa, ea), (pb, eb) = pods
    peer = await start_peer("nixl_connect", "readable", [SIZE], seed=92, prefix=pa, env=ea)
    try:
        md = await peer.expect("MD")
        out = tmp_path / "out"
        os.chmod(tmp_path, 0o777)
        read = await _cli(pb, eb, "read", "--metadata", "-", "--path", "local", "--out", str(out),
                          "--json", stdin=True)
        read.stdin.write((md + "\n").encode())
        await read.stdin.drain()
        read.stdin.close()
        res = json.loads(await _line(read))
        assert (res["path"], res["mechanism"]) == ("local", "pipes"), res
        assert await read.wait() == 0
        assert (await peer.result())["ok"]
        assert hashlib.sha256(out.read_bytes()).hexdigest() == sha256_of([pattern(SIZE, 92 * 1000)])
    finally:
        await peer.close()


async def test_pods_python_writes_a_rust_writable_through_pipes(pods, tmp_path):
    (pa, ea), (pb, eb) = pods
    out = tmp_path / "landed"
    os.chmod(tmp_path, 0o777)
    serve = await _cli(pa, ea, "serve", "--writable", "--size", str(SIZE), "--out", str(out),
                       "--json", "--timeout", "30")
    try:
        md = await _line(serve)
        peer = await start_peer("nixl_connect", "write", seed=93, prefix=pb, env=eb)
        try:
            await peer.send(md)
            res = await peer.result()
            assert (res["path"], res["mechanism"]) == ("local", "pipes"), res
        finally:
            await peer.close()
        json.loads(await _line(serve))
        assert await serve.wait() == 0
        assert hashlib.sha256(out.read_bytes()).hexdigest() == sha256_of([pattern(SIZE, 93 * 1000)])
    finally:
        if serve.returncode is None:
            serve.kill()
            await serve.wait()


async def test_pods_python_pair_through_pipes(pods):
    (pa, ea), (pb, eb) = pods
    owner = await start_peer("nixl_connect", "readable", [65536, SIZE], seed=94, prefix=pa, env=ea)
    try:
        md = await owner.expect("MD")
        reader = await start_peer("nixl_connect", "read", prefix=pb, env=eb)
        try:
            await reader.send(md)
            res = await reader.result()
            assert (res["path"], res["mechanism"]) == ("local", "pipes"), res
            assert res["sha256"] == (await owner.result())["sha256"]
        finally:
            await reader.close()
    finally:
        await owner.close()
