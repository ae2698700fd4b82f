"""The loader's statistics record: the arena snapshot plus what only the loader knows.

Invariant: all fields describe one moment; taking a snapshot costs a few microseconds (counters
are kept incrementally), so it can be read every training step.
"""

from __future__ import annotations

from dataclasses import dataclass

from arena import Arena, ArenaStats
from shmloader.lease import Leases
from shmloader.pin import Pinner


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


class Monitor:
    """What a loader keeps of its newest iterator to answer ``stats()``: the arena's bookkeeping,
    the lease table and the pinner, never the iterator itself (so dropping the iterator still
    shuts its workers down)."""

    def __init__(self, arena: Arena, leases: Leases, pinner: Pinner, pids: list[int]) -> None:
        self.arena = arena
        self.leases = leases
        self.pinner = pinner
        self.pids = tuple(pids)

    def snapshot(self) -> LoaderStats:
        return LoaderStats(
            self.arena.stats(), self.leases.held, self.pinner.pinned_bytes, self.pids
        )
