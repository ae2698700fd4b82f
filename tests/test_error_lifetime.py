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
import traceback
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

import shmloader
from shmloader import DevicePrefetcher
from shmloader.epoch import ShmDataLoaderIter
from shmloader.single import SingleProcessIter
from tests.lifetime_checks import frees_its_loaders_on_failure, states
from tests.shmloader.fakes import CloningEngine

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


# What the user catches from a worker (torch's ExceptionWrapper.reraise)
_ITERATORS = (ShmDataLoaderIter, SingleProcessIter)
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


def _dropped_after_error(loader: shmloader.DataLoader[Any], error: type[BaseException]) -> bool:
    """Iterate ``loader`` until it raises ``error``, drop the iterator: whether it is gone."""
    it = iter(loader)
    gone = weakref.ref(it)
    with pytest.raises(error):
        for batch in it:
            del batch
    del it
    return gone() is None


@pytest.mark.parametrize("column", ["ragged list", "null in the first row"])
@frees_its_loaders_on_failure
def test_arrow_collate_errors_keep_no_cycle_to_the_iterator(
    column: str, tmp_path: Any, no_gc: None
) -> None:
    """Review 81: shmloader.arrow's own collate errors (raised in the main process without
    workers) were kept in a local of the frame their traceback holds."""
    pa = pytest.importorskip("pyarrow")
    from shmloader.arrow import ArrowDataset
    from tests.arrow_files import write_file

    if column == "ragged list":
        table = pa.table({"t": pa.array([list(range(i % 3)) for i in range(16)])})
    else:
        table = pa.table({"s": pa.array([None if i == 0 else f"x{i}" for i in range(16)])})
    dataset = ArrowDataset(write_file(table, tmp_path / "t.arrow"))
    loader = shmloader.DataLoader(dataset, batch_size=8)
    assert _dropped_after_error(loader, RuntimeError if column == "ragged list" else TypeError)


@pytest.mark.parametrize("workers", [0, 2])
@frees_its_loaders_on_failure
def test_an_arrow_dataset_unpickled_after_its_file_changed_keeps_no_iterator(
    workers: int, tmp_path: Any
) -> None:
    """Review 81: such a dataset raised the error it keeps itself, at every use, so the error
    took the traceback of each raise: the dataset, alive with its loader, kept the last iterator
    it failed in (with workers, its worker processes) even past a garbage collection. It raises
    a copy, with the same words, each time."""
    pa = pytest.importorskip("pyarrow")
    import copy

    import numpy as np

    from shmloader.arrow import ArrowDataset, ArrowSourceError
    from tests.arrow_files import write_file

    path = write_file(pa.table({"y": np.arange(40)}), tmp_path / "t.arrow")
    dataset = ArrowDataset(path)
    write_file(pa.table({"y": np.full(40, 2)}), path)  # rewritten in place
    broken = copy.deepcopy(dataset)  # (a pickle round trip, as a checkpoint or a spawn makes)
    more: dict[str, Any] = {"num_workers": workers, "timeout": 30} if workers else {}
    loader = shmloader.DataLoader(broken, batch_size=4, **more)
    words = []
    for _ in range(2):  # (with workers, iter() raises: the sampler's first draws ask len())
        before = {id(o) for o in gc.get_objects() if isinstance(o, _ITERATORS)}
        with pytest.raises(ArrowSourceError, match="changed since it was opened") as raised:
            next(iter(loader))
        words.append(str(raised.value))
        del raised
        gc.collect()
        left = [o for o in gc.get_objects() if isinstance(o, _ITERATORS) and id(o) not in before]
        assert left == [], "the dataset keeps the iterator it failed in"
    assert words[0] == words[1]
    assert broken._broken is not None and broken._broken.__traceback__ is None


class _Caller:
    """Stands for the iterator whose frames an error's traceback holds."""

    def call(self, fn: Any) -> None:
        fn()


def _caller_freed_after(fn: Any, error: type[BaseException]) -> bool:
    """Call ``fn`` from a method of an object, catch ``error``, drop it: whether the object is
    gone (with the collector off: the error made no cycle with the frames it passed)."""
    caller = _Caller()
    gone = weakref.ref(caller)
    with pytest.raises(error):
        caller.call(fn)
    del caller
    return gone() is None


def test_teardown_steps_raise_their_first_error_without_a_cycle(no_gc: None) -> None:
    """Review 81: ``host._every`` (the arena host's teardown) kept the first error in a local."""
    from shmloader.host import _every

    def fails() -> None:
        raise RuntimeError("a teardown step failed")

    assert _caller_freed_after(lambda: _every(fails, lambda: None), RuntimeError)


def test_an_arena_close_that_raises_keeps_no_cycle(no_gc: None, monkeypatch: Any) -> None:
    """Review 81: ``Arena.close`` kept the error of its books' last step in a local."""
    from arena import Arena

    arena = Arena(backend="memfd", max_bytes=1 << 20)

    def fails() -> None:
        raise RuntimeError("hollowing failed")

    monkeypatch.setattr(arena, "_hollow_free", fails)
    assert _caller_freed_after(arena.close, RuntimeError)


@frees_its_loaders_on_failure
def test_unpickling_a_changed_arrow_dataset_in_a_handler_leaves_the_users_traceback(
    tmp_path: Any,
) -> None:
    """Review 82: the error such a dataset keeps was made traceless with its whole chain, the
    exception the caller was handling (its ``__context__``) included: that one's traceback was
    wiped, so a bare ``raise`` after the unpickling lost where the user's own error came from.
    It is left alone, and the kept error no longer names it as its context."""
    pa = pytest.importorskip("pyarrow")
    import copy

    import numpy as np

    from shmloader.arrow import ArrowDataset, ArrowSourceError
    from tests.arrow_files import write_file

    path = write_file(pa.table({"y": np.arange(40)}), tmp_path / "t.arrow")
    dataset = ArrowDataset(path)
    write_file(pa.table({"y": np.full(40, 2)}), path)
    try:
        raise LookupError("the user's own")
    except LookupError as handled:
        frames = len(traceback.extract_tb(handled.__traceback__))
        broken = copy.deepcopy(dataset)
        assert len(traceback.extract_tb(handled.__traceback__)) == frames >= 1
    with pytest.raises(ArrowSourceError) as raised:
        len(broken)
    assert not isinstance(raised.value.__context__, LookupError)
