"""The arena's statistics record: a frozen snapshot, cheap to take every training step.

Invariants: ``bytes_reserved == sum(bytes_by_state.values())`` and
``slots_total == sum(slots_by_state.values())``; ``slots_hollow <= slots_by_state["free"]``;
``high_water_bytes`` is the most bytes ever held outside the FREE state at once, and never
decreases.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class ArenaStats:
    """Where the arena's bytes are, right now."""

    backend: str
    bytes_reserved: int
    max_bytes: int
    bytes_by_state: Mapping[str, int]
    slots_by_state: Mapping[str, int]
    slots_total: int
    slot_sizes: tuple[int, ...]
    high_water_bytes: int
    growth_events: int
    slabs: int
    slots_hollow: int = 0  # FREE slots whose memory went back to the system (not reserved)

    @property
    def slots_free(self) -> int:
        return self.slots_by_state.get("free", 0)

    @property
    def bytes_in_use(self) -> int:
        """Bytes in slots that are not FREE (being written, ready, or lent to the user)."""
        return self.bytes_reserved - self.bytes_by_state.get("free", 0)
