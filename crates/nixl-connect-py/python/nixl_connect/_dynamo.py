"""Running Dynamo's own code on `nixl_connect`: `install_as_dynamo()` and `NIXL_CONNECT_AS_DYNAMO`.

Dynamo's workers import `dynamo.nixl_connect` themselves (`import dynamo.nixl_connect as connect`,
`from dynamo import nixl_connect`, `from dynamo.nixl_connect import RdmaMetadata`, annotations in
dataclasses and pydantic models). `install_as_dynamo()` makes that name resolve to this module, so
every class those callers see, `RdmaMetadata` included, is ours, and a pydantic model typed with
`dynamo.nixl_connect.RdmaMetadata` validates our metadata.

It refuses to half-apply: once Dynamo's own module has been imported, objects of both modules may
exist (a model class typed with Dynamo's `RdmaMetadata`, a `Descriptor` made by Dynamo's class), so
switching then raises instead. Two ways to switch early enough:

* `nixl_connect.install_as_dynamo()` first thing in the worker's entry point, or
* `NIXL_CONNECT_AS_DYNAMO=1` in the worker's environment: the wheel's `nixl_connect_as_dynamo.pth`
  calls `install_as_dynamo()` when the interpreter starts (nothing is imported when it is unset).
"""
from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

ENV = "NIXL_CONNECT_AS_DYNAMO"
"""The environment variable that switches a whole interpreter over at start-up ("1")."""

_NAME = "dynamo.nixl_connect"


def install_as_dynamo() -> ModuleType:
    """Make `dynamo.nixl_connect` resolve to `nixl_connect` in this interpreter; returns it.

    Idempotent. Raises RuntimeError when Dynamo's own `dynamo.nixl_connect` was imported already
    (call it earlier, or set `NIXL_CONNECT_AS_DYNAMO=1`). Dynamo's package itself (`dynamo`, from
    `ai-dynamo-runtime`) is untouched; only its `nixl_connect` submodule is replaced.
    """
    ours = sys.modules[__name__.rpartition(".")[0]]
    current = sys.modules.get(_NAME)
    if current is ours:
        return ours
    if current is not None:
        raise RuntimeError(
            "dynamo.nixl_connect (Dynamo's own module) was imported before "
            "nixl_connect.install_as_dynamo(): objects of both modules may already exist, so "
            "switching now would half-apply. Call nixl_connect.install_as_dynamo() before anything "
            f"imports dynamo.nixl_connect, or set {ENV}=1 in the worker's environment.")
    sys.modules[_NAME] = ours
    # The parent package's attribute too, so that `import dynamo.nixl_connect` followed by
    # `dynamo.nixl_connect.X` works (the import system sets it only when it loads the submodule).
    try:
        parent = importlib.import_module("dynamo")
    except ImportError:  # Dynamo's runtime is not installed: only the sys.modules entry matters
        parent = None
    if parent is not None:
        setattr(parent, "nixl_connect", ours)
    return ours


def is_installed_as_dynamo() -> bool:
    """True when `dynamo.nixl_connect` resolves to `nixl_connect` in this interpreter."""
    return sys.modules.get(_NAME) is sys.modules.get(__name__.rpartition(".")[0])


def _install_from_environment() -> None:
    """The `.pth` hook: install when `NIXL_CONNECT_AS_DYNAMO` is set to anything but "" or "0"."""
    if os.environ.get(ENV, "") not in ("", "0"):
        install_as_dynamo()
