"""Lifetime and hang edges found by an adversarial review: ways out of the loop that used to leak
a slot, let another process write into a batch the user still holds, or block for good.

- A sampler that raises while the iterator hands out a batch (a user bug, or Ctrl-C landing in a
  slow sampler): torch drops that batch; its slot must come back (invariant 6).
- A forked child calling ``next()`` on the iterator it inherited: the iterator belongs to the
  parent (invariant 4), so the child gets an error naming the fix, and the parent's batches and
  workers are untouched.
- A forked child holding a batch (``multiprocessing.Process(args=(batch,))`` under fork, or a
  bare ``os.fork()``) while the parent drops it and iterates on: the child keeps its batch, as
  with torch, though the parent's workers rewrite the slot (``shmloader.afterfork``).

- Frames larger than a pipe holds, both ways at once (a batch size of 65,536 makes each TASK
  512 KiB of indices; a collate returning 1,500 tensors of 60 dimensions makes each READY about
  700 KiB): the main process must not block writing a TASK while the worker blocks writing its
  READY.

- ``iter()`` right after the user drops every batch of the last epoch: the dead batches' slots
  go to the new epoch's first tasks at once, rather than at the first ``next()``.

- An IterableDataset with persistent workers whose epoch is abandoned while the worker still
  has tasks past the end of its replica: those tasks are skipped (as torch's are) yet answered,
  so their slots come back and ``state_dict()``, which waits for them, returns.

- Ctrl-C landing between two frames the main process read in one wake-up: the frames not yet
  handled stay in the supervisor's inbox and are handled by the next ``next()``, so the epoch
  completes and ``state_dict()`` returns.

- Tight caps with one outsized batch: the next batch's worker asked first for the new size and
  took the only room for it, so the batch the consumer needed next could not move; and after an
  outsized batch every task asked for a slot of its size, so small batches no longer fit.

Every loader has ``timeout=``; scenarios in a forked child run under :class:`ForkedChild`, which
reaps it and reports its stack if it hangs. Each test failed before its fix.
"""

from __future__ import annotations

import gc
import os
import resource
import select
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import shmloader
from shmloader import afterfork
from tests.fault_datasets import Gate
from tests.forked import ForkedChild
from tests.lifetime_checks import batch_ok, frees_its_loaders_on_failure, states
from tests.lifetime_datasets import SizedRows, TorchRows, row_value

HANG_S = 20.0
LOADER_TIMEOUT_S = 10


class FailingOnce(torch.utils.data.Sampler[list[int]]):
    """Batches of 4 consecutive indices; the first epoch raises at draw ``bad``."""

    def __init__(self, n: int, bad: int) -> None:
        self.n, self.bad, self.epochs = n, bad, 0

    def __len__(self) -> int:
        return self.n // 4

    def __iter__(self) -> Iterator[list[int]]:
        self.epochs += 1
        for k in range(self.n // 4):
            if self.epochs == 1 and k == self.bad:
                raise RuntimeError(f"sampler failed at draw {k}")
            yield list(range(4 * k, 4 * k + 4))


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh-workers", "persistent-workers"])
@frees_its_loaders_on_failure
def test_a_sampler_that_raises_mid_epoch_gives_back_the_slot_of_the_batch_being_handed_out(
    persistent: bool,
) -> None:
    loader = shmloader.DataLoader(
        TorchRows(64, 64),
        batch_sampler=FailingOnce(64, bad=6),
        num_workers=2,
        persistent_workers=persistent,
        timeout=LOADER_TIMEOUT_S,
    )
    got = []
    with pytest.raises(RuntimeError, match="sampler failed at draw 6"):
        for k, (x, y) in enumerate(loader):
            assert batch_ok(x, y, k, 64), k
            got.append(k)
    # torch draws the next index before it hands a batch out: with 2 workers x 2 tasks primed,
    # the draw that fails is the one made while handing out batch 2, which is then lost
    assert got == [0, 1]
    del x, y
    gc.collect()
    # a clean epoch after the failure ends with every slot free: nothing was left READY
    assert [k for k, (x, y) in enumerate(loader) if not batch_ok(x, y, k, 64)] == []
    gc.collect()
    left = states(loader)
    assert (left["ready"], left["lent"], left["writing"]) == (0, 0, 0), left
    assert loader.stats().batches_held == 0


@frees_its_loaders_on_failure
def test_a_forked_child_cannot_take_batches_from_the_iterator_it_inherited() -> None:
    loader = shmloader.DataLoader(
        TorchRows(128, 64), batch_size=4, num_workers=2, timeout=LOADER_TIMEOUT_S
    )
    it = iter(loader)
    held = [next(it) for _ in range(3)]

    def child_body() -> dict[str, Any]:
        del held[:]  # the child drops its copies of the parent's batches, then tries the iterator
        gc.collect()
        try:
            next(it)
        except RuntimeError as e:
            return {"error": str(e)}
        return {"error": None}

    report = ForkedChild(child_body, HANG_S).result()
    assert report["error"] is not None, "the child took a batch from the parent's iterator"
    assert f"belongs to process {os.getpid()}" in report["error"], report["error"]
    assert "iter(loader)" in report["error"], report["error"]
    rest = [next(it) for _ in range(10)]  # the parent goes on as if nothing happened
    batches = held + rest
    wrong = [k for k, (x, y) in enumerate(batches) if not batch_ok(x, y, k, 64)]
    assert wrong == [], f"held batches {wrong} show other batches' rows"


@pytest.fixture(params=["few-descriptors", "past-1024-descriptors"])
def descriptors(request: pytest.FixtureRequest) -> Iterator[None]:
    """Either as is, or with more than 1,024 descriptors open (select() cannot wait on those;
    large training jobs often have that many)."""
    if request.param == "few-descriptors":
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"this process may open only {hard} descriptors (ulimit -Hn)")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    fds = []
    try:
        with open(os.devnull) as f:
            fds = [os.dup(f.fileno()) for _ in range(1100)]
        yield
    finally:
        for fd in fds:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _wait_readable(fd: int, seconds: float) -> None:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    poller.poll(int(seconds * 1000))


@pytest.fixture(params=["alone", "while-another-thread-starts-workers"])
def other_thread(request: pytest.FixtureRequest) -> Iterator[Callable[[], None]]:
    """A function that does nothing, or has another thread sit inside ``forking_workers``
    (starting shmloader workers, which can take seconds under spawn) for the rest of the test.
    That must not change what this thread's forks copy."""
    entered, leave = threading.Event(), threading.Event()
    threads = []

    def start() -> None:
        if request.param == "alone":
            return

        def starting_workers() -> None:
            with afterfork.forking_workers(afterfork.Keep()):
                entered.set()
                leave.wait(HANG_S)

        threads.append(threading.Thread(target=starting_workers))
        threads[0].start()
        assert entered.wait(HANG_S)

    try:
        yield start
    finally:
        leave.set()
        for thread in threads:
            thread.join(HANG_S)


@frees_its_loaders_on_failure
def test_a_forked_child_keeps_the_batch_it_holds_while_the_parent_reuses_its_slot(
    descriptors: None,
    other_thread: Callable[[], None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    unraisable: list[str] = []  # an exception in a fork hook is only "ignored": catch it
    monkeypatch.setattr(sys, "unraisablehook", lambda u: unraisable.append(repr(u.exc_value)))
    loader = shmloader.DataLoader(
        TorchRows(400, 256), batch_size=4, num_workers=2, timeout=LOADER_TIMEOUT_S
    )
    it = iter(loader)
    held = [next(it)]
    slot = held[0][0].data_ptr()
    other_thread()
    go_r, go_w = os.pipe()

    def child_body() -> dict[str, Any]:
        os.close(go_w)
        _wait_readable(go_r, HANG_S)  # until the parent has rewritten the slot
        x, y = held[0]
        return {"ok": batch_ok(x, y, 0, 256), "first": x[0, 0].item()}

    child = ForkedChild(child_body, HANG_S)
    os.close(go_r)
    reused_by = None
    try:
        held.clear()  # the parent drops batch 0; the child still has it
        for k in range(1, 60):  # the parent goes on until a later batch lands in that slot
            xk, yk = next(it)
            assert batch_ok(xk, yk, k, 256), k
            if xk.data_ptr() == slot:
                reused_by = k
                break
            del xk, yk
        os.write(go_w, b"g")
    finally:
        os.close(go_w)
        report = child.result()
    assert unraisable == [], f"a fork hook failed: {unraisable}"
    assert reused_by is not None, "no later batch reused the slot of batch 0"
    assert report["ok"], f"the child's batch 0 shows {report['first']} (batch {reused_by} rows)"


class Pool(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """A replay pool: the rows of batches of another loader. The worker loading index 0 first
    waits at ``gate``."""

    def __init__(self, batches: list[Any], gate: Gate) -> None:
        self.batches, self.gate = batches, gate

    def __len__(self) -> int:
        return 4 * len(self.batches)

    def __getitem__(self, j: int) -> tuple[torch.Tensor, int]:
        if j == 0:
            self.gate.arrive()
        x, y = self.batches[j // 4]
        return x[j % 4].clone(), int(y[j % 4])


@frees_its_loaders_on_failure
def test_another_loaders_workers_keep_the_batches_their_dataset_holds() -> None:
    first = shmloader.DataLoader(
        TorchRows(400, 256), batch_size=4, num_workers=2, timeout=LOADER_TIMEOUT_S
    )
    it = iter(first)
    gate = Gate()
    pool = Pool([next(it) for _ in range(4)], gate)
    slots = {x.data_ptr() for x, _ in pool.batches}
    replay = shmloader.DataLoader(pool, batch_size=4, num_workers=1, timeout=LOADER_TIMEOUT_S)
    replayed = iter(replay)  # its worker is forked holding the pool
    gate.wait_reached()
    pool.batches = []  # the main process lets the pool go, and trains on
    first.stats()  # a drain: the pool's slots are kept for the replay worker, not copied into it
    assert first._host.leases.kept == 4
    kept = first.stats()
    assert (kept.slots_kept, kept.bytes_kept > 0) == (4, True), "stats() does not show them"
    reused = 0
    for k in range(4, 100):
        x, y = next(it)
        assert batch_ok(x, y, k, 256), k
        reused += x.data_ptr() in slots
    gate.open()
    rows = [(int(x[0]), int(y)) for xs, ys in replayed for x, y in zip(xs, ys, strict=True)]
    assert reused == 0, "a slot the replay worker may still read was reused"
    assert rows == [(row_value(i), i) for i in range(16)], rows
    gone = first.stats()  # the replay worker is gone: its kept slots went back
    assert (gone.slots_kept, gone.bytes_kept) == (0, 0)


class Banked(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """TorchRows, except that the epoch's last batch reads its rows from ``bank``: rows kept,
    uncopied, from batches of the same loader (a memory bank)."""

    def __init__(self, n: int, width: int) -> None:
        self.rows, self.n = TorchRows(n, width), n
        self.bank: list[torch.Tensor] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x, y = self.rows[i]
        if i >= self.n - len(self.bank):
            x = self.bank[i - (self.n - len(self.bank))].clone()
        return x, y


@frees_its_loaders_on_failure
def test_a_loaders_own_workers_keep_the_batches_its_dataset_held_when_they_started() -> None:
    ds = Banked(400, 256)
    loader = shmloader.DataLoader(ds, batch_size=4, num_workers=2, timeout=LOADER_TIMEOUT_S)
    for k, (x, y) in enumerate(loader):
        if k < 4:
            ds.bank.append(x[0])  # a view: row 4k of batch k, in that batch's slot
        del x, y
    slots = {row.data_ptr() // 4096 for row in ds.bank}
    it = iter(loader)  # this epoch's workers are forked with the bank
    ds.bank = []  # the main process lets the rows go; the workers still read theirs
    reused, last = 0, None
    for x, y in it:
        reused += x.data_ptr() // 4096 in slots
        last = [int(v) for v in x[:, 0]]
        del x, y
    assert last == [row_value(4 * k) for k in range(4)], last
    assert reused == 0, "a slot the workers may still read was reused during their epoch"
    gc.collect()
    left = states(loader)  # the workers are gone: the kept slots went back
    assert (left["lent"], left["ready"], left["writing"]) == (0, 0, 0), left


@frees_its_loaders_on_failure
def test_slots_kept_for_a_new_epochs_workers_do_not_make_a_tight_cap_fail() -> None:
    # At a cap of 2 slots, each epoch's worker forks while the loop variable still holds the
    # previous epoch's last batch; that slot is kept for the epoch, and must not count against
    # the cap (it raised ArenaExhaustedError in the second epoch, where torch runs).
    kwargs: dict[str, Any] = {"batch_size": 4, "num_workers": 1, "prefetch_factor": 1}
    probe = shmloader.DataLoader(TorchRows(16, 256), **kwargs)
    next(iter(probe))
    slot = probe.stats().arena.slot_sizes[0]
    del probe
    loader = shmloader.DataLoader(
        TorchRows(16, 256),
        arena_max_bytes=2 * slot,
        arena_slots_per_slab=2,
        timeout=LOADER_TIMEOUT_S,
        **kwargs,
    )
    for _ in range(3):
        wrong = []
        for k, (x, y) in enumerate(loader):  # x, y outlive the loop, as in a training script
            if not batch_ok(x, y, k, 256):
                wrong.append(k)
        assert wrong == []
        assert loader.stats().arena.bytes_reserved <= 3 * slot  # the cap plus the kept slot


@frees_its_loaders_on_failure
def test_a_loader_left_holding_batches_keeps_no_copy_of_them_per_epoch_of_another() -> None:
    # Loader A's batches stay held (a replay bank) and A is never iterated again while B runs
    # epochs with fresh workers: each epoch's workers keep A's lent slots (a quarantine in A's
    # table), lifted when they end, and A's table drains only at its next next() or stats().
    # Until then it gained a set of every lent slot per epoch (review 28: +50 MiB after 100
    # epochs with 10,000 held).
    a = shmloader.DataLoader(TorchRows(64, 16), batch_size=1, num_workers=1,
                             timeout=LOADER_TIMEOUT_S)
    bank = []
    for x, _ in a:
        bank.append(x)
        if len(bank) == 40:
            break
    b = shmloader.DataLoader(TorchRows(8, 16), batch_size=4, num_workers=1,
                             timeout=LOADER_TIMEOUT_S)
    leases = a._host.leases
    for _ in range(3):
        for _ in b:
            pass
    lifted = [q for q in list(leases.quarantines) if not q.active]
    assert len(lifted) == 3  # one per epoch of b, gone at a's next drain
    assert [len(q.refs) for q in lifted] == [0, 0, 0]
    a.stats()
    assert leases.quarantines == []
    bank.clear()


@frees_its_loaders_on_failure
def test_an_interrupted_teardown_still_gives_back_the_slots_kept_for_its_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loader = shmloader.DataLoader(
        TorchRows(64, 256), batch_size=4, num_workers=1, timeout=LOADER_TIMEOUT_S
    )
    first = iter(loader)
    held = next(first)
    del first
    second = iter(loader)  # its worker forks while `held` is lent: that slot is kept
    next(second)
    del held
    gc.collect()
    loader.stats()  # a drain: the dead batch's slot is kept, not freed
    assert loader._host.leases.kept == 1

    def interrupted(self: Any, timeout: float) -> None:
        raise KeyboardInterrupt  # Ctrl-C while teardown waits for the worker

    monkeypatch.setattr("shmloader.supervisor.Supervisor._flush_all", interrupted)
    with pytest.raises(KeyboardInterrupt):
        second._shutdown_workers()
    monkeypatch.undo()
    del second
    gc.collect()
    left = states(loader)
    assert loader._host.leases.kept == 0
    assert (left["lent"], left["ready"], left["writing"]) == (0, 0, 0), left


class Counted(torch.utils.data.Dataset[int]):
    def __len__(self) -> int:
        return 4 * BIG_BATCH

    def __getitem__(self, i: int) -> int:
        return i


BIG_BATCH = 65_536  # indices per TASK: 512 KiB of int64, more than a pipe holds
LEAVES = 1_500  # 60-dimensional tensors per batch: a READY frame of about 700 KiB


def count_with_leaves(samples: list[int]) -> tuple[int, int, list[torch.Tensor]]:
    """The batch's first index and size, and LEAVES tiny tensors of 60 dimensions each (each
    dimension is a field of the batch's layout in its READY frame)."""
    return samples[0], len(samples), [torch.full((1,) * 60, i) for i in samples[:LEAVES]]


def _big_frames_both_ways() -> dict[str, Any]:
    loader = shmloader.DataLoader(
        Counted(),
        batch_size=BIG_BATCH,
        num_workers=1,
        collate_fn=count_with_leaves,
        timeout=LOADER_TIMEOUT_S,
    )
    got = []
    for first, n, leaves in loader:
        got.append((first, n, [int(t) for t in leaves] == list(range(first, first + LEAVES))))
    return {"got": got}


@pytest.mark.timeout(HANG_S + 30)
def test_frames_larger_than_a_pipe_both_ways_do_not_deadlock() -> None:
    report = ForkedChild(_big_frames_both_ways, HANG_S).result()
    assert report["got"] == [[k * BIG_BATCH, BIG_BATCH, True] for k in range(4)]


class SlowThree(torch.utils.data.IterableDataset[torch.Tensor]):
    """Three samples per replica, each slow enough that an abandoned epoch's queued tasks are
    still waiting when the next epoch begins."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        for i in range(3):
            time.sleep(0.2)
            yield torch.full((1000,), i)


def _abandon_an_iterable_epoch_then_save() -> dict[str, Any]:
    loader = shmloader.DataLoader(
        SlowThree(), batch_size=1, num_workers=1, prefetch_factor=4, persistent_workers=True
    )
    it = iter(loader)
    next(it)  # then the epoch is abandoned: its worker still has tasks past its 3 samples
    del it
    second = [int(b[0, 0]) for b in loader]
    state = loader.state_dict()  # waits for the abandoned epoch's answers
    left = states(loader)
    return {"second": second, "epoch": state["epoch"], "left": left}


@pytest.mark.timeout(HANG_S + 30)
def test_an_abandoned_iterable_epoch_past_the_replicas_end_gives_its_slots_back() -> None:
    report = ForkedChild(_abandon_an_iterable_epoch_then_save, HANG_S).result()
    assert report["second"] == [0, 1, 2]
    assert report["epoch"] == 2
    left = report["left"]
    assert (left["writing"], left["ready"], left["lent"]) == (0, 0, 0), left


@frees_its_loaders_on_failure
def test_an_interruption_between_frames_loses_none_of_them(monkeypatch) -> None:
    loader = shmloader.DataLoader(
        TorchRows(64, 64), batch_size=4, num_workers=2, timeout=LOADER_TIMEOUT_S
    )
    it = iter(loader)
    sup = it._sup
    deadline = time.monotonic() + LOADER_TIMEOUT_S
    while len(sup.inbox) < 2 and time.monotonic() < deadline:
        sup.wait(deadline - time.monotonic())  # both workers' first answers, read at once
    assert len(sup.inbox) >= 2
    handle = type(it)._handle

    def interrupted_after_one(self, wid, msg):
        handle(self, wid, msg)
        monkeypatch.undo()
        raise KeyboardInterrupt  # as if Ctrl-C landed right after the first frame

    monkeypatch.setattr(type(it), "_handle", interrupted_after_one)
    with pytest.raises(KeyboardInterrupt):
        next(it)
    assert len(sup.inbox) >= 1, "the frames not yet handled are still there"
    batches = list(it)  # the same iterator goes on: nothing is missing or waits forever
    assert [y.tolist() for _, y in batches] == [list(range(i, i + 4)) for i in range(0, 64, 4)]
    assert all(batch_ok(x, y, k, 64) for k, (x, y) in enumerate(batches))
    del batches
    gc.collect()
    assert loader.state_dict()["epoch"] == 1
    left = states(loader)
    assert (left["writing"], left["ready"], left["lent"]) == (0, 0, 0), left


MIB = 1 << 20


class SlowAt(SizedRows):
    """A :class:`SizedRows` whose sample ``slow`` costs about half a second of CPU (no sleep)."""

    def __init__(self, n: int, schedule: list[tuple[int, int]], slow: int) -> None:
        super().__init__(n, schedule)
        self.slow = slow

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.slow:
            h = i
            for _ in range(3_000_000):
                h = (h * 6364136223846793005 + 1442695040888963407) & 0xFFFFFFFFFFFFFFFF
            assert h >= 0
        return super().__getitem__(i)


@frees_its_loaders_on_failure
def test_at_the_cap_a_new_size_goes_to_the_batch_needed_next() -> None:
    # Batches 4 and 5 are 4 MiB and the cap has room for one such slot; batch 4 is slow, so
    # batch 5's worker asks for that size first. The room must still go to batch 4.
    data = SlowAt(12, [(0, 4096), (4, 4 * MIB), (6, 4096)], slow=4)
    loader = shmloader.DataLoader(
        data, batch_size=1, num_workers=2, arena_max_bytes=4 * MIB + 600 * 1024, timeout=20
    )
    it = iter(loader)
    sizes = [next(it).numel() for _ in range(12)]  # nothing held while the next one comes
    assert sizes == [data.width_of(i) for i in range(12)]


@frees_its_loaders_on_failure
def test_after_an_outsized_batch_small_batches_still_fit_under_the_cap() -> None:
    # One 4 MiB batch among 64 KiB ones; the loop variable holds one batch while the next is
    # fetched, and 600 KiB is left under the cap beside the 4 MiB slot.
    data = SizedRows(16, [(0, 64 * 1024), (5, 4 * MIB), (6, 64 * 1024)])
    loader = shmloader.DataLoader(
        data, batch_size=1, num_workers=1, arena_max_bytes=4 * MIB + 600 * 1024, timeout=20
    )
    sizes = [b.numel() for b in loader]
    assert sizes == [data.width_of(i) for i in range(16)]


@frees_its_loaders_on_failure
def test_iter_gives_the_slots_of_batches_dropped_since_to_its_first_tasks() -> None:
    loader = shmloader.DataLoader(
        TorchRows(16), batch_size=2, num_workers=2, persistent_workers=True,
        timeout=LOADER_TIMEOUT_S,
    )  # fmt: skip
    held = list(loader)  # every batch of the epoch held: their slots are all lent
    del held  # dropped: dead, not yet given back
    it = iter(loader)
    assert not it._dispatch.unsent  # every task it primed went out with a slot
    assert [batch[1].tolist() for batch in it] == [[i, i + 1] for i in range(0, 16, 2)]


@pytest.mark.parametrize("how", ["broken-out-of", "persistent-workers", "peeked"])
@frees_its_loaders_on_failure
def test_a_dropped_loader_gives_its_arena_back_at_once(how: str) -> None:
    """Review 13: an iterator's ending queued a function of its dispatcher for the next drain;
    where none came (an epoch broken out of, persistent workers, ``next(iter(loader))``), the
    loader's arena stayed alive and mapped, its whole size, until the process exited."""
    loader = shmloader.DataLoader(
        TorchRows(16), batch_size=2, num_workers=2, persistent_workers=how == "persistent-workers",
        timeout=LOADER_TIMEOUT_S,
    )  # fmt: skip
    it = iter(loader)
    batch = next(it)
    if how == "broken-out-of":
        batch = next(it)
    elif how == "persistent-workers":
        batch = deque(it, maxlen=1)[0]  # the epoch to its end, holding its last batch
    host = weakref.ref(loader._host)
    del it, batch, loader
    gc.collect()
    assert host() is None, "the dropped loader's arena is still alive"
