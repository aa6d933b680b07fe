"""Reproduces issue 63, finding 7 (forking while a thread's waits drive the engine), and says where
each child that hangs is stuck (gdb's backtrace of its threads).

A thread reads 4 KiB readables between two connectors in a loop; the main thread forks FORKS
children, PARALLEL alive at once. Each child reads through the connectors it inherited (they make
fresh connections there) and through a fresh pair. A child that has not exited after 12 s is
dumped with gdb and killed.

Usage: .venv/bin/python scripts/fork_during_driven_waits.py [FORKS] [PARALLEL]
Prints `forks=N failed=N hung=N`, and each hung child's stacks (where gdb is installed).
`tests/python/test_dynamo_callers.py` runs it with 200 forks; 500 is the issue's measure.
"""
import asyncio
import os
import subprocess
import sys
import threading
import time

import nixl_connect as nc

FORKS = int(sys.argv[1]) if len(sys.argv) > 1 else 200
PARALLEL = int(sys.argv[2]) if len(sys.argv) > 2 else 8


async def transfer(a, b, n):
    src, dst = bytearray(os.urandom(n)), bytearray(n)
    with await a.create_readable(nc.Descriptor(src)) as r:
        op = await b.begin_read(r.metadata(), nc.Descriptor(dst))
        await asyncio.wait_for(asyncio.gather(op.wait_for_completion(), r.wait_for_completion()), 10)
    assert dst == src


def main():
    a, b = nc.Connector(), nc.Connector()
    stop = threading.Event()

    def driver():
        async def loop():
            while not stop.is_set():
                await transfer(a, b, 4096)
        asyncio.run(loop())

    drive = threading.Thread(target=driver, daemon=True)
    drive.start()
    time.sleep(0.5)
    live, failed, hung = {}, 0, 0
    for k in range(FORKS):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                asyncio.run(transfer(a, b, 4096))
                c, d = nc.Connector(), nc.Connector()
                asyncio.run(transfer(c, d, 4096))
                code = 0
            except BaseException as e:  # noqa: BLE001 - reported, the child exits 1
                print(f"child {k}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            finally:
                os._exit(code)
        live[pid] = (k, time.time())
        while len(live) >= PARALLEL or (k == FORKS - 1 and live):
            for p, (j, t) in list(live.items()):
                r, status = os.waitpid(p, os.WNOHANG)
                if r:
                    live.pop(p)
                    failed += int(not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0))
                elif time.time() - t > 12:
                    hung += 1
                    print(f"=== child {j} (pid {p}) hung", flush=True)
                    try:
                        out = subprocess.run(["gdb", "-p", str(p), "-batch", "-ex", "thread apply all bt 30"],
                                             capture_output=True, text=True, timeout=120).stdout
                    except (OSError, subprocess.TimeoutExpired) as e:
                        out = f"# no stacks: {e}"
                    print("\n".join(l for l in out.splitlines() if l.startswith(("#", "Thread"))), flush=True)
                    os.kill(p, 9)
                    os.waitpid(p, 0)
                    live.pop(p)
            time.sleep(0.02)
    alive = drive.is_alive()
    stop.set()
    drive.join()
    if not alive:
        print("the parent's driving thread died: the forks did not race its waits", flush=True)
        failed += 1
    print(f"forks={FORKS} failed={failed} hung={hung}")


if __name__ == "__main__":
    main()
