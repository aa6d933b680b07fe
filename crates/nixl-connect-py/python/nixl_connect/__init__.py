"""nixl_connect: a drop-in replacement for NVIDIA Dynamo's `dynamo.nixl_connect` (1.6.1, plus what
1.7 adds: `await Connector.warmup()`, `Remote.decode_metadata()`), backed by a Rust core
(`nixl_connect._core`).

Migrate with one line::

    import nixl_connect as nc            # instead of: import dynamo.nixl_connect as nc

Every public name of Dynamo's module exists here with the same methods, properties, argument names
and order, async-ness (the five Connector methods and every `wait_for_completion` are coroutines),
synchronous context managers, enum values and `str()`, and the same pydantic v2 models
(`RdmaMetadata`, `SerializedDescriptor`: same fields, config and validators, byte-identical
`model_dump_json()`), so the two implementations exchange metadata and memory in both directions.
Misuse raises the builtin exception Dynamo raises (TypeError / ValueError / RuntimeError), as an
instance of a typed subclass (see below).

Behaviour that differs from Dynamo, by design:

* torch is never imported. Tensors are recognised by duck typing (`data_ptr()`, `numel()`,
  `element_size()`, `is_contiguous()`, `device`); numpy/CuPy arrays as `(array, device)` tuples
  through `__array_interface__` / `__cuda_array_interface__`.
* Data starts moving when `begin_read` / `begin_write` return (Dynamo posts the transfer on the
  first `status` read; its docs say "the transfer begins immediately"). `results()` still requires
  the operation to have been seen COMPLETE (by `wait_for_completion()` or by reading `status`).
* `cancel()` after completion leaves the operation COMPLETE (Dynamo flips it to CANCELLED).
* Leaving an active operation's `with` block releases it: a transfer still running is cancelled
  (status CANCELLED), a finished one stays COMPLETE. Leaving a passive operation's block releases
  the memory; its status is then frozen (Dynamo's never changes either) and, as in Dynamo, a later
  `wait_for_completion()` never completes (pass `timeout=` to bound it).
* `metadata(hex_encode=True)` honours the flag on every call (Dynamo caches the first call's
  encoding); `nixl_metadata` is "b64:"+base64 of zlib(NIXL metadata), or bare hex.
* A Descriptor shared by two operations of one Connector stays registered until both end (Dynamo
  deregisters it when the first one ends); using it with a second Connector at the same time raises
  RuntimeError as in Dynamo.
* `bytes` (and other read-only memory) cannot be a destination: the operation fails with
  `InvalidArgumentError` (a ValueError) instead of NIXL mutating an immutable object.
* Strided (non-contiguous) arrays and buffers are refused with ValueError (Dynamo transfers the
  wrong bytes). Non-contiguous torch tensors are copied with `.contiguous()` like Dynamo does, with
  a logged warning (data read into such a Descriptor lands in the copy).
* A bytearray is pinned while an operation uses it (resizing it raises BufferError then); a
  Descriptor whose buffer was resized before the operation started is refused.
* A Connector's NIXL agent is created on its first operation (as in Dynamo) but on a helper
  thread, so the event loop is not blocked for the tens of milliseconds it takes.
* Operations are meant to be created through the Connector. Constructing one directly
  (`ReadOperation(connection, ...)`) is allowed; it starts on its first `wait_for_completion()`.
* `Connection.metadata` (the agent's whole NIXL metadata) is not available; each passive
  operation's `metadata()` carries what its peer needs. `Remote` only names the peer agent.
* `nixl_api` is NIXL's Python API module (`nixl._api`; None when the `nixl` package is not
  installed), as in Dynamo's module, where agents are made through it. This module never calls it
  (its agents are made by the Rust core), so replacing it (Dynamo 1.7's warm-up tests patch in a
  mock and count `nixl_agent` calls) changes nothing here.

Dynamo's own callers (the `ai-dynamo` package) touch private names; they keep Dynamo's meaning:
`await Connector._create_connection()` (async, no arguments, overridable, usable through
`run_async` from another thread's loop), `Descriptor.register_with_connector()` (a real NIXL
registration that later reads and writes reuse), `Descriptor._data_size` (shrink a pooled
descriptor to use its start; never past its memory) and `Descriptor._data_ref` (the tensor itself).
Run a whole Dynamo worker on this module with `NIXL_CONNECT_AS_DYNAMO=1` or `install_as_dynamo()`.

Extras (never needed by code written for Dynamo):

* `await op.wait_for_completion(timeout=None)`: seconds; raises `nixl_connect.TimeoutError` (a
  subclass of the builtin `TimeoutError`, which is `asyncio.TimeoutError` on Python 3.11+) and
  leaves the operation live, so it can be awaited again.
* Typed exceptions: `NixlConnectError` (attribute `.kind`, the Rust error variant) and one subclass
  per kind, each also deriving from the builtin Dynamo raises in that situation, e.g.
  `WrongPairingError(NixlConnectError, RuntimeError)`,
  `DescriptorMismatchError(NixlConnectError, ValueError)`. Table in `nixl_connect._errors`.
* `op.path`: "local" (same-host copy) or "nixl", None until known.
* `op.mechanism`: how the same-host path moved the bytes ("frames", "cma", "pipes" between pods,
  "cuda-ipc", "cuda-vmm", "pinned-staging"), None on NIXL or until known.
* `Descriptor(memoryview | array.array | numpy array | any C-contiguous buffer)` as host memory.
* `nixl_connect.__version__`.
"""
try:
    from . import _core
except ImportError as _e:  # a source checkout without the built extension
    raise ImportError(
        "nixl_connect._core (the Rust extension) is not built: install the package with "
        "`pip install ./crates/nixl-connect-py` or `maturin develop` in crates/nixl-connect-py "
        f"({_e})") from _e
from ._dynamo import install_as_dynamo, is_installed_as_dynamo
from ._errors import (
    ERROR_CLASSES,
    CancelledError,  # noqa: F401 - public, kept out of __all__
    ChannelError,
    CudaUnavailableError,
    DescriptorInUseError,
    DescriptorMismatchError,
    DeviceMismatchError,
    EngineStoppedError,
    ForkedError,
    InvalidArgumentError,
    MetadataError,
    NixlBackendError,
    NixlConnectError,
    NixlError,
    NixlLoadError,
    NixlNotFoundError,
    NotPublishedError,
    OsError,
    PathUnavailableError,
    RefusedError,
    RemoteGoneError,
    TimeoutError,  # noqa: F401 - public, kept out of __all__
    TransferError,
    TransferInterruptedError,
    WrongPairingError,
)
from ._operations import (
    AbstractOperation,
    ActiveOperation,
    Connection,
    Connector,
    PassiveOperation,
    ReadableOperation,
    ReadOperation,
    Remote,
    WritableOperation,
    WriteOperation,
)
from ._types import (
    Descriptor,
    Device,
    DeviceKind,
    OperationKind,
    OperationStatus,
    RdmaMetadata,
    SerializedDescriptor,
)

__version__: str = _core.__version__

# `from nixl_connect import *` leaves out TimeoutError and CancelledError so that it never shadows
# the builtin TimeoutError or asyncio.CancelledError; use nixl_connect.TimeoutError explicitly.
__all__ = [
    # Dynamo's public names
    "AbstractOperation",
    "ActiveOperation",
    "Connection",
    "Connector",
    "Descriptor",
    "Device",
    "DeviceKind",
    "OperationKind",
    "OperationStatus",
    "PassiveOperation",
    "RdmaMetadata",
    "ReadOperation",
    "ReadableOperation",
    "Remote",
    "SerializedDescriptor",
    "WritableOperation",
    "WriteOperation",
    # extras
    "install_as_dynamo",
    "is_installed_as_dynamo",
    "ERROR_CLASSES",
    "ForkedError",
    "NixlConnectError",
    "InvalidArgumentError",
    "WrongPairingError",
    "DeviceMismatchError",
    "DescriptorMismatchError",
    "DescriptorInUseError",
    "MetadataError",
    "RefusedError",
    "NixlNotFoundError",
    "NixlLoadError",
    "CudaUnavailableError",
    "NixlBackendError",
    "OsError",
    "NixlError",
    "RemoteGoneError",
    "TransferError",
    "TransferInterruptedError",
    "PathUnavailableError",
    "EngineStoppedError",
    "ChannelError",
    "NotPublishedError",
]

# Public classes report themselves as nixl_connect.X (reprs, tracebacks, pickles).
for _name in __all__ + ["TimeoutError", "CancelledError"]:
    _obj = globals()[_name]
    if isinstance(_obj, type):
        try:
            _obj.__module__ = __name__
        except (AttributeError, TypeError):  # pragma: no cover
            pass
del _name, _obj


def __getattr__(name):
    # `nixl_api`: NIXL's Python API as Dynamo's module names it, imported on first use (see above).
    if name == "nixl_api":
        try:
            from nixl import _api as api
        except Exception:  # noqa: BLE001 - not installed, or its native part does not load
            api = None
        globals()["nixl_api"] = api
        return api
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
