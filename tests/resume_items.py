"""Helpers of the in-process resume tests: a run that saves a loader's state after k *items*
(what one ``next()`` gave: a batch, or an error the loop caught and went on past, as torch
allows), and a fresh loader resumed from it with its global RNGs scrambled, as a fresh process's
would be. Every loop is bounded (:data:`CAP` items), so a regression that makes a loader fail every
batch forever fails the test instead of hanging it. Test modules import :func:`own_rngs`, which
restores the global RNGs of torch, ``random`` and NumPy after each test."""

from __future__ import annotations

import contextlib
import io
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from shmloader import DataLoader, rngstate

Item = tuple[str, bytes]  # ("B", the batch's bytes) or ("ERR", the error's type name)
MakeLoader = Callable[[], DataLoader[Any]]
CAP = 200  # no run here has that many items: reaching it means a loop that never ends
TIMEOUT = 60


@contextlib.contextmanager
def kept_rngs() -> Iterator[None]:
    """Leave the global RNGs of torch, ``random`` and NumPy as they were before the block."""
    saved = rngstate.capture()
    try:
        yield
    finally:
        rngstate.restore(saved)


@pytest.fixture(autouse=True)
def own_rngs() -> Iterator[None]:
    """Leave the global RNGs of torch, ``random`` and NumPy as they were before the test."""
    with kept_rngs():
        yield


def seed_all(s: int) -> None:
    torch.manual_seed(s)
    random.seed(s)
    np.random.seed(s)


def batch_bytes(batch: Any) -> bytes:
    if isinstance(batch, torch.Tensor):
        t = batch.contiguous()
        return f"{t.dtype}{tuple(t.shape)}".encode() + t.numpy().tobytes()
    if isinstance(batch, list | tuple):
        return b"[" + b"|".join(batch_bytes(b) for b in batch) + b"]"
    return repr(batch).encode()


def roundtrip(sd: dict[str, Any]) -> dict[str, Any]:
    """The state as a checkpoint holds it: through ``torch.save`` and ``weights_only`` load."""
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)  # type: ignore[no-any-return]


def next_item(it: Iterator[Any], key: Callable[[Any], bytes] = batch_bytes) -> Item | None:
    """One ``next()``: the batch (its ``key``), the error it raised (caught, as a training loop
    may), or None at the end of the epoch."""
    try:
        batch = next(it)
    except StopIteration:
        return None
    except Exception as e:  # noqa: BLE001 - the loop under test catches any dataset error
        return ("ERR", type(e).__name__.encode())
    return ("B", key(batch))


def drain(it: Iterator[Any], items: list[Item], key: Callable[[Any], bytes] = batch_bytes) -> None:
    """Append ``it``'s items up to the end of its epoch, or until ``items`` holds :data:`CAP`."""
    while len(items) < CAP:
        item = next_item(it, key)
        if item is None:
            return
        items.append(item)


def saving_run(
    loader: DataLoader[Any], epochs: int, save_after: int
) -> tuple[list[Item], dict[str, Any]]:
    """Every item of ``epochs`` epochs, and the loader's state saved after ``save_after`` items
    (mid-epoch: before the ``next()`` that gives item ``save_after``)."""
    items: list[Item] = []
    state: dict[str, Any] | None = None
    for _ in range(epochs):
        it = iter(loader)
        while len(items) < CAP:
            if len(items) == save_after and state is None:
                state = roundtrip(loader.state_dict())
            item = next_item(it)
            if item is None:
                break
            items.append(item)
        del it
    assert state is not None, f"the run had {len(items)} items, never {save_after}"
    return items, state


def resumed_run(
    make: MakeLoader, state: dict[str, Any], epochs: int, key: Callable[[Any], bytes] = batch_bytes
) -> list[Item]:
    """A fresh loader, its global RNGs scrambled, loaded with ``state`` and run to the end."""
    seed_all(12345)
    loader = make()
    loader.load_state_dict(state)
    items: list[Item] = []
    for _ in range(state["epoch"], epochs):
        drain(iter(loader), items, key)
    return items


def uninterrupted_and_resumed(
    make: MakeLoader, epochs: int, save_after: int
) -> tuple[list[Item], list[Item], list[Item]]:
    """(items before the save, the uninterrupted run's items after it, the resumed run's)."""
    seed_all(0)
    full, state = saving_run(make(), epochs, save_after)
    return full[:save_after], full[save_after:], resumed_run(make, state, epochs)
