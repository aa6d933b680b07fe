#!/usr/bin/env bash
# Device memory between pods (issue 41, item 3), on a GPU host, from the GPU bundle
# (scripts/gpu-bundle.sh): the VMM checks (unit), the pods test (integration), then `bench`
# VRAM -> VRAM between two processes in separate PID, IPC and mount namespaces (each with its own
# /proc) that share only the socket directory, beside the same pair in one namespace (the
# library's VMM `DeviceBuffer`, and `cuMemAlloc` memory through legacy CUDA IPC), alternated
# within each run; then the pods pair with `cuMemAlloc` memory (which takes NIXL, with the reason).
# Prints the medians over RUNS runs (default 3) and writes JSON lines to $OUT/gpu-pods.jsonl.
# Needs root (unshare). Usage: bash nixl-connect-gpu/gpu-pods.sh
set -uo pipefail
B=$(cd "$(dirname "$0")" && pwd)
OUTDIR=${OUT:-$B}
res="$OUTDIR/gpu-pods.jsonl"; log="$OUTDIR/gpu-pods.log"
: > "$res"; : > "$log"
export NIXL_CONNECT_LIB="$B/nixl/lib" NIXL_CONNECT_REQUIRE_GPU=1
bin="$B/bin/nixl-connect"
status=0
sec() { echo "== $* (t=${SECONDS}s)" | tee -a "$log"; }
sec "tests"
timeout 120 "$B/bin/unit" --test-threads=1 vmm ipc_ sys_cuda forgot 2>&1 | tail -n 30 | tee -a "$log" || status=1
timeout 300 "$B/bin/integration" --test-threads=1 gpu_vmm 2>&1 | tail -n 30 | tee -a "$log" || status=1
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
mkdir -m 777 "$work/sock"
pod=(unshare --pid --ipc --mount --fork --kill-child --mount-proc)
SIZES=${SIZES:-4K,64M,1G}
RUNS=${RUNS:-3}
# One pods pair: the passive side (bench-peer) and the active side each in a pod of its own.
pods() {
  local tag=$1; shift
  mkfifo "$work/in" "$work/out"
  NIXL_CONNECT_SOCKET_DIR=$work/sock "${pod[@]}" "$bin" bench-peer < "$work/in" > "$work/out" &
  local peer=$!
  NIXL_CONNECT_SOCKET_DIR=$work/sock timeout 240 "${pod[@]}" "$bin" bench --json --path auto --peer-fifos "$work/in,$work/out" "$@" \
    | sed "s/^{/{\"run\":$r,\"pods\":true,\"alloc\":\"$tag\",/" | tee -a "$res" || status=1
  wait "$peer"
  rm -f "$work/in" "$work/out"
}
sec "bench: VRAM -> VRAM, pods beside one namespace"
for r in $(seq "$RUNS"); do
  for op in read write; do
    "$bin" bench --json --path auto --device cuda:0 --buffers vmm --sizes "$SIZES" --op "$op" \
      | sed "s/^{/{\"run\":$r,\"pods\":false,\"alloc\":\"vmm\",/" | tee -a "$res" || status=1
    "$bin" bench --json --path auto --device cuda:0 --buffers huge --sizes "$SIZES" --op "$op" \
      | sed "s/^{/{\"run\":$r,\"pods\":false,\"alloc\":\"cuMemAlloc\",/" | tee -a "$res" || status=1
    pods vmm --device cuda:0 --buffers vmm --sizes "$SIZES" --op "$op"
  done
done
sec "bench: fresh DeviceBuffers per operation between pods (8 MiB), and cuMemAlloc memory between pods (NIXL), once"
r=1 pods vmm-fresh --device cuda:0 --buffers vmm --sizes 8M --op read --fresh --iters 50
r=1 pods cuMemAlloc --device cuda:0 --buffers huge --sizes 4K,64M --op read
python3 - "$res" <<'PY' | tee -a "$log"
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
def med(v): return statistics.median(v) if v else float("nan")
keys = sorted({(r["op"], r["size"], r["pods"], r["alloc"]) for r in rows})
print("| op | size | where | memory | path (mechanism) | latency p50 us | GB/s | runs | bytes checked |")
print("|---|---|---|---|---|---|---|---|---|")
for op, size, pods, alloc in keys:
    g = [r for r in rows if (r["op"], r["size"], r["pods"], r["alloc"]) == (op, size, pods, alloc)]
    mech = ",".join(sorted({f'{r.get("path", "?")} ({r.get("mechanism", "-")})' for r in g}))
    print(f"| {op} | {size} | {'two pods' if pods else 'one namespace'} | {alloc} | {mech} | "
          f"{med([r['latency_p50_us'] for r in g]):.1f} | {med([r['GBps'] for r in g]):.1f} | {len(g)} | "
          f"{'yes' if all(r['ok'] for r in g) else 'NO'} |")
PY
# PyTorch tensors between pods (the Python module on both sides), where a python with torch is.
PY=${PYTHON:-python3}
if "$PY" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
  site=/tmp/nixl-connect-site
  if [ ! -d "$site/nixl_connect" ]; then
    rm -rf "$site" && "$PY" -m pip install -q --no-deps --no-index --no-compile --target "$site" \
        $(ls "$B"/python/wheels/*.whl 2>/dev/null) "$B"/python/nixl_connect-*.whl || status=1
  fi
  sec "PyTorch tensors between pods (gpu_torch_pods.py)"
  PYTHONPATH="$site" timeout 300 "$PY" "$B/gpu_torch_pods.py" --iters "${TORCH_ITERS:-10}" \
    2>>"$log" | tee "$OUTDIR/gpu-torch-pods.jsonl" | tee -a "$log" || status=1
else
  sec "PyTorch skipped: no python with torch (CUDA) here"
fi
sec "done"
exit $status
