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
