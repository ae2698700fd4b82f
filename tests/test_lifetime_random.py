"""Randomized batch lifetimes: hold, slice, view, release and drop batches in random orders, and
check after every step that every batch the user still holds shows exactly its dataset rows.

Hypothesis draws a *scenario* — the loader (start method, persistent workers or not, a batch
sampler whose batch sizes change within the epoch, row width (the widest makes batches of up to
1.9 MB, which take slots of 1 MiB and more: there a batch a quarter of its slot or less gets a
snug class, and big free slots go hollow), tensor or NumPy collate) and a
program of steps over up to :data:`MAX_ITERATORS` live iterators of that one loader:

- ``next``: the next batch of an iterator (a new epoch once it is exhausted); it is checked and
  held as a new *group* (everything that views one batch's slot);
- ``slice`` / ``view``: hold a row or column slice, or a ``.numpy()`` (NumPy: ``.view()``) view
  of a held batch, in its group;
- ``drop``: let go of one held object (the slot must stay while any object of its group lives);
- ``release``: ``shmloader.release`` on any object of a group — 1 the first time, 0 after (the
  group is then no longer checked: its slot may hold a later batch);
- ``gc``: ``gc.collect()``;
- ``new_iter`` / ``drop_iter``: start another epoch on a new iterator (with persistent workers,
  ``iter()`` restarts the loader's one iterator), or drop one mid-epoch.

After every step each held object of an unreleased group is compared with the dataset, and
``stats().batches_held`` must equal the number of unreleased groups still held. At the end every
live iterator is drained (its batches checked), everything is dropped, and every slot must be
free.

Some scenarios give the loader a tight ``arena_max_bytes`` (room for 2 to 6 of the largest
batch) and prefetch far ahead, so the arena runs at its cap: later batches are spilled, free
slots hollowed, slabs of other sizes given back (tests/test_at_the_cap.py forces each case;
here they mix). Then the arena must stay within its cap (plus the bytes kept for forked workers),
its slab files must hold exactly the bytes it reports, and an ``ArenaExhaustedError`` is allowed
only while the user holds a batch: the model then drops its oldest group, as a user would, and
goes on. A capped scenario keeps one live iterator (another iterator's prefetched batches hold
slots this one cannot take back).

Each example runs in a fork of the test process (tests/forked.py), so a failing example's
traceback cannot keep its workers alive and a hang fails that example. Bounds: the program is
short, fork gets :data:`FORK_EXAMPLES` examples, spawn and forkserver
(several seconds to start workers on 2 cores) one example each with persistent workers, the whole
file runs in about a minute. ``derandomize=True`` and no example database make every run the
same; shrinking is off so a failure costs one replay, not minutes (``LIFETIME_SHRINK=1`` turns
it on when you want the smallest failing program).
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import shmloader
from arena import ArenaExhaustedError
from arena._layout import PAGE, page_align
from tests.forked import ForkedChild
from tests.lifetime_datasets import (
    ListBatchSampler,
    PairRows,
    consecutive_batches,
    numpy_pair_collate,
    row_value,
)

FORK_EXAMPLES = 20
OTHER_EXAMPLES = 2  # spawn, forkserver: the first is the minimal program, the rest random
MAX_ITERATORS = 3  # live at once
MAX_ITERATORS_CREATED = 5  # per example (each starts fresh workers unless persistent)
MAX_GROUPS = 24  # batches held at once; beyond it the oldest group is dropped
LOADER_TIMEOUT_S = 20
EXAMPLE_S = 60  # one example's bound (spawn and forkserver start workers in several seconds)
PHASES = (Phase.explicit, Phase.reuse, Phase.generate) + (
    (Phase.shrink,) if os.environ.get("LIFETIME_SHRINK") else ()
)

STEPS = (
    "next",
    "next",
    "next",
    "next",
    "slice",
    "view",
    "drop",
    "release",
    "gc",
    "new_iter",
    "drop_iter",
)


@dataclass(frozen=True)
class Scenario:
    start_method: str
    persistent: bool
    kind: str  # "torch" (default collate) or "numpy" (a collate returning NumPy arrays)
    width: int
    sizes: tuple[int, ...]  # batch sizes of one epoch, in order
    steps: tuple[tuple[str, int, int, int], ...]
    cap_batches: int | None = None  # arena_max_bytes as this many of the largest batch

    def __repr__(self) -> str:  # what hypothesis prints for a failing example
        return (
            f"Scenario({self.start_method}, persistent={self.persistent}, {self.kind}, "
            f"width={self.width}, sizes={list(self.sizes)}, cap_batches={self.cap_batches}, "
            f"steps={list(self.steps)})"
        )


@st.composite
def scenarios(draw: st.DrawFn, start_method: str) -> Scenario:
    cheap = start_method == "fork"
    return Scenario(
        start_method=start_method,
        persistent=draw(st.booleans()) if cheap else True,
        kind=draw(st.sampled_from(["torch", "numpy"])),
        width=draw(st.sampled_from([16, 300, 2000, 20000])),
        sizes=tuple(draw(st.lists(st.integers(1, 12), min_size=3, max_size=10))),
        steps=tuple(
            draw(
                st.lists(
                    st.tuples(
                        st.sampled_from(STEPS),
                        st.integers(0, 1000),
                        st.integers(0, 1000),
                        st.integers(0, 1000),
                    ),
                    min_size=10,
                    max_size=80 if cheap else 40,
                )
            )
        ),
        cap_batches=draw(st.one_of(st.none(), st.integers(2, 6))) if cheap else None,
    )


# ------------------------------------------------------------------------------------ the model


@dataclass
class Group:
    """What the user holds of one batch: objects viewing its slot, each with its expected value."""

    name: str
    objects: list[tuple[Any, np.ndarray]] = field(default_factory=list)
    released: bool = False
    spilled: bool = False  # copied out of the arena at the cap: it holds no slot


@dataclass
class LiveIterator:
    it: Any
    pos: int = 0  # batches of the current epoch taken so far


def as_numpy(obj: Any) -> np.ndarray:
    return obj.numpy() if isinstance(obj, torch.Tensor) else np.asarray(obj)


class Run:
    """Executes one scenario against one loader, checking after every step."""

    def __init__(self, sc: Scenario) -> None:
        self.sc = sc
        self.batches = consecutive_batches(sc.sizes)
        capped = sc.cap_batches is not None
        largest = page_align(max(sc.sizes) * (sc.width + 1) * 8 + PAGE)  # rows, labels, payload
        self.loader = shmloader.DataLoader(
            # At the cap, uneven work per sample: workers finish out of sampler order, so
            # later batches take slots before the one needed next asks (and get spilled).
            PairRows(sum(sc.sizes), sc.width, sc.kind, max_rounds=3000 if capped else 0),
            batch_sampler=ListBatchSampler(self.batches),
            num_workers=2,
            collate_fn=numpy_pair_collate if sc.kind == "numpy" else None,
            multiprocessing_context=sc.start_method,
            persistent_workers=sc.persistent,
            timeout=LOADER_TIMEOUT_S,
            prefetch_factor=8 if capped else 2,
            arena_max_bytes=(sc.cap_batches or 0) * largest or None,
        )
        self.max_iterators = 1 if capped else MAX_ITERATORS
        self.iterators: list[LiveIterator] = []
        self.created = 0
        self.groups: list[Group] = []
        self.log: list[str] = []

    # -- expected values

    def expected(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        idx = self.batches[k]
        rows = np.array([[row_value(i)] * self.sc.width for i in idx], dtype=np.int64)
        return rows, np.array(idx, dtype=np.int64)

    # -- steps

    def step(self, kind: str, a: int, b: int, c: int) -> None:
        self.log.append(f"{kind}({a}, {b}, {c})")
        getattr(self, f"do_{kind}")(a, b, c)
        self.check(f"after step {len(self.log)}: {kind}")

    def new_iterator(self) -> LiveIterator:
        it = iter(self.loader)
        self.created += 1
        for live in self.iterators:
            if live.it is it:  # persistent workers: iter() restarted the loader's one iterator
                live.pos = 0
                return live
        live = LiveIterator(it)
        self.iterators.append(live)
        return live

    def do_next(self, a: int, b: int, c: int) -> None:
        if not self.iterators:
            self.new_iterator()
        live = self.iterators[a % len(self.iterators)]
        try:
            batch = self.next_of(live)
        except StopIteration:
            assert live.pos == len(self.batches), (
                f"epoch ended after {live.pos} of {len(self.batches)} batches"
            )
            self.iterators.remove(live)
            return
        k = live.pos
        live.pos += 1
        x, y = batch
        want_x, want_y = self.expected(k)
        group = Group(f"batch {k} of iterator {id(live.it):#x}", [(x, want_x), (y, want_y)])
        group.spilled = not self.in_arena(x)
        self.groups.append(group)
        if b % 3 == 0:  # sometimes the batch object itself is what the user holds
            group.objects.append((batch, want_x))
        del batch, x, y
        if len(self.groups) > MAX_GROUPS:
            self.groups.pop(0)

    def next_of(self, live: LiveIterator) -> Any:
        """``next(live.it)``; at the cap, an ``ArenaExhaustedError`` is allowed only while the
        user holds a batch: it then lets go of its oldest one and asks again."""
        while True:
            try:
                return next(live.it)
            except ArenaExhaustedError as e:
                held = [g for g in self.groups if g.objects and not g.released]
                assert self.sc.cap_batches is not None and held, (
                    f"ArenaExhaustedError while the user holds no batch: {e}; steps: {self.log}"
                )
                held[0].objects.clear()
                self.check("after an ArenaExhaustedError")

    def in_arena(self, x: Any) -> bool:
        ptr = x.data_ptr() if isinstance(x, torch.Tensor) else int(x.ctypes.data)
        return any(
            s.segment.address <= ptr < s.segment.address + s.size
            for s in self.loader._host.arena.slabs()
        )

    def _held_group(self, a: int) -> Group | None:
        held = [g for g in self.groups if g.objects]
        return held[a % len(held)] if held else None

    def do_slice(self, a: int, b: int, c: int) -> None:
        group = self._held_group(a)
        if group is None:
            return
        x, want = group.objects[0]
        if isinstance(x, tuple | list):
            return
        if b % 2 and x.ndim == 2:  # a column slice (not contiguous)
            lo = c % x.shape[1]
            hi = lo + 1 + (b % (x.shape[1] - lo))
            group.objects.append((x[:, lo:hi], want[:, lo:hi]))
        else:
            lo = c % x.shape[0]
            hi = lo + 1 + (b % (x.shape[0] - lo))
            group.objects.append((x[lo:hi], want[lo:hi]))

    def do_view(self, a: int, b: int, c: int) -> None:
        group = self._held_group(a)
        if group is None:
            return
        obj, want = group.objects[b % len(group.objects)]
        if isinstance(obj, torch.Tensor):
            group.objects.append((obj.numpy(), want))
        elif isinstance(obj, np.ndarray):
            group.objects.append((obj.view(), want))

    def do_drop(self, a: int, b: int, c: int) -> None:
        group = self._held_group(a)
        if group is None:
            return
        if c % 4 == 0:
            group.objects.clear()  # the whole batch at once
        else:
            group.objects.pop(b % len(group.objects))

    def do_release(self, a: int, b: int, c: int) -> None:
        group = self._held_group(a)
        if group is None:
            return
        obj = group.objects[b % len(group.objects)][0]
        got = shmloader.release(obj, self.loader)
        want = 0 if group.released or group.spilled else 1
        assert got == want, (
            f"shmloader.release of {group.name} ({'again' if group.released else 'first'}) "
            f"returned {got}, expected {want}"
        )
        group.released = True

    def do_gc(self, a: int, b: int, c: int) -> None:
        gc.collect()

    def do_new_iter(self, a: int, b: int, c: int) -> None:
        if self.created >= MAX_ITERATORS_CREATED:
            self.do_next(a, b, c)
            return
        if len(self.iterators) >= self.max_iterators:
            self.iterators.pop(a % len(self.iterators))
        self.new_iterator()

    def do_drop_iter(self, a: int, b: int, c: int) -> None:
        if self.iterators:
            self.iterators.pop(a % len(self.iterators))  # mid-epoch: its workers stop

    # -- checks

    def check(self, where: str) -> None:
        wrong = []
        for g in self.groups:
            if g.released:
                continue
            for obj, want in g.objects:
                got = as_numpy(obj[0] if isinstance(obj, tuple | list) else obj)
                if got.shape != want.shape or not np.array_equal(got, want):
                    wrong.append(g.name)
                    break
        assert wrong == [], f"{where}: held batches changed: {wrong}; steps: {self.log}"
        held = [g for g in self.groups if g.objects and not g.released]
        st_ = self.loader.stats()
        in_slots = sum(1 for g in held if not g.spilled)
        assert st_.batches_held == in_slots, (
            f"{where}: stats() says {st_.batches_held} batches held, the user "
            f"holds {in_slots} in the arena; steps: {self.log}"
        )
        spilled = sum(1 for g in held if g.spilled)  # (copies waiting their turn count too)
        assert st_.batches_spilled >= spilled, f"{where}: {spilled} spilled held, {st_}"
        if self.sc.cap_batches is not None and st_.slabs:
            assert st_.bytes_reserved <= st_.max_bytes + st_.bytes_kept, f"{where}: {st_}"
            arena = self.loader._host.arena  # the slab files hold what the arena reports
            allocated = sum(os.fstat(s.segment._fd).st_blocks * 512 for s in arena.slabs())
            assert allocated == st_.bytes_reserved, f"{where}: {allocated} allocated, {st_}"

    def finish(self) -> None:
        if self.sc.persistent and self.created:
            # The loader keeps its one iterator, mid-epoch or not: a last epoch from the start
            # settles whatever the one before left in flight.
            self.iterators.clear()
            self.new_iterator()
        for live in list(self.iterators):  # drain each epoch, checking every batch
            while live.pos < len(self.batches):
                batch = self.next_of(live)
                want_x, want_y = self.expected(live.pos)
                live.pos += 1
                assert np.array_equal(as_numpy(batch[0]), want_x), f"draining batch {live.pos - 1}"
                assert np.array_equal(as_numpy(batch[1]), want_y), f"draining batch {live.pos - 1}"
                del batch
                self.check(f"while draining, after batch {live.pos - 1}")
            with pytest.raises(StopIteration):
                next(live.it)
        self.iterators.clear()
        self.groups.clear()
        gc.collect()
        st_ = self.loader.stats()
        assert st_.batches_held == 0, st_
        if st_.arena is not None:
            slots = dict(st_.arena.slots_by_state)
            assert slots["free"] == st_.arena.slots_total, f"slots left busy: {slots}"


def _run_here(sc: Scenario) -> int:
    run = Run(sc)
    try:
        for kind, a, b, c in sc.steps:
            run.step(kind, a, b, c)
        run.finish()
        return len(run.log)
    finally:
        run.iterators.clear()
        run.groups.clear()
        del run
        gc.collect()  # the loader and its workers end before the child exits


def run_scenario(sc: Scenario) -> None:
    """Runs ``sc`` in a fork of this process: a failing example's traceback cannot keep its
    loader and workers alive here, and a hang fails the example after :data:`EXAMPLE_S`."""
    assert ForkedChild(lambda: _run_here(sc), EXAMPLE_S).result() == len(sc.steps)


@pytest.mark.parametrize(
    ("start_method", "examples"),
    [("fork", FORK_EXAMPLES), ("spawn", OTHER_EXAMPLES), ("forkserver", OTHER_EXAMPLES)],
    ids=["fork", "spawn", "forkserver"],
)
@pytest.mark.timeout(150)
def test_held_batches_always_show_their_own_rows_whatever_the_user_does(start_method, examples):
    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        phases=PHASES,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        print_blob=True,
    )
    @given(scenarios(start_method))
    def lifetimes_hold(sc: Scenario) -> None:
        run_scenario(sc)

    lifetimes_hold()
