#!/usr/bin/env bash
# Runs the NIXL tests on every NIXL release Dynamo's extras pin besides the one setup.sh installs
# (1.5.1): 1.4.1 (ai-dynamo 1.6.1's vllm extra) and 1.5.0 (its sglang extra; both extras of
# 1.7.0.dev). Each release is downloaded from PyPI (nixl-cu13) into .nixl-<version>/ and chosen with
# NIXL_CONNECT_LIB, with no override: the version beside the library is checked as in production.
# What runs on each: the library's integration tests whose bytes move through NIXL (the modules
# scripts/nixl-modules.sh lists; scripts/test.sh runs them all on the pinned release) and the
# tests the ai-dynamo wheel ships for its nixl_connect callers, on nixl_connect (test-dynamo.sh).
# Usage: bash scripts/test-nixl-versions.sh [VERSION...]   (default: 1.4.1 1.5.0; needs setup.sh --interop)
set -euo pipefail
cd "$(dirname "$0")/.."
versions=("$@"); [ ${#versions[@]} -gt 0 ] || versions=(1.4.1 1.5.0)
unset NIXL_CONNECT_SKIP_VERSION_CHECK
source scripts/nixl-modules.sh
source scripts/test-exe.sh
integration=$(test_exe integration)
cargo build -q --workspace --all-features   # the CLI (doctor, below), as scripts/test.sh built it
for v in "${versions[@]}"; do
  NIXL_VERSION=$v NIXL_DIR=".nixl-$v" bash scripts/setup.sh
  export NIXL_CONNECT_LIB="$PWD/.nixl-$v/lib"
  # Which NIXL the tests load, as the library itself finds and checks it (no override), and its
  # self-test (a 1 MiB read between two agents).
  target/debug/nixl-connect doctor --json | .venv/bin/python -c '
import json, sys
v = sys.argv[1]
checks = {c["check"]: c for c in json.load(sys.stdin)["checks"]}
lib, st = checks["NIXL library"], checks["self-test"]
ok = lib["status"] == "ok" and lib["detail"].endswith("==" + v + ")") and st["status"] == "ok"
print("test-nixl-versions: NIXL library", lib["detail"], "; self-test", st["status"], file=sys.stderr)
sys.exit(0 if ok else 1)' "$v" || { echo "test-nixl-versions: NIXL $v did not load and pass doctor's self-test" >&2; exit 1; }
  echo "== NIXL $v: the integration tests that move bytes through NIXL (${nixl_modules[*]})" >&2
  (cd crates/nixl-connect && "$integration" "${nixl_filters[@]}") 2>&1
  echo "== NIXL $v: Dynamo's multimodal tests on nixl_connect" >&2
  bash scripts/test-dynamo.sh
done
