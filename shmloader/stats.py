"""The loader's statistics record: the arena snapshot plus what only the loader knows.

Invariant: all fields describe one moment; taking a snapshot costs a few microseconds (counters
are kept incrementally), so it can be read every training step.
"""

from __future__ import annotations

from dataclasses import dataclass

from arena import ArenaStats


@dataclass(frozen=True)
class LoaderStats:
    """Where a loader's bytes are. ``arena`` is None before the first multi-worker epoch."""

    arena: ArenaStats | None
    batches_held: int
    pinned_bytes: int
    worker_pids: tuple[int, ...]

    @property
    def bytes_reserved(self) -> int:
        return 0 if self.arena is None else self.arena.bytes_reserved

    @property
    def bytes_in_use(self) -> int:
        return 0 if self.arena is None else self.arena.bytes_in_use

    @property
    def slots_total(self) -> int:
        return 0 if self.arena is None else self.arena.slots_total

    @property
    def slots_free(self) -> int:
        return 0 if self.arena is None else self.arena.slots_free

    @property
    def high_water_bytes(self) -> int:
        return 0 if self.arena is None else self.arena.high_water_bytes

    def as_row(self) -> dict[str, int | str]:
        """One flat row (for CSV and JSON lines): every arena field, slots and bytes per state,
        batches held and pinned bytes. Empty before the first multi-worker epoch."""
        a = self.arena
        if a is None:
            return {}
        row: dict[str, int | str] = {
            "backend": a.backend,
            "bytes_reserved": a.bytes_reserved,
            "bytes_in_use": a.bytes_in_use,
            "max_bytes": a.max_bytes,
            "high_water_bytes": a.high_water_bytes,
            "growth_events": a.growth_events,
            "slabs": a.slabs,
            "slots_total": a.slots_total,
            "slot_sizes": " ".join(str(s) for s in a.slot_sizes),
        }
        for state, n in a.slots_by_state.items():
            row[f"slots_{state}"] = n
        for state, n in a.bytes_by_state.items():
            row[f"bytes_{state}"] = n
        row["batches_held"] = self.batches_held
        row["pinned_bytes"] = self.pinned_bytes
        return row
