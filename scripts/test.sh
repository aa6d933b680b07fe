#!/usr/bin/env bash
# Runs every test of nixl-connect on a fresh machine: installs what is missing (libclang, the NIXL
# wheel, the Python Dynamo module for interop, nats-server, etcd, prometheus), checks formatting and lints, then runs
# the whole test suite against the real NIXL library (Rust, then the Python module against Dynamo's).
# Usage: bash scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
# Each step says how long the one before it took (CI's time is the sum; where it goes is here).
t_start=$(date +%s); t_step=$t_start
step() {
  local now; now=$(date +%s)
  echo "   ($((now - t_step)) s)" >&2
  t_step=$now
  echo "== $*" >&2
}
echo "== setup (what is missing is installed, the Python module built)" >&2
bash scripts/setup.sh --interop --nats --etcd --prometheus
export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}
# A clean build gains nothing from incremental state, and it doubles the target directory (28 of
# 52 GB once here): CI on a full disk failed installing torch.
export CARGO_INCREMENTAL=${CARGO_INCREMENTAL:-0}
step "cargo fmt --check"
cargo fmt --all -- --check
step "cargo clippy -D warnings"
cargo clippy --workspace --all-targets --all-features -- -D warnings
step "cargo doc (public, then private items: every intra-doc link resolves)"
# Cargo's own warnings (an output filename collision: two targets documented into one folder at once)
# are not rustdoc's, so -D warnings misses them: any warning line fails the run.
doc_log=$(RUSTDOCFLAGS="-D warnings" cargo doc --workspace --all-features --no-deps -q 2>&1) || { echo "$doc_log" >&2; exit 1; }
if grep -q '^warning' <<<"$doc_log"; then echo "$doc_log" >&2; echo "cargo doc warned" >&2; exit 1; fi
RUSTDOCFLAGS="-D warnings" cargo doc -p nixl-connect --all-features --no-deps --document-private-items -q
step "cargo test"
cargo test --workspace --all-features 2>&1
step "the library's tests compile with default features, none, and each feature alone"
bash scripts/test-features.sh
step "the crates as a registry takes them (cargo package, offline; each built from its .crate)"
bash scripts/test-package.sh
step "the declared minimum Rust (rust-version) checks the crates"
bash scripts/test-msrv.sh
step "the core's unit tests and the loopback tests with NIXL_CONNECT_LIB naming nothing (no NIXL library)"
# (The executables `cargo test` built, run as cargo does: scripts/test-exe.sh says why.)
source scripts/test-exe.sh
unit=$(test_exe nixl_connect); loopback=$(test_exe loopback); integration=$(test_exe integration)
(cd crates/nixl-connect && NIXL_CONNECT_LIB=/nonexistent/libnixl_capi.so "$unit" && NIXL_CONNECT_LIB=/nonexistent/libnixl_capi.so "$loopback") 2>&1
step "pytest tests/python (nixl_connect and dynamo.nixl_connect side by side, Dynamo's callers on both)"
# Real torch (CPU use) from .venv. The watchdog in tests/python/conftest.py ends a hung test with
# every thread's stack.
.venv/bin/python -m pytest tests/python -q -p no:cacheprovider
step "pytest: the tests the ai-dynamo wheel ships for its nixl_connect callers, on nixl_connect"
bash scripts/test-dynamo.sh
bash scripts/test-dynamo.sh --next
step "the Python sdist, pip-installed into a fresh venv, reads a Python Dynamo worker's readable"
bash scripts/test-sdist.sh
step "the churn soak, 60 s (owners come and go, link flaps; 0 lost, nothing held after)"
# (scripts/soak.sh --churn 60, in the debug build `cargo test` already made; NIXL's own error
# lines about the killed owners are filtered out; the pipeline fails if the soak does.)
(cd crates/nixl-connect && NIXL_CONNECT_SOAK_SECS=60 "$integration" --ignored --exact \
  soak::soak_churn_owners_come_and_go --nocapture --test-threads=1) 2>&1 | grep -v '^[EWI][0-9]\{4\} \|UCX  ERROR'
step "one nixl-sys with Dynamo's crates: interop/dynamo-memory, and the integration tests on nixl-sys 1.3.2"
bash scripts/test-interop.sh
step "the NIXL tests on the other NIXL releases Dynamo's extras pin (1.4.1, 1.5.0)"
bash scripts/test-nixl-versions.sh
step "done: every test passed in $(( $(date +%s) - t_start )) s"
