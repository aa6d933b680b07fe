#!/usr/bin/env bash
# The same-host path between pods (issue 41): `bench` between two processes in separate PID, IPC
# and mount namespaces that share only the socket directory (they cannot see each other's pids:
# host memory goes through pipes), beside the same pair in one namespace (cross-memory attach, and
# the copy limit: one thread's process_vm_readv of the peer's buffer), alternated within each run,
# for HostBuffer (`huge`) and plain Vec (`vec`) memory, reads and writes. Prints the medians over
# RUNS runs and the ratios the issue asks for; writes JSON lines to bench-results/. Needs root
# (unshare), as CI does.
# Usage: bash scripts/bench-pods.sh [--sizes 4K,64M] [--runs 5]
set -euo pipefail
cd "$(dirname "$0")/.."
SIZES=4K,64M; RUNS=5
while [ $# -gt 0 ]; do
  case "$1" in
    --sizes) SIZES=$2; shift 2 ;;
    --runs) RUNS=$2; shift 2 ;;
    *) echo "bench-pods.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
bash scripts/setup.sh
cargo build --release -q -p nixl-connect-cli
bin=$PWD/target/release/nixl-connect
OUT=bench-results; mkdir -p "$OUT"; stamp=$(date -u +%Y%m%dT%H%M%SZ)
res="$OUT/$stamp-pods.jsonl"; : > "$res"
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
mkdir -m 777 "$work/sock"
# A pod: its own PID namespace (with its own /proc), IPC and mount namespaces.
pod=(unshare --pid --ipc --mount --fork --kill-child --mount-proc)
export UCX_TLS=${UCX_TLS:-tcp}
for r in $(seq "$RUNS"); do
  for buffers in huge vec; do
    for op in read write; do
      "$bin" bench --json --path local --sizes "$SIZES" --op "$op" --buffers "$buffers" \
        | sed "s/^{/{\"run\":$r,\"pods\":false,/" >> "$res"
      mkfifo "$work/in" "$work/out"
      NIXL_CONNECT_SOCKET_DIR=$work/sock "${pod[@]}" "$bin" bench-peer < "$work/in" > "$work/out" &
      peer=$!
      NIXL_CONNECT_SOCKET_DIR=$work/sock "${pod[@]}" "$bin" bench --json --path local --sizes "$SIZES" \
        --op "$op" --buffers "$buffers" --peer-fifos "$work/in,$work/out" \
        | sed "s/^{/{\"run\":$r,\"pods\":true,/" >> "$res"
      wait "$peer"
      rm -f "$work/in" "$work/out"
    done
  done
done
python3 - "$res" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
def med(v): return statistics.median(v) if v else float("nan")
keys = sorted({(r["op"], r["buffers"], r["size"]) for r in rows})
print("| op | memory | size | one namespace (mechanism) us / GB/s | two pods (mechanism) us / GB/s | copy limit GB/s | pods of limit | pods / one-ns latency |")
print("|---|---|---|---|---|---|---|---|")
for op, buf, size in keys:
    one = [r for r in rows if not r["pods"] and (r["op"], r["buffers"], r["size"]) == (op, buf, size)]
    two = [r for r in rows if r["pods"] and (r["op"], r["buffers"], r["size"]) == (op, buf, size)]
    lat1, lat2 = med([r["latency_p50_us"] for r in one]), med([r["latency_p50_us"] for r in two])
    g1, g2 = med([r["GBps"] for r in one]), med([r["GBps"] for r in two])
    lim = med([r["limit_GBps"] for r in one if "limit_GBps" in r])
    m1 = ",".join(sorted({r["mechanism"] for r in one})); m2 = ",".join(sorted({r["mechanism"] for r in two}))
    ok = all(r["ok"] for r in one + two)
    print(f"| {op} | {'HostBuffer' if buf == 'huge' else 'Vec'} | {size} | {lat1:.1f} / {g1:.2f} ({m1}) | {lat2:.1f} / {g2:.2f} ({m2}) | {lim:.2f} | {g2/lim:.2f}x | {lat2/lat1:.2f}x |" + ("" if ok else " NOT VERIFIED"))
print(f"(medians of {len({r['run'] for r in rows})} runs; {sys.argv[1]})")
PY
