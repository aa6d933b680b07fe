#!/usr/bin/env bash
# The main job: installs what is missing, builds, and runs the two-process demo (one process exposes
# a 256 MiB buffer as readable, another reads it; both verify the bytes; the throughput is printed).
# Usage: bash scripts/demo.sh [demo options, e.g. --size 64M]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo build --release -q -p nixl-connect-cli
exec target/release/nixl-connect demo "$@"
