#!/usr/bin/env bash
# The short device run (one lease of a few minutes, where scripts/gpu-run.sh takes longer): the
# GPU tests, then the rows the seventeenth session changed or left to measure on a many-core host,
# each beside its anchor in the same run:
#   - device -> pageable host at 64 MiB and 1 GiB, reads and writes, and host -> device beside
#     them (issue 46 item 1), with torch's copy limits (D2H, H2D) from anchors/gpu_copy.py;
#   - tensors from PyTorch's allocator per operation against reused ones (gpu_torch_alloc.py),
#     beside raw cuMemAlloc per operation (`bench --fresh`) and reused (issue 46 item 2);
#   - 4 KiB VRAM -> VRAM (issue 46 item 3's row, unchanged code);
#   - recording metrics on and off, interleaved, 4 KiB host memory: latency and 64 outstanding,
#     reads and writes (issue 42's A/B on 16 cores);
#   - `spin` (not in the default ONLY): waits that stay awake (`--wait-spin-us`, SPINS, default
#     "0 30 100"), 4 KiB reads and writes on the same-host path and on NIXL over TCP, with raw
#     NIXL over TCP each round (issue 45: whether a default spin pays on many cores).
# Results: $OUT/gpu-rows.jsonl (bench lines carry "label" and "run"), the log $OUT/gpu-rows.log.
# Usage: bash nixl-connect-gpu/gpu-rows.sh
#   RUNS (default 3), AB_ROUNDS (default 6), ONLY (sections, default "tests d2h ab small torch";
#   "spin" too),
#   LANES (staged lanes to compare in d2h, e.g. "8 12 16"; default: the library's own choice),
#   TORCH_MODES (default reused,fresh), AB_OPS (default "c64-write c64-read lat-read lat-write"),
#   D2H_SIZES (default 64M,1G), TESTS (the integration tests' filter, default gpu), SPINS (the
#   wait spins the "spin" section compares, us, default "0 30 100").
set -uo pipefail
B=$(cd "$(dirname "$0")" && pwd)
OUTDIR=${OUT:-$B}
res="$OUTDIR/gpu-rows.jsonl"; log="$OUTDIR/gpu-rows.log"
: > "$res"; : > "$log"
export NIXL_CONNECT_LIB="$B/nixl/lib" NIXL_CONNECT_REQUIRE_GPU=1
RUNS=${RUNS:-3}
AB_ROUNDS=${AB_ROUNDS:-6}
ONLY=${ONLY:-tests d2h ab small torch}
LANES=${LANES:-default}
on() { case " $ONLY " in *" $1 "*) return 0;; *) return 1;; esac; }
status=0
sec() { echo "== $* (t=${SECONDS}s)" | tee -a "$log"; }
# bench LABEL ARGS...: RUNS runs, one JSON line each, labelled.
bench() {
  local label=$1; shift
  for r in $(seq "$RUNS"); do
    "$B/bin/nixl-connect" bench --json "$@" | sed "s/^{/{\"run\":$r,\"label\":\"$label\",/" >> "$res" || status=1
  done
}
{ nvidia-smi -L; echo "cores: $(nproc)"; } 2>&1 | tee -a "$log"

if on tests; then
sec "GPU tests"
timeout 240 "$B/bin/integration" --test-threads=1 "${TESTS:-gpu}" >> "$log" 2>&1 || status=1
grep -E "^test |test result" "$log" | tail -14
fi

if on d2h; then
sec "device -> pageable host (staged), host -> device beside it (lanes: $LANES)"
SZ=${D2H_SIZES:-64M,1G}
for r in $(seq "$RUNS"); do
  for l in $LANES; do
    if [ "$l" = default ]; then unset NIXL_CONNECT_STAGING_LANES; t=""; else export NIXL_CONNECT_STAGING_LANES=$l; t="-l$l"; fi
    RUNS=1 bench "d2h-read$t" --sizes "$SZ" --device cpu --peer-device cuda:0 --op read
    RUNS=1 bench "d2h-write$t" --sizes "$SZ" --device cuda:0 --peer-device cpu --op write
    RUNS=1 bench "h2d-read$t" --sizes "$SZ" --device cuda:0 --peer-device cpu --op read
    RUNS=1 bench "h2d-write$t" --sizes "$SZ" --device cpu --peer-device cuda:0 --op write
  done
done
unset NIXL_CONNECT_STAGING_LANES
[ -f "$B/anchors/gpu_copy.py" ] && (cd "$B/anchors" && timeout 60 python3 gpu_copy.py >> "$res" 2>>"$log")
fi

if on ab; then
sec "metrics on/off, 4 KiB host memory, interleaved"
for round in $(seq "$AB_ROUNDS"); do
  for arm in off on; do
    m=(); [ "$arm" = on ] && m=(--metrics 127.0.0.1:0)
    for o in ${AB_OPS:-c64-write c64-read lat-read lat-write}; do
      case $o in
        c64-*) x=(--concurrency 64 --iters 1000) ;;
        *) x=(--iters 3000) ;;
      esac
      RUNS=1 bench "ab-$arm-$o" --path local --device cpu --sizes 4K --op "${o#*-}" "${x[@]}" "${m[@]}"
    done
  done
done
fi

if on spin; then
sec "waits that stay awake (--wait-spin-us), 4 KiB host memory, interleaved; NIXL over TCP beside raw NIXL"
for round in $(seq "$AB_ROUNDS"); do
  for us in ${SPINS:-0 30 100}; do
    for o in read write; do
      RUNS=1 bench "spin$us-local-$o" --path local --device cpu --sizes 4K --op "$o" --iters 3000 --wait-spin-us "$us"
      UCX_TLS=tcp RUNS=1 bench "spin$us-nixl-$o" --path nixl --device cpu --sizes 4K --op "$o" --iters 2000 --wait-spin-us "$us"
    done
  done
  if [ -f "$B/anchors/nixl_raw_pair.py" ] && python3 -c "import nixl" 2>/dev/null; then
    (cd "$B/anchors" && timeout 120 python3 nixl_raw_pair.py --ops READ,WRITE --runs 1 --sizes 4K --tls tcp \
      --json "$OUTDIR/raw-tcp-$round.json" >> "$log" 2>&1) || echo "raw NIXL anchor failed" | tee -a "$log"
    # Its rows beside ours in the summary: reader latency and the owner's notification, us.
    python3 -c "
import json, sys
for x in json.load(open(sys.argv[1]))['rows']:
    print(json.dumps({'label': 'raw-nixl-tcp-' + x['op'].lower(), 'run': $round, 'size': x['size'],
                      'read_median_us': x['lat_B']['med'] * 1e6, 'passive_p50_us': x['notif_A']['med'] * 1e6}))
" "$OUTDIR/raw-tcp-$round.json" >> "$res" 2>>"$log"
  fi
done
fi

if on small; then
sec "4 KiB VRAM -> VRAM; 8 MiB fresh cuMemAlloc per operation and reused"
bench vram-4k-read --sizes 4K --device cuda:0 --op read --iters 2000
bench vram-4k-write --sizes 4K --device cuda:0 --op write --iters 2000
bench fresh-8m --sizes 8M --device cuda:0 --op read --iters 100 --fresh
bench reused-8m --sizes 8M --device cuda:0 --op read --iters 100
fi

if on torch; then
sec "tensors from PyTorch's allocator per operation"
PY=${PYTHON:-python3}
if "$PY" -c "import torch, pydantic; assert torch.cuda.is_available()" 2>/dev/null || \
   "$PY" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
  site="/tmp/nixl-connect-site"
  rm -rf "$site" && "$PY" -m pip install -q --no-deps --no-index --no-compile --target "$site" \
      $(ls "$B"/python/wheels/*.whl 2>/dev/null) "$B"/python/nixl_connect-*.whl >> "$log" 2>&1 || status=1
  PYTHONPATH="$site" timeout 180 "$PY" "$B/gpu_torch_alloc.py" --iters 150 --runs "$RUNS" \
    --modes "${TORCH_MODES:-reused,fresh}" 2>>"$log" | tee -a "$res" || status=1
else
  echo "skipped: no python with torch (CUDA) here" | tee -a "$log"
fi
fi
sec "done"
# A summary of medians per label and size (the raw lines are in $res).
python3 - "$res" <<'PY' | tee -a "$log"
import json, statistics, sys, collections
rows = collections.defaultdict(list)
for line in open(sys.argv[1]):
    try:
        r = json.loads(line)
    except ValueError:
        continue
    if "label" in r:
        v = r["ops_per_s"] if r.get("concurrency", 1) > 1 else (r["GBps"] if r["size"] >= 1 << 20 else r["read_median_us"])
        unit = "ops/s" if r.get("concurrency", 1) > 1 else ("GB/s" if r["size"] >= 1 << 20 else "us reader")
        rows[(r["label"], r["size"], unit)].append(v)
        if r["size"] < 1 << 20 and r.get("concurrency", 1) == 1:
            rows[(r["label"], r["size"], "us passive")].append(r["passive_p50_us"])
            if "passive_from_begin_p50_us" in r:
                rows[(r["label"], r["size"], "us passive from begin")].append(r["passive_from_begin_p50_us"])
    elif "copy" in r:
        rows[("torch " + r["copy"], r["size"], "GB/s")].append(r["GBps_one_way"])
    elif r.get("bench") == "torch_alloc":
        rows[("torch-alloc " + r["mode"], r["size"], "us reader")].append(r["median_us"])
for (label, size, unit), v in sorted(rows.items()):
    print(f"{label:24} {size:>11} {statistics.median(v):12.2f} {unit:10} n={len(v)} {[round(x, 2) for x in v]}")
PY
exit $status
