#!/usr/bin/env bash
# Installs the Python module as a user without this checkout does, and uses it: the source
# distribution (`maturin sdist`) goes into a fresh venv with `pip install` alone (pip fetches maturin
# and builds the Rust core with cargo), NIXL beside it from PyPI's nixl-cu13 wheel (what the
# `[cu13]` extra brings; installed here with --no-deps, since that wheel requires torch, several GB),
# and that venv's `nixl_connect`, with no NIXL_CONNECT_LIB, finds NIXL in its own environment and
# reads a readable that an unmodified Python Dynamo worker (`dynamo.nixl_connect` from ai-dynamo,
# in .venv) exposes, bytes checked. The installed metadata is checked too: the version
# (`nixl_connect.__version__`), the license, and the extras that bring NIXL.
# The dependencies' cargo build is kept in target/sdist-build, so a second run builds only this
# project's crates.
# Usage: bash scripts/test-sdist.sh   (needs .venv from `bash scripts/setup.sh --interop`)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
work=$root/target/sdist-test
rm -rf "$work/dist" "$work/venv"
mkdir -p "$work"
log=$(.venv/bin/maturin sdist -m crates/nixl-connect-py/Cargo.toml -o "$work/dist" 2>&1) || { echo "$log" >&2; exit 1; }
sdist=$(ls "$work"/dist/nixl_connect-*.tar.gz)
echo "test-sdist: $(basename "$sdist"), $(tar tzf "$sdist" | wc -l) files" >&2
# The interpreter .venv was made from, without .venv's packages.
base=$(.venv/bin/python -c 'import sys; print(getattr(sys, "_base_executable", sys.executable))')
"$base" -m venv "$work/venv"
py=$work/venv/bin/python
unset NIXL_CONNECT_LIB NIXL_CONNECT_AS_DYNAMO PYTHONPATH VIRTUAL_ENV
# The build's dependencies are kept between runs, never this project's crates: the sdist's sources
# carry the archive's old times, so cargo would take a previous run's build of them as fresh.
cargo clean -q --release -p nixl-connect -p nixl-connect-py --target-dir "$root/target/sdist-build"
# Away from the checkout's Python sources, so nothing of them is imported by accident. No pip
# cache: pip would reuse the wheel it built from an sdist of the same path and name last time.
cd "$work"
CARGO_TARGET_DIR=$root/target/sdist-build "$py" -m pip install -q --disable-pip-version-check --no-cache-dir "$sdist"
"$py" -m pip install -q --disable-pip-version-check --no-deps "$(cat "$root/.nixl/VERSION")"
# What the core module defines, as the checkout's own build (setup.sh's, in .venv) has it: the
# sdist's build must define the same, or an older build was installed.
surface='import json, nixl_connect._core as c; print(json.dumps({n: sorted(dir(getattr(c, n))) for n in dir(c) if not n.startswith("_")}, sort_keys=True))'
export NC_SURFACE=$(cd /tmp && "$root/.venv/bin/python" -c "$surface")
"$py" - <<'EOF'
import importlib.metadata as m
import nixl_connect as nc
assert nc.__file__.startswith(__import__("sys").prefix), nc.__file__
# Built from this tree's sources: the same core as the checkout's own build.
import json, os
c = nc._core
mine = {n: sorted(dir(getattr(c, n))) for n in dir(c) if not n.startswith("_")}
assert json.dumps(mine, sort_keys=True) == os.environ["NC_SURFACE"], "an older build was installed"
md = m.metadata("nixl-connect")
assert nc.__version__ == m.version("nixl-connect"), (nc.__version__, m.version("nixl-connect"))
assert md["License"] == "Apache-2.0" or "Apache" in (md.get("License-Expression") or ""), md["License"]
req = m.requires("nixl-connect") or []
for extra in ("cu12", "cu13"):
    assert any(r.startswith(f"nixl-{extra}") and r.replace('"', "'").endswith(f"extra == '{extra}'") for r in req), req
print(f"test-sdist: nixl_connect {nc.__version__} installed; requires {req}")
EOF
n=1048576
"$root/.venv/bin/python" "$root/tests/interop/py_peer.py" pattern --size $n --out "$work/expected"
coproc peer { exec "$root/.venv/bin/python" "$root/tests/interop/py_peer.py" readable --size $n --timeout 60; }
pid=$peer_PID
trap 'kill $pid 2>/dev/null || true' EXIT
# NIXL logs to stdout too: the metadata is the line that is a JSON object.
metadata=
while [ -z "$metadata" ]; do
  read -r -t 120 line <&"${peer[0]}" || { echo "test-sdist: the Dynamo worker printed no metadata" >&2; exit 1; }
  case $line in "{"*) metadata=$line ;; esac
done
METADATA=$metadata EXPECTED=$work/expected "$py" - <<'EOF'
import asyncio, os
import nixl_connect as nc

async def main():
    md = nc.RdmaMetadata.model_validate_json(os.environ["METADATA"])
    expected = open(os.environ["EXPECTED"], "rb").read()
    dst = bytearray(len(expected))
    conn = nc.Connector()
    op = await conn.begin_read(md, nc.Descriptor(dst))
    await asyncio.wait_for(op.wait_for_completion(), 60)
    assert dst == expected, "the bytes read differ from the Dynamo worker's"
    print(f"test-sdist: read {len(dst)} bytes from a Dynamo worker, bytes checked")

asyncio.run(main())
EOF
wait "$pid"
trap - EXIT
