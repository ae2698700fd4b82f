"""Datasets for tests/test_torch_contract.py: top level, so spawn and forkserver workers import
them by name (``tests.contract_datasets.X``)."""

from __future__ import annotations

import multiprocessing

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info


class StuckFirstDataset(Dataset):
    """Sample ``i`` is ``(worker id, i)``. Fetching index 0 blocks until the test sets
    ``released`` (once it has received every other worker's batches): the worker that took 0 is
    stuck while the others go on. The wait is bounded so a broken loader fails the test instead
    of hanging it."""

    def __init__(self, n: int = 10, ctx: str = "fork") -> None:
        self.n = n
        self.released = multiprocessing.get_context(ctx).Event()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, int]:
        if i == 0 and not self.released.wait(timeout=30):
            raise TimeoutError("index 0 waited 30 s for the last index to be fetched")
        info = get_worker_info()
        return (info.id if info is not None else -1), i


class NestedTensorDataset(Dataset):
    """Sample ``i`` holds a nested tensor of ragged rows ``[i], [i, i+1], ...`` and a plain one."""

    def __init__(self, n: int = 6) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        rows = [torch.arange(i, i + k + 1, dtype=torch.float32) for k in range(3)]
        return {"nested": torch.nested.nested_tensor(rows), "plain": torch.full((2,), i)}


def list_collate(batch: list) -> list:
    return list(batch)


class RangeIterable(IterableDataset):
    """0 .. n-1, split between workers by worker id."""

    def __init__(self, n: int = 40) -> None:
        self.n = n

    def __iter__(self):  # type: ignore[no-untyped-def]
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        return iter(range(wid, self.n, nw))


class SmallTensors(Dataset):
    def __init__(self, n: int = 200) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((16,), i)
