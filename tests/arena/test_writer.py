"""Tests of arena.writer: aligned, non-overlapping bump allocation inside one slot."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arena._layout import ALIGN, PAGE
from arena.writer import SlotWriter

sizes = st.lists(st.integers(0, 3 * ALIGN), max_size=30)


def test_first_range_starts_at_zero():
    writer = SlotWriter(PAGE)
    assert writer.alloc(10) == 0
    assert writer.used == 10


def test_next_range_starts_at_the_next_alignment_boundary():
    writer = SlotWriter(PAGE)
    writer.alloc(1)
    assert writer.alloc(1) == ALIGN
    writer.alloc(ALIGN)
    assert writer.alloc(1) == 3 * ALIGN
    assert writer.used == 3 * ALIGN + 1


def test_overflow_returns_none_without_changing_used():
    writer = SlotWriter(4 * ALIGN)
    writer.alloc(ALIGN + 1)
    assert writer.alloc(2 * ALIGN + 1) is None
    assert writer.used == ALIGN + 1
    assert writer.alloc(2 * ALIGN) == 2 * ALIGN  # the exact remainder still fits
    assert writer.used == writer.capacity


def test_a_negative_size_is_refused_without_moving_used():
    """Review 38: alloc(-900) moved ``used`` back, so the next range overlapped an earlier one."""
    writer = SlotWriter(PAGE)
    writer.alloc(1000)
    with pytest.raises(ValueError, match="nbytes must be >= 0, got -900"):
        writer.alloc(-900)
    assert writer.used == 1000 and writer.alloc(1) == 1024


def test_alignment_padding_counts_toward_overflow():
    writer = SlotWriter(2 * ALIGN)
    writer.alloc(1)
    assert writer.alloc(2 * ALIGN - 1) is None  # fits in bytes, not after aligning
    assert writer.used == 1


def test_zero_byte_range_is_aligned_and_takes_no_room():
    writer = SlotWriter(PAGE)
    writer.alloc(3)
    assert writer.alloc(0) == ALIGN
    assert writer.used == ALIGN


@settings(max_examples=100)
@given(requests=sizes, capacity=st.integers(0, 2 * PAGE))
def test_ranges_are_aligned_disjoint_and_inside_the_slot(requests, capacity):
    writer = SlotWriter(capacity)
    ranges = []
    for n in requests:
        before = writer.used
        start = writer.alloc(n)
        if start is None:
            assert writer.used == before
            continue
        assert start % ALIGN == 0
        assert start >= before
        assert writer.used == start + n
        ranges.append((start, start + n))
        assert 0 <= writer.used <= capacity
    for (_, end), (start, _) in itertools.pairwise(ranges):
        assert end <= start


@settings(max_examples=100)
@given(requests=sizes)
def test_size_of_is_the_space_alloc_uses(requests):
    needed = SlotWriter.size_of(requests)
    writer = SlotWriter(needed)
    assert all(writer.alloc(n) is not None for n in requests)
    assert writer.used == needed
