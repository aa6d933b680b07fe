"""Fixtures for the drop-in tests: every test runs against Dynamo's `dynamo.nixl_connect` and this
project's `nixl_connect`; a module that cannot be imported is skipped with the reason.

Run: cd /work/main && .venv/bin/python -m pytest tests/python -q
"""
import asyncio
import faulthandler
import functools
import gc
import json
import os
import subprocess
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import nc_common  # noqa: E402
from nc_common import MODULES  # noqa: E402

PEER = os.path.join(HERE, "peer.py")
DYNAMO = "dynamo.nixl_connect"
EXTRA_REASON = "extra beyond Dynamo"
# Hard ceiling per test: a hang dumps every thread's stack and kills the run instead of stalling CI.
WATCHDOG_S = 90


# --------------------------------------------------------------------------- module selection

@functools.lru_cache(maxsize=None)
def _import_error(name: str):
    """None when `name` imports in this process, else the reason it does not."""
    try:
        nc_common.import_module(name)
        return None
    except BaseException as e:  # noqa: BLE001 - ImportError, or whatever a broken build raises
        return f"{name} cannot be imported: {type(e).__name__}: {e}"


@functools.lru_cache(maxsize=None)
def _peer_import_error(name: str):
    """None when a fresh interpreter (the peer's) can import `name`, else the reason."""
    r = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True,
                       timeout=60)
    if r.returncode == 0:
        return None
    last = (r.stderr.strip().splitlines() or ["?"])[-1]
    return f"{name} cannot be imported by the peer process: {last}"


def load_module(name: str):
    err = _import_error(name)
    if err is not None:
        pytest.skip(err)
    return nc_common.import_module(name)


def require_peer_module(name: str) -> str:
    err = _peer_import_error(name)
    if err is not None:
        pytest.skip(err)
    return name


def short(name: str) -> str:
    return "dynamo" if name == DYNAMO else "nixl_connect"


@pytest.fixture(params=MODULES, ids=short)
def nc(request):
    """The module under test (skips when it cannot be imported)."""
    return load_module(request.param)


@pytest.fixture(params=MODULES, ids=lambda n: "peer=" + short(n))
def peer_module(request):
    """The peer process's module name (skips when the peer cannot import it)."""
    return require_peer_module(request.param)


def is_dynamo(nc) -> bool:
    return nc.__name__ == DYNAMO


# --------------------------------------------------------------------------- markers and guards

def pytest_configure(config):
    config.addinivalue_line(
        "markers", "extra: behaviour beyond Dynamo 1.6.1; runs for nixl_connect only")


@pytest.fixture(autouse=True)
def _extra_and_watchdog(request):
    if request.node.get_closest_marker("extra") is not None:
        callspec = getattr(request.node, "callspec", None)
        module = callspec.params.get("nc") if callspec else None
        if module == DYNAMO:
            pytest.skip(EXTRA_REASON)
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()
    gc.collect()


def pytest_terminal_summary(terminalreporter):
    """One line per distinct skip reason (with a count), so reasons show without -rs noise."""
    reasons = {}
    for rep in terminalreporter.stats.get("skipped", []):
        longrepr = rep.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        reason = reason.removeprefix("Skipped: ")
        reasons[reason] = reasons.get(reason, 0) + 1
    if reasons:
        terminalreporter.write_sep("-", "skip reasons")
        for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
            terminalreporter.write_line(f"{n:4d} x {reason}")


# --------------------------------------------------------------------------- helpers

async def waited(aw, timeout: float = 15.0):
    """Await with a bound, so a broken implementation fails instead of hanging."""
    return await asyncio.wait_for(aw, timeout)


class Peer:
    """A peer.py subprocess speaking the MD/RESULT line protocol on stdout."""

    def __init__(self, proc, errfile, module, role):
        self.proc = proc
        self.errfile = errfile
        self.module = module
        self.role = role

    def stderr_tail(self) -> str:
        self.errfile.flush()
        self.errfile.seek(0)
        return self.errfile.read().decode(errors="replace")[-3000:]

    async def expect(self, tag: str, timeout: float = 20.0) -> str:
        """Next protocol line with `tag`; raises with the peer's stderr on ERROR or EOF."""
        async def _next():
            while True:
                raw = await self.proc.stdout.readline()
                if not raw:
                    await self.proc.wait()
                    raise AssertionError(
                        f"peer {self.module} {self.role} ended (rc={self.proc.returncode}) before "
                        f"{tag}:\n{self.stderr_tail()}")
                line = raw.decode().rstrip("\n")
                t, _, payload = line.partition(" ")
                if t == "ERROR":
                    raise AssertionError(f"peer {self.module} {self.role}: {payload}\n"
                                         f"{self.stderr_tail()}")
                if t == tag:
                    return payload
        return await asyncio.wait_for(_next(), timeout)

    async def send(self, line: str) -> None:
        self.proc.stdin.write((line.rstrip("\n") + "\n").encode())
        await self.proc.stdin.drain()
        self.proc.stdin.close()

    async def result(self, timeout: float = 20.0) -> dict:
        res = json.loads(await self.expect("RESULT", timeout))
        rc = await asyncio.wait_for(self.proc.wait(), timeout)
        assert rc == 0, f"peer exited {rc}:\n{self.stderr_tail()}"
        return res

    async def close(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()
        self.errfile.close()


async def start_peer(module: str, role: str, sizes=None, seed: int = 1, style: str = "bytearray",
                     timeout: float = 15.0, prefix=(), env=None) -> Peer:
    """Starts peer.py; `prefix` runs it under another command (`ip netns exec ...`, `unshare
    ...`), `env` replaces its environment."""
    args = [*prefix, sys.executable, PEER, module, role, "--seed", str(seed), "--timeout",
            str(timeout), "--style", style]
    if sizes is not None:
        args += ["--sizes", ",".join(str(s) for s in sizes)]
    errfile = tempfile.TemporaryFile()
    proc = await asyncio.create_subprocess_exec(
        *args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=errfile, env=env)
    return Peer(proc, errfile, module, role)


def cuda_skip_reason():
    """None when a real torch with CUDA is present, else why CUDA tests cannot run."""
    try:
        import torch
    except ImportError as e:
        return f"torch is not installed ({e})"
    try:
        if not torch.cuda.is_available():
            return "torch.cuda.is_available() is False"
    except Exception as e:  # noqa: BLE001
        return f"torch.cuda unusable: {e}"
    return None
