"""Python pair benchmark, both sides timed: a server process exposes a readable per iteration and a
client process reads it, with either module (`dynamo.nixl_connect` or `nixl_connect`).

    python scripts/py_pair_bench.py MODULE SIZE ITERS      -> one JSON line on stdout

Per iteration, on the host's monotonic clock (shared by both processes):
  client_us  from the metadata line in hand (parse included) to the client's read complete
  server_us  from create_readable to the server's wait_for_completion returning
  both_us    from the client's start to the later of the two completions: the operation complete
             on both sides
The anchor ../shared/anchors/py_pair.py times the client only; scripts/bench.sh runs both.
"""
import asyncio
import importlib
import json
import os
import statistics
import subprocess
import sys
import time


async def server(nc, size, iters, r, w):
    conn = nc.Connector()
    buf = bytearray(os.urandom(size))
    for _ in range(iters):
        t0 = time.perf_counter()
        op = await conn.create_readable(nc.Descriptor(buf))
        w.write(op.metadata().model_dump_json() + "\n")
        w.flush()
        await op.wait_for_completion()
        t1 = time.perf_counter()
        op.__exit__(None, None, None)
        w.write(f"{t0!r} {t1!r}\n")
        w.flush()
        r.readline()


async def client(nc, size, iters, r, w):
    conn = nc.Connector()
    dst = bytearray(size)
    rows = []
    for _ in range(iters):
        line = r.readline()
        t0 = time.perf_counter()
        md = nc.RdmaMetadata.model_validate_json(line)
        op = await conn.begin_read(md, nc.Descriptor(dst))
        await op.wait_for_completion()
        t1 = time.perf_counter()
        op.__exit__(None, None, None)
        s0, s1 = (float(x) for x in r.readline().split())
        rows.append((t1 - t0, s1 - s0, max(t1, s1) - t0))
        w.write("ack\n")
        w.flush()
    med = [statistics.median(c) for c in zip(*rows)]
    print(json.dumps({"module": nc.__name__, "size": size, "iters": iters,
                      "client_us": med[0] * 1e6, "server_us": med[1] * 1e6, "both_us": med[2] * 1e6,
                      "GBps": size / med[0] / 1e9}))


def main():
    if len(sys.argv) == 4:  # the parent: start the pair
        a_r, b_w = os.pipe()
        b_r, a_w = os.pipe()
        me = os.path.abspath(__file__)
        args = sys.argv[1:]
        s = subprocess.Popen([sys.executable, me, "server", *args, str(a_r), str(a_w)],
                             pass_fds=(a_r, a_w), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        c = subprocess.Popen([sys.executable, me, "client", *args, str(b_r), str(b_w)],
                             pass_fds=(b_r, b_w), stderr=subprocess.DEVNULL)
        for fd in (a_r, a_w, b_r, b_w):
            os.close(fd)
        rc = c.wait(timeout=600)
        s.wait(timeout=60)
        sys.exit(rc)
    role, module, size, iters, rfd, wfd = sys.argv[1:]
    nc = importlib.import_module(module)
    r, w = os.fdopen(int(rfd), "r"), os.fdopen(int(wfd), "w")
    run = server if role == "server" else client
    asyncio.run(run(nc, int(size), int(iters), r, w))


if __name__ == "__main__":
    main()
