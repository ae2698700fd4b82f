"""Dispatch at the arena's cap, driven directly (a real arena, a fake supervisor): the batch
needed next waits, rather than raise, while slots it could use are still coming back."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import closing
from types import SimpleNamespace
from typing import Any

import pytest

from arena import ArenaCapacityError, ArenaExhaustedError
from arena._layout import PAGE
from shmloader import protocol as P
from shmloader.dispatch import Dispatch, Orphan
from shmloader.host import ArenaHost


class FakeSupervisor:
    """Records what dispatch sends; its workers are alive."""

    def __init__(self, workers: int) -> None:
        self.sent: list[tuple[int, Any]] = []
        self.procs = [SimpleNamespace(exitcode=None) for _ in range(workers)]
        self.stopped = False

    def send(self, wid: int, msg: Any) -> None:
        self.sent.append((wid, msg))


@pytest.fixture
def host() -> Iterator[ArenaHost]:
    h = ArenaHost(backend="memfd", max_bytes=4 * PAGE, slots_per_slab=4, pin=False, pin_device=None)
    with closing(h):
        yield h


def blocked_head(host: ArenaHost) -> Dispatch:
    """Every slot taken: three lent to the user; the head (task 0 of worker 0) asks for one."""
    d = Dispatch(host, FakeSupervisor(2), 2, 4, True, threading.RLock())  # type: ignore[arg-type]
    host.sizes.at_least(PAGE)
    refs = [host.arena.acquire(PAGE) for _ in range(4)]
    for ref in refs[:3]:
        host.arena.mark_ready(ref)
        host.arena.lend(ref)
    head = d.tasks.add(0, None)
    d.num_tasks[0] += 1
    d.need(head, P.NeedSlot(head.seq, d.epoch, 0, PAGE, None))
    d.last_ref = refs[3]  # type: ignore[attr-defined]
    return d


def test_the_head_waits_for_a_slot_an_abandoned_epochs_batch_still_writes(host):
    d = blocked_head(host)
    # The fourth slot belongs to a task of an abandoned epoch its worker still writes: its slot
    # comes back when it answers (review 9: the head raised ArenaExhaustedError instead).
    d.orphans[(d.epoch - 1, 5)] = Orphan(1, [d.last_ref], d.last_ref)  # type: ignore[attr-defined]
    d.unblock(0, None)  # returns: the caller waits for frames
    assert 0 in d.asked
    d.orphan_answered(P.Dropped(5, d.epoch - 1, 1))  # it answers: its slot is free
    d.offer()
    assert 0 not in d.asked and d.tasks.get(0).ref is not None  # type: ignore[union-attr]


def test_with_no_slot_coming_back_the_head_raises(host):
    d = blocked_head(host)  # the fourth slot is taken by nothing that will ever answer
    with pytest.raises(ArenaExhaustedError, match="no arena slot is free for the next batch"):
        d.unblock(0, None)


def test_a_main_process_error_keeps_no_frame_it_was_caught_in_and_raises_a_copy():
    """Review 42: the error of a batch the dispatch denied kept its traceback (the dispatch's
    frames, and through them the iterator's) inside the task's answer, a cycle: a dropped
    loader kept its workers and slabs until the garbage collector ran, and a fresh loader's
    retry found /dev/shm still full."""
    import gc
    import weakref

    from arena import ArenaCapacityError
    from shmloader.dispatch import MainError

    class Holder:
        pass

    def deny(holder: Holder) -> MainError:  # a frame that holds ``holder`` catches the error
        try:
            try:
                raise OSError(28, "No space left on device")
            except OSError:
                raise ArenaCapacityError("cannot reserve 8 bytes") from None
        except ArenaCapacityError as e:
            return MainError(e)

    holder = Holder()
    alive = weakref.ref(holder)
    error = deny(holder)
    del holder
    gc.disable()  # (nothing but reference counts may free it)
    try:
        assert alive() is None
        with pytest.raises(ArenaCapacityError, match="cannot reserve 8 bytes") as raised:
            error.reraise()
        assert raised.value is not error.exc
    finally:
        gc.enable()


def test_a_denied_batchs_error_is_kept_without_the_frames_it_was_caught_in(host):
    """Review 82: the error of a batch denied (larger than the cap) was kept with its traceback
    until the worker acknowledged the DENY; the traceback's frames hold the iterator, and the
    iterator's finalizer holds the dispatch, so an iterator dropped before the acknowledgement
    was never freed, not even by a garbage collection."""
    d = Dispatch(host, FakeSupervisor(2), 2, 4, True, threading.RLock())  # type: ignore[arg-type]
    task = d.tasks.add(0, None)
    d.num_tasks[0] += 1
    d.need(task, P.NeedSlot(task.seq, d.epoch, 0, 8 * PAGE, None))  # twice the cap
    assert d.sup.sent[-1] == (0, P.Deny(task.seq, d.epoch))  # type: ignore[attr-defined]
    kept = d.denied[task.seq].exc
    assert kept.__traceback__ is None and kept.__context__ is None
    d.answer(task, P.Dropped(task.seq, d.epoch, 0))  # acknowledged: the task fails with it
    with pytest.raises(ArenaCapacityError, match="larger than"):
        task.answer.error.reraise()  # type: ignore[union-attr]
