"""Batches that shrink stop taking slots sized for big ones.

Review 12b (finding 2): the size tasks were sent with only ever grew, so after a few big
batches every small batch took a big slot, and a user who held only the labels of small
batches held a big slot for each (9.7 GB of ``/dev/shm`` for 19 KB of labels under the default
cap). Now that size is the largest of the latest batches (:mod:`shmloader.slotsize`), the arena
serves small requests from a snug class and gives back the big slots' memory
(:mod:`arena.allocator`), and the arena grows only for a size a worker measured, never for a
guess (:meth:`shmloader.dispatch.Dispatch.unblock`).
"""

from __future__ import annotations

from typing import Any

import torch

import shmloader
from shmloader.slotsize import WINDOW

BIG_BATCHES, SMALL_BATCHES, BATCH = 3, 60, 8
IN_FLIGHT = 2 * 2  # prefetch_factor * num_workers
BIG_WIDTH, SMALL_WIDTH = 64 * 1024, 16  # float32 values a sample: 256 KiB, then 64 bytes


class Shrinking(torch.utils.data.Dataset[Any]):
    """Sample ``i``: a row of ``i``s (wide in the first ``BIG_BATCHES`` batches) and ``i``."""

    def __len__(self) -> int:
        return (BIG_BATCHES + SMALL_BATCHES) * BATCH

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        width = BIG_WIDTH if i < BIG_BATCHES * BATCH else SMALL_WIDTH
        return torch.full((width,), float(i)), i


def loader(**kwargs: Any) -> shmloader.DataLoader:
    return shmloader.DataLoader(
        Shrinking(), batch_size=BATCH, num_workers=2, timeout=60, **kwargs
    )


def check(rows: torch.Tensor, labels: torch.Tensor, n: int) -> None:
    expected = torch.arange(n * BATCH, (n + 1) * BATCH)
    assert torch.equal(labels, expected)
    assert torch.equal(rows, expected.float()[:, None].expand_as(rows))


def test_held_labels_of_small_batches_do_not_hold_big_slots():
    dl = loader()
    held = []
    for n, (rows, labels) in enumerate(dl):
        check(rows, labels, n)
        held.append(labels)  # only the labels: each keeps its batch's slot
    st = dl.stats().arena
    big = max(st.slot_sizes)
    small = min(st.slot_sizes)
    assert big >= BATCH * BIG_WIDTH * 4
    assert small <= big // 64  # small batches got slots of their own size
    # Big slots: the big batches', and those of small batches sent while the size hint still
    # remembered a big one: at most the 2 * WINDOW - 1 batches answered until it falls, and
    # the tasks in flight then. Before, every held small batch kept a big slot of its own.
    in_big = 2 * WINDOW - 1 + IN_FLIGHT
    assert in_big < SMALL_BATCHES // 2
    assert st.bytes_by_state["lent"] <= (BIG_BATCHES + in_big) * big + SMALL_BATCHES * small
    for n, labels in enumerate(held):
        assert torch.equal(labels, torch.arange(n * BATCH, (n + 1) * BATCH))
    del held, rows, labels


def test_the_arena_gives_back_the_memory_of_big_slots_once_batches_shrank():
    dl = loader(persistent_workers=True)
    for _ in range(2):  # the second epoch grows big again, then shrinks again
        for n, (rows, labels) in enumerate(dl):
            check(rows, labels, n)
        del rows, labels
        st = dl.stats().arena
        big = max(st.slot_sizes)
        assert st.bytes_by_state["lent"] == 0
        assert st.slots_hollow >= 1
        assert st.bytes_reserved < big  # every big slot is hollow: only small slots hold memory
