"""Batch lifetime under threads, forks and interpreter exit (review 6): a held batch stays
readable and right, and nothing hangs, whatever else runs in the process.

- Exit: an ``atexit`` handler registered before shmloader's import, or a module global's
  ``__del__``, reads a held batch during interpreter shutdown: the slabs are still mapped (they
  segfaulted when weakref's exit hook unmapped them first).
- ``os.fork()`` from another thread while batches are held: the parent's main thread drops the
  batch and iterates on while the child copies it; the child still sees the batch's own bytes
  (the held slots are kept from reuse until the child reports its copy).
- A forked child lets go of its parent's arenas: it maps no slab of them but the private copy of
  the batch it holds, and holds no slab descriptor; neither do another loader's persistent
  workers started after the batches were dropped.
- Re-entrance: ``shmloader.release()`` and ``stats()`` called from inside an arena or lease
  operation of the same thread (a ``__del__`` run by the garbage collector, a signal handler)
  return at once, the release taking effect at the next drain.
- ``state_dict()`` from a checkpoint thread while the main thread iterates; the same call from
  inside the iterator's own ``next()`` raises.
- The copy fence of a page-locked arena at its cap (the loader waits for the GPU), with a
  ``stats()`` thread and a thread standing in for the GPU: no error, every batch right,
  ``batches_held`` never above the slots lent, every slot free at the end.
- The replay-pool counts ``slots_kept`` / ``bytes_kept`` are tested in test_lifetime_edges.py.
- ``import shmloader`` imports ``numpy.random`` (a fork during its lazy import in another thread
  left the import lock held in the workers).

Every loader has ``timeout=``; scenarios that can deadlock the process itself run in a forked
child (:class:`ForkedChild`), reaped and reported with its stack if it hangs. Each test failed
with its fix reverted.
"""

from __future__ import annotations

import gc
import json
import os
import select
import subprocess
import sys
import textwrap
import threading
import traceback
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch

import shmloader
from shmloader import afterfork
from tests.forked import ForkedChild
from tests.lifetime_checks import batch_ok, frees_its_loaders_on_failure, rows_ok
from tests.lifetime_datasets import TorchRows
from tests.shmloader.fakes import FakeEvents, Squares, fenced_loader

HANG_S = 20.0  # a scenario that has not finished by then is hung: a pass takes a few seconds
LOADER_TIMEOUT_S = 10
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _wait_readable(fd: int, seconds: float) -> bool:
    """Whether ``fd`` becomes readable within ``seconds`` (poll: any descriptor number)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(int(seconds * 1000)))


def _collecting(body: Callable[[], Any]) -> Callable[[], Any]:
    """``body`` for a :class:`ForkedChild`, followed by a collection: the child's loaders end
    their workers before it leaves with ``os._exit``."""

    def run() -> Any:
        try:
            return body()
        finally:
            gc.collect()

    return run


# --------------------------------------------------------------------------------------- exit

_EXIT_SCRIPT = """
import atexit
import sys

held = []
if sys.argv[1] == "atexit":  # registered before torch's and shmloader's own exit hooks
    atexit.register(lambda: print("sum at exit", int(held[0].sum()), flush=True))

import torch
import shmloader


class Reader:
    def __init__(self, batch):
        self.batch = batch

    def __del__(self):
        print("sum at exit", int(self.batch.sum()), flush=True)


loader = shmloader.DataLoader(
    torch.utils.data.TensorDataset(torch.ones(64, 1000, dtype=torch.int64)),
    batch_size=16,
    num_workers=2,
    timeout=10,
)
for (batch,) in loader:
    held.append(batch)
if sys.argv[1] == "module-global-del":
    READER = Reader(held[0])  # a module global: its __del__ runs during shutdown
print("loop done", flush=True)
"""


def _run_script(script: str, *args: str) -> str:
    """``script`` run by a fresh interpreter in the repository (60 s at most): its output,
    once it exited with 0."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-2000:])
    return done.stdout


@pytest.mark.timeout(90)
@pytest.mark.parametrize("reader", ["atexit", "module-global-del"])
def test_a_held_batch_is_readable_during_interpreter_exit(reader: str) -> None:
    out = _run_script(_EXIT_SCRIPT, reader)
    assert out.splitlines() == ["loop done", f"sum at exit {16 * 1000}"], out


# ------------------------------------------------------------------- fork from another thread


@pytest.mark.timeout(HANG_S + 30)
@frees_its_loaders_on_failure
def test_a_fork_from_another_thread_keeps_the_batch_while_the_main_thread_drops_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loader = shmloader.DataLoader(
        TorchRows(400, 256), batch_size=4, num_workers=2, timeout=LOADER_TIMEOUT_S
    )
    it = iter(loader)
    held = [next(it)]
    assert batch_ok(*held[0], 0, 256)
    started_r, started_w = os.pipe()
    go_r, go_w = os.pipe()
    copies: list[int] = []
    real_privatize = afterfork.privatize

    def held_up(addr: int, nbytes: int) -> None:
        """In the child, at the fork: the first copy waits until the parent has iterated on."""
        if not copies:
            os.write(started_w, b"s")
            _wait_readable(go_r, HANG_S)
        copies.append(nbytes)
        real_privatize(addr, nbytes)

    monkeypatch.setattr(afterfork, "privatize", held_up)

    def child_body() -> dict[str, Any]:
        x, y = held[0]
        return {"ok": batch_ok(x, y, 0, 256), "first": int(x[0, 0]), "copies": len(copies)}

    outcome: list[Any] = []

    def forker() -> None:  # holds no reference to the batch: only `held` does
        try:
            outcome.append(ForkedChild(child_body, HANG_S).result())
        except BaseException as e:  # noqa: BLE001 - the main thread reports it
            outcome.append(e)

    thread = threading.Thread(target=forker)
    try:
        thread.start()
        assert _wait_readable(started_r, HANG_S), "the child never started copying"
        held.clear()  # the parent drops batch 0 while the child is about to copy it
        for k in range(1, 9):  # with batch 0's slot free, a worker would rewrite it at once
            x, y = next(it)
            assert batch_ok(x, y, k, 256), k
            del x, y
    finally:
        os.write(go_w, b"g")  # the child copies batch 0 now
        thread.join(HANG_S + 10)
        for fd in (started_r, started_w, go_r, go_w):
            os.close(fd)
    assert not thread.is_alive(), "the forking thread never came back from os.fork()"
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    report = outcome[0]
    assert report["copies"] >= 1
    assert report["ok"], f"the child's batch 0 shows {report['first']}, another batch's rows"


# ------------------------------------------------------- a forked child lets go of the arenas


def _slab_files(loader: shmloader.DataLoader[Any]) -> set[tuple[int, int]]:
    """(device, inode) of every slab of ``loader``'s arena."""
    out = set()
    for slab in loader._host.arena.slabs():
        st = os.fstat(slab.segment._fd)
        out.add((st.st_dev, st.st_ino))
    return out


def _files_of(pid: int | str) -> dict[str, list[tuple[int, int]]]:
    """(device, inode) of every file process ``pid`` maps and every file it holds open."""
    mapped = set()
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split()
            major, minor = (int(part, 16) for part in fields[3].split(":"))
            if int(fields[4]):
                mapped.add((os.makedev(major, minor), int(fields[4])))
    opened = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            st = os.stat(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile (the listing's own descriptor)
            continue
        opened.add((st.st_dev, st.st_ino))
    return {"mapped": sorted(mapped), "open": sorted(opened)}


def _of(files: dict[str, list[tuple[int, int]]], slabs: set[tuple[int, int]]) -> dict[str, Any]:
    return {kind: sorted(set(map(tuple, found)) & slabs) for kind, found in files.items()}


def _in_new_persistent_workers(files: set[tuple[int, int]]) -> dict[int, dict[str, Any]]:
    """Which of ``files`` each persistent worker of a new loader maps or holds open, once its
    first epoch is done (and checked)."""
    b = shmloader.DataLoader(
        TorchRows(64, 8),
        batch_size=4,
        num_workers=2,
        persistent_workers=True,
        timeout=LOADER_TIMEOUT_S,
    )
    assert [k for k, (x, y) in enumerate(b) if not batch_ok(x, y, k, 8)] == []
    pids = b.stats().worker_pids
    assert len(pids) == 2
    return {pid: _of(_files_of(pid), files) for pid in pids}


NOTHING = {"mapped": [], "open": []}


@pytest.mark.timeout(HANG_S + 30)
@frees_its_loaders_on_failure
def test_forked_processes_give_up_the_parents_arena_but_the_batches_they_hold() -> None:
    a = shmloader.DataLoader(
        TorchRows(400, 4096), batch_size=4, num_workers=2, timeout=LOADER_TIMEOUT_S
    )
    it = iter(a)
    held = [next(it) for _ in range(8)]  # the arena grows past one slab
    del held[1:]
    gc.collect()
    a.stats()  # a drain: batches 1 to 7 are gone, their slots free
    slabs = _slab_files(a)
    assert len(slabs) >= 2, "the arena did not grow"

    def child_body() -> dict[str, Any]:
        x, y = held[0]
        return {"ok": batch_ok(x, y, 0, 4096), "files": _files_of("self")}

    report = ForkedChild(child_body, HANG_S).result()
    assert report["ok"], "the child's copy of batch 0 is wrong"
    assert _of(report["files"], slabs) == {"mapped": [], "open": []}, "the child kept A's slabs"
    assert batch_ok(*held[0], 0, 4096)

    held.clear()
    del it
    gc.collect()
    a.stats()  # every batch of A is gone: its arena is idle (and stays reserved)
    in_workers = _in_new_persistent_workers(slabs)
    assert all(v == NOTHING for v in in_workers.values()), "B's persistent workers keep A's slabs"


@pytest.mark.timeout(HANG_S + 30)
@frees_its_loaders_on_failure
def test_forked_processes_give_up_the_parents_rng_rings() -> None:
    """Review 14 F3: a child forked while an iterator's RNG ring existed (another loader's
    persistent worker, any other process) kept the ring's memory for its whole life, after the
    owner's ``stats()`` had stopped counting it."""
    a = shmloader.DataLoader(
        TorchRows(64, 8), batch_size=4, num_workers=2, timeout=LOADER_TIMEOUT_S
    )
    it = iter(a)
    # a batch from each worker: both have mapped the ring (the second may still be starting
    # when the first batch comes)
    assert batch_ok(*next(it), 0, 8) and batch_ok(*next(it), 1, 8)
    st = os.fstat(it._progress.ring.slab.segment._fd)
    ring = {(st.st_dev, st.st_ino)}
    assert _of(_files_of("self"), ring)["open"], "the ring is not where the test looks"
    assert all(_of(_files_of(pid), ring)["mapped"] for pid in a.stats().worker_pids), (
        "A's own workers do not map their ring"
    )

    report = ForkedChild(lambda: {"files": _files_of("self")}, HANG_S).result()
    assert _of(report["files"], ring) == NOTHING, "a forked child kept A's ring"
    in_workers = _in_new_persistent_workers(ring)
    assert all(v == NOTHING for v in in_workers.values()), "B's persistent workers keep A's ring"
    assert batch_ok(*next(it), 2, 8)  # A's workers still publish into it


class ForksAChild(torch.utils.data.Dataset[torch.Tensor]):
    """Sample 0, in a worker, forks a child that writes the files it maps and holds open to
    ``report`` (a pipe's write end) and exits; the worker reaps it before it returns."""

    def __init__(self, report: int) -> None:
        self.report = report

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 0:
            pid = os.fork()
            if pid == 0:
                try:
                    os.write(self.report, json.dumps(_files_of("self")).encode())
                finally:
                    os._exit(0)
            os.waitpid(pid, 0)
        return torch.full((8,), i)


@pytest.mark.timeout(HANG_S + 30)
@frees_its_loaders_on_failure
def test_a_child_a_worker_forks_gives_up_the_workers_rng_ring() -> None:
    """Review 15 F5: the worker attaches its ring by spec, and a child it forked (a dataset
    calling os.fork()) kept that mapping and descriptor for its whole life."""
    r, w = os.pipe()
    try:
        loader = shmloader.DataLoader(
            ForksAChild(w), batch_size=2, num_workers=2, timeout=LOADER_TIMEOUT_S
        )
        it = iter(loader)
        assert next(it)[0, 0] == 0  # sample 0's worker has forked and reaped its child
        st = os.fstat(it._progress.ring.slab.segment._fd)
        ring = {(st.st_dev, st.st_ino)}
        files = json.loads(os.read(r, 1 << 20))
        assert _of(files, ring) == NOTHING, "the worker's child kept the ring"
        assert [int(b[0, 0]) for b in it] == [2, 4, 6]
    finally:
        os.close(r)
        os.close(w)


# ------------------------------------------------------------------------------ re-entrance


def _release_and_stats_from_inside(where: str) -> dict[str, Any]:
    loader = shmloader.DataLoader(
        TorchRows(64, 64), batch_size=4, num_workers=2, timeout=LOADER_TIMEOUT_S
    )
    it = iter(loader)
    batch = next(it)
    ok = batch_ok(*batch, 0, 64)
    host = loader._host
    before = loader.stats()
    if where == "holding-the-arena-lock":
        with host.arena._lock:  # as a __del__ run by the collector inside an arena call
            released = shmloader.release(batch, loader)
            inside = loader.stats()
    else:
        with host.leases.lock:  # as a __del__ run by the collector inside a drain
            host.leases._inside = threading.get_ident()
            try:
                released = shmloader.release(batch, loader)
                inside = loader.stats()
            finally:
                host.leases._inside = None
    after = loader.stats()
    del batch, it
    return {
        "ok": ok,
        "released": released,
        "held": [before.batches_held, inside.batches_held, after.batches_held],
        "lent": [s.arena.slots_by_state["lent"] for s in (before, inside, after)],
        "free": [s.arena.slots_by_state["free"] - before.arena.slots_by_state["free"]
                 for s in (inside, after)],
    }  # fmt: skip


@pytest.mark.timeout(HANG_S + 30)
@pytest.mark.parametrize("where", ["holding-the-arena-lock", "inside-a-drain"])
@frees_its_loaders_on_failure
def test_release_and_stats_from_inside_an_arena_or_lease_operation_wait_for_the_next_drain(
    where: str,
) -> None:
    report = ForkedChild(_collecting(lambda: _release_and_stats_from_inside(where)), HANG_S)
    assert report.result() == {
        "ok": True,
        "released": 1,
        "held": [1, 1, 0],  # queued inside, released at the next drain
        "lent": [1, 1, 0],
        "free": [0, 1],
    }


def _stats_from_inside_while_another_thread_takes_stats() -> dict[str, Any]:
    """A monitor thread's ``stats()`` holds the lease lock and waits for the arena lock, which
    this thread holds when a signal handler (or a ``__del__``) here calls ``stats()``."""
    loader = shmloader.DataLoader(
        TorchRows(64, 64), batch_size=4, num_workers=2, timeout=LOADER_TIMEOUT_S
    )
    it = iter(loader)
    batch = next(it)
    arena = loader._host.arena
    real_stats, waiting = arena.stats, threading.Event()

    def stats_after_telling() -> Any:
        if threading.current_thread() is not threading.main_thread():
            waiting.set()  # the monitor holds the lease lock now, and is about to wait
        return real_stats()

    arena.stats = stats_after_telling  # type: ignore[method-assign]
    got: list[Any] = []
    with arena._lock:  # this thread is inside an arena call
        monitor = threading.Thread(target=lambda: got.append(loader.stats().batches_held))
        monitor.start()
        assert waiting.wait(HANG_S / 2), "the monitor thread never reached the arena"
        inside = loader.stats().batches_held  # the handler's call: must not wait for the monitor
    monitor.join(HANG_S / 2)
    ok = batch_ok(*batch, 0, 64)
    del batch, it
    return {"ok": ok, "inside": inside, "monitor": got, "alive": monitor.is_alive()}


@pytest.mark.timeout(HANG_S + 30)
@frees_its_loaders_on_failure
def test_stats_from_inside_an_arena_call_does_not_wait_for_a_stats_thread() -> None:
    report = ForkedChild(_collecting(_stats_from_inside_while_another_thread_takes_stats), HANG_S)
    assert report.result() == {"ok": True, "inside": 1, "monitor": [1], "alive": False}


@frees_its_loaders_on_failure
def test_a_release_queued_inside_a_drain_goes_through_the_copy_fence_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Queued from inside a drain, then its views die: the lease is queued twice, and the
    page-locked slot must still be held once and freed once (it raised KeyError, then
    StaleSlotError: double release)."""
    events = FakeEvents()
    loader, host = fenced_loader(monkeypatch, events, arena_slots_per_slab=12)
    it = iter(loader)
    batch = next(it)
    leases = host.leases
    with leases.lock:  # as a signal handler or __del__ running inside a drain
        leases._inside = threading.get_ident()
        try:
            assert shmloader.release(batch, loader) == 1
        finally:
            leases._inside = None
    del batch
    gc.collect()
    assert loader.stats().batches_held == 0  # the drain: both entries of that one lease
    assert leases.fence is not None and leases.fence.held == 1
    events.complete_all()
    st = loader.stats()
    assert st.arena.slots_by_state["lent"] == 0
    assert [x.shape for x, _ in it] == [torch.Size([4, 3, 4])] * 15
    del it


def test_state_dict_from_inside_a_stats_call_raises_instead_of_waiting() -> None:
    """A signal handler running while its thread holds the lease lock (inside ``stats()`` or
    ``release()``) calls ``state_dict()``: it must not wait for the iterator's lock, which a
    training thread may hold while it waits for the lease lock."""
    loader = shmloader.DataLoader(
        TorchRows(64, 8), batch_size=4, num_workers=2, timeout=LOADER_TIMEOUT_S
    )
    it = iter(loader)
    batch = next(it)
    with loader._host.leases.lock, pytest.raises(RuntimeError, match="between steps"):
        loader.state_dict()
    assert batch_ok(*batch, 0, 8)
    assert loader.state_dict()["yielded"] == 1  # between steps it works
    del batch, it


class Holder:
    """Holds a batch in a reference cycle; its ``__del__``, run by the garbage collector at
    any allocation, releases the batch early."""

    def __init__(self, batch: Any, loader: shmloader.DataLoader[Any], log: list[Any]) -> None:
        self.batch, self.loader, self.log, self.me = batch, loader, log, self

    def __del__(self) -> None:
        try:
            self.log.append(shmloader.release(self.batch, self.loader))
        except BaseException:  # noqa: BLE001 - an exception in __del__ is only printed
            self.log.append(traceback.format_exc())


GC_BATCHES = 2000
GC_THRESHOLDS = range(2, 60)  # gc.set_threshold: collect after at most this many allocations


def _releases_from_the_garbage_collector() -> dict[str, Any]:
    loader = shmloader.DataLoader(
        TorchRows(4 * GC_BATCHES // 2, 16), batch_size=4, num_workers=2, timeout=LOADER_TIMEOUT_S
    )
    log: list[Any] = []
    bad = steps = 0
    old = gc.get_threshold()
    try:
        for _epoch in range(2):
            for k, (x, y) in enumerate(loader):
                bad += not batch_ok(x, y, k, 16)
                steps += 1
                # the next collection, which frees this Holder, comes after a number of
                # allocations that varies from batch to batch: somewhere inside next()
                gc.set_threshold(GC_THRESHOLDS[k % len(GC_THRESHOLDS)])
                Holder((x, y), loader, log)
                del x, y
    finally:
        gc.set_threshold(*old)
    gc.collect()
    st = loader.stats()
    return {
        "steps": steps,
        "bad": bad,
        "errors": [e for e in log if not isinstance(e, int)][:3],
        "released": sum(e for e in log if isinstance(e, int)),
        "held": st.batches_held,
        "free": st.arena.slots_free == st.arena.slots_total,
    }


@pytest.mark.timeout(HANG_S + 30)
@frees_its_loaders_on_failure
def test_batches_released_by_del_methods_the_garbage_collector_runs_do_not_deadlock() -> None:
    report = ForkedChild(_collecting(_releases_from_the_garbage_collector), HANG_S).result()
    assert report == {
        "steps": GC_BATCHES,
        "bad": 0,
        "errors": [],
        "released": GC_BATCHES,
        "held": 0,
        "free": True,
    }


# ------------------------------------------------------------------------------- state_dict()

SD_EPOCHS = 24  # every odd epoch is abandoned after 4 batches: the next one has orphans


def _checkpoint_thread_while_iterating() -> dict[str, Any]:
    sys.setswitchinterval(1e-6)  # (this child only) thread switches land anywhere
    loader = shmloader.DataLoader(
        TorchRows(200, 64),
        batch_size=4,
        num_workers=2,
        shuffle=True,
        persistent_workers=True,
        timeout=LOADER_TIMEOUT_S,
    )
    stop = threading.Event()
    errors: list[str] = []
    saved = [0]

    def checkpoint() -> None:
        while not stop.is_set():
            try:
                loader.state_dict()
            except Exception:  # noqa: BLE001 - reported to the test
                errors.append("checkpoint thread: " + traceback.format_exc())
                return
            saved[0] += 1

    thread = threading.Thread(target=checkpoint)
    thread.start()
    steps = bad = 0
    try:
        for epoch in range(SD_EPOCHS):
            for k, (x, y) in enumerate(loader):
                bad += not rows_ok(x, y.tolist(), 64)
                steps += 1
                del x, y
                if epoch % 2 and k == 3:
                    break
    except Exception:  # noqa: BLE001 - reported to the test
        errors.append("main thread: " + traceback.format_exc())
    finally:
        stop.set()
        thread.join(HANG_S)
    return {
        "steps": steps,
        "bad": bad,
        "errors": errors[:2],
        "hung": thread.is_alive(),
        "saved": saved[0] > 0,
    }


@pytest.mark.timeout(HANG_S + 30)
@frees_its_loaders_on_failure
def test_state_dict_from_a_checkpoint_thread_while_the_main_thread_iterates() -> None:
    report = ForkedChild(_collecting(_checkpoint_thread_while_iterating), HANG_S).result()
    assert report == {
        "steps": SD_EPOCHS // 2 * (50 + 4),
        "bad": 0,
        "errors": [],
        "hung": False,
        "saved": True,
    }


@frees_its_loaders_on_failure
def test_state_dict_from_inside_next_on_the_same_thread_raises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loader = shmloader.DataLoader(
        TorchRows(64, 64), batch_size=4, num_workers=2, timeout=LOADER_TIMEOUT_S
    )
    it = iter(loader)
    offer = it._dispatch.offer
    raised: list[BaseException | None] = []

    def offer_and_save() -> None:  # as a signal handler or a __del__ landing inside next()
        if not raised:
            try:
                loader.state_dict()
            except Exception as e:  # noqa: BLE001 - the test checks it
                raised.append(e)
            else:
                raised.append(None)
        offer()

    monkeypatch.setattr(it._dispatch, "offer", offer_and_save)
    x, y = next(it)
    assert raised, "next() did not offer slots: the test no longer reaches state_dict()"
    assert isinstance(raised[0], RuntimeError), raised[0]
    assert "between steps" in str(raised[0]), raised[0]
    assert batch_ok(x, y, 0, 64)
    monkeypatch.undo()
    assert loader.state_dict()["yielded"] == 1  # between steps it works


# ------------------------------------------------------------------- copy fence and threads


class GpuEvents:
    """An event factory for :class:`shmloader.fence.CopyFence` standing in for CUDA across
    threads: a recorded event completes when the "GPU" (another thread) calls
    :meth:`complete_all`; ``wait`` blocks until then, or its timeout."""

    def __init__(self) -> None:
        self.made: list[GpuEvent] = []

    def __call__(self) -> GpuEvent:
        event = GpuEvent()
        self.made.append(event)
        return event

    def complete_all(self) -> None:
        for event in list(self.made):
            event.done.set()


class GpuEvent:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.done.set()  # a new event has nothing queued before it

    def record(self) -> None:
        self.done.clear()

    def query(self) -> bool:
        return self.done.is_set()

    def wait(self, timeout: float) -> bool:
        return self.done.wait(timeout)


FENCE_EPOCHS = 12


def _fence_with_a_stats_thread(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    sys.setswitchinterval(1e-6)  # (this child only) thread switches land anywhere
    probe = shmloader.DataLoader(Squares(64), batch_size=4, num_workers=2)
    next(iter(probe))
    slot = probe.stats().arena.slot_sizes[0]
    del probe
    events = GpuEvents()
    # four slots in all: the loader waits for the GPU (settle) while the stats thread drains
    loader, _ = fenced_loader(
        monkeypatch, events, timeout=LOADER_TIMEOUT_S, arena_max_bytes=4 * slot,
        arena_slots_per_slab=4,
    )  # fmt: skip
    stop = threading.Event()
    errors: list[str] = []
    over: list[tuple[int, int]] = []
    polls = [0]

    def poll_stats() -> None:
        while not stop.is_set():
            try:
                st = loader.stats()
            except Exception:  # noqa: BLE001 - reported to the test
                errors.append("stats thread: " + traceback.format_exc())
                return
            if st.arena is not None:
                polls[0] += 1
                if st.batches_held > st.arena.slots_by_state["lent"]:
                    over.append((st.batches_held, st.arena.slots_by_state["lent"]))

    def complete_events() -> None:
        while not stop.is_set():
            events.complete_all()

    threads = [threading.Thread(target=poll_stats), threading.Thread(target=complete_events)]
    for thread in threads:
        thread.start()
    steps = bad = 0
    try:
        for _epoch in range(FENCE_EPOCHS):
            for k, (x, y) in enumerate(loader):
                indices = list(range(4 * k, 4 * k + 4))
                want = torch.tensor(indices, dtype=x.dtype)[:, None, None].expand_as(x)
                bad += not (y.tolist() == indices and torch.equal(x, want))
                steps += 1
                del x, y
    except Exception:  # noqa: BLE001 - reported to the test
        errors.append("main thread: " + traceback.format_exc())
    finally:
        stop.set()
        for thread in threads:
            thread.join(HANG_S)
    gc.collect()
    loader.stats()  # a drain: the last batches' slots wait behind their events
    events.complete_all()
    st = loader.stats()
    return {
        "steps": steps,
        "bad": bad,
        "errors": errors[:2],
        "hung": any(thread.is_alive() for thread in threads),
        "polled": polls[0] > 0,
        "held_over_lent": over[:5],
        "free": st.arena.slots_free == st.arena.slots_total,
        "held": st.batches_held,
    }


@pytest.mark.timeout(HANG_S + 30)
@frees_its_loaders_on_failure
def test_the_copy_fence_with_a_stats_thread_and_completing_events_loses_no_slot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    body = _collecting(lambda: _fence_with_a_stats_thread(monkeypatch))
    assert ForkedChild(body, HANG_S).result() == {
        "steps": FENCE_EPOCHS * 16,
        "bad": 0,
        "errors": [],
        "hung": False,
        "polled": True,
        "held_over_lent": [],
        "free": True,
        "held": 0,
    }


# ------------------------------------------------------------------------------ numpy.random


def test_importing_shmloader_imports_numpy_random() -> None:
    out = _run_script("import sys, shmloader; print('numpy.random' in sys.modules)")
    assert out.strip() == "True"


class FreezeCounts(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Sample ``i``: how many objects the worker's collector has frozen."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return gc.get_freeze_count()


def test_workers_freeze_what_they_inherit_so_full_collections_leave_it_shared() -> None:
    # A full collection in a forked worker writes to every object it tracks: the pages the
    # worker shares with the main process become private copies (review 8b: 12 -> 46 MiB per
    # worker on a dict dataset). Frozen at start, inherited objects are never scanned.
    # The suite froze this process's import-time heap (tests/conftest.py): thaw it for the test,
    # so what the worker reports is what it froze itself; freeze again once the loader is gone.
    gc.unfreeze()
    try:
        assert gc.get_freeze_count() == 0
        least = _least_freeze_count_in_a_worker()
    finally:
        gc.collect()
        gc.freeze()
    assert least > 1000  # the inherited heap: modules, torch, the dataset


def _least_freeze_count_in_a_worker() -> int:
    counts = next(iter(shmloader.DataLoader(FreezeCounts(), batch_size=4, num_workers=1)))
    return int(counts.min())


def test_a_child_forked_after_the_loader_closed_reads_a_batch_the_parent_drops() -> None:
    """Review 21: while a closed arena emptied each held batch's slot as the batch died
    (review 20's attempt at giving that memory back sooner), a child forked after the close
    (and so sharing the slot's pages), or a child's own exit, or the interpreter's, zeroed
    batches still read. A closed arena keeps each slot held at close until the slab's last view
    in this process goes."""
    rows = torch.arange(40 * 1024, dtype=torch.int64).reshape(40, 1024)
    loader = shmloader.DataLoader(torch.utils.data.TensorDataset(rows), batch_size=4,
                                  num_workers=2, timeout=30)  # fmt: skip
    it = iter(loader)
    box = [next(it)[0]]
    other = next(it)[0]
    expected = int(box[0].sum())
    del it, loader
    gc.collect()  # the arena closes, both batches held (one slab)
    go_r, go_w = os.pipe()
    try:
        child = ForkedChild(lambda: (os.read(go_r, 1), int(box[0].sum()))[1], timeout=30)
        box.clear()
        gc.collect()  # the parent's last view of that batch goes
        os.write(go_w, b"x")
        assert child.result() == expected
    finally:
        os.close(go_r)
        os.close(go_w)
    assert torch.equal(other, rows[4:8])


@pytest.mark.timeout(HANG_S + 30)
@frees_its_loaders_on_failure
def test_a_child_forked_after_the_loader_closed_copies_its_batches_and_gives_up_the_slabs() -> None:
    """Review 22: a closed arena left the fork's books, so a child forked after the close kept
    every slab a held batch maps (shared, and unseen by ``stats()``) for as long as its copy of
    the batch lived, after the parent had dropped the batch. The child now copies the batches
    held, as from an open arena, and lets go of the slabs."""
    a = shmloader.DataLoader(
        TorchRows(400, 4096), batch_size=4, num_workers=2, timeout=LOADER_TIMEOUT_S
    )
    it = iter(a)
    held = [next(it) for _ in range(8)]  # the arena grows past one slab
    slabs = _slab_files(a)
    assert len(slabs) >= 2, "the arena did not grow"
    held = [held[0], held[7]]
    del it, a
    gc.collect()  # the arena closes; the two batches held keep their slabs mapped
    assert _of(_files_of("self"), slabs)["mapped"], "no slab is mapped: nothing to test"

    def child_body() -> dict[str, Any]:
        ok = batch_ok(*held[0], 0, 4096) and batch_ok(*held[1], 7, 4096)
        return {"ok": ok, "files": _files_of("self")}

    report = ForkedChild(child_body, HANG_S).result()
    assert report["ok"], "the child's copies of the batches are wrong"
    assert _of(report["files"], slabs) == NOTHING, "the child kept the closed arena's slabs"
    assert batch_ok(*held[0], 0, 4096) and batch_ok(*held[1], 7, 4096)
    held.clear()
    gc.collect()
    assert _of(_files_of("self"), slabs) == NOTHING



class _ChangesWhileWalked(dict):  # type: ignore[type-arg]
    """afterfork's books' inner dict, in which an entry goes as soon as a walk of them has
    begun: what a loader's finalizer, run by the garbage collector inside a fork hook, does
    (closing its arena takes its table out of the books: track_closed)."""

    def items(self):  # type: ignore[no-untyped-def,override]
        for n, item in enumerate(super().items()):
            if n == 1:
                super().pop(next(iter(self)))
            yield item


@pytest.mark.parametrize("reader", ["lent", "let_go", "keep", "fork hook"])
def test_a_table_leaving_the_books_inside_a_fork_hook_does_not_break_it(
    reader: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Review 31: "RuntimeError: dictionary changed size during iteration" from a fork hook,
    # when the garbage collector ran a loader's finalizer while the hook walked the books.
    class Table:  # stands in for a lease table; owner pid -1 is no process's
        pass

    tables = [Table() for _ in range(4)]
    books = weakref.WeakKeyDictionary(dict.fromkeys(tables, -1))
    books.data = _ChangesWhileWalked(books.data)  # type: ignore[attr-defined]
    monkeypatch.setattr(afterfork, "_tracked", books)
    if reader == "lent":
        assert afterfork._lent(-2) == []
    elif reader == "let_go":
        afterfork._let_go(-2, [])
    elif reader == "keep":
        afterfork.Keep().take(-2)
    else:
        monkeypatch.setattr(afterfork, "_keep_until_forked", lambda keep, pid: None)
        afterfork._before()
        afterfork._in_parent()


_ALLOCATES_AFTER_THE_HOOK = """
import gc
import os

ARM = {}


def allocate_late():  # registered first, so it runs after shmloader's own fork hook
    if ARM.pop("val", None) is not None:
        ARM["t"] = shmloader.empty((4, 1024), dtype=torch.float32).fill_(508.0)


os.register_at_fork(before=allocate_late)

import torch  # noqa: E402
import shmloader  # noqa: E402

go_r, go_w = os.pipe()
out_r, out_w = os.pipe()


class Items(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return i


calls = [0]


def collate(idx):
    calls[0] += 1
    if calls[0] == 3:  # a task of the worker's first epoch, nothing allocated in its slot yet
        ARM["val"] = 1
        if os.fork() == 0:
            os.read(go_r, 1)
            os.write(out_w, str(float(ARM["t"][0, 0])).encode())
            os._exit(0)
        return ARM["t"]
    return shmloader.empty((4, 1024), dtype=torch.float32).fill_(float(idx[0]))


loader = shmloader.DataLoader(Items(), batch_size=4, num_workers=1, collate_fn=collate,
                              timeout=30, persistent_workers=True)
for _ in range(6):  # the slot is reused, written with other batches
    for b in loader:
        pass
del b, loader
gc.collect()
os.write(go_w, b"x")
print(os.read(out_r, 64).decode(), flush=True)
"""


@pytest.mark.timeout(90)
def test_a_process_forked_in_a_task_copies_what_is_allocated_after_the_fork_hook() -> None:
    # Review 33: the hook decided the copy from the part of the slot in use, none yet; another
    # hook (or thread) allocated and filled before the fork, and the child shared that part
    # uncopied: it read a later batch there (12.0, not 508.0).
    out = _run_script(_ALLOCATES_AFTER_THE_HOOK)
    assert out.split() == ["508.0"], out


def test_a_child_whose_copy_is_interrupted_says_so_and_the_parent_warns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review 65: a child's copy interrupted (a signal handler's exception in the at-fork hook)
    was made once more; a copy cut short had already remapped its range, so the second read
    zeros, and the child told the parent it had copied. An interrupted copy is not made again:
    the child says it failed, and the parent warns that the child may see later batches."""
    import warnings

    loader = shmloader.DataLoader(
        TorchRows(400, 256), batch_size=4, num_workers=2, timeout=LOADER_TIMEOUT_S
    )
    it = iter(loader)
    held = next(it)
    calls: list[int] = []

    def cut_short(addr: int, nbytes: int) -> None:
        """In the child: the first copy is interrupted; another would 'succeed'."""
        calls.append(nbytes)
        if len(calls) == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(afterfork, "privatize", cut_short)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ForkedChild(lambda: len(calls), HANG_S).result()
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert any("could not copy them" in s for s in said), said
    del held, it
