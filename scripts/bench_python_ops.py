"""The Python module's cost per operation: 4 KiB, both sides in one process, on asyncio and on
uvloop (Dynamo runs its workers on uvloop), for two caller patterns, beside Dynamo's own module.

Patterns (each iteration is one whole operation, both sides complete; medians of the iterations
after the first 10, which connect):

- `plain`: `create_readable(Descriptor(bytearray))`, `begin_read(readable.metadata(),
  Descriptor(bytearray))`, both `wait_for_completion()` gathered, both released.
- `dynamo`: Dynamo 1.6.1's multimodal caller (`dynamo.common.multimodal.mm_kwargs_transfer`):
  the sender wraps the payload in a fresh tensor (`torch.frombuffer(bytearray(...))`) and a fresh
  `Descriptor`, creates the readable and ships `metadata().model_dump()`; the receiver validates
  it back (`RdmaMetadata.model_validate`), reads into a fresh `Descriptor` over its tensor inside a
  gathered task, and the sender's cleanup awaits the readable under `asyncio.wait_for(gather(...,
  return_exceptions=True))` before releasing it.
- `caller`: the `dynamo` pattern's own steps (the tensor, `model_dump`/`model_validate` of one
  `RdmaMetadata`, the gathered task, `wait_for(gather(...))`) with each call into the module
  replaced by an awaitable that is already complete: the floor any implementation of the module
  sits on under this caller. Not a measurement of either module: it runs for `nixl_connect` only.

    python scripts/bench_python_ops.py [RUNS] [ITERS]   -> JSON lines, then a table on stderr

`dynamo.nixl_connect` (Dynamo's module, milliseconds an operation here) runs ITERS // 10
iterations. The Rust anchors run in each run beside them when their binary is there
(`crates/nixl-connect/examples/in_process_pair.rs`, built by scripts/bench.sh): the `plain`
pattern without Python (memory reused), and with `fresh` memory per operation, as the `dynamo`
pattern's tensors are (each readable then registers its memory and makes new metadata, which
the reader decodes): the Rust floor under the `dynamo` pattern. The table's last lines give each
pattern's cost above its floor (`plain` over the Rust anchor; `dynamo` over `caller` plus the
fresh Rust anchor).
"""
import json
import os
import statistics
import subprocess
import sys

PY = sys.executable
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The Rust anchor: built here by scripts/bench.sh; the GPU bundle names its copy.
RUST = os.environ.get("IN_PROCESS_PAIR",
                      os.path.join(ROOT, "target", "release", "examples", "in_process_pair"))
MODULES = ("nixl_connect", "dynamo.nixl_connect")
LOOPS = ("asyncio", "uvloop")
PATTERNS = ("plain", "dynamo", "caller")

ONE = r"""
import asyncio, importlib, json, statistics, sys, time
module, loop_kind, pattern, iters = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
nc = importlib.import_module(module)
if pattern in ("dynamo", "caller"):
    import torch

async def plain(a, b, src, dst):
    r = await a.create_readable(nc.Descriptor(src))
    op = await b.begin_read(r.metadata(), nc.Descriptor(dst))
    await asyncio.gather(op.wait_for_completion(), r.wait_for_completion())
    r.__exit__(None, None, None)
    op.__exit__(None, None, None)

async def dynamo(a, b, payload, dst):
    # sender (mm_kwargs_transfer's register): a fresh tensor and Descriptor per payload
    tensor = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    readable = await a.create_readable(nc.Descriptor(tensor))
    request = readable.metadata().model_dump()
    # receiver: metadata validated back, the read in a gathered task
    rm = nc.RdmaMetadata.model_validate(request)
    async def do_read(rm=rm, d=nc.Descriptor(dst)):
        read_op = await b.begin_read(rm, d)
        await read_op.wait_for_completion()
        read_op.__exit__(None, None, None)
    await asyncio.gather(do_read())
    # sender's cleanup: bounded wait, then release
    await asyncio.wait_for(asyncio.gather(readable.wait_for_completion(), return_exceptions=True),
                           timeout=30)
    readable.__exit__(None, None, None)

async def _complete(value=None):
    return value

async def caller(a, b, payload, dst):
    # Dynamo's caller with every call into the module replaced by an awaitable already complete
    # (and the readable's metadata made once): what the pattern costs before any implementation.
    tensor = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    await _complete(tensor)
    request = SAMPLE.model_dump()
    rm = nc.RdmaMetadata.model_validate(request)
    async def do_read(rm=rm, d=dst):
        await _complete(rm)
        await _complete(d)
    await asyncio.gather(do_read())
    await asyncio.wait_for(asyncio.gather(_complete(), return_exceptions=True), timeout=30)

async def main():
    global SAMPLE
    a, b = nc.Connector(), nc.Connector()
    if pattern == "plain":
        src, dst, one = bytearray(b"x" * 4096), bytearray(4096), plain
    else:
        src, dst, one = b"x" * 4096, torch.zeros(4096, dtype=torch.uint8), dynamo
    if pattern == "caller":
        r = await a.create_readable(nc.Descriptor(src))
        SAMPLE, one = r.metadata(), caller
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        await one(a, b, src, dst)
        times.append((time.perf_counter() - t0) * 1e6)
    print(json.dumps({"median_us": round(statistics.median(times[10:]), 1)}))

if loop_kind == "uvloop":
    import uvloop
    uvloop.run(main())
else:
    asyncio.run(main())
"""


def env_for(module):
    env = dict(os.environ, NIXL_LOG_LEVEL="FATAL", UCX_LOG_LEVEL="fatal")
    env.pop("NIXL_CONNECT_AS_DYNAMO", None)
    return env


def one(module, loop_kind, pattern, iters):
    r = subprocess.run([PY, "-c", ONE, module, loop_kind, pattern, str(iters)], capture_output=True,
                       text=True, env=env_for(module), timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"{module} {loop_kind} {pattern} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])["median_us"]


def rust(iters, fresh=False):
    env = dict(os.environ)
    env.setdefault("NIXL_CONNECT_LIB", os.path.join(ROOT, ".nixl", "lib"))
    r = subprocess.run([RUST, str(iters)] + (["fresh"] if fresh else []), capture_output=True,
                       text=True, env=env, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"the Rust anchor failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])["median_us"]


def installed(module):
    r = subprocess.run([PY, "-c", f"import {module}"], capture_output=True, env=env_for(module))
    return r.returncode == 0


def main():
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    iters = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
    modules = [m for m in MODULES if installed(m)]
    for m in MODULES:
        if m not in modules:
            print(f"{m}: not importable here, skipped", file=sys.stderr)
    if "nixl_connect" not in modules:
        raise SystemExit("nixl_connect is not importable: build it first (scripts/bench.sh does)")
    rows = {}
    for run in range(1, runs + 1):
        if os.path.exists(RUST):
            us = rust(iters)
            rows.setdefault(("rust",), []).append(us)
            print(json.dumps({"run": run, "bench": "rust_4KiB_in_process", "iters": iters,
                              "median_us": us}), flush=True)
            us = rust(iters, fresh=True)
            rows.setdefault(("rust-fresh",), []).append(us)
            print(json.dumps({"run": run, "bench": "rust_4KiB_in_process", "memory": "fresh",
                              "iters": iters, "median_us": us}), flush=True)
        for pattern in PATTERNS:
            for loop_kind in LOOPS:
                for module in modules:
                    if pattern == "caller" and module != "nixl_connect":
                        continue
                    n = iters if module == "nixl_connect" else max(20, iters // 10)
                    us = one(module, loop_kind, pattern, n)
                    rows.setdefault((pattern, loop_kind, module), []).append(us)
                    print(json.dumps({"run": run, "bench": "python_4KiB_in_process",
                                      "module": None if pattern == "caller" else module,
                                      "loop": loop_kind, "pattern": pattern, "iters": n,
                                      "median_us": us}), flush=True)
    print(f"\n4 KiB, both sides in one process: medians of {runs} runs (run medians in brackets), us",
          file=sys.stderr)
    if ("rust",) in rows:
        print(f"  plain   Rust     in_process_pair {statistics.median(rows[('rust',)]):8.1f} "
              f"{sorted(rows[('rust',)])}", file=sys.stderr)
        print(f"  fresh   Rust     in_process_pair {statistics.median(rows[('rust-fresh',)]):8.1f} "
              f"{sorted(rows[('rust-fresh',)])}", file=sys.stderr)
    for pattern in PATTERNS:
        for loop_kind in LOOPS:
            ours = rows[(pattern, loop_kind, "nixl_connect")]
            if pattern == "caller":
                print(f"  {pattern:7s} {loop_kind:8s} (no module) {statistics.median(ours):9.1f} "
                      f"{sorted(ours)}", file=sys.stderr)
                continue
            dyn = rows.get((pattern, loop_kind, "dynamo.nixl_connect"))
            theirs = f"   dynamo.nixl_connect {statistics.median(dyn):8.1f}" if dyn else ""
            print(f"  {pattern:7s} {loop_kind:8s} nixl_connect {statistics.median(ours):8.1f} {sorted(ours)}"
                  + theirs, file=sys.stderr)
    if ("rust",) in rows:
        med = lambda k: statistics.median(rows[k])
        print("Above the floor (medians), us:", file=sys.stderr)
        for loop_kind in LOOPS:
            plain = med(("plain", loop_kind, "nixl_connect")) - med(("rust",))
            dyn = (med(("dynamo", loop_kind, "nixl_connect")) - med(("caller", loop_kind, "nixl_connect"))
                   - med(("rust-fresh",)))
            print(f"  {loop_kind:8s} plain - Rust {plain:7.1f}   dynamo - (caller + Rust fresh) {dyn:7.1f}",
                  file=sys.stderr)


if __name__ == "__main__":
    main()
