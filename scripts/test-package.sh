#!/usr/bin/env bash
# The crates as a registry would take them: `cargo package` for the library and the command, each
# built from its `.crate` alone (the command against the library's `.crate`, through cargo's
# temporary local registry). `cargo publish --dry-run` would also ask crates.io's index, which CI
# may not reach: `cargo package` checks the same packaging offline, with the dependencies this
# build already fetched (Cargo.lock). Then what each .crate holds, and `nixl-connect --version`.
# Usage: bash scripts/test-package.sh
set -euo pipefail
cd "$(dirname "$0")/.."
# Cargo unpacks the library's .crate from its temporary registry into $CARGO_HOME/registry/src/
# once per version and registry path, and reuses that copy from then on (a published version never
# changes): a copy from an earlier run would build the command against an older library. Those
# copies are removed first (local registries are the folders named "-<hash>").
rm -rf "${CARGO_HOME:-$HOME/.cargo}"/registry/src/-*/nixl-connect-[0-9]*
# Likewise a build of that copy: cargo takes a registry crate's build as fresh whatever its
# sources, so the packages are built in a target folder of their own, where this project's crates
# are cleaned first (their dependencies' builds stay).
export CARGO_TARGET_DIR=$PWD/target/package-check
cargo clean -q -p nixl-connect -p nixl-connect-cli
# --allow-dirty: a developer's uncommitted change is packaged as it is (CI's clone is clean).
cargo package -p nixl-connect -p nixl-connect-cli --offline --allow-dirty
for c in nixl-connect nixl-connect-cli; do
  files=$(tar -tzf "$CARGO_TARGET_DIR/package/$c-0.1.0.crate")
  for f in Cargo.toml LICENSE README.md src/lib.rs src/main.rs; do
    case "$c/$f" in nixl-connect/src/main.rs|nixl-connect-cli/src/lib.rs) continue ;; esac
    grep -qx "$c-0.1.0/$f" <<<"$files" || { echo "test-package: the $c crate has no $f" >&2; exit 1; }
  done
done
# What `cargo install nixl-connect-cli` gives: the `nixl-connect` command, with its version.
v=$(CARGO_TARGET_DIR=$PWD/target cargo run -q -p nixl-connect-cli -- --version)
echo "test-package: both crates packaged and built from their .crate files; $v" >&2
[[ "$v" == "nixl-connect 0.1.0" ]] || { echo "test-package: --version said '$v'" >&2; exit 1; }
