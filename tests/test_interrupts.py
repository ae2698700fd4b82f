"""Ctrl-C (or an exception a signal handler raises) inside ``next()``: never a hang.

A stress run found it (a timer whose handler raised inside the loader, the loop catching it and
going on): after some hundreds of interruptions a batch was lost, and the loop then waited for
it forever (``timeout=`` turned that into "timed out"). Now an interruption in the wait for
workers' frames changes nothing, and one anywhere else marks the iterator unusable at once, with
its workers stopped; iterating the loader again starts over (``shmloader.interrupts``).
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import shmloader
from shmloader.epoch import ShmDataLoaderIter
from shmloader.interrupts import from_a_signal
from shmloader.supervisor import Supervisor
from tests.lifetime_checks import frees_its_loaders_on_failure


class Rows(torch.utils.data.Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((64,), i)


def firsts(batches: list[torch.Tensor]) -> list[int]:
    return [int(b[0, 0]) for b in batches]


ALL = list(range(0, 40, 4))


class Alarm(Exception):
    pass


def _raise_alarm(signum: int, frame: Any) -> None:
    raise Alarm


def test_exceptions_of_signal_handlers_are_told_from_those_raised_by_code():
    assert from_a_signal(KeyboardInterrupt())
    with pytest.raises(ValueError) as plain:
        raise ValueError("by code")
    assert not from_a_signal(plain.value)
    before = signal.signal(signal.SIGUSR1, _raise_alarm)
    try:
        with pytest.raises(Alarm) as alarm:
            signal.raise_signal(signal.SIGUSR1)  # the handler runs before this call returns
        assert from_a_signal(alarm.value)  # the handler's frame is in its traceback
        assert not from_a_signal(Alarm())  # the same type, raised by code
    finally:
        signal.signal(signal.SIGUSR1, before)


@pytest.fixture
def interrupt_once(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``interrupt_once(cls, name, at)``: the ``at``-th call of ``cls.name`` raises
    ``KeyboardInterrupt`` first, as a Ctrl-C landing right there would."""

    def arm(cls: type, name: str, at: int) -> None:
        real = getattr(cls, name)
        calls = [0]

        def interrupted(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] == at:
                raise KeyboardInterrupt
            return real(*args, **kwargs)

        monkeypatch.setattr(cls, name, interrupted)

    yield arm
    monkeypatch.undo()


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh", "persistent"])
@frees_its_loaders_on_failure
def test_an_interruption_while_answers_are_recorded_makes_the_iterator_say_so(
    interrupt_once: Any, persistent: bool
) -> None:
    loader = shmloader.DataLoader(
        Rows(), batch_size=4, num_workers=2, persistent_workers=persistent, timeout=30
    )
    it = iter(loader)
    held = [next(it), next(it)]
    pids = loader.stats().worker_pids
    interrupt_once(ShmDataLoaderIter, "_handle", 1)  # the next answer the loader records
    with pytest.raises(KeyboardInterrupt):
        while True:
            held.append(next(it))  # (batches already recorded may still come first)
    with pytest.raises(RuntimeError, match="interrupted by KeyboardInterrupt while it was record"):
        next(it)  # before: a lost answer, then a wait without end (or "timed out")
    assert all(not p.is_alive() for p in it._workers), "its workers were not stopped"
    assert firsts(held) == ALL[: len(held)]  # batches held before it stay intact
    assert firsts(list(loader)) == ALL  # the loader starts over, on fresh workers
    assert set(loader.stats().worker_pids).isdisjoint(pids)


@frees_its_loaders_on_failure
def test_an_interruption_of_the_wait_for_workers_changes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loader = shmloader.DataLoader(Rows(), batch_size=4, num_workers=2, timeout=30)
    it = iter(loader)
    got = [next(it)]
    real = Supervisor._poller

    class PollInterruptedOnce:
        """The supervisor's poll object, whose next ``poll`` is cut short by a Ctrl-C."""

        def __init__(self, poll: Any) -> None:
            self.real, self.armed = poll, True

        def poll(self, ms: int | None) -> Any:
            if self.armed:
                self.armed = False
                raise KeyboardInterrupt
            return self.real.poll(ms)

    armed: dict[int, PollInterruptedOnce] = {}

    def poller(sup: Supervisor) -> Any:
        return armed.setdefault(id(sup), PollInterruptedOnce(real(sup)))

    monkeypatch.setattr(Supervisor, "_poller", poller)
    interrupted = 0
    while True:
        try:
            got.append(next(it))
        except KeyboardInterrupt:
            interrupted += 1  # Ctrl-C caught by the loop, which goes on
        except StopIteration:
            break
    assert interrupted == 1
    assert firsts(got) == ALL  # nothing lost, nothing twice
