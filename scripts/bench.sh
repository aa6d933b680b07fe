#!/usr/bin/env bash
# Benchmarks nixl-connect side by side with the anchors of ../shared/anchors in one run, as medians
# over RUNS runs (default 3): the Rust `bench` over both paths (same-host "local" and "nixl"), raw
# NIXL (nixl_raw_pair.py, UCX defaults), Python Dynamo (run_dynamo.py), and the Python pair
# (py_pair.py, and scripts/py_pair_bench.py timing both sides) with Dynamo's module and with this
# project's nixl_connect, Python's cost per operation in one process (scripts/bench_python_ops.py,
# asyncio and uvloop); then many operations at once beside raw NIXL with as many outstanding
# (scripts/nixl_raw_concurrent.py), many descriptors against their copy limit, fresh memory against
# reused. Prints markdown tables and writes JSON to bench-results/.
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
cargo build --release -q -p nixl-connect --example in_process_pair
ANCHOR_DIR=${ANCHOR_DIR:-../shared/anchors}
OUT=bench-results; mkdir -p "$OUT"; stamp=$(date -u +%Y%m%dT%H%M%SZ)
res="$OUT/$stamp.jsonl"; : > "$res"
for r in $(seq "$RUNS"); do
  for path in local nixl; do
    for buffers in huge vec; do
      for op in read write; do
        target/release/nixl-connect bench --json --path "$path" --sizes "$SIZES" --op "$op" --buffers "$buffers" | sed "s/^{/{\"run\":$r,/" >> "$res"
      done
    done
  done
done
# The Python pair, both modules, 4 KiB and 64 MiB (the Rust figure for 64 MiB comes from the rows above).
pyres="$OUT/$stamp-python.jsonl"; : > "$pyres"
for r in $(seq "$RUNS"); do
  for module in nixl_connect dynamo.nixl_connect; do
    for size in 4096:500 67108864:30; do
      .venv/bin/python scripts/py_pair_bench.py "$module" "${size%%:*}" "${size##*:}" 2>/dev/null | grep "^{" | sed "s/^{/{\"run\":$r,/" >> "$pyres" || echo "python pair ($module) failed" >&2
      if [ "$ANCHORS" = 1 ] && [ -f "$ANCHOR_DIR/run_pair.py" ]; then
        NC_MODULE=$module .venv/bin/python "$ANCHOR_DIR/run_pair.py" "${size%%:*}" "${size##*:}" 2>/dev/null | grep "^{" \
          | sed "s/^{/{\"run\":$r,\"anchor\":\"py_pair.py\",\"module\":\"$module\",/" >> "$pyres" || echo "py_pair anchor ($module) failed" >&2
      fi
    done
  done
done
# Dynamo's own callers on both modules: the embedding transfer between two processes (8 MiB float32,
# 512 KiB bf16) and 4 KiB both sides in one process; medians of the runs on stderr.
.venv/bin/python scripts/bench_dynamo_callers.py "$RUNS" > "$OUT/$stamp-dynamo-callers.jsonl" \
  || echo "Dynamo callers benchmark failed" >&2
# The Python module's cost per operation: 4 KiB, both sides in one process, on asyncio and uvloop,
# plain and as Dynamo's multimodal caller does it, beside Dynamo's module; table on stderr.
.venv/bin/python scripts/bench_python_ops.py "$RUNS" > "$OUT/$stamp-python-ops.jsonl" \
  || echo "Python per-operation benchmark failed" >&2
if [ "$ANCHORS" = 1 ] && [ -d "$ANCHOR_DIR" ]; then
  .venv/bin/python "$ANCHOR_DIR/nixl_raw_pair.py" --ops READ,WRITE --runs "$RUNS" --sizes "$SIZES" --json "$OUT/$stamp-raw.json" >&2 || echo "raw NIXL anchor failed" >&2
  .venv/bin/python "$ANCHOR_DIR/nixl_raw_pair.py" --ops READ,WRITE --runs "$RUNS" --sizes "$SIZES" --thp 0 --json "$OUT/$stamp-raw4k.json" >&2 || echo "raw NIXL anchor (4 KiB pages) failed" >&2
  .venv/bin/python "$ANCHOR_DIR/run_dynamo.py" --runs "$RUNS" --sizes "$SIZES" --json "$OUT/$stamp-dynamo.json" >&2 || echo "Python Dynamo anchor failed" >&2
fi
# Many operations at once (issue 28), UCX_TLS=tcp for the NIXL rows and their anchor: 4 KiB with
# 64 outstanding on both paths, beside raw NIXL with 64 outstanding (scripts/nixl_raw_concurrent.py);
# 1,000 x 4 KiB in one operation in each layout (same-host path, against the copy limit of the same
# ranges); 8 MiB over fresh memory for every operation against the same memory reused; and the
# NIXL path with one outstanding against raw NIXL, UCX_TLS=tcp for both (what crosses hosts), the
# reader's time and the passive side's from the reader's start (raw NIXL's notif_A) side by side.
many="$OUT/$stamp-many.jsonl"; : > "$many"
tcpraw="$OUT/$stamp-raw-tcp"
for r in $(seq "$RUNS"); do
  for op in read write; do
    UCX_TLS=tcp target/release/nixl-connect bench --json --path nixl --op "$op" --sizes 4K,1M,64M \
      | grep '"size"' | sed "s/^{/{\"run\":$r,\"set\":\"tcp\",/" >> "$many"
  done
  if [ "$ANCHORS" = 1 ] && [ -d "$ANCHOR_DIR" ]; then
    .venv/bin/python "$ANCHOR_DIR/nixl_raw_pair.py" --ops READ,WRITE --runs 1 --sizes 4K,1M,64M --tls tcp \
      --json "$tcpraw-$r.json" >/dev/null 2>&1 || echo "raw NIXL anchor (tcp) failed" >&2
  fi
  for path in local nixl; do
    for op in read write; do
      UCX_TLS=tcp target/release/nixl-connect bench --json --path "$path" --op "$op" --sizes 4K --concurrency 64 --iters 200 \
        | grep '"size"' | sed "s/^{/{\"run\":$r,\"set\":\"concurrency\",/" >> "$many"
      UCX_TLS=tcp .venv/bin/python scripts/nixl_raw_concurrent.py --runs 1 --op "${op^^}" --concurrency 64 2>/dev/null \
        | tail -n1 | sed "s/^{/{\"run\":$r,\"set\":\"concurrency\",\"path\":\"$path\",/" >> "$many" || echo "raw NIXL concurrent anchor failed" >&2
    done
  done
  for layout in separate contiguous scattered; do
    target/release/nixl-connect bench --json --path local --sizes 4K --descriptors 1000 --layout "$layout" \
      | grep '"size"' | sed "s/^{/{\"run\":$r,\"set\":\"descriptors\",/" >> "$many"
  done
  for path in local nixl; do
    for fresh in "" --fresh; do
      UCX_TLS=tcp target/release/nixl-connect bench --json --path "$path" --buffers vec --sizes 8M --iters 30 $fresh \
        | grep '"size"' | sed "s/^{/{\"run\":$r,\"set\":\"fresh\",/" >> "$many"
    done
  done
done
.venv/bin/python - "$many" "$tcpraw" "$RUNS" <<'PY' || true
import json, os, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
med = statistics.median
raws = [json.load(open(f)) for f in (f"{sys.argv[2]}-{r}.json" for r in range(1, int(sys.argv[3]) + 1)) if os.path.exists(f)]
print("\nThe NIXL path against raw NIXL, one outstanding, UCX_TLS=tcp (medians of run medians, us)")
print("| op | size | reader | raw NIXL reader (lat_B) | ratio | passive from the reader's start | raw NIXL notif_A | ratio |")
print("|---|---|---|---|---|---|---|---|")
for op in ("read", "write"):
  for size in (4096, 1 << 20, 64 << 20):
    ours = [r for r in rows if r["set"] == "tcp" and r["op"] == op and r["size"] == size]
    raw = [x for f in raws for x in f["rows"] if x["op"] == op.upper() and x["size"] == size]
    if not ours:
      continue
    lat, pb = med(r["latency_p50_us"] for r in ours), med(r["passive_from_begin_p50_us"] for r in ours)
    if raw:
      rl, rn = med(x["lat_B"]["med"] * 1e6 for x in raw), med(x["notif_A"]["med"] * 1e6 for x in raw)
      print(f"| {op} | {size >> 10} KiB | {lat:.1f} | {rl:.1f} | {lat / rl:.2f}x | {pb:.1f} | {rn:.1f} | {pb / rn:.2f}x |")
    else:
      print(f"| {op} | {size >> 10} KiB | {lat:.1f} | - | - | {pb:.1f} | - | - |")
print("\nMany operations (issue 28; medians of run medians, UCX_TLS=tcp for the NIXL path)")
print("| what | nixl-connect | anchor in the same runs | ratio |")
print("|---|---|---|---|")
for path in ("local", "nixl"):
  for op in ("read", "write"):
    ours = [r["ops_per_s"] for r in rows if r["set"] == "concurrency" and r.get("impl") == "nixl-connect" and r["path"] == path and r["op"] == op]
    raw = [r["ops_per_s_median"] for r in rows if r["set"] == "concurrency" and r.get("anchor") and r["path"] == path and r["op"] == op.upper()]
    if ours:
      a = f"{med(raw):,.0f}/s raw NIXL" if raw else "-"
      ratio = f"{med(ours) / med(raw):.2f}x" if raw else "-"
      print(f"| 4 KiB {op}, 64 outstanding, {path} path | {med(ours):,.0f}/s | {a} | {ratio} |")
for layout in ("separate", "contiguous", "scattered"):
  rs = [r for r in rows if r["set"] == "descriptors" and r["layout"] == layout]
  if rs:
    one = [r["one_range_limit_GBps"] for r in rs if "one_range_limit_GBps" in r]
    extra = f"; as one range {med(one):.2f} GB/s" if one else ""
    print(f"| 1,000 x 4 KiB read, {layout} | {med(r['latency_p50_us'] for r in rs):.0f} us, {med(r['GBps'] for r in rs):.2f} GB/s | copy limit {med(r['limit_GBps'] for r in rs):.2f} GB/s{extra} | {med(r['of_limit'] for r in rs):.0%} |")
for path in ("local", "nixl"):
  f = [r["latency_p50_us"] for r in rows if r["set"] == "fresh" and r["path"] == path and r["fresh"]]
  u = [r["latency_p50_us"] for r in rows if r["set"] == "fresh" and r["path"] == path and not r["fresh"]]
  if f and u:
    print(f"| 8 MiB read, Vec, fresh memory, {path} path | {med(f):.0f} us | reused {med(u):.0f} us | {med(f) / med(u):.2f}x |")
PY
.venv/bin/python - "$res" "$OUT/$stamp-raw.json" "$OUT/$stamp-dynamo.json" "$OUT/$stamp-raw4k.json" "$pyres" <<'PY'
import json, statistics, sys, os
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
py = [json.loads(l) for l in open(sys.argv[5]) if l.strip()] if os.path.exists(sys.argv[5]) else []
raw = json.load(open(sys.argv[2])) if os.path.exists(sys.argv[2]) else None
dyn = json.load(open(sys.argv[3])) if os.path.exists(sys.argv[3]) else None
raw4k = json.load(open(sys.argv[4])) if os.path.exists(sys.argv[4]) else None
def h(n): return f"{n>>20}M" if n >= 1<<20 else f"{n>>10}K"
idle = [r["idle_connector_cpu_pct"] for r in rows if "idle_connector_cpu_pct" in r]
rows = [r for r in rows if "size" in r]
print("| op | path | buffers | size | nixl-connect median us (min-max of run medians) | passive us: from publish / from begin | GB/s | copy limit GB/s | raw NIXL us / GB/s / notif_A us (same page size) | Python Dynamo us / GB/s | ok |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for op in ("read", "write"):
 for path in ("local", "nixl"):
  for buf in ("huge", "vec"):
    for size in sorted({r["size"] for r in rows}):
      rs = [r for r in rows if r["op"] == op and r["buffers"] == buf and r["size"] == size and r.get("path") == path]
      if not rs: continue
      us = [r["read_median_us"] for r in rs]; wt = [r["server_wait_median_us"] for r in rs]
      fb = [r["passive_from_begin_p50_us"] for r in rs if "passive_from_begin_p50_us" in r]
      fbc = f"{statistics.median(fb):.1f}" if fb else "-"
      m = statistics.median(us)
      rawc = dync = "-"
      src = raw if buf == "huge" else raw4k
      if src:
        for x in src["rows"]:
          if x["op"] == op.upper() and x["size"] == size:
            rawc = f'{x["lat_B"]["med"]*1e6:.1f} / {x["GBps"]["med"]:.2f} / {x["notif_A"]["med"]*1e6:.1f}'
      if dyn and op == "read" and buf == "vec":
        for x in dyn:
          if x["size"] == size:
            dync = f'{x["median_s"]*1e6:.0f} / {x["GBps_med"]:.2f}'
      lim = [r["limit_GBps"] for r in rs if "limit_GBps" in r]
      limc = f"{statistics.median(lim):.2f}" if lim else "-"
      print(f"| {op} | {path} | {buf} | {h(size)} | {m:.1f} ({min(us):.1f}-{max(us):.1f}) | {statistics.median(wt):.1f} / {fbc} | {size/m/1e3:.2f} | {limc} | {rawc} | {dync} | {all(r['ok'] for r in rs)} |")
if idle: print(f"\nidle connector CPU: median {statistics.median(idle):.3f}% of a core over {len(idle)} runs")
if py:
  print("\nPython pair (medians of run medians; both sides: until client and server have both completed)")
  print("| module | size | py_pair.py anchor client us | client us | server us | both sides us | GB/s | of Rust bench (read, vec, local) |")
  print("|---|---|---|---|---|---|---|---|")
  for module in ("nixl_connect", "dynamo.nixl_connect"):
    for size in (4096, 67108864):
      ours = [x for x in py if x.get("module") == module and x["size"] == size and "anchor" not in x]
      anc = [x for x in py if x.get("module") == module and x["size"] == size and "anchor" in x]
      if not ours and not anc: continue
      med = lambda k: statistics.median(x[k] for x in ours) if ours else float("nan")
      a = f'{statistics.median(x["median_s"] for x in anc)*1e6:.0f}' if anc else "-"
      rust = [r for r in rows if r["op"] == "read" and r["buffers"] == "vec" and r.get("path") == "local" and r["size"] == size]
      gb = statistics.median(x["GBps"] for x in ours) if ours else float("nan")
      ratio = f'{gb / statistics.median(r["GBps"] for r in rust):.0%}' if rust and ours else "-"
      print(f"| {module} | {h(size)} | {a} | {med('client_us'):.0f} | {med('server_us'):.0f} | {med('both_us'):.0f} | {gb:.2f} | {ratio} |")
PY
echo "raw results: $res" >&2
