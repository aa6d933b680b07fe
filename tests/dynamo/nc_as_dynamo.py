"""pytest plugin for running the tests the `ai-dynamo` wheel ships, unmodified, on `nixl_connect`.

Loaded with `-p nc_as_dynamo` by `scripts/test-dynamo.sh`, which sets `NIXL_CONNECT_AS_DYNAMO=1` so
that the wheel's `.pth` hook makes `dynamo.nixl_connect` resolve to `nixl_connect` when the
interpreter starts. This plugin proves that happened before any test module is imported (a run on
Dynamo's own module would prove nothing), registers Dynamo's markers, and says which module ran.
"""
import os
import sys

import pytest

DYNAMO_MARKERS = ("pre_merge", "post_merge", "nightly", "integration", "unit", "multimodal",
                  "gpu_0", "gpu_1", "gpu_2", "gpu_4", "vllm", "sglang", "trtllm", "timeout",
                  "parallel", "e2e", "slow")


def pytest_configure(config):
    for m in DYNAMO_MARKERS:
        config.addinivalue_line("markers", f"{m}: Dynamo's marker")
    want = os.environ.get("NC_DYNAMO_MODULE", "nixl_connect")
    import dynamo.nixl_connect as module
    if module.__name__ != want:
        raise pytest.UsageError(
            f"dynamo.nixl_connect is {module.__name__} ({module.__file__}), expected {want}: "
            "NIXL_CONNECT_AS_DYNAMO=1 did not take effect (is the nixl_connect wheel installed?)")
    sys.stderr.write(f"nc_as_dynamo: dynamo.nixl_connect is {module.__name__} ({module.__file__})\n")


def pytest_report_header(config):
    import dynamo.nixl_connect as module
    return f"dynamo.nixl_connect resolves to: {module.__name__}"
