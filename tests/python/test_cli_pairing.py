"""Pairing with the Rust CLI (`nixl-connect serve/read/write`) in all four directions, for both
modules, byte-exact at 4 KiB, 64 MiB and 8 unequal descriptors.

The CLI binary is $NIXL_CONNECT_CLI, else target/debug/nixl-connect (built by `cargo test`), else
built here with cargo.
"""
import asyncio
import functools
import os
import shutil
import subprocess

import pytest

import nc_common
from conftest import waited
from nc_common import KIB, MIB, UNEQUAL_SIZES, pattern, patterns

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CLI_SHAPES = {"4KiB": [4 * KIB], "64MiB": [64 * MIB], "8unequal": UNEQUAL_SIZES}
T = 60.0


@functools.lru_cache(maxsize=None)
def _cli_or_reason():
    path = os.environ.get("NIXL_CONNECT_CLI") or os.path.join(ROOT, "target", "debug", "nixl-connect")
    if os.path.exists(path):
        return path, None
    cargo = shutil.which("cargo")
    if cargo is None:
        return None, f"no CLI binary at {path} and no cargo to build it"
    r = subprocess.run([cargo, "build", "-q", "-p", "nixl-connect-cli"], cwd=ROOT,
                       capture_output=True, text=True, timeout=1800)
    if r.returncode != 0 or not os.path.exists(path):
        return None, f"building the CLI failed: {r.stderr.strip()[-500:]}"
    return path, None


@pytest.fixture
def cli():
    path, reason = _cli_or_reason()
    if reason:
        pytest.skip(reason)
    return path


async def run_cli(cli, *args, stdin: bytes = b""):
    proc = await asyncio.create_subprocess_exec(
        cli, *args, "--timeout", "30", cwd=ROOT, stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await waited(proc.communicate(stdin), T)
    assert proc.returncode == 0, f"nixl-connect {' '.join(args)} exited {proc.returncode}:\n{err.decode()}"
    return out


class Serving:
    """`nixl-connect serve ...` running: its first stdout line is the metadata."""

    def __init__(self, cli, *args):
        self.cli, self.args = cli, args

    async def __aenter__(self):
        self.proc = await asyncio.create_subprocess_exec(
            self.cli, "serve", *self.args, "--timeout", "30", cwd=ROOT,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        line = await waited(self.proc.stdout.readline(), T)
        if not line:
            err = await self.proc.stderr.read()
            raise AssertionError(f"serve printed no metadata:\n{err.decode()}")
        self.metadata = line.decode()
        return self

    async def finished(self):
        _, err = await waited(self.proc.communicate(), T)
        assert self.proc.returncode == 0, f"serve exited {self.proc.returncode}:\n{err.decode()}"

    async def __aexit__(self, *exc):
        if self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


@pytest.mark.parametrize("shape", list(CLI_SHAPES))
async def test_cli_serves_readable_module_reads(nc, cli, tmp_path, shape):
    data = bytes(pattern(sum(CLI_SHAPES[shape]), 91))
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    n = str(len(CLI_SHAPES[shape]))
    async with Serving(cli, "--file", str(src), "--descriptors", n) as s:
        md = nc.RdmaMetadata.model_validate_json(s.metadata)
        assert len(md.descriptors) == int(n)
        dst = [bytearray(d.size) for d in md.descriptors]
        with await nc.Connector().begin_read(md, nc_common.descriptors(nc, dst)) as op:
            await waited(op.wait_for_completion(), T)
        await s.finished()
    assert b"".join(dst) == data


@pytest.mark.parametrize("shape", list(CLI_SHAPES))
async def test_cli_serves_writable_module_writes(nc, cli, tmp_path, shape):
    total = sum(CLI_SHAPES[shape])
    out = tmp_path / "out.bin"
    n = str(len(CLI_SHAPES[shape]))
    async with Serving(cli, "--size", str(total), "--writable", "--descriptors", n,
                       "--out", str(out)) as s:
        md = nc.RdmaMetadata.model_validate_json(s.metadata)
        src = patterns([d.size for d in md.descriptors], 92)
        with await nc.Connector().begin_write(nc_common.descriptors(nc, src), md) as op:
            await waited(op.wait_for_completion(), T)
        await s.finished()
    assert out.read_bytes() == b"".join(src)


@pytest.mark.parametrize("shape", list(CLI_SHAPES))
async def test_module_readable_cli_reads(nc, cli, tmp_path, shape):
    src = patterns(CLI_SHAPES[shape], 93)
    out = tmp_path / "out.bin"
    with await nc.Connector().create_readable(nc_common.descriptors(nc, src)) as readable:
        md = readable.metadata().model_dump_json()
        reader = asyncio.ensure_future(run_cli(cli, "read", "--metadata", "-", "--out", str(out),
                                               stdin=md.encode()))
        await waited(readable.wait_for_completion(), T)
        await reader
    assert out.read_bytes() == b"".join(src)


@pytest.mark.parametrize("shape", list(CLI_SHAPES))
async def test_module_writable_cli_writes(nc, cli, tmp_path, shape):
    dst = [bytearray(s) for s in CLI_SHAPES[shape]]
    data = bytes(pattern(sum(CLI_SHAPES[shape]), 94))
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    with await nc.Connector().create_writable(nc_common.descriptors(nc, dst)) as writable:
        md = writable.metadata().model_dump_json()
        writer = asyncio.ensure_future(run_cli(cli, "write", "--metadata", "-", "--file", str(src),
                                               stdin=md.encode()))
        await waited(writable.wait_for_completion(), T)
        await writer
    assert b"".join(dst) == data


async def test_cli_refuses_a_wrong_pairing(nc, cli, tmp_path):
    """A writable's metadata handed to `read`: the CLI says so and exits non-zero."""
    dst = bytearray(4096)
    with await nc.Connector().create_writable(nc.Descriptor(dst)) as writable:
        md = writable.metadata().model_dump_json()
        proc = await asyncio.create_subprocess_exec(
            cli, "read", "--metadata", "-", "--out", str(tmp_path / "o"), "--timeout", "10",
            cwd=ROOT, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
        _, err = await waited(proc.communicate(md.encode()), T)
    assert proc.returncode != 0
    assert "writable" in err.decode().lower(), err.decode()
    assert not (tmp_path / "o").exists()
