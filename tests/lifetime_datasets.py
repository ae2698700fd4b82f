"""Top-level (picklable) datasets, samplers and collates for the batch-lifetime tests
(tests/test_lifetime_regressions.py, tests/test_lifetime_random.py).

Every sample's value is a pure function of its index, so a test can check any batch it holds
against the dataset at any time: :func:`expected_rows` gives the exact rows a batch of given
indices must show. Everything here is importable at module top level, so spawn and forkserver
workers can unpickle it.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

import shmloader


def row_value(i: int) -> int:
    """The value every element of sample ``i`` holds (distinct per index, never 0)."""
    return 1000 + i


class NumpyRows(Dataset):
    """Sample i: ``np.full(width, row_value(i), int64)``."""

    def __init__(self, n: int, width: int = 1000) -> None:
        self.n = n
        self.width = width

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(self.width, row_value(i), dtype=np.int64)


class TorchRows(Dataset):
    """Sample i: ``torch.full((width,), row_value(i), int64)`` and the label ``i``."""

    def __init__(self, n: int, width: int = 64) -> None:
        self.n = n
        self.width = width

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((self.width,), row_value(i), dtype=torch.int64), i


class UnevenWork(Dataset):
    """Like :class:`TorchRows`, but the CPU work per index differs (a pseudo-random number of
    hashing rounds), so workers finish their batches in an order unrelated to sampler order —
    without a single sleep."""

    def __init__(self, n: int, width: int = 256, max_rounds: int = 4000) -> None:
        self.n = n
        self.width = width
        self.max_rounds = max_rounds

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        rounds = (i * 7919 + 104729) % 97 * self.max_rounds // 97
        h = i
        for _ in range(rounds):
            h = (h * 6364136223846793005 + 1442695040888963407) & 0xFFFFFFFFFFFFFFFF
        assert h >= 0
        return torch.full((self.width,), row_value(i), dtype=torch.int64), i


class SizedRows(Dataset):
    """Sample i: ``torch.full((width_of(i),), row_value(i) % 251, uint8)`` where the width comes
    from a schedule ``[(first index, width), ...]`` (sorted by first index)."""

    def __init__(self, n: int, schedule: Sequence[tuple[int, int]]) -> None:
        self.n = n
        self.schedule = list(schedule)

    def __len__(self) -> int:
        return self.n

    def width_of(self, i: int) -> int:
        width = self.schedule[0][1]
        for first, w in self.schedule:
            if i >= first:
                width = w
        return width

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((self.width_of(i),), row_value(i) % 251, dtype=torch.uint8)


class ListBatchSampler(Sampler):
    """Yields the given index lists, in order, every epoch (batch sizes may vary)."""

    def __init__(self, batches: Sequence[Sequence[int]]) -> None:
        self.batches = [list(b) for b in batches]

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[list[int]]:
        return iter([list(b) for b in self.batches])


def consecutive_batches(sizes: Sequence[int]) -> list[list[int]]:
    """Index lists of the given sizes over ``0, 1, 2, ...``."""
    out, start = [], 0
    for s in sizes:
        out.append(list(range(start, start + s)))
        start += s
    return out


def expected_rows(indices: Sequence[int], width: int) -> torch.Tensor:
    """The ``(len(indices), width)`` int64 batch :class:`NumpyRows` / :class:`TorchRows` give."""
    return torch.tensor([row_value(i) for i in indices], dtype=torch.int64)[:, None].expand(
        len(indices), width
    )


def scratch_collate(samples: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """A custom collate that allocates a large scratch buffer in the slot with
    :func:`shmloader.empty`, fills it, and returns a smaller ``.contiguous()`` copy of part of it
    (issue 11, bug 5)."""
    n = len(samples)
    scratch = shmloader.empty((n, 4096), dtype=torch.int64)
    scratch.zero_()
    for k, (x, _) in enumerate(samples):
        scratch[k, : x.numel()] = x
    width = samples[0][0].numel()
    return scratch[:, :width].contiguous(), torch.tensor([i for _, i in samples])


def zero_d_numpy_collate(samples: list[np.ndarray]) -> dict[str, Any]:
    """The batch's sum as a 0-d NumPy array, next to the stacked samples (issue 11, bug 9)."""
    stacked = np.stack(samples)
    return {"total": np.asarray(stacked.sum()), "rows": stacked}


# --------------------------------------------------------------- a payload that fails to rebuild


def _rebuild_marker(value: int, poisoned_pid: int) -> Marker:
    if os.getpid() == poisoned_pid:
        raise pickle.UnpicklingError(f"marker {value} refuses to rebuild in process {poisoned_pid}")
    return Marker(value, poisoned_pid)


class Marker:
    """A non-array object carried in the batch's pickled payload, whose unpickling raises in the
    process whose pid is ``poisoned_pid`` (the test's main process) and nowhere else."""

    def __init__(self, value: int, poisoned_pid: int) -> None:
        self.value = value
        self.poisoned_pid = poisoned_pid

    def __reduce__(self) -> tuple[Any, tuple[int, int]]:
        return (_rebuild_marker, (self.value, self.poisoned_pid))


class PoisonedPayload(Dataset):
    """Sample i: a tensor row and a :class:`Marker` that cannot be rebuilt in the main process
    (``main_pid`` is recorded when the dataset is made, before any worker starts)."""

    def __init__(self, n: int, poison_every: int = 1) -> None:
        self.n = n
        self.main_pid = os.getpid()
        self.poison_every = poison_every

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, Any]:
        pid = self.main_pid if i % self.poison_every == 0 else -1
        return torch.full((64,), row_value(i), dtype=torch.int64), Marker(i, pid)


def marker_collate(samples: list[tuple[torch.Tensor, Marker]]) -> tuple[torch.Tensor, list[Marker]]:
    """Stacks the rows; the markers travel as a list in the batch's pickled payload."""
    return torch.stack([x for x, _ in samples]), [m for _, m in samples]


class PairRows(Dataset):
    """Sample i: ``(row, i)`` where ``row`` is ``row_value(i)`` repeated ``width`` times, as an
    int64 torch tensor (``kind="torch"``) or NumPy array (``kind="numpy"``)."""

    def __init__(self, n: int, width: int, kind: str = "torch", max_rounds: int = 0) -> None:
        self.n = n
        self.width = width
        self.kind = kind
        self.max_rounds = max_rounds  # uneven work per index, as UnevenWork's (0: none)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[Any, int]:
        h = i
        for _ in range((i * 7919 + 104729) % 97 * self.max_rounds // 97):
            h = (h * 6364136223846793005 + 1442695040888963407) & 0xFFFFFFFFFFFFFFFF
        row = np.full(self.width, row_value(i), dtype=np.int64)
        return (torch.from_numpy(row) if self.kind == "torch" else row), i


def numpy_pair_collate(samples: list[tuple[np.ndarray, int]]) -> tuple[np.ndarray, np.ndarray]:
    """``(rows, labels)`` as NumPy arrays: the batch's leaves are NumPy arrays in the slot."""
    return np.stack([r for r, _ in samples]), np.asarray([i for _, i in samples], dtype=np.int64)
