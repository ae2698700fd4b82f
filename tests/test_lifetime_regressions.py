"""Regression tests for issue 11: a batch the user holds is never overwritten, and the loader
never hangs.

One test per bug of the issue (and the CPU ``DevicePrefetcher``), each asserting the correct
behaviour and checking every batch it looks at against the dataset (tests/lifetime_datasets.py:
sample ``i`` is filled with ``row_value(i)``). Each is bounded: loaders get ``timeout=``, and the
scenarios that can deadlock the main process itself (a lock taken inside the garbage collector)
run in a forked child (tests/forked.py) that is killed and reaped after :data:`HANG_S` seconds,
reporting the child's stack.

Each failed before its fix (they were written first, marked ``xfail(strict=True)``, and the
markers went with the fixes).
"""

from __future__ import annotations

import collections
import gc
import os
import pickle
import select
import traceback
from typing import Any

import numpy as np
import pytest
import torch

import shmloader
from arena import ArenaExhaustedError
from tests.forked import ForkedChild
from tests.lifetime_checks import batch_ok, frees_its_loaders_on_failure, rows_ok, states
from tests.lifetime_datasets import (
    ListBatchSampler,
    NumpyRows,
    PoisonedPayload,
    SizedRows,
    TorchRows,
    UnevenWork,
    consecutive_batches,
    marker_collate,
    row_value,
    scratch_collate,
    zero_d_numpy_collate,
)

HANG_S = 20.0  # a scenario that has not finished by then is hung: a pass takes a few seconds
LOADER_TIMEOUT_S = 10  # every loader's timeout=: a worker waiting forever fails the test


# ------------------------------------------------------------------------ 1. NumPy collates


@frees_its_loaders_on_failure
def test_numpy_collate_batches_hold_their_slot():
    loader = shmloader.DataLoader(
        NumpyRows(64, 1000),
        batch_size=4,
        num_workers=2,
        collate_fn=np.stack,
        timeout=LOADER_TIMEOUT_S,
    )
    kept = list(loader)
    assert len(kept) == 16
    assert all(isinstance(b, np.ndarray) for b in kept)
    wrong = [k for k, b in enumerate(kept) if not rows_ok(b, range(4 * k, 4 * k + 4), 1000)]
    assert wrong == [], f"held batches {wrong} show other batches' rows"
    held = states(loader)
    assert loader.stats().batches_held == 16
    assert held["lent"] == 16, held
    del kept
    gc.collect()
    after = states(loader)
    assert after["free"] == sum(after.values()), after


# --------------------------------------------------------------------- 2. release() twice


@frees_its_loaders_on_failure
def test_releasing_a_batch_twice_leaves_the_batch_now_in_its_slot_intact():
    loader = shmloader.DataLoader(
        TorchRows(128, 64), batch_size=4, num_workers=2, timeout=LOADER_TIMEOUT_S
    )
    it = iter(loader)
    first = next(it)
    slot_ptr = first[0].data_ptr()
    assert shmloader.release(first, loader) == 1
    held: list[tuple[int, Any]] = []
    for k in range(1, 32):  # hold every batch until one lands in the released slot
        batch = next(it)
        held.append((k, batch))
        if batch[0].data_ptr() == slot_ptr:
            break
    else:
        pytest.fail("no later batch reused the released slot")
    del batch
    assert shmloader.release(first, loader) == 0, "a second release of the same batch"
    for k in range(len(held) + 1, len(held) + 6):  # later batches would take a wrongly freed slot
        held.append((k, next(it)))
    wrong = [k for k, (x, y) in held if not batch_ok(x, y, k, 64)]
    assert wrong == [], f"held batches {wrong} were overwritten after the second release"
    assert loader.stats().batches_held == len(held)


# ---------------------------------------------------------- 3. os.fork() of the main process


FORK_EPOCHS = 3  # epochs each side iterates after the fork (100 batches each)


def _iterate_holding_a_window(loader: shmloader.DataLoader[Any], epochs: int) -> dict[str, int]:
    """Iterates ``epochs`` epochs holding the last 3 batches, checking every held batch against
    the dataset at every step; returns how many checks failed out of how many."""
    bad = checked = 0
    for _ in range(epochs):
        window: collections.deque[tuple[int, torch.Tensor, torch.Tensor]] = collections.deque()
        for k, (x, y) in enumerate(loader):
            window.append((k, x, y))
            if len(window) > 3:
                window.popleft()
            for j, xj, yj in window:
                idx = range(4 * j, 4 * j + 4)
                checked += 1
                bad += not (rows_ok(xj, idx, 256) and yj.tolist() == list(idx))
        del window
    return {"bad": bad, "checked": checked}


@pytest.mark.timeout(60)
@frees_its_loaders_on_failure
def test_a_forked_main_process_builds_its_own_arena_and_neither_side_corrupts_batches():
    loader = shmloader.DataLoader(
        TorchRows(400, 256), batch_size=4, num_workers=2, timeout=LOADER_TIMEOUT_S
    )
    assert _iterate_holding_a_window(loader, 1)["bad"] == 0  # the arena exists before the fork
    go_r, go_w = os.pipe()

    def child_body() -> dict[str, int]:
        os.close(go_w)
        select.select([go_r], [], [], HANG_S)  # start together with the parent
        try:
            return _iterate_holding_a_window(loader, FORK_EPOCHS)
        finally:
            gc.collect()  # the child's iterators and workers end before os._exit

    child = ForkedChild(child_body, HANG_S)
    os.close(go_r)
    try:
        os.write(go_w, b"g")
        in_parent = _iterate_holding_a_window(loader, FORK_EPOCHS)
    finally:
        os.close(go_w)
        in_child = child.result()
    assert in_child["checked"] == in_parent["checked"] == FORK_EPOCHS * (3 * 100 - 3)
    assert (in_parent["bad"], in_child["bad"]) == (0, 0), (
        f"corrupted batch checks: parent {in_parent['bad']}, child {in_child['bad']}"
    )
    st = loader.stats()
    assert st.arena is not None and st.arena.slots_free == st.arena.slots_total


# --------------------------------------------------------- 4. batches held in reference cycles

CYCLE_SIZES = [2] * 6 + [8] * 6 + [32] * 6 + [3] * 6 + [64] * 6  # the arena grows mid-epoch
CYCLE_THRESHOLDS = (5, 7, 10, 13, 20) * 2  # gc.set_threshold: collect at most allocations


def _hold_batches_in_reference_cycles() -> dict[str, int]:
    steps = bad = 0
    old = gc.get_threshold()
    batches = consecutive_batches(CYCLE_SIZES)
    try:
        for threshold in CYCLE_THRESHOLDS:
            gc.set_threshold(threshold)
            loader = shmloader.DataLoader(
                TorchRows(sum(CYCLE_SIZES), 512),
                batch_sampler=ListBatchSampler(batches),
                num_workers=2,
                timeout=LOADER_TIMEOUT_S,
            )
            for _epoch in range(2):
                for k, (x, y) in enumerate(loader):
                    steps += 1
                    bad += not (rows_ok(x, batches[k], 512) and y.tolist() == batches[k])
                    cycle: dict[str, Any] = {"batch": (x, y)}
                    cycle["self"] = cycle  # only the garbage collector frees this batch
                del x, y, cycle
            gc.set_threshold(*old)
            del loader
            gc.collect()
    finally:
        gc.set_threshold(*old)
    return {"steps": steps, "bad": bad}


@pytest.mark.timeout(HANG_S + 30)
@frees_its_loaders_on_failure
def test_batches_freed_by_the_garbage_collector_inside_the_allocator_do_not_deadlock():
    report = ForkedChild(_hold_batches_in_reference_cycles, HANG_S).result()
    assert report == {"steps": len(CYCLE_THRESHOLDS) * 2 * len(CYCLE_SIZES), "bad": 0}


# ---------------------------------------------------- 5. a scratch buffer larger than the result


@pytest.mark.timeout(LOADER_TIMEOUT_S + 20)
@frees_its_loaders_on_failure
def test_a_custom_collate_with_a_larger_scratch_buffer_in_the_slot_does_not_hang():
    loader = shmloader.DataLoader(
        TorchRows(64, 32),
        batch_size=4,
        num_workers=2,
        collate_fn=scratch_collate,
        timeout=LOADER_TIMEOUT_S,
    )
    got = 0
    for k, (x, y) in enumerate(loader):
        assert rows_ok(x, range(4 * k, 4 * k + 4), 32), k
        assert y.tolist() == list(range(4 * k, 4 * k + 4))
        got += 1
    assert got == 16


# ------------------------------------------------------------ 6. false ArenaExhaustedError


@pytest.mark.parametrize(
    ("slots_per_slab", "num_workers"),
    [(1, 2), (2, 3)],
    ids=["1-slot-2-workers", "2-slots-3-workers"],
)
@frees_its_loaders_on_failure
def test_keeping_every_batch_under_the_cap_never_raises_arena_exhausted(
    slots_per_slab, num_workers
):
    data = UnevenWork(96, 256, max_rounds=20000)  # workers finish in a scrambled order
    for _trial in range(4):
        loader = shmloader.DataLoader(
            data,
            batch_size=4,
            num_workers=num_workers,
            arena_slots_per_slab=slots_per_slab,
            arena_max_bytes=1 << 30,  # room for every kept batch many times over
            timeout=LOADER_TIMEOUT_S,
        )
        kept = []
        for x, y in loader:  # an ArenaExhaustedError here fails the test
            kept.append((x, y))
        assert len(kept) == 24
        wrong = [k for k, (x, y) in enumerate(kept) if not batch_ok(x, y, k, 256)]
        assert wrong == [], f"kept batches {wrong} are wrong"
        assert loader.stats().batches_held == 24
        del kept, x, y, loader


# --------------------------------------------------- 7. growing batches under a byte cap

CAP = 1 << 20


@frees_its_loaders_on_failure
def test_growing_batches_under_a_byte_cap_reuse_the_memory_of_smaller_free_slabs():
    # batches of 40 KB, then 120 KB, then 240 KB (4 uint8 samples each), each dropped at once
    data = SizedRows(96, [(0, 10_000), (32, 30_000), (64, 60_000)])
    loader = shmloader.DataLoader(
        data, batch_size=4, num_workers=2, arena_max_bytes=CAP, timeout=LOADER_TIMEOUT_S
    )
    got = 0
    for k, batch in enumerate(loader):
        width = data.width_of(4 * k)
        expect = torch.tensor([row_value(i) % 251 for i in range(4 * k, 4 * k + 4)])
        assert batch.shape == (4, width), k
        assert torch.equal(batch.long(), expect[:, None].expand(4, width)), k
        assert loader.stats().bytes_reserved <= CAP
        got += 1
    assert got == 24


# --------------------------------------------------- 8. a batch that fails to rebuild


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh-workers", "persistent-workers"])
@frees_its_loaders_on_failure
def test_a_batch_that_fails_to_rebuild_in_the_main_process_gives_its_slot_back(persistent):
    data = PoisonedPayload(40, poison_every=8)  # batches 0, 2, 4, 6, 8 cannot be rebuilt here
    loader = shmloader.DataLoader(
        data,
        batch_size=4,
        num_workers=2,
        collate_fn=marker_collate,
        persistent_workers=persistent,
        timeout=LOADER_TIMEOUT_S,
    )
    for epoch in range(3):
        outcome = []
        it = iter(loader)
        while True:
            try:
                x, markers = next(it)
            except StopIteration:
                break
            except pickle.UnpicklingError as e:
                traceback.clear_frames(e.__traceback__)
                outcome.append("unpickling error")
            else:
                k = len(outcome)
                assert rows_ok(x, range(4 * k, 4 * k + 4), 64)
                assert [m.value for m in markers] == list(range(4 * k, 4 * k + 4))
                outcome.append("ok")
                del x, markers
        del it
        assert outcome == ["unpickling error", "ok"] * 5
        left = states(loader)
        assert (left["ready"], left["lent"], left["writing"]) == (0, 0, 0), (epoch, left)


# --------------------------------------------------------------------- 9. 0-d NumPy arrays


@frees_its_loaders_on_failure
def test_a_zero_dimensional_numpy_array_keeps_its_shape():
    loader = shmloader.DataLoader(
        NumpyRows(8, 3),
        batch_size=4,
        num_workers=2,
        collate_fn=zero_d_numpy_collate,
        timeout=LOADER_TIMEOUT_S,
    )
    torch_loader = torch.utils.data.DataLoader(
        NumpyRows(8, 3), batch_size=4, num_workers=0, collate_fn=zero_d_numpy_collate
    )
    for k, (ours, theirs) in enumerate(zip(loader, torch_loader, strict=True)):
        assert theirs["total"].shape == ()
        assert isinstance(ours["total"], np.ndarray)
        assert ours["total"].shape == ()
        assert int(ours["total"]) == 3 * sum(row_value(i) for i in range(4 * k, 4 * k + 4))
        assert rows_ok(ours["rows"], range(4 * k, 4 * k + 4), 3)


# ------------------------------------------------------------- DevicePrefetcher on a CPU device


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")], ids=["str", "torch.device"])
@frees_its_loaders_on_failure
def test_device_prefetcher_on_a_cpu_device_passes_the_loaders_batches_through(device):
    plain = [torch.arange(4), {"x": torch.ones(2)}]
    assert all(
        a is b for a, b in zip(shmloader.DevicePrefetcher(plain, device), plain, strict=True)
    )
    loader = shmloader.DataLoader(
        TorchRows(32, 8), batch_size=4, num_workers=2, timeout=LOADER_TIMEOUT_S
    )
    got = 0
    for k, (x, y) in enumerate(shmloader.DevicePrefetcher(loader, device)):
        assert x.device.type == "cpu"
        assert rows_ok(x, range(4 * k, 4 * k + 4), 8)
        assert y.tolist() == list(range(4 * k, 4 * k + 4))
        got += 1
    assert got == 8


# ------------------------------------------------ the exhaustion error's numbers (README claim)


@frees_its_loaders_on_failure
def test_arena_exhausted_error_reports_exactly_what_the_user_holds():
    # 16 batches of 64 int64 rows x 4 fit one 4 KiB page each: a cap of 6 pages is 6 slots
    page = 4096
    loader = shmloader.DataLoader(
        TorchRows(64, 64),
        batch_size=4,
        num_workers=1,
        arena_max_bytes=6 * page,
        timeout=LOADER_TIMEOUT_S,
    )
    kept = []
    with pytest.raises(ArenaExhaustedError) as err:
        for batch in loader:
            kept.append(batch)
    message = str(err.value)
    assert len(kept) == 6, "the user holds every slot the cap allows before the error"
    assert f"the user holds 6 batches ({6 * page:,} bytes)" in message, message
    assert f"at its cap of {6 * page:,} bytes (6 slots)" in message, message
    for k, (x, y) in enumerate(kept):
        assert batch_ok(x, y, k, 64), k
    assert loader.stats().batches_held == 6


@frees_its_loaders_on_failure
def test_arena_exhausted_error_counts_the_bytes_the_user_holds_not_the_bytes_reserved():
    # One small batch (held), then big ones (all held): the small class keeps free slots that
    # cannot hold a big batch, so at the cap the arena reserves more than the user holds.
    data = SizedRows(64, [(0, 500), (4, 12000)])
    probe = shmloader.DataLoader(data, batch_size=4, num_workers=1, timeout=LOADER_TIMEOUT_S)
    assert sum(1 for _ in probe) == 16
    small, big = probe.stats().arena.slot_sizes  # one slab of each class, 3 slots each
    del probe
    cap = 3 * small + 6 * big
    loader = shmloader.DataLoader(
        data, batch_size=4, num_workers=1, arena_max_bytes=cap, timeout=LOADER_TIMEOUT_S
    )
    kept = []
    with pytest.raises(ArenaExhaustedError) as err:
        for batch in loader:
            kept.append(batch)
    message = str(err.value)
    assert len(kept) == 7
    assert f"the user holds 7 batches ({small + 6 * big:,} bytes)" in message, message
    assert f"at its cap of {cap:,} bytes (9 slots)" in message, message
    for k, batch in enumerate(kept):
        want = torch.tensor([row_value(i) % 251 for i in range(4 * k, 4 * k + 4)])
        assert torch.equal(batch.long(), want[:, None].expand(4, data.width_of(4 * k))), k
