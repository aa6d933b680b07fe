"""Helpers shared by the pytest suite and by peer.py (the subprocess peer).

Kept free of pytest and of any nixl_connect import so that peer.py can use it too.
"""
import hashlib
import importlib

import numpy as np

# The two implementations under test: Dynamo's Python module and this project's PyO3 module.
MODULES = ["dynamo.nixl_connect", "nixl_connect"]

KIB = 1024
MIB = 1024 * 1024

# Eight unequal sizes (odd ones included) for the list-of-descriptors tests.
UNEQUAL_SIZES = [1, 7, 512, 4096, 4099, 65536, 100003, 1 << 20]

# The shapes every round trip is run with: one 4 KiB descriptor, one 64 MiB descriptor, eight unequal ones.
SHAPES = {
    "4KiB": [4 * KIB],
    "64MiB": [64 * MIB],
    "8unequal": UNEQUAL_SIZES,
}


def pattern(n: int, seed: int) -> bytearray:
    """n deterministic bytes; every aligned 8-byte word differs, and different seeds differ."""
    words = (n + 7) // 8
    with np.errstate(over="ignore"):
        x = np.arange(words, dtype=np.uint64)
        x += np.uint64(seed) * np.uint64(0x632BE59BD9B4E019)
        x *= np.uint64(0x9E3779B97F4A7C15)
        x ^= x >> np.uint64(31)
    return bytearray(x.astype("<u8").tobytes()[:n])


def patterns(sizes, seed: int) -> list:
    """One pattern buffer per size, each with its own seed (so swapped descriptors are caught)."""
    return [pattern(s, seed * 1000 + i) for i, s in enumerate(sizes)]


def sha256_of(buffers) -> str:
    h = hashlib.sha256()
    for b in buffers:
        h.update(memoryview(b).cast("B"))
    return h.hexdigest()


def import_module(name: str):
    return importlib.import_module(name)


def descriptors(nc, buffers, style: str = "bytearray"):
    """Dynamo-style Descriptors over `buffers` (bytearrays). A single buffer gives a single Descriptor.

    style: "bytearray" -> Descriptor(bytearray); "numpy" -> Descriptor((ndarray, "cpu"))
    """
    out = []
    for b in buffers:
        if style == "numpy":
            out.append(nc.Descriptor((np.frombuffer(b, dtype=np.uint8), "cpu")))
        else:
            out.append(nc.Descriptor(b))
    return out[0] if len(out) == 1 else out
