#!/usr/bin/env python3
"""One Python Dynamo worker for nixl-connect's interop tests, using the unmodified
`dynamo.nixl_connect` module (ai-dynamo-runtime 1.6.1) and the real NIXL library.

Roles:
  readable  --size N [--descriptors K] [--hex]   expose N bytes of the test pattern; print metadata
  writable  --size N [--descriptors K] --out F   expose N writable bytes; print metadata; save to F
  read      --metadata F|- --out F               read what a readable's metadata describes
  write     --metadata F|- --file F              write F into what a writable's metadata describes
  validate  --metadata F|-                       parse with the strict pydantic model, print it back
  pattern   --size N --out F                     write the test pattern (what `serve --size` exposes)

Passive roles print the metadata JSON as one line on stdout, then wait (bounded by --timeout).
Every failure prints one line on stderr and exits 1.
"""
import argparse
import asyncio
import sys

import numpy as np

import dynamo.nixl_connect as nc


def pattern(n: int, seed: int) -> bytearray:
    """The same deterministic pattern as the Rust CLI's `serve --size` (pattern.rs)."""
    idx = np.arange((n + 7) // 8, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = np.uint64(seed) ^ (idx * np.uint64(0x9E3779B97F4A7C15))
        x ^= x >> np.uint64(31)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(29)
    return bytearray(x.astype("<u8").tobytes()[:n])


SEED = 0x6E69786C


def split_sizes(total: int, n: int) -> list:
    """Unequal sizes (weights 1..n), as the Rust CLI's --descriptors."""
    w = n * (n + 1) // 2
    sizes = [max(total // w * i, 1) for i in range(1, n + 1)]
    sizes[-1] = total - sum(sizes[:-1])
    return sizes


def descriptors(buf, sizes):
    arr = np.frombuffer(buf, dtype=np.uint8)
    out, off = [], 0
    for s in sizes:
        out.append(nc.Descriptor((arr[off:off + s], "cpu")))
        off += s
    return out[0] if len(out) == 1 else out


def read_md(src: str) -> "nc.RdmaMetadata":
    text = sys.stdin.read() if src == "-" else open(src).read()
    line = next((l for l in text.splitlines() if l.strip()), "")
    return nc.RdmaMetadata.model_validate_json(line)


def md_sizes(md) -> list:
    return [d.size for d in md.descriptors]


async def main(a) -> None:
    if a.role == "validate":
        md = read_md(a.metadata)
        print(md.model_dump_json(), flush=True)
        return
    if a.role == "pattern":
        with open(a.out, "wb") as f:
            f.write(pattern(a.size, SEED))
        return
    conn = nc.Connector()
    if a.role == "readable":
        buf = pattern(a.size, SEED)
        op = await conn.create_readable(descriptors(buf, split_sizes(a.size, a.descriptors)))
        print(op.metadata(hex_encode=a.hex).model_dump_json(), flush=True)
        await asyncio.wait_for(op.wait_for_completion(), a.timeout)
    elif a.role == "writable":
        buf = bytearray(a.size)
        op = await conn.create_writable(descriptors(buf, split_sizes(a.size, a.descriptors)))
        print(op.metadata(hex_encode=a.hex).model_dump_json(), flush=True)
        await asyncio.wait_for(op.wait_for_completion(), a.timeout)
        with open(a.out, "wb") as f:
            f.write(buf)
    elif a.role == "read":
        md = read_md(a.metadata)
        sizes = md_sizes(md)
        buf = bytearray(sum(sizes))
        op = await conn.begin_read(md, descriptors(buf, sizes))
        await asyncio.wait_for(op.wait_for_completion(), a.timeout)
        with open(a.out, "wb") as f:
            f.write(buf)
    elif a.role == "write":
        md = read_md(a.metadata)
        data = bytearray(open(a.file, "rb").read())
        sizes = md_sizes(md)
        if sum(sizes) != len(data):
            raise ValueError(f"{a.file} is {len(data)} bytes but the writable takes {sum(sizes)}")
        op = await conn.begin_write(descriptors(data, sizes), md)
        await asyncio.wait_for(op.wait_for_completion(), a.timeout)
    print("PY-DONE", file=sys.stderr, flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("role", choices=["readable", "writable", "read", "write", "validate", "pattern"])
    p.add_argument("--size", type=int, default=4096)
    p.add_argument("--descriptors", type=int, default=1)
    p.add_argument("--hex", action="store_true")
    p.add_argument("--metadata", default="-")
    p.add_argument("--out")
    p.add_argument("--file")
    p.add_argument("--timeout", type=float, default=60.0)
    args = p.parse_args()
    try:
        asyncio.run(main(args))
    except Exception as e:  # one clear line, non-zero exit
        print(f"py_peer {args.role}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
