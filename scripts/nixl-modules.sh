#!/usr/bin/env bash
# The integration-test modules that run again on each other NIXL release and nixl-sys version
# (scripts/test-nixl-versions.sh, scripts/test-interop.sh): those whose bytes move through NIXL,
# so that NIXL's C API (agents, registration, metadata, transfers, notifications, a peer's
# failure) is exercised end to end on that release. scripts/test.sh's `cargo test` runs every
# module on the pinned release. Left out here: the same-host wing's tests (local, pods, flood,
# hostile, impostor), the metadata channels' (channels, etcd), the metadata parser's (untrusted)
# and the GPU's (gpu): none reaches NIXL beyond the agent every connector above makes too.
# Sourced: sets `nixl_filters` (libtest filters, one per module), after checking that each module
# is still declared in tests/integration/main.rs (a renamed one would otherwise run nothing).
nixl_modules=(core driven faults freed limits metrics quarantine soundness stall)
nixl_filters=()
for m in "${nixl_modules[@]}"; do
  grep -q "^\(pub(crate) \)\?mod $m;" crates/nixl-connect/tests/integration/main.rs \
    || { echo "nixl-modules: no integration module $m (update scripts/nixl-modules.sh)" >&2; exit 1; }
  nixl_filters+=("$m::")
done
