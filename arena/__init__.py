"""A shared-memory slab arena and slot allocator. Knows nothing of torch or DataLoader.

Owner side: :class:`Arena` creates slabs (:class:`Slab`) on demand, hands out slots
(:class:`SlotRef`) through ``acquire`` and takes them back through ``release``. Other processes
attach a slab from its :class:`SlabSpec`, write a batch with :class:`SlotWriter` (large copies
with streaming stores: :mod:`arena.stream`), and describe it with a :class:`Descriptor`; the owner
views it in place with :func:`views`.
"""

from arena._layout import ALIGN, DTYPE_CODE, DTYPES, PAGE
from arena.allocator import Arena, SlotRef, SlotState, default_max_bytes
from arena.descriptor import ArraySpec, Descriptor
from arena.errors import (
    ArenaCapacityError,
    ArenaDescriptorError,
    ArenaError,
    ArenaExhaustedError,
    InheritedArenaError,
    StaleSlotError,
)
from arena.segment import (
    Backend,
    Mapping,
    Segment,
    SegmentSpec,
    forsake,
    mem_available_bytes,
    privatize,
    shm_free_bytes,
)
from arena.slab import Slab, SlabSpec
from arena.stats import ArenaStats
from arena.views import array_view, payload, views
from arena.writer import SlotWriter

__all__ = [
    "ALIGN",
    "DTYPES",
    "DTYPE_CODE",
    "PAGE",
    "Arena",
    "ArenaCapacityError",
    "ArenaDescriptorError",
    "ArenaError",
    "ArenaExhaustedError",
    "ArenaStats",
    "ArraySpec",
    "Backend",
    "Descriptor",
    "InheritedArenaError",
    "Mapping",
    "Segment",
    "SegmentSpec",
    "Slab",
    "SlabSpec",
    "SlotRef",
    "SlotState",
    "SlotWriter",
    "StaleSlotError",
    "array_view",
    "default_max_bytes",
    "forsake",
    "mem_available_bytes",
    "payload",
    "privatize",
    "shm_free_bytes",
    "views",
]
