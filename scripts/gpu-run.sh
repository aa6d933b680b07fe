#!/usr/bin/env bash
# Runs the GPU bundle on a GPU host (CUDA driver, no Rust, no network needed): first the host-memory
# rows that need this host's many cores (4 KiB latency, 64 outstanding, the Python module's cost per
# operation beside the Rust anchor), then every GPU test (a skip is a failure here), the Python
# module's CUDA tensor tests (when a python with torch, pydantic, pytest and pytest-asyncio is
# there), then the benchmark, RUNS times (default 3), on device memory (VRAM to VRAM, read and write, same-host path and --path nixl) and the host<->GPU
# mixes at 4K,1M,64M,1G, then the raw NIXL anchors if a Python with nixl and torch is present.
# Results go to stdout and to $OUT/gpu-results.jsonl (default: beside this script).
# Usage: bash nixl-connect-gpu/gpu-run.sh
set -uo pipefail
B=$(cd "$(dirname "$0")" && pwd)
OUTDIR=${OUT:-$B}
res="$OUTDIR/gpu-results.jsonl"; log="$OUTDIR/gpu-tests.log"
: > "$res"; : > "$log"
export NIXL_CONNECT_LIB="$B/nixl/lib" NIXL_CONNECT_REQUIRE_GPU=1
nvidia-smi -L 2>&1 | tee -a "$log"
status=0
# A section header with the seconds since the start (the whole run must fit a lease).
sec() { echo "== $* (t=${SECONDS}s)" | tee -a "$log"; }
PY=${PYTHON:-python3}
site=""
if "$PY" -c "import torch, pytest; assert torch.cuda.is_available()" 2>/dev/null; then
  # The image's python is itself a venv: install beside it with --target, not into a new venv
  # (which would not see its torch and pytest).
  site="/tmp/nixl-connect-site"
  rm -rf "$site" && "$PY" -m pip install -q --no-deps --no-index --no-compile --target "$site" \
      $(ls "$B"/python/wheels/*.whl 2>/dev/null) "$B"/python/nixl_connect-*.whl || { site=""; status=1; }
fi
SIZES=${SIZES:-4K,1M,64M,1G}
RUNS=${RUNS:-3}
bench() {
  for r in $(seq "$RUNS"); do
    "$B/bin/nixl-connect" bench --json --sizes "$SIZES" "$@" | sed "s/^{/{\"run\":$r,/" | tee -a "$res" || status=1
  done
}
sec "host memory, 4 KiB on this host (issue 27's latency, issue 28's rate)"
# Host memory on this (many-core) host: 4 KiB latency both ways, 64 outstanding (issue 28's rate).
RUNS=3 SIZES=4K bench --device cpu --op read
RUNS=3 SIZES=4K bench --device cpu --op write
RUNS=3 SIZES=4K bench --device cpu --op write --idle-cpu
RUNS=3 SIZES=4K bench --device cpu --op read --concurrency 64 --iters 300
RUNS=3 SIZES=4K bench --device cpu --op write --concurrency 64 --iters 300
if [ -n "$site" ]; then
  sec "python, 4 KiB, both sides in one process (scripts/bench_python_ops.py)"
  PYTHONPATH="$site" IN_PROCESS_PAIR="$B/bin/in_process_pair" timeout 300 "$PY" "$B/python/bench_python_ops.py" "$RUNS" 2000 2>&1 | tee -a "$res" || status=1
fi
sec "tests"
timeout 300 "$B/bin/integration" --test-threads=1 gpu 2>&1 | tee -a "$log" || status=1
timeout 60 "$B/bin/unit" --test-threads=1 ipc cuda staged 2>&1 | tee -a "$log" || status=1
sec "python (nixl_connect with CUDA tensors)"
if [ -n "$site" ]; then
  (cd "$B/python/tests" && PYTHONPATH="$site" timeout 240 "$PY" -m pytest -q -p no:cacheprovider -rs -s test_cuda.py test_local_transfers.py 2>&1 | tee -a "$log") \
    || status=1
else
  echo "skipped: no python here with torch (CUDA) and pytest" | tee -a "$log"
fi
sec "bench"
bench --device cuda:0 --op read
bench --device cuda:0 --op write
bench --device cpu --peer-device cuda:0 --op read
bench --device cuda:0 --peer-device cpu --op read
bench --device cuda:0 --peer-device cpu --op write
bench --device cpu --peer-device cuda:0 --op write
bench --device cpu --op read
# Fresh device memory per operation (cuMemAlloc on both sides, a new IPC mapping each time) beside
# the same memory reused.
RUNS=3 SIZES=8M bench --device cuda:0 --op read --iters 100 --fresh
RUNS=3 SIZES=8M bench --device cuda:0 --op read --iters 100
# NIXL's own path for device memory (UCX's emulated lane here, ~0.6 GB/s): once, without 1 GiB.
RUNS=1 SIZES=4K,1M,64M bench --device cuda:0 --op read --path nixl
sec "device limits (torch, same run)"
for a in gpu_copy.py gpu_ipc.py gpu_ipc_small.py; do
  [ -f "$B/anchors/$a" ] && (cd "$B/anchors" && timeout 90 python3 "$a" 2>&1 | tee -a "$res")
done
sec "device memory between pods (gpu-pods.sh)"
OUT="$OUTDIR" bash "$B/gpu-pods.sh" || status=1
sec "doctor"
"$B/bin/nixl-connect" doctor 2>&1 | tee -a "$log"
if [ -f "$B/anchors/gpu_pair.py" ] && python3 -c "import nixl, torch" 2>/dev/null; then
  sec "anchors (raw NIXL)"
  # gpu_pair.py prints its own JSON lines (keys src, dst, op, size, median_us, GBps).
  (cd "$B/anchors" && PAIR_SIZES=4096,1048576,67108864,1073741824 python3 gpu_pair.py cuda cuda | tee -a "$res")
else
  sec "anchors skipped: no python with nixl and torch here (raw figures: ../shared/anchors/FIGURES.md)"
fi
echo "results: $res  tests: $log"
exit $status
