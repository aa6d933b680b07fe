#!/usr/bin/env python3
"""Subprocess peer for the cross-process tests of tests/python.

    peer.py MODULE ROLE [--sizes 4096,...] [--seed N] [--timeout S] [--style bytearray|numpy]

MODULE is the import name ("dynamo.nixl_connect" or "nixl_connect"): the peer's module may differ
from the test's own. Roles:

  readable   expose pattern(sizes, seed) readable; print "MD <json>"; wait; print "RESULT {...}"
  writable   expose zeroed buffers of sizes;        print "MD <json>"; wait; print "RESULT {sha256}"
  read       read "<json>" (one line) from stdin; read into fresh buffers; print
             "RESULT {sha256, path, mechanism}"
  write      read "<json>" from stdin; write pattern(md sizes, seed) into it; print "RESULT {...}"
  emit       print "MD <json>" for a readable over 8 unequal buffers, then "MDW <json>" for a
             writable and "MDHEX <json>" (hex_encode=True), then exit without waiting

The protocol lines go to the original stdout only; everything else written to fd 1 (NIXL's Python
logger, UCX) is redirected to stderr, so the parent can parse stdout line by line. Any failure
prints "ERROR <type>: <message>" on the protocol channel and exits 1.
"""
import argparse
import asyncio
import json
import os
import sys

# Protocol channel: a private copy of stdout; fd 1 itself becomes stderr before anything logs.
_proto = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
sys.stdout = sys.stderr

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nc_common  # noqa: E402


def say(tag: str, payload: str) -> None:
    _proto.write(f"{tag} {payload}\n")
    _proto.flush()


async def main(a) -> None:
    nc = nc_common.import_module(a.module)
    conn = nc.Connector()
    if a.role == "emit":
        bufs = nc_common.patterns(nc_common.UNEQUAL_SIZES, a.seed)
        rd = await conn.create_readable(nc_common.descriptors(nc, bufs))
        say("MD", rd.metadata().model_dump_json())
        wbufs = [bytearray(s) for s in nc_common.UNEQUAL_SIZES]
        wr = await conn.create_writable(nc_common.descriptors(nc, wbufs))
        say("MDW", wr.metadata().model_dump_json())
        hbufs = [bytearray(4096)]
        hx = await conn.create_readable(nc_common.descriptors(nc, hbufs))
        say("MDHEX", hx.metadata(hex_encode=True).model_dump_json())
        say("RESULT", json.dumps({"ok": True}))
        return
    if a.role in ("readable", "writable"):
        sizes = [int(s) for s in a.sizes.split(",")]
        if a.role == "readable":
            bufs = nc_common.patterns(sizes, a.seed)
            op = await conn.create_readable(nc_common.descriptors(nc, bufs, a.style))
        else:
            bufs = [bytearray(s) for s in sizes]
            op = await conn.create_writable(nc_common.descriptors(nc, bufs, a.style))
        with op:
            say("MD", op.metadata().model_dump_json())
            await asyncio.wait_for(op.wait_for_completion(), a.timeout)
        say("RESULT", json.dumps({"ok": True, "sha256": nc_common.sha256_of(bufs)}))
        return
    line = sys.stdin.readline()
    md = nc.RdmaMetadata.model_validate_json(line)
    sizes = [d.size for d in md.descriptors]
    if a.role == "read":
        bufs = [bytearray(s) for s in sizes]
        with await conn.begin_read(md, nc_common.descriptors(nc, bufs, a.style)) as op:
            await asyncio.wait_for(op.wait_for_completion(), a.timeout)
            how = (getattr(op, "path", None), getattr(op, "mechanism", None))
    else:
        bufs = nc_common.patterns(sizes, a.seed)
        with await conn.begin_write(nc_common.descriptors(nc, bufs, a.style), md) as op:
            await asyncio.wait_for(op.wait_for_completion(), a.timeout)
            how = (getattr(op, "path", None), getattr(op, "mechanism", None))
    # `path` and `mechanism` are nixl_connect's extras (None with Dynamo's module).
    say("RESULT", json.dumps({"ok": True, "sha256": nc_common.sha256_of(bufs), "path": how[0],
                              "mechanism": how[1]}))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("module")
    p.add_argument("role", choices=["readable", "writable", "read", "write", "emit"])
    p.add_argument("--sizes", default="4096")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=float, default=15.0)
    p.add_argument("--style", choices=["bytearray", "numpy"], default="bytearray")
    args = p.parse_args()
    try:
        asyncio.run(main(args))
    except BaseException as e:  # noqa: BLE001 - one clear line for the parent, non-zero exit
        say("ERROR", f"{type(e).__name__}: {e}".replace("\n", " "))
        sys.exit(1)
