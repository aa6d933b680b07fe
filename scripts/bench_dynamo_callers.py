"""Dynamo's own callers timed on both modules, in one run (scripts/bench.sh runs it).

1. Dynamo's read-based embedding transfer (`NixlReadEmbeddingSender` / `NixlReadEmbeddingReceiver`,
   unmodified) between two processes, metadata over a pipe: the receiver's time per received
   tensor (begin_read to complete; the first tensor, which connects, is left out), for 8 MiB
   float32 and 512 KiB bf16 tensors. `dynamo.nixl_connect` is Dynamo's module, or ours through
   NIXL_CONNECT_AS_DYNAMO=1. (tests/python/dynamo_embed_peer.py plays both sides.)
2. 4 KiB in one process, both sides complete: create_readable + begin_read + both
   wait_for_completion() (two Connectors).

    python scripts/bench_dynamo_callers.py [RUNS]     -> JSON lines, then medians of the runs
"""
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEER = os.path.join(ROOT, "tests", "python", "dynamo_embed_peer.py")
PY = sys.executable
MODULES = ("nixl_connect", "dynamo.nixl_connect")
CASES = (("float32", 8 << 20, 16), ("bfloat16", 512 << 10, 30))

INPROC = r"""
import asyncio, importlib, json, statistics, sys, time
nc = importlib.import_module(sys.argv[1]); iters = int(sys.argv[2])
async def main():
    a, b = nc.Connector(), nc.Connector()
    src, dst = bytearray(b"x" * 4096), bytearray(4096)
    times = []
    for i in range(iters):
        t0 = time.perf_counter()
        r = await a.create_readable(nc.Descriptor(src))
        op = await b.begin_read(r.metadata(), nc.Descriptor(dst))
        await asyncio.gather(op.wait_for_completion(), r.wait_for_completion())
        times.append((time.perf_counter() - t0) * 1e6)
        r.__exit__(None, None, None); op.__exit__(None, None, None)
    print(json.dumps({"median_us": round(statistics.median(times[10:]), 1)}))
asyncio.run(main())
"""


def env_for(module):
    env = dict(os.environ, NIXL_LOG_LEVEL="FATAL", UCX_LOG_LEVEL="fatal")
    env.pop("NIXL_CONNECT_AS_DYNAMO", None)
    if module == "nixl_connect":
        env["NIXL_CONNECT_AS_DYNAMO"] = "1"
    return env


def embed(module, dtype, size, count):
    env = env_for(module)
    s = subprocess.Popen([PY, PEER, "sender", str(count), str(size), dtype], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, env=env, text=True)
    r = subprocess.run([PY, PEER, "receiver", str(count), str(size), dtype], stdin=s.stdout,
                       capture_output=True, text=True, env=env, timeout=600)
    s.wait(timeout=120)
    if r.returncode != 0:
        raise SystemExit(f"embedding pair ({module}) failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])["median_us"]


def inproc(module, iters=300):
    r = subprocess.run([PY, "-c", INPROC, module, str(iters)], capture_output=True, text=True,
                       env=env_for("dynamo.nixl_connect"), timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"4 KiB in-process ({module}) failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])["median_us"]


def main():
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    rows = {}
    for run in range(1, runs + 1):
        for module in MODULES:
            for dtype, size, count in CASES:
                us = embed(module, dtype, size, count)
                rows.setdefault(("embed", dtype, size, module), []).append(us)
                print(json.dumps({"run": run, "bench": "dynamo_embedding_transfer", "module": module,
                                  "dtype": dtype, "size": size, "receive_median_us": us}), flush=True)
            us = inproc(module)
            rows.setdefault(("4KiB", "", 4096, module), []).append(us)
            print(json.dumps({"run": run, "bench": "4KiB_both_sides_in_process", "module": module,
                              "median_us": us}), flush=True)
    print(f"\nmedians of {runs} runs (µs)", file=sys.stderr)
    keys = sorted({k[:3] for k in rows})
    for k in keys:
        ours = statistics.median(rows[k + ("nixl_connect",)])
        dyn = statistics.median(rows[k + ("dynamo.nixl_connect",)])
        label = f"{k[0]} {k[1]} {k[2] >> 10} KiB".strip()
        print(f"  {label:36s} nixl_connect {ours:10.1f}   dynamo.nixl_connect {dyn:10.1f}   "
              f"ratio {ours / dyn:6.1%}", file=sys.stderr)


if __name__ == "__main__":
    main()
