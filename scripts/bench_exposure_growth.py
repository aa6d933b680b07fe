"""Whether a small fresh exposure gets slower as the exposing connector's registrations grow, across
the exposer's rotations (docs/FIGURES.md, "Fresh exposures over many operations": flat for the first exposer, then
growing with the second's, NIXL inserting each registration into an address-sorted vector).

Dynamo's multimodal caller without its gather: 4 KiB, a fresh torch tensor per operation, both
sides in one process on uvloop. Prints, per window of WINDOW operations, the median time of one
operation and the exposing connector's live NIXL registrations (its counters).

    python scripts/bench_exposure_growth.py [OPERATIONS] [WINDOW]   (default 130000 10000)

The first exposer rotates after 256 MiB of quarantined exposures (65,536 of 4 KiB), so the
default runs into the second exposer's first 64,000.
"""
import asyncio
import statistics
import sys
import time

import torch
import uvloop

import nixl_connect as nc


async def main(operations: int, window: int) -> None:
    a, b = nc.Connector(), nc.Connector()
    payload, dst = b"x" * 4096, torch.zeros(4096, dtype=torch.uint8)
    times = []
    for i in range(operations):
        t0 = time.perf_counter()
        tensor = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        readable = await a.create_readable(nc.Descriptor(tensor))
        md = nc.RdmaMetadata.model_validate(readable.metadata().model_dump())
        op = await b.begin_read(md, nc.Descriptor(dst))
        await op.wait_for_completion()
        await readable.wait_for_completion()
        op.__exit__(None, None, None)
        readable.__exit__(None, None, None)
        times.append((time.perf_counter() - t0) * 1e6)
        if (i + 1) % window == 0:
            stats = (await a._create_connection())._core.stats()
            print(f"{i + 1:8d} operations: median {statistics.median(times[-window:]):7.1f} us, "
                  f"live registrations {stats['live_registrations']}", flush=True)


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 130000
    w = int(sys.argv[2]) if len(sys.argv) > 2 else 10000
    uvloop.run(main(n, w))
