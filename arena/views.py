"""Zero-copy NumPy views over a slot, from a descriptor.

Invariant: a view shares memory with the slot (no copy) and holds a reference to the slot's
buffer, so the mapping stays valid while the view lives.
"""

from __future__ import annotations

import math

import numpy as np

from arena._layout import DTYPES
from arena.descriptor import ArraySpec, Descriptor


def array_view(slot: memoryview, spec: ArraySpec) -> np.ndarray:
    """The array ``spec`` describes, viewed in place. Torch-only dtypes come back as raw bytes
    (``uint8`` with a trailing item-size axis), which the caller reinterprets."""
    name, size, numpy_ok = DTYPES[spec.dtype]
    count = math.prod(spec.shape)
    if numpy_ok:
        return np.frombuffer(slot, dtype=name, count=count, offset=spec.offset).reshape(spec.shape)
    raw = np.frombuffer(slot, dtype=np.uint8, count=count * size, offset=spec.offset)
    return raw.reshape((*spec.shape, size))


def views(slot: memoryview, desc: Descriptor) -> list[np.ndarray]:
    """Every array of ``desc``, viewed in place, after checking that they lie inside the slot."""
    desc.check(len(slot))
    return [array_view(slot, a) for a in desc.arrays]


def payload(slot: memoryview, desc: Descriptor) -> memoryview:
    """The descriptor's payload bytes, in place."""
    return slot[desc.payload_offset : desc.payload_offset + desc.payload_len]
