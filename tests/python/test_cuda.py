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


def _cycles_for(torch, seconds: float) -> int:
    """GPU clock cycles that `torch.cuda._sleep` spins for about `seconds`, measured here."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    probe = 50_000_000
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    per_ms = probe / max(start.elapsed_time(end), 1e-3)
    return int(per_ms * seconds * 1000)


async def _read_pair(nc, a, b, src, dst):
    with await a.create_readable(nc.Descriptor(src)) as passive:
        with await b.begin_read(passive.metadata(), nc.Descriptor(dst)) as op:
            await waited(asyncio.gather(op.wait_for_completion(), passive.wait_for_completion()))


@pytest.mark.parametrize("direction", ["read", "write"])
async def test_cuda_stream_order_a_kernel_on_the_producer_stream_runs_before_the_copy(nc, direction):
    """The source is filled by a kernel still queued (behind a 0.3 s one) on the caller's stream
    when the operations are created: the copy must see the filled bytes, never the old ones."""
    torch = _cuda_or_skip()
    a, b = nc.Connector(), nc.Connector()
    n = 16 << 20
    src = torch.zeros(n, dtype=torch.uint8, device="cuda:0")
    dst = torch.zeros_like(src)
    await _read_pair(nc, a, b, src, dst)  # warm: connections, mappings
    cycles = _cycles_for(torch, 0.3)
    torch.cuda.synchronize()
    torch.cuda._sleep(cycles)  # the producer stream (current) is busy...
    src.fill_(7)               # ...and fills the source after it
    if direction == "read":
        await _read_pair(nc, a, b, src, dst)
    else:
        with await a.create_writable(nc.Descriptor(dst)) as passive:
            with await b.begin_write(nc.Descriptor(src), passive.metadata()) as op:
                await waited(asyncio.gather(op.wait_for_completion(), passive.wait_for_completion()))
    torch.cuda.synchronize()
    assert int((dst == 7).sum()) == n


async def test_cuda_stream_order_a_kernel_on_another_stream_does_not_delay_a_transfer(nc):
    """A 3 s kernel on an unrelated stream is still running when a transfer of memory produced on
    the default stream has completed (the owner no longer synchronises the whole context)."""
    torch = _cuda_or_skip()
    import time
    a, b = nc.Connector(), nc.Connector()
    src = torch.randint(0, 255, (64 << 20,), dtype=torch.uint8, device="cuda:0")
    dst = torch.zeros_like(src)
    await _read_pair(nc, a, b, src, dst)  # warm
    cycles = _cycles_for(torch, 3.0)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(cycles)
    t0 = time.perf_counter()
    dst.zero_()
    await _read_pair(nc, a, b, src, dst)
    took = time.perf_counter() - t0
    still_running = not side.query()
    print(f"64 MiB transfer took {took * 1e3:.2f} ms while a 3 s kernel ran on another stream "
          f"(still running at the end: {still_running})")
    assert still_running, f"the transfer waited for the other stream's kernel ({took:.3f} s)"
    side.synchronize()
    assert torch.equal(src, dst)


@pytest.mark.parametrize("direction", ["read", "write"])
async def test_cuda_host_into_device_takes_the_same_host_path(nc, direction):
    """Host memory into device memory of another connector is pulled through pinned staging (the
    same-host path), byte-exact over several staging pieces and an odd tail."""
    torch = _cuda_or_skip()
    a, b = nc.Connector(), nc.Connector()
    n = (40 << 20) + 12345
    src = torch.randint(0, 255, (n,), dtype=torch.uint8)
    dst = torch.zeros(n, dtype=torch.uint8, device="cuda:0")
    if direction == "read":
        with await a.create_readable(nc.Descriptor(src)) as passive:
            with await b.begin_read(passive.metadata(), nc.Descriptor(dst)) as op:
                await waited(asyncio.gather(op.wait_for_completion(), passive.wait_for_completion()))
                path = op.path
    else:
        with await a.create_writable(nc.Descriptor(dst)) as passive:
            with await b.begin_write(nc.Descriptor(src), passive.metadata()) as op:
                await waited(asyncio.gather(op.wait_for_completion(), passive.wait_for_completion()))
                path = op.path
    torch.cuda.synchronize()
    assert torch.equal(src, dst.cpu())
    assert path == "local", path
