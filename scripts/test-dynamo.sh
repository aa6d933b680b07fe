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
# Needs .venv from `bash scripts/setup.sh --interop`.
set -euo pipefail
cd "$(dirname "$0")/.."
site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
export NIXL_CONNECT_AS_DYNAMO=1
export PYTHONPATH="$PWD/tests/dynamo${PYTHONPATH:+:$PYTHONPATH}"
export NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-WARN}
cd "$site"   # Dynamo's tests import their conftest from the installed package
exec "$OLDPWD/.venv/bin/python" -m pytest -q -p no:cacheprovider -p nc_as_dynamo \
  -o asyncio_mode=auto -o asyncio_default_fixture_loop_scope=function \
  -W ignore::DeprecationWarning \
  dynamo/common/tests/multimodal -m "not vllm" -k "not test_gpu_benchmark" "$@"
