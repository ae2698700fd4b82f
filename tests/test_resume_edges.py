"""Exact resume at the edges review 16 found: a state taken after an abandoned epoch whose
batches had been read ahead, between epochs of a dataset that counts its own epochs, mid-epoch
of persistent workers that shuffle on their own, with samplers that draw in ``iter()``, and loads
that must be refused (or allowed) with the right words.

Each test saves a state in this process and resumes it in a fresh loader whose global RNGs were
scrambled (:mod:`tests.resume_items`), and compares with the uninterrupted run, item for item.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import random
import signal
import threading
import traceback
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    Dataset,
    IterableDataset,
    RandomSampler,
    Sampler,
    get_worker_info,
)

from arena.errors import ArenaExhaustedError
from shmloader import DataLoader, DevicePrefetcher
from tests.fault_datasets import Gate, Gated, Ramp
from tests.forked import exit_code_of_fork
from tests.lifetime_checks import frees_its_loaders_on_failure
from tests.resume_items import (
    TIMEOUT,
    Item,
    batch_bytes,
    drain,
    next_item,
    own_rngs,
    resumed_run,
    roundtrip,
    saving_run,
    seed_all,
    uninterrupted_and_resumed,
)
from tests.shmloader.fakes import CloningEngine, DoneEvent

__all__ = ["own_rngs"]  # the autouse fixture, imported to apply here

N = 24


def _worker() -> tuple[int, int]:
    info = get_worker_info()
    return (info.id, info.num_workers) if info is not None else (0, 1)


class Augment(Dataset):  # type: ignore[type-arg]
    """Each item draws from torch, ``random`` and NumPy, as augmentations do."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(
            [float(i), torch.rand(()).item(), random.random(), float(np.random.rand())],
            dtype=torch.float64,
        )


# -- an epoch abandoned with answers read ahead ------------------------------------------------


def test_a_state_after_an_abandoned_epoch_counts_the_batches_read_ahead() -> None:
    """F1: the user leaves an epoch after two batches, when the workers' answers to the tasks
    after them have been read but not consumed. Abandoning the epoch consumes them: each
    worker's RNG moved past their draws, so a state taken before the next epoch's first batch
    must carry the RNG after them (it carried the RNG after the last batch consumed)."""

    def make() -> DataLoader[Any]:
        return DataLoader(Augment(), batch_size=3, shuffle=True, num_workers=2,
                          persistent_workers=True, timeout=TIMEOUT)  # fmt: skip

    seed_all(0)
    loader = make()
    it = iter(loader)
    next(it)
    next(it)
    tasks = it._dispatch.tasks
    while any(info.answer is None for info in tasks):  # every answer in flight read, none used
        it._receive()
    assert len(list(tasks)) >= 2, "no answer read ahead: the test needs some"
    it = iter(loader)  # epoch 0 abandoned
    state = roundtrip(loader.state_dict())
    expected: list[Item] = []
    drain(it, expected)
    drain(iter(loader), expected)
    assert len(expected) == 2 * N // 3
    assert resumed_run(make, state, 3) == expected


# -- a Stateful stream saved between epochs ---------------------------------------------------


class Positioned(IterableDataset):  # type: ignore[type-arg]
    """Stateful (torchdata's protocol), its state the position in the current pass: ``iter()``
    starts a pass from the start unless ``load_state_dict`` gave a position (the usual kind)."""

    def __init__(self) -> None:
        self.pos = 0
        self._start = 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        wid, nw = _worker()
        shard = [i for i in range(N) if i % nw == wid]
        self.pos, self._start = self._start, 0
        while self.pos < len(shard):
            self.pos += 1
            yield torch.tensor([float(shard[self.pos - 1]), torch.rand(()).item()])

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self._start = sd["pos"]


@pytest.mark.parametrize("workers", [0, 2], ids=["0 workers", "2 persistent workers"])
@pytest.mark.parametrize("saved", ["between epochs", "after 1 batch of epoch 1"])
def test_a_stateful_stream_resumes_its_next_epoch_whole(workers: int, saved: str) -> None:
    """A state between epochs carries no replica state: the next epoch starts from each
    replica's ``iter()``, as a fresh loader's does. (Review 16 F2 proposed carrying the state
    the last fetch left, for datasets that count their own epochs; review 19 showed that this
    resumes a position-keeping stream at its end, with an empty epoch, and loses the shards of
    persistent workers that had delivered nothing yet: 0 and 2 of 6 batches.)"""

    def make() -> DataLoader[Any]:
        return DataLoader(Positioned(), batch_size=4, num_workers=workers,
                          persistent_workers=workers > 0,
                          timeout=TIMEOUT if workers else 0)  # fmt: skip

    per_epoch = N // 4
    save_after = per_epoch if saved == "between epochs" else per_epoch + 1
    seed_all(0)
    loader = make()
    items: list[Item] = []
    state: dict[str, Any] | None = None
    between = saved == "between epochs"
    for _ in range(3):
        if between and len(items) == save_after:  # after the StopIteration, before iter()
            state = roundtrip(loader.state_dict())
        it = iter(loader)
        while (item := next_item(it)) is not None:
            items.append(item)
            if not between and len(items) == save_after:
                state = roundtrip(loader.state_dict())
    assert state is not None and state["in_epoch"] is not between
    assert resumed_run(make, state, 3) == items[save_after:]


class RewindsAtPassEnd(IterableDataset):  # type: ignore[type-arg]
    """Stateful, its state the position in the pass, which it sets back to 0 once a pass ends
    (so the next ``iter()`` starts over): 10 items, sharded by worker."""

    def __init__(self) -> None:
        self.pos = 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        wid, nw = _worker()
        shard = [i for i in range(10) if i % nw == wid]
        while self.pos < len(shard):
            self.pos += 1
            yield torch.tensor([float(shard[self.pos - 1]), torch.rand(()).item()])
        self.pos = 0

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.pos = sd["pos"]


@pytest.mark.parametrize("at", ["last batch", "one before"])
@pytest.mark.parametrize("workers", [0, 2, "persistent"])
def test_a_stream_that_ran_out_inside_a_short_batch_resumes_past_it(
    workers: int | str, at: str
) -> None:
    """Review 31: a replica that ran out inside a short last batch had already rewound its
    state to the start of a pass, so a state saved there resumed a whole pass again (6 extra
    batches with 2 workers). The state records that the replica ended, and the resumed one
    ends there, as torch's fetcher does after a short batch."""
    n = 0 if workers == 0 else 2

    def make() -> DataLoader[Any]:
        return DataLoader(RewindsAtPassEnd(), batch_size=4, num_workers=n,
                          persistent_workers=workers == "persistent",
                          timeout=TIMEOUT if n else 0)  # fmt: skip

    per_epoch = 3 if n == 0 else 4  # 4 + 4 + 2, or per worker of 5 items: 4 + 1
    save_after = per_epoch - (at == "one before")
    _, after, resumed = uninterrupted_and_resumed(make, 2, save_after)
    assert len(after) == 2 * per_epoch - save_after
    assert resumed == after


# -- datasets and samplers that shuffle with the global RNGs -----------------------------------


class ShuffledShards(IterableDataset):  # type: ignore[type-arg]
    """Not Stateful: each replica shuffles its shard with ``random`` as its iteration starts
    (in a generator, or at once in ``__iter__``), and draws from torch per item."""

    def __init__(self, eager: bool = False) -> None:
        self.eager = eager

    def __iter__(self) -> Iterator[torch.Tensor]:
        wid, nw = _worker()
        order = [i for i in range(N) if i % nw == wid]
        if self.eager:
            random.shuffle(order)
            return iter([torch.tensor([float(i)]) for i in order])
        return self._items(order)

    @staticmethod
    def _items(order: list[int]) -> Iterator[torch.Tensor]:
        random.shuffle(order)
        for i in order:
            yield torch.tensor([float(i), torch.rand(()).item()])


@pytest.mark.parametrize("save_after", [3, 9])  # epoch 0, epoch 1 (6 batches an epoch)
def test_persistent_workers_fast_forward_from_where_their_epoch_began(save_after: int) -> None:
    """F3: in epoch 1 a persistent worker's replica began its pass with the RNG the worker had
    after epoch 0, but a resumed worker fast-forwarded it from its fresh seed."""

    def make() -> DataLoader[Any]:
        return DataLoader(ShuffledShards(), batch_size=4, num_workers=2, persistent_workers=True,
                          timeout=TIMEOUT)  # fmt: skip

    _, expected, resumed = uninterrupted_and_resumed(make, 3, save_after)
    assert len(expected) == 18 - save_after
    assert resumed == expected


@pytest.mark.parametrize("eager", [False, True], ids=["generator", "eager"])
def test_no_workers_fast_forward_replays_the_epochs_own_draws(eager: bool) -> None:
    """F11: with ``num_workers=0`` the replica shuffled with the global RNG as it stood at
    ``state_dict()``, not at the epoch's start (with workers it was exact)."""

    def make() -> DataLoader[Any]:
        return DataLoader(ShuffledShards(eager), batch_size=4)

    _, expected, resumed = uninterrupted_and_resumed(make, 2, 2)
    assert len(expected) == 10
    assert resumed == expected


class EagerPermutation(Sampler[int]):
    """Draws its whole permutation from the global torch RNG when ``iter()`` is called."""

    def __len__(self) -> int:
        return N

    def __iter__(self) -> Iterator[int]:
        return iter(torch.randperm(N).tolist())


class EagerBatches(Sampler[list[int]]):
    """A batch sampler that shuffles with ``random`` when ``iter()`` is called."""

    def __len__(self) -> int:
        return N // 4

    def __iter__(self) -> Iterator[list[int]]:
        idx = list(range(N))
        random.shuffle(idx)
        return iter([idx[i : i + 4] for i in range(0, N, 4)])


SAMPLERS: dict[str, Callable[[], dict[str, Any]]] = {
    "batch_size=None, eager sampler": lambda: {"batch_size": None, "sampler": EagerPermutation()},
    "eager batch_sampler": lambda: {"batch_sampler": EagerBatches()},
}


@pytest.mark.parametrize("save_after", [1, 4], ids=["epoch 0", "epoch 1"])
@pytest.mark.parametrize("workers", [0, 2, "persistent"])
@pytest.mark.parametrize("sampler", list(SAMPLERS))
def test_a_sampler_that_draws_in_iter_resumes_exactly(
    sampler: str, workers: int | str, save_after: int
) -> None:
    """F4: with ``num_workers=0`` the epoch's start was taken after torch's ``__init__`` had
    called ``iter()`` of the sampler, so the resumed epoch drew another permutation. F5: with
    workers, the draws of the resumed iterator's own ``__init__`` were undone for torch's RNG
    only, so a ``random`` one moved the next epoch's."""
    nw = 2 if workers == "persistent" else int(workers)
    spec = SAMPLERS[sampler]()
    per_epoch = N if spec.get("batch_size", 1) is None else N // 4
    save = save_after if per_epoch == N // 4 else save_after * 4

    def make() -> DataLoader[Any]:
        return DataLoader(Augment(), num_workers=nw, persistent_workers=workers == "persistent",
                          timeout=TIMEOUT if nw else 0, **SAMPLERS[sampler]())  # fmt: skip

    _, expected, resumed = uninterrupted_and_resumed(make, 3, save)
    assert len(expected) == 3 * per_epoch - save
    assert resumed == expected


# -- a replica state the dataset goes on changing ----------------------------------------------


class LiveState(IterableDataset):  # type: ignore[type-arg]
    """Stateful: ``state_dict()`` returns its live dict, which iterating goes on changing."""

    def __init__(self) -> None:
        self.st = {"pos": 0}
        self._start = 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        self.st["pos"], self._start = self._start, 0
        while self.st["pos"] < N:
            self.st["pos"] += 1
            yield torch.tensor([float(self.st["pos"])])

    def state_dict(self) -> dict[str, int]:
        return self.st

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self._start = sd["pos"]


def test_a_replica_state_is_copied_when_saved_without_workers() -> None:
    """F7: with ``num_workers=0`` the state held the dataset's own dict, so a state kept in
    memory (not yet written out) changed as the epoch went on."""
    loader = DataLoader(LiveState(), batch_size=4)
    it = iter(loader)
    next(it)
    next(it)
    state = loader.state_dict()  # kept as it is: no torch.save round trip
    expected: list[Item] = []
    drain(it, expected)
    resumed = DataLoader(LiveState(), batch_size=4)
    resumed.load_state_dict(state)
    got: list[Item] = []
    drain(iter(resumed), got)
    assert len(expected) == N // 4 - 2
    assert got == expected


# -- loads refused, and allowed --------------------------------------------------------------


def _state_of(loader: DataLoader[Any], k: int = 2) -> dict[str, Any]:
    it = iter(loader)
    for _ in range(k):
        next(it)
    return loader.state_dict()


@pytest.mark.parametrize(
    ("saved", "loaded", "named"),
    [
        (lambda ds: {"batch_sampler": BatchSampler(RandomSampler(ds), 4, False)},
         lambda ds: {"batch_sampler": BatchSampler(RandomSampler(ds), 5, False)},
         "batch_sampler.batch_size"),
        (lambda ds: {"batch_sampler": BatchSampler(RandomSampler(ds), 4, False)},
         lambda ds: {"batch_sampler": BatchSampler(RandomSampler(ds), 4, True)},
         "batch_sampler.drop_last"),
        (lambda ds: {"sampler": RandomSampler(ds, num_samples=20), "batch_size": 4},
         lambda ds: {"sampler": RandomSampler(ds, num_samples=40), "batch_size": 4},
         "batches"),
    ],
    ids=["batch_sampler's batch size", "batch_sampler's drop_last", "sampler's length"],
)  # fmt: skip
def test_a_state_of_other_sampling_is_refused_naming_it(
    saved: Callable[[Any], dict[str, Any]], loaded: Callable[[Any], dict[str, Any]], named: str
) -> None:
    """F8: these loaded silently (the fingerprint held the loader's batch size and drop_last,
    None and False under ``batch_sampler=``, and never the number of batches)."""
    ds = Augment()
    sd = _state_of(DataLoader(ds, **saved(ds)))
    with pytest.raises(ValueError, match=f"mismatch: it was saved with {named}="):
        DataLoader(ds, **loaded(ds)).load_state_dict(sd)


@pytest.mark.parametrize("key", ["yielded", "yielded_extra"])
def test_a_state_past_the_epochs_end_is_refused_at_load(key: str) -> None:
    """F9: a ``yielded`` past the epoch's end loaded, and every ``iter()`` then raised a bare
    StopIteration, for good."""
    sd = _state_of(DataLoader(Augment(), batch_size=4, in_order=False))
    bad = {**sd, key: 1000 if key == "yielded" else [1000]}
    with pytest.raises(ValueError, match=r"corrupted DataLoader state.*epoch of 6 batches"):
        DataLoader(Augment(), batch_size=4, in_order=False).load_state_dict(bad)


class Unsized(Sampler[int]):
    """No ``__len__``: the loader cannot tell at load how many batches an epoch has."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_sampler_shorter_than_the_state_is_refused_at_iter_once(workers: int) -> None:
    """F9: found only when ``iter()`` replays the draws: a ValueError naming both lengths, and
    the next ``iter()`` starts afresh (before, a bare StopIteration, at every ``iter()``)."""

    def make(n: int) -> DataLoader[Any]:
        return DataLoader(Augment(), batch_size=2, sampler=Unsized(n), num_workers=workers,
                          timeout=TIMEOUT if workers else 0)  # fmt: skip

    sd = _state_of(make(20), k=3)
    short = make(4)
    short.load_state_dict(sd)
    with pytest.raises(ValueError, match=r"saved after 3 batches.*sampler ends after 2"):
        iter(short)
    assert [b[:, 0].tolist() for b in short] == [[0.0, 1.0], [2.0, 3.0]]


def test_a_loader_whose_worker_died_takes_the_last_good_state() -> None:
    """F10: after a worker's death (its iterator unusable, persistent workers), loading the
    last good state was refused as if the loader were mid-epoch."""

    def make() -> DataLoader[Any]:
        return DataLoader(Augment(), batch_size=4, shuffle=True, num_workers=2,
                          persistent_workers=True, timeout=TIMEOUT)  # fmt: skip

    seed_all(0)
    loader = make()
    it = iter(loader)
    next(it)
    good = roundtrip(loader.state_dict())
    expected: list[Item] = []
    drain(it, expected)
    drain(iter(loader), expected)
    it = iter(loader)
    # Before any next(): worker 0 owes task 4 at the latest (tasks 0-3 were sent by iter()).
    os.kill(it._workers[0].pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match="killed by signal"):
        for _ in range(N):
            next(it)
    with pytest.raises(RuntimeError, match="iterator is unusable"):
        loader.state_dict()  # it says why its epoch ended
    seed_all(12345)
    loader.load_state_dict(good)
    got: list[Item] = []
    drain(iter(loader), got)
    drain(iter(loader), got)
    assert got == expected


# -- batches a DevicePrefetcher holds ahead of the user ------------------------------------------


class LazyDraws(Sampler[int]):
    """Draws each index from the global ``random`` as it is asked for (torch's samplers draw
    their permutation at once)."""

    def __len__(self) -> int:
        return N

    def __iter__(self) -> Iterator[int]:
        for _ in range(N):
            yield random.randrange(N)


PREFETCHED: dict[str, Callable[[], DataLoader[Any]]] = {
    "0 workers": lambda: DataLoader(Augment(), batch_size=2, shuffle=True),
    "2 workers": lambda: DataLoader(Augment(), batch_size=2, shuffle=True, num_workers=2,
                                    timeout=TIMEOUT),
    "persistent": lambda: DataLoader(Augment(), batch_size=2, shuffle=True, num_workers=2,
                                     persistent_workers=True, timeout=TIMEOUT),
    "in_order=False": lambda: DataLoader(Augment(), batch_size=2, shuffle=True, num_workers=2,
                                         in_order=False, timeout=TIMEOUT),
    "stateful stream": lambda: DataLoader(Positioned(), batch_size=2, num_workers=2,
                                          timeout=TIMEOUT),
    "stream, no state": lambda: DataLoader(ShuffledShards(), batch_size=2, num_workers=2,
                                           persistent_workers=True, timeout=TIMEOUT),
    "stream, 0 workers": lambda: DataLoader(ShuffledShards(), batch_size=2),
    "lazy global sampler": lambda: DataLoader(Augment(), batch_size=2, sampler=LazyDraws(),
                                              num_workers=2, timeout=TIMEOUT),
}  # fmt: skip


@pytest.mark.parametrize("depth", [1, 3])
@pytest.mark.parametrize("case", list(PREFETCHED))
def test_a_state_saved_behind_a_device_prefetcher_resumes_at_the_users_batch(
    case: str, depth: int
) -> None:
    """F6: the loader counted the batches the DevicePrefetcher took ahead as consumed, so a
    state saved after the user's k-th batch resumed past the ones it had not seen. Saved in
    epoch 1 at its 3rd batch, and in the epoch's last batches (the loader already at its end).
    Review 19: a stream with no workers resumed one batch short there (the fetch that found the
    stream's end was counted), and a sampler drawing from the global RNG as it goes skipped the
    draws of the batches behind (the state's RNGs were those after them)."""
    for save_after, rest, got in _saved_in_the_loop_and_resumed(
        PREFETCHED[case], lambda loader: DevicePrefetcher(loader, "cuda", depth=depth,
                                                          engine=CloningEngine())
    ):  # fmt: skip
        if case == "in_order=False":  # which batch comes when, and from which worker's random
            # stream, is timing's (README): each batch of sample indices comes once
            assert sorted(map(_indices, got)) == sorted(map(_indices, rest))
        else:
            assert got == rest, f"saved after {save_after}"


def _train(loader: DataLoader[Any], depth: int | None, steps: list[int | None],
           save_after: int = 0, draws: bool = True,
           ) -> tuple[list[tuple[bytes, float, float]], dict[str, Any] | None]:
    """Epochs of a training loop over ``DevicePrefetcher(loader)`` (``depth`` None: over the
    loader itself): epoch ``e`` takes at most ``steps[e]`` batches (None: all of them), and
    with ``draws`` each step draws from the global torch and ``random`` RNGs as a model's
    dropout or a loop's own augmentation does. What each step saw and drew, and the loader's
    state after step ``save_after`` (counted over all epochs)."""
    seen: list[tuple[bytes, float, float]] = []
    state = None
    for limit in steps:
        batches = iter(loader if depth is None else
                       DevicePrefetcher(loader, "cuda", depth=depth, engine=CloningEngine()))
        if limit == 0:
            continue  # the loop's iter(), and no step
        for taken, batch in enumerate(batches, 1):
            drawn = (torch.rand(()).item(), random.random()) if draws else (0.0, 0.0)
            seen.append((batch_bytes(batch), *drawn))
            if len(seen) == save_after:
                state = roundtrip(loader.state_dict())
            if taken == limit:
                break
    return seen, state


def _resumes_exactly(make: Callable[[], DataLoader[Any]], depth: int, save_after: int) -> None:
    """Two epochs of ``_train`` behind a prefetcher of ``depth``, the state saved after
    ``save_after`` batches (some rewound), and a loader resumed from it: the same batches."""
    seed_all(0)
    seen, state = _train(make(), depth, [None, None], save_after=save_after, draws=False)
    assert state is not None and state["rewound_rngs"]
    seed_all(1)
    resumed = make()
    resumed.load_state_dict(state)
    got, _ = _train(resumed, depth, [None, None], draws=False)
    assert got == seen[save_after:]


@pytest.mark.parametrize("case", ["0 workers", "2 workers", "persistent"])
@pytest.mark.parametrize("depth", [1, 3])
@pytest.mark.parametrize("leaves", [True, False], ids=["epoch left at the save", "epoch goes on"])
def test_a_state_behind_a_prefetcher_resumes_the_global_rngs_of_the_loop(
    depth: int, leaves: bool, case: str
) -> None:
    """Review 61: with num_workers=0 the state behind a DevicePrefetcher set the global RNGs to
    before the fetches it rewound, and a resumed run made them again one after another. A
    resumed epoch left at once (a step limit the save fell on) never made them, and every later
    draw was behind the uninterrupted run's; a training loop drawing between steps saw other
    numbers, and the fetches made again drew after none of its draws. Review 74: with workers
    it set them to before the sampler draws that taking the held batches made, so the loop's
    draws since were lost (and the next epochs' shuffles, seeded from the global RNG, differed),
    and persistent workers whose resumed epoch was left at once fetched fewer stale tasks than
    the saved run's. Each draw (or fetch) made again now starts from the RNGs it started from
    in the saved run, and leaves the global ones as the saved run had them at the save."""
    make = PREFETCHED[case]
    first = 5 if leaves else None
    seed_all(0)
    seen, state = _train(make(), depth, [first, None, None], save_after=5)
    assert state is not None and state["in_epoch"] and len(state["rewound_rngs"]) > 0
    seed_all(12345)
    resumed = make()
    resumed.load_state_dict(state)
    rest = [0 if leaves else None, None, None]
    got, _ = _train(resumed, depth, rest)
    assert got == seen[5:]


@pytest.mark.parametrize("case", ["0 workers", "lazy global sampler"])
@pytest.mark.parametrize("depth", [None, 1, 3])
def test_a_state_saved_before_a_resumed_epoch_remade_its_draws_keeps_them(
    depth: int | None, case: str
) -> None:
    """Review 62: a state saved in a resumed epoch before it had made again every fetch the
    first state rewound (its loop without a prefetcher, or with a shallower one) lost the rest,
    and a second resume fetched those batches from the wrong RNGs; review 74: the same with
    workers, for the sampler draws. (The loop draws nothing: a prefetcher of another depth
    takes batches at other points between its draws.)"""
    make = PREFETCHED[case]
    seed_all(0)
    seen, first = _train(make(), 3, [None, None], save_after=5, draws=False)
    assert first is not None and len(first["rewound_rngs"]) > 2
    seed_all(1)
    once = make()
    once.load_state_dict(first)
    got, second = _train(once, depth, [None, None], save_after=1, draws=False)
    assert got == seen[5:] and second is not None
    seed_all(2)
    twice = make()
    twice.load_state_dict(second)
    again, _ = _train(twice, depth, [None, None], draws=False)
    assert again == seen[6:]


def _saved_in_the_loop_and_resumed(
    make: Callable[[], DataLoader[Any]], prefetch: Callable[[DataLoader[Any]], Iterable[Any]]
) -> Iterator[tuple[int, list[bytes], list[bytes]]]:
    """Three epochs of ``prefetch(make())``, the loader's state saved in the loop after the
    user's k-th batch (in epoch 1 at its 3rd batch, and at its last but one); for each k, the
    batches seen after the save and those a resumed loader yields."""
    per_epoch = N // 2
    for save_after in (per_epoch + 3, 2 * per_epoch - 1):
        seed_all(0)
        loader = make()
        seen: list[bytes] = []
        state: dict[str, Any] | None = None
        for _ in range(3):
            for batch in prefetch(loader):
                seen.append(batch_bytes(batch))
                if len(seen) == save_after:
                    state = roundtrip(loader.state_dict())
        assert state is not None and len(seen) == 3 * per_epoch
        seed_all(12345)
        resumed = make()
        resumed.load_state_dict(state)
        got = [batch_bytes(b) for _ in range(state["epoch"], 3) for b in prefetch(resumed)]
        yield save_after, seen[save_after:], got


class _Wrapper:
    """A framework's thin wrapper of a loader: its ``iter()`` is the loader's."""

    def __init__(self, loader: DataLoader[Any]) -> None:
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader)


def _fake(source: Any, depth: int = 2) -> DevicePrefetcher[Any]:
    return DevicePrefetcher(source, "cuda", depth=depth, engine=CloningEngine())


WRAPPED: dict[str, Callable[[DataLoader[Any]], Iterable[Any]]] = {
    "iter(loader)": lambda loader: _fake(iter(loader)),
    "a wrapper": lambda loader: _fake(_Wrapper(loader)),
    "a prefetcher": lambda loader: _fake(_fake(loader, depth=1)),
    "a prefetcher over a wrapper": lambda loader: _fake(_fake(_Wrapper(loader), depth=1)),
    "a cpu prefetcher": lambda loader: _fake(DevicePrefetcher(loader, "cpu")),
}


@pytest.mark.parametrize("wrap", list(WRAPPED))
@pytest.mark.parametrize("case", ["0 workers", "2 workers"])
def test_a_prefetcher_over_an_iterator_a_wrapper_or_a_prefetcher_resumes_at_the_users_batch(
    case: str, wrap: str
) -> None:
    """Review 37: a prefetcher given ``iter(loader)`` or a wrapper whose ``iter()`` is the
    loader's told the iterator how many batches it held but never made it rewindable, so
    ``state_dict()`` raised ("only 0 are recorded"); one over another prefetcher hid its own
    batches from the loader, whose state then resumed past them."""
    for save_after, rest, got in _saved_in_the_loop_and_resumed(PREFETCHED[case], WRAPPED[wrap]):
        assert got == rest, f"saved after {save_after}"


def test_a_timeout_behind_a_prefetcher_uses_up_no_batch_and_is_raised_once() -> None:
    """Review 39: the prefetcher counted the loader's timeout as a batch it held (the loader
    gives that batch at the next call), so a state saved at the error resumed one batch early;
    and it took again at once, raising a second timeout before the user could act on the
    first."""
    gate = Gate()
    loader = DataLoader(Gated(16, 6, gate), batch_size=1, num_workers=2, timeout=2)
    it = iter(DevicePrefetcher(loader, "cuda", depth=1, engine=CloningEngine()))
    seen: list[int] = []
    saved: list[tuple[int, dict[str, Any]]] = []
    while True:
        try:
            batch = next(it)
        except StopIteration:
            break
        except RuntimeError as e:
            assert "timed out" in str(e)
            saved.append((len(seen), roundtrip(loader.state_dict())))
            gate.open()  # the sample that held it up comes now
            continue
        seen.append(int(batch[0, 0]))
    assert seen == list(range(16)) and len(saved) == 1
    at, state = saved[0]
    resumed = DataLoader(Ramp(16), batch_size=1, num_workers=2, timeout=TIMEOUT)
    resumed.load_state_dict(state)
    assert [int(b[0, 0]) for b in resumed] == seen[at:]


class _RaisesOnce(Sampler[int]):
    """0..n-1, raising ValueError instead of drawing the ``at``-th index (which ends its
    iterator, and so the epoch)."""

    def __init__(self, n: int, at: int) -> None:
        self.n, self.at = n, at

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        for i in range(self.n):
            if i == self.at:
                raise ValueError(f"sampler failed at draw {self.at}")
            yield i


@pytest.mark.parametrize("prefetched", [False, True], ids=["plain", "prefetcher"])
def test_a_sampler_error_without_workers_keeps_no_rng_state_of_a_batch(prefetched: bool) -> None:
    """Review 40: with num_workers=0 the main-process RNGs logged before a fetch whose sampler
    raised (no batch used up) were kept, so a state saved behind a DevicePrefetcher took them
    one batch late: the resumed batch 2 had batch 3's random draw."""

    def make() -> DataLoader[Any]:
        return DataLoader(Augment(), batch_size=1, sampler=_RaisesOnce(8, 3))

    def run(source: Iterable[Any], save_at: int | None = None) -> list[Any]:
        seen: list[Any] = []
        it = iter(source)
        while True:
            try:
                seen.append(batch_bytes(next(it)))
            except StopIteration:
                return seen
            except ValueError as e:
                seen.append(str(e))
            if len(seen) == save_at:
                saved.append(roundtrip(loader.state_dict()))

    saved: list[dict[str, Any]] = []
    seed_all(0)
    loader = make()
    source = DevicePrefetcher(loader, "cuda", depth=1, engine=CloningEngine()) if prefetched \
        else loader  # fmt: skip
    seen = run(source, save_at=2)
    seed_all(99)
    resumed = make()
    resumed.load_state_dict(saved[0])
    assert run(resumed) == seen[2:]


class _Keeping:
    """A copy engine whose "device" batch is the host batch itself: the user holds the slots."""

    def copy(self, batch: Any) -> tuple[Any, DoneEvent]:
        return batch, DoneEvent()

    def hand_over(self, device_batch: Any, event: Any) -> None:
        pass


def test_the_cap_behind_a_prefetcher_uses_up_no_batch_and_is_raised_once_per_event() -> None:
    """Review 39: at the cap the prefetcher raised each ArenaExhaustedError twice (it took again
    at once, before the user had dropped anything) and counted each as a batch it held, so a
    state saved at the first resumed one batch early."""
    def make() -> DataLoader[Any]:
        return DataLoader(Ramp(40, width=256 * 1024), batch_size=1, num_workers=2,
                          timeout=TIMEOUT, arena_max_bytes=12 << 20)  # fmt: skip

    loader = make()
    it = iter(DevicePrefetcher(loader, "cuda", depth=1, engine=_Keeping()))
    held: list[Any] = []
    seen: list[int] = []
    events: list[int] = []  # len(seen) at each error
    state: dict[str, Any] | None = None
    while True:
        try:
            batch = next(it)
        except StopIteration:
            break
        except ArenaExhaustedError:
            events.append(len(seen))
            held.clear()  # the user drops what they hold, and goes on
            if state is None:
                state = roundtrip(loader.state_dict())
            continue
        seen.append(int(batch[0, 0]))
        held.append(batch)
    assert seen == list(range(40)) and events and state is not None
    assert len(set(events)) == len(events), events  # one error per event, a batch between
    del held, it
    resumed = make()
    resumed.load_state_dict(state)
    assert [int(b[0, 0]) for b in resumed] == seen[events[0] :]


def _indices(key: bytes) -> list[float]:
    """The sample indices of an ``Augment`` batch of 2 from its ``batch_bytes``."""
    rows = np.frombuffer(key[-64:], dtype=np.float64).reshape(2, 4)
    return rows[:, 0].tolist()


@pytest.mark.parametrize("case", ["0 workers", "2 workers", "persistent", "stateful stream"])
def test_a_state_saved_at_an_epochs_last_batch_behind_a_prefetcher_is_mid_epoch(
    case: str,
) -> None:
    """Review 22: the prefetcher, one batch ahead, had already met the epoch's end when it
    handed out the last batch, so a state saved then said "between epochs": a loop counting its
    own epochs resumed with the next epoch's batches where the saved run had an empty rest of
    this one (without a prefetcher the state is mid-epoch, all consumed)."""
    make = PREFETCHED[case]
    per_epoch = N // 2
    seed_all(0)
    loader = make()
    seen: list[bytes] = []
    state: dict[str, Any] | None = None
    for _ in range(2):
        for batch in DevicePrefetcher(loader, "cuda", depth=1, engine=CloningEngine()):
            seen.append(batch_bytes(batch))
            if len(seen) == per_epoch:
                state = roundtrip(loader.state_dict())
    assert state is not None and (state["epoch"], state["in_epoch"]) == (0, True)
    seed_all(12345)
    resumed = make()
    resumed.load_state_dict(state)
    passes = [
        [batch_bytes(b) for b in DevicePrefetcher(resumed, "cuda", depth=1,
                                                  engine=CloningEngine())]
        for _ in range(2)
    ]  # fmt: skip
    assert passes == [[], seen[per_epoch:]]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_rewinding_stream_saved_at_its_last_item_behind_a_prefetcher_resumes_past_it(
    workers: int,
) -> None:
    """Review 33: with batch_size=None torch's fetcher never marks itself ended; the prefetcher,
    a batch ahead, had met the stream's end, which rewound it, so the state (mid-epoch, with
    the replica's state at a pass's start) resumed a whole pass again."""

    def make() -> DataLoader[Any]:
        return DataLoader(RewindsAtPassEnd(), batch_size=None, num_workers=workers,
                          timeout=TIMEOUT if workers else 0)  # fmt: skip

    def prefetched(loader: DataLoader[Any]) -> DevicePrefetcher[Any]:
        return DevicePrefetcher(loader, "cuda", depth=2, engine=CloningEngine())

    seed_all(0)
    loader = make()
    seen: list[bytes] = []
    state: dict[str, Any] | None = None
    for _ in range(2):
        for batch in prefetched(loader):
            seen.append(batch_bytes(batch))
            if len(seen) == 10:
                state = roundtrip(loader.state_dict())
    assert state is not None and (state["epoch"], state["in_epoch"]) == (0, True)
    seed_all(12345)
    resumed = make()
    resumed.load_state_dict(state)
    passes = [[batch_bytes(b) for b in prefetched(resumed)] for _ in range(2)]
    assert passes == [[], seen[10:]]


class SavesAtFirstCopy(CloningEngine):
    """The copy engine of a prefetcher whose first copy waits for a checkpoint thread's
    ``state_dict()``: the batch is taken from the loader, and not yet counted by the
    prefetcher as held."""

    def __init__(self, loader: DataLoader[Any]) -> None:
        self.loader = loader
        self.states: list[dict[str, Any]] = []

    def copy(self, batch: Any) -> tuple[Any, DoneEvent]:
        if not self.states:
            thread = threading.Thread(target=lambda: self.states.append(self.loader.state_dict()))
            thread.start()
            thread.join(TIMEOUT)
            assert self.states, "the checkpoint thread's state_dict() did not return"
        return super().copy(batch)


@pytest.mark.parametrize("case", list(PREFETCHED))
def test_a_state_a_thread_takes_as_a_prefetcher_takes_a_batch_resumes_at_the_users_batch(
    case: str,
) -> None:
    """Review 48: a prefetcher told the iterator how many batches it held only after taking
    one, and a checkpoint thread's state in between counted that batch as the user's: the
    resume skipped it (and those after it the prefetcher took before its first hand-over)."""
    make = PREFETCHED[case]
    seed_all(0)
    loader = make()
    engine = SavesAtFirstCopy(loader)
    seen = [batch_bytes(b) for b in DevicePrefetcher(loader, "cuda", depth=1, engine=engine)]
    state = roundtrip(engine.states[0])
    resumed = make()
    resumed.load_state_dict(state)
    assert state["yielded"] == 0, "the batch taken, not yet handed out, counted as seen"
    got = [batch_bytes(b) for b in resumed]
    if case == "in_order=False":  # which batch comes when, and with which worker's draws, is
        assert sorted(map(_indices, got)) == sorted(map(_indices, seen))  # timing's (README)
    else:
        assert got == seen


@pytest.mark.parametrize("outer_depth", [1, 3])
@pytest.mark.parametrize("case", ["0 workers", "2 workers", "in_order=False"])
@frees_its_loaders_on_failure
def test_a_state_a_thread_takes_as_an_outer_prefetcher_takes_a_batch_resumes_at_the_users_batch(
    case: str, outer_depth: int
) -> None:
    """Review 49 H1: with one prefetcher over another, a batch the inner one handed to the outer
    one was counted by neither until the outer one handed one out, so a checkpoint thread's
    state during the outer one's first steps resumed past those batches."""
    make = PREFETCHED[case]
    seed_all(0)
    loader = make()
    engine = SavesAtFirstCopy(loader)
    inner = DevicePrefetcher(loader, "cuda", depth=2, engine=CloningEngine())
    outer = DevicePrefetcher(inner, "cuda", depth=outer_depth, engine=engine)
    seen = [batch_bytes(b) for b in outer]
    state = roundtrip(engine.states[0])
    assert state["yielded"] == 0, "a batch the outer prefetcher took, not handed out, was seen"
    resumed = make()
    resumed.load_state_dict(state)
    got = [batch_bytes(b) for b in resumed]
    if case == "in_order=False":
        assert sorted(map(_indices, got)) == sorted(map(_indices, seen))
    else:
        assert got == seen


@pytest.mark.parametrize("under", ["iter(loader)", "an inner prefetcher"])
@pytest.mark.parametrize("case", ["0 workers", "2 workers", "persistent"])
@frees_its_loaders_on_failure
def test_the_plain_loop_after_an_abandoned_prefetcher_pass_saves_where_it_is(
    case: str, under: str
) -> None:
    """Review 49: a pass over ``iter(loader)``, left after 2 batches, kept the iterator
    counting every batch it handed out as held unseen, so the plain ``next()`` calls after it
    were repeated by a resume (and after 64 of them state_dict() raised). A closed pass gives
    the iterator back to its user: what the pass still held is dropped, as a loop's batches
    are. The same over an inner prefetcher's pass (whose own batches ahead stay unseen):
    before review 49 H1's fix it kept the outer pass's last count, and a resume repeated that
    many of the user's batches."""
    make = PREFETCHED[case]
    seed_all(0)
    loader = make()
    if under == "iter(loader)":
        it: Iterator[Any] = iter(loader)
    else:
        it = iter(DevicePrefetcher(loader, "cuda", depth=1, engine=CloningEngine()))
    passing = iter(DevicePrefetcher(it, "cuda", depth=1, engine=CloningEngine()))
    for _ in range(2):
        next(passing)
    del passing
    gc.collect()
    for _ in range(3):
        next(it)
    state = roundtrip(loader.state_dict())
    rest = [batch_bytes(b) for b in it]
    resumed = make()
    resumed.load_state_dict(state)
    assert [batch_bytes(b) for b in resumed] == rest


@pytest.mark.parametrize("nested", [False, True], ids=["one prefetcher", "nested"])
@pytest.mark.parametrize("case", ["0 workers", "2 workers", "persistent"])
@frees_its_loaders_on_failure
def test_an_older_pass_dropped_after_a_newer_one_began_leaves_its_count_alone(
    case: str, nested: bool
) -> None:
    """Review 51: with persistent workers every pass has the same iterator, and an older pass
    dropped after a newer one began (``it = iter(prefetcher)`` each epoch) turned the newer
    one's counting off and its count to 0: a state saved then resumed past the batches the
    newer pass held (3 of them; 5 nested)."""
    make = PREFETCHED[case]
    seed_all(0)
    loader = make()

    def prefetched() -> DevicePrefetcher[Any]:
        inner = DevicePrefetcher(loader, "cuda", depth=2, engine=CloningEngine())
        return DevicePrefetcher(inner, "cuda", depth=1, engine=CloningEngine()) if nested else inner

    old = iter(prefetched())
    for _ in range(3):
        next(old)  # epoch 0 left early, its pass still referenced
    new = iter(prefetched())
    for _ in range(2):
        next(new)
    del old
    gc.collect()
    state = roundtrip(loader.state_dict())
    rest = [batch_bytes(b) for b in new]
    assert (state["epoch"], state["yielded"]) == (1, 2)
    resumed = make()
    resumed.load_state_dict(state)
    assert [batch_bytes(b) for b in resumed] == rest


class SavesAtCopy(CloningEngine):
    """A copy engine whose ``at``-th copy waits for a checkpoint thread's ``state_dict()``,
    noting how many batches the user had seen then."""

    def __init__(self, loader: DataLoader[Any], seen: list[bytes], at: int) -> None:
        self.loader, self.seen, self.at, self.copies = loader, seen, at, 0
        self.saved: tuple[int, dict[str, Any]] | None = None

    def copy(self, batch: Any) -> tuple[Any, DoneEvent]:
        self.copies += 1
        if self.copies == self.at:
            out: list[dict[str, Any]] = []
            thread = threading.Thread(target=lambda: out.append(self.loader.state_dict()))
            thread.start()
            thread.join(TIMEOUT)
            assert out, "the checkpoint thread's state_dict() did not return"
            self.saved = (len(self.seen), roundtrip(out[0]))
        return super().copy(batch)


@pytest.mark.parametrize("at", [1, 3])
@pytest.mark.parametrize("case", ["0 workers", "2 workers"])
@frees_its_loaders_on_failure
def test_a_second_outer_pass_over_one_inner_pass_counts_from_its_own_start(
    case: str, at: int
) -> None:
    """Review 52: the user leaves an outer pass for a second one over the same inner pass, and
    drops the first after the second began. The first one's close turned the second one's
    counting off, and before that its last count stayed with the second one's: a checkpoint
    thread's state resumed 3 batches past the user's, or 2 before. What the first pass still
    held, the user never gets (as after a ``break``)."""
    make = PREFETCHED[case]
    seed_all(0)
    loader = make()
    seen: list[bytes] = []
    inner = iter(DevicePrefetcher(loader, "cuda", depth=1, engine=CloningEngine()))
    first = iter(DevicePrefetcher(inner, "cuda", depth=1, engine=CloningEngine()))
    for _ in range(2):
        seen.append(batch_bytes(next(first)))
    engine = SavesAtCopy(loader, seen, at)
    second = iter(DevicePrefetcher(inner, "cuda", depth=2, engine=engine))
    del first
    gc.collect()
    seen += [batch_bytes(b) for b in second]
    assert engine.saved is not None
    users, state = engine.saved
    resumed = make()
    resumed.load_state_dict(state)
    assert [batch_bytes(b) for b in resumed] == seen[users:]


def test_a_forked_child_saves_the_num_workers_0_epoch_it_goes_on_with() -> None:
    """Review 49: with num_workers=0 an os.fork() child goes on with the iterator it
    inherited, and its state_dict() said the epoch had ended (the fork-to-snapshot pattern
    then resumed a whole epoch early)."""
    loader = PREFETCHED["0 workers"]()
    it = iter(loader)
    for _ in range(3):
        next(it)
    def child() -> int:
        sd = loader.state_dict()
        return 0 if (sd["epoch"], sd["in_epoch"], sd["yielded"]) == (0, True, 3) else 2

    assert exit_code_of_fork(child, TIMEOUT) == 0
    del it


@pytest.mark.parametrize(
    "when", ["mid-epoch", "epoch ended", "persistent, epoch ended", "last batch in a prefetcher"]
)
@frees_its_loaders_on_failure
def test_a_forked_child_refuses_the_state_of_a_multi_worker_epoch_it_cannot_see(when: str) -> None:
    """Review 48 L1: a child forked while a 2-worker iterator was mid-epoch (or kept its
    workers) saved a state that said the epoch had ended, and a resume from it skipped the
    rest of the epoch. Where that epoch stands is in the parent's workers and RNG ring; the
    child now refuses, naming the fix, and saves once it has its own iterator. After an epoch
    that ended without persistent workers there is nothing of the parent's in it: it saves.
    Review 56: an iterator at its end whose last batch a DevicePrefetcher still held was taken
    for ended."""
    make = PREFETCHED["persistent" if when.startswith("persistent") else "2 workers"]
    loader = make()
    if when == "last batch in a prefetcher":
        it: Iterator[Any] = iter(DevicePrefetcher(loader, "cuda", depth=1, engine=CloningEngine()))
        for _ in range(N // 2 - 1):
            next(it)
        assert loader._current()._ended  # the loader's iterator has met its end
    else:
        it = iter(loader)
        for _ in range(3 if when == "mid-epoch" else N // 2):
            next(it)
    if when in ("epoch ended", "persistent, epoch ended"):
        with pytest.raises(StopIteration):
            next(it)
    expected = roundtrip(loader.state_dict())

    def child() -> int:
        try:
            state = loader.state_dict()
        except RuntimeError as e:
            if when == "epoch ended" or "inherited this DataLoader through fork()" not in str(e):
                return 2
            own = iter(loader)  # its own workers: then it saves
            next(own)
            return 0 if loader.state_dict()["yielded"] == 1 else 3
        return 0 if when == "epoch ended" and state["epoch"] == expected["epoch"] else 4

    assert exit_code_of_fork(child, TIMEOUT) == 0
    del it


def test_two_prefetchers_over_one_loader_keep_their_own_count() -> None:
    """Review 19: one count per loader, which each prefetcher overwrote: a state for the second
    prefetcher's epoch skipped the batches the first one no longer held."""

    def make() -> DataLoader[Any]:
        return DataLoader(Augment(), batch_size=4, num_workers=2, timeout=TIMEOUT)

    seed_all(0)
    loader = make()
    a = iter(DevicePrefetcher(loader, "cuda", depth=1, engine=CloningEngine()))
    for _ in range(5):
        next(a)  # A's user at its 5th of 6 batches
    b = iter(DevicePrefetcher(loader, "cuda", depth=1, engine=CloningEngine()))
    seen = [batch_bytes(next(b))]
    next(a)  # A hands out its last batch: it holds none now, B still holds 2
    state = roundtrip(loader.state_dict())  # the latest iterator's: B's
    seen += [batch_bytes(x) for x in b]
    resumed = make()
    resumed.load_state_dict(state)
    got = [batch_bytes(x) for x in DevicePrefetcher(resumed, "cuda", depth=1,
                                                     engine=CloningEngine())]  # fmt: skip
    assert state["yielded"] == 1 and got == seen[1:]
    del a


def test_a_stateful_dataset_without_workers_behind_a_device_prefetcher_says_why() -> None:
    """With num_workers=0 the dataset's own state is already past the batches held unseen."""
    loader = DataLoader(Positioned(), batch_size=2)
    batches = iter(DevicePrefetcher(loader, "cuda", depth=1, engine=CloningEngine()))
    next(batches)
    with pytest.raises(RuntimeError, match=r"DevicePrefetcher holds 2 batches.*num_workers=0"):
        loader.state_dict()


# -- a replica that ran out, resumed with another prefetch_factor (review 45) -------------------


class UnevenStream(IterableDataset):  # type: ignore[type-arg]
    """Worker 0's replica: 0, 2, ..., 22 (three batches of 4); worker 1's: 1, 3, 5, 7, 9 (one of
    4 and one of 1). Its place is its state; a pass that ends goes back to the start."""

    def __init__(self) -> None:
        self.pos = 0

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = state["pos"]

    def __iter__(self) -> Iterator[int]:
        wid, _ = _worker()
        items = list(range(wid, 23 if wid == 0 else 11, 2))
        while self.pos < len(items):
            self.pos += 1
            yield items[self.pos - 1]
        self.pos = 0


def test_tasks_of_an_ended_replica_in_flight_resume_with_any_prefetch_factor() -> None:
    """The state keeps the workers of the tasks in flight, for the resume to hand them out in
    the saved run's order. Saved with 4 in flight (prefetch_factor=2), all on worker 1, whose
    replica had run out, and resumed with prefetch_factor=1, the later ones were decided after
    worker 1 said so and went to it anyway: worker 0 never got the task that ends its pass, and
    the next epoch lost its batches (prefetch_factor is not in the state: a resume may change
    it, as it changes only memory and timing)."""

    def make(prefetch: int) -> DataLoader[Any]:
        return DataLoader(UnevenStream(), batch_size=4, num_workers=2, persistent_workers=True,
                          prefetch_factor=prefetch, timeout=TIMEOUT)  # fmt: skip

    save_after = 5  # every batch of epoch 0 consumed, its end not yet seen
    for _ in range(8):  # which tasks are in flight then depends on timing: look for 4 on worker 1
        seed_all(0)
        full, state = saving_run(make(2), 2, save_after)
        if state["replicas"]["assign"] == [1, 1, 1, 1]:
            break
    assert full[save_after:] == [("B", batch_bytes(torch.tensor(b))) for b in (
        [0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9], [16, 18, 20, 22])]  # fmt: skip
    for prefetch in (1, 2, 3):
        resumed = resumed_run(lambda p=prefetch: make(p), state, 2)  # type: ignore[misc]
        assert resumed == full[save_after:], (prefetch, state["replicas"])


@pytest.mark.parametrize("depth", [1, 3])
@pytest.mark.parametrize("leaves", [True, False], ids=["epoch left at the save", "epoch goes on"])
def test_with_workers_a_global_rng_sampler_behind_a_prefetcher_resumes_its_later_epochs(
    depth: int, leaves: bool
) -> None:
    """Review 74: a sampler drawing from the global ``random`` as it goes, with workers behind a
    DevicePrefetcher, and an epoch left at the save: the resumed epoch, left at once, never
    made again the draws the state rewound, so every later epoch drew behind the saved run's."""
    make = PREFETCHED["lazy global sampler"]
    first = 5 if leaves else None
    seed_all(0)
    seen, state = _train(make(), depth, [first, None, None], save_after=5, draws=False)
    assert state is not None
    seed_all(12345)
    resumed = make()
    resumed.load_state_dict(state)
    got, _ = _train(resumed, depth, [0 if leaves else None, None, None], draws=False)
    assert got == seen[5:]


def _epochs_of_a_loop(loader: DataLoader[Any], depth: int, steps: list[int | None],
                      save_after: int = 0) -> tuple[list[bytes], dict[str, Any] | None]:
    """Epochs of ``for batch in DevicePrefetcher(loader): ...`` (the prefetcher, and with it the
    loader's iterator, dropped when a step limit leaves the epoch); as :func:`_train`."""
    seen: list[bytes] = []
    state = None
    for limit in steps:
        if limit == 0:  # the loop's iter(), and no step
            iter(DevicePrefetcher(loader, "cuda", depth=depth, engine=CloningEngine()))
            continue
        prefetcher = DevicePrefetcher(loader, "cuda", depth=depth, engine=CloningEngine())
        for taken, batch in enumerate(prefetcher, 1):
            seen.append(batch_bytes(batch))
            if len(seen) == save_after:
                state = roundtrip(loader.state_dict())
            if taken == limit:
                break
    return seen, state


@pytest.mark.parametrize("save_after", [12, 13, 15])
@pytest.mark.parametrize("workers", [0, 2, "persistent"])
def test_a_sampler_drawing_from_its_generator_as_it_goes_resumes_the_epochs_after_a_save_left(
    workers: int | str, save_after: int
) -> None:
    """Review 74: ``RandomSampler(replacement=True, generator=g)`` draws 32 indices at a time
    from ``g`` as the epoch goes on. Behind a DevicePrefetcher the saved run had drawn past the
    batch the user had; a resumed epoch left at once never drew those again, so ``g`` (which
    the next epochs draw from) stayed behind, and every later batch differed. The resumed
    epoch now draws them again as it starts."""
    def make() -> DataLoader[Any]:
        data = Augment()
        sampler = RandomSampler(data, replacement=True, num_samples=96,
                                generator=torch.Generator().manual_seed(7))
        if workers == 0:
            return DataLoader(data, batch_size=2, sampler=sampler)
        return DataLoader(data, batch_size=2, sampler=sampler, num_workers=2, timeout=TIMEOUT,
                          persistent_workers=workers == "persistent")

    seed_all(0)
    seen, state = _epochs_of_a_loop(make(), 3, [save_after, None, None], save_after)
    assert state is not None and state["rewound_rngs"]
    seed_all(12345)
    resumed = make()
    resumed.load_state_dict(state)
    got, _ = _epochs_of_a_loop(resumed, 3, [0, None, None])
    assert got == seen[save_after:]


class RaisesAt(Sampler[int]):
    """Yields 0, 1, ... and raises ``error(at)`` at index ``at`` (a generator: it ends there);
    by default a ValueError caused by a KeyError."""

    def __init__(self, at: int, error: Callable[[int], Exception] | None = None) -> None:
        self.at = at
        self.error = error

    def __len__(self) -> int:
        return N

    def __iter__(self) -> Iterator[int]:
        for i in range(N):
            if i == self.at:
                if self.error is not None:
                    raise self.error(i)
                raise ValueError(f"sampler failed at {i}") from KeyError(i)
            yield i


def _outcomes(
    batches: Iterator[Any], errors: tuple[type[Exception], ...] = (ValueError,)
) -> list[bytes | str]:
    """Every batch, and every error of ``errors`` (its text) in its place, until the end."""
    out: list[bytes | str] = []
    while True:
        try:
            out.append(batch_bytes(next(batches)))
        except StopIteration:
            return out
        except errors as e:
            out.append(str(e))


def _raised_then_resumed(depth: int) -> tuple[DataLoader[Any], list[bytes | str]]:
    """A 2-worker loader over a sampler that raises at index 16, saved behind a prefetcher of
    ``depth`` after 3 batches (the raising draw among those made ahead of the save), and a
    loader that loaded that state; and what the saved run yielded after the save."""
    def make() -> DataLoader[Any]:
        return DataLoader(Augment(), batch_size=2, sampler=RaisesAt(16), num_workers=2,
                          timeout=TIMEOUT)

    seed_all(0)
    loader = make()
    batches = iter(DevicePrefetcher(loader, "cuda", depth=depth, engine=CloningEngine()))
    seen = [batch_bytes(next(batches)) for _ in range(3)]
    state = roundtrip(loader.state_dict())
    seen += _outcomes(batches)
    seed_all(5)
    resumed = make()
    resumed.load_state_dict(state)
    return resumed, seen[3:]


@pytest.mark.parametrize("depth", [1, 2])
def test_a_sampler_error_the_saved_run_had_drawn_ahead_is_raised_at_its_turn(depth: int) -> None:
    """Review 74 (of the draws a resumed epoch makes again at once): the draw the sampler raised
    at, made ahead of the user's batch in the saved run, raised during the resumed iter(); the
    error was dropped there, and the resumed run yielded a batch in its place."""
    resumed, after = _raised_then_resumed(depth)
    assert "sampler failed at 16" in after
    got = _outcomes(iter(DevicePrefetcher(resumed, "cuda", depth=depth, engine=CloningEngine())))
    assert got == after


@pytest.mark.parametrize("when", ["left at once", "after the error"])
def test_a_sampler_error_drawn_again_keeps_no_cycle_to_the_iterator(when: str) -> None:
    """Review 75: the sampler's error that a resumed epoch drew again at once kept its
    traceback, whose frames lead back to the iterator's own: a cycle that kept the dropped
    iterator, its workers and its slots alive until a garbage collection. Without one, the
    iterator goes with its last reference; the error still says where the sampler raised."""
    resumed, _ = _raised_then_resumed(2)
    gc.collect()
    gc.disable()
    try:
        it = iter(resumed)
        if when == "after the error":
            with pytest.raises(ValueError, match="sampler failed at 16") as raised:
                while True:
                    next(it)
            notes = "".join(getattr(raised.value, "__notes__", []))
            assert "in __iter__" in notes and "sampler failed at 16" in notes
            assert isinstance(raised.value.__cause__, KeyError)  # (review 76: it was lost)
            del raised
        gone = weakref.ref(it)
        del it
        assert gone() is None
    finally:
        gc.enable()


class ByKey(Dataset):  # type: ignore[type-arg]
    """Samples looked up by index objects that hash by identity, some holding a lock (torch
    hands a sampler's indices to the dataset as they are with num_workers=0)."""

    def __init__(self) -> None:
        self.keys = [Handle(i) for i in range(N)]

    def __len__(self) -> int:
        return N

    def __getitem__(self, key: Handle) -> torch.Tensor:
        with key.lock:
            return torch.tensor([float(self.keys.index(key)), torch.rand(()).item()])


class Handle:
    def __init__(self, i: int) -> None:
        self.i = i
        self.lock = threading.Lock()  # (cannot be copied)


class HandleSampler(Sampler[Handle]):
    def __init__(self, keys: list[Handle]) -> None:
        self.keys = keys

    def __len__(self) -> int:
        return N

    def __iter__(self) -> Iterator[Handle]:
        for j in torch.randperm(N).tolist():
            yield self.keys[j]


def test_index_objects_keep_their_identity_when_a_resumed_epoch_draws_them_again() -> None:
    """Review 75: the indices a resumed epoch drew again at once were deep copies, so index
    objects that hash by identity missed the dataset's keys, and one holding a lock made every
    iter() of the loader fail."""
    def make() -> DataLoader[Any]:
        data = ByKey()
        return DataLoader(data, batch_size=2, sampler=HandleSampler(data.keys))

    _resumes_exactly(make, 3, save_after=5)


class InterruptedOnce(Sampler[list[int]]):
    """A batch sampler whose batch ``at`` raises KeyboardInterrupt once (Ctrl-C in its draw)."""

    def __init__(self) -> None:
        self.at: int | None = None

    def __len__(self) -> int:
        return N // 2

    def __iter__(self) -> Iterator[list[int]]:
        order = torch.randperm(N).tolist()
        for b in range(N // 2):
            if self.at == b:
                self.at = None
                raise KeyboardInterrupt
            yield order[2 * b : 2 * b + 2]


def test_a_resumed_iter_cut_short_counts_its_epoch_once() -> None:
    """Review 75: a Ctrl-C in the sampler's draws of a resumed iter() (the first tasks') left
    the loader's epoch count one ahead: the next iter() resumed the right batches, but a state
    saved then named the next epoch."""
    def make() -> DataLoader[Any]:
        return DataLoader(Augment(), batch_sampler=InterruptedOnce(), num_workers=2,
                          timeout=TIMEOUT)

    seed_all(0)
    seen, state = _train(make(), 3, [None, None], save_after=5, draws=False)
    assert state is not None and state["rewound_rngs"]
    seed_all(1)
    resumed = make()
    resumed.load_state_dict(state)
    resumed.batch_sampler.at = state["yielded"] + 1  # type: ignore[union-attr]
    with pytest.raises(KeyboardInterrupt):
        iter(resumed)
    got, again = _train(resumed, 3, [None, None], save_after=1, draws=False)
    assert got == seen[5:]
    assert again is not None and again["epoch"] == state["epoch"]


class FlakyOnce(Sampler[int]):
    """Its second iter() raises at the first draw (a flaky read), once."""

    def __init__(self) -> None:
        self.iters = 0

    def __len__(self) -> int:
        return N

    def __iter__(self) -> Iterator[int]:
        self.iters += 1
        if self.iters == 2:
            raise OSError("flaky read")
        yield from range(N)


@pytest.mark.parametrize("workers", [0, 2, "persistent"])
def test_an_epoch_whose_first_draw_failed_counts_as_begun_whatever_the_workers(
    workers: int | str,
) -> None:
    """Review 76: the count put back for a resumed iter() that failed (review 75) was put back
    for any iter(): with 2 workers an epoch whose sampler failed at its first draw no longer
    counted, where with 0 or persistent workers (whose draw fails in next(), or in the kept
    iterator's iter()) it does, as it did before."""
    kw: dict[str, Any] = {} if workers == 0 else {
        "num_workers": 2, "timeout": TIMEOUT, "persistent_workers": workers == "persistent"}
    loader = DataLoader(Augment(), batch_size=2, sampler=FlakyOnce(), **kw)
    assert len(list(loader)) == N // 2
    with pytest.raises(OSError, match="flaky read"):
        list(loader)
    assert len(list(loader)) == N // 2
    assert loader.state_dict()["epoch"] == 3


class _RefilledList(list):  # type: ignore[type-arg]
    pass


KEYS = [torch.tensor([i]) for i in range(N)]  # tensors hash by identity


class OneIndexObject(Sampler[Any]):
    """Yields, for each sample, an index object of ``kind`` that it refills in place (or, for
    "tensor key", one the dataset looks up by identity): torch hands each to the dataset as it
    is, before the next draw, with ``num_workers=0``."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __len__(self) -> int:
        return N

    def __iter__(self) -> Iterator[Any]:
        inner: list[int] = []
        refilled = _RefilledList()
        for i in torch.randperm(N).tolist():
            if self.kind == "list subclass":
                refilled[:] = [i]
                yield refilled
            elif self.kind == "tuple of a list":
                inner[:] = [i]
                yield (inner, "tag")
            elif self.kind == "generator":
                inner[:] = [i]
                yield (x for x in inner)
            else:
                yield KEYS[i]


class ByIndexObject(Dataset):  # type: ignore[type-arg]
    def __init__(self) -> None:
        self.table = {key: i for i, key in enumerate(KEYS)}

    def __len__(self) -> int:
        return N

    def __getitem__(self, index: Any) -> torch.Tensor:
        if isinstance(index, torch.Tensor):
            i = self.table.get(index, -1)
        elif isinstance(index, tuple):
            i = index[0][0]
        elif isinstance(index, list):
            i = index[0]
        else:
            i = next(index, -1)
        return torch.tensor([float(i), torch.rand(()).item()], dtype=torch.float64)


@pytest.mark.parametrize(
    "kind, workers",
    [("list subclass", 0), ("tuple of a list", 0), ("generator", 0), ("tensor key", 0),
     ("list subclass", 2), ("tuple of a list", 2)],
)
def test_index_objects_reach_the_dataset_as_the_sampler_yielded_them_after_a_resume(
    kind: str, workers: int
) -> None:
    """Review 76: indices a resumed epoch drew again at once (review 74) were kept as copies
    of some types only: a list subclass or a tuple of a list the sampler refilled, or a lazy
    index (a generator over a refilled list), arrived holding the last draw's indices, and a
    tensor copy missed the dataset's identity-keyed table. With num_workers=0 they are drawn
    at their fetch again (the draws a resumed epoch left undone are made when the next iterator
    starts); with workers each is kept as its worker receives it."""
    def make() -> DataLoader[Any]:
        return DataLoader(ByIndexObject(), batch_size=None, sampler=OneIndexObject(kind),
                          num_workers=workers, timeout=TIMEOUT if workers else 0)

    _resumes_exactly(make, 2, save_after=3)


def _own_generator_loader() -> DataLoader[Any]:
    data = Augment()
    return DataLoader(data, batch_size=2, sampler=RandomSampler(
        data, replacement=True, num_samples=96, generator=torch.Generator().manual_seed(7)))


def test_a_state_taken_after_a_resumed_epoch_was_left_counts_the_draws_it_owed() -> None:
    """Review 77: with num_workers=0, a resumed epoch left at once (its iterator dropped) still
    owes the sampler the draws the saved run had made ahead of its save, made when the next
    iterator starts; a state taken before that recorded where the next epoch's draws start
    without them, so a loader resumed from it drew every later epoch from a generator behind
    the saved run's."""
    seed_all(0)
    seen, state = _epochs_of_a_loop(_own_generator_loader(), 3, [13, None, None], 13)
    assert state is not None and state["rewound_rngs"]
    resumed = _own_generator_loader()
    resumed.load_state_dict(state)
    iter(DevicePrefetcher(resumed, "cuda", depth=3, engine=CloningEngine()))  # left at once
    between = roundtrip(resumed.state_dict())
    assert not between["in_epoch"]
    again = _own_generator_loader()
    again.load_state_dict(between)
    got, _ = _epochs_of_a_loop(again, 3, [None, None])
    assert got == seen[13:]


def test_a_state_loaded_after_a_resumed_epoch_was_left_drops_the_draws_it_owed() -> None:
    """Review 77: the draws a resumed num_workers=0 epoch left at once still owed were made
    when the next iterator started even after another state was loaded, moving the sampler's
    generator off where that state had put it."""
    seed_all(0)
    _, state = _epochs_of_a_loop(_own_generator_loader(), 3, [13, None], 13)
    assert state is not None and state["rewound_rngs"]
    seed_all(1)
    plain = _own_generator_loader()
    list(plain)
    between = roundtrip(plain.state_dict())
    expected = [batch_bytes(b) for b in plain]
    loader = _own_generator_loader()
    loader.load_state_dict(state)
    iter(DevicePrefetcher(loader, "cuda", depth=3, engine=CloningEngine()))  # left at once
    loader.load_state_dict(between)
    assert [batch_bytes(b) for b in loader] == expected


@dataclasses.dataclass(frozen=True)
class FrozenError(Exception):
    """An exception that refuses attribute assignment (its __traceback__ and notes too)."""

    code: int


def test_a_sampler_error_that_refuses_a_traceback_is_raised_at_its_turn_after_a_resume() -> None:
    """Review 77: keeping the sampler's error without frames assigned its __traceback__, which
    a frozen dataclass refuses: the FrozenInstanceError left the resumed iter(), and the
    sampler's own error was lost."""
    def make() -> DataLoader[Any]:
        return DataLoader(Augment(), batch_size=2, sampler=RaisesAt(16, FrozenError), num_workers=2,
                          timeout=TIMEOUT)

    seed_all(0)
    loader = make()
    batches = iter(DevicePrefetcher(loader, "cuda", depth=2, engine=CloningEngine()))
    seen = [batch_bytes(next(batches)) for _ in range(3)]
    state = roundtrip(loader.state_dict())
    after = _outcomes(batches, (FrozenError,))
    assert "16" in after
    resumed = make()
    resumed.load_state_dict(state)
    got = _outcomes(iter(DevicePrefetcher(resumed, "cuda", depth=2, engine=CloningEngine())),
                    (FrozenError,))
    assert got == after and seen


def test_the_users_own_exception_keeps_its_traceback_when_a_resumed_iter_keeps_an_error() -> None:
    """Review 77: a resumed iter() called while the user handles an exception of their own
    kept the sampler's error without frames, and cleared those of the exception it chained to:
    the user's, which then had lost where it was raised."""
    resumed, _ = _raised_then_resumed(2)

    def users_step() -> None:
        raise LookupError("the user's own")

    try:
        users_step()
    except LookupError as own:
        it = iter(resumed)
        assert own.__traceback__ is not None
        assert any("users_step" in line for line in traceback.format_tb(own.__traceback__))
    with pytest.raises(ValueError, match="sampler failed at 16"):
        while True:
            next(it)


class GeneratorBatches(Sampler[list[int]]):
    """A batch sampler drawing each batch from its own generator as it goes; a Ctrl-C before
    batch ``interrupt_at``, once, after which its iterator (an object, not a generator
    function, which an exception would end) goes on."""

    def __init__(self) -> None:
        self.generator = torch.Generator().manual_seed(3)
        self.interrupt_at: int | None = None

    def __len__(self) -> int:
        return N // 2

    def __iter__(self) -> Iterator[list[int]]:
        return _Batches(self)


class _Batches:
    def __init__(self, sampler: GeneratorBatches) -> None:
        self.sampler = sampler
        self.drawn = 0

    def __iter__(self) -> _Batches:
        return self

    def __next__(self) -> list[int]:
        if self.drawn == N // 2:
            raise StopIteration
        if self.sampler.interrupt_at == self.drawn:
            self.sampler.interrupt_at = None
            raise KeyboardInterrupt
        self.drawn += 1
        return torch.randint(N, (2,), generator=self.sampler.generator).tolist()


def _saved_at_5_and_loaded(
    make: Callable[[], DataLoader[Any]],
) -> tuple[list[tuple[bytes, float, float]], dict[str, Any], DataLoader[Any]]:
    """A run of ``make()`` behind a prefetcher of depth 3 that leaves its first epoch at the
    save (after 5 batches, some drawn ahead), then one more epoch: what it saw, the state, and
    a fresh loader that loaded it."""
    seed_all(0)
    seen, state = _train(make(), 3, [5, None], save_after=5, draws=False)
    assert state is not None and len(state["rewound_rngs"]) > 2
    resumed = make()
    resumed.load_state_dict(state)
    return seen, state, resumed


def test_a_ctrl_c_in_the_draws_a_left_epoch_owed_keeps_the_rest_owed() -> None:
    """Review 77: with num_workers=0, a Ctrl-C in one of the draws a resumed epoch left at once
    still owed, made as the next iterator starts, dropped the rest: the next epoch drew from a
    generator behind the saved run's."""
    def make() -> DataLoader[Any]:
        return DataLoader(Augment(), batch_sampler=GeneratorBatches())

    seen, state, resumed = _saved_at_5_and_loaded(make)
    iter(DevicePrefetcher(resumed, "cuda", depth=3, engine=CloningEngine()))  # left at once
    resumed.batch_sampler.interrupt_at = state["yielded"] + 1  # type: ignore[union-attr]
    with pytest.raises(KeyboardInterrupt):
        iter(resumed)
    assert [batch_bytes(b) for b in resumed] == [s[0] for s in seen[5:]]


class HeldAugment(Dataset):  # type: ignore[type-arg]
    """Augment's samples; a fetch waits at ``gate`` while ``hold`` is set."""

    def __init__(self) -> None:
        self.augment = Augment()
        self.hold = False
        self.entered = threading.Event()
        self.gate = threading.Event()

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> Any:
        if self.hold:
            self.entered.set()
            self.gate.wait(TIMEOUT)
        return self.augment[i]


def test_iter_leaves_the_draws_a_resumed_epoch_owes_to_it_while_another_thread_fetches() -> None:
    """Review 77: with num_workers=0, iter() made the draws a resumed epoch still owed under
    that iterator's lock, so it waited for another thread's fetch in it (for good, for a fetch
    that never returns). An iterator in use in another thread makes them itself."""
    data = HeldAugment()
    def make() -> DataLoader[Any]:
        return DataLoader(data, batch_size=2, sampler=RandomSampler(
            data, replacement=True, num_samples=96, generator=torch.Generator().manual_seed(7)))

    seed_all(0)
    _, state = _epochs_of_a_loop(make(), 3, [13, None], 13)
    assert state is not None and state["rewound_rngs"]
    resumed = make()
    resumed.load_state_dict(state)
    first = iter(resumed)
    data.hold = True
    fetching = threading.Thread(target=lambda: next(first), daemon=True)
    fetching.start()
    try:
        assert data.entered.wait(TIMEOUT)
        iter(resumed)
        assert all(type(r) is bytes for r in first._rewound)  # (made by `first` as it fetches)
    finally:
        data.gate.set()
        fetching.join(TIMEOUT)
    assert not fetching.is_alive()


class DrawsByThread(Sampler[list[int]]):
    """GeneratorBatches' batches, noting the thread of every draw."""

    def __init__(self) -> None:
        self.batches = GeneratorBatches()
        self.threads: list[int] = []

    def __len__(self) -> int:
        return N // 2

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.batches:
            self.threads.append(threading.get_ident())
            yield batch


def test_a_checkpoint_threads_state_makes_no_draw_a_left_resumed_epoch_owed() -> None:
    """Review 78: with num_workers=0, a state_dict() between a resumed epoch left at once and
    the next iter() made the draws that epoch still owed, setting the process's global RNGs
    for their length: taken by a checkpoint thread, that disturbed the training thread's own
    draws. Only the iterating thread makes them (on another thread the state records the next
    epoch's start without them, as the README says); the next iter() makes them."""
    def make() -> DataLoader[Any]:
        return DataLoader(Augment(), batch_sampler=DrawsByThread())

    seen, _, resumed = _saved_at_5_and_loaded(make)
    iter(DevicePrefetcher(resumed, "cuda", depth=3, engine=CloningEngine()))  # left at once
    sampler: DrawsByThread = resumed.batch_sampler  # type: ignore[assignment]
    before = len(sampler.threads)
    saved: list[dict[str, Any]] = []
    checkpoint = threading.Thread(target=lambda: saved.append(resumed.state_dict()))
    checkpoint.start()
    checkpoint.join(TIMEOUT)
    assert saved and not saved[0]["in_epoch"]
    assert len(sampler.threads) == before  # no draw on the checkpoint thread
    assert [batch_bytes(b) for b in resumed] == [s[0] for s in seen[5:]]
    assert set(sampler.threads) == {threading.get_ident()}


def test_a_kept_sampler_error_is_raised_without_the_exception_handled_at_iter() -> None:
    """Review 78: the sampler's error a resumed iter() drew ahead, while the user handled an
    exception of their own, kept that exception as its __context__: raised at its turn, much
    later, it said it came while handling it. It takes the context of its turn, as the saved
    run's did."""
    resumed, _ = _raised_then_resumed(2)
    try:
        raise LookupError("the user's own, handled while calling iter()")
    except LookupError:
        it = iter(resumed)
    with pytest.raises(ValueError, match="sampler failed at 16") as raised:
        while True:
            next(it)
    assert not isinstance(raised.value.__context__, LookupError)


def test_a_thread_that_reuses_the_iterating_threads_id_makes_no_owed_draw() -> None:
    """Review 79: the thread allowed to make the draws a left resumed epoch owed (review 78) was
    matched by its id, which a thread started after it exited often reuses: a checkpoint
    thread's state_dict() then made them, setting the global RNGs under the training thread."""
    def make() -> DataLoader[Any]:
        return DataLoader(Augment(), batch_sampler=DrawsByThread())

    _, _, resumed = _saved_at_5_and_loaded(make)
    ids: dict[str, int] = {}

    def run(name: str, step: Callable[[], Any]) -> None:
        def body() -> None:
            ids[name] = threading.get_ident()
            step()
        thread = threading.Thread(target=body)
        thread.start()
        thread.join(TIMEOUT)

    # the resumed epoch iterated (and left at once) in a thread that then exits
    run("iterated", lambda: iter(DevicePrefetcher(resumed, "cuda", depth=3,
                                                  engine=CloningEngine())))
    sampler: DrawsByThread = resumed.batch_sampler  # type: ignore[assignment]
    before = len(sampler.threads)
    run("checkpoint", resumed.state_dict)
    assert len(sampler.threads) == before, (ids, "the checkpoint thread made the owed draws")


def test_a_frozen_sampler_error_kept_ahead_is_cut_from_the_exception_handled_at_iter() -> None:
    """Review 79: cutting the kept error's link to the exception the user handled at iter()
    (review 78) assigned __context__, which a frozen dataclass refuses; the rest of the walk
    and the note were skipped too, and at its turn the error still came chained to the user's
    exception (and, through its frames, kept the iterator and its workers)."""
    def make() -> DataLoader[Any]:
        return DataLoader(Augment(), batch_size=2, sampler=RaisesAt(16, FrozenError), num_workers=2,
                          timeout=TIMEOUT)

    seed_all(0)
    loader = make()
    batches = iter(DevicePrefetcher(loader, "cuda", depth=2, engine=CloningEngine()))
    for _ in range(3):
        next(batches)
    state = roundtrip(loader.state_dict())
    del batches, loader
    resumed = make()
    resumed.load_state_dict(state)
    try:
        raise LookupError("the user's own, handled while calling iter()")
    except LookupError:
        it = iter(resumed)
    with pytest.raises(FrozenError) as raised:
        while True:
            next(it)
    assert not isinstance(raised.value.__context__, LookupError)
    assert "where it was raised" in "".join(getattr(raised.value, "__notes__", []))
