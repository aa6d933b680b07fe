"""One side of Dynamo's read-based embedding transfer, run unchanged in its own process.

    python dynamo_embed_peer.py sender   COUNT SIZE DTYPE   # prints one TransferRequest JSON a line
    python dynamo_embed_peer.py receiver COUNT SIZE DTYPE   # reads them from stdin, checks, times

`dynamo.nixl_connect` is Dynamo's module, or ours when NIXL_CONNECT_AS_DYNAMO=1 (the wheel's .pth
hook). The classes are Dynamo's own (`dynamo.common.multimodal.embedding_transfer`); tensors are
real torch CPU tensors made from a seed, so the receiver checks every byte. The receiver prints one
JSON line: the module, the per-tensor receive times (µs) and their median.
"""
import asyncio
import json
import statistics
import sys
import time

import torch

from dynamo.common.multimodal.embedding_transfer import (
    NixlReadEmbeddingReceiver,
    NixlReadEmbeddingSender,
    TransferRequest,
)

HIDDEN = 1024


def tensor(i: int, size: int, dtype: torch.dtype) -> torch.Tensor:
    """Tensor `i` of `size` bytes: rows of HIDDEN elements, values from seed i."""
    g = torch.Generator().manual_seed(1000 + i)
    n = size // torch.tensor([], dtype=dtype).element_size()
    return (torch.randn(n // HIDDEN, HIDDEN, generator=g) * 100).to(dtype)


async def sender(count: int, size: int, dtype: torch.dtype) -> None:
    s = NixlReadEmbeddingSender()
    tensors = [tensor(i, size, dtype) for i in range(count)]  # made first: not timed by the peer
    futures = []
    for t in tensors:
        request, done = await s.send_embeddings(t)
        futures.append(done)
        print(request.model_dump_json(), flush=True)
    await asyncio.wait_for(asyncio.gather(*futures), 120)
    print("DONE", flush=True)


async def receiver(count: int, size: int, dtype: torch.dtype) -> None:
    hidden_items = max(1, size // HIDDEN)
    r = NixlReadEmbeddingReceiver(embedding_hidden_size=HIDDEN, max_item_mm_token=hidden_items,
                                  max_items=4)
    loop = asyncio.get_running_loop()
    times = []
    for i in range(count):
        line = await loop.run_in_executor(None, sys.stdin.readline)
        request = TransferRequest.model_validate_json(line)
        t0 = time.perf_counter()
        tensor_id, got = await r.receive_embeddings(request)
        times.append((time.perf_counter() - t0) * 1e6)
        want = tensor(i, size, dtype)
        assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), (got.shape, want.shape)
        assert torch.equal(got, want), f"tensor {i}: bytes differ"
        r.release_tensor(tensor_id)
    import dynamo.nixl_connect as module
    print(json.dumps({"module": module.__name__, "count": count, "size": size,
                      "dtype": str(dtype).removeprefix("torch."),
                      "receive_us": [round(t, 1) for t in times],
                      "median_us": round(statistics.median(times[1:] or times), 1)}), flush=True)


def main() -> None:
    role, count, size, dtype = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    dt = getattr(torch, dtype)
    asyncio.run((sender if role == "sender" else receiver)(count, size, dt))


if __name__ == "__main__":
    main()
