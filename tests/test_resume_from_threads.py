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

import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import Sampler

from shmloader import DataLoader
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
