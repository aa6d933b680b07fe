#!/usr/bin/env bash
# The soak (docs/SOUNDNESS.md): 10 minutes of mixed load between two processes, 1,000 operations
# outstanding, both paths, reads and writes, random drops, the peer killed and restarted every
# minute. Prints the tally, RSS and file descriptors every 10 s, and SOAK-OK if every check held.
# Usage: bash scripts/soak.sh [SECONDS]   (after bash scripts/setup.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
export NIXL_CONNECT_SOAK_SECS=${1:-600}
cargo test --release -p nixl-connect --all-features --test integration -- \
  --ignored --exact soak::soak_mixed_load_between_two_processes --nocapture --test-threads=1
