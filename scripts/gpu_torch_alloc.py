#!/usr/bin/env python3
"""Tensors from PyTorch's allocator per operation (issue 46, item 2), beside tensors reused.

Two processes on one host, both running this project's Python module (`nixl_connect`): the
owner exposes a readable over a CUDA tensor for each operation (metadata is single-use), the
reader reads it into a CUDA tensor of its own. Two cases, each timed on the reader from
`begin_read` to completion:
  - reused: each side allocates its tensor once and uses it for every operation;
  - fresh:  each side allocates a new tensor per operation from PyTorch's caching allocator
            (`torch.empty`), keeping the last three alive so that addresses move inside the
            allocator's segments, the pattern of a worker allocating per request;
  - fresh-owner, fresh-reader: only that side allocates per operation (where the cost lies).
Every operation's bytes are checked (the owner fills its tensor with the operation's number).
Prints one JSON line per case: median and p90 microseconds per read, GB/s, and the path and
mechanism the reader's operations report. The Rust figure for raw `cuMemAlloc` per operation
is `nixl-connect bench --fresh` (scripts/gpu-run.sh prints it beside).

Usage: gpu_torch_alloc.py [--device cuda:0] [--size 8388608] [--iters 200] [--runs 3]
                          [--modes reused,fresh,fresh-owner,fresh-reader]
       (internal roles: owner MODE SIZE ITERS DEVICE | reader MODE ITERS DEVICE)
"""
import argparse
import asyncio
import collections
import json
import os
import statistics
import subprocess
import sys
import time


async def owner(mode, size, iters, device):
    import torch
    import nixl_connect as nc
    conn = nc.Connector()
    live = collections.deque(maxlen=3)
    t = torch.empty(size, dtype=torch.uint8, device=device)
    for i in range(iters):
        if mode in ("fresh", "fresh-owner"):
            t = torch.empty(size, dtype=torch.uint8, device=device)
            live.append(t)
        t.fill_(i % 251)
        if device != "cpu":
            torch.cuda.synchronize()
        with await conn.create_readable(nc.Descriptor(t)) as op:
            print("MD " + op.metadata().model_dump_json(), flush=True)
            await asyncio.wait_for(op.wait_for_completion(), 60)
    print("DONE", flush=True)


async def reader(mode, iters, device):
    import torch
    import nixl_connect as nc
    conn = nc.Connector()
    loop = asyncio.get_running_loop()
    live = collections.deque(maxlen=3)
    times, how, bad = [], set(), 0
    dst = None
    for i in range(iters):
        line = await loop.run_in_executor(None, sys.stdin.readline)
        md = nc.RdmaMetadata.model_validate_json(line)
        size = sum(d.size for d in md.descriptors)
        if dst is None or mode in ("fresh", "fresh-reader"):
            dst = torch.empty(size, dtype=torch.uint8, device=device)
            live.append(dst)
        start = time.perf_counter()
        with await conn.begin_read(md, nc.Descriptor(dst)) as op:
            await asyncio.wait_for(op.wait_for_completion(), 60)
            times.append(time.perf_counter() - start)
            how.add(f"{op.path} ({op.mechanism})")
        if not bool((dst == i % 251).all()):
            bad += 1
    times = times[min(10, len(times) // 10):]  # the first operations open mappings and streams
    med = statistics.median(times)
    p90 = sorted(times)[int(len(times) * 0.9)]
    print("RESULT " + json.dumps({"size": size, "median_us": round(med * 1e6, 1),
                                  "p90_us": round(p90 * 1e6, 1), "GBps": round(size / med / 1e9, 2),
                                  "how": sorted(how), "ops_with_wrong_bytes": bad}), flush=True)


def run_case(mode, size, iters, device):
    me = [sys.executable, os.path.abspath(__file__)]
    own = subprocess.Popen(me + ["owner", mode, str(size), str(iters), device], stdout=subprocess.PIPE, text=True)
    rd = subprocess.Popen(me + ["reader", mode, str(iters), device], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True)
    result = None
    try:
        for _ in range(iters):
            line = own.stdout.readline()
            if not line.startswith("MD "):
                raise RuntimeError(f"owner said {line!r}")
            rd.stdin.write(line[3:])
            rd.stdin.flush()
        for line in rd.stdout:
            if line.startswith("RESULT "):
                result = json.loads(line[7:])
                break
    finally:
        for p in (own, rd):
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
    return result


def main():
    if len(sys.argv) > 1 and sys.argv[1] in ("owner", "reader"):
        # Protocol lines on stdout only: everything else the libraries print goes to stderr.
        proto = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)
        sys.stdout = proto
        if sys.argv[1] == "owner":
            asyncio.run(owner(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]))
        else:
            asyncio.run(reader(sys.argv[2], int(sys.argv[3]), sys.argv[4]))
        return
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--size", type=int, default=8 << 20)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--modes", default="reused,fresh")
    a = p.parse_args()
    for run in range(1, a.runs + 1):
        for mode in a.modes.split(","):  # interleaved
            r = run_case(mode, a.size, a.iters, a.device)
            print(json.dumps({"bench": "torch_alloc", "run": run, "mode": mode, "device": a.device,
                              "iters": a.iters, **(r or {"error": "no result"})}), flush=True)


if __name__ == "__main__":
    main()
