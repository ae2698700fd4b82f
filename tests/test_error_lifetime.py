"""An iterator the user drops after catching an error goes with its last reference: its workers
stop and its slots go back then, not at some later garbage collection (review 81).

A retry loop (``for attempt in range(3): try: train() except ...: continue``) on a machine with
little RAM must not find the failed attempt's workers and arena memory still held while the next
attempt starts its own. Each test runs with the garbage collector off: what is still alive after
the last reference goes is held by a reference cycle (until then a full collection, which in a
long-running program can be minutes away).
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

import shmloader
from shmloader import DevicePrefetcher
from shmloader.prefetch import map_tensors
from tests.lifetime_checks import frees_its_loaders_on_failure, states

BAD = 5  # the sample that raises


class TwoArgsError(Exception):
    """An exception torch cannot build again from its message: it raises a RuntimeError."""

    def __init__(self, what: str, where: int) -> None:
        super().__init__(what, where)


class Raises(Dataset[torch.Tensor]):
    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == BAD:
            if self.kind == "KeyError":
                raise KeyError(f"no sample {i}")
            if self.kind == "TwoArgsError":
                raise TwoArgsError("no sample", i)
            raise ValueError(f"no sample {i}")
        return torch.tensor([i])


class _Done:
    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class CloningEngine:
    """A stand-in for the CUDA copy engine: the "device" batch is a clone, complete at once."""

    def copy(self, batch: Any) -> tuple[Any, _Done]:
        return map_tensors(batch, torch.clone), _Done()

    def hand_over(self, device_batch: Any, event: Any) -> None:
        pass


# What the user catches from a worker (torch's ExceptionWrapper.reraise)
RAISED = {"ValueError": ValueError, "KeyError": KeyError, "TwoArgsError": RuntimeError}


@pytest.fixture
def no_gc() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.parametrize("through", ["loader", "DevicePrefetcher"])
@pytest.mark.parametrize("kind", list(RAISED))
@pytest.mark.parametrize("workers", ["0 workers", "2 workers", "persistent"])
@frees_its_loaders_on_failure
def test_an_iterator_dropped_after_an_error_goes_with_its_last_reference(
    workers: str, kind: str, through: str, no_gc: None
) -> None:
    """The error reaches the user with torch's type and words; once the user lets go of it and
    of the iterator, the iterator is gone, and (the loader kept) every slot is free again."""
    loader = shmloader.DataLoader(
        Raises(kind), batch_size=2, num_workers=0 if workers == "0 workers" else 2,
        persistent_workers=workers == "persistent", timeout=0 if workers == "0 workers" else 30,
    )  # fmt: skip
    source: Any = loader
    if through == "DevicePrefetcher":
        source = DevicePrefetcher(loader, "cuda", engine=CloningEngine())
    it = iter(source)
    inner = weakref.ref(getattr(it, "source", it))  # the loader's own iterator
    got: list[Any] = []
    # (without workers the dataset's own error reaches the user, as in torch)
    expected = TwoArgsError if workers == "0 workers" and kind == "TwoArgsError" else RAISED[kind]
    with pytest.raises(expected) as raised:
        for batch in it:
            got.append(batch)
    assert len(got) == BAD // 2
    if workers != "0 workers":
        assert str(raised.value).startswith(f"Caught {kind} in DataLoader worker process")
    del raised, got, batch, it
    if workers == "persistent":  # the loader keeps its iterator: it goes with the loader
        del loader, source
        assert inner() is None, "the dropped loader's iterator is still alive"
        return
    assert inner() is None, "the dropped iterator is still alive"
    if workers != "0 workers":
        st = states(loader)
        assert st["free"] == sum(st.values()), st


@frees_its_loaders_on_failure
def test_a_loader_retried_after_an_error_holds_one_iterators_slots(no_gc: None) -> None:
    """The retry loop of the module docstring: each attempt's iterator is gone before the next
    one starts, so the arena never holds two attempts' slots."""
    loader = shmloader.DataLoader(Raises("ValueError"), batch_size=2, num_workers=2, timeout=30)
    for _ in range(3):
        try:
            for batch in loader:
                del batch  # (the loop's variable would keep the last batch's slot)
        except ValueError:
            pass
        st = states(loader)
        assert st["free"] == sum(st.values()), st
