#!/usr/bin/env bash
# Benchmarks nixl-connect side by side with the anchors of ../shared/anchors in one run, as medians
# over RUNS runs (default 3): raw NIXL (nixl_raw_pair.py, UCX defaults) and Python Dynamo
# (run_dynamo.py). Prints a markdown table and writes JSON lines to bench-results/.
# Usage: bash scripts/bench.sh [--sizes 4K,64K,1M,16M,64M,256M] [--runs 3] [--no-anchors]
set -euo pipefail
cd "$(dirname "$0")/.."
SIZES=4K,64K,1M,16M,64M,256M; RUNS=3; ANCHORS=1
while [ $# -gt 0 ]; do
  case "$1" in
    --sizes) SIZES=$2; shift 2 ;;
    --runs) RUNS=$2; shift 2 ;;
    --no-anchors) ANCHORS=0; shift ;;
    *) echo "bench.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
bash scripts/setup.sh --interop
cargo build --release -q -p nixl-connect-cli
OUT=bench-results; mkdir -p "$OUT"; stamp=$(date -u +%Y%m%dT%H%M%SZ)
res="$OUT/$stamp.jsonl"; : > "$res"
for r in $(seq "$RUNS"); do
  for buffers in huge vec; do
    for op in read write; do
      target/release/nixl-connect bench --sizes "$SIZES" --op "$op" --buffers "$buffers" | sed "s/^{/{\"run\":$r,/" >> "$res"
    done
  done
done
ANCHOR_DIR=${ANCHOR_DIR:-../shared/anchors}
if [ "$ANCHORS" = 1 ] && [ -d "$ANCHOR_DIR" ]; then
  export PYTHONPATH="$PWD/tests/interop/torch_stub${PYTHONPATH:+:$PYTHONPATH}"
  .venv/bin/python "$ANCHOR_DIR/nixl_raw_pair.py" --ops READ,WRITE --runs "$RUNS" --sizes "$SIZES" --json "$OUT/$stamp-raw.json" >&2 || echo "raw NIXL anchor failed" >&2
  .venv/bin/python "$ANCHOR_DIR/nixl_raw_pair.py" --ops READ,WRITE --runs "$RUNS" --sizes "$SIZES" --thp 0 --json "$OUT/$stamp-raw4k.json" >&2 || echo "raw NIXL anchor (4 KiB pages) failed" >&2
  .venv/bin/python "$ANCHOR_DIR/run_dynamo.py" --runs "$RUNS" --sizes "$SIZES" --json "$OUT/$stamp-dynamo.json" >&2 || echo "Python Dynamo anchor failed" >&2
fi
.venv/bin/python - "$res" "$OUT/$stamp-raw.json" "$OUT/$stamp-dynamo.json" "$OUT/$stamp-raw4k.json" <<'PY'
import json, statistics, sys, os
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
raw = json.load(open(sys.argv[2])) if os.path.exists(sys.argv[2]) else None
dyn = json.load(open(sys.argv[3])) if os.path.exists(sys.argv[3]) else None
raw4k = json.load(open(sys.argv[4])) if os.path.exists(sys.argv[4]) else None
def h(n): return f"{n>>20}M" if n >= 1<<20 else f"{n>>10}K"
idle = [r["idle_connector_cpu_pct"] for r in rows if "idle_connector_cpu_pct" in r]
rows = [r for r in rows if "size" in r]
print("| op | buffers | size | nixl-connect median us (min-max of run medians) | server wait us | GB/s | raw NIXL us / GB/s (same page size) | Python Dynamo us / GB/s | ok |")
print("|---|---|---|---|---|---|---|---|---|")
for op in ("read", "write"):
  for buf in ("huge", "vec"):
    for size in sorted({r["size"] for r in rows}):
      rs = [r for r in rows if r["op"] == op and r["buffers"] == buf and r["size"] == size]
      if not rs: continue
      us = [r["read_median_us"] for r in rs]; wt = [r["server_wait_median_us"] for r in rs]
      m = statistics.median(us)
      rawc = dync = "-"
      src = raw if buf == "huge" else raw4k
      if src:
        for x in src["rows"]:
          if x["op"] == op.upper() and x["size"] == size:
            rawc = f'{x["lat_B"]["med"]*1e6:.1f} / {x["GBps"]["med"]:.2f}'
      if dyn and op == "read" and buf == "vec":
        for x in dyn:
          if x["size"] == size:
            dync = f'{x["median_s"]*1e6:.0f} / {x["GBps_med"]:.2f}'
      print(f"| {op} | {buf} | {h(size)} | {m:.1f} ({min(us):.1f}-{max(us):.1f}) | {statistics.median(wt):.1f} | {size/m/1e3:.2f} | {rawc} | {dync} | {all(r['ok'] for r in rs)} |")
if idle: print(f"\nidle connector CPU: median {statistics.median(idle):.3f}% of a core over {len(idle)} runs")
PY
echo "raw results: $res" >&2
