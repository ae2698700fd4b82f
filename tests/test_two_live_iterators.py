"""Two live iterators of one loader share its arena: room made at the cap is made for both.

Review 10 found that each iterator made room only among its own tasks: with another live
iterator's prefetched batches finished in their slots, the batch needed next raised
``ArenaExhaustedError`` while the user held room for it; and a slab one iterator gave back at
the cap stayed mapped (and allocated) by the other iterator's workers, above the cap that
``stats()`` reported.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
import torch

import shmloader
from arena import ArenaExhaustedError
from shmloader.lease import Leases
from tests.lifetime_checks import frees_its_loaders_on_failure
from tests.test_at_the_cap import LOADER_TIMEOUT_S, LateBatch, expected

SLOT = 16384  # a batch of 4 rows of 1,000 float32 values and its labels fits one page-aligned slot


@frees_its_loaders_on_failure
def test_the_batch_needed_next_spills_another_live_iterators_finished_batches():
    # Batch 0 of the first iterator starts only once worker 1 fetches its third batch (5), so
    # batches 1 and 3 are finished (and handled) when batch 0 arrives. The second iterator then
    # has one free slot of the cap's eight: its second batch needs a slot those batches hold.
    data = LateBatch(4 * 20, batch_size=4, width=1000)
    loader = shmloader.DataLoader(
        data, batch_size=4, num_workers=2, prefetch_factor=3, arena_max_bytes=8 * SLOT,
        arena_slots_per_slab=8, timeout=LOADER_TIMEOUT_S,
    )  # fmt: skip
    for _ in loader:  # the batch size is known, and the cap's one slab of eight slots exists
        pass
    assert loader.stats().slots_total == 8
    data.late, data.after = 0, 4 * 5  # the next iterator's workers wait as described above
    first = iter(loader)
    kept_first = [next(first)]  # batch 0
    second = iter(loader)
    held = next(second)  # kept to the end: the user holds one batch of the cap's eight
    spilled = 0
    for k in range(1, 20):  # before the fix: ArenaExhaustedError at the first of these
        x, y = next(second)
        assert all(map(torch.equal, (x, y), expected(data, k))), f"batch {k} is wrong"
        spilled = max(spilled, loader.stats().batches_spilled)
        del x, y
    assert spilled >= 1, "no batch of the first iterator was spilled: the scenario did not happen"
    assert all(map(torch.equal, held, expected(data, 0)))
    del held
    # The first iterator's spilled batches come back from their copies, in order.
    for k, (x, y) in enumerate(first, start=1):
        assert all(map(torch.equal, (x, y), expected(data, k))), f"first iterator's {k} is wrong"
    assert k == 19 and all(map(torch.equal, kept_first[0], expected(data, 0)))
    assert not data.waited_out.is_set(), "the forced ordering did not happen"


def _shm_inodes(pid: int) -> set[str]:
    """Inodes of the shared-memory files (``/dev/shm``, memfd) that process ``pid`` maps."""
    with open(f"/proc/{pid}/maps") as maps:
        rows = [row.split() for row in maps]
    return {r[4] for r in rows if len(r) > 5 and ("/dev/shm/" in r[5] or "memfd:" in r[5])}


class Rows(torch.utils.data.Dataset[torch.Tensor]):
    def __init__(self, width: int) -> None:
        self.width = width

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((self.width,), i, dtype=torch.uint8)


@frees_its_loaders_on_failure
def test_a_slab_given_back_is_unmapped_by_every_live_iterators_workers():
    big = 266240  # the slot of a batch of 4 rows of 64 KiB
    data = Rows(16 << 10)
    loader = shmloader.DataLoader(data, batch_size=4, num_workers=2, arena_max_bytes=4 * big)
    idle = iter(loader)
    idle_workers = loader.stats().worker_pids
    for _ in range(4):
        next(idle)  # every batch consumed, StopIteration never asked for: it stays live
    small = loader.stats().slot_sizes
    data.width = 64 << 10  # the next iterator's workers make batches four times as big
    busy = iter(loader)
    held = [next(busy) for _ in range(3)]  # three big slots and the next: the small slab must go
    assert loader.stats().slot_sizes != small, "the small slab was not given back"
    main = _shm_inodes(os.getpid())
    deadline = time.monotonic() + LOADER_TIMEOUT_S
    # A worker unmaps a slab when it reads the DETACH: wait for that (its /proc maps say so).
    while any(_shm_inodes(pid) - main for pid in idle_workers) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not [_shm_inodes(pid) - main for pid in idle_workers if _shm_inodes(pid) - main], (
        "the idle iterator's workers still map a slab the arena gave back"
    )
    assert [int(b[0, 0]) for b in held] == [0, 4, 8]
    del held, idle, busy


def _late_first_iterator() -> tuple[LateBatch, Any, Any, list[Any]]:
    """The first test's scene: the first iterator has finished batches in slots, and the
    second iterator's next batches need their room."""
    data = LateBatch(4 * 20, batch_size=4, width=1000)
    loader = shmloader.DataLoader(
        data, batch_size=4, num_workers=2, prefetch_factor=3, arena_max_bytes=8 * SLOT,
        arena_slots_per_slab=8, timeout=LOADER_TIMEOUT_S,
    )  # fmt: skip
    for _ in loader:
        pass
    data.late, data.after = 0, 4 * 5
    first = iter(loader)
    kept_first = [next(first)]
    return data, loader, first, kept_first


@frees_its_loaders_on_failure
def test_another_iterators_batches_are_spilled_only_under_its_lock(monkeypatch: Any) -> None:
    """Review 12: a thread at the cap spilled the finished batches of an iterator another
    thread was lending from at that moment; the slot of a batch that thread then held was
    freed, and rewritten (or its lend raised ``StaleSlotError``)."""
    data, loader, first, kept_first = _late_first_iterator()
    locked: list[bool] = []
    spill = Leases.spill

    def watched(self: Leases, ready: Any) -> Any:
        locked.append(first._lock._is_owned())  # type: ignore[attr-defined]
        return spill(self, ready)

    monkeypatch.setattr(Leases, "spill", watched)
    second = iter(loader)
    held = next(second)
    for k in range(1, 20):
        x, y = next(second)
        assert all(map(torch.equal, (x, y), expected(data, k))), f"batch {k} is wrong"
        del x, y
    assert locked, "no batch of the first iterator was spilled: the scene did not happen"
    assert all(locked), "the first iterator's batches were spilled without its lock"
    assert all(map(torch.equal, held, expected(data, 0)))
    for k, (x, y) in enumerate(first, start=1):
        assert all(map(torch.equal, (x, y), expected(data, k))), f"first iterator's {k} is wrong"
    assert all(map(torch.equal, kept_first[0], expected(data, 0)))


@frees_its_loaders_on_failure
def test_an_iterator_another_thread_is_inside_keeps_its_finished_batches() -> None:
    data, loader, first, kept_first = _late_first_iterator()
    inside, leave = threading.Event(), threading.Event()

    def other_thread() -> None:
        with first._lock:  # as while that thread runs next(first)
            inside.set()
            leave.wait(LOADER_TIMEOUT_S)

    t = threading.Thread(target=other_thread)
    t.start()
    try:
        assert inside.wait(LOADER_TIMEOUT_S)
        second = iter(loader)
        held = next(second)
        with pytest.raises(ArenaExhaustedError, match="another live iterator of this loader"):
            for _ in range(1, 20):
                next(second)  # before: the first iterator's finished batches were spilled
        assert loader.stats().batches_spilled == 0
    finally:
        leave.set()
        t.join()
    assert all(map(torch.equal, held, expected(data, 0)))
    del held, second
    for k, (x, y) in enumerate(first, start=1):
        assert all(map(torch.equal, (x, y), expected(data, k))), f"first iterator's {k} is wrong"
    assert all(map(torch.equal, kept_first[0], expected(data, 0)))
