"""``DataLoader.state_dict()`` from a checkpoint thread while the training thread iterates: every
state describes the loader between two whole steps, never half-way through one, and resumes
exactly (review 45).

A state taken while the training thread was inside ``iter()`` counted the epoch as begun and
over at once (its iterator was not yet recorded), and one taken inside ``next()`` with
``num_workers=0`` counted the batch being fetched and took the global RNGs half-way through
its draws; one taken as ``next()`` ended an epoch kept that iterator's base seed for the next.

The first test holds the training thread inside the step (in the sampler's ``__iter__``, which
``iter()`` or the first ``next()`` calls) until the checkpoint thread's ``state_dict()`` has
returned, or ``HOLD_S`` has passed: a correct loader makes it wait for the step, so it returns
only after. The second lets a thread take states as fast as it can and resumes each distinct one.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, Sampler

from shmloader import DataLoader
from tests.forked import exit_code_of_fork
from tests.lifetime_checks import frees_its_loaders_on_failure
from tests.resume_items import (
    TIMEOUT,
    Item,
    batch_bytes,
    drain,
    own_rngs,
    resumed_run,
    roundtrip,
    seed_all,
)
from tests.test_resume_edges import Augment, N  # items that draw from all three global RNGs

__all__ = ["own_rngs"]  # the autouse fixture, imported to apply here

BATCH, EPOCHS = 4, 3
PER_EPOCH = N // BATCH
HOLD_S = 0.5  # how long the training thread stays inside its step for the checkpoint thread
WAIT_S = 30.0  # bound on every other wait


class Meeting:
    """Where the training thread, inside its step, meets the checkpoint thread."""

    def __init__(self, loader: DataLoader[Any] | None = None) -> None:
        self.loader = loader
        self.armed = False
        self.inside = threading.Event()
        self.taken = threading.Event()
        self.state: dict[str, Any] | None = None
        self.returned_inside: bool | None = None

    def checkpoint(self) -> None:
        """The checkpoint thread: once the training thread is inside, take the state."""
        if self.inside.wait(WAIT_S):
            assert self.loader is not None
            self.state = roundtrip(self.loader.state_dict())
            self.taken.set()

    def step(self) -> None:
        """Inside the training thread's step: let the checkpoint thread in, once."""
        if self.armed and threading.current_thread() is threading.main_thread():
            self.armed = False
            self.inside.set()
            self.returned_inside = self.taken.wait(HOLD_S)


class ShuffleMeeting(Sampler[int]):
    """A random permutation drawn from the global torch RNG at each ``iter()``, which first
    meets the checkpoint thread when armed."""

    def __init__(self, meeting: Meeting) -> None:
        self.meeting = meeting

    def __len__(self) -> int:
        return N

    def __iter__(self) -> Iterator[int]:
        order = torch.randperm(N).tolist()
        self.meeting.step()
        return iter(order)


def _make(meeting: Meeting, workers: int, persistent: bool) -> DataLoader[Any]:
    return DataLoader(
        Augment(), batch_size=BATCH, sampler=ShuffleMeeting(meeting), num_workers=workers,
        persistent_workers=persistent, timeout=TIMEOUT if workers else 0,
    )  # fmt: skip


def _position(state: dict[str, Any]) -> int:
    """Items of the uninterrupted run before the state's place."""
    return state["epoch"] * PER_EPOCH + (state["yielded"] if state["in_epoch"] else 0)


def _run(loader: DataLoader[Any], epochs: int = EPOCHS, train: bool = False) -> list[Item]:
    items: list[Item] = []
    for _ in range(epochs):
        if not train:
            drain(iter(loader), items)
            continue
        for batch in loader:
            items.append(("B", batch_bytes(batch)))
            sum(i * i for i in range(20_000))  # a training step (no RNG draws), between steps
    return items


CASES = [(0, False), (2, False), (2, True)]
IDS = ["num_workers=0", "2-workers", "2-persistent-workers"]


@pytest.mark.parametrize("epoch", [0, 1], ids=["first-epoch", "second-epoch"])
@pytest.mark.parametrize(("workers", "persistent"), CASES, ids=IDS)
@frees_its_loaders_on_failure
def test_a_state_taken_while_the_training_thread_is_inside_a_step_waits_for_it(
    workers: int, persistent: bool, epoch: int
) -> None:
    seed_all(0)
    full = _run(_make(Meeting(), workers, persistent))

    seed_all(0)
    meeting = Meeting()
    loader = meeting.loader = _make(meeting, workers, persistent)
    items: list[Item] = []
    thread = threading.Thread(target=meeting.checkpoint)
    for e in range(EPOCHS):
        if e == epoch:
            meeting.armed = True
            thread.start()
        drain(iter(loader), items)
        if e == epoch:
            thread.join(WAIT_S)
    assert items == full, "the checkpoint thread changed the run"
    assert meeting.returned_inside is False, (
        "state_dict() returned while the training thread was inside iter() or next()"
    )
    state = meeting.state
    assert state is not None
    # iter() (with workers) or the first next() (without) of that epoch: the state is of the
    # step's end, either way one whose resume gives the rest of the run
    assert resumed_run(lambda: _make(Meeting(), workers, persistent), state, EPOCHS) == full[
        _position(state) :
    ]


@pytest.mark.parametrize(("workers", "persistent"), CASES, ids=IDS)
@frees_its_loaders_on_failure
def test_every_state_a_checkpoint_thread_takes_while_the_loader_runs_resumes_exactly(
    workers: int, persistent: bool
) -> None:
    seed_all(0)
    full = _run(_make(Meeting(), workers, persistent))

    seed_all(0)
    loader = _make(Meeting(), workers, persistent)
    stop = threading.Event()
    states: list[dict[str, Any]] = []

    def checkpoint() -> None:
        while not stop.wait(0.0005):  # (pacing only: the states land wherever they land)
            states.append(loader.state_dict())

    thread = threading.Thread(target=checkpoint)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # thread switches land anywhere in a step
    thread.start()
    try:
        items = _run(loader, train=True)
    finally:
        stop.set()
        thread.join(WAIT_S)
        sys.setswitchinterval(switch)
    assert items == full, "the checkpoint thread changed the run"
    distinct: dict[Any, dict[str, Any]] = {}
    for s in states:
        key = (s["epoch"], s["in_epoch"], s["yielded"], s["base_seed"], bytes(s["main_rng"]))
        distinct.setdefault(key, s)
    assert len(distinct) > 3, "the checkpoint thread took too few states to test anything"
    picked = list(distinct.values())
    picked = picked[:: max(1, len(picked) // 6)]  # at most about 6, spread over the run
    for state in picked:
        got = resumed_run(lambda: _make(Meeting(), workers, persistent), roundtrip(state), EPOCHS)
        assert got == full[_position(state) :], (
            f"state epoch={state['epoch']} in_epoch={state['in_epoch']} "
            f"yielded={state['yielded']} base_seed={state['base_seed']} resumed wrong"
        )


class SamplerDuringSave(Sampler[int]):
    """``range(N)``, with a ``state_dict()`` (so a loader's ``state_dict()`` calls it between
    epochs) that, once, says it is inside (``meeting.inside``) and waits for ``meeting.taken``."""

    def __init__(self, meeting: Meeting) -> None:
        self.meeting = meeting
        self.hold = True

    def __len__(self) -> int:
        return N

    def __iter__(self) -> Iterator[int]:
        return iter(range(N))

    def state_dict(self) -> dict[str, int]:
        if self.hold:
            self.hold = False
            self.meeting.inside.set()
            self.meeting.taken.wait(WAIT_S)
        return {}

    def load_state_dict(self, state: dict[str, int]) -> None:
        pass


@pytest.mark.parametrize("workers", [0, 2], ids=["num_workers=0", "2-workers"])
@frees_its_loaders_on_failure
def test_a_process_forked_while_another_thread_saves_can_save_and_iterate(workers: int) -> None:
    """Review 47: a child forked while a checkpoint thread was inside ``state_dict()`` found
    the loader's lock held for good (by a thread it does not have): its ``iter(loader)`` and
    ``state_dict()`` hung."""
    meeting = Meeting()
    loader = meeting.loader = DataLoader(
        Augment(), batch_size=BATCH, sampler=SamplerDuringSave(meeting), num_workers=workers,
        timeout=TIMEOUT if workers else 0,
    )  # fmt: skip

    def child() -> int:  # save, then a whole epoch with its own workers
        loader.state_dict()
        return 0 if len(list(loader)) == N // BATCH else 2

    # the thread holds the loader's lock while it is inside
    assert _fork_while_inside(loader.state_dict, meeting.inside, meeting.taken, child) == 0


def _fork_while_inside(
    step: Callable[[], Any], inside: threading.Event, go: threading.Event, child: Callable[[], int]
) -> int:
    """Run ``step`` in a thread until it is ``inside`` (where it waits for ``go``), fork, run
    ``child`` in the child, and return its exit code (1 if it raised); then let the step end."""
    thread = threading.Thread(target=step)
    thread.start()
    try:
        assert inside.wait(WAIT_S)
        return exit_code_of_fork(child, WAIT_S)
    finally:
        go.set()
        thread.join(WAIT_S)


class HoldsInside(Dataset):  # type: ignore[type-arg]
    """Item i is ``[i]``; loading item 5 says so (``inside``) and waits for ``go``, once."""

    def __init__(self) -> None:
        self.inside, self.go = threading.Event(), threading.Event()

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 5 and not self.inside.is_set():
            self.inside.set()
            self.go.wait(WAIT_S)
        return torch.tensor([float(i)])


def test_a_process_forked_while_another_thread_is_inside_next_refuses_its_half_step() -> None:
    """Review 51: the fork hook frees the iterator's lock another thread held at the fork, so
    a fork-to-snapshot child's ``state_dict()`` described the step that thread was half-way
    through with ``num_workers=0`` (its sampler position and the dataset's RNG draws so far).
    There it now raises, naming the fix; ``iter(loader)`` in the child gives a new epoch."""
    dataset = HoldsInside()
    loader = DataLoader(dataset, batch_size=2)
    it = iter(loader)
    next(it)
    next(it)

    def child() -> int:
        try:
            loader.state_dict()
            return 2  # a state of half a step
        except RuntimeError as e:
            if "forked while another thread was inside" not in str(e):
                return 3
        dataset.inside.set()  # (item 5 loads at once here)
        return 0 if len(list(loader)) == N // 2 else 4

    # the thread loads items 4 and 5
    assert _fork_while_inside(lambda: next(it), dataset.inside, dataset.go, child) == 0
    assert loader.state_dict()["yielded"] == 3  # the parent's own iterator is whole


class SlowToSave(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """A stream of ``[1] .. [20]`` whose ``state_dict()`` says it is inside (``inside``) and
    waits for ``go`` while ``hold`` is set."""

    def __init__(self) -> None:
        self.pos = 0
        self.hold = False
        self.inside, self.go = threading.Event(), threading.Event()

    def __iter__(self) -> Iterator[torch.Tensor]:
        while self.pos < 20:
            self.pos += 1
            yield torch.tensor([float(self.pos)])

    def state_dict(self) -> dict[str, int]:
        if self.hold:
            self.inside.set()
            self.go.wait(WAIT_S)
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = state["pos"]


def test_a_process_forked_while_another_thread_saves_refuses_the_iterator_too() -> None:
    """Reviews 53 and 54: a thread inside a ``num_workers=0`` iterator's ``state_dict()`` may be
    inside the dataset's own, which may take its state apart and put it back (a shuffle
    buffer): a child forked then refuses the iterator as one forked inside ``next()`` does (a
    version that let it through lost 3 items there), and the parent goes on whole."""
    dataset = SlowToSave()
    loader = DataLoader(dataset, batch_size=2)
    it = iter(loader)
    next(it)
    next(it)

    def child() -> int:
        dataset.hold = False
        try:
            loader.state_dict()
            return 2
        except RuntimeError as e:
            return 0 if "forked while another thread was inside" in str(e) else 3

    dataset.hold = True
    assert _fork_while_inside(loader.state_dict, dataset.inside, dataset.go, child) == 0
    dataset.hold = False
    assert next(it).tolist() == [[5.0], [6.0]]


def _save_while_a_thread_waits(loader: DataLoader[Any]) -> tuple[threading.Thread, Any]:
    """From inside ``next()``: start a checkpoint thread, let it take the loader's lock (it then
    waits for this ``next()``), then call ``state_dict()`` here. Returns the thread and what the
    call here raised (None if it returned)."""
    thread = threading.Thread(target=lambda: loader.state_dict())
    thread.start()
    lock = loader._state_lock
    deadline = time.monotonic() + WAIT_S
    while lock.acquire(blocking=False):  # until the thread holds it
        lock.release()
        assert time.monotonic() < deadline, "the checkpoint thread never took the lock"
        threading.Event().wait(0.001)  # (a bounded pause between looks)
    try:
        loader.state_dict()
    except RuntimeError as e:
        return thread, e
    return thread, None


class SavesInside(Dataset):  # type: ignore[type-arg]
    """Item i is ``[i]``; loading item 1 (in this process: ``num_workers=0``) runs
    :func:`_save_while_a_thread_waits` once."""

    def __init__(self) -> None:
        self.loader: DataLoader[Any] | None = None
        self.result: list[tuple[threading.Thread, Any]] = []

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 1 and self.loader is not None and not self.result:
            self.result.append(_save_while_a_thread_waits(self.loader))
        return torch.tensor([float(i)])


@pytest.mark.parametrize("workers", [0, 2], ids=["num_workers=0", "2-workers"])
@frees_its_loaders_on_failure
def test_state_dict_inside_next_raises_while_a_checkpoint_thread_waits_for_that_next(
    workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 47: a checkpoint thread's ``state_dict()`` holds the loader's lock and waits for
    the ``next()`` under way; a ``state_dict()`` from inside that ``next()`` (a signal handler,
    say) waited for the loader's lock: both waited for good. It raises the error that says to
    save between steps, as it does with no checkpoint thread."""
    data = SavesInside()
    loader = DataLoader(data, batch_size=BATCH, num_workers=workers,
                        timeout=TIMEOUT if workers else 0)  # fmt: skip
    it = iter(loader)
    if workers:  # inside next(): where it offers slots, as the test of one thread does
        offer = it._dispatch.offer

        def offer_and_save() -> None:
            if not data.result:
                data.result.append(_save_while_a_thread_waits(loader))
            offer()

        monkeypatch.setattr(it._dispatch, "offer", offer_and_save)
    else:
        data.loader = loader
    first = next(it)
    monkeypatch.undo()
    assert data.result, "the test did not reach state_dict() inside next()"
    thread, raised = data.result[0]
    thread.join(WAIT_S)
    assert not thread.is_alive()
    assert isinstance(raised, RuntimeError) and "between steps" in str(raised), raised
    assert first.flatten().tolist() == [0.0, 1.0, 2.0, 3.0]
    assert loader.state_dict()["yielded"] == 1


class StartsAChildInside(Dataset):  # type: ignore[type-arg]
    """Item i is ``[i]``; loading item 1 (``num_workers=0``: inside ``next()``) starts, once, a
    ``multiprocessing`` child (fork) that saves the loader's state and runs an epoch of it."""

    def __init__(self) -> None:
        self.loader: DataLoader[Any] | None = None
        self.exitcode: int | None = None

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 1 and self.exitcode is None and self.loader is not None:
            loader = self.loader

            def child() -> None:
                loader.state_dict()
                os._exit(0 if len(list(loader)) == N // BATCH else 2)

            proc = multiprocessing.get_context("fork").Process(target=child)
            proc.start()
            proc.join(WAIT_S)
            if proc.exitcode is None:
                proc.kill()
                proc.join(WAIT_S)
            self.exitcode = proc.exitcode
        return torch.tensor([float(i)])


@frees_its_loaders_on_failure
def test_a_child_started_inside_a_fetch_iterates_and_saves_its_inherited_loader() -> None:
    """Review 48: a multiprocessing child started from inside a num_workers=0 fetch inherited
    the iterator's lock held (by the thread that forked, which the child never returns to):
    its iter(loader) and state_dict() raised the re-entrance error."""
    data = StartsAChildInside()
    loader = data.loader = DataLoader(data, batch_size=BATCH)
    assert len(list(loader)) == N // BATCH
    assert data.exitcode == 0


def test_a_loader_subclass_that_is_not_hashable_is_made_and_iterated() -> None:
    """Review 48: registering a loader for the fork hook needed it hashable; torch's does not."""

    class Compared(DataLoader):  # type: ignore[type-arg]
        def __eq__(self, other: object) -> bool:
            return self is other

    assert Compared.__hash__ is None
    assert len(list(Compared(Augment(), batch_size=BATCH))) == N // BATCH
