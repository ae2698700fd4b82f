"""When the arena needs a slab and the system has no room for one, the batch fails with the
numbers, at its turn; the loader never waits for room that is not coming.

Review 10 found a loop that holds its batches with ``arena_backend="posix"`` hang for good once
``/dev/shm`` filled up: the batch needed next was decided but not yet sent (its worker had no
slot for it), the arena's ``ArenaCapacityError`` for the new slab was dropped, and the main
process waited for an answer no worker would ever send. Here ``/dev/shm`` "fills" by making the
arena's view of its free bytes 0 in the main process (the only one that makes slabs).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import arena.segment
import shmloader
from arena import ArenaCapacityError
from tests.lifetime_checks import frees_its_loaders_on_failure

SAMPLE = 16 << 10  # float32 values of one sample: 64 KiB
BATCH = 4


class Rows(torch.utils.data.Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((SAMPLE,), float(i))


def _rows(batch: torch.Tensor, k: int) -> bool:
    return torch.equal(batch[:, 0], torch.arange(k * BATCH, (k + 1) * BATCH, dtype=torch.float32))


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh", "persistent"])
@frees_its_loaders_on_failure
def test_a_full_dev_shm_fails_the_batch_that_needs_a_slab_instead_of_waiting(
    monkeypatch: pytest.MonkeyPatch, persistent: bool
) -> None:
    loader = shmloader.DataLoader(
        Rows(), batch_size=BATCH, num_workers=2, arena_backend="posix",
        persistent_workers=persistent, timeout=30,  # a regression times out, it does not hang
    )  # fmt: skip
    assert all(_rows(b, k) for k, b in enumerate(loader))  # one slab, sized for these batches
    slabs = loader.stats().slabs
    with monkeypatch.context() as full:
        full.setattr(arena.segment, "shm_free_bytes", lambda path="/dev/shm": 0)
        held: list[torch.Tensor] = []
        with pytest.raises(ArenaCapacityError) as raised:
            for k, b in enumerate(loader):
                assert _rows(b, k)
                held.append(b)  # every batch kept: the arena needs another slab
        assert "/dev/shm is too small" in str(raised.value)
        assert "arena_backend='memfd'" in str(raised.value)  # and it says what to change
        assert len(held) >= 1 and loader.stats().slabs == slabs
        held.clear()
    # Room again: the next epoch loads every batch.
    got: list[Any] = [b for b in loader]
    assert len(got) == 16 and all(_rows(b, k) for k, b in enumerate(got))
