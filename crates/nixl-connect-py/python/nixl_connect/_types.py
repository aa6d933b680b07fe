"""Value types: the enums, Device, the pydantic wire models and Descriptor.

Pure Python; nothing here touches the Rust core. torch is never imported: a tensor is recognised
by duck typing (see `_looks_like_tensor`).
"""
from __future__ import annotations

import ctypes
import logging
import sys
from enum import IntEnum
from typing import Any, List, Optional, Tuple, Union

from pydantic import BaseModel, ConfigDict, field_validator

from ._errors import DescriptorInUseError, InvalidArgumentError

logger = logging.getLogger("nixl_connect")


# --------------------------------------------------------------------------- enums


class DeviceKind(IntEnum):
    """The kind of memory a Descriptor describes."""

    UNSPECIFIED = 0
    HOST = 1
    CUDA = 2
    XPU = 3

    def __str__(self) -> str:
        return _DEVICE_KIND_STR[self.value]

    @property
    def nixl_mem_type(self) -> str:
        """NIXL's memory type: "DRAM" for host memory, "VRAM" for everything else."""
        return "DRAM" if self is DeviceKind.HOST else "VRAM"


_DEVICE_KIND_STR = {0: "<invalid>", 1: "cpu", 2: "cuda", 3: "xpu"}


class OperationKind(IntEnum):
    """READ (a ReadOperation / ReadableOperation pair) or WRITE."""

    UNSPECIFIED = 0
    READ = 1
    WRITE = 2

    def __str__(self) -> str:
        return _OPERATION_KIND_STR[self.value]


_OPERATION_KIND_STR = {0: "<invalid>", 1: "READ", 2: "WRITE"}


class OperationStatus(IntEnum):
    """The state of an operation. COMPLETE, CANCELLED and ERRORED are terminal."""

    UNINITIALIZED = 0
    INITIALIZED = 1
    IN_PROGRESS = 2
    COMPLETE = 3
    CANCELLED = 4
    ERRORED = 5

    def __str__(self) -> str:
        return _OPERATION_STATUS_STR[self.value]


_OPERATION_STATUS_STR = {0: "<invalid>", 1: "INIT", 2: "PROC", 3: "DONE", 4: "STOP", 5: "ERR"}

_TERMINAL = frozenset((OperationStatus.COMPLETE, OperationStatus.CANCELLED, OperationStatus.ERRORED))


# --------------------------------------------------------------------------- Device


class Device:
    """A device: `Device("cuda:1")`, `Device("cpu")`, `Device((DeviceKind.CUDA, 1))`.

    Strings are parsed like Dynamo's: stripped, lower-cased, then by prefix: "cuda"/"gpu" (id after
    ":" or 0), "xpu" (same), "cpu"/"host" (id always 0). Devices compare by identity, as in Dynamo.
    """

    def __init__(self, metadata: Union[str, Tuple[DeviceKind, int]]) -> None:
        if metadata is None:
            raise ValueError("Argument `metadata` cannot be `None`.")
        if isinstance(metadata, tuple):
            if (len(metadata) == 2 and isinstance(metadata[0], DeviceKind)
                    and isinstance(metadata[1], int)):
                self._kind = metadata[0]
                self._id = int(metadata[1])
                return
            raise TypeError("Argument `metadata` must be a `tuple[MemoryKind, int]` or a `str`.")
        if not isinstance(metadata, str):
            raise TypeError("Argument `metadata` must be a `tuple[MemoryKind, int]` or a `str`.")
        text = metadata.strip().lower()
        if text.startswith("cuda") or text.startswith("gpu"):
            self._kind = DeviceKind.CUDA
            self._id = int(text.split(":")[1]) if ":" in text else 0
        elif text.startswith("xpu"):
            self._kind = DeviceKind.XPU
            self._id = int(text.split(":")[1]) if ":" in text else 0
        elif text.startswith("cpu") or text.startswith("host"):
            self._kind = DeviceKind.HOST
            self._id = 0
        else:
            raise ValueError(
                "Argument `metadata` must be in the format 'cuda:<device_id>', 'xpu:<device_id>', "
                "or 'cpu'.")

    def __repr__(self) -> str:
        return f"Device(kind={self._kind}, id={self._id})"

    def __str__(self) -> str:
        kind = self._kind
        if kind is DeviceKind.HOST:  # every host descriptor of every operation asks: no formatting
            return "cpu"
        if kind in (DeviceKind.CUDA, DeviceKind.XPU):
            return f"{kind}:{self._id}"
        return str(kind)

    @property
    def id(self) -> int:
        """The device index (0 for host memory)."""
        return self._id

    @property
    def kind(self) -> DeviceKind:
        """The kind of device."""
        return self._kind


def _host_device() -> Device:
    """A new `Device("cpu")`, made without parsing (Devices compare by identity: one each)."""
    device = Device.__new__(Device)
    device._kind = DeviceKind.HOST
    device._id = 0
    return device


# --------------------------------------------------------------------------- pydantic models


class SerializedDescriptor(BaseModel):
    """One remote memory region: `{"device": "cpu", "ptr": 94065810693184, "size": 4096}`."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    device: str = "cpu"
    ptr: int = 0
    size: int = 0

    def to_descriptor(self) -> "Descriptor":
        """A Descriptor with this region's pointer, size and device (no memory reference)."""
        return Descriptor((self.ptr, self.size, self.device, None))

    @field_validator("device")
    @classmethod
    def validate_device(cls, v: str) -> str:
        v = v.strip().lower()
        if not (v.startswith("cuda") or v.startswith("xpu") or v == "cpu"):
            raise ValueError(
                "Argument `device` must be one of 'cpu', 'cuda:<device_id>', or 'xpu:<device_id>'.")
        return v

    @field_validator("ptr")
    @classmethod
    def validate_ptr(cls, v: int) -> int:
        if v == 0:
            raise ValueError("Argument `ptr` cannot be zero (aka `null` or `None`).")
        return v

    @field_validator("size")
    @classmethod
    def validate_size(cls, v: int) -> int:
        if v < 0:
            raise ValueError("Argument `size` must be an integer greater than or equal to zero.")
        return v


class RdmaMetadata(BaseModel):
    """What a passive operation hands to its peer; byte-compatible with Dynamo's JSON."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    descriptors: List[SerializedDescriptor] = []
    nixl_metadata: str = ""
    notification_key: str = ""
    operation_kind: int = 0

    @field_validator("operation_kind")
    @classmethod
    def validate_operation_kind(cls, v: int) -> int:
        # A TypeError is not wrapped by pydantic: it escapes as a bare TypeError, as in Dynamo.
        if v < 1 or v > 3:
            raise TypeError(
                "Argument `operation_kind` must be an integer value of "
                "`nixl_connect.OperationKind`.")
        return v

    def to_descriptors(self) -> Union["Descriptor", List["Descriptor"]]:
        """One Descriptor for one serialized descriptor, else a list (no memory references)."""
        if len(self.descriptors) == 0:
            raise ValueError("Request descriptor must contain at least one serialized descriptor.")
        if len(self.descriptors) == 1:
            return self.descriptors[0].to_descriptor()
        return [sd.to_descriptor() for sd in self.descriptors]


# --------------------------------------------------------------------------- memory helpers

_TYPE_ERROR_MESSAGE = (
    "Argument `data` must be `torch.Tensor`, `tuple[ndarray, Device|str]`, `bytes`, or "
    "`tuple[int, int, Device|str, Any]` (nixl_connect also accepts `bytearray`, `memoryview` and "
    "any C-contiguous object supporting the buffer protocol).")

_KIND_NONE = 0     # no reference (from metadata)
_KIND_RAW = 1      # (ptr, size, device, ref)
_KIND_BUFFER = 2   # bytes / bytearray / buffer protocol: pinned with a memoryview per operation
_KIND_ARRAY = 3    # (ndarray, device) via __array_interface__ / __cuda_array_interface__
_KIND_TENSOR = 4   # torch.Tensor (duck-typed)

_EMPTY = b""
_U64 = 1 << 64


def _readonly_address(mv: memoryview) -> int:
    """The address of a read-only, C-contiguous, non-empty byte memoryview."""
    obj = mv.obj
    if type(obj) is bytes and mv.nbytes == len(obj):
        # c_char_p over a bytes object points into the object itself (no copy).
        return ctypes.cast(ctypes.c_char_p(obj), ctypes.c_void_p).value or 0
    try:
        import numpy
    except ImportError:
        raise TypeError("Descriptors over read-only buffers other than `bytes` need numpy") from None
    return int(numpy.frombuffer(mv, dtype=numpy.uint8).__array_interface__["data"][0])


def _empty_address() -> int:
    return ctypes.cast(ctypes.c_char_p(_EMPTY), ctypes.c_void_p).value or 0


def _byte_view(obj: Any) -> memoryview:
    """A flat unsigned-byte view of a C-contiguous buffer (raises for non-contiguous ones)."""
    mv = memoryview(obj)
    if not mv.c_contiguous:
        raise ValueError(
            "Argument `data` must be C-contiguous memory; a strided buffer cannot be described by "
            "one pointer and size (copy it first).")
    if mv.ndim != 1 or mv.format not in ("B", "b", "c"):
        mv = mv.cast("B")
    return mv


def _view_address(mv: memoryview) -> int:
    if mv.nbytes == 0:
        return _empty_address()
    if not mv.readonly:
        return ctypes.addressof(ctypes.c_char.from_buffer(mv))
    return _readonly_address(mv)


def _looks_like_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    if torch is not None:
        tensor_type = getattr(torch, "Tensor", None)
        if isinstance(tensor_type, type) and isinstance(obj, tensor_type):
            return True
    if isinstance(obj, (bytes, bytearray, memoryview, tuple, str)):
        return False
    return (callable(getattr(obj, "data_ptr", None)) and callable(getattr(obj, "numel", None))
            and callable(getattr(obj, "element_size", None))
            and callable(getattr(obj, "is_contiguous", None)) and hasattr(obj, "device"))


def _array_interface(arr: Any, device: Device) -> Optional[dict]:
    names = ("__array_interface__", "__cuda_array_interface__")
    if device.kind in (DeviceKind.CUDA, DeviceKind.XPU):
        names = names[::-1]
    for name in names:
        try:
            iface = getattr(arr, name)
        except Exception:  # noqa: BLE001 - cupy raises TypeError for host conversions
            continue
        if isinstance(iface, dict):
            return iface
    return None


def _producer_stream(desc: "Descriptor") -> Optional[int]:
    """The CUDA stream an operation over `desc` waits for before it starts (stream order: the
    work queued there before the operation, and nothing else on the device): for a torch tensor
    the caller's current stream on its device, for an object with a CUDA array interface its
    `stream` (version 3); None for raw pointers, whose work the caller finishes first."""
    if desc._kind == _KIND_TENSOR:
        cuda = getattr(sys.modules.get("torch"), "cuda", None)
        try:
            return int(cuda.current_stream(desc._data_device.id).cuda_stream)
        except Exception:  # noqa: BLE001 (not torch, or torch without CUDA: nothing to wait for)
            return None
    if desc._kind == _KIND_ARRAY:
        iface = getattr(desc._data_ref, "__cuda_array_interface__", None)
        stream = iface.get("stream") if isinstance(iface, dict) else None
        return stream if isinstance(stream, int) and not isinstance(stream, bool) and stream > 0 else None
    return None


def _has_array_interface(obj: Any) -> bool:
    return hasattr(type(obj), "__array_interface__") or hasattr(type(obj), "__cuda_array_interface__")


def _is_dense(shape: Tuple[int, ...], strides: Optional[Tuple[int, ...]], itemsize: int) -> bool:
    """True when shape/strides cover one dense block (C- or Fortran-ordered)."""
    if strides is None or any(s == 0 for s in shape):
        return True

    def dense(order):
        expected = itemsize
        for dim, stride in order:
            if dim != 1 and stride != expected:
                return False
            expected *= dim
        return True

    pairs = list(zip(shape, strides))
    return dense(reversed(pairs)) or dense(pairs)


def _device_arg(value: Any) -> Device:
    if isinstance(value, Device):
        return value
    if isinstance(value, str):
        return Device(value)
    raise TypeError("Argument `data` must be a `tuple[int, int, Device|str, Any]`.")


# --------------------------------------------------------------------------- Descriptor


class Descriptor:
    """A region of memory: a tensor, an (ndarray, device) pair, bytes/bytearray, any C-contiguous
    buffer, or a raw `(ptr, size, device, reference)` tuple.

    The Descriptor keeps its memory's owner (`reference`) alive; an operation keeps its Descriptors
    alive, and the Rust core keeps the memory pinned until no transfer can touch it any more.
    """

    def __init__(self, data: Any) -> None:
        self._metadata: Optional[SerializedDescriptor] = None
        self._connection = None
        self._holders = 0
        self._readonly = False
        # Dynamo's register_with_connector: the core's registration and the Connection it is for.
        self._registration: Any = None
        self._registered_with: Any = None
        # The bytes the memory really has (None for raw pointers): `_data_size`, which Dynamo's
        # callers shrink to use the start of a pooled buffer, may never exceed it.
        self._extent: Optional[int] = None
        if data is None:
            raise ValueError("Argument `data` cannot be `None`.")
        if _looks_like_tensor(data):
            self._init_tensor(data)
        elif isinstance(data, (bytes, bytearray)):
            self._init_buffer(data)
        elif isinstance(data, tuple):
            self._init_tuple(data)
        elif isinstance(data, (str, int, float, list, dict)):
            raise TypeError(_TYPE_ERROR_MESSAGE)
        else:
            try:
                memoryview(data)
            except TypeError:
                raise TypeError(_TYPE_ERROR_MESSAGE) from None
            self._init_buffer(data)
        if self._kind != _KIND_RAW:
            self._extent = self._data_size

    # -- constructors by kind

    def _init_tensor(self, tensor: Any) -> None:
        contiguous = tensor.is_contiguous()
        if contiguous and getattr(tensor, "is_cpu", False) is True:
            # torch's own host tensor (every request's in Dynamo's callers): its flag and byte
            # count in one attribute each, no device object to parse.
            nbytes = getattr(tensor, "nbytes", None)
            if type(nbytes) is int:
                self._data_device = _host_device()
                self._data_ptr = int(tensor.data_ptr())
                self._data_size = nbytes
                self._data_ref = tensor
                self._kind = _KIND_TENSOR
                return
        if not contiguous:
            # Dynamo does the same (tensor.contiguous()); a destination then receives data in a copy.
            logger.warning("Descriptor: a non-contiguous tensor was copied with .contiguous(); data "
                           "written into this Descriptor lands in the copy, not in the original")
            tensor = tensor.contiguous()
        dev = tensor.device
        dev_type = getattr(dev, "type", None) or str(dev).split(":")[0]
        if dev_type in ("cuda", "xpu"):
            index = getattr(dev, "index", None)
            if index is None:
                get_device = getattr(tensor, "get_device", None)
                index = get_device() if callable(get_device) else 0
            kind = DeviceKind.CUDA if dev_type == "cuda" else DeviceKind.XPU
            self._data_device = Device((kind, int(index)))
        elif dev_type == "cpu":
            self._data_device = Device((DeviceKind.HOST, 0))
        else:
            raise ValueError(f"Tensors on device {dev!s} are not supported (cpu, cuda and xpu are).")
        self._data_ptr = int(tensor.data_ptr())
        self._data_size = int(tensor.numel()) * int(tensor.element_size())
        self._data_ref = tensor
        self._kind = _KIND_TENSOR

    def _init_buffer(self, obj: Any) -> None:
        mv = _byte_view(obj)
        try:
            self._data_ptr = _view_address(mv)
        except (TypeError, ValueError):
            raise
        except Exception as e:  # noqa: BLE001
            raise RuntimeError(f"Failed to get memory address of {type(obj).__name__}: {e}") from e
        self._data_size = mv.nbytes
        self._readonly = mv.readonly
        self._data_device = Device((DeviceKind.HOST, 0))
        self._data_ref = obj
        self._kind = _KIND_BUFFER

    def _init_tuple(self, data: tuple) -> None:
        if (len(data) == 2 and not isinstance(data[0], (int, str, bytes, bytearray))
                and _has_array_interface(data[0])):
            arr, dev = data
            if not isinstance(dev, (Device, str)):
                raise TypeError(_TYPE_ERROR_MESSAGE)
            device = dev if isinstance(dev, Device) else Device(dev)
            iface = _array_interface(arr, device)
            if iface is None or not isinstance(iface.get("data"), tuple):
                raise TypeError(_TYPE_ERROR_MESSAGE)
            ptr, readonly = iface["data"]
            shape = tuple(iface.get("shape", ()))
            count = 1
            for dim in shape:
                count *= int(dim)
            nbytes = getattr(arr, "nbytes", None)
            itemsize = getattr(arr, "itemsize", None)
            if not isinstance(itemsize, int):
                typestr = iface.get("typestr", "|u1")
                itemsize = int(typestr[2:]) if typestr[2:].isdigit() else 1
            if not isinstance(nbytes, int):
                nbytes = count * itemsize
            strides = iface.get("strides")
            if not _is_dense(shape, tuple(strides) if strides is not None else None, itemsize):
                raise ValueError(
                    "Argument `data`: the array is not contiguous, so one pointer and size cannot "
                    "describe it (copy it first, e.g. numpy.ascontiguousarray).")
            self._data_ptr = int(ptr or 0)
            self._data_size = int(nbytes)
            self._readonly = bool(readonly)
            self._data_device = device
            self._data_ref = arr
            self._kind = _KIND_ARRAY
            return
        if len(data) >= 2 and isinstance(data[0], int) and isinstance(data[1], int):
            self._data_ptr = data[0]
            self._data_size = data[1]
            self._data_device = _device_arg(data[2]) if len(data) >= 3 else Device((DeviceKind.HOST, 0))
            self._data_ref = data[3] if len(data) >= 4 else None
            self._kind = _KIND_RAW
            return
        raise TypeError(_TYPE_ERROR_MESSAGE)

    # -- Dynamo's public surface

    def __repr__(self) -> str:
        return f"Descriptor({self})"

    def __str__(self) -> str:
        return f"ptr={hex(self._data_ptr)}, size={self._data_size}, device={self._data_device}"

    @property
    def device(self) -> Device:
        """The device the memory is on."""
        return self._data_device

    @property
    def is_registered(self) -> bool:
        """True while `register_with_connector` registered this Descriptor, or an operation holds
        it."""
        return self._registration is not None or self._connection is not None

    @property
    def _nixl_hndl(self) -> Any:
        """Semi-internal (Dynamo): the registration `register_with_connector` made (the same
        object until `deregister_with_connector`), or None. Dynamo 1.7's tests check that a pooled
        Descriptor keeps its registration by its identity."""
        return self._registration

    @property
    def ptr(self) -> int:
        """The address of the first byte."""
        return self._data_ptr

    @property
    def size(self) -> int:
        """The size in bytes."""
        return self._data_size

    @property
    def metadata(self) -> SerializedDescriptor:
        """This Descriptor as a SerializedDescriptor (cached)."""
        md = self._metadata
        if md is None or md.size != self._data_size:
            self._metadata = SerializedDescriptor(device=str(self._data_device), ptr=self._data_ptr,
                                                  size=self._data_size)
        return self._metadata

    @staticmethod
    def from_serialized(serialized: SerializedDescriptor) -> "Descriptor":
        """A Descriptor from a SerializedDescriptor (no memory reference)."""
        if not isinstance(serialized, SerializedDescriptor):
            raise TypeError("Argument `serialized` must be `SerializedDescriptor`.")
        return serialized.to_descriptor()

    def register_with_connector(self, connection: Any) -> None:
        """Semi-internal (Dynamo): register this memory with `connection`'s NIXL agent now, so
        that the reads and writes that later use it (all of it, or its start after `_data_size`
        was shrunk) skip registering it. The registration lasts until `deregister_with_connector`
        or until the Descriptor is garbage collected; operations do not end it (Dynamo's do, so
        there only the first operation gains).

        Raises TypeError for anything but a `nixl_connect.Connection`, ValueError for a null
        pointer, RuntimeError when registered with another connection (as Dynamo).
        """
        if not callable(getattr(connection, "_register", None)):
            raise TypeError("Argument `connection` must be `nixl_connect.Connection`.")
        if self._data_ptr == 0:
            raise InvalidArgumentError("Cannot register memory with a null pointer.")
        for other in (self._registered_with, self._connection):
            if other is not None and other is not connection:
                raise DescriptorInUseError(
                    "Descriptor cannot be registered with more than one connection. Existing "
                    f"connection: {other}, new connection: {connection}.")
        if self._registration is not None:
            return
        self._registration = connection._register([self._core_desc()])
        self._registered_with = connection

    def deregister_with_connector(self, connection: Any) -> None:
        """Semi-internal (Dynamo): end `register_with_connector`'s registration (or, without one,
        one operation's hold)."""
        if self._registration is not None:
            if self._registered_with is not connection:
                raise RuntimeError(
                    "Descriptor can only be deregistered from the connection it was registered "
                    f"with. Existing connection: {self._registered_with}, requested connection: "
                    f"{connection}.")
            self._registration = None
            self._registered_with = None
            return
        if self._connection is None:
            logger.warning("Descriptor %s is not registered; nothing to deregister", self)
            return
        if self._connection is not connection:
            raise RuntimeError(
                "Descriptor can only be deregistered from the connection it was registered with. "
                f"Existing connection: {self._connection}, requested connection: {connection}.")
        self._release_hold()

    # -- internals used by the operations

    def _acquire(self, connection: Any) -> None:
        if self._data_ptr == 0:
            raise InvalidArgumentError("Cannot register memory with a null pointer.")
        if not 0 < self._data_ptr < _U64:
            raise InvalidArgumentError(f"Cannot register memory at {self._data_ptr}: not an address.")
        if not 0 <= self._data_size < _U64:
            raise InvalidArgumentError(
                f"Cannot register memory of size {self._data_size}: sizes are 0 or more bytes.")
        if self._registered_with is not None and self._registered_with is not connection:
            raise DescriptorInUseError(
                "Descriptor cannot be used with more than one connection. It is registered with "
                f"{self._registered_with}; the operation's connection is {connection}.")
        if self._connection is not None and self._connection is not connection:
            raise DescriptorInUseError(
                "Descriptor cannot be registered with more than one connection. Existing "
                f"connection: {self._connection}, new connection: {connection}.")
        self._connection = connection
        self._holders += 1

    def _release_hold(self) -> None:
        if self._holders > 0:
            self._holders -= 1
        if self._holders == 0:
            self._connection = None

    def _core_desc(self) -> tuple:
        """(ptr, size, device string, keepalive) for the Rust core.

        Buffers are pinned with a fresh memoryview for the operation's lifetime (a pinned bytearray
        cannot be resized); their address is checked again, so a buffer resized since the
        Descriptor was made is refused instead of transferring freed memory.
        """
        size = self._data_size
        if (not isinstance(size, int) or isinstance(size, bool) or size < 0
                or (self._extent is not None and size > self._extent)):
            raise InvalidArgumentError(
                f"Descriptor._data_size is {size!r}: it must be an int from 0 to the "
                f"{self._extent} bytes of the Descriptor's memory.")
        keep = self._data_ref
        if self._kind == _KIND_BUFFER:
            keep = _byte_view(self._data_ref)
            if keep.nbytes != self._extent or (self._extent and _view_address(keep) != self._data_ptr):
                raise InvalidArgumentError(
                    "The buffer behind this Descriptor was resized or moved after the Descriptor "
                    "was created; create a new Descriptor.")
        device = str(self._data_device)
        if self._readonly:
            device += "!ro"
        if self._data_device.kind == DeviceKind.CUDA:
            stream = _producer_stream(self)
            if stream is not None:
                device += f"@{stream}"
        return (self._data_ptr, self._data_size, device, keep)
