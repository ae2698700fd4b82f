"""Bump allocation inside one slot: where the next array (and finally the payload) goes.

Invariants: ``0 <= used <= capacity``; every offset handed out is a multiple of ``ALIGN``;
a request that does not fit returns ``None`` and changes nothing (the caller decides what to do
with an oversized batch).
"""

from __future__ import annotations

from arena._layout import ALIGN, align_up


class SlotWriter:
    """Hands out aligned, non-overlapping byte ranges of a slot of ``capacity`` bytes."""

    __slots__ = ("capacity", "used")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a fresh ``nbytes`` range, or ``None`` if the slot is full."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        start = align_up(self.used, ALIGN)
        end = start + nbytes
        if end > self.capacity:
            return None
        self.used = end
        return start

    @staticmethod
    def size_of(sizes: list[int]) -> int:
        """Bytes a slot needs to hold ranges of ``sizes`` laid out by :meth:`alloc` in order."""
        used = 0
        for n in sizes:
            used = align_up(used, ALIGN) + n
        return used
