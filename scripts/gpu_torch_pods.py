#!/usr/bin/env python3
"""PyTorch tensors between pods (issue 41, item 3: "the PyTorch case measured beside it").

Two processes, each in its own PID, IPC and mount namespaces (own /proc), sharing only the socket
directory, both running this project's Python module (`nixl_connect`): the owner exposes a fresh
readable over one torch tensor per operation (metadata is single-use), the reader reads it into
a torch tensor of its own; every byte of the first and last operation is checked. Run for each
allocator setting (PyTorch's default, `expandable_segments:True`) and size; prints one JSON line
per case (median microseconds per read, GB/s, path and mechanism as the reader's operation
reports them). Needs root (unshare).

Usage: gpu_torch_pods.py [--device cuda:0] [--sizes 16777216,67108864] [--iters 20]
       (internal roles: owner SIZE ITERS DEVICE | reader ITERS DEVICE)
"""
import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

POD = ["unshare", "--pid", "--ipc", "--mount", "--fork", "--kill-child", "--mount-proc"]


def pattern(torch, n, device):
    return (torch.arange(n, dtype=torch.int64, device=device) % 251).to(torch.uint8)


async def owner(size, iters, device):
    import torch
    import nixl_connect as nc
    conn = nc.Connector()
    # The tensor first (with expandable segments it then starts its segment: a tensor of up to
    # 20 MiB lies in one of the segment's allocations), its bytes after.
    t = torch.empty(size, dtype=torch.uint8, device=device)
    t.copy_(pattern(torch, size, device))
    if device != "cpu":
        torch.cuda.synchronize()
    for _ in range(iters):
        with await conn.create_readable(nc.Descriptor(t)) as op:
            print("MD " + op.metadata().model_dump_json(), flush=True)
            await asyncio.wait_for(op.wait_for_completion(), 60)
    print("DONE", flush=True)


async def reader(iters, device):
    import torch
    import nixl_connect as nc
    conn = nc.Connector()
    times, how, ok = [], set(), True
    loop = asyncio.get_running_loop()
    for i in range(iters):
        line = await loop.run_in_executor(None, sys.stdin.readline)
        md = nc.RdmaMetadata.model_validate_json(line)
        size = sum(d.size for d in md.descriptors)
        dst = torch.empty(size, dtype=torch.uint8, device=device)
        start = time.perf_counter()
        with await conn.begin_read(md, nc.Descriptor(dst)) as op:
            await asyncio.wait_for(op.wait_for_completion(), 60)
            times.append(time.perf_counter() - start)
            how.add(f"{op.path} ({op.mechanism})")
        if i in (0, iters - 1):
            ok = ok and bool(torch.equal(dst, pattern(torch, size, device)))
    med = statistics.median(times)
    print("RESULT " + json.dumps({"size": size, "median_us": med * 1e6, "GBps": size / med / 1e9,
                                  "how": sorted(how), "bytes_checked": ok}), flush=True)


def run_case(conf, share, size, iters, device, sockdir):
    env = dict(os.environ, NIXL_CONNECT_SOCKET_DIR=sockdir)
    env.pop("NIXL_CONNECT_SHARE_VMM", None)
    if share:
        env["NIXL_CONNECT_SHARE_VMM"] = "1"
    if conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = conf
    else:
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    me = [sys.executable, os.path.abspath(__file__)]
    own = subprocess.Popen(POD + me + ["owner", str(size), str(iters), device], env=env,
                           stdout=subprocess.PIPE, text=True)
    rd = subprocess.Popen(POD + me + ["reader", str(iters), device], env=env,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
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
            asyncio.run(owner(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]))
        else:
            asyncio.run(reader(int(sys.argv[2]), sys.argv[3]))
        return
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--sizes", default="16777216,67108864,268435456")
    p.add_argument("--iters", type=int, default=10)
    a = p.parse_args()
    sockdir = tempfile.mkdtemp(prefix="nxc-torch-pods-")
    os.chmod(sockdir, 0o777)
    # PyTorch's default allocator; expandable segments as they are (not this crate's memory: the
    # owner refuses to share it with another pod); and with NIXL_CONNECT_SHARE_VMM=1.
    confs = [("", False), ("expandable_segments:True", False), ("expandable_segments:True", True)]
    for conf, share in confs if a.device != "cpu" else [("", False)]:
        for size in (int(s) for s in a.sizes.split(",")):
            r = run_case(conf, share, size, a.iters, a.device, sockdir)
            print(json.dumps({"torch_alloc": conf or "default", "share_vmm": share, "device": a.device,
                              "pods": True, "iters": a.iters, **(r or {"error": "no result"})}),
                  flush=True)


if __name__ == "__main__":
    main()
