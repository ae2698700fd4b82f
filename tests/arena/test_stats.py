"""Tests of arena.stats: the snapshot's invariants, checked over random slot life cycles."""

from __future__ import annotations

import dataclasses
from contextlib import closing

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from arena._layout import PAGE, page_align
from arena.allocator import Arena, SlotRef, SlotState
from arena.errors import StaleSlotError
from arena.stats import ArenaStats

MAX_BYTES = 24 * PAGE
REQUESTS = [1, PAGE, PAGE + 1, 2 * PAGE, 3 * PAGE, 5 * PAGE]


def assert_books_balance(stats: ArenaStats) -> None:
    assert stats.bytes_reserved == sum(stats.bytes_by_state.values())
    assert stats.slots_total == sum(stats.slots_by_state.values())
    assert stats.bytes_reserved <= stats.max_bytes
    assert 0 <= stats.bytes_in_use <= stats.high_water_bytes <= stats.bytes_reserved
    assert all(n >= 0 for n in stats.bytes_by_state.values())
    assert all(n >= 0 for n in stats.slots_by_state.values())


class ArenaBooks(RuleBasedStateMachine):
    """Random acquire / mark_ready / lend / release / stale-release sequences against a model."""

    arena: Arena

    @initialize()
    def open_arena(self) -> None:
        self.arena = Arena(backend="memfd", max_bytes=MAX_BYTES, slots_per_slab=2)
        self.held: dict[SlotRef, SlotState] = {}  # refs the model holds, with their state
        self.released: list[SlotRef] = []
        self.generation: dict[tuple[int, int], int] = {}
        self.high_water = 0

    def teardown(self) -> None:
        if hasattr(self, "arena"):
            self.arena.close()

    def _pick(self, index: int) -> SlotRef:
        refs = list(self.held)
        return refs[index % len(refs)]

    @rule(nbytes=st.sampled_from(REQUESTS))
    def acquire(self, nbytes: int) -> None:
        ref = self.arena.acquire(nbytes)
        if ref is None:
            self._assert_nothing_fits(nbytes)
            return
        key = (ref.slab_id, ref.slot)
        assert all((r.slab_id, r.slot) != key for r in self.held)
        assert ref.generation == self.generation.get(key, 0) + 1
        assert self.arena.slot_size(ref) >= nbytes
        self.generation[key] = ref.generation
        self.held[ref] = SlotState.WRITING

    def _assert_nothing_fits(self, nbytes: int) -> None:
        """Refused only when every fitting slot is held and no new slab fits under the cap."""
        need = page_align(nbytes)
        stats = self.arena.stats()
        fitting = [s for s in stats.slot_sizes if s >= need]
        slots = sum(s.nslots for s in self.arena.slabs() if s.slot_size >= need)
        assert slots == sum(1 for r in self.held if self.arena.slot_size(r) >= need)
        smallest_growth = fitting[0] if fitting else need
        assert smallest_growth > stats.max_bytes - stats.bytes_reserved

    @precondition(lambda self: self.held)
    @rule(index=st.integers(0, 63))
    def mark_ready(self, index: int) -> None:
        ref = self._pick(index)
        if self.held[ref] is SlotState.WRITING:
            self.arena.mark_ready(ref)
            self.held[ref] = SlotState.READY
        else:
            with pytest.raises(StaleSlotError):
                self.arena.mark_ready(ref)

    @precondition(lambda self: self.held)
    @rule(index=st.integers(0, 63))
    def lend(self, index: int) -> None:
        ref = self._pick(index)
        if self.held[ref] is SlotState.READY:
            self.arena.lend(ref)
            self.held[ref] = SlotState.LENT
        else:
            with pytest.raises(StaleSlotError):
                self.arena.lend(ref)

    @precondition(lambda self: self.held)
    @rule(index=st.integers(0, 63))
    def release(self, index: int) -> None:
        ref = self._pick(index)
        assert self.arena.release(ref) is True
        del self.held[ref]
        self.released.append(ref)

    @precondition(lambda self: self.released)
    @rule(index=st.integers(0, 63))
    def release_again(self, index: int) -> None:
        ref = self.released[index % len(self.released)]
        if self.generation[(ref.slab_id, ref.slot)] != ref.generation:
            assert self.arena.release(ref) is False  # stale: the slot has a new owner
        else:
            with pytest.raises(StaleSlotError):
                self.arena.release(ref)

    @invariant()
    def books_balance(self) -> None:
        if not hasattr(self, "arena"):
            return
        stats = self.arena.stats()
        assert_books_balance(stats)
        assert stats.high_water_bytes >= self.high_water  # never decreases
        self.high_water = stats.high_water_bytes
        for state in (SlotState.WRITING, SlotState.READY, SlotState.LENT):
            want = sum(1 for s in self.held.values() if s is state)
            assert stats.slots_by_state[state.name.lower()] == want
        assert stats.bytes_in_use == sum(self.arena.slot_size(r) for r in self.held)
        assert stats.slot_sizes == tuple(sorted(set(stats.slot_sizes)))


def test_stats_invariants_hold_over_random_slot_life_cycles():
    run_state_machine_as_test(
        ArenaBooks,
        settings=settings(
            max_examples=100,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


def test_fresh_arena_reports_nothing_reserved():
    with closing(Arena(backend="memfd", max_bytes=MAX_BYTES)) as arena:
        stats = arena.stats()
        assert stats.backend == "none"
        assert stats.bytes_reserved == stats.slots_total == stats.slabs == 0
        assert stats.high_water_bytes == stats.growth_events == 0
        assert stats.slot_sizes == ()
        assert stats.max_bytes == MAX_BYTES
        assert set(stats.bytes_by_state) == {"free", "writing", "ready", "lent"}
        assert_books_balance(stats)


@pytest.mark.parametrize("backend", ["posix", "memfd"])
def test_stats_name_the_backend_in_use(backend):
    with closing(Arena(backend=backend, max_bytes=MAX_BYTES)) as arena:
        arena.acquire(PAGE)
        assert arena.stats().backend == backend


def test_bytes_in_use_and_slots_free_follow_the_states():
    with closing(Arena(backend="memfd", max_bytes=MAX_BYTES, slots_per_slab=4)) as arena:
        a = arena.acquire(PAGE)
        b = arena.acquire(PAGE)
        assert a is not None and b is not None
        arena.mark_ready(b)
        stats = arena.stats()
        assert stats.slots_free == 2
        assert stats.bytes_in_use == 2 * PAGE
        assert stats.bytes_by_state == {"free": 2 * PAGE, "writing": PAGE, "ready": PAGE, "lent": 0}
        assert stats.slots_by_state == {"free": 2, "writing": 1, "ready": 1, "lent": 0}


def test_high_water_remembers_the_peak_after_release():
    with closing(Arena(backend="memfd", max_bytes=MAX_BYTES, slots_per_slab=4)) as arena:
        refs = [arena.acquire(PAGE) for _ in range(3)]
        for ref in refs:
            assert ref is not None
            arena.release(ref)
        stats = arena.stats()
        assert stats.bytes_in_use == 0
        assert stats.high_water_bytes == 3 * PAGE


def test_growth_events_count_slabs_created():
    with closing(Arena(backend="memfd", max_bytes=MAX_BYTES, slots_per_slab=1)) as arena:
        for nbytes in (PAGE, PAGE, 2 * PAGE):
            arena.acquire(nbytes)
        stats = arena.stats()
        assert stats.growth_events == stats.slabs == 3
        assert stats.slot_sizes == (PAGE, 2 * PAGE)


def test_stats_are_a_frozen_snapshot():
    with closing(Arena(backend="memfd", max_bytes=MAX_BYTES)) as arena:
        before = arena.stats()
        arena.acquire(PAGE)
        assert before.bytes_reserved == 0
        with pytest.raises(dataclasses.FrozenInstanceError):
            before.slabs = 1  # type: ignore[misc]
