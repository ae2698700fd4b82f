"""``loader.stats()``: one well-defined record at every moment, every field documented."""

import dataclasses
import os

import pytest
import torch

import shmloader
from arena import ArenaStats, SlotState
from shmloader.stats import LoaderStats, no_arena

STATES = {s.name.lower() for s in SlotState}
ARENA_FIELDS = [*(f.name for f in dataclasses.fields(ArenaStats)), "slots_free", "bytes_in_use"]
LOADER_FIELDS = [
    "arena", "batches_held", "pinned_bytes", "worker_pids", "slots_kept", "bytes_kept",
    "batches_spilled", "bytes_spilled", "bytes_rng_rings", "batches_retired", "bytes_retired",
]


class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return torch.full((256,), i, dtype=torch.float32)


def assert_nothing_reserved(st, max_bytes):
    assert st.backend == "none"
    assert st.max_bytes == max_bytes
    assert st.bytes_reserved == st.bytes_in_use == st.high_water_bytes == 0
    assert st.slots_total == st.slots_free == st.slabs == st.growth_events == 0
    assert st.slot_sizes == ()
    assert dict(st.slots_by_state) == dict.fromkeys(STATES, 0)
    assert dict(st.bytes_by_state) == dict.fromkeys(STATES, 0)
    assert (st.batches_held, st.pinned_bytes, st.worker_pids) == (0, 0, ())


def test_before_the_first_iteration_stats_says_nothing_is_reserved_under_the_given_cap():
    loader = shmloader.DataLoader(Rows(), batch_size=4, num_workers=2, arena_max_bytes=1 << 24)
    assert_nothing_reserved(loader.stats(), 1 << 24)


def test_before_the_first_iteration_the_default_cap_is_reported():
    st = shmloader.DataLoader(Rows(), batch_size=4, num_workers=2).stats()
    assert st.max_bytes > 0
    assert st.bytes_reserved == 0


def test_with_no_workers_stats_stays_empty_while_batches_are_held():
    loader = shmloader.DataLoader(Rows(), batch_size=4, num_workers=0)
    held = list(loader)
    assert len(held) == 4
    assert_nothing_reserved(loader.stats(), 0)


def test_every_arena_field_is_readable_on_the_record_during_and_after_iteration():
    loader = shmloader.DataLoader(Rows(), batch_size=4, num_workers=2, arena_max_bytes=1 << 24)
    empty_row = loader.stats().as_row()
    it = iter(loader)
    batch = next(it)
    st = loader.stats()
    for name in ARENA_FIELDS:
        assert getattr(st, name) == getattr(st.arena, name), name
    assert st.backend in {"posix", "memfd"}
    assert st.slots_by_state["lent"] == st.batches_held == 1
    assert st.growth_events >= 1
    assert len(st.worker_pids) == 2
    assert st.as_row().keys() == empty_row.keys()
    del batch, it
    assert loader.stats().batches_held == 0


@pytest.mark.parametrize("name", ARENA_FIELDS + LOADER_FIELDS)
def test_every_field_is_documented_on_the_record(name):
    assert f"``{name}``" in LoaderStats.__doc__


def test_the_record_without_an_arena_cannot_be_changed_through_its_mappings():
    st = no_arena(4096)
    with pytest.raises(TypeError):
        st.slots_by_state["free"] = 1  # type: ignore[index]
    assert no_arena(4096).slots_free == 0


def _memfd_bytes() -> int:
    """The sizes of the memfds this process has open (the arena's slabs here are not memfds)."""
    total = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:"):
                total += os.fstat(int(fd)).st_size
        except OSError:
            continue  # the directory's own descriptor, closed by now
    return total


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh", "persistent"])
def test_the_rng_rings_of_live_iterators_are_counted_until_they_close(persistent):
    loader = shmloader.DataLoader(
        Rows(), batch_size=4, num_workers=2, prefetch_factor=3, arena_backend="posix",
        persistent_workers=persistent,
    )  # fmt: skip
    before = _memfd_bytes()
    assert loader.stats().bytes_rng_rings == 0
    it = iter(loader)
    one_ring = 2 * (3 + 4) * 12288  # two workers, prefetch_factor + 4 entries of three pages each
    assert loader.stats().bytes_rng_rings == one_ring == _memfd_bytes() - before
    second = iter(loader)  # persistent: the same iterator again; otherwise a second one
    rings = one_ring if persistent else 2 * one_ring
    assert loader.stats().bytes_rng_rings == rings == _memfd_bytes() - before
    assert loader.stats().as_row()["bytes_rng_rings"] == rings
    list(second)
    del it, second
    left = one_ring if persistent else 0  # persistent workers live as long as the loader
    assert loader.stats().bytes_rng_rings == left == _memfd_bytes() - before
