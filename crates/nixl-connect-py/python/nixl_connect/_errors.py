"""Typed exceptions: one class per error kind of the Rust core.

The Rust core chooses the class of each of its error kinds (`class_of` in the extension; every
`_core.CoreError` names it) and `ERROR_CLASSES` is the same table, kind -> class, checked against
the core's by `test_core_chooses_the_class_of_every_kind`.

Every class derives from `NixlConnectError` *and* from the builtin exception Dynamo's
`dynamo.nixl_connect` raises in the same situation, so `except RuntimeError` / `except ValueError`
written for Dynamo keeps working while new code can catch the precise class or look at `.kind`.

    kind (Rust `Error` variant)  class                      builtin base
    ---------------------------  -------------------------  ------------------------------
    InvalidArgument              InvalidArgumentError       ValueError
    WrongPairing                 WrongPairingError          RuntimeError
    DeviceMismatch               DeviceMismatchError        ValueError
    DescriptorMismatch           DescriptorMismatchError    ValueError
    Metadata                     MetadataError              ValueError
    Refused                      RefusedError               RuntimeError
    NixlNotFound                 NixlNotFoundError          ImportError
    NixlLoad                     NixlLoadError              ImportError
    CudaUnavailable              CudaUnavailableError       RuntimeError
    NixlBackend                  NixlBackendError           RuntimeError
    Os                           OsError                    OSError
    Nixl                         NixlError                  RuntimeError
    RemoteGone                   RemoteGoneError            RuntimeError
    Transfer                     TransferError              RuntimeError
    Interrupted                  TransferInterruptedError   RuntimeError
    PathUnavailable              PathUnavailableError       RuntimeError
    EngineStopped                EngineStoppedError         RuntimeError
    Cancelled                    CancelledError             RuntimeError
    TimedOut                     TimeoutError               builtins.TimeoutError (= asyncio.TimeoutError on 3.11+)
    Channel                      ChannelError               RuntimeError
    NotPublished                 NotPublishedError          RuntimeError
    (a kind this layer does not know: a newer _core)   NixlConnectError subclass with RuntimeError

`DescriptorInUseError` (kind "InvalidArgument", RuntimeError) is raised by this Python layer only,
for Dynamo's "Descriptor cannot be registered with more than one connection" misuse.

`CancelledError` is *not* `asyncio.CancelledError` (which is a BaseException that asyncio uses to
cancel tasks); and neither it nor `TimeoutError` is exported by `from nixl_connect import *`, so a
star import never shadows the builtin or asyncio names.
"""
from __future__ import annotations

import asyncio
import builtins
from typing import Dict, Optional, Type

__all__ = [
    "NixlConnectError",
    "InvalidArgumentError",
    "WrongPairingError",
    "DeviceMismatchError",
    "DescriptorMismatchError",
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
    "CancelledError",
    "TimeoutError",
    "ChannelError",
    "NotPublishedError",
    "DescriptorInUseError",
    "ERROR_CLASSES",
]


class NixlConnectError(Exception):
    """Base class of every error the Rust core reports (and of the typed errors this layer raises).

    `kind` is the Rust error variant (for example "WrongPairing", "TimedOut"); `message` the
    human-readable text, which is also `str(error)` and `error.args[0]`.
    """

    kind: str = "Unknown"

    def __init__(self, message: str = "", *, kind: Optional[str] = None) -> None:
        # One positional argument only: OSError-based subclasses would read two as (errno, strerror).
        super().__init__(message)
        self.message = message
        if kind is not None:
            self.kind = kind


class InvalidArgumentError(NixlConnectError, ValueError):
    """An argument can never work (null pointer, empty list, read-only destination, ...)."""

    kind = "InvalidArgument"


class WrongPairingError(NixlConnectError, RuntimeError):
    """A read paired with a writable's metadata, or a write with a readable's."""

    kind = "WrongPairing"


class DeviceMismatchError(NixlConnectError, ValueError):
    """A descriptor claims a device its memory is not on."""

    kind = "DeviceMismatch"


class DescriptorMismatchError(NixlConnectError, ValueError):
    """Local and remote descriptors do not line up (count, list-ness or sizes)."""

    kind = "DescriptorMismatch"


class MetadataError(NixlConnectError, ValueError):
    """RdmaMetadata that does not parse, breaks a field rule, or that NIXL rejects."""

    kind = "Metadata"


class RefusedError(NixlConnectError, RuntimeError):
    """The peer's passive side refused the operation (ended, replayed metadata, out of scope)."""

    kind = "Refused"


class NixlNotFoundError(NixlConnectError, ImportError):
    """No NIXL library was found (Dynamo raises ImportError when NIXL is missing)."""

    kind = "NixlNotFound"


class NixlLoadError(NixlConnectError, ImportError):
    """The NIXL library was found but could not be loaded."""

    kind = "NixlLoad"


class CudaUnavailableError(NixlConnectError, RuntimeError):
    """CUDA memory was used but no usable driver or device is present."""

    kind = "CudaUnavailable"


class NixlBackendError(NixlConnectError, RuntimeError):
    """NIXL loaded but its UCX backend is unusable."""

    kind = "NixlBackend"


class OsError(NixlConnectError, OSError):
    """The operating system refused memory or I/O."""

    kind = "Os"


class NixlError(NixlConnectError, RuntimeError):
    """A NIXL call failed."""

    kind = "Nixl"


class RemoteGoneError(NixlConnectError, RuntimeError):
    """The peer's process (or its connector) is gone."""

    kind = "RemoteGone"


class TransferError(NixlConnectError, RuntimeError):
    """The transfer failed (Dynamo: "NIXL transfer operation ERRORED ...", a RuntimeError)."""

    kind = "Transfer"


class TransferInterruptedError(NixlConnectError, RuntimeError):
    """The connector cut this transfer off to release memory from an unresponsive peer."""

    kind = "Interrupted"


class PathUnavailableError(NixlConnectError, RuntimeError):
    """No allowed transport path reaches the peer."""

    kind = "PathUnavailable"


class EngineStoppedError(NixlConnectError, RuntimeError):
    """The connector's engine thread has stopped."""

    kind = "EngineStopped"


class ForkedError(NixlConnectError, RuntimeError):
    """An object made before `os.fork()` was used in the child: create it again there (a
    Connector does so by itself)."""

    kind = "Forked"


class CancelledError(NixlConnectError, RuntimeError):
    """The operation was cancelled. Not `asyncio.CancelledError`."""

    kind = "Cancelled"


_TIMEOUT_BASES: tuple = (NixlConnectError, builtins.TimeoutError)
if asyncio.TimeoutError is not builtins.TimeoutError:  # Python < 3.11: a distinct class
    _TIMEOUT_BASES += (asyncio.TimeoutError,)


class TimeoutError(*_TIMEOUT_BASES):  # type: ignore[misc]  # noqa: A001 - deliberately the builtin's name
    """A wait's deadline passed; the operation is still live and may be awaited again.

    A subclass of the builtin `TimeoutError` (which is `asyncio.TimeoutError` on Python 3.11+; on
    older Pythons this class derives from both).
    """

    kind = "TimedOut"


class ChannelError(NixlConnectError, RuntimeError):
    """A metadata channel failed."""

    kind = "Channel"


class NotPublishedError(NixlConnectError, RuntimeError):
    """Nothing is published at a channel location."""

    kind = "NotPublished"


class DescriptorInUseError(NixlConnectError, RuntimeError):
    """A Descriptor registered with one Connector's connection was given to another Connector."""

    kind = "InvalidArgument"


class _UnknownKindError(NixlConnectError, RuntimeError):
    """An error kind this Python layer does not know (a newer `_core`)."""


ERROR_CLASSES: Dict[str, Type[NixlConnectError]] = {
    "InvalidArgument": InvalidArgumentError,
    "WrongPairing": WrongPairingError,
    "DeviceMismatch": DeviceMismatchError,
    "DescriptorMismatch": DescriptorMismatchError,
    "Metadata": MetadataError,
    "Refused": RefusedError,
    "NixlNotFound": NixlNotFoundError,
    "NixlLoad": NixlLoadError,
    "CudaUnavailable": CudaUnavailableError,
    "NixlBackend": NixlBackendError,
    "Os": OsError,
    "Nixl": NixlError,
    "RemoteGone": RemoteGoneError,
    "Transfer": TransferError,
    "Interrupted": TransferInterruptedError,
    "PathUnavailable": PathUnavailableError,
    "EngineStopped": EngineStoppedError,
    "Cancelled": CancelledError,
    "Forked": ForkedError,
    "TimedOut": TimeoutError,
    "Channel": ChannelError,
    "NotPublished": NotPublishedError,
}
"""kind -> exception class, for every kind of the Rust core."""


def from_core(error: BaseException) -> NixlConnectError:
    """The typed exception for a `_core.CoreError` (args == (kind, message, class)).

    The Rust side chooses the class (`class_of` in the extension) and names it in `args[2]`; a
    name this module does not define (a newer `_core`) falls back to the kind's entry of
    `ERROR_CLASSES`, then to a plain `NixlConnectError` subclass."""
    args = error.args
    kind = getattr(error, "kind", None)
    if not isinstance(kind, str):
        kind = args[0] if args and isinstance(args[0], str) else "Unknown"
    message = getattr(error, "message", None)
    if not isinstance(message, str):
        message = args[1] if len(args) >= 2 and isinstance(args[1], str) else str(error)
    named = args[2] if len(args) >= 3 and isinstance(args[2], str) else None
    cls = globals().get(named) if named else None
    if not (isinstance(cls, type) and issubclass(cls, NixlConnectError)):
        cls = ERROR_CLASSES.get(kind, _UnknownKindError)
    return cls(message, kind=kind)
