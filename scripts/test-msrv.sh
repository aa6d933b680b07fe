#!/usr/bin/env bash
# The declared minimum Rust (`rust-version` in Cargo.toml) checks the library and the command with
# every feature, against the dependency versions Cargo.lock holds (some need that Rust: 1.89 for
# uuid 1.29). Installs that toolchain with rustup if missing (minimal profile); its own target
# directory keeps the main build's intact.
# Usage: bash scripts/test-msrv.sh
set -euo pipefail
cd "$(dirname "$0")/.."
msrv=$(sed -n 's/^rust-version = "\(.*\)"/\1/p' Cargo.toml)
[ -n "$msrv" ] || { echo "test-msrv: no rust-version in Cargo.toml" >&2; exit 1; }
rustup toolchain list | grep -q "^$msrv" || rustup toolchain install "$msrv" --profile minimal
CARGO_TARGET_DIR=${MSRV_TARGET_DIR:-target/msrv} cargo "+$msrv" check -p nixl-connect -p nixl-connect-cli --all-features
echo "test-msrv: Rust $msrv checks nixl-connect and nixl-connect-cli (every feature)" >&2
