"""Ctrl-C (or an exception a signal handler raises) inside ``next()``: never a hang.

A stress run found it (a timer whose handler raised inside the loader, the loop catching it and
going on): after some hundreds of interruptions a batch was lost, and the loop then waited for
it forever (``timeout=`` turned that into "timed out"). Now an interruption in the wait for
workers' frames changes nothing, and one anywhere else marks the iterator unusable at once, with
its workers stopped; iterating the loader again starts over (``shmloader.interrupts``).
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing.process
import os
import select
import signal
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import shmloader
from shmloader import afterfork, ending, supervisor
from shmloader import protocol as P
from shmloader.epoch import ShmDataLoaderIter
from shmloader.host import ArenaHost
from shmloader.lease import Leases
from shmloader.supervisor import Supervisor
from tests.forked import ForkedChild
from tests.lifetime_checks import frees_its_loaders_on_failure


class Rows(torch.utils.data.Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((64,), i)


def firsts(batches: list[torch.Tensor]) -> list[int]:
    return [int(b[0, 0]) for b in batches]


ALL = list(range(0, 40, 4))


def retired(loader: shmloader.DataLoader[Any]) -> tuple[int, int]:
    st = loader.stats()
    return st.batches_retired, st.bytes_retired


@contextlib.contextmanager
def slab_memory(host: ArenaHost) -> Iterator[Callable[[], int]]:
    """A reader of the memory the kernel holds for ``host``'s slabs, also after they close
    (through descriptors of its own, closed on leaving)."""
    fds = [os.dup(s.segment._fd) for s in host.arena.slabs()]
    del host  # (this frame must not keep the host, and so its arena, alive)
    try:
        yield lambda: sum(os.fstat(fd).st_blocks * 512 for fd in fds)
    finally:
        for fd in fds:
            os.close(fd)


class Alarm(Exception):
    """What a SIGALRM handler of the user's might raise (any type, any kind of handler)."""


@pytest.fixture
def interrupt_once(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``interrupt_once(cls, name, at, exc)``: the ``at``-th call of ``cls.name`` raises ``exc``
    (``KeyboardInterrupt``) first, as a Ctrl-C (or a signal handler) landing right there would."""

    def arm(cls: type, name: str, at: int, exc: type[BaseException] = KeyboardInterrupt) -> None:
        real = getattr(cls, name)
        calls = [0]

        def interrupted(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] == at:
                raise exc
            return real(*args, **kwargs)

        monkeypatch.setattr(cls, name, interrupted)

    yield arm
    monkeypatch.undo()


@pytest.mark.parametrize(
    ("persistent", "exc"),
    [(False, KeyboardInterrupt), (True, KeyboardInterrupt), (False, Alarm)],
    ids=["fresh", "persistent", "a-handlers-own-exception"],
)
@frees_its_loaders_on_failure
def test_an_interruption_while_answers_are_recorded_makes_the_iterator_say_so(
    interrupt_once: Any, persistent: bool, exc: type[BaseException]
) -> None:
    loader = shmloader.DataLoader(
        Rows(), batch_size=4, num_workers=2, persistent_workers=persistent, timeout=30
    )
    it = iter(loader)
    held = [next(it), next(it)]
    pids = loader.stats().worker_pids
    interrupt_once(ShmDataLoaderIter, "_handle", 1, exc)  # the next answer the loader records
    with pytest.raises(exc):
        while True:
            held.append(next(it))  # (batches already recorded may still come first)
    with pytest.raises(RuntimeError, match=rf"next\(\) was interrupted by {exc.__name__} while it"):
        next(it)  # before: a lost answer, then a wait without end (or "timed out")
    assert all(not p.is_alive() for p in it._workers), "its workers were not stopped"
    assert firsts(held) == ALL[: len(held)]  # batches held before it stay intact
    assert firsts(list(loader)) == ALL  # the loader starts over, on fresh workers
    assert set(loader.stats().worker_pids).isdisjoint(pids)
    assert loader.stats().slabs >= 1 and not it._host.retired  # the arena's books were whole


@frees_its_loaders_on_failure
def test_an_interruption_inside_the_arenas_books_retires_the_arena(interrupt_once: Any) -> None:
    loader = shmloader.DataLoader(Rows(), batch_size=4, num_workers=2, timeout=30)
    it = iter(loader)
    held = next(it)
    old = it._host
    interrupt_once(Leases, "_give_back", 1)  # a dead batch's slot, on its way back
    del held
    with pytest.raises(KeyboardInterrupt):
        next(it)
    assert old.retired
    with pytest.raises(RuntimeError, match="interrupted by KeyboardInterrupt"):
        next(it)
    assert firsts(list(loader)) == ALL  # on a fresh arena
    assert loader._host is not old


def _retired_holding(
    interrupt_once: Any, held: int
) -> tuple[shmloader.DataLoader[Any], ShmDataLoaderIter, Any, int, list[torch.Tensor]]:
    """A loader whose arena an interruption retired while ``held`` of its batches were held:
    the loader, its failed iterator, the retired host, its slot size and the batches."""
    loader = shmloader.DataLoader(Rows(), batch_size=4, num_workers=2, timeout=30)
    it = iter(loader)
    kept = [next(it) for _ in range(held)]
    dropped = next(it)
    old = it._host
    slot = old.arena.stats().slot_sizes[0]
    interrupt_once(Leases, "_give_back", 1)  # the dropped batch's slot, on its way back
    del dropped
    with pytest.raises(KeyboardInterrupt):
        next(it)
    assert old.retired
    return loader, it, old, slot, kept


@frees_its_loaders_on_failure
def test_a_retired_arena_its_iterator_keeps_whole_is_in_stats_whole(interrupt_once: Any) -> None:
    """Review 14 F1: while an iterator of a retired arena lives (in a variable, or in a saved
    traceback, as IPython keeps the last one), the whole old arena stays; stats() counted only
    the slots of the batches held from it."""
    loader, it, old, slot, (kept,) = _retired_holding(interrupt_once, 1)
    assert firsts(list(loader)) == ALL  # on a fresh arena, while `it` keeps the old one
    allocated = sum(os.fstat(s.segment._fd).st_blocks * 512 for s in old.arena.slabs())
    rings = sum(r.nbytes for r in old.rng_rings.snapshot())
    st = loader.stats()
    assert st.batches_retired == 1
    assert st.bytes_retired == allocated + rings > slot  # what the kernel holds for it
    del it, old
    gc.collect()  # the old arena closes: only the held batch's slot is left
    assert retired(loader) == (1, slot)
    assert firsts([kept]) == [0]
    del kept
    assert retired(loader) == (0, 0)


@frees_its_loaders_on_failure
def test_batches_held_from_a_retired_arena_stay_in_stats_until_dropped(
    interrupt_once: Any,
) -> None:
    """A retired arena is outside the next iterator's, but the batches the user still holds from
    it are shared memory the loader made: stats() counts them until they are dropped, and the
    closed arena keeps nothing else (review 15: not the slot the interruption stranded)."""
    loader, it, old, slot, kept = _retired_holding(interrupt_once, 2)
    assert len({lease.slot.slab_id for lease in old.leases.live()}) == 1  # both in one slab
    with slab_memory(old) as held_now:
        del it, old
        gc.collect()
        fresh = list(loader)  # on a fresh arena; the retired one closes (its iterator is gone)
        assert firsts(fresh) == ALL
        st = loader.stats()
        assert (st.batches_retired, st.bytes_retired) == (2, 2 * slot)
        assert held_now() == 2 * slot
        assert st.batches_held == len(fresh)  # the fresh arena's own count, apart
        assert st.as_row()["bytes_retired"] == 2 * slot
        # The stats export's rows (the host's snapshot) carry them too (review 15 F4).
        assert loader._host.snapshot().as_row()["bytes_retired"] == 2 * slot
        assert firsts(kept) == ALL[:2]  # and the batches are intact
        kept.pop()
        # The closed slab keeps both slots while the other batch maps it (emptying a slot as
        # its batch goes could zero what a process forked since reads, review 21), and stats()
        # says so (review 20: it said one slot).
        assert held_now() == 2 * slot
        assert retired(loader) == (1, 2 * slot)
        kept.clear()
        assert retired(loader) == (0, 0)


@frees_its_loaders_on_failure
def test_a_closed_slab_that_a_released_batch_keeps_mapped_stays_in_stats(
    interrupt_once: Any,
) -> None:
    """Review 22: once a retired arena closed, stats() counted a slab's memory only while a
    batch it lent was alive; a batch released early (shmloader.release) whose views the user
    still holds keeps the slab mapped, and with it the slots held when it closed."""
    loader = shmloader.DataLoader(Rows(), batch_size=4, num_workers=2, timeout=30)
    it = iter(loader)
    released = next(it)
    kept = [next(it)]
    old = it._host
    slot = old.arena.stats().slot_sizes[0]
    assert len({lease.slot.slab_id for lease in old.leases.live()}) == 1  # both in one slab
    with slab_memory(old) as held_now:
        assert shmloader.release(released, loader) == 1  # the user keeps only a reference
        dropped = next(it)
        interrupt_once(Leases, "_give_back", 1)  # the dropped batch's slot, on its way back
        del dropped
        with pytest.raises(KeyboardInterrupt):
            next(it)
        assert old.retired
        del it, old
        gc.collect()
        assert firsts(list(loader)) == ALL  # on a fresh arena; the retired one closed
        assert retired(loader) == (1, slot)
        kept.clear()  # the released batch's views keep the slab, and the slot held at close
        assert held_now() == slot
        assert retired(loader) == (0, slot)
        del released
        assert retired(loader) == (0, 0)


@pytest.mark.parametrize("workers_first", [False, True])
@frees_its_loaders_on_failure
def test_a_closed_slot_that_workers_forked_while_it_was_held_share_stays_in_stats(
    interrupt_once: Any, workers_first: bool
) -> None:
    """Review 24: once a retired arena closed, stats() counted a slot only while this process
    mapped its slab; the next iterator's workers, forked while the batch was held (after the
    close, or before it), share the slot and keep it after the batch is dropped, until they
    exit."""
    loader, it, old, slot, kept = _retired_holding(interrupt_once, 2)  # two in one slab
    with slab_memory(old) as held_now:
        if workers_first:
            it2 = iter(loader)  # its workers are forked while the batches are held
        del it, old
        gc.collect()
        if not workers_first:
            assert firsts(list(loader)) == ALL  # the retired arena closes, its batches held
            kept.pop()  # its slot stays: the other batch maps the slab
            it2 = iter(loader)  # forked while one batch is held
        assert firsts([next(it2)]) == ALL[:1]
        kept.clear()  # this process maps the old slab no more; the workers still do
        gc.collect()
        # Review 25: a worker's mapping of one slot keeps the whole file: both slots held at
        # close (stats said one).
        assert held_now() == 2 * slot
        assert retired(loader) == (0, 2 * slot)
        del it2
        gc.collect()  # its workers are gone
        assert retired(loader) == (0, 0)


@frees_its_loaders_on_failure
def test_an_interruption_in_the_drain_that_starts_a_close_still_closes_the_arena(
    interrupt_once: Any,
) -> None:
    """Review 25: the drain that begins an arena's close ran outside its try, so an
    interruption there left the arena unclosed: every slab whole (not hollowed) while a batch
    kept it mapped, and out of the fork books."""
    loader, it, old, slot, kept = _retired_holding(interrupt_once, 1)
    with slab_memory(old) as held_now:
        assert held_now() > slot
        del it, old
        gc.collect()
        interrupt_once(Leases, "drain", 1)  # the close's own drain: the next one called
        fresh = iter(loader)  # the retired arena closes: interrupted (its finalizer says so)
        assert held_now() == slot  # the held one only
        assert firsts(list(fresh)) == ALL
        assert retired(loader) == (1, slot)
        assert firsts(kept) == ALL[:1]
        kept.clear()
        assert retired(loader) == (0, 0)


@frees_its_loaders_on_failure
def test_slots_kept_for_workers_an_interruption_kept_from_starting_come_back(
    interrupt_once: Any,
) -> None:
    """Review 25: iter() keeps the slots of the batches held from reuse before it forks its
    workers; interrupted before the supervisor took charge of giving them back, they stayed
    kept for good (never reused, counted in slots_kept)."""
    loader = shmloader.DataLoader(Rows(), batch_size=4, num_workers=2, timeout=30)
    held = next(iter(loader))
    interrupt_once(Supervisor, "__init__", 1)
    with pytest.raises(KeyboardInterrupt):
        iter(loader)
    del held
    gc.collect()
    assert loader.stats().slots_kept == 0
    assert firsts(list(loader)) == ALL


class ReadsAPoolOnStart:
    """A ``worker_init_fn`` reading a batch of another loader (a replay pool) once the test says
    go, and writing the first value of each row to ``out``."""

    def __init__(self, pool: list[torch.Tensor], go: int, out: int) -> None:
        self.pool, self.go, self.out = pool, go, out

    def __call__(self, worker_id: int) -> None:
        if os.read(self.go, 1) and self.pool:  # (a worker forked before it was filled: none)
            os.write(self.out, (",".join(map(str, self.pool[0][:, 0].tolist())) + "\n").encode())


class ReaderPipes:
    """The pipes of the readers a worker starts (:class:`ReadsAPoolOnStart`,
    :class:`ForksAReader`): ``ends`` theirs; :meth:`go` lets ``n`` of them read;
    :meth:`lines`, what they wrote once every one is gone (or 30 s passed without a byte)."""

    def __init__(self) -> None:
        self.go_r, self.go_w = os.pipe()
        self.out_r, self.out_w = os.pipe()
        self.ends = (self.go_r, self.out_w)
        self.ends_ours: tuple[int, ...] = (self.go_w, self.out_w)

    def go(self, n: int) -> None:
        os.write(self.go_w, b"x" * n)

    def close_ours(self) -> None:
        """Close this process's write ends (the readers hold their own). Idempotent."""
        ours, self.ends_ours = self.ends_ours, ()
        for fd in ours:
            os.close(fd)

    def lines(self) -> list[str]:
        self.close_ours()
        read = b""
        poller = select.poll()
        poller.register(self.out_r, select.POLLIN)
        while poller.poll(30_000):
            chunk = os.read(self.out_r, 4096)
            if not chunk:
                break
            read += chunk
        os.close(self.out_r)
        os.close(self.go_r)
        return read.decode().split()


@pytest.mark.parametrize("where", ["as forking_workers exits", "as the second start returns"])
@frees_its_loaders_on_failure
def test_workers_an_interrupted_start_leaves_behind_never_read_a_reused_slot(
    monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """Review 26: iter() interrupted after the supervisor had forked its workers (as
    forking_workers() exits) lifted the slots kept for them while they ran on (the traceback
    keeps the supervisor): a worker reading a batch of another loader then read the batch
    written in its place. Only the supervisor lets them go, once its workers are ended. Review
    27: a signal handler's exception as a worker's start() returned left that worker out of
    the supervisor's list: it was never ended, and the slots went as it ran."""
    a = shmloader.DataLoader(Rows(), batch_size=4, num_workers=2, timeout=30)
    it_a = iter(a)
    pool = [next(it_a)]  # rows 0-3, in a slot of a's arena
    pipes = ReaderPipes()
    try:
        b = shmloader.DataLoader(Rows(), batch_size=4, num_workers=2, timeout=30,
                                 worker_init_fn=ReadsAPoolOnStart(pool, *pipes.ends))  # fmt: skip
        if where == "as forking_workers exits":
            real = afterfork.forking_workers

            @contextlib.contextmanager
            def interrupted(keep: Any) -> Iterator[None]:
                with real(keep):
                    yield
                raise Alarm

            monkeypatch.setattr(afterfork, "forking_workers", interrupted)
        else:
            real_start = multiprocessing.process.BaseProcess.start
            starts = []

            def start_then_interrupted(self: Any) -> None:
                real_start(self)
                starts.append(self)
                if len(starts) == 2:
                    raise Alarm

            monkeypatch.setattr(multiprocessing.process.BaseProcess, "start",
                                start_then_interrupted)  # fmt: skip
        with pytest.raises(Alarm) as kept_traceback:  # keeps the supervisor
            iter(b)
        monkeypatch.undo()
        pool_batch = pool.pop()
        del pool_batch
        assert firsts(list(it_a)) == ALL[1:]  # the arena reuses its free slots
        assert firsts(list(a)) == ALL
        pipes.go(2)
    finally:
        pipes.close_ours()
    lines = pipes.lines()
    del kept_traceback
    assert all(line == "0,1,2,3" for line in lines), lines


@frees_its_loaders_on_failure
def test_a_batch_lent_while_workers_start_is_kept_for_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review 27: the slots kept for new workers were those lent before the first fork; a batch
    another thread lent while the workers started was shared by them but not kept, and its slot
    reused while they read it (7 of 12 runs of two threads). Each fork keeps what is lent at
    that moment."""
    a = shmloader.DataLoader(Rows(), batch_size=4, num_workers=2, timeout=30)
    it_a = iter(a)
    pool: list[torch.Tensor] = []
    pipes = ReaderPipes()
    try:
        b = shmloader.DataLoader(Rows(), batch_size=4, num_workers=2, timeout=30,
                                 worker_init_fn=ReadsAPoolOnStart(pool, *pipes.ends))  # fmt: skip
        real_start = multiprocessing.process.BaseProcess.start

        def lend_then_start(self: Any) -> None:  # as another thread lending meanwhile
            if not pool:
                pool.append(next(it_a))
            real_start(self)

        monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", lend_then_start)
        it_b = iter(b)
        monkeypatch.undo()
        pool.clear()
        gc.collect()
        assert a.stats().slots_kept == 1, "the batch b's workers share was not kept"
        assert firsts(list(it_a)) == ALL[1:]
        assert firsts(list(a)) == ALL
        pipes.go(2)
    finally:
        pipes.close_ours()
    del it_b
    gc.collect()
    lines = pipes.lines()
    assert all(line == "0,1,2,3" for line in lines), lines
    assert a.stats().slots_kept == 0


@frees_its_loaders_on_failure
def test_a_batch_lent_after_a_workers_fork_hook_and_before_the_fork_is_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review 28: Python runs other fork hooks after shmloader's (logging's takes its lock),
    then forks; a batch another thread lent in between was shared by the worker and not kept.
    Here that thread holds logging's lock, lends once the last worker's keep is taken, then
    lets go."""
    a = shmloader.DataLoader(Rows(), batch_size=4, num_workers=2, timeout=30)
    it_a = iter(a)
    pool: list[torch.Tensor] = []
    took, holding, failed = threading.Event(), threading.Event(), []
    real_take = afterfork.Keep.take
    takes = []

    def take_then_wait(self: Any, pid: int) -> None:
        real_take(self, pid)
        takes.append(pid)
        if len(takes) == 2:  # the last worker's fork (an earlier one's keep covers later lends)
            took.set()
            if not holding.wait(30):  # the lender holds logging's lock: its hook will wait
                failed.append("the lender did not take logging's lock")

    def lender() -> None:
        if not took.wait(30):
            failed.append("no second fork")
            return
        with logging_module_lock():
            holding.set()
            pool.append(next(it_a))  # after shmloader's hook, before the fork

    pipes = ReaderPipes()
    try:
        b = shmloader.DataLoader(Rows(), batch_size=4, num_workers=2, timeout=30,
                                 worker_init_fn=ReadsAPoolOnStart(pool, *pipes.ends))  # fmt: skip
        monkeypatch.setattr(afterfork.Keep, "take", take_then_wait)
        thread = threading.Thread(target=lender)
        thread.start()
        it_b = iter(b)  # its second fork waits for logging's lock: the lender lends meanwhile
        thread.join(30)
        monkeypatch.undo()
        assert not failed and len(pool) == 1
        pool.clear()
        gc.collect()
        assert a.stats().slots_kept == 1, "the batch b's workers share was not kept"
        assert firsts(list(it_a)) == ALL[1:]
        pipes.go(2)
    finally:
        pipes.close_ours()
    del it_b
    gc.collect()
    lines = pipes.lines()
    assert all(line == "0,1,2,3" for line in lines), lines
    assert a.stats().slots_kept == 0


@frees_its_loaders_on_failure
def test_a_plain_child_forked_with_nothing_lent_at_the_hook_keeps_a_batch_lent_before_the_fork(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review 29: with nothing lent when shmloader's fork hook ran, a plain fork made no keep
    and copied nothing; a batch another thread lent before the fork itself (here while the
    fork waits for logging's lock) was shared by the child, uncopied, and its slot reused."""
    a = shmloader.DataLoader(Rows(), batch_size=4, num_workers=2, timeout=30)
    it_a = iter(a)
    pool: list[torch.Tensor] = []
    hooked, holding, failed = threading.Event(), threading.Event(), []
    real_keep = afterfork._keep_until_forked

    def keep_then_say(keep: Any, pid: int) -> None:  # shmloader's hook keeps what is lent
        real_keep(keep, pid)
        hooked.set()
        if not holding.wait(30):
            failed.append("the lender did not take logging's lock")

    def lender() -> None:
        if not hooked.wait(30):
            failed.append("the fork kept nothing (no keep was made)")
            return
        with logging_module_lock():
            holding.set()
            pool.append(next(it_a))  # after shmloader's hook, before the fork

    pipes = ReaderPipes()
    thread = threading.Thread(target=lender)
    thread.start()
    monkeypatch.setattr(afterfork, "_keep_until_forked", keep_then_say)
    try:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(pipes.go_w)  # (EOF once the parent closes its end)
                if os.read(pipes.go_r, 1):
                    row = ",".join(map(str, pool[0][:, 0].tolist()))
                    os.write(pipes.out_w, (row + "\n").encode())
                code = 0
            finally:
                os._exit(code)
        monkeypatch.undo()
        thread.join(30)
        assert not failed and len(pool) == 1
        pool.clear()
        gc.collect()
        assert firsts(list(it_a)) == ALL[1:]  # the arena reuses its free slots
        assert firsts(list(a)) == ALL
        pipes.go(1)
    finally:
        pipes.close_ours()
    lines = pipes.lines()
    os.waitpid(pid, 0)
    assert lines == ["0,1,2,3"]


def test_a_child_starts_with_the_fork_bookkeeping_lock_free() -> None:
    """Review 29: a thread of the parent could hold afterfork's lock at the fork (its fork hook
    runs while other threads run on); the child's next fork then waited for good."""
    with afterfork._pending_lock:  # as another thread inside _fork_done at the fork
        child = ForkedChild(lambda: afterfork._pending_lock.acquire(timeout=5), timeout=30)
        assert child.result() is True


@contextlib.contextmanager
def logging_module_lock() -> Iterator[None]:
    """Hold the lock logging's fork hook takes (as logging.getLogger() holds it)."""
    import logging

    lock = logging._lock  # type: ignore[attr-defined]
    with lock:
        yield


class ForksAReader:
    """A ``worker_init_fn`` that forks a process reading a batch of another loader (a replay
    pool) once the test says go, writing the first value of each row to ``out``, then
    leaving; the worker goes on at once."""

    def __init__(self, pool: list[torch.Tensor], go: int, out: int) -> None:
        self.pool, self.go, self.out = pool, go, out

    def __call__(self, worker_id: int) -> None:
        if worker_id == 0 and os.fork() == 0:
            try:
                if os.read(self.go, 1):
                    row = ",".join(map(str, self.pool[0][:, 0].tolist()))
                    os.write(self.out, (row + "\n").encode())
            finally:
                os._exit(0)


class StartsANestedLoader:
    """A ``worker_init_fn`` that makes and runs, in the worker, a loader of its own whose worker
    forks a process reading a batch of the main process's (:class:`ForksAReader`)."""

    def __init__(self, pool: list[torch.Tensor], go: int, out: int) -> None:
        self.pool, self.go, self.out = pool, go, out

    def __call__(self, worker_id: int) -> None:
        # A worker is a daemon, which may have no children: the known workaround, as in torch.
        multiprocessing.current_process()._config["daemon"] = False  # type: ignore[attr-defined]
        nested = shmloader.DataLoader(
            Rows(), batch_size=4, num_workers=1, timeout=30,
            worker_init_fn=ForksAReader(self.pool, self.go, self.out),
        )  # fmt: skip
        assert firsts(list(nested)) == ALL


@pytest.mark.parametrize("forker", ["worker", "nested worker"])
@frees_its_loaders_on_failure
def test_a_process_a_worker_forks_keeps_the_batches_the_worker_shares(forker: str) -> None:
    """Review 28: a shmloader worker shares the slots lent when it started, uncopied; a process
    it forked copied nothing (its parent lent nothing), and read a reused slot once the worker
    had ended and the slot was let go. It copies what the worker shares. Review 30: a worker of
    a loader made inside a worker shares, uncopied, what its parent shares from the main
    process too; a process it forked copied only its parent's lent slots."""
    a = shmloader.DataLoader(Rows(), batch_size=4, num_workers=2, timeout=30)
    it_a = iter(a)
    pool = [next(it_a)]
    pipes = ReaderPipes()
    init = ForksAReader if forker == "worker" else StartsANestedLoader
    try:
        b = shmloader.DataLoader(Rows(), batch_size=4, num_workers=1, timeout=60,
                                 worker_init_fn=init(pool, *pipes.ends))  # fmt: skip
        assert firsts(list(b)) == ALL  # its workers (nested ones too) end with the epoch
        pool.clear()
        gc.collect()
        assert a.stats().slots_kept == 0
        assert firsts(list(it_a)) == ALL[1:]  # the arena reuses the slot
        assert firsts(list(a)) == ALL
        pipes.go(1)
    finally:
        pipes.close_ours()
    assert pipes.lines() == ["0,1,2,3"]


class ForkingCollate:
    """A ``collate_fn`` that writes the batch into ``shmloader.empty()`` (the README's way to
    collate into the slot) and, for its worker's first batch, forks a process that reads it
    once the test says go (say, to write it out in the background): ``same``, or what changed."""

    def __init__(self, go: int, out: int) -> None:
        self.go, self.out = go, out
        self.batches = 0

    def __call__(self, samples: list[torch.Tensor]) -> torch.Tensor:
        out = shmloader.empty((len(samples), *samples[0].shape), dtype=samples[0].dtype)
        torch.stack(samples, out=out)
        self.batches += 1
        if self.batches == 1 and os.fork() == 0:
            try:
                wrote = out[:, 0].tolist()
                if os.read(self.go, 1):
                    now = out[:, 0].tolist()
                    line = "same" if now == wrote else f"{wrote}->{now}".replace(" ", "")
                    os.write(self.out, (line + "\n").encode())
            finally:
                os._exit(0)
        return out


@frees_its_loaders_on_failure
def test_a_process_forked_in_a_collate_fn_keeps_the_batch_being_written() -> None:
    """Review 30: the slot a worker writes into is lent by nobody yet, so a process forked
    inside the collate_fn shared it uncopied, and read the next epoch's batch there (torch's
    child keeps its batch: a shared-memory file never reused)."""
    pipes = ReaderPipes()
    try:
        collate = ForkingCollate(*pipes.ends)
        loader = shmloader.DataLoader(Rows(), batch_size=4, num_workers=1, timeout=30,
                                      shuffle=True, collate_fn=collate)  # fmt: skip
        for _ in range(3):  # each epoch's first slot is written again in the next epochs
            assert sorted(int(v) for b in loader for v in b[:, 0]) == list(range(40))
        pipes.go(3)
    finally:
        pipes.close_ours()
    assert pipes.lines() == ["same"] * 3


class ForksAnAllocator:
    """A ``collate_fn`` that, at its worker's first batch and before allocating anything, forks
    a helper which, once the test says go, fills a tensor from ``shmloader.empty()`` with -7
    (outside a worker: torch.empty) and says ``done``."""

    def __init__(self, go: int, out: int) -> None:
        self.go, self.out = go, out
        self.batches = 0

    def __call__(self, samples: list[torch.Tensor]) -> torch.Tensor:
        self.batches += 1
        if self.batches == 1 and os.fork() == 0:
            try:
                if os.read(self.go, 1):
                    shmloader.empty((4, 64), dtype=torch.int64).fill_(-7)
                    os.write(self.out, b"done\n")
            finally:
                os._exit(0)
        out = shmloader.empty((len(samples), *samples[0].shape), dtype=samples[0].dtype)
        return torch.stack(samples, out=out)


@frees_its_loaders_on_failure
def test_shmloader_empty_in_a_process_forked_in_a_task_allocates_privately() -> None:
    """Review 33: a child forked inside a task kept the worker's slot session, so its
    shmloader.empty() handed out the worker's slot, shared: it overwrote a held batch."""
    pipes = ReaderPipes()
    try:
        loader = shmloader.DataLoader(Rows(), batch_size=4, num_workers=1, timeout=30,
                                      collate_fn=ForksAnAllocator(*pipes.ends))  # fmt: skip
        # Each epoch's worker forks at its first task: in the second, slots are free at once,
        # so that task has one from the start.
        held = [list(loader), list(loader)]
        pipes.go(2)
    finally:
        pipes.close_ours()
    assert pipes.lines() == ["done", "done"]
    for epoch in held:
        assert firsts(epoch) == ALL
        assert all(torch.equal(b[:, 1:], b[:, :1].expand(-1, 63)) for b in epoch)
    del held


@frees_its_loaders_on_failure
def test_an_interrupted_teardown_keeps_the_slots_of_workers_it_did_not_end(
    interrupt_once: Any,
) -> None:
    """Review 26: iter() interrupted while forking its second worker, its teardown interrupted
    in its wait for a worker's exit, and the kill interrupted before the first worker's: the
    teardown let the slots kept for the workers go while the first one ran on. They go only
    once it is ended (here by the finalizer of the supervisor the traceback kept)."""
    a = shmloader.DataLoader(Rows(), batch_size=4, num_workers=2, timeout=30)
    held = [next(iter(a))]
    b = shmloader.DataLoader(Rows(), batch_size=4, num_workers=2, timeout=30)
    interrupt_once(multiprocessing.process.BaseProcess, "start", 2)
    # the teardown's wait for the first worker's exit (Supervisor._wait_exit, which replaced
    # Process.join there: join blocks for good on a worker that closed its sentinel, review 46)
    interrupt_once(Supervisor, "_wait_exit", 1)
    # the kill of the first worker (through its pidfd: supervisor._send, review 52)
    interrupt_once(supervisor, "_send", 1)
    with pytest.raises(KeyboardInterrupt) as kept_traceback:
        iter(b)
    sup = next(f.frame.f_locals["self"] for f in kept_traceback.traceback
               if f.name == "shutdown")  # fmt: skip
    alive = [p for p in sup.procs if p.is_alive()]
    assert len(alive) == 1, "the first worker was to be left running"
    held.clear()
    assert a.stats().slots_kept == 1, "the slot was let go while a worker shares it"
    del sup, alive, kept_traceback
    gc.collect()  # the supervisor's finalizer ends the worker, then lets the slot go
    assert a.stats().slots_kept == 0
    assert firsts(list(a)) == ALL


@frees_its_loaders_on_failure
def test_an_interruption_while_slots_are_kept_for_new_workers_keeps_all_and_none_for_good(
    interrupt_once: Any,
) -> None:
    """Review 26: an interruption inside afterfork's keep (the second loader's quarantine)
    lost the first loader's, which kept its slot for good. The keep is made in each worker's
    fork hook now, where nothing stops the fork (Python reports the interruption and forks):
    it must keep every loader's slots all the same, and give them all back."""
    a = shmloader.DataLoader(Rows(), batch_size=4, num_workers=2, timeout=30)
    c = shmloader.DataLoader(Rows(), batch_size=4, num_workers=2, timeout=30)
    held = [next(iter(a)), next(iter(c))]
    b = shmloader.DataLoader(Rows(), batch_size=4, num_workers=2, timeout=30)
    interrupt_once(Leases, "quarantine", 2)
    it_b = iter(b)  # (the hook's KeyboardInterrupt is reported, not raised)
    held.clear()
    gc.collect()
    assert (a.stats().slots_kept, c.stats().slots_kept) == (1, 1)  # b's workers share them
    assert firsts(list(it_b)) == ALL
    del it_b
    gc.collect()
    assert (a.stats().slots_kept, c.stats().slots_kept) == (0, 0)


@frees_its_loaders_on_failure
def test_an_interruption_in_the_lift_after_a_plain_fork_keeps_no_slot_for_good(
    interrupt_once: Any,
) -> None:
    """Review 27: the slots kept while a plain child copies the batches held are let go in the
    parent's after-fork hook, which nothing retries: interrupted there, they stayed kept for
    good. Every lift is tried once more on an interruption."""
    a = shmloader.DataLoader(Rows(), batch_size=4, num_workers=2, timeout=30)
    held = [next(iter(a))]
    interrupt_once(Leases, "lift", 1)
    child = ForkedChild(lambda: int(held[0][3, 0]), timeout=30)  # (the hook reports it)
    assert child.result() == 3
    held.clear()
    gc.collect()
    assert a.stats().slots_kept == 0
    assert firsts(list(a)) == ALL


@frees_its_loaders_on_failure
def test_an_interruption_in_the_retired_branch_of_a_close_still_writes_the_books(
    interrupt_once: Any,
) -> None:
    """Review 26: an interruption while a retired arena's close emptied the stranded slots
    skipped its close books: stats() counted it as an open arena, 0 bytes once its batches were
    dropped, while workers forked with them still mapped the slab. It counts the slab whole now
    (the stranded slot stays, and the books cannot say which it is), never less than the
    kernel holds."""
    loader, it, old, slot, kept = _retired_holding(interrupt_once, 2)
    with slab_memory(old) as held_now:
        it2 = iter(loader)  # its workers are forked while the batches are held
        interrupt_once(Leases, "read_ranges", 1)
        del it, old
        gc.collect()  # the retired arena closes: interrupted (its finalizer says so)
        assert firsts([next(it2)]) == ALL[:1]
        kept.clear()
        gc.collect()
        assert held_now() == 3 * slot  # the two held at close, and the stranded one
        assert retired(loader)[0] == 0 and retired(loader)[1] >= held_now()
        del it2
        gc.collect()
        assert retired(loader) == (0, 0)


@frees_its_loaders_on_failure
def test_a_retired_arena_is_counted_once_when_making_its_successor_was_interrupted(
    interrupt_once: Any,
) -> None:
    """Review 15 F3: a Ctrl-C inside the new host's making left the retired host listed while
    still current, and the next iter() listed it again: one batch held read as two, for good."""
    loader, it, old, slot, kept = _retired_holding(interrupt_once, 1)
    del it, old
    gc.collect()
    interrupt_once(ArenaHost, "__init__", 1)  # iter() makes the successor: interrupted there
    with pytest.raises(KeyboardInterrupt):
        iter(loader)
    assert firsts(list(loader)) == ALL
    assert retired(loader) == (1, slot)
    assert firsts(kept) == ALL[:1]
    kept.clear()
    assert retired(loader) == (0, 0)


@frees_its_loaders_on_failure
def test_what_the_sampler_raises_leaves_the_iterator_usable() -> None:
    class Fails(torch.utils.data.Sampler[int]):
        def __iter__(self) -> Iterator[int]:
            yield from range(24)
            raise Alarm  # while the loader draws ahead: torch drops the batch and raises it

    loader = shmloader.DataLoader(Rows(), batch_size=4, num_workers=2, sampler=Fails())
    it = iter(loader)
    with pytest.raises(Alarm):
        while True:
            next(it)
    assert it.failure is None  # not an interruption: the iterator is whole


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


@frees_its_loaders_on_failure
def test_an_interruption_while_state_dict_waits_for_an_abandoned_epoch_says_so(
    interrupt_once: Any,
) -> None:
    loader = shmloader.DataLoader(
        Rows(), batch_size=4, num_workers=2, persistent_workers=True, timeout=30
    )
    it = iter(loader)
    next(it)
    iter(loader)  # the epoch is abandoned: its tasks in flight answer into the next one
    interrupt_once(ShmDataLoaderIter, "_handle", 1)  # the first of those answers
    with pytest.raises(KeyboardInterrupt):
        loader.state_dict()
    with pytest.raises(RuntimeError, match=r"its state_dict\(\) was interrupted by Keyboard"):
        loader.state_dict()  # before: a lost answer, then a wait without end (or "timed out")
    assert firsts(list(loader)) == ALL  # a fresh iterator, from the epoch's start


@pytest.mark.parametrize("at", [1, 2, 3, 4], ids=["resume-0", "resume-1", "task-0", "task-1"])
@frees_its_loaders_on_failure
def test_an_interrupted_iter_of_persistent_workers_loses_no_batch(
    interrupt_once: Any, at: int
) -> None:
    """Review 12: ``iter(loader)`` of a persistent iterator tells its workers the new epoch and
    primes them with tasks; an interruption there left a task recorded but unsent (or a worker
    a RESUME short), and the next epoch waited for it forever."""
    loader = shmloader.DataLoader(
        Rows(), batch_size=4, num_workers=2, persistent_workers=True, timeout=30
    )
    held = list(loader)[:2]
    loader.stats()  # the slots of the batches dropped are free for the next epoch's tasks
    it = loader._iterator
    interrupt_once(Supervisor, "send", at)  # RESUME to worker 0, to worker 1, then the tasks
    with pytest.raises(KeyboardInterrupt):
        iter(loader)
    with pytest.raises(RuntimeError, match=r"its iter\(\) was interrupted by KeyboardInterrupt"):
        next(it)  # before: "timed out after 30 seconds"
    assert all(not p.is_alive() for p in it._workers), "its workers were not stopped"
    assert firsts(list(loader)) == ALL  # a fresh iterator, on fresh workers
    assert firsts(list(loader)) == ALL
    assert firsts(held) == ALL[:2]  # batches held from before stay intact


@frees_its_loaders_on_failure
def test_an_interruption_of_iter_before_it_changes_anything_changes_nothing(
    interrupt_once: Any,
) -> None:
    """An interruption while ``iter(loader)`` only asks the sampler for its iterator (before the
    workers hear of the epoch) leaves the persistent iterator whole, and its epoch count too."""
    loader = shmloader.DataLoader(
        Rows(), batch_size=4, num_workers=2, persistent_workers=True, shuffle=True, timeout=30
    )
    list(loader)
    it = loader._iterator
    pids = loader.stats().worker_pids
    interrupt_once(torch.utils.data.BatchSampler, "__iter__", 1)
    with pytest.raises(KeyboardInterrupt):
        iter(loader)
    assert loader.state_dict()["epoch"] == 1 and not loader.state_dict()["in_epoch"]
    assert sorted(int(x) for b in loader for x in b[:, 0]) == list(range(40))  # same workers
    assert loader._iterator is it and it.failure is None
    assert loader.stats().worker_pids == pids


@frees_its_loaders_on_failure
def test_an_interrupted_first_iter_after_load_state_dict_still_resumes(interrupt_once: Any) -> None:
    def make() -> shmloader.DataLoader[Any]:
        return shmloader.DataLoader(Rows(), batch_size=4, num_workers=2, timeout=30)

    saved = make()
    it = iter(saved)
    next(it), next(it), next(it)
    state = saved.state_dict()
    loader = make()
    loader.load_state_dict(state)
    interrupt_once(torch.utils.data.BatchSampler, "__iter__", 1)
    with pytest.raises(KeyboardInterrupt):
        iter(loader)
    assert firsts(list(loader)) == ALL[3:]  # before: the state was dropped, ALL from the start


@frees_its_loaders_on_failure
def test_an_interrupted_load_state_dict_never_touches_closed_pipes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """Review 12: ``load_state_dict()`` stops an idle persistent iterator's workers, then let it
    go; interrupted between the two, the loader kept it, and the next epoch wrote its frames to
    the closed pipes' descriptor numbers, which the user's files had taken meanwhile."""
    loader = shmloader.DataLoader(
        Rows(), batch_size=4, num_workers=2, persistent_workers=True, timeout=30
    )
    state = loader.state_dict()
    assert firsts(list(loader)) == ALL
    stop = ShmDataLoaderIter._shutdown_workers

    def stopped_then_interrupted(self: ShmDataLoaderIter) -> None:
        stop(self)
        raise KeyboardInterrupt

    monkeypatch.setattr(ShmDataLoaderIter, "_shutdown_workers", stopped_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        loader.load_state_dict(state)
    monkeypatch.undo()
    files = [open(tmp_path / f"user{i}.log", "w+b") for i in range(4)]  # noqa: SIM115
    try:
        assert firsts(list(loader)) == ALL
        for f in files:
            f.seek(0)
            assert f.read() == b"", f"the loader wrote into the user's file {f.name}"
    finally:
        for f in files:
            f.close()


@frees_its_loaders_on_failure
def test_a_stopped_supervisor_refuses_to_use_its_closed_pipes() -> None:
    loader = shmloader.DataLoader(Rows(), batch_size=4, num_workers=2, persistent_workers=True)
    list(loader)
    sup = loader._iterator._sup
    loader._iterator._shutdown_workers()
    with pytest.raises(RuntimeError, match="workers were shut down and their pipes closed"):
        sup.send(0, P.Stop())
    with pytest.raises(RuntimeError, match="workers were shut down and their pipes closed"):
        sup.wait(0)
    assert firsts(list(loader)) == ALL  # the loader replaces the stopped iterator


def _reaped(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}")  # (a zombie is not reaped)


@frees_its_loaders_on_failure
def test_workers_of_an_iterator_interrupted_while_it_is_made_are_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review 12: an interruption after the workers started and before the iterator registered
    its teardown left them running (then unreaped) after the loader was gone."""
    from shmloader.dispatch import Dispatch

    pids: list[int] = []
    made = Dispatch.__init__

    def interrupted(self: Dispatch, host: Any, sup: Supervisor, *args: Any) -> None:
        pids.extend(sup.pids)
        raise KeyboardInterrupt

    loader = shmloader.DataLoader(Rows(), batch_size=4, num_workers=2, timeout=30)
    monkeypatch.setattr(Dispatch, "__init__", interrupted)
    with pytest.raises(KeyboardInterrupt) as caught:
        iter(loader)
    monkeypatch.setattr(Dispatch, "__init__", made)
    traceback.clear_frames(caught.tb)
    del caught
    gc.collect()
    assert len(pids) == 2 and all(map(_reaped, pids)), "its workers were left behind"
    assert firsts(list(loader)) == ALL


@frees_its_loaders_on_failure
def test_an_interrupted_teardown_ends_the_workers_before_their_slots_go_back(
    interrupt_once: Any,
) -> None:
    """An interruption as a dropped iterator's teardown begins (Ctrl-C, or a signal handler,
    while the garbage collector runs it): its slots came back while its workers still ran, free
    for the next batches while those workers could still write them."""
    loader = shmloader.DataLoader(Rows(), batch_size=4, num_workers=2, timeout=30)
    it = iter(loader)
    next(it)
    workers = list(it._workers)
    interrupt_once(Supervisor, "shutdown", 1)
    with pytest.raises(KeyboardInterrupt):
        it._ending()
    assert all(p.exitcode is not None for p in workers), "a worker outlived the slot hand-back"
    del it
    st = loader.stats()
    assert st.slots_by_state.get("writing", 0) == st.slots_by_state.get("ready", 0) == 0
    assert firsts(list(loader)) == ALL


@frees_its_loaders_on_failure
def test_a_slot_taken_for_a_task_but_not_yet_given_to_it_comes_back(interrupt_once: Any) -> None:
    """Review 12: an interruption after a slot left the arena for a task and before the task
    named it lost the slot: it stayed WRITING for good, and the arena had one slot less."""
    from shmloader.dispatch import Dispatch

    loader = shmloader.DataLoader(Rows(), batch_size=4, num_workers=2, timeout=30)
    it = iter(loader)
    interrupt_once(Dispatch, "_give", 1)  # the first slot given (a GRANT: sizes are unknown)
    with pytest.raises(KeyboardInterrupt):
        while True:
            next(it)
    del it
    assert firsts(list(loader)) == ALL
    st = loader.stats()
    assert st.slots_by_state.get("writing", 0) == st.slots_by_state.get("ready", 0) == 0



@pytest.mark.parametrize("how", ["dropped", "a-worker-died", "interrupted-twice"])
@frees_its_loaders_on_failure
def test_an_interruption_before_a_teardowns_first_line_loses_no_slot(
    interrupt_once: Any, how: str
) -> None:
    """An interruption before the first line of an iterator's teardown, which then never ran
    again, so the iterator's slots stayed WRITING or READY for good: as the garbage collector
    runs it for a dropped iterator (where the exception is only printed), as a dead worker fails
    the iterator, or as a second Ctrl-C lands while the first one stops the iterator."""
    from shmloader.dispatch import Dispatch

    loader = shmloader.DataLoader(Rows(), batch_size=4, num_workers=2, timeout=30)
    interrupt_once(ending, "_teardown", 1)
    it = iter(loader)
    next(it)
    workers = list(it._workers)
    if how == "dropped":
        del it
        gc.collect()
    elif how == "a-worker-died":
        workers[0].kill()
        workers[0].join()
        with pytest.raises(KeyboardInterrupt):
            for _ in it:
                pass
        assert "worker" in (it.failure or "")
    else:
        interrupt_once(Dispatch, "_give", 1)
        with pytest.raises(KeyboardInterrupt):
            for _ in it:
                pass
        assert "interrupted by KeyboardInterrupt" in (it.failure or "")
    if how != "dropped":  # stats() finishes the ending the failed iterator asked for
        st = loader.stats()
        assert st.slots_by_state.get("writing", 0) == st.slots_by_state.get("ready", 0) == 0
        assert all(p.exitcode is not None for p in workers), "the old workers were left running"
        del it
    again = iter(loader)  # the next iterator finishes an ending left pending before it starts
    assert all(p.exitcode is not None for p in workers), "the old workers were left running"
    assert firsts(list(again)) == ALL
    st = loader.stats()
    assert st.slots_by_state.get("writing", 0) == st.slots_by_state.get("ready", 0) == 0


@frees_its_loaders_on_failure
def test_the_batch_needed_next_gets_the_slots_of_an_ending_cut_short(interrupt_once: Any) -> None:
    """At the cap, another iterator of the loader was dropped and its ending cut short before
    its first line: its slots are the only room for the live iterator's next batch, which used
    to raise ``ArenaExhaustedError`` (nothing of the dropped one would ever come back)."""
    slot = 4096  # a batch of 4 rows of 64 int64 values fits one page
    loader = shmloader.DataLoader(
        Rows(), batch_size=4, num_workers=2, prefetch_factor=3, arena_max_bytes=7 * slot,
        arena_slots_per_slab=7, timeout=30,
    )  # fmt: skip
    for _ in loader:  # the batch size is known, and the cap's one slab of seven slots exists
        pass
    assert loader.stats().slot_sizes == (slot,)
    first = iter(loader)
    held = next(first)  # 6 tasks in flight and this batch: every slot of the cap
    second = iter(loader)  # its tasks wait for slots
    interrupt_once(ending, "_teardown", 1)
    del first
    gc.collect()
    assert [int(b[0, 0]) for b in second] == ALL
    assert int(held[0, 0]) == 0


@frees_its_loaders_on_failure
def test_an_ending_interrupted_after_its_last_line_runs_again_harmlessly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An interruption after the teardown returned and before its ending recorded that: the
    host runs it again, which must neither fail nor hand any slot back twice."""
    real, runs = ending._teardown, [0]

    def then_interrupted(*args: Any) -> None:
        real(*args)
        runs[0] += 1
        if runs[0] == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(ending, "_teardown", then_interrupted)
    loader = shmloader.DataLoader(Rows(), batch_size=4, num_workers=2, timeout=30)
    it = iter(loader)
    next(it)
    del it  # the garbage collector's ending prints the interruption and is left pending
    gc.collect()
    assert firsts(list(loader)) == ALL
    assert runs[0] == 3  # the first iterator's twice, the second's once
    st = loader.stats()
    assert st.slots_by_state.get("writing", 0) == st.slots_by_state.get("ready", 0) == 0
    assert st.slots_by_state.get("free", 0) == st.slots_total


@frees_its_loaders_on_failure
def test_a_ctrl_c_held_back_while_a_worker_starts_leaves_no_child_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SIGINT is blocked while a worker process starts, so a Ctrl-C then is delivered as the
    mask is restored: the worker had started but was not yet recorded, so nothing stopped and
    reaped it (it lived on, then stayed a zombie)."""
    import psutil

    real, calls = signal.pthread_sigmask, [0]

    def delivered_at_restore(how: int, mask: Any) -> Any:
        old = real(how, mask)
        calls[0] += 1
        if calls[0] == 4:  # restoring the mask after the second worker started
            raise KeyboardInterrupt
        return old

    before = {p.pid for p in psutil.Process().children()}
    loader = shmloader.DataLoader(Rows(), batch_size=4, num_workers=2, timeout=30)
    monkeypatch.setattr(supervisor.signal, "pthread_sigmask", delivered_at_restore)
    with pytest.raises(KeyboardInterrupt) as caught:
        iter(loader)
    monkeypatch.undo()
    traceback.clear_frames(caught.tb)
    del caught
    gc.collect()
    left = [p for p in psutil.Process().children() if p.pid not in before]
    assert not left, f"workers left behind: {[(p.pid, p.status()) for p in left]}"
    assert firsts(list(loader)) == ALL


@frees_its_loaders_on_failure
def test_an_arena_whose_finalizer_an_interruption_cut_short_is_closed_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An interruption at the first line of a dropped loader's arena finalizer: the garbage
    collector printed it and weakref never calls a finalizer twice, so the arena and every
    slab stayed mapped until the process exited (review 13's stress: whole arenas left). The
    next loader's ``iter()`` closes it (``arena.finalizers``)."""
    import weakref

    from shmloader import host as host_mod

    real, cut = weakref.finalize.__call__, []

    def interrupted_first(self: weakref.finalize, _: Any = None) -> Any:
        info = self._registry.get(self)  # type: ignore[attr-defined]
        if not cut and info is not None and info.func is host_mod._close:
            cut.append(True)
            raise KeyboardInterrupt
        return real(self, _)

    loader = shmloader.DataLoader(Rows(), batch_size=4, num_workers=2, timeout=30)
    assert firsts(list(loader)) == ALL
    arena = loader._host.arena
    monkeypatch.setattr(weakref.finalize, "__call__", interrupted_first)
    del loader
    gc.collect()
    monkeypatch.undo()
    assert cut and not arena.closed  # the finalizer was skipped
    other = shmloader.DataLoader(Rows(), batch_size=4, num_workers=2, timeout=30)
    assert firsts(list(other)) == ALL
    assert arena.closed


class _RaisesOnceWhenAForkIsDone:
    """afterfork's lock, raising KeyboardInterrupt the second time the parent's after-fork hook
    takes it to drop the fork's keep (the last worker's fork: the workers' forks share one
    keep), as a signal handler's exception would there."""

    def __init__(self, real: Any) -> None:
        self.real, self.calls, self.raised = real, 0, False

    def __enter__(self) -> Any:
        import sys

        if sys._getframe(1).f_code.co_name == "_forget_pending":
            self.calls += 1
            if self.calls == 2:
                self.raised = True
                raise KeyboardInterrupt
        return self.real.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        return self.real.__exit__(*exc)


@frees_its_loaders_on_failure
def test_an_interruption_in_the_parents_after_fork_hook_leaves_no_fork_pending(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review 63: a Ctrl-C in the parent's after-fork hook, once it had dropped its note of the
    fork and before it dropped the fork's keep, left the keep pending for good: every batch lent
    from then on was kept for the persistent workers forked then, and the arena grew past its
    cap (6.4x by the sixth epoch)."""
    from shmloader import lease

    lock = _RaisesOnceWhenAForkIsDone(afterfork._pending_lock)
    monkeypatch.setattr(afterfork, "_pending_lock", lock)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4, 1024), torch.arange(64))
    loader = shmloader.DataLoader(data, batch_size=4, num_workers=2, persistent_workers=True,
                                  multiprocessing_context="fork", timeout=60)  # fmt: skip
    for _ in range(3):
        assert sum(len(y) for _, y in loader) == 64
        assert lease.FORKS_PENDING == [] and loader.stats().slots_kept == 0
    assert lock.raised


@frees_its_loaders_on_failure
def test_a_keep_an_interrupted_fork_of_this_thread_left_pending_is_joined_by_no_lend() -> None:
    """Review 64: an interruption at the very entry of the parent's after-fork hook (before any
    try can run) leaves the fork's keep pending; every later batch then joined the quarantine
    of the persistent workers forked then, past the cap. A thread that lends is inside no fork
    of its own: its lends skip such a keep, and its next fork drops it."""
    import threading

    from shmloader import lease

    stale = lease.KeptTables()
    stale.thread = threading.get_ident()
    data = torch.utils.data.TensorDataset(torch.randn(64, 4, 1024), torch.arange(64))
    loader = shmloader.DataLoader(data, batch_size=4, num_workers=2, persistent_workers=True,
                                  multiprocessing_context="fork", timeout=60)  # fmt: skip
    it = iter(loader)  # the workers are forked
    lease.FORKS_PENDING.append(stale)  # as an interruption there leaves it
    try:
        for _ in range(2):
            assert sum(len(y) for _, y in it) == 64
            assert loader.stats().slots_kept == 0 and stale == {}
            it = iter(loader)
        ForkedChild(lambda: 0, timeout=30).result()  # this thread's next fork
        assert all(kept is not stale for kept in lease.FORKS_PENDING)
    finally:
        with contextlib.suppress(ValueError):
            lease.FORKS_PENDING.remove(stale)
    del it
