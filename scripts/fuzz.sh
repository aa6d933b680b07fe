#!/usr/bin/env bash
# Coverage-guided fuzzing of what peers send: the JSON RdmaMetadata, NIXL agent metadata, and
# the same-host wire frames. Each target runs for SECONDS (default 60) or RUNS executions, growing
# the committed corpus under fuzz/corpus/<target>; a crash leaves its input in fuzz/artifacts/.
# Needs cargo-fuzz (`cargo install cargo-fuzz`) and a nightly toolchain (or RUSTC_BOOTSTRAP=1).
# Usage: bash scripts/fuzz.sh [--runs N] [--seconds S] [--max-len BYTES] [target...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh   # libclang for nixl-sys's bindgen
cd fuzz
secs=60
runs=""
maxlen=65536
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) secs=$2; shift 2 ;;
    --runs) runs=$2; shift 2 ;;
    --max-len) maxlen=$2; shift 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
[ ${#targets[@]} -gt 0 ] || targets=(metadata_json agent_metadata wire_frames link_sequences)
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
toolchain=()
if rustup toolchain list 2>/dev/null | grep -q nightly; then toolchain=(+nightly); else export RUSTC_BOOTSTRAP=1; fi
for t in "${targets[@]}"; do
  mkdir -p "corpus/$t"
  limit=(-max_total_time="$secs")
  [ -n "$runs" ] && limit=(-runs="$runs")
  echo "== fuzz $t (${limit[*]})" >&2
  cargo "${toolchain[@]}" fuzz run -O "$t" "corpus/$t" -- "${limit[@]}" -max_len="$maxlen" -rss_limit_mb=2048 -print_final_stats=1 2>&1 \
    | grep -E 'stat::|Done|ERROR|panicked|SUMMARY|cov:' | tail -8
done
