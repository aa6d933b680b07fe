"""torch tensors (CPU and CUDA) as Descriptors. The CUDA cases are skipped, with the reason, when
CUDA is unavailable."""
import asyncio

import pytest

from conftest import cuda_skip_reason, waited


def _real_torch_or_skip():
    import torch
    return torch


def _cuda_or_skip():
    reason = cuda_skip_reason()
    if reason is not None:
        print(f"CUDA tests skipped: {reason}")
        pytest.skip(reason)
    import torch
    return torch


async def test_cpu_tensor_descriptor(nc):
    torch = _real_torch_or_skip()
    t = torch.arange(256, dtype=torch.int32)
    d = nc.Descriptor(t)
    assert d.ptr == t.data_ptr() and d.size == 1024 and str(d.device) == "cpu"


async def test_noncontiguous_tensor_is_copied(nc):
    torch = _real_torch_or_skip()
    t = torch.arange(64, dtype=torch.float32).reshape(8, 8).t()
    assert not t.is_contiguous()
    d = nc.Descriptor(t)
    assert d.size == 256 and d.ptr != t.data_ptr()  # Dynamo registers a contiguous copy


@pytest.mark.parametrize("direction", ["read", "write"])
async def test_cuda_tensor_round_trip(nc, direction):
    torch = _cuda_or_skip()
    a, b = nc.Connector(), nc.Connector()
    src = torch.randint(0, 255, (4 << 20,), dtype=torch.uint8, device="cuda:0")
    dst = torch.zeros_like(src)
    ds, dd = nc.Descriptor(src), nc.Descriptor(dst)
    assert str(ds.device) == "cuda:0" and ds.metadata.device == "cuda:0"
    if direction == "read":
        with await a.create_readable(ds) as passive:
            with await b.begin_read(passive.metadata(), dd) as op:
                await waited(asyncio.gather(op.wait_for_completion(), passive.wait_for_completion()))
    else:
        with await a.create_writable(dd) as passive:
            with await b.begin_write(ds, passive.metadata()) as op:
                await waited(asyncio.gather(op.wait_for_completion(), passive.wait_for_completion()))
    torch.cuda.synchronize()
    assert torch.equal(src, dst)


async def test_cuda_to_host_read(nc):
    torch = _cuda_or_skip()
    a, b = nc.Connector(), nc.Connector()
    src = torch.arange(1 << 20, dtype=torch.int32, device="cuda:0")
    dst = bytearray(4 << 20)
    with await a.create_readable(nc.Descriptor(src)) as passive:
        with await b.begin_read(passive.metadata(), nc.Descriptor(dst)) as op:
            await waited(asyncio.gather(op.wait_for_completion(), passive.wait_for_completion()))
    assert bytes(dst) == src.cpu().numpy().tobytes()
