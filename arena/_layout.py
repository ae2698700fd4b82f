"""The arena's byte layout, declared once: alignment, slot geometry, descriptors, dtype codes.

Pure functions and constants only; every other module asks this one for an offset or a format.

Invariants:
- ``PAGE`` is the kernel page size; every slab size and every slot size is a multiple of ``PAGE``,
  so slots never share a page (pinning, faulting and accounting work slot by slot).
- Array offsets inside a slot are multiples of ``ALIGN`` (64 bytes: one cache line and the widest
  SIMD load), so vectorised copies into a slot run at full speed and no two arrays share a line.
- A descriptor is ``DESC_HEAD`` followed by ``narrays`` records of ``ARRAY_HEAD`` + ``ndim`` x
  ``SHAPE_DIM``; all little-endian, no padding.  Its length is
  ``DESC_HEAD.size + sum(ARRAY_HEAD.size + ndim_i * SHAPE_DIM.size)``.
- Dtype codes are stable small integers; the table carries each dtype's item size so the arena can
  do offset math for dtypes it cannot view itself (torch-only dtypes such as bfloat16).
"""

from __future__ import annotations

import mmap
import struct
from typing import Final

PAGE: Final[int] = mmap.PAGESIZE
ALIGN: Final[int] = 64

# slab_id, slot, generation, narrays, flags, payload_offset, payload_len
DESC_HEAD: Final = struct.Struct("<IIIHHQQ")
# offset, dtype code, ndim
ARRAY_HEAD: Final = struct.Struct("<QBB")
SHAPE_DIM: Final = struct.Struct("<Q")
# shape of ndim dims, as one record (cached per ndim)
SHAPES: Final = tuple(struct.Struct(f"<{n}Q") for n in range(65))

MAX_NDIM: Final[int] = 64  # numpy's limit


def align_up(n: int, alignment: int) -> int:
    """Smallest multiple of ``alignment`` (a power of two) that is ``>= n``."""
    return (n + alignment - 1) & ~(alignment - 1)


def page_align(n: int) -> int:
    """``n`` rounded up to whole pages (at least one page)."""
    return max(PAGE, align_up(n, PAGE))


# code -> (name, itemsize, numpy-viewable). Names are numpy dtype names where numpy has the type,
# torch dtype names otherwise. Codes are part of the wire format: append, never renumber.
DTYPES: Final[dict[int, tuple[str, int, bool]]] = {
    1: ("bool", 1, True),
    2: ("uint8", 1, True),
    3: ("int8", 1, True),
    4: ("int16", 2, True),
    5: ("int32", 4, True),
    6: ("int64", 8, True),
    7: ("float16", 2, True),
    8: ("float32", 4, True),
    9: ("float64", 8, True),
    10: ("complex64", 8, True),
    11: ("complex128", 16, True),
    12: ("uint16", 2, True),
    13: ("uint32", 4, True),
    14: ("uint64", 8, True),
    64: ("bfloat16", 2, False),
    65: ("complex32", 4, False),
    66: ("float8_e4m3fn", 1, False),
    67: ("float8_e5m2", 1, False),
    68: ("float8_e4m3fnuz", 1, False),
    69: ("float8_e5m2fnuz", 1, False),
}
DTYPE_CODE: Final[dict[str, int]] = {name: code for code, (name, _, _) in DTYPES.items()}


def itemsize(code: int) -> int:
    """Bytes per element of dtype ``code``."""
    return DTYPES[code][1]
