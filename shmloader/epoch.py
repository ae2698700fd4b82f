"""A multi-process iterator's life: its start, its epochs, its resume record and its end.

One instance per ``iter(loader)`` (or one for the loader's life with ``persistent_workers``):

    __init__: arena host, workers (:mod:`shmloader.startup`), Dispatch, its
        :class:`~shmloader.ending.Ending` (the teardown, also run when it is dropped)
    _reset (each epoch): torch's base seed and sampler iterator, a resumed plan's replayed draws
        and skipped batches, RESUME frames to persistent workers, then torch's priming puts
    next(): :mod:`shmloader.nextbatch` (the per-batch path; this class extends it)
    resume_state: this iterator's part of ``DataLoader.state_dict()``
    end: exhausted, dropped or failed -> workers stopped, every slot held queued for release

Everything runs in the caller's thread: no background thread in the main process. Task sending,
worker choice and slot binding are :mod:`shmloader.dispatch`'s, leases :mod:`shmloader.lease`'s,
the resume records :mod:`shmloader.progress`'s.

Invariants:
- Base seed and sampler iterator come from torch's ``_BaseDataLoaderIter``, drawn at torch's
  moments, so the main process's RNG state afterwards is torch's (torch's stock samplers take the
  equivalent fast path of :mod:`shmloader.sampling`).
- Every slot that reaches the main process leaves it: yielded (then released with its lease),
  released when its batch fails to rebuild or the sampler raises while it is handed out, or
  released at its end (a finished, dropped or failed iterator stops its workers, then queues
  every slot it holds for release: :mod:`shmloader.ending`, which finishes later an end that an
  interruption cut short).
- A dead worker, or an interruption that leaves a change half done, fails the iterator
  (:mod:`shmloader.nextbatch`). An iterator inherited through ``fork()`` refuses to yield: its
  slots are the parent's.
- One thread at a time (:mod:`shmloader.onethread`): ``__next__``, ``iter()`` of a persistent
  iterator and ``state_dict()`` take the iterator's lock.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from arena.finalizers import on_death
from shmloader import protocol as P
from shmloader import rngstate
from shmloader._torch_compat import ITERABLE_KIND
from shmloader.dispatch import Dispatch
from shmloader.ending import Ending
from shmloader.host import ArenaHost
from shmloader.nextbatch import NextBatch, SamplerRaised
from shmloader.onethread import one_thread, reset_after_fork
from shmloader.progress import SamplerProgress, last_logged
from shmloader.sampling import fast_batches
from shmloader.startup import start_workers
from shmloader.state import EpochStart, skip_consumed, untouched_rngs
from shmloader.unseen import HeldUnseen

HostFor = Callable[[bool, str | None], ArenaHost]  # (pin_memory, pin_memory_device) -> host


class ShmDataLoaderIter(NextBatch, HeldUnseen):
    """Iterates over a DataLoader with worker processes writing into a shared-memory arena."""

    def __init__(
        self,
        loader: torch.utils.data.DataLoader[Any],
        host_for: HostFor,
        plan: dict[str, Any] | None = None,
    ) -> None:
        # A loaded state whose iterator existed (an epoch in progress, or persistent workers):
        # its base seed is the saved one, and drawing it must leave every RNG untouched.
        resumed = plan is not None and plan["base_seed"] is not None
        with untouched_rngs(loader) if resumed else contextlib.nullcontext():
            super().__init__(loader)
        if resumed:
            self._base_seed = plan["base_seed"]  # type: ignore[index]
        nw: int = self._num_workers
        # torch's check, at its moment (review 32: 0 ran as 2); None set after the loader was
        # made raises torch's TypeError here, as there
        if loader.prefetch_factor <= 0:  # type: ignore[operator]
            raise AssertionError(
                "prefetch_factor must be greater than 0 for MultiProcessingDataLoaderIter"
            )
        self._plan = plan
        self._ended = False
        self._lock = threading.RLock()  # one thread at a time in the iterator (see invariants)
        reset_after_fork(self)
        self._host = host = host_for(self._pin_memory, self._pin_memory_device)
        self._leases = host.leases
        self._pid = os.getpid()
        self._sup, self._progress = start_workers(self, loader, plan, host)
        self._workers = self._sup.procs  # torch's name: pid, exitcode, is_alive(), join()
        max_tasks = (loader.prefetch_factor or 2) * nw
        self._dispatch = Dispatch(host, self._sup, nw, max_tasks, loader.in_order, self._lock)
        # Dropped, exhausted or failed: stop the workers, then give back every slot in flight;
        # the host finishes an ending an interruption cut short (shmloader.ending).
        self._ending = ending = Ending(self, self._lock, self._sup, self._dispatch, self._leases)
        host.endings.append(ending)
        on_death(self, ending)
        self.failure = None
        self._safe = False
        self._rewind_keep = 0  # rewindable()
        # While a DevicePrefetcher holds batches unseen: the global RNGs before the sampler
        # draw each consumed batch triggers (the state's rewound_rngs, behind them).
        self._rngs_before: deque[bytes] | None = None
        self._rewound: deque[bytes | tuple[bytes, Any, int]] = deque()  # (NextBatch)
        self._reset(loader, first_iter=True)

    # -- epochs ---------------------------------------------------------------------------------

    @one_thread("iter()")
    def _reset(self, loader: torch.utils.data.DataLoader[Any], first_iter: bool = False) -> None:
        # Interruptions follow next()'s rule (shmloader.interrupts): safe until the epoch's first
        # change to the workers or the dispatch, then only in the sampler's draws.
        self._safe = True
        try:
            self._start_epoch(loader, first_iter)
        except BaseException as e:
            self._left(e, "iter()")
            raise
        self._safe = False

    def _start_epoch(self, loader: torch.utils.data.DataLoader[Any], first_iter: bool) -> None:
        if self._rewound:  # persistent workers: their stale tasks must be the saved run's
            self._safe = False
            self._draw_rewound()
            self._safe = True
        plan, self._plan = self._plan, None
        if plan is None or not plan["in_epoch"]:
            plan = None
            start = EpochStart.capture(loader)
        else:
            start = EpochStart.from_dict(plan["epoch_start"])
        # A resumed epoch replays its sampler draws from where they started, skips the batches
        # already consumed without fetching them, then primes as torch does.
        with start.replay(loader) if plan else contextlib.nullcontext():
            super()._reset(loader, first_iter)
            fast = fast_batches(self._index_sampler)
            if fast is not None:
                self._sampler_iter = fast
            self._check_usable()
            # From here on the epoch, the workers and the dispatch change (an interruption that
            # leaves them half-changed makes the iterator unusable; before, an iter() again redoes
            # what ran).
            self._safe = False
            self.epoch_start = start
            self.epoch_no: int = loader._epochs_started  # type: ignore[attr-defined]
            loader._epochs_started += 1  # type: ignore[attr-defined]
            self._ended = False
            d = self._dispatch
            d.detach_deferred()
            if plan is None:
                self._progress.new_epoch()
            if not first_iter:
                abandoned = d.epoch
                for seq, wid in d.new_epoch():
                    self._progress.moved_past(wid, abandoned, seq)
                for wid in range(self._num_workers):
                    self._sup.send(wid, P.Resume(d.epoch, self._shared_seed))
            skip = plan["yielded"] if plan else 0
            skip_consumed(self._next_index, skip)
            self._num_yielded = skip
            d.start_at(skip, plan.get("replicas") if plan else None)
            self._at = SamplerProgress(skip, plan["yielded_extra"] if plan else ())
            self._reset_unseen()  # until a DevicePrefetcher pass over this epoch registers
            # The draws the saved run had made ahead of its save, behind a DevicePrefetcher,
            # that this epoch's consumed batches make again (NextBatch._try_put_rewindable)
            self._rewound = deque(plan.get("rewound_rngs") or ()) if plan else deque()
            if self._rewind_keep:  # a DevicePrefetcher's batches ahead: see rewindable()
                self._at.log = deque(maxlen=self._rewind_keep)
                self._progress.undo = deque(maxlen=self._rewind_keep)
                self._rngs_before = deque(maxlen=self._rewind_keep)
            # Batches the user dropped since the last next() give their slots to the first
            # tasks: else those wait, decided and unsent, until the first next().
            self._leases.drain()
            for _ in range(d.max_tasks):  # torch primes the prefetch loop with this many attempts
                self._try_put()
            if self._rewound and self._dataset_kind != ITERABLE_KIND:
                self._draw_ahead()  # (an IterableDataset's sampler draws nothing)

    def _draw_rewound(self) -> None:
        """Persistent workers' resumed epoch left before its consumed batches sent every task
        the saved run had decided ahead of its save: sent now (drawn, where not drawn yet, each
        from its own RNGs), so those workers fetch them as stale as that run's did, and their
        random streams go on from where that run's went on (review 74). A draw the sampler
        raises from is passed over, as that run's error was raised at its turn."""
        while self._rewound:
            entry = self._rewound[0]
            if isinstance(entry, tuple) and type(entry[1]) is SamplerRaised:
                self._rewound.popleft()  # (raised to the saved run's user at its turn)
                continue
            try:
                self._try_put_rewindable()
            except Exception:  # noqa: BLE001  (a draw made now that the sampler raises at)
                self._safe = False  # (set for the sampler's draw; the next puts are not safe)

    # -- resume state ---------------------------------------------------------------------------

    @one_thread("state_dict()")
    def resume_state(self) -> dict[str, Any] | None:
        """This iterator's part of ``DataLoader.state_dict()`` (see :mod:`shmloader.state`), as
        of before the batches a consumer took and has not handed out yet (``ahead``: a
        ``DevicePrefetcher``), which a resumed loader produces again, making the sampler draws
        that taking them made from the global RNGs they started from (``rewound_rngs``), and
        leaving the main process's RNGs as they are now (``main_rng``); None once the epoch is
        over and the workers are not kept (the loader records that). Decided under the
        iterator's lock: a ``next()`` in another thread ends the epoch either before or after
        it, never in between."""
        d, behind = self._dispatch, self.ahead
        if self._epoch_over() and not self._persistent_workers:
            return None
        self._check_usable()
        try:
            while d.orphans:  # an abandoned epoch's tasks: the RNG state needed is after them
                self._receive()
        except BaseException as e:
            self._left(e, "state_dict()")
            raise
        if self._epoch_over():  # between epochs
            return {
                "epoch": self.epoch_no + 1,
                "in_epoch": False,
                "yielded": 0,
                "yielded_extra": [],
                "base_seed": int(self._base_seed),
                "epoch_start": None,
                "workers": self._progress.rng_states(d.exhausted, d.epoch),
                "replicas": None,
                "main_rng": rngstate.capture(),
            }
        yielded, extra = self._at.record(d.in_order, behind)
        progress, back = self._progress.behind(behind)
        try:
            workers = progress.rng_states()
        except RuntimeError as e:
            if not behind:
                raise
            raise RuntimeError(
                f"cannot save the DataLoader's state {behind} batches behind the iterator (the "
                f"batches a DevicePrefetcher holds ahead of you): the workers' RNG snapshots of "
                f"then are gone from their ring of {progress.ring.depth}; make the "
                "DevicePrefetcher before the loader's first iter()"
            ) from e
        return {
            "epoch": self.epoch_no,
            "in_epoch": True,
            "yielded": yielded,
            "yielded_extra": extra,
            "base_seed": int(self._base_seed),
            "epoch_start": self.epoch_start.as_dict(),
            "workers": workers,
            "replicas": progress.replica_record(*d.assignment(back)),
            "main_rng": rngstate.capture(),
            # The draws the batches behind made, each made again from its own RNGs by a resumed
            # loader (review 74: main_rng was set to before the first of them, so a loop's own
            # draws since were lost, and a resumed epoch left at once left every later draw
            # behind), and those a resumed epoch has yet to make again.
            "rewound_rngs": (
                last_logged(self._rngs_before, behind) if behind else []
            ) + [r if type(r) is bytes else r[0] for r in self._rewound],
        }

    def rewindable(self, batches: int) -> None:
        """Keep what the last consumed batches changed (at least ``batches``), so that
        ``state_dict()`` can be taken as of before them (a ``DevicePrefetcher`` holds up to
        that many ahead); from now on, every epoch. Never less than asked before."""
        self._rewind_keep = keep = max(self._rewind_keep, 64, 2 * batches)
        self._dispatch.consumer_holds = max(self._dispatch.consumer_holds, batches)
        self._progress.undo = deque(self._progress.undo or (), maxlen=keep)
        self._at.log = deque(self._at.log or (), maxlen=keep)
        self._rngs_before = deque(self._rngs_before or (), maxlen=keep)

    def _copies_done(self, box: list[Any]) -> None:
        """A ``DevicePrefetcher`` whose source is this iterator lets go of the batch in ``box``
        (its only element, emptied here), whose copies to the GPU have completed: the slots of
        those of its views that nothing else holds go back without waiting on the copy fence
        (``Leases.let_go``)."""
        self._leases.let_go(box)
        box.clear()

    def _batches_taken(self) -> int:
        """Batches of the epoch taken so far, yielded or raised (an error that took none, a
        timeout or the cap's, leaves it): a DevicePrefetcher tells the two kinds apart."""
        return self._at.count
