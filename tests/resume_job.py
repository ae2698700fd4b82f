"""A training-like job for the resume tests, run as ``python -c "from tests.resume_job import main;
main()" SPEC OUT``.

SPEC is JSON: the loader's settings, ``epochs``, ``mode`` (``"save"``: run every epoch and save
the loader's state after ``save_after`` batches; ``"resume"``: load the state from ``state`` in
this fresh process, whose global RNGs are first scrambled, and run to the end). OUT receives
``torch.save({"batches": [...]})``: every batch yielded, as plain tensors. The tests run the
``"save"`` job in their own process (:func:`run`) and only the resume in a fresh one.
"""

from __future__ import annotations

import json
import random
import sys
from typing import Any

import numpy as np
import torch

from shmloader import DataLoader


class RandomAugment(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Each item draws from torch, ``random`` and NumPy, as augmentations do."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(
            [float(i), torch.rand(()).item(), random.random(), float(np.random.rand()),
             random.gauss(0, 1), float(np.random.normal())],
            dtype=torch.float64,
        )  # fmt: skip


class StatefulSampler(torch.utils.data.Sampler[int]):
    """A custom sampler with its own RNG and torchdata's ``state_dict`` protocol."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.rng = np.random.default_rng(7)

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Any:
        return iter(self.rng.permutation(self.n).tolist())

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.rng.bit_generator.state = sd["rng"]


class Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """An IterableDataset whose replicas shard ``range(n)`` by worker (so they end at different
    batches) and draw from torch, ``random`` and NumPy per item, as augmentations do."""

    def __init__(self, n: int, short_first: bool = False) -> None:
        self.n = n
        self.short_first = short_first  # worker 0's replica holds 3 items, one short batch
        self.pos = 0  # items this replica has yielded in the current pass
        self._start = 0  # where the next pass starts (a loaded state)

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        items = range(wid, self.n, nw)
        if self.short_first and wid == 0:
            items = items[:3]
        self.pos, self._start = self._start, 0
        while self.pos < len(items):
            i = items[self.pos]
            self.pos += 1
            yield torch.tensor(
                [float(i), torch.rand(()).item(), random.random(), float(np.random.rand())],
                dtype=torch.float64,
            )


class StatefulStream(Stream):
    """``Stream`` with torchdata's Stateful protocol."""

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self._start = sd["pos"]


def make_loader(spec: dict[str, Any]) -> DataLoader[Any]:
    n = spec.get("n", 37)
    kw: dict[str, Any] = {
        "num_workers": spec.get("workers", 0),
        "persistent_workers": spec.get("persistent", False),
        "in_order": spec.get("in_order", True),
        "timeout": 60 if spec.get("workers", 0) else 0,
    }
    stream = {"stream": Stream, "stateful_stream": StatefulStream}.get(spec.get("dataset", ""))
    if stream is not None:
        ds = stream(n, spec.get("short_first", False))
        return DataLoader(ds, batch_size=spec.get("batch_size", 4), **kw)
    ds = RandomAugment(n)
    if spec.get("generator") is not None:
        kw["generator"] = torch.Generator().manual_seed(spec["generator"])
    sampler = spec.get("sampler", "random")
    bs = spec.get("batch_size", 4)
    if sampler == "batch_sampler":
        inner = torch.utils.data.RandomSampler(ds, generator=kw.pop("generator", None))
        return DataLoader(ds, batch_sampler=torch.utils.data.BatchSampler(inner, bs, False), **kw)
    if sampler == "random":
        return DataLoader(ds, batch_size=bs, shuffle=True, **kw)
    if sampler == "replacement":
        s = torch.utils.data.RandomSampler(ds, replacement=True, num_samples=n + 5)
        return DataLoader(ds, batch_size=bs, sampler=s, **kw)
    if sampler == "stateful":
        return DataLoader(ds, batch_size=bs, sampler=StatefulSampler(n), **kw)
    return DataLoader(ds, batch_size=bs, shuffle=False, **kw)


def run(spec: dict[str, Any]) -> list[torch.Tensor]:
    """Run the job of ``spec`` in this process; return every batch yielded, as plain tensors."""
    loader = make_loader(spec)
    batches: list[torch.Tensor] = []
    first = 0
    if spec["mode"] == "resume":
        torch.manual_seed(12345)  # a fresh process's global RNGs hold anything
        random.seed(54321)
        np.random.seed(999)
        state = torch.load(spec["state"], weights_only=True)
        loader.load_state_dict(state)
        first = state["epoch"]
    for _ in range(first, spec["epochs"]):
        for batch in loader:
            batches.append(batch.clone())
            if spec["mode"] == "save" and len(batches) == spec["save_after"]:
                torch.save(loader.state_dict(), spec["state"])
    return batches


def main() -> None:
    spec = json.loads(sys.argv[1])
    torch.save({"batches": run(spec)}, sys.argv[2])


if __name__ == "__main__":
    main()
