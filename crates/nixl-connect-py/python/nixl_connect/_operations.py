"""Connector, Connection, Remote and the four operations: thin wrappers over `nixl_connect._core`.

Dynamo's argument checks (types, pairing, descriptor shapes) run here first, with Dynamo's
messages and builtin exception types, so that code written for `dynamo.nixl_connect` sees the
same errors; the Rust core validates everything again and its errors are translated into the typed
exceptions of `nixl_connect._errors`.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import math
import numbers
import os
import socket
import sys
import threading
import time
import uuid
import weakref
from abc import ABC, abstractmethod
from functools import cached_property
from typing import Any, Dict, List, Optional, Union

from . import _core
from ._errors import (
    CancelledError,
    DescriptorMismatchError,
    InvalidArgumentError,
    MetadataError,
    NixlConnectError,
    TimeoutError,
    TransferError,
    WrongPairingError,
    from_core,
)
from ._types import (
    _TERMINAL,
    Descriptor,
    OperationKind,
    OperationStatus,
    RdmaMetadata,
    SerializedDescriptor,
    logger,
)

CoreError = _core.CoreError
# The core's operations, as its calls return them when they are known at the call (`now=True`:
# the operation itself, or None for a finished wait, instead of an awaitable to await).
_CoreActive = _core.Active
_CorePassive = _core.Passive

_LOCAL_TYPE_MESSAGE = ("Argument `local_descriptors` must be `nixl_connect.Descriptor` or "
                       "`list[nixl_connect.Descriptor]`.")


# --------------------------------------------------------------------------- helpers


def _check_timeout(timeout: Any) -> Optional[float]:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError("Argument `timeout` must be a number of seconds or `None`.")
    t = float(timeout)
    if math.isnan(t) or t < 0:
        raise ValueError("Argument `timeout` must be zero or more seconds.")
    return None if math.isinf(t) else t


def _local_list(local_descriptors: Any, message: str = _LOCAL_TYPE_MESSAGE) -> List[Descriptor]:
    if isinstance(local_descriptors, Descriptor):
        return [local_descriptors]
    if isinstance(local_descriptors, list):
        if not local_descriptors:
            raise InvalidArgumentError("Argument `local_descriptors` must not be an empty list.")
        for d in local_descriptors:
            if not isinstance(d, Descriptor):
                raise TypeError(message)
        return list(local_descriptors)
    raise TypeError(message)


_METADATA_FIELDS = ("descriptors", "nixl_metadata", "notification_key", "operation_kind")


def _as_metadata(remote_metadata: Any) -> Any:
    """`remote_metadata` as this module's RdmaMetadata: ours as is; any other pydantic model with
    the same four fields (Dynamo's `dynamo.nixl_connect.RdmaMetadata`, or a copy of the class)
    validated again by our model, so a graph that mixes the two modules works. Anything else is
    returned unchanged (the caller's type check rejects it)."""
    if isinstance(remote_metadata, RdmaMetadata):
        return remote_metadata
    dump = getattr(remote_metadata, "model_dump", None)
    fields = getattr(type(remote_metadata), "model_fields", None)
    if callable(dump) and isinstance(fields, dict) and set(fields) == set(_METADATA_FIELDS):
        return RdmaMetadata.model_validate(dump())
    return remote_metadata


def _check_active_args(kind: OperationKind, remote_metadata: Any,
                       local_descriptors: Any) -> List[Descriptor]:
    """Dynamo's checks for begin_read / begin_write, in Dynamo's order."""
    if not isinstance(remote_metadata, RdmaMetadata):
        raise TypeError("Argument `remote_metadata` must be `RdmaMetadata`.")
    if kind == OperationKind.READ:
        local = _local_list(local_descriptors)
        if remote_metadata.operation_kind != OperationKind.READ:
            raise WrongPairingError(
                "Cannot create a `nixl_connect.ReadOperation` to read from a remote "
                "`nixl_connect.WritableOperation` (the metadata's operation_kind is "
                f"{remote_metadata.operation_kind}); use `begin_write()` for a WritableOperation.")
    else:
        local = _local_list(local_descriptors,
                            "Argument `local_descriptors` must be `Descriptor` or `list[Descriptor]`.")
        if remote_metadata.operation_kind != OperationKind.WRITE:
            raise WrongPairingError(
                "Cannot create a `WriteOperation` to write to a remote `ReadableOperation` (the "
                f"metadata's operation_kind is {remote_metadata.operation_kind}); use "
                "`begin_read()` for a ReadableOperation.")
    if not remote_metadata.nixl_metadata:
        raise MetadataError("Argument `nixl_metadata` cannot be empty.")
    remote = remote_metadata.descriptors
    if not remote:
        raise MetadataError("Request descriptor must contain at least one serialized descriptor.")
    _check_shapes(local, remote)
    if not remote_metadata.notification_key:
        raise MetadataError("Argument `notification_key` must not be an empty string.")
    return local


def _check_shapes(local: List[Descriptor], remote: List[SerializedDescriptor]) -> None:
    # One-element lists count as single descriptors on both sides (Dynamo).
    if (len(local) == 1) != (len(remote) == 1):
        raise DescriptorMismatchError(
            "Both `local_descriptors` and `remote_descriptors` must be either lists or single "
            "descriptors.")
    if len(local) == 1:
        if local[0].size != remote[0].size:
            raise DescriptorMismatchError(
                "Local and remote descriptors must be the same size. "
                f"{local[0].size} != {remote[0].size}.")
        return
    if len(local) != len(remote):
        raise DescriptorMismatchError(
            "When `local_descriptors` and `remote_descriptors` are lists, they must have the same "
            f"length. {len(local)} != {len(remote)}.")
    for i, (ld, rd) in enumerate(zip(local, remote)):
        if ld.size != rd.size:
            raise DescriptorMismatchError(
                "Descriptor length mismatch: `local_descriptors` and `remote_descriptors` "
                f"descriptor at {i} must have the same size. {ld.size} != {rd.size}.")


def _agent_name(nixl_metadata: Union[str, bytes]) -> str:
    """The agent name in `nixl_metadata`, read by the core's decoder, or ""."""
    if isinstance(nixl_metadata, (bytes, bytearray)):
        try:
            nixl_metadata = bytes(nixl_metadata).decode("ascii")
        except UnicodeDecodeError:
            return ""
    return _core.agent_name(nixl_metadata)


def _describe(descriptors: List[Any]) -> str:
    if len(descriptors) == 1:
        return str(descriptors[0])
    return "[" + ", ".join(f"({d})" for d in descriptors) + "]"


# The core's status code of a completed operation (`OperationStatus.COMPLETE`'s value).
_COMPLETE = int(OperationStatus.COMPLETE.value)


def _core_status(core: Any) -> OperationStatus:
    try:
        return OperationStatus(core.status())
    except CoreError as e:
        raise from_core(e) from None


async def _sleep_then_time_out(timeout: Optional[float], what: str) -> None:
    """Dynamo's behaviour for a released passive operation: it never completes."""
    if timeout is None:
        await asyncio.get_running_loop().create_future()  # forever (until the task is cancelled)
    await asyncio.sleep(timeout)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}, which was released before "
                       "it completed and can no longer complete", kind="TimedOut")


# --------------------------------------------------------------------------- Connection / Remote


class Connection:
    """The Connector's NIXL agent (one per Connector, created on its first operation)."""

    def __init__(self, connector: "Connector", number: int = 1) -> None:
        if not isinstance(connector, Connector):
            raise TypeError("Argument `connector` must be `nixl_connect.Connector`.")
        self._connector = connector
        self._number = number
        self._remote_refs: Dict[str, int] = {}
        self._is_initialized = False
        try:
            self._core = _core.Connector(connector.name)
        except CoreError as e:
            raise from_core(e) from None
        self._is_initialized = True

    def __repr__(self) -> str:
        return f"Connection(is_initialized={self._is_initialized}, name='{self.name}')"

    def __str__(self) -> str:
        return str(self.name)

    @property
    def connector(self) -> "Connector":
        """The Connector this connection belongs to."""
        return self._connector

    @property
    def is_initialized(self) -> bool:
        return self._is_initialized

    @property
    def metadata(self) -> bytes:
        """The agent's full NIXL metadata (Dynamo: `nixl_agent.get_agent_metadata()`).

        Each operation carries its own metadata (`PassiveOperation.metadata()`); this is only
        available when the core exposes `agent_metadata()`.
        """
        fn = getattr(self._core, "agent_metadata", None)
        if not callable(fn):
            raise NotImplementedError(
                "Connection.metadata is not available in nixl_connect; use "
                "PassiveOperation.metadata() for what a peer needs")
        try:
            return bytes(fn())
        except CoreError as e:
            raise from_core(e) from None

    @property
    def name(self) -> Optional[str]:
        """The NIXL agent name, "<worker_id>-<n>"."""
        return self._core.name

    def _register(self, descs: List[tuple]) -> Any:
        """Registers `descs` (`Descriptor._core_desc()` tuples) with this agent ahead of the
        operations that use them (`Descriptor.register_with_connector`); the returned handle keeps
        the registration until it is dropped."""
        try:
            return self._core.register(descs)
        except CoreError as e:
            raise from_core(e) from None

    def acquire_remote_ref(self, name: str) -> None:
        """Semi-internal (Dynamo): count a user of remote agent `name` (bookkeeping only)."""
        self._remote_refs[name] = self._remote_refs.get(name, 0) + 1

    def release_remote_ref(self, name: str) -> bool:
        """Semi-internal (Dynamo): drop one user of `name`; True when it was the last one."""
        n = self._remote_refs.get(name, 0) - 1
        if n > 0:
            self._remote_refs[name] = n
            return False
        self._remote_refs.pop(name, None)
        return True

    async def initialize(self) -> None:
        """Deprecated no-op (Dynamo)."""
        self._is_initialized = True


class Remote:
    """The peer agent of an active operation. The Rust core loads and releases remote agents
    itself; this object only names the peer."""

    def __init__(self, connection: Connection, nixl_metadata: Union[bytes, str]) -> None:
        if not isinstance(connection, Connection):
            raise TypeError("Argument `connection` must be `nixl_connect.Connection`.")
        if not nixl_metadata:
            raise MetadataError("Argument `nixl_metadata` cannot be empty.")
        if not isinstance(nixl_metadata, (bytes, str)):
            raise TypeError("Argument `nixl_metadata` must be `bytes` or `str`.")
        self._connection = connection
        self._nixl_metadata = nixl_metadata
        self._name: Optional[str] = None
        self._source: Any = None  # the core operation, once started (it may know the peer's name)

    @staticmethod
    def decode_metadata(nixl_metadata: Union[bytes, str]) -> bytes:
        """The raw NIXL agent metadata in `nixl_metadata`, checked without loading the agent or
        starting anything (Dynamo 1.7; its callers validate a batch of metadata with it before
        borrowing any buffer).

        A `str` is what `RdmaMetadata.nixl_metadata` carries: "b64:" + base64, or legacy hex, of
        zlib-compressed metadata; `bytes` are taken as already decoded and returned as they are.
        Raises TypeError for any other type, and `MetadataError` (a ValueError) when the text is
        empty or does not decode (Dynamo raises binascii's, ValueError or zlib.error there).
        """
        if not isinstance(nixl_metadata, (bytes, str)):
            raise TypeError("Argument `nixl_metadata` must be `bytes` or `str`.")
        if len(nixl_metadata) == 0:
            raise MetadataError("Argument `nixl_metadata` cannot be empty.")
        if isinstance(nixl_metadata, bytes):
            return nixl_metadata
        try:
            return _core.decode_agent_metadata(nixl_metadata)
        except CoreError as e:
            detail = e.args[1]
            if not nixl_metadata.startswith("b64:"):
                # Say it as Dynamo's decoder (bytes.fromhex) would, for callers matching its text.
                try:
                    bytes.fromhex(nixl_metadata)
                except ValueError as hex_error:
                    detail = f"{hex_error}; {detail}"
            raise MetadataError(
                "Argument `nixl_metadata` is neither \"b64:\"+base64 nor hex of zlib-compressed "
                f"NIXL metadata of at most 16 MiB ({detail}); pass the peer's "
                "RdmaMetadata.nixl_metadata unchanged."
            ) from None

    def __enter__(self) -> "Remote":
        return self

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        return None

    def __repr__(self) -> str:
        return f"Remote(name={self.name}, connection={self._connection.name})"

    def __str__(self) -> str:
        return self.name

    @property
    def connection(self) -> Connection:
        return self._connection

    @property
    def name(self) -> str:
        """The remote NIXL agent's name."""
        if self._name is not None:
            return self._name
        name = ""
        fn = getattr(self._source, "remote_name", None)
        if callable(fn):
            try:
                name = fn() or ""
            except Exception:  # noqa: BLE001 - fall back to the metadata
                name = ""
        if not name:
            name = _agent_name(self._nixl_metadata)
        if name:
            self._name = name
        return name


# --------------------------------------------------------------------------- operations


class AbstractOperation(ABC):
    """Base of every operation. Use as a *synchronous* context manager:
    `with await connector.begin_read(...) as op:`; leaving the block releases the operation."""

    def __init__(self, connection: Connection, operation_kind: OperationKind,
                 local_descriptors: Union[Descriptor, List[Descriptor]],
                 _checked: Optional[List[Descriptor]] = None) -> None:
        self._released = True  # until construction succeeds (keeps __del__ quiet)
        self._held: List[Descriptor] = []
        self._core: Any = None
        if not isinstance(connection, Connection):
            raise TypeError("Argument `connection` must be `nixl_connect.Connection`.")
        local = _checked if _checked is not None else _local_list(local_descriptors)
        self._connection = connection
        self._operation_kind = (operation_kind if type(operation_kind) is OperationKind
                                else OperationKind(operation_kind))
        self._local = local
        if self._local_is_destination():
            for d in local:
                if d._readonly:
                    raise InvalidArgumentError(
                        f"Read-only memory ({type(d._data_ref).__name__}) cannot be the destination of "
                        f"a {type(self).__name__}; use writable memory such as a bytearray.")
        try:
            for d in local:
                d._acquire(connection)
                self._held.append(d)
        except BaseException:
            self._drop_holds()
            raise
        self._released = False

    # -- context manager

    def __enter__(self) -> "AbstractOperation":
        return self

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        try:
            self._release()
        except NixlConnectError:
            if exc_type is None:
                raise
            logger.exception("releasing %r failed while another exception was propagating", self)

    def __del__(self) -> None:
        # The Rust operation releases itself when dropped; only this layer's bookkeeping is undone.
        try:
            self._drop_holds()
        except Exception:  # noqa: BLE001 - never raise from __del__
            pass

    # -- properties

    @property
    def connection(self) -> Connection:
        """The Connection (NIXL agent) the operation belongs to."""
        return self._connection

    @property
    def operation_kind(self) -> OperationKind:
        """OperationKind.READ or OperationKind.WRITE."""
        return self._operation_kind

    @property
    def path(self) -> Optional[str]:
        """Extra: how the data moves, "local" (same host, kernel copy) or "nixl"; None until known
        (and for passive operations when the core does not report it)."""
        return self._core_says("path")

    @property
    def mechanism(self) -> Optional[str]:
        """Extra: how the same-host path moved the bytes ("frames", "cma", "pipes" between pods,
        "cuda-ipc", "cuda-vmm", "pinned-staging"); None on NIXL, until known, and for passive operations."""
        return self._core_says("mechanism")

    @property
    def path_reason(self) -> Optional[str]:
        """Extra: why a faster path declined this read or write, when one did (it then took
        "nixl"), in words a user can act on; None when the first path offered took it, and for
        passive operations. (The Rust core also warns once per peer through `tracing`, which this
        module does not forward to Python logging.)"""
        return self._core_says("path_reason")

    def _core_says(self, what: str) -> Optional[str]:
        """What the core's `what()` answers, or None where it has no such method or is gone."""
        core = self._core
        fn = getattr(core, what, None) if core is not None else None
        if not callable(fn):
            return None
        try:
            return fn()
        except CoreError:
            return None

    @abstractmethod
    async def wait_for_completion(self, timeout: Optional[float] = None) -> None:
        """Wait until the operation completes."""

    # -- internals

    def _local_is_destination(self) -> bool:
        raise NotImplementedError

    def _descs(self) -> List[tuple]:
        return [d._core_desc() for d in self._local]

    def _drop_holds(self) -> None:
        held, self._held = getattr(self, "_held", []), []
        for d in held:
            d._release_hold()

    def _release(self) -> None:
        raise NotImplementedError

    def _release_quietly(self) -> None:
        try:
            self._release()
        except Exception:  # noqa: BLE001
            logger.debug("release of %r failed", self, exc_info=True)

    async def _start(self) -> None:
        raise NotImplementedError


class ActiveOperation(AbstractOperation):
    """Base of ReadOperation and WriteOperation: the side that moves the data."""

    def __init__(self, connection: Connection, operation_kind: OperationKind,
                 remote_metadata: RdmaMetadata,
                 local_descriptors: Union[Descriptor, List[Descriptor]],
                 _checked: Optional[List[Descriptor]] = None) -> None:
        self._released = True
        if not isinstance(connection, Connection):
            raise TypeError("Argument `connection` must be `nixl_connect.Connection`.")
        if _checked is None:  # the Connector's begin_* checked them already
            remote_metadata = _as_metadata(remote_metadata)
            local = _check_active_args(OperationKind(operation_kind), remote_metadata,
                                       local_descriptors)
        else:
            local = _checked
        self._remote_metadata = remote_metadata
        self._remote = Remote(connection, remote_metadata.nixl_metadata)
        self._observed = OperationStatus.UNINITIALIZED   # what results() trusts (Dynamo: cached)
        self._pre_status = OperationStatus.UNINITIALIZED  # status while no core operation exists
        self._frozen: Optional[OperationStatus] = None    # the (terminal) status after release
        super().__init__(connection, operation_kind, local_descriptors, _checked=local)

    def __repr__(self) -> str:
        try:
            status = str(self.status)
        except Exception:  # noqa: BLE001
            status = "?"
        remote = self._remote.name
        return (f"{type(self).__name__}(operation_kind={self._operation_kind}, "
                f"local_descriptors={_describe(self._local)}, "
                f"remote_descriptors={_describe(self._remote_metadata.descriptors)}, "
                f"notification_key='{self._remote_metadata.notification_key}', "
                f"remote='{remote}', status='{status}')")

    def _local_is_destination(self) -> bool:
        return self._operation_kind == OperationKind.READ

    async def _start(self) -> None:
        if self._core is not None:
            return
        if self._released:
            raise RuntimeError("The operation has been released.")
        descs = self._descs()
        # The model itself: the core reads its fields (no JSON round trip per operation).
        md = self._remote_metadata
        conn = self._connection._core
        try:
            if self._operation_kind == OperationKind.READ:
                core = conn.begin_read(md, descs, True)
            else:
                core = conn.begin_write(descs, md, True)
            if type(core) is not _CoreActive:
                core = await core
        except CoreError as e:
            raise from_core(e) from None
        self._core = core
        self._remote._source = core
        if self._released:  # released while starting (another task left the with-block)
            self._end(core)

    @property
    def remote(self) -> Remote:
        """The peer agent."""
        return self._remote

    @property
    def status(self) -> OperationStatus:
        """The current status (the transfer started when the operation was created)."""
        core = self._core
        if self._frozen is not None:
            st = self._frozen
        elif core is None:
            st = self._pre_status
        else:
            st = _core_status(core)
        self._observed = st
        return st

    def cancel(self) -> None:
        """Cancel the transfer if it is still running; no effect once it has completed (the status
        stays COMPLETE). Raises RuntimeError for an ERRORED operation (as Dynamo)."""
        core = self._core
        if core is None:
            self._pre_status = self._observed = OperationStatus.CANCELLED
            return
        st = self.status
        if st == OperationStatus.ERRORED:
            raise TransferError("Operation is errored, unable to cancel the operation.")
        if st in _TERMINAL:
            return
        try:
            core.cancel()
        except CoreError as e:
            raise from_core(e) from None
        self.status  # refresh what results() sees

    async def _wait(self, timeout: Optional[float]) -> None:
        timeout = _check_timeout(timeout)
        if self._frozen is not None:  # released: its outcome is known
            self._observed = self._frozen
            if self._frozen == OperationStatus.ERRORED:
                raise TransferError(f"The transfer with {self._remote.name or 'the peer'} failed.")
            return
        if self._core is None:
            if self._pre_status == OperationStatus.CANCELLED or self._released:
                return
            await self._start()
        core = self._core
        try:
            # Already complete (a small read often is by now): no future, no trip through the loop;
            # nor when the core sees it complete at the call (None).
            if core.status() != _COMPLETE:
                pending = core.wait(timeout, True)
                if pending is not None:
                    await pending
        except CoreError as e:
            err = from_core(e)
            if err.kind == "Cancelled":
                # Dynamo: a CANCELLED operation's wait_for_completion() returns normally.
                self._observed = self._frozen or OperationStatus.CANCELLED
                return
            try:
                self.status
            except Exception:  # noqa: BLE001
                pass
            raise err from None
        self._observed = OperationStatus.COMPLETE

    def _release(self) -> None:
        if self._released:
            return
        self._released = True
        core = self._core
        try:
            if core is None:
                self._pre_status = OperationStatus.CANCELLED
                return
            self._end(core)
        finally:
            self._drop_holds()

    def _end(self, core: Any) -> None:
        try:
            core.release()
        except CoreError as e:
            raise from_core(e) from None
        finally:
            # Released means ended: a transfer that had not completed counts as CANCELLED (as
            # Dynamo's __exit__), whatever the core last reported.
            try:
                after = OperationStatus(core.status())
            except CoreError:
                after = OperationStatus.CANCELLED
            self._frozen = after if after in _TERMINAL else OperationStatus.CANCELLED


class PassiveOperation(AbstractOperation):
    """Base of ReadableOperation and WritableOperation: the side that exposes memory."""

    def __init__(self, connection: Connection, operation_kind: OperationKind,
                 local_descriptors: Union[Descriptor, List[Descriptor]]) -> None:
        self._released = True
        self._metadata_cache: Dict[bool, RdmaMetadata] = {}
        self._frozen: Optional[OperationStatus] = None  # the status after release
        super().__init__(connection, operation_kind, local_descriptors)

    def __repr__(self) -> str:
        try:
            status = str(self.status)
        except Exception:  # noqa: BLE001
            status = "?"
        key = ""
        if self._core is not None:
            try:
                key = self._core.notification_key
            except Exception:  # noqa: BLE001
                key = ""
        return (f"{type(self).__name__}(operation_kind={self._operation_kind}, "
                f"local_descriptors={_describe(self._local)}, notification_key='{key}', "
                f"status='{status}')")

    def _local_is_destination(self) -> bool:
        return self._operation_kind == OperationKind.WRITE

    async def _start(self) -> None:
        if self._core is not None:
            return
        if self._released:
            raise RuntimeError("The operation has been released.")
        descs = self._descs()
        conn = self._connection._core
        try:
            if self._operation_kind == OperationKind.READ:
                core = conn.create_readable(descs, True)
            else:
                core = conn.create_writable(descs, True)
            if type(core) is not _CorePassive:
                core = await core
        except CoreError as e:
            raise from_core(e) from None
        self._core = core
        if self._released:
            core.release()

    def metadata(self, hex_encode: bool = False) -> RdmaMetadata:
        """What the peer needs to reach this memory. `nixl_metadata` is "b64:"+base64 of the
        zlib-compressed NIXL metadata, or bare hex with `hex_encode=True` (the flag is honoured
        on every call; Dynamo caches the first call's form)."""
        key = bool(hex_encode)
        md = self._metadata_cache.get(key)
        if md is not None:
            return md
        base = self._metadata_cache.get(False)
        if base is None:
            core = self._core
            if core is None:
                raise RuntimeError(
                    "The operation has not been started: create passive operations with "
                    "`Connector.create_readable()` / `Connector.create_writable()`.")
            try:
                text = core.metadata_json()
            except CoreError as e:
                raise from_core(e) from None
            base = RdmaMetadata.model_validate_json(text)
            self._metadata_cache[False] = base
        if not key:
            return base
        try:
            nixl = _core.agent_metadata_hex(base.nixl_metadata)
        except CoreError as e:
            raise from_core(e) from None
        md = base.model_copy(update={"nixl_metadata": nixl})
        self._metadata_cache[True] = md
        return md

    @property
    def status(self) -> OperationStatus:
        """INITIALIZED until the peer's notification arrives, then COMPLETE. After the operation is
        released (`__exit__`), the status is frozen at its last value (Dynamo's too never changes)."""
        frozen = self._frozen
        if frozen is not None:
            return frozen
        core = self._core
        if core is None:
            return OperationStatus.UNINITIALIZED
        return _core_status(core)

    async def _wait(self, timeout: Optional[float]) -> None:
        timeout = _check_timeout(timeout)
        started = time.monotonic()
        if self._core is None and not self._released:
            await self._start()
        if self._released:
            st = self.status
            if st == OperationStatus.COMPLETE:
                return
            if st == OperationStatus.ERRORED:  # ended by the core before it was released
                raise TransferError(f"{self!r} failed before it was released.")
            if st == OperationStatus.CANCELLED:
                raise CancelledError(f"{self!r} was cancelled before it was released.")
            await _sleep_then_time_out(timeout, repr(self))
        core = self._core
        try:
            # Already complete (the owner of a small read completes when its answer leaves): no
            # future, no trip through the loop; nor when the core sees it complete at the call.
            if core.status() != _COMPLETE:
                pending = core.wait(timeout, True)
                if pending is not None:
                    await pending
        except CoreError as e:
            err = from_core(e)
            if err.kind == "Cancelled" and self._released:
                # Released by another task while this one waited: like Dynamo, never completes.
                if self.status == OperationStatus.COMPLETE:
                    return
                left = None if timeout is None else max(0.0, timeout - (time.monotonic() - started))
                await _sleep_then_time_out(left, repr(self))
            raise err from None

    def _release(self) -> None:
        if self._released:
            return
        self._released = True
        core = self._core
        try:
            if core is None:
                self._frozen = OperationStatus.UNINITIALIZED
                return
            try:
                before = OperationStatus(core.status())
            except CoreError:
                before = OperationStatus.INITIALIZED
            try:
                core.release()
            except CoreError as e:
                raise from_core(e) from None
            finally:
                try:
                    after = OperationStatus(core.status())
                except CoreError:
                    after = before
                if before in _TERMINAL:
                    self._frozen = before
                elif after == OperationStatus.COMPLETE:
                    self._frozen = after
                else:
                    self._frozen = before
        finally:
            self._drop_holds()


class ReadOperation(ActiveOperation):
    """Reads a peer's ReadableOperation into local memory (created by `Connector.begin_read`)."""

    def __init__(self, connection: Connection, remote_metadata: RdmaMetadata,
                 local_descriptors: Union[Descriptor, List[Descriptor]],
                 _checked: Optional[List[Descriptor]] = None) -> None:
        super().__init__(connection, OperationKind.READ, remote_metadata, local_descriptors,
                         _checked)

    def cancel(self) -> None:
        """Cancel the read if it has not completed."""
        super().cancel()

    def results(self) -> List[Descriptor]:
        """The local Descriptors (always a list), once the operation was seen COMPLETE by
        `wait_for_completion()` or by reading `status`."""
        if self._observed != OperationStatus.COMPLETE:
            raise RuntimeError("Operation has not completed yet, cannot get results.")
        return list(self._local)

    async def wait_for_completion(self, timeout: Optional[float] = None) -> None:
        """Wait until the data has arrived. Returns normally for a cancelled operation (as
        Dynamo); raises a RuntimeError subclass when the transfer failed. Extra: `timeout`
        (seconds) raises `nixl_connect.TimeoutError` and leaves the operation running."""
        await self._wait(timeout)


class WriteOperation(ActiveOperation):
    """Writes local memory into a peer's WritableOperation (created by `Connector.begin_write`)."""

    def __init__(self, connection: Connection,
                 local_descriptors: Union[Descriptor, List[Descriptor]],
                 remote_metadata: RdmaMetadata,
                 _checked: Optional[List[Descriptor]] = None) -> None:
        super().__init__(connection, OperationKind.WRITE, remote_metadata, local_descriptors,
                         _checked)

    def cancel(self) -> None:
        """Cancel the write if it has not completed."""
        super().cancel()

    async def wait_for_completion(self, timeout: Optional[float] = None) -> None:
        """Wait until the data has been written. See ReadOperation.wait_for_completion."""
        await self._wait(timeout)


class ReadableOperation(PassiveOperation):
    """Exposes local memory for a peer's ReadOperation (created by `Connector.create_readable`)."""

    def __init__(self, connection: Connection,
                 local_descriptors: Union[Descriptor, List[Descriptor]]) -> None:
        super().__init__(connection, OperationKind.READ, local_descriptors)

    async def wait_for_completion(self, timeout: Optional[float] = None) -> None:
        """Wait until the peer has read the memory. Without `timeout` this waits as long as it
        takes (wrap it in asyncio.wait_for, or pass `timeout`: nixl_connect.TimeoutError)."""
        await self._wait(timeout)


class WritableOperation(PassiveOperation):
    """Exposes local memory for a peer's WriteOperation (created by `Connector.create_writable`)."""

    def __init__(self, connection: Connection,
                 local_descriptors: Union[Descriptor, List[Descriptor]]) -> None:
        super().__init__(connection, OperationKind.WRITE, local_descriptors)

    async def wait_for_completion(self, timeout: Optional[float] = None) -> None:
        """Wait until the peer has written the memory. See ReadableOperation.wait_for_completion."""
        await self._wait(timeout)


async def _started(op: AbstractOperation) -> Any:
    try:
        await op._start()
    except BaseException:
        op._release_quietly()
        raise
    return op


# --------------------------------------------------------------------------- Connector


class Connector:
    """Entry point: creates operations. Its NIXL agent is created on the first operation."""

    def __init__(self, worker_id: Optional[str] = None) -> None:
        if worker_id is None:
            worker_id = uuid.uuid4().hex
        elif not isinstance(worker_id, str) or not worker_id:
            raise TypeError("Argument `worker_id` must be a non-empty `str` or `None`.")
        self._worker_id = worker_id
        self._hostname = socket.gethostname()
        self._connection: Optional[Connection] = None
        self._creating: Optional["concurrent.futures.Future[Connection]"] = None
        self._lock = threading.Lock()
        self._pid = os.getpid()
        _CONNECTORS[id(self)] = self

    def __eq__(self, other: Any) -> bool:
        if not isinstance(other, Connector):
            return False
        return self._worker_id == other._worker_id

    def __ne__(self, value: object) -> bool:
        return not self.__eq__(value)

    __hash__ = None  # type: ignore[assignment]  # as Dynamo: equality by worker_id, unhashable

    def __repr__(self) -> str:
        return f"Connector(worker_id='{self._worker_id}', hostname={self._hostname})"

    def __str__(self) -> str:
        return self._worker_id

    @property
    def hostname(self) -> str:
        return self._hostname

    @cached_property
    def is_cuda_available(self) -> bool:
        """True when a CUDA device can be used (never imports torch)."""
        fn = getattr(_core, "cuda_available", None)
        if callable(fn):
            try:
                return bool(fn())
            except Exception:  # noqa: BLE001
                return False
        torch = sys.modules.get("torch")
        cuda = getattr(torch, "cuda", None) if torch is not None else None
        if cuda is not None and callable(getattr(cuda, "is_available", None)):
            try:
                return bool(cuda.is_available())
            except Exception:  # noqa: BLE001
                return False
        return _cuda_driver_has_devices()

    @property
    def name(self) -> Optional[str]:
        """The worker id."""
        return self._worker_id

    async def _create_connection(self) -> Connection:
        """The Connector's shared Connection (NIXL agent), created on first use.

        Dynamo's private coroutine, kept with its meaning because Dynamo's own callers use it:
        awaited directly as a probe (TRT-LLM), run with `run_async` on a throwaway event loop in
        another thread (the multimodal receivers), or overridden by a subclass; every operation
        gets its connection through it. The Connection is usable from any thread and loop.

        Creating the NIXL agent takes tens of milliseconds; it runs on a helper thread so the
        event loop is not blocked. Concurrent first calls share one creation; whatever the
        creation raises is raised here (and a later call tries again).
        """
        conn = self._connection
        if conn is not None:
            return conn
        with self._lock:
            pending = self._creating
            start = pending is None
            if start:
                pending = self._creating = concurrent.futures.Future()
        if start:
            try:
                threading.Thread(target=self._make_connection, args=(pending,),
                                 name="nixl_connect-connector", daemon=True).start()
            except BaseException as e:  # noqa: BLE001 - e.g. no thread can be started
                self._fail_creation(pending, e)
        # shield: a cancelled caller must not cancel the creation other callers wait for
        return await asyncio.shield(asyncio.wrap_future(pending))

    def _make_connection(self, pending: "concurrent.futures.Future[Connection]") -> None:
        """The helper thread's work: every outcome, exceptions included, reaches `pending`."""
        try:
            if not pending.set_running_or_notify_cancel():
                with self._lock:
                    if self._creating is pending:
                        self._creating = None
                return
            conn = Connection(self, 1)
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting callers
            self._fail_creation(pending, e)
            return
        with self._lock:
            self._connection = conn
            if self._creating is pending:
                self._creating = None
        pending.set_result(conn)

    def _fail_creation(self, pending: "concurrent.futures.Future[Connection]",
                       e: BaseException) -> None:
        with self._lock:
            if self._creating is pending:
                self._creating = None
        if not pending.done():
            try:
                pending.set_exception(e)
            except concurrent.futures.InvalidStateError:  # pragma: no cover - raced to done
                pass

    def _after_fork(self) -> None:
        """In a child of fork() (`os.register_at_fork`): the parent's Connection belongs to
        threads the child does not have; forget it (it is never used or freed here) and create a
        fresh one on next use."""
        if self._pid == os.getpid():
            return
        if self._connection is not None:
            _FORKED_AWAY.append(self._connection)
        self._connection = None
        self._creating = None
        self._lock = threading.Lock()
        self._pid = os.getpid()

    async def begin_read(self, remote_metadata: RdmaMetadata,
                         local_descriptors: Union[Descriptor, List[Descriptor]]) -> ReadOperation:
        """Start reading the peer's ReadableOperation (described by `remote_metadata`) into
        `local_descriptors`; the data starts moving now. Await `wait_for_completion()`."""
        remote_metadata = _as_metadata(remote_metadata)
        local = _check_active_args(OperationKind.READ, remote_metadata, local_descriptors)
        op = ReadOperation(await self._create_connection(), remote_metadata, local_descriptors,
                           _checked=local)
        return await _started(op)

    async def begin_write(self, local_descriptors: Union[Descriptor, List[Descriptor]],
                          remote_metadata: RdmaMetadata) -> WriteOperation:
        """Start writing `local_descriptors` into the peer's WritableOperation; the data starts
        moving now. Await `wait_for_completion()`."""
        remote_metadata = _as_metadata(remote_metadata)
        local = _check_active_args(OperationKind.WRITE, remote_metadata, local_descriptors)
        op = WriteOperation(await self._create_connection(), local_descriptors, remote_metadata,
                            _checked=local)
        return await _started(op)

    async def create_readable(self, local_descriptors: Union[Descriptor, List[Descriptor]]
                              ) -> ReadableOperation:
        """Expose `local_descriptors` for one peer to read; hand `op.metadata()` to the peer."""
        _local_list(local_descriptors)
        op = ReadableOperation(await self._create_connection(), local_descriptors)
        return await _started(op)

    async def create_writable(self, local_descriptors: Union[Descriptor, List[Descriptor]]
                              ) -> WritableOperation:
        """Expose `local_descriptors` for one peer to write; hand `op.metadata()` to the peer."""
        _local_list(local_descriptors)
        op = WritableOperation(await self._create_connection(), local_descriptors)
        return await _started(op)

    async def warmup(self) -> None:
        """Create the shared connection (the NIXL agent and the same-host listener) now, before
        the first transfer (Dynamo 1.7).

        Repeated and concurrent calls share one connection with the operations; what creating it
        raises reaches the caller, so a worker can fail at start-up instead of on its first
        request, and a later call tries again.
        """
        await self._create_connection()

    async def initialize(self) -> None:
        """Deprecated no-op (Dynamo); `warmup()` creates the connection eagerly."""
        logger.debug("Connector.initialize() is deprecated and does nothing; use warmup()")

    @property
    def _shared_connection(self) -> Optional[Connection]:
        """Dynamo's name for the connection once created (None before, and after a failed
        creation); read by Dynamo 1.7's tests."""
        return self._connection


# Every live Connector, so that a child of fork() can reset their locks and connections at once.
_CONNECTORS: "weakref.WeakValueDictionary[int, Connector]" = weakref.WeakValueDictionary()
# Connections of a parent process, kept (never used, never freed) in a child of fork().
_FORKED_AWAY: List[Connection] = []


def _after_fork_in_child() -> None:
    for connector in list(_CONNECTORS.values()):
        connector._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _cuda_driver_has_devices() -> bool:
    lib = None
    for path in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            lib = ctypes.CDLL(path)
            break
        except OSError:
            continue
    if lib is None:
        return False
    try:
        if lib.cuInit(0) != 0:
            return False
        count = ctypes.c_int(0)
        if lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return False
        return count.value > 0
    except (AttributeError, OSError):
        return False
