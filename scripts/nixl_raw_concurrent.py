#!/usr/bin/env python3
"""Raw NIXL with many transfers outstanding: the anchor for `nixl-connect bench --path nixl
--concurrency N` (issue 28). ../shared/anchors/nixl_raw_pair.py times one transfer at a time; this
times rounds of N at once, the way the bench does.

Two processes, the NIXL Python API over the UCX backend (no nixl-connect, no Dynamo). The target
registers N buffers of SIZE bytes once and hands its agent metadata and addresses to the initiator
over a pipe. The initiator registers its own N buffers once, loads the target's metadata once,
and then per round (timed): one `initialize_xfer` per buffer pair (each with its own
notification), all posted, polled until every one is DONE, all released. The target counts the
N notifications of a round before it acknowledges it (outside the timed part). The first round's
bytes are verified.

    python scripts/nixl_raw_concurrent.py [--op READ|WRITE] [--size 4096] [--concurrency 64]
                                          [--rounds 200] [--runs 3]
    -> one JSON line per run, then one with the medians; UCX_TLS comes from the environment
"""
import argparse
import base64
import json
import multiprocessing as mp
import statistics
import time


def agent(name):
    from nixl._api import nixl_agent, nixl_agent_config

    a = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
    a.create_backend("UCX", {})
    return a


def fill(size, seed):
    import numpy as np

    return np.frombuffer(np.random.default_rng(seed).bytes(size), dtype=np.uint8).copy()


def target(conn, op, size, n):
    import numpy as np

    bufs = [fill(size, k) if op == "READ" else np.zeros(size, np.uint8) for k in range(n)]
    a = agent("target")
    a.register_memory([(b.ctypes.data, size, 0, "") for b in bufs], "DRAM")
    conn.send({"md": base64.b64encode(a.get_agent_metadata()).decode(),
               "addrs": [b.ctypes.data for b in bufs]})
    while True:
        msg = conn.recv()
        if msg == "quit":
            break
        conn.send("armed")
        got = 0
        deadline = time.monotonic() + 30
        while got < n:
            got += sum(len(v) for v in a.get_new_notifs().values())
            if time.monotonic() > deadline:
                raise SystemExit(f"target: {got} of {n} notifications in 30 s")
        ok = op == "READ" or all(np.array_equal(b, fill(size, 1000 + k)) for k, b in enumerate(bufs))
        conn.send(ok)


def initiator(conn, op, size, n, rounds):
    import numpy as np

    bufs = [fill(size, 1000 + k) if op == "WRITE" else np.zeros(size, np.uint8) for k in range(n)]
    a = agent("initiator")
    a.register_memory([(b.ctypes.data, size, 0, "") for b in bufs], "DRAM")
    info = conn.recv()
    peer = a.add_remote_agent(base64.b64decode(info["md"]))
    local = [a.get_xfer_descs([(b.ctypes.data, size, 0)], "DRAM") for b in bufs]
    remote = [a.get_xfer_descs([(addr, size, 0)], "DRAM") for addr in info["addrs"]]
    times, ok = [], True
    for r in range(rounds + 3):
        conn.send("round")
        assert conn.recv() == "armed"
        t0 = time.perf_counter()
        hs = [a.initialize_xfer(op, local[k], remote[k], peer, f"{r}:{k}".encode()) for k in range(n)]
        states = [a.transfer(h) for h in hs]
        for k, h in enumerate(hs):
            while states[k] == "PROC":
                states[k] = a.check_xfer_state(h)
            if states[k] != "DONE":
                raise SystemExit(f"initiator: transfer {k} ended {states[k]}")
        for h in hs:
            a.release_xfer_handle(h)
        dt = time.perf_counter() - t0
        peer_ok = conn.recv()
        if r == 0:
            ok = peer_ok and (op == "WRITE" or all(np.array_equal(b, fill(size, k)) for k, b in enumerate(bufs)))
        if r >= 3:
            times.append(dt)
    conn.send("quit")
    med = statistics.median(times)
    conn.send({"round_us": med * 1e6, "ops_per_s": n / med, "ok": bool(ok)})


def one_run(op, size, n, rounds):
    ctx = mp.get_context("spawn")
    ta, tb = ctx.Pipe()
    ia, ib = ctx.Pipe()
    # The initiator talks to the target through this process (two pipes, relayed).
    pt = ctx.Process(target=target, args=(tb, op, size, n))
    pi = ctx.Process(target=initiator, args=(ib, op, size, n, rounds))
    pt.start()
    pi.start()
    try:
        ia.send(ta.recv())
        while True:
            msg = ia.recv()
            if isinstance(msg, dict):
                return msg
            ta.send(msg)
            if msg == "quit":
                continue
            ia.send(ta.recv())  # "armed"
            ia.send(ta.recv())  # the round's verdict
    finally:
        for p in (pi, pt):
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--op", default="READ", choices=["READ", "WRITE"])
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    runs = []
    for run in range(args.runs):
        r = one_run(args.op, args.size, args.concurrency, args.rounds)
        r.update(run=run + 1, anchor="nixl_raw_concurrent", op=args.op, size=args.size,
                 concurrency=args.concurrency)
        print(json.dumps(r), flush=True)
        runs.append(r)
    print(json.dumps({"anchor": "nixl_raw_concurrent", "op": args.op, "size": args.size,
                      "concurrency": args.concurrency, "runs": len(runs),
                      "round_us_median": statistics.median(r["round_us"] for r in runs),
                      "ops_per_s_median": statistics.median(r["ops_per_s"] for r in runs),
                      "ok": all(r["ok"] for r in runs)}))


if __name__ == "__main__":
    main()
