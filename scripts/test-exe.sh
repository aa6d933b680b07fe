#!/usr/bin/env bash
# Sourced: `test_exe TARGET` prints the path of the test executable `cargo test --workspace
# --all-features` built for TARGET (`nixl_connect`: the library's unit tests; `integration`,
# `loopback`: those test targets), building it if it is missing or stale. The steps after
# scripts/test.sh's `cargo test` run these executables (from crates/nixl-connect, where cargo runs
# them) instead of a narrower `cargo test`: selecting fewer packages or targets resolves other
# dependency features, and the library and its tests would build again once per step.
test_exe() {
  cargo test --workspace --all-features --no-run --message-format=json \
    | python3 -c '
import json, sys
want, found = sys.argv[1], []
for line in sys.stdin:  # to the end: cargo fails on a closed pipe
    m = json.loads(line)
    t = m.get("target", {})
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"] \
            and t.get("name") == want and m["manifest_path"].endswith("/crates/nixl-connect/Cargo.toml"):
        found.append(m["executable"])
if not found:
    sys.exit("test-exe: no test executable for " + want)
print(found[0])' "$1"
}
