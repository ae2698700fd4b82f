"""The loader's statistics record: the arena snapshot plus what only the loader knows.

``DataLoader.stats()`` returns a :class:`LoaderStats` at every moment of a loader's life: before
its first iteration, with ``num_workers=0`` (which never makes an arena) and after its workers
are gone. Every arena field is also readable on the record itself (``stats().backend``).

Invariants:
- All fields describe one moment; taking a snapshot costs a few microseconds (counters are kept
  incrementally), so it can be read every training step.
- ``arena`` is never None. Before the loader has an arena it is :func:`no_arena`'s record:
  ``backend == "none"``, nothing reserved, every slot and byte count 0, ``max_bytes`` the cap an
  arena would get (0 with ``num_workers=0``).
- The arena's invariants carry over: ``bytes_reserved == sum(bytes_by_state.values())``,
  ``slots_total == sum(slots_by_state.values())``, ``high_water_bytes`` never decreases.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch.distributed as dist

from arena import ArenaStats, SlotState

_STATE_NAMES = tuple(s.name.lower() for s in SlotState)


@dataclass(frozen=True)
class LoaderStats:
    """Where a loader's bytes are, right now.

    Fields:
    - ``arena``: the arena's own record (:class:`arena.ArenaStats`); its fields are also
      properties of this record, listed below.
    - ``batches_held``: batches yielded to the user whose views are still alive, in arena slots
      (a spilled batch the user holds is counted in ``batches_spilled``).
    - ``pinned_bytes``: arena bytes page-locked for CUDA (0 without ``pin_memory`` or a GPU).
    - ``worker_pids``: process ids of the most recent multi-worker iterator's workers (they may
      have exited since; empty before the first one).
    - ``rank``, ``world_size``: the ``torch.distributed`` rank of the process the loader lives in
      and the job's world size (0 and 1 outside a process group). The arena, and its
      ``arena_max_bytes`` cap, is per rank.
    - ``slots_kept``, ``bytes_kept``: lent slots whose batch you dropped, kept from reuse until
      the shmloader workers forked while you held it exit (they may still read it:
      :mod:`shmloader.afterfork`); they do not count against the cap. Dropped before those
      workers exit, the loader leaves those slots' memory with them until they do, counted by
      no loader.
    - ``batches_spilled``, ``bytes_spilled``: finished batches copied out of the arena into the
      main process's own memory, alive now (waiting their turn, or held by you). At the cap, when
      the batch needed next finds every slot taken by batches after it, those are copied out
      rather than fail the loop; outside the arena, they do not count against its cap.
    - ``bytes_rng_rings``: shared memory (memfd) of the RNG snapshot rings of the loader's live
      multi-worker iterators, where workers publish their generators' states for
      ``state_dict()`` (:mod:`shmloader.rngstate`): ``num_workers * (prefetch_factor + 4)``
      entries of 12 KiB each per iterator (more behind a ``DevicePrefetcher``); outside the
      arena and its cap.
    - ``batches_retired``, ``bytes_retired``: batches you still hold from an arena the loader
      retired after an interruption landed inside its books, or when ``pin_memory`` changed
      between iterators (:mod:`shmloader.interrupts`; the next iterator got a fresh arena),
      and the shared memory retired arenas still hold: a whole arena, with its iterators' RNG
      rings, while an iterator of it lives (a saved traceback can keep one:
      ``sys.last_traceback`` in IPython), then the slots held when it closed, in each slab a
      view you hold keeps mapped (a batch's, or one's you released early), gone with the slab's
      last view; a slab the GPU had not passed copies from at close stays page-locked, whole,
      until the process exits. Outside the current arena and its cap.

    Arena properties:
    - ``backend``: ``"posix"``, ``"memfd"``, both joined by ``+`` when slabs differ, or
      ``"none"`` before the first slab.
    - ``max_bytes``: the cap on reserved bytes (``arena_max_bytes``, or half the available RAM).
    - ``bytes_reserved``: shared memory held by the arena's slabs, in every state.
    - ``bytes_in_use``: reserved bytes in slots that are not free (writing, ready or lent).
    - ``bytes_by_state`` / ``slots_by_state``: bytes and slots per slot state (``free``,
      ``writing``: a worker collates into it, ``ready``: written, waiting its turn, ``lent``:
      views of it are out with the user; or its batch is gone but it is kept (``slots_kept``);
      or, in a page-locked arena, a GPU copy queued from it may not have run yet:
      :mod:`shmloader.fence`).
    - ``slots_total``, ``slots_free``: slots in all slabs, and those free.
    - ``slot_sizes``: the slot size classes in bytes, ascending.
    - ``high_water_bytes``: the most bytes ever in use at once.
    - ``growth_events``: how many times a slab was added; ``slabs``: how many exist.
    - ``slots_hollow``: free slots whose memory went back to the system, at the cap or once
      batches shrank to a quarter of their size or less (counted in ``slots_free``, not in
      ``bytes_reserved``; :meth:`arena.Arena.hollow`).
    """

    arena: ArenaStats
    batches_held: int
    pinned_bytes: int
    worker_pids: tuple[int, ...]
    rank: int = 0
    world_size: int = 1
    slots_kept: int = 0
    bytes_kept: int = 0
    batches_spilled: int = 0
    bytes_spilled: int = 0
    bytes_rng_rings: int = 0
    batches_retired: int = 0
    bytes_retired: int = 0

    @property
    def backend(self) -> str:
        return self.arena.backend

    @property
    def max_bytes(self) -> int:
        return self.arena.max_bytes

    @property
    def bytes_reserved(self) -> int:
        return self.arena.bytes_reserved

    @property
    def bytes_in_use(self) -> int:
        return self.arena.bytes_in_use

    @property
    def bytes_by_state(self) -> Mapping[str, int]:
        return self.arena.bytes_by_state

    @property
    def slots_by_state(self) -> Mapping[str, int]:
        return self.arena.slots_by_state

    @property
    def slots_total(self) -> int:
        return self.arena.slots_total

    @property
    def slots_free(self) -> int:
        return self.arena.slots_free

    @property
    def slot_sizes(self) -> tuple[int, ...]:
        return self.arena.slot_sizes

    @property
    def high_water_bytes(self) -> int:
        return self.arena.high_water_bytes

    @property
    def growth_events(self) -> int:
        return self.arena.growth_events

    @property
    def slabs(self) -> int:
        return self.arena.slabs

    @property
    def slots_hollow(self) -> int:
        return self.arena.slots_hollow

    def as_row(self) -> dict[str, int | str]:
        """One flat row (for CSV and JSON lines): every arena field, slots and bytes per state,
        batches held and pinned bytes."""
        a = self.arena
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
            "slots_hollow": a.slots_hollow,
        }
        for state, n in a.slots_by_state.items():
            row[f"slots_{state}"] = n
        for state, n in a.bytes_by_state.items():
            row[f"bytes_{state}"] = n
        row["batches_held"] = self.batches_held
        row["pinned_bytes"] = self.pinned_bytes
        row["rank"] = self.rank
        row["world_size"] = self.world_size
        row["slots_kept"] = self.slots_kept
        row["bytes_kept"] = self.bytes_kept
        row["batches_spilled"] = self.batches_spilled
        row["bytes_spilled"] = self.bytes_spilled
        row["bytes_rng_rings"] = self.bytes_rng_rings
        row["batches_retired"] = self.batches_retired
        row["bytes_retired"] = self.bytes_retired
        return row


def dist_rank() -> tuple[int, int]:
    """(rank, world size) of this process's default ``torch.distributed`` group, else (0, 1)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@functools.lru_cache(maxsize=16)
def no_arena(max_bytes: int) -> LoaderStats:
    """The record of a loader without an arena (yet): nothing reserved, held, pinned or running;
    ``max_bytes`` is the cap an arena would get (0 when none will be made). Cached (the record
    is frozen and its mappings read-only), so asking costs no more than a real snapshot."""
    zeros = MappingProxyType(dict.fromkeys(_STATE_NAMES, 0))
    arena = ArenaStats(
        backend="none",
        bytes_reserved=0,
        max_bytes=max_bytes,
        bytes_by_state=zeros,
        slots_by_state=zeros,
        slots_total=0,
        slot_sizes=(),
        high_water_bytes=0,
        growth_events=0,
        slabs=0,
    )
    return LoaderStats(arena, 0, 0, ())
