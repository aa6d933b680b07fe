#!/usr/bin/env bash
# Runs the tests the ai-dynamo wheel ships for the callers of dynamo.nixl_connect, unmodified, with
# dynamo.nixl_connect resolving to this project's nixl_connect (NIXL_CONNECT_AS_DYNAMO=1: the
# wheel's .pth hook). tests/dynamo/nc_as_dynamo.py refuses to run if the switch did not happen.
#
# What runs: dynamo/common/tests/multimodal (test_embedding_transfer.py's NIXL read-based
# correctness and benchmark on CPU tensors, the mm_kwargs, media, image/video/audio loader tests and
# the rest of the folder) with Dynamo's own pytest settings (asyncio_mode=auto).
# What cannot run here, and why:
#   - test_embedding_transfer.py::*::test_gpu_benchmark: CUDA tensors (no GPU on this machine).
#   - tests marked `vllm` (mm_kwargs receiver with vLLM types), vllm/tests/omni (imports vllm and
#     vllm_omni), trtllm/tests (imports tensorrt_llm, needs CUDA): those packages are several GB of
#     CUDA builds. Their nixl_connect call patterns are exercised by tests/python/test_dynamo_callers.py.
#
# With --next: the same folder of Dynamo's next release (1.7.0.dev, installed in .dynamo-next/ by
# setup.sh and put ahead of .venv's 1.6.1 on PYTHONPATH), plus tests/dynamo/test_next_on_ours.py.
# Twelve of its tests cannot pass on this module, and are deselected: test_nixl_warmup.py patches
# `dynamo.nixl_connect.nixl_api` (NIXL's Python API) with a mock and counts its `nixl_agent` calls
# (or makes them raise), which only a module that creates its agents through NIXL's Python API
# does; this one creates them in its Rust core. test_next_on_ours.py covers the same behaviours on
# this module with the real library (the loaders warm up one shared connection before the first
# transfer, stay lazy without frontend decoding, a failed warm-up reaches the loader's caller and
# leaves no connection, and is retried).
# Needs .venv from `bash scripts/setup.sh --interop`.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
export NIXL_CONNECT_AS_DYNAMO=1
export PYTHONPATH="$root/tests/dynamo${PYTHONPATH:+:$PYTHONPATH}"
export NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-WARN}
extra=(); skip="test_gpu_benchmark"
if [ "${1:-}" = "--next" ]; then
  shift
  [ -f .dynamo-next/VERSION ] || { echo "test-dynamo: .dynamo-next/ is missing: run bash scripts/setup.sh --interop" >&2; exit 2; }
  site=$root/.dynamo-next
  export PYTHONPATH="$root/tests/dynamo:$site${PYTHONPATH#"$root/tests/dynamo"}"
  extra=("$root/tests/dynamo/test_next_on_ours.py")
  # The twelve that count the mocked NIXL API's agent calls (names found only in test_nixl_warmup.py).
  for t in test_loader_warms_connection_in_sync_context test_loader_warms_connection_before_first_transfer \
           test_loader_fails_startup_if_warmup_fails test_concurrent_warmup_and_transfer_share_one_connection \
           test_connector_remains_lazy_until_warmup test_failed_warmup_can_be_retried; do
    skip="$skip or $t"
  done
fi
cd "$site"   # Dynamo's tests import their conftest from the installed package
exec "$root/.venv/bin/python" -m pytest -q -p no:cacheprovider -p nc_as_dynamo \
  -o asyncio_mode=auto -o asyncio_default_fixture_loop_scope=function \
  -W ignore::DeprecationWarning \
  dynamo/common/tests/multimodal "${extra[@]}" -m "not vllm" -k "not ($skip)" "$@"
