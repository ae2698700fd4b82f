"""At the arena's cap, the batch needed next always moves unless the user holds the room.

Review 8 found plain loops that hold nothing failing with ``ArenaExhaustedError``: later batches
(finished, or being written) held every slot under the cap, or sat in a slab of another size the
arena could not give back, and the batch needed next could never get one. Now the dispatcher
takes that room back: it copies finished later batches out of their slots (*spills* them, counted
in ``stats().batches_spilled``), waits for later batches being written, and gives idle slabs
back. These tests force the orderings (a worker's first batch waits, across processes, for
another worker's later ones) and check every batch, spilled or not, against the dataset and
torch's DataLoader, held across later batches.
"""

from __future__ import annotations

import collections
import gc
import multiprocessing as mp
import os
from typing import Any

import pytest
import torch

import shmloader
from arena import ArenaExhaustedError
from tests.lifetime_checks import frees_its_loaders_on_failure

LOADER_TIMEOUT_S = 20  # every loader's timeout=: a worker waiting forever fails the test
WAIT_S = 20.0  # the longest a forced wait lasts; a wait that times out fails the test


class LateBatch(torch.utils.data.Dataset[Any]):
    """Sample ``i``: a row filled with ``i`` (``width`` float32 values, or ``wide`` for the
    batches in ``wide_batches``) and its label. Sample ``late`` (the first of a batch) waits
    until sample ``after`` (the first of a later batch of the other worker) is fetched, so the
    worker of the first asks for its slot after the other worker's later batches took theirs."""

    def __init__(
        self,
        n: int,
        batch_size: int,
        width: int,
        late: int = -1,
        after: int = -1,
        wide: int = 0,
        wide_batches: frozenset[int] = frozenset(),
    ) -> None:
        self.n, self.batch_size, self.width = n, batch_size, width
        self.late, self.after = late, after
        self.wide, self.wide_batches = wide, wide_batches
        # Events only: a shared Value would leave this process a /dev/shm heap file for good.
        self.go = mp.get_context("fork").Event()
        self.waited_out = mp.get_context("fork").Event()

    def __len__(self) -> int:
        return self.n

    def width_of(self, i: int) -> int:
        return self.wide if i // self.batch_size in self.wide_batches else self.width

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if i == self.late and not self.go.wait(WAIT_S):
            self.waited_out.set()
        if i == self.after:
            self.go.set()
        return torch.full((self.width_of(i),), float(i)), i


def expected(data: LateBatch, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    b = data.batch_size
    rows = [torch.full((data.width_of(i),), float(i)) for i in range(k * b, k * b + b)]
    return torch.stack(rows), torch.arange(k * b, k * b + b)


def run(loader: shmloader.DataLoader, data: LateBatch) -> list[int]:
    """Iterate holding nothing but the spilled batches (a batch that holds no slot: releasing
    it returns 0; the others are released at once); check each batch as it comes and every
    kept one after the epoch. Returns the indices of the spilled batches."""
    kept = []
    it = iter(loader)
    for k in range(len(data) // data.batch_size):
        x, y = next(it)
        want_x, want_y = expected(data, k)
        assert torch.equal(x, want_x) and torch.equal(y, want_y), f"batch {k} is wrong"
        if shmloader.release((x, y), loader) == 0:
            kept.append((k, x, y))
        del x, y
    with pytest.raises(StopIteration):
        next(it)
    for k, x, y in kept:  # a spilled batch is a copy: later batches never touch it
        want_x, want_y = expected(data, k)
        assert torch.equal(x, want_x) and torch.equal(y, want_y), f"kept batch {k} changed"
    assert loader.stats().batches_spilled == len(kept)
    assert not data.waited_out.is_set(), "the forced ordering did not happen"
    return [k for k, _, _ in kept]


@frees_its_loaders_on_failure
def test_later_batches_holding_every_slot_are_spilled_for_the_batch_needed_next():
    # 16,000-byte batches; a slot is 16 KiB and the cap 4 slots. Batch 2 (worker 0) starts only
    # once worker 1 fetches batch 11, so batches 3, 5, 7 and 9 hold every slot when batch 2
    # asks for one: before the fix that raised ArenaExhaustedError with nothing held.
    data = LateBatch(4 * 40, batch_size=4, width=1000, late=4 * 2, after=4 * 11)
    loader = shmloader.DataLoader(
        data,
        batch_size=4,
        num_workers=2,
        prefetch_factor=64,
        arena_max_bytes=4 * 16384,
        timeout=LOADER_TIMEOUT_S,
    )
    spilled = run(loader, data)
    assert spilled, "no batch was spilled: the scenario did not happen"
    st = loader.stats()
    assert st.bytes_reserved <= st.max_bytes
    assert st.batches_spilled == st.bytes_spilled == 0  # the copies went with the batches


@frees_its_loaders_on_failure
def test_a_bigger_batch_gets_room_from_later_batches_in_a_slab_of_another_size():
    # 100 KB batches and one 600 KB batch (batch 9) under a 1 MiB cap, holding nothing: when
    # the big one asks, the small class's slab (512,000 bytes) holds later batches, and the two
    # classes cannot both fit. The small slab must be emptied (later batches spilled or waited
    # for) and given back.
    data = LateBatch(4 * 20, batch_size=4, width=6250, wide=37500, wide_batches=frozenset({9}))
    loader = shmloader.DataLoader(
        data, batch_size=4, num_workers=2, arena_max_bytes=1 << 20, timeout=LOADER_TIMEOUT_S
    )
    run(loader, data)
    assert loader.stats().bytes_reserved <= 1 << 20


@frees_its_loaders_on_failure
def test_spilled_batches_match_torchs_dataloader_bit_for_bit():
    order = list(
        torch.utils.data.BatchSampler(
            torch.utils.data.RandomSampler(range(96), generator=torch.Generator().manual_seed(5)),
            4,
            False,
        )
    )
    data = LateBatch(96, batch_size=4, width=1000, late=order[2][0], after=order[11][0])
    loader = shmloader.DataLoader(
        data,
        batch_size=4,
        shuffle=True,
        generator=torch.Generator().manual_seed(5),
        num_workers=2,
        prefetch_factor=64,
        arena_max_bytes=4 * 16384,
        timeout=LOADER_TIMEOUT_S,
    )
    ours = [(x.clone(), y.clone()) for x, y in loader]  # held past the cap: copies
    ref = torch.utils.data.DataLoader(
        LateBatch(96, batch_size=4, width=1000),
        batch_size=4,
        shuffle=True,
        generator=torch.Generator().manual_seed(5),
    )
    theirs = list(ref)
    assert len(ours) == len(theirs) == 24
    for k, ((x, y), (tx, ty)) in enumerate(zip(ours, theirs, strict=True)):
        assert torch.equal(x, tx) and torch.equal(y, ty), k
    assert not data.waited_out.is_set(), "the forced ordering did not happen"


def small_then_big() -> tuple[LateBatch, shmloader.DataLoader, Any, Any]:
    """Batches of 100,000 bytes in slots of 102,400 (5 to a slab: 512,000 bytes), and batch 4
    of 600,000 bytes (602,112) under a 1 MiB cap: beside the whole small slab it cannot fit.
    The dataset, the loader, its iterator and the first batch (which the caller holds)."""
    data = LateBatch(4 * 8, batch_size=4, width=6250, wide=37500, wide_batches=frozenset({4}))
    loader = shmloader.DataLoader(
        data,
        batch_size=4,
        num_workers=1,
        arena_max_bytes=1 << 20,
        arena_slots_per_slab=5,
        timeout=LOADER_TIMEOUT_S,
    )
    it = iter(loader)
    return data, loader, it, next(it)


@frees_its_loaders_on_failure
def test_free_slots_beside_a_held_batch_are_hollowed_to_make_room_at_the_cap():
    # The user keeps the first small batch, so its slab cannot be given back; its four free
    # slots are hollowed instead (their memory goes back and leaves the cap's count), and the
    # big batch fits: 102,400 + 602,112 bytes are held, under the cap.
    data, loader, it, first = small_then_big()
    hollow = 0
    for k in range(1, 8):
        x, y = next(it)  # the loop's previous batch is dropped as the next one comes
        want_x, want_y = expected(data, k)
        assert torch.equal(x, want_x) and torch.equal(y, want_y), k
        st = loader.stats()
        assert st.bytes_reserved <= st.max_bytes, st
        assert st.bytes_reserved == sum(st.bytes_by_state.values()), st
        hollow = max(hollow, st.arena.slots_hollow)
    assert hollow > 0, "no slot was hollowed: the scenario did not happen"
    assert torch.equal(first[0], expected(data, 0)[0]), "the held batch changed"


@frees_its_loaders_on_failure
def test_the_error_at_the_cap_names_free_slots_it_cannot_hollow():
    # Page-locked slabs are never hollowed (the GPU may read any of their pages): then the
    # free slots beside the held batch stay, and the error says so with their numbers.
    data, loader, it, first = small_then_big()
    loader._host.arena.can_hollow = lambda slab_id: False  # as for page-locked slabs
    with pytest.raises(ArenaExhaustedError) as err:
        while True:
            next(it)
    message = str(err.value)
    st = loader.stats()
    free = st.slots_by_state["free"]
    assert free > 0 and st.arena.slots_hollow == 0, st  # none hollow: all free slots count
    assert "the user holds 1 batches (102,400 bytes)" in message, message
    assert f"its {free} free slots ({st.bytes_by_state['free']:,} bytes) are too small" in message
    assert torch.equal(first[0], expected(data, 0)[0])


def allocated(loader: shmloader.DataLoader) -> int:
    """Bytes the loader's slabs really hold (their files' allocated blocks)."""
    arena = loader._host.arena
    return sum(os.fstat(s.segment._fd).st_blocks * 512 for s in arena.slabs())


@frees_its_loaders_on_failure
def test_the_arena_is_back_under_its_cap_once_kept_slots_return_and_holds_what_it_reports():
    # A loop that keeps its last 10 batches across epochs: each epoch's fresh workers are forked
    # while those are held, so they are kept, and the arena may pass its cap by their bytes
    # meanwhile (review 8b: it stayed 1.6x over the cap for good, and new workers' pre-faulting
    # filled slots the books said were empty).
    data = torch.utils.data.TensorDataset(torch.zeros(64, 16 * 1024, dtype=torch.uint8))
    loader = shmloader.DataLoader(
        data, batch_size=4, num_workers=2, arena_max_bytes=16 * 65536, timeout=LOADER_TIMEOUT_S
    )
    keep: collections.deque[torch.Tensor] = collections.deque(maxlen=10)
    for _epoch in range(3):
        for (x,) in loader:
            keep.append(x)
        st = loader.stats()
        assert st.bytes_reserved <= st.max_bytes + st.bytes_kept, st
        assert allocated(loader) == st.bytes_reserved, st
    del x
    keep.clear()
    st = loader.stats()
    assert st.batches_held == st.slots_kept == 0, st
    assert st.bytes_reserved <= st.max_bytes, st
    assert allocated(loader) == st.bytes_reserved, st


@frees_its_loaders_on_failure
def test_a_dropped_loader_keeps_only_the_memory_of_the_batch_still_held():
    # A held batch keeps its slab mapped after the loader is gone (and any process forked
    # meanwhile maps all of it): only that batch's slot may still hold memory (review 8b: the
    # whole slab did, invisible to every live loader's stats()).
    data = torch.utils.data.TensorDataset(torch.zeros(40, 16 * 1024, dtype=torch.uint8))
    loader = shmloader.DataLoader(data, batch_size=4, num_workers=2, timeout=LOADER_TIMEOUT_S)
    batches = [x for (x,) in loader]
    held = batches[3]
    del batches
    assert loader.stats().batches_held == 1  # (a drain: the leases of the others are gone)
    arena = loader._host.arena
    lease = loader._host.leases.live()
    assert len(lease) == 1
    slab = arena.slab(lease[0].slot.slab_id)
    assert slab.nslots > 1
    fd, slot_size = os.dup(slab.segment._fd), slab.slot_size
    try:
        del lease, slab, arena, loader
        gc.collect()
        assert os.fstat(fd).st_blocks * 512 == slot_size  # one slot: the held batch's
        assert torch.equal(held, torch.zeros(4, 16 * 1024, dtype=torch.uint8))
    finally:
        os.close(fd)


class Outgrowing(torch.utils.data.Dataset[Any]):
    """Sample ``i``: ``(i, width)``; batch 3 carries a wide second leaf and outgrows its slot."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> tuple[int, int]:
        return i, (2500 if 12 <= i < 16 else 10)


def transposed_collate(samples: list[tuple[int, int]]) -> tuple[torch.Tensor, ...]:
    """Writes into the slot (``shmloader.empty``) and returns a transposed view of it: a leaf
    that views the slot but cannot be placed where it lies (it is not contiguous)."""
    n, wide = len(samples), max(w for _, w in samples)
    a = shmloader.empty((n, 1000), dtype=torch.int32)
    for r, (i, _) in enumerate(samples):
        a[r] = torch.arange(1000, dtype=torch.int32) + i * 1000
    b = shmloader.empty((n, wide), dtype=torch.int32)
    b.fill_(7)
    return a.t(), b, torch.tensor([i for i, _ in samples])


@frees_its_loaders_on_failure
def test_a_batch_that_outgrows_its_slot_takes_every_leaf_that_viewed_it_along():
    # The worker copies the batch out of its slot before asking for a bigger one, and the main
    # process frees (at the cap: hollows) the old slot at once. A leaf that views the slot
    # without having been placed in it was left behind (review 9): batch 3 arrived all zeros.
    loader = shmloader.DataLoader(
        Outgrowing(), batch_size=4, num_workers=1, collate_fn=transposed_collate,
        arena_max_bytes=80 * 1024, timeout=LOADER_TIMEOUT_S,
    )  # fmt: skip
    for k, (at, b, idx) in enumerate(loader):
        want = torch.arange(1000, dtype=torch.int32)[None, :] + idx[:, None] * 1000
        assert torch.equal(at.t(), want), f"batch {k}: {at.t()[0, :4].tolist()}"
        assert bool((b == 7).all()), k


@frees_its_loaders_on_failure
def test_room_freed_by_spills_goes_to_a_batch_of_a_new_size():
    # Batch 1 is bigger (a new size class) and starts only once batch 5 is being fetched, so the
    # finished batches after it fill the arena; the slots their spills free are too small and
    # must give their memory back for batch 1's class to fit (review 9: it raised, holding one).
    order = [[0, 1, 2, 3], list(range(100, 116)), *[list(range(i, i + 4)) for i in (4, 8, 12, 16)]]
    data = LateBatch(200, batch_size=4, width=1000, late=100, after=16)
    loader = shmloader.DataLoader(
        data, batch_sampler=order, num_workers=3, arena_max_bytes=6 * 16384,
        timeout=LOADER_TIMEOUT_S,
    )  # fmt: skip
    got = []
    for x, y in loader:  # the loop variable holds the previous batch
        assert y.tolist() == order[len(got)]
        assert torch.equal(x, torch.stack([torch.full((1000,), float(i)) for i in y.tolist()]))
        got.append(loader.stats().batches_spilled)
    assert len(got) == len(order)
    assert max(got) > 0, "nothing was spilled: the scenario did not happen"
    assert not data.waited_out.is_set(), "the forced ordering did not happen"


class SlowThird(torch.utils.data.Dataset[torch.Tensor]):
    """Sample 2 is three times as big as the others; sample 3 waits for ``go``."""

    def __init__(self, go: Any) -> None:
        self.go = go

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 3:
            assert self.go.wait(LOADER_TIMEOUT_S), "the main process never let sample 3 go"
        return torch.full(((3 if i == 2 else 1) << 20,), i, dtype=torch.uint8)


@frees_its_loaders_on_failure
def test_a_wait_at_the_cap_for_later_batches_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """Review 12: the batch needed next (2), grown past its slot at the cap, waits for a later
    batch (3) still being written, to copy it out once finished; a dataset whose later sample is
    slow held it up silently (and one that waits for the main process, for good), and the
    timeout said nothing of why. Now a wait that lasts ``CAP_WARN_S`` warns, naming the cap."""
    import warnings

    from shmloader import dispatch

    ctx = mp.get_context("fork")
    go = ctx.Event()
    monkeypatch.setattr(dispatch, "CAP_WARN_S", 0.0)
    shown: list[str] = []

    def seen(message: Any, *args: Any, **kwargs: Any) -> None:
        shown.append(str(message))
        go.set()  # the user reads the warning, and lets sample 3 go

    loader = shmloader.DataLoader(
        SlowThird(go), batch_size=1, num_workers=2, prefetch_factor=2, arena_max_bytes=5 << 20,
        multiprocessing_context=ctx, timeout=LOADER_TIMEOUT_S,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        monkeypatch.setattr(warnings, "showwarning", seen)
        got = [int(b[0, 0]) for b in loader]
    assert got == list(range(8))
    assert shown and "is at its cap of 5,242,880 bytes (arena_max_bytes)" in shown[0], shown
    assert "1 later batches still being written" in shown[0]


@frees_its_loaders_on_failure
def test_a_timeout_at_the_cap_names_the_batches_it_waits_for() -> None:
    ctx = mp.get_context("fork")
    go = ctx.Event()  # never set: sample 3 waits until the loader's workers are stopped
    loader = shmloader.DataLoader(
        SlowThird(go), batch_size=1, num_workers=2, prefetch_factor=2, arena_max_bytes=5 << 20,
        multiprocessing_context=ctx, timeout=1.0,
    )  # fmt: skip
    it = iter(loader)
    held = [next(it), next(it)]  # (held: the room at the cap is theirs and batch 3's)
    with pytest.raises(RuntimeError, match=r"timed out after 1\.0 seconds; the batch needed next"):
        next(it)  # before: only "timed out after 1.0 seconds"
    assert [int(b[0, 0]) for b in held] == [0, 1]
