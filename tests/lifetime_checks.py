"""Checks shared by the lifetime tests: slot states, batches against the dataset, and a guard
that keeps a failing test's loaders from outliving it."""

from __future__ import annotations

import functools
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import shmloader
from tests.lifetime_datasets import expected_rows


def states(loader: shmloader.DataLoader[Any]) -> dict[str, int]:
    st = loader.stats()
    assert st.arena is not None
    return dict(st.arena.slots_by_state)


def rows_ok(x: torch.Tensor | np.ndarray, indices: range | list[int], width: int) -> bool:
    return torch.equal(torch.as_tensor(x), expected_rows(list(indices), width))


def batch_ok(x: torch.Tensor, y: torch.Tensor, k: int, width: int, size: int = 4) -> bool:
    """Whether ``(x, y)`` is batch ``k`` (of ``size`` consecutive indices) of a TorchRows."""
    indices = range(size * k, size * k + size)
    return rows_ok(x, indices, width) and y.tolist() == list(indices)


def frees_its_loaders_on_failure(test: Callable[..., None]) -> Callable[..., None]:
    """A failing test's traceback keeps its frames, and with them its loaders, iterators and
    workers, alive past the suite's no-leak guard; clear those frames before pytest keeps them
    (messages stay, local variables go)."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        try:
            test(*args, **kwargs)
        except BaseException as e:
            traceback.clear_frames(e.__traceback__)
            raise

    return run
