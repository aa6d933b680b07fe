#!/usr/bin/env bash
# Builds the nixl_connect wheel as Dynamo ships its runtime: abi3, manylinux_2_28 (glibc 2.28, so it
# installs on the distributions Dynamo supports), stripped. Zig (PyPI's ziglang, in .venv) links
# against glibc 2.28's symbols; maturin audits the result. Needs .venv from `scripts/setup.sh --interop`.
# Usage: bash scripts/build-wheel.sh [OUT_DIR]   (default target/wheels)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-target/wheels}
# maturin finds zig as `python3 -m ziglang`: the venv's python3 must come first.
export PATH="$PWD/.venv/bin:$PATH"
# bindgen (nixl-sys) parses NIXL's C header with libclang for zig's target: name clang's own headers.
inc=$(ls -d /usr/lib/llvm-*/lib/clang/*/include 2>/dev/null | sort -V | tail -n1)
export BINDGEN_EXTRA_CLANG_ARGS="${inc:+-I$inc} -I/usr/include -I/usr/include/x86_64-linux-gnu"
# nixl-sys's C++ stub needs libstdc++ (zig's own C++ library is not it): link the system's by path,
# which records only the NEEDED entry (the symbols it uses are GLIBCXX_3.4, allowed by manylinux_2_28).
# (awk reads all of ldconfig's output: exiting early would SIGPIPE ldconfig, fatal under pipefail.)
stdcxx=$(ldconfig -p | awk '/libstdc\+\+\.so\.6 .*x86-64/ && !found {found = $NF} END {print found}')
export RUSTFLAGS="${RUSTFLAGS:-} -C link-arg=${stdcxx:-/usr/lib/x86_64-linux-gnu/libstdc++.so.6}"
echo "build-wheel: building the nixl_connect wheel (maturin --zig, release, manylinux_2_28, stripped)" >&2
rm -f "$out"/nixl_connect-*.whl
.venv/bin/maturin build -q --release --zig -i .venv/bin/python -m crates/nixl-connect-py/Cargo.toml -o "$out" >&2
ls "$out"/nixl_connect-*-manylinux_2_28_x86_64.whl >/dev/null
