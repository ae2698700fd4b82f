"""Exact resume after errors the loop caught, and with samplers whose randomness lives outside
the loader: a state saved after k items, loaded into a fresh loader in this process, yields the
uninterrupted run's remaining items (batches bit for bit, errors by type), and no more.

Items, bounded loops and RNG hygiene: :mod:`tests.resume_items`.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, IterableDataset, Sampler

from shmloader import DataLoader
from tests.resume_items import (
    TIMEOUT,
    Item,
    drain,
    next_item,
    own_rngs,
    resumed_run,
    roundtrip,
    seed_all,
    uninterrupted_and_resumed,
)

__all__ = ["own_rngs"]  # the autouse fixture, imported to apply here

# -- 1. a batch that raised, the loop went on --------------------------------------------------


class AugmentRaisesAt9(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """40 items drawing from torch, ``random`` and NumPy (augmentation); item 9 raises."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 9:
            raise ValueError(f"corrupt item {i}")
        return torch.tensor(
            [float(i), torch.rand(()).item(), random.random(), float(np.random.rand())],
            dtype=torch.float64,
        )


@pytest.mark.parametrize("save_after", [3, 6])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_saved_after_a_raised_batch_resumes_without_repeating_a_batch(
    workers: int, save_after: int
) -> None:
    """Batch 2 (items 8..11) raises; saved just after it (3) or three batches later (6)."""

    def make() -> DataLoader[Any]:
        return DataLoader(AugmentRaisesAt9(), batch_size=4, num_workers=workers,
                          timeout=TIMEOUT if workers else 0, in_order=True)  # fmt: skip

    before, expected, resumed = uninterrupted_and_resumed(make, 2, save_after)
    assert before[2] == ("ERR", b"ValueError")  # the error the loop caught, before the save
    assert resumed == expected


# -- 2. a batch denied by the arena (ArenaCapacityError) ---------------------------------------


class OneHugeItem(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """40 random tensors of 4 float64s; item 9 has 300,000 (2.4 MB, over a 1 MiB arena)."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> torch.Tensor:
        x = torch.rand(300_000 if i == 9 else 4, dtype=torch.float64)
        x[0] = i
        return x


def as_list(samples: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(samples)


def _sample_indices(batch: list[torch.Tensor]) -> bytes:
    return repr([int(x[0]) for x in batch]).encode()


@pytest.mark.parametrize("in_order", [True, False])
def test_state_dict_right_after_an_arena_capacity_error_resumes_the_rest(in_order: bool) -> None:
    """Batch 2 is larger than ``arena_max_bytes``: its ``next()`` raises ArenaCapacityError;
    ``state_dict()`` right after it must work, and resume the batches not yet consumed. With
    ``in_order=False`` which batches come before the save is timing-dependent, and so are the
    draws of each batch's worker: the rest is compared as a multiset of sample indices."""

    def make() -> DataLoader[Any]:
        return DataLoader(OneHugeItem(), batch_size=4, num_workers=2, collate_fn=as_list,
                          arena_max_bytes=1 << 20, in_order=in_order, timeout=TIMEOUT)  # fmt: skip

    if in_order:
        before, expected, resumed = uninterrupted_and_resumed(make, 1, 3)
        assert before[2] == ("ERR", b"ArenaCapacityError")
        assert resumed == expected
        return
    seed_all(0)
    loader = make()
    it = iter(loader)
    consumed: list[Item] = []
    while ("ERR", b"ArenaCapacityError") not in consumed and len(consumed) < 10:
        item = next_item(it, _sample_indices)
        assert item is not None
        consumed.append(item)
    assert ("ERR", b"ArenaCapacityError") in consumed
    state = roundtrip(loader.state_dict())  # right after the error
    rest: list[Item] = []
    drain(it, rest, _sample_indices)
    del it
    assert len(consumed) + len(rest) == 10  # every batch once: 9 of them and the error
    resumed = resumed_run(make, state, 1, _sample_indices)
    assert sorted(resumed) == sorted(rest)


# -- 3. and 4. IterableDataset replicas that raised --------------------------------------------


class Replica:
    """Worker ``wid``'s replica: records 1..12, each with a random draw; worker 0's record 4
    raises (once: the iterator goes on after it, as a reader that skips a bad record)."""

    def __init__(self, wid: int, start: int = 0) -> None:
        self.wid, self.i = wid, start

    def __iter__(self) -> Replica:
        return self

    def __next__(self) -> torch.Tensor:
        if self.i >= 12:
            raise StopIteration
        self.i += 1
        if self.i == 4 and self.wid == 0:
            raise ValueError("corrupt record 4")
        return torch.tensor([float(self.wid), float(self.i), torch.rand(()).item()],
                            dtype=torch.float64)  # fmt: skip


def _worker_id() -> int:
    info = torch.utils.data.get_worker_info()
    return info.id if info is not None else 0


class RecordsWithABadOne(IterableDataset):  # type: ignore[type-arg]
    """No ``state_dict``: a resume fast-forwards each replica past its consumed batches."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        return Replica(_worker_id())


class GeneratorWithABadOne(IterableDataset):  # type: ignore[type-arg]
    """As :class:`RecordsWithABadOne`, as a generator: worker 0's replica ends at its error."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        wid = _worker_id()
        for i in range(1, 13):
            if i == 4 and wid == 0:
                raise ValueError("corrupt record 4")
            yield torch.tensor([float(wid), float(i), torch.rand(()).item()], dtype=torch.float64)


class StatefulRecordsWithABadOne(IterableDataset):  # type: ignore[type-arg]
    """As :class:`RecordsWithABadOne`, with torchdata's Stateful protocol (records read)."""

    def __init__(self) -> None:
        self.start = 0
        self.replica: Replica | None = None

    def __iter__(self) -> Iterator[torch.Tensor]:
        self.replica, self.start = Replica(_worker_id(), self.start), 0
        return self.replica

    def state_dict(self) -> dict[str, int]:
        return {"i": self.replica.i if self.replica is not None else 0}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.start = sd["i"]


# (dataset, workers, items before the save): worker 0's error is among them, the epoch goes on
FAST_FORWARD = {
    "iterator, 2 workers": (RecordsWithABadOne, 2, 5),
    "iterator, 0 workers": (RecordsWithABadOne, 0, 3),
    "generator, 2 workers": (GeneratorWithABadOne, 2, 4),
    "generator, 0 workers": (GeneratorWithABadOne, 0, 2),  # the epoch ends at the error
}


@pytest.mark.parametrize("case", list(FAST_FORWARD))
def test_a_fast_forwarded_replica_that_raised_before_the_save_resumes_the_rest_and_ends(
    case: str,
) -> None:
    dataset, workers, save_after = FAST_FORWARD[case]

    def make() -> DataLoader[Any]:
        return DataLoader(dataset(), batch_size=2, num_workers=workers,
                          timeout=TIMEOUT if workers else 0)  # fmt: skip

    before, expected, resumed = uninterrupted_and_resumed(make, 2, save_after)
    assert ("ERR", b"ValueError") in before
    assert resumed == expected  # and it ended: drain stops at CAP items otherwise


def test_a_stateful_replica_that_raised_before_the_save_resumes_the_rest() -> None:
    """Saved right after worker 0's batch that raised: its replica's saved state must be the
    one after that batch (before, the one before it: the resume read that record again)."""

    def make() -> DataLoader[Any]:
        return DataLoader(StatefulRecordsWithABadOne(), batch_size=2, num_workers=2,
                          timeout=TIMEOUT)  # fmt: skip

    before, expected, resumed = uninterrupted_and_resumed(make, 2, 3)
    assert before[-1] == ("ERR", b"ValueError")
    assert resumed == expected


# -- 5. a replica whose state_dict() cannot be pickled -----------------------------------------


class UnpicklableState(IterableDataset):  # type: ignore[type-arg]
    """A Stateful IterableDataset whose ``state_dict()`` holds a lock (as a handle might)."""

    def __init__(self) -> None:
        self.pos = 0
        self.lock = threading.Lock()

    def __iter__(self) -> Iterator[torch.Tensor]:
        self.pos = 0
        while self.pos < 10:
            self.pos += 1
            yield torch.tensor([_worker_id(), self.pos])

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos, "lock": self.lock}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.pos = sd["pos"]


def test_an_unpicklable_replica_state_fails_only_state_dict_naming_it() -> None:
    def items(loader: Any) -> list[Item]:
        out: list[Item] = []
        drain(iter(loader), out)
        return out

    kw: dict[str, Any] = {"batch_size": 2, "num_workers": 2, "timeout": TIMEOUT}
    expected = items(torch.utils.data.DataLoader(UnpicklableState(), **kw))
    assert len(expected) == 10 and all(kind == "B" for kind, _ in expected)
    loader = DataLoader(UnpicklableState(), **kw)
    assert items(loader) == expected  # no batch fails for a state nobody asked for

    it = iter(loader)
    got: list[Item] = []
    for _ in range(2):
        item = next_item(it)
        assert item is not None
        got.append(item)
    with pytest.raises(RuntimeError, match=r"replica state_dict\(\) could not be taken or pickled"):
        loader.state_dict()
    drain(it, got)  # the iterator goes on after the failed save
    del it
    assert got == expected


# -- 6., 7. and 8. samplers ---------------------------------------------------------------------


class Indices(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i)], dtype=torch.float64)


class NumpyGlobalSampler(Sampler[int]):
    """No ``state_dict``: each epoch draws ``np.random.permutation`` from NumPy's global RNG."""

    def __len__(self) -> int:
        return 48

    def __iter__(self) -> Iterator[int]:
        return iter(np.random.permutation(48).tolist())


class RandomGlobalSampler(Sampler[int]):
    """No ``state_dict``: each epoch shuffles with ``random.shuffle`` (the global RNG)."""

    def __len__(self) -> int:
        return 48

    def __iter__(self) -> Iterator[int]:
        idx = list(range(48))
        random.shuffle(idx)
        return iter(idx)


class OwnRngSampler(Sampler[int]):
    """Its own RNG, saved through torchdata's ``state_dict`` protocol."""

    def __init__(self) -> None:
        self.rng = np.random.default_rng(7)

    def __len__(self) -> int:
        return 48

    def __iter__(self) -> Iterator[int]:
        return iter(self.rng.permutation(48).tolist())

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.rng.bit_generator.state = sd["rng"]


class LiveStateSampler(Sampler[int]):
    """``state_dict()`` returns its live dict, which the next ``__iter__`` changes."""

    def __init__(self) -> None:
        self.state = {"epoch": 0}

    def __len__(self) -> int:
        return 48

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(100 + self.state["epoch"])
        self.state["epoch"] += 1
        return iter(torch.randperm(48, generator=g).tolist())

    def state_dict(self) -> dict[str, int]:
        return self.state

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.state = dict(sd)


SAMPLERS: dict[str, Callable[[], dict[str, Any]]] = {
    "np.random.permutation": lambda: {"batch_size": 4, "sampler": NumpyGlobalSampler()},
    "random.shuffle": lambda: {"batch_size": 4, "sampler": RandomGlobalSampler()},
    "live state_dict": lambda: {"batch_size": 4, "sampler": LiveStateSampler()},
}


# 12 batches an epoch: 5 is mid-epoch 0, 17 mid-epoch 1
@pytest.mark.parametrize("save_after", [5, 17])
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("sampler", list(SAMPLERS))
def test_a_custom_sampler_drawing_outside_the_loader_resumes_exactly(
    sampler: str, workers: int, save_after: int
) -> None:
    def make() -> DataLoader[Any]:
        return DataLoader(Indices(), num_workers=workers, timeout=TIMEOUT if workers else 0,
                          **SAMPLERS[sampler]())  # fmt: skip

    _, expected, resumed = uninterrupted_and_resumed(make, 3, save_after)
    assert len(expected) == 36 - save_after
    assert resumed == expected


def test_a_stateful_sampler_inside_torchs_batch_sampler_resumes_exactly() -> None:
    """Saved mid-epoch 1: a fresh OwnRngSampler is where epoch 0 began, not epoch 1 (saved
    mid-epoch 0, a resume would match with or without the sampler's state)."""

    def make() -> DataLoader[Any]:
        return DataLoader(Indices(), batch_sampler=BatchSampler(OwnRngSampler(), 4, False),
                          num_workers=2, timeout=TIMEOUT)  # fmt: skip

    _, expected, resumed = uninterrupted_and_resumed(make, 3, 17)
    assert len(expected) == 19
    assert resumed == expected
