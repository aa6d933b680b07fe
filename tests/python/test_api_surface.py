"""The public names, enums, signatures and value types of dynamo.nixl_connect 1.6.1.

Everything here needs no transfer (Connectors are created but no NIXL agent is, except where an
operation is created). See /work/research/dynamo_api.md for the source these come from.
"""
import inspect
import socket

import numpy as np
import pytest

PUBLIC = [
    "Connector", "Descriptor", "Device", "DeviceKind", "OperationKind", "OperationStatus",
    "RdmaMetadata", "SerializedDescriptor", "ReadOperation", "WriteOperation",
    "ReadableOperation", "WritableOperation",
]


@pytest.mark.parametrize("name", PUBLIC)
def test_public_names_exist(nc, name):
    assert hasattr(nc, name), f"{nc.__name__} lacks {name}"


def test_operation_class_hierarchy(nc):
    # Dynamo: Read/WriteOperation <- ActiveOperation, Readable/WritableOperation <- PassiveOperation,
    # both <- AbstractOperation. Code may isinstance-check the public four; keep them distinct.
    classes = [nc.ReadOperation, nc.WriteOperation, nc.ReadableOperation, nc.WritableOperation]
    assert len(set(classes)) == 4
    for a in classes:
        for b in classes:
            if a is not b:
                assert not issubclass(a, b)


def test_device_kind_values(nc):
    K = nc.DeviceKind
    assert [(m.name, int(m)) for m in K] == [("UNSPECIFIED", 0), ("HOST", 1), ("CUDA", 2), ("XPU", 3)]
    assert [str(m) for m in K] == ["<invalid>", "cpu", "cuda", "xpu"]
    assert K.HOST == 1 and isinstance(K.CUDA, int)


def test_operation_kind_values(nc):
    K = nc.OperationKind
    assert [(m.name, int(m)) for m in K] == [("UNSPECIFIED", 0), ("READ", 1), ("WRITE", 2)]
    assert [str(m) for m in K] == ["<invalid>", "READ", "WRITE"]
    assert f"{K.READ}" == "READ"


def test_operation_status_values(nc):
    S = nc.OperationStatus
    assert [(m.name, int(m)) for m in S] == [
        ("UNINITIALIZED", 0), ("INITIALIZED", 1), ("IN_PROGRESS", 2), ("COMPLETE", 3),
        ("CANCELLED", 4), ("ERRORED", 5)]
    assert [str(m) for m in S] == ["<invalid>", "INIT", "PROC", "DONE", "STOP", "ERR"]
    assert S.COMPLETE == 3


# --------------------------------------------------------------------------- async-ness / signatures

@pytest.mark.parametrize("method,params", [
    ("begin_read", ["remote_metadata", "local_descriptors"]),
    ("begin_write", ["local_descriptors", "remote_metadata"]),
    ("create_readable", ["local_descriptors"]),
    ("create_writable", ["local_descriptors"]),
    ("initialize", []),
])
def test_connector_method_parameters(nc, method, params):
    # Dynamo: all five are `async def`. (inspect.iscoroutinefunction is not asserted: it is False
    # for compiled methods that return awaitables; awaiting them is what every other test does.)
    f = getattr(nc.Connector, method)
    try:
        sig = inspect.signature(f)
    except (TypeError, ValueError):
        pytest.skip("signature not introspectable")
    names = [p for p in sig.parameters if p != "self"]
    assert names == params


async def test_connector_initialize_returns_awaitable(nc):
    aw = nc.Connector().initialize()
    assert inspect.isawaitable(aw)
    assert await aw is None


@pytest.mark.parametrize("cls,members", [
    ("ReadOperation", ["cancel", "results", "status", "wait_for_completion", "remote", "connection",
                       "operation_kind", "__enter__", "__exit__"]),
    ("WriteOperation", ["cancel", "status", "wait_for_completion", "remote", "connection",
                        "operation_kind", "__enter__", "__exit__"]),
    ("ReadableOperation", ["metadata", "status", "wait_for_completion", "connection", "operation_kind",
                           "__enter__", "__exit__"]),
    ("WritableOperation", ["metadata", "status", "wait_for_completion", "connection", "operation_kind",
                           "__enter__", "__exit__"]),
])
def test_operation_members(nc, cls, members):
    c = getattr(nc, cls)
    for m in members:
        assert hasattr(c, m), f"{cls}.{m} missing"
    if "metadata" in members:
        # a method on operations (op.metadata(hex_encode=False)), unlike Descriptor.metadata (property)
        assert callable(getattr(c, "metadata")) and not isinstance(
            inspect.getattr_static(c, "metadata"), property)


# --------------------------------------------------------------------------- Connector

def test_connector_defaults(nc):
    c = nc.Connector()
    assert isinstance(c.name, str) and len(c.name) == 32
    int(c.name, 16)  # uuid4().hex: 32 lowercase hex digits, no dashes
    assert c.name == c.name.lower()
    assert str(c) == c.name
    assert c.hostname == socket.gethostname()
    assert nc.Connector().name != c.name


def test_connector_worker_id(nc):
    c = nc.Connector(worker_id="worker-a")
    assert c.name == "worker-a" and str(c) == "worker-a"
    assert nc.Connector("worker-a") == c  # positional works too; equality is by worker_id
    assert nc.Connector("worker-b") != c
    assert c != "worker-a"
    for bad in ("", 5):
        with pytest.raises(TypeError, match="worker_id"):
            nc.Connector(worker_id=bad)


async def test_connector_initialize_is_a_noop(nc):
    c = nc.Connector()
    assert await c.initialize() is None
    assert await c.initialize() is None


# --------------------------------------------------------------------------- Device

@pytest.mark.parametrize("text,kind,dev_id,as_str", [
    ("cpu", "HOST", 0, "cpu"),
    (" CPU ", "HOST", 0, "cpu"),
    ("host", "HOST", 0, "cpu"),
    ("cpu:3", "HOST", 0, "cpu"),      # the id is ignored for host memory
    ("cuda", "CUDA", 0, "cuda:0"),
    ("cuda:1", "CUDA", 1, "cuda:1"),
    ("GPU:2", "CUDA", 2, "cuda:2"),
    ("xpu:1", "XPU", 1, "xpu:1"),
])
def test_device_parsing(nc, text, kind, dev_id, as_str):
    d = nc.Device(text)
    assert d.kind == getattr(nc.DeviceKind, kind)
    assert d.id == dev_id
    assert str(d) == as_str


def test_device_from_tuple_and_errors(nc):
    d = nc.Device((nc.DeviceKind.CUDA, 3))
    assert d.kind == nc.DeviceKind.CUDA and d.id == 3 and str(d) == "cuda:3"
    with pytest.raises(ValueError):
        nc.Device(None)
    with pytest.raises(ValueError):
        nc.Device("tpu")
    with pytest.raises(ValueError):
        nc.Device("")
    with pytest.raises(ValueError):
        nc.Device("cuda:x")
    with pytest.raises(TypeError):
        nc.Device(3)
    with pytest.raises(TypeError):
        nc.Device((2, 3))  # the kind must be a DeviceKind


# --------------------------------------------------------------------------- Descriptor

def test_descriptor_from_bytearray(nc):
    buf = bytearray(b"0123456789")
    d = nc.Descriptor(buf)
    assert d.size == 10
    assert isinstance(d.ptr, int) and d.ptr != 0
    assert d.device.kind == nc.DeviceKind.HOST and str(d.device) == "cpu"
    assert d.is_registered is False
    assert nc.Descriptor(data=buf).ptr == d.ptr  # same buffer, same address


def test_descriptor_from_bytes(nc):
    d = nc.Descriptor(b"abc")
    assert d.size == 3 and d.ptr != 0 and str(d.device) == "cpu"


def test_descriptor_from_numpy_tuple(nc):
    arr = np.zeros(16, dtype=np.float32)
    d = nc.Descriptor((arr, "cpu"))
    assert d.ptr == arr.__array_interface__["data"][0]
    assert d.size == 64
    d2 = nc.Descriptor((arr, nc.Device("cpu")))
    assert d2.ptr == d.ptr and d2.size == 64


def test_descriptor_from_pointer_tuple(nc):
    d = nc.Descriptor((0x1000, 256, "cuda:2", None))
    assert (d.ptr, d.size, str(d.device)) == (0x1000, 256, "cuda:2")
    d = nc.Descriptor((0x1000, 256))
    assert str(d.device) == "cpu"
    d = nc.Descriptor((0x1000, 256, nc.Device("xpu:1")))
    assert str(d.device) == "xpu:1"


def test_descriptor_metadata(nc):
    d = nc.Descriptor((0x10, 10, "cuda:3"))
    sd = d.metadata
    assert isinstance(sd, nc.SerializedDescriptor)
    assert (sd.device, sd.ptr, sd.size) == ("cuda:3", 16, 10)
    assert nc.Descriptor((0x10, 10, "host")).metadata.device == "cpu"
    assert nc.Descriptor((0x10, 10, "xpu")).metadata.device == "xpu:0"


def test_descriptor_from_serialized(nc):
    sd = nc.SerializedDescriptor(device="cuda:1", ptr=4096, size=64)
    d = nc.Descriptor.from_serialized(sd)
    assert (d.ptr, d.size, str(d.device)) == (4096, 64, "cuda:1")
    d = sd.to_descriptor()
    assert (d.ptr, d.size, str(d.device)) == (4096, 64, "cuda:1")
    with pytest.raises(TypeError):
        nc.Descriptor.from_serialized({"ptr": 1, "size": 2})


@pytest.mark.parametrize("bad,exc", [
    (None, ValueError),
    ("a string", TypeError),
    (5, TypeError),
    ([1, 2], TypeError),
    ((), TypeError),
    ((5,), TypeError),
    (("5", 10), TypeError),
    ((0x1000, 10, 3), TypeError),          # third element must be Device or str
    ((np.zeros(4), 0), TypeError),          # (ndarray, <not a device>)
])
def test_descriptor_rejects(nc, bad, exc):
    with pytest.raises(exc):
        nc.Descriptor(bad)


def test_descriptor_bad_device_string(nc):
    with pytest.raises(ValueError):
        nc.Descriptor((np.zeros(4), "tpu"))
    with pytest.raises(ValueError):
        nc.Descriptor((0x1000, 8, "tpu"))


def test_rdma_metadata_to_descriptors(nc):
    sd = [nc.SerializedDescriptor(ptr=1, size=2), nc.SerializedDescriptor(device="cuda:1", ptr=3, size=4)]
    one = nc.RdmaMetadata(descriptors=sd[:1], operation_kind=1).to_descriptors()
    assert isinstance(one, nc.Descriptor) and (one.ptr, one.size) == (1, 2)
    two = nc.RdmaMetadata(descriptors=sd, operation_kind=1).to_descriptors()
    assert isinstance(two, list) and [(d.ptr, d.size, str(d.device)) for d in two] == [
        (1, 2, "cpu"), (3, 4, "cuda:1")]
    with pytest.raises(ValueError):
        nc.RdmaMetadata(operation_kind=1).to_descriptors()


async def test_descriptor_registration_handle_lives_from_register_to_deregister(nc):
    # `_nixl_hndl` (Dynamo's private name, read by Dynamo 1.7's mm_kwargs tests): None until
    # `register_with_connector`, then one object, kept by a repeated registration, None again after
    # `deregister_with_connector`.
    conn = await nc.Connector()._create_connection()
    d = nc.Descriptor(bytearray(4096))
    assert d._nixl_hndl is None
    d.register_with_connector(conn)
    handle = d._nixl_hndl
    assert handle is not None
    d.register_with_connector(conn)
    assert d._nixl_hndl is handle
    d.deregister_with_connector(conn)
    assert d._nixl_hndl is None


def test_module_names_nixls_python_api(nc):
    # `nixl_api`: NIXL's Python API module, as Dynamo's module imports it (None on nixl_connect
    # when the `nixl` package is not installed; this suite's venv has it).
    assert nc.nixl_api is not None and callable(nc.nixl_api.nixl_agent)
