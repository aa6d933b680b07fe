#!/usr/bin/env bash
# Builds, on this CPU machine, everything a GPU host needs to run the GPU tests and the GPU
# benchmark without a Rust toolchain: the library's integration-test binary and the CLI (both with
# the `cuda` feature; cudarc loads the driver at run time), NIXL pruned to what its UCX path needs
# (the dependency closure of libnixl_capi.so, the UCX plugin and UCX's modules), the Python wheel
# (nixl_connect) with the Python tests, and scripts/gpu-run.sh. Packs them as .bundle/nixl-connect-gpu.tar.gz, at most 60 MiB.
# Usage: bash scripts/gpu-bundle.sh      then copy the tarball to the GPU host and run
#        tar xzf nixl-connect-gpu.tar.gz && bash nixl-connect-gpu/gpu-run.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --interop   # --interop: the venv with maturin, which builds the wheel
LIMIT=$((60 << 20))
B=.bundle/nixl-connect-gpu
rm -rf .bundle && mkdir -p "$B/bin"

cargo build --release -q -p nixl-connect-cli --features cuda
cp target/release/nixl-connect "$B/bin/"
cargo test --release -q -p nixl-connect --features cuda --no-run --message-format=json 2>/dev/null \
  | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "integration":
        print(m["executable"])' | while read -r exe; do cp "$exe" "$B/bin/integration"; done
[ -x "$B/bin/integration" ] || { echo "gpu-bundle: the integration test binary was not built" >&2; exit 1; }
# The library's unit tests too (the CUDA IPC checks that need a GPU live there).
cargo test --release -q -p nixl-connect --features cuda --lib --no-run --message-format=json 2>/dev/null \
  | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and "lib" in m["target"]["kind"]:
        print(m["executable"])' | while read -r exe; do cp "$exe" "$B/bin/unit"; done
[ -x "$B/bin/unit" ] || { echo "gpu-bundle: the unit test binary was not built" >&2; exit 1; }
# The Rust anchor of the Python per-operation bench (both sides in one process, no Python).
cargo build --release -q -p nixl-connect --example in_process_pair
cp target/release/examples/in_process_pair "$B/bin/"
strip "$B/bin/"* 2>/dev/null || true

# NIXL: the closure of NEEDED libraries, resolved inside .nixl/, keeping the wheel's layout
# (lib/ beside nixl_cu13.libs/) that the libraries' RPATH ($ORIGIN/../nixl_cu13.libs) relies on.
python3 - "$B" <<'PY'
import os, shutil, subprocess, sys
bundle = sys.argv[1]
root = ".nixl"
index = {}
for d, _, files in os.walk(root):
    for f in files:
        index.setdefault(f, os.path.join(d, f))
start = [os.path.join(root, "lib", "libnixl_capi.so"), os.path.join(root, "lib", "plugins", "libplugin_UCX.so")]
ucx = os.path.join(root, "nixl_cu13.libs", "ucx")
start += [os.path.join(ucx, f) for f in os.listdir(ucx) if ".so" in f and "perftest" not in f]
seen, todo = set(), list(start)
while todo:
    p = todo.pop()
    if p in seen:
        continue
    seen.add(p)
    out = subprocess.run(["readelf", "-d", p], capture_output=True, text=True).stdout
    for line in out.splitlines():
        if "(NEEDED)" in line:
            name = line.split("[", 1)[1].rstrip("]")
            if name in index:
                todo.append(index[name])
for p in sorted(seen):
    dst = os.path.join(bundle, "nixl", os.path.relpath(p, root))
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    shutil.copy2(p, dst)
print(f"gpu-bundle: {len(seen)} NIXL/UCX libraries", file=sys.stderr)
PY
cp .nixl/VERSION "$B/nixl/"
# The Python module and its tests (test_cuda.py runs on the GPU host when torch is there).
mkdir -p "$B/python"
cp target/wheels/nixl_connect-*.whl "$B/python/"
cp -r tests/python "$B/python/tests"
cp scripts/bench_python_ops.py "$B/python/"
# What the Python tests import beyond the GPU host's image (torch, numpy and pytest are there;
# pydantic, pytest-asyncio and uvloop, on which Dynamo runs its workers, are not), as wheels for
# its Python 3.12, installed with --no-index.
mkdir -p "$B/python/wheels"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$B/python/wheels" "pydantic==2.13.5" "pydantic-core==2.46.5" "annotated-types==0.8.0" \
  "typing-inspection==0.4.5" "pytest-asyncio==1.5.0" "uvloop==0.23.0" \
  || echo "gpu-bundle: could not download the Python test dependencies; the GPU host must have them" >&2
rm -rf "$B/python/tests/__pycache__"
cp scripts/gpu-run.sh scripts/gpu-rows.sh scripts/gpu-pods.sh scripts/gpu_torch_pods.py scripts/gpu_torch_alloc.py "$B/"
for a in gpu_pair.py gpu_copy.py gpu_ipc.py gpu_ipc_small.py dyn_pair.py nixl_raw_pair.py; do
  [ -f "../shared/anchors/$a" ] && mkdir -p "$B/anchors" && cp "../shared/anchors/$a" "$B/anchors/"
done
tar -C .bundle -czf .bundle/nixl-connect-gpu.tar.gz nixl-connect-gpu
size=$(stat -c %s .bundle/nixl-connect-gpu.tar.gz)
echo "gpu-bundle: .bundle/nixl-connect-gpu.tar.gz is $((size >> 20)) MiB ($size bytes)"
if [ "$size" -gt "$LIMIT" ]; then
  echo "gpu-bundle: over the 60 MiB limit" >&2
  exit 1
fi
