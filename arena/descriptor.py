"""Slot descriptors: which slot, and which arrays live at which offsets with which dtype and shape.

A descriptor is what crosses the control channel instead of the data. It encodes to the fixed
records of :mod:`arena._layout` (``DESC_HEAD`` + per array ``ARRAY_HEAD`` + shape dims).

Invariants:
- ``decode(encode(d)) == d`` for every valid descriptor.
- Every array and the payload lie inside the slot: ``offset + nbytes <= slot_size`` (checked by
  :meth:`Descriptor.check`, which the reader calls before making views).
- Arrays are C-contiguous; offsets are multiples of ``ALIGN``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from arena._layout import ARRAY_HEAD, DESC_HEAD, DTYPES, MAX_NDIM, SHAPES, itemsize
from arena.allocator import SlotRef


class ArraySpec(NamedTuple):
    """One C-contiguous array inside a slot."""

    offset: int
    dtype: int  # a code of arena._layout.DTYPES
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


class Descriptor(NamedTuple):
    """Where one batch lives: a slot, its arrays, and the pickled payload for everything else.

    Descriptors are built and decoded once per batch, so they are named tuples (immutable and
    several times cheaper to construct than frozen dataclasses)."""

    ref: SlotRef
    arrays: tuple[ArraySpec, ...]
    payload_offset: int = 0
    payload_len: int = 0
    flags: int = 0

    @property
    def end(self) -> int:
        """One past the last byte of the slot this batch uses."""
        ends = [a.offset + a.nbytes for a in self.arrays]
        ends.append(self.payload_offset + self.payload_len)
        return max(ends)

    def check(self, slot_size: int) -> None:
        """Raise ``ValueError`` unless every array and the payload fit inside ``slot_size``."""
        for a in self.arrays:
            if (a.dtype not in DTYPES or len(a.shape) > MAX_NDIM or a.offset < 0
                    or any(d < 0 for d in a.shape)):  # fmt: skip
                raise ValueError(f"corrupt array record {a}")
            if a.offset + a.nbytes > slot_size:
                raise ValueError(
                    f"array at offset {a.offset} of {a.nbytes} bytes overruns slot of {slot_size}"
                )
        if self.payload_offset < 0 or self.payload_len < 0:
            raise ValueError(
                f"corrupt payload record: offset {self.payload_offset}, {self.payload_len} bytes"
            )
        if self.payload_offset + self.payload_len > slot_size:
            raise ValueError(
                f"payload at {self.payload_offset} of {self.payload_len} bytes overruns slot "
                f"of {slot_size}"
            )

    def encode(self) -> bytes:
        r = self.ref
        parts = [
            DESC_HEAD.pack(
                r.slab_id,
                r.slot,
                r.generation,
                len(self.arrays),
                self.flags,
                self.payload_offset,
                self.payload_len,
            )
        ]
        for a in self.arrays:
            parts.append(ARRAY_HEAD.pack(a.offset, a.dtype, len(a.shape)))
            parts.append(SHAPES[len(a.shape)].pack(*a.shape))
        return b"".join(parts)

    @classmethod
    def decode(cls, buf: bytes | memoryview, pos: int = 0) -> Descriptor:
        slab_id, slot, gen, narrays, flags, poff, plen = DESC_HEAD.unpack_from(buf, pos)
        pos += DESC_HEAD.size
        arrays = []
        for _ in range(narrays):
            offset, dtype, ndim = ARRAY_HEAD.unpack_from(buf, pos)
            pos += ARRAY_HEAD.size
            if ndim > MAX_NDIM:
                raise ValueError(f"corrupt array record: {ndim} dimensions (at most {MAX_NDIM})")
            rec = SHAPES[ndim]
            shape = rec.unpack_from(buf, pos)
            pos += rec.size
            arrays.append(ArraySpec(offset, dtype, shape))
        return cls(SlotRef(slab_id, slot, gen), tuple(arrays), poff, plen, flags)
