#!/usr/bin/env bash
# One nixl-sys in any graph (issue 44): nixl-connect accepts every nixl-sys from 1.3.2 (what
# Dynamo's dynamo-memory and dynamo-llm 1.6.1 pin) to the newest 1.5.x (the workspace's lock).
#   1. interop/dynamo-memory, a crate depending on `dynamo-memory = "=1.6.1"` and nixl-connect
#      together (its own lockfile: nixl-sys 1.3.2, cudarc 0.19.8), is linted and its tests run:
#      descriptors over Dynamo's storage read and written over NIXL and the same-host path.
#      Its example media_read then reads, in one process, what another publishes the way Dynamo's
#      Rust media path does (dynamo-memory's NixlAgent), checksums compared.
#   2. The library's integration tests that move bytes through NIXL (scripts/nixl-modules.sh) run
#      on the lowest nixl-sys (1.3.2); `cargo test` in scripts/test.sh runs them all on the lock's
#      (the newest).
# Usage: bash scripts/test-interop.sh   (after scripts/setup.sh; NIXL_CONNECT_LIB defaults to .nixl/lib)
set -euo pipefail
cd "$(dirname "$0")/.."
export NIXL_CONNECT_LIB=${NIXL_CONNECT_LIB:-$PWD/.nixl/lib}
lowest=1.3.2
version_in() { grep -A1 '^name = "nixl-sys"$' "$1" | sed -n 's/^version = "\(.*\)"$/\1/p'; }
echo "== interop/dynamo-memory: nixl-connect and dynamo-memory 1.6.1 in one build" >&2
(
  cd interop/dynamo-memory
  cargo fmt -- --check
  cargo clippy --locked --target-dir ../../target/interop --all-targets -- -D warnings
  cargo test --locked --target-dir ../../target/interop 2>&1
)
echo "== interop/dynamo-memory's media_read: Dynamo's media publication (dynamo-memory's NIXL module) read by nixl-connect in another process" >&2
ex=target/interop/debug/examples/media_read
errs=$(mktemp)
read_out=$(timeout 120 "$ex" publish 480 640 2>"$errs" | timeout 120 "$ex")
published=$(grep -o 'checksum [0-9a-f]*' "$errs" || true)
rm -f "$errs"
echo "media_read: published ${published:-nothing}; $read_out" >&2
[ -n "$published" ] && [ "$published" = "$(grep -o 'checksum [0-9a-f]*' <<<"$read_out")" ] \
  || { echo "test-interop: the media read did not return the published bytes" >&2; exit 1; }
got=$(version_in interop/dynamo-memory/Cargo.lock)
[ "$got" = "$lowest" ] || { echo "test-interop: the interop build has nixl-sys $got, not $lowest" >&2; exit 1; }
echo "== the library's NIXL integration tests on nixl-sys $lowest (the workspace's lock has $(version_in Cargo.lock))" >&2
saved=$(mktemp)
cp Cargo.lock "$saved"
trap 'cp "$saved" Cargo.lock; rm -f "$saved"' EXIT
cargo update -q -p nixl-sys --precise "$lowest"
[ "$(version_in Cargo.lock)" = "$lowest" ]
source scripts/nixl-modules.sh
# In the shared target folder: only nixl-sys and what uses it build again (their builds for the
# two versions are kept side by side, so the next steps find theirs).
cargo test --workspace --all-features --test integration -- "${nixl_filters[@]}" 2>&1
