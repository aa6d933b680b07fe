#!/usr/bin/env bash
# The soaks (docs/SOUNDNESS.md, docs/FAILURES.md), release builds against the real NIXL library:
#   bash scripts/soak.sh [SECONDS]          10 minutes (default) of mixed load between two
#       processes, 1,000 operations outstanding, both paths, reads and writes, random drops, the
#       peer killed and restarted every minute; the tally, RSS and descriptors every 10 s, SOAK-OK.
#   bash scripts/soak.sh --churn [SECONDS]  the churn soak (issue 43): owners in one network
#       namespace come and go every second (half killed), a reader in another keeps 1,000 reads
#       outstanding across them over both paths while the link between them goes down for a
#       second every 20 s; every operation ends once (0 lost), and the reader holds the same
#       descriptors, threads and connections (RSS within 10%) after the soak as after its warm-up.
#       Needs root (network namespaces). CI runs 60 s.
# Usage: after bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
test=soak::soak_mixed_load_between_two_processes
if [ "${1:-}" = "--churn" ]; then
  test=soak::soak_churn_owners_come_and_go
  shift
fi
export NIXL_CONNECT_SOAK_SECS=${1:-600}
cargo test --release -p nixl-connect --all-features --test integration -- \
  --ignored --exact "$test" --nocapture --test-threads=1
