#!/usr/bin/env bash
# Type-checks the library and its tests under every feature set a user may pick (what `cargo hack
# --each-feature` does): default features, none, and each feature alone (`cargo check --tests`:
# what fails to compile under one feature set fails here, without the code generation and linking
# of a build per set, minutes on a clean clone; the main run builds and links everything). The main run
# (scripts/test.sh) builds and runs everything with --all-features; this catches a test or an item
# that compiles only when some other feature is on (the first command a Rust user types is
# `cargo test -p nixl-connect`, with default features).
# Usage: bash scripts/test-features.sh
set -euo pipefail
cd "$(dirname "$0")/.."
features=$(sed -n '/^\[features\]/,/^\[/p' crates/nixl-connect/Cargo.toml | grep -o '^[a-z][a-z0-9_-]*' | grep -v '^default$')
run() {
  echo "== cargo check -p nixl-connect --tests --examples $*" >&2
  cargo check -q -p nixl-connect --tests --examples "$@" || { echo "test-features: the tests do not compile with: $*" >&2; exit 1; }
}
run
run --no-default-features
for f in $features; do
  run --no-default-features --features "$f"
done
