"""Tests of shmloader.slotsize: the slot size tasks are sent with follows the batches both ways."""

from __future__ import annotations

from shmloader.slotsize import WINDOW, SlotSize


def test_no_size_before_the_first_batch():
    assert SlotSize().largest == 0


def test_a_bigger_batch_raises_the_size_at_once():
    sizes = SlotSize()
    for n in (100, 50, 300):
        sizes.saw(n)
    assert sizes.largest == 300


def test_a_big_batch_is_remembered_for_a_whole_window_after_its_own():
    sizes = SlotSize()
    sizes.saw(1000)  # the first batch of a window
    for _ in range(2 * WINDOW - 2):  # the rest of its window, and all but one of the next
        sizes.saw(10)
        assert sizes.largest == 1000
    sizes.saw(10)  # the second window is whole: only its batches count now
    assert sizes.largest == 10


def test_a_big_batch_last_in_its_window_is_remembered_for_the_next_window():
    sizes = SlotSize()
    for _ in range(WINDOW - 1):
        sizes.saw(10)
    sizes.saw(1000)
    for _ in range(WINDOW - 1):
        sizes.saw(10)
        assert sizes.largest == 1000
    sizes.saw(10)
    assert sizes.largest == 10


def test_sizes_that_shrink_step_by_step_are_followed():
    sizes = SlotSize()
    seen = []
    for n in (800, 400, 200, 100):
        for _ in range(WINDOW):
            sizes.saw(n)
        seen.append(sizes.largest)
    assert seen == [800, 400, 200, 100]


def test_a_slot_granted_on_request_raises_the_size_without_counting_a_batch():
    sizes = SlotSize()
    for _ in range(WINDOW - 1):
        sizes.saw(10)
    sizes.at_least(500)  # granted; its READY comes later and counts it
    assert sizes.largest == 500
    sizes.saw(500)  # that batch: the window is whole now, and it holds 500
    assert sizes.largest == 500
    sizes.at_least(20)  # smaller than the size: nothing changes
    assert sizes.largest == 500


def test_saw_says_when_the_size_fell_and_only_then():
    sizes = SlotSize()
    said = [sizes.saw(n) for n in [1000] * WINDOW + [10] * WINDOW + [10] * WINDOW]
    assert said == [False] * (2 * WINDOW - 1) + [True] + [False] * WINDOW
