"""A slab: one shared-memory segment cut into ``nslots`` equal slots of ``slot_size`` bytes.

Invariants:
- ``slot_size`` is a multiple of ``PAGE``; slot ``i`` occupies bytes
  ``[i * slot_size, (i + 1) * slot_size)`` of the segment; ``size == slot_size * nslots``.
- A slab pickles as its :class:`SlabSpec` (a few integers); a process attaches on unpickling.
- The slab holds no slot state: who may write which slot is the allocator's business.
"""

from __future__ import annotations

from dataclasses import dataclass

from arena._layout import PAGE
from arena.segment import Backend, Segment, SegmentSpec


@dataclass(frozen=True)
class SlabSpec:
    """Enough to attach a slab from any process."""

    slab_id: int
    slot_size: int
    nslots: int
    segment: SegmentSpec


class Slab:
    """A mapped slab. Owner side: :meth:`create`; any other process: :meth:`attach`."""

    def __init__(self, slab_id: int, slot_size: int, nslots: int, segment: Segment) -> None:
        if slot_size % PAGE or nslots <= 0 or segment.size != slot_size * nslots:
            raise ValueError(
                f"bad slab geometry: slot_size={slot_size} nslots={nslots} "
                f"segment={segment.size} page={PAGE}"
            )
        self.slab_id = slab_id
        self.slot_size = slot_size
        self.nslots = nslots
        self.segment = segment

    @classmethod
    def create(
        cls,
        slab_id: int,
        slot_size: int,
        nslots: int,
        backend: Backend | str = Backend.AUTO,
        purpose: str | None = None,
    ) -> Slab:
        """Reserve and pre-fault a new slab owned by this process. ``purpose`` says what it is
        for when there is no descriptor to spare for it (default: another arena slab; see
        :meth:`Segment.create`)."""
        segment = Segment.create(slot_size * nslots, backend, purpose)
        return cls(slab_id, slot_size, nslots, segment)

    @classmethod
    def attach(cls, spec: SlabSpec, populate: bool = True) -> Slab:
        """Map an existing slab (created by another process, or by this one); without
        ``populate``, fault in each slot before use (:meth:`populate_slot`): the owner may have
        hollowed some (:meth:`arena.Arena.hollow`)."""
        segment = Segment.attach(spec.segment, populate)
        return cls(spec.slab_id, spec.slot_size, spec.nslots, segment)

    def populate_slot(self, slot: int) -> None:
        """Fault one slot in for writing (a slot handed out is never hollow)."""
        self.segment.populate(self.slot_offset(slot), self.slot_size)

    @property
    def spec(self) -> SlabSpec:
        return SlabSpec(self.slab_id, self.slot_size, self.nslots, self.segment.spec)

    @property
    def size(self) -> int:
        return self.segment.size

    @property
    def backend(self) -> Backend:
        return self.segment.backend

    def slot_offset(self, slot: int) -> int:
        """Byte offset of ``slot`` inside the segment."""
        if not 0 <= slot < self.nslots:
            raise IndexError(f"slot {slot} out of range for slab {self.slab_id} ({self.nslots})")
        return slot * self.slot_size

    def slot_buffer(self, slot: int) -> memoryview:
        """A writable memoryview of exactly one slot (no copy)."""
        start = self.slot_offset(slot)
        return self.segment.buffer[start : start + self.slot_size]

    def close(self) -> None:
        """Close this process's mapping (idempotent; live views keep the memory valid)."""
        self.segment.close()

    def __reduce__(self) -> tuple[object, tuple[SlabSpec]]:
        return (Slab.attach, (self.spec,))

    def __repr__(self) -> str:
        return (
            f"Slab(id={self.slab_id}, slots={self.nslots}x{self.slot_size:,}, "
            f"backend={self.backend.value})"
        )
