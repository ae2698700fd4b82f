"""The multi-process iterator: one batch's life in the main process, start to end.

    sampler --_try_put--> Dispatch.put --TASK--> worker --READY--> _handle --> Dispatch.answer
        --> _next_data (sampler order) --> _process --> Leases.open (views) --> pin --> user

One instance per ``iter(loader)`` (or one for the loader's life with ``persistent_workers``).
Everything runs in the caller's thread: there is no background thread in the main process. Each
``__next__`` returns the slots of batches whose views died (a safe point), then reads worker
answers until the next batch in sampler order (or any batch, with ``in_order=False``) is here,
and lends it.

Invariants:
- Base seed and sampler iterator come from torch's ``_BaseDataLoaderIter``, drawn at the same
  moments as torch, so the main process's RNG state afterwards is torch's; torch's stock samplers
  take the equivalent fast path of :mod:`shmloader.sampling`.
- Task sending, worker choice and slot binding are :mod:`shmloader.dispatch`'s; leases are
  :mod:`shmloader.lease`'s; this module only wires them and turns answers into batches or errors.
- Every slot that reaches the main process leaves it: yielded (then released with its lease),
  released when its batch fails to rebuild, or released at teardown (a finished, dropped or
  failed iterator stops its workers, then queues every slot it holds for release).
- A dead worker fails the iterator within one wait: pipes and process sentinels are watched
  together.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from arena import Backend
from shmloader import protocol as P
from shmloader._torch_compat import (
    ITERABLE_KIND,
    IterDataPipe,
    MapDataPipe,
    _BaseDataLoaderIter,
    _sharding_worker_init_fn,
    profiler_enabled,
)
from shmloader.collate import slot_default_collate
from shmloader.dispatch import Dispatch
from shmloader.host import ArenaHost
from shmloader.lease import Leases
from shmloader.progress import WorkerProgress
from shmloader.reorder import TaskInfo
from shmloader.rngstate import RngRing
from shmloader.sampling import fast_batches
from shmloader.state import EpochStart, untouched_rngs
from shmloader.supervisor import Supervisor, WorkerDeath
from shmloader.worker import WorkerConfig

WAIT_SLICE_S = 5.0  # longest single wait when no timeout is set (deaths still wake it at once)

HostFor = Callable[[bool, str | None], ArenaHost]  # (pin_memory, pin_memory_device) -> host


def _teardown(pid: int, sup: Supervisor, dispatch: Dispatch, leases: Leases) -> None:
    """Stop the workers, then queue every slot the iterator holds for release. May run inside
    the garbage collector: it takes no lock and leaves the releases to the next safe point."""
    if os.getpid() != pid:
        return  # inherited through fork(): the workers and slots are the parent's
    try:
        sup.shutdown()
    finally:
        leases.dead.extend(dispatch.all_slots())


class ShmDataLoaderIter(_BaseDataLoaderIter):
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
        pf = loader.prefetch_factor or 2
        # memfd: a few pages per worker that never count against /dev/shm or the arena's cap
        self._rng_ring = RngRing.create(nw, pf + 4, Backend.MEMFD)
        weakref.finalize(self, self._rng_ring.close)
        mid_epoch = resumed and plan["in_epoch"]  # type: ignore[index]
        iterable = self._dataset_kind == ITERABLE_KIND
        self._progress = WorkerProgress(
            nw,
            self._rng_ring,
            iterable,
            rng_carry=list(plan["workers"]) if resumed and plan["workers"] else None,  # type: ignore[index]
            replicas=plan.get("replicas") if mid_epoch else None,  # type: ignore[union-attr]
        )
        self._plan = plan
        self._ended = False
        ctx = loader.multiprocessing_context or torch.multiprocessing.get_context()
        init_fn = loader.worker_init_fn
        if isinstance(self._dataset, IterDataPipe | MapDataPipe):
            init_fn = functools.partial(
                _sharding_worker_init_fn, init_fn, self._world_size, self._rank
            )
        collate_fn = self._collate_fn
        if collate_fn is torch.utils.data.default_collate:
            collate_fn = slot_default_collate
        self._host = host = host_for(self._pin_memory, self._pin_memory_device)
        self._leases = host.leases
        self._pid = os.getpid()
        # An IterableDataset's sampler is torch's infinite constant one: any draw is the index
        # of one batch ([None] * batch_size, or None), what a resumed replica fast-forwards with.
        one_index = next(iter(self._index_sampler)) if iterable and mid_epoch else None
        configs = [
            WorkerConfig(
                worker_id=i,
                num_workers=nw,
                dataset_kind=self._dataset_kind,
                dataset=self._dataset,
                auto_collation=self._auto_collation,
                collate_fn=collate_fn,
                drop_last=self._drop_last,
                base_seed=int(self._base_seed),
                init_fn=init_fn,
                main_pid=self._pid,
                shared_seed=self._shared_seed,
                rng_ring=self._rng_ring.slab.spec,
                rng_depth=self._rng_ring.depth,
                rng_restore=self._progress.rng_carry[i],
                replica_restore=self._progress.restore_for(i, one_index),
            )
            for i in range(nw)
        ]
        self._sup = Supervisor(ctx, configs)
        self._workers = self._sup.procs  # torch's name: pid, exitcode, is_alive(), join()
        max_tasks = pf * nw
        self._dispatch = Dispatch(host, self._sup, nw, max_tasks, loader.in_order)
        # Dropped, exhausted or failed: stop the workers, then give back every slot in flight.
        self._finalizer = weakref.finalize(
            self, _teardown, self._pid, self._sup, self._dispatch, self._leases
        )
        host.worker_pids = tuple(self._sup.pids)
        if host.export is not None:
            host.export.write({"kind": "workers", "pids": list(self._sup.pids)})
        self.failure: str | None = None
        self._reset(loader, first_iter=True)

    @property
    def here(self) -> bool:
        """Whether this iterator belongs to the calling process (not inherited by fork)."""
        return self._pid == os.getpid()

    # -- epochs ---------------------------------------------------------------------------------

    def _reset(self, loader: torch.utils.data.DataLoader[Any], first_iter: bool = False) -> None:
        plan, self._plan = self._plan, None
        if plan is None or not plan["in_epoch"]:
            plan = None
            self.epoch_start = EpochStart.capture(loader)
        else:
            self.epoch_start = EpochStart.from_dict(plan["epoch_start"])
        self.epoch_no: int = loader._epochs_started  # type: ignore[attr-defined]
        loader._epochs_started += 1  # type: ignore[attr-defined]
        self._ended = False
        # A resumed epoch replays its sampler draws from where they started, skips the batches
        # already consumed without fetching them, then primes as torch does.
        with self.epoch_start.replay(loader) if plan else contextlib.nullcontext():
            super()._reset(loader, first_iter)
            fast = fast_batches(self._index_sampler)
            if fast is not None:
                self._sampler_iter = fast
            if self.failure is not None:
                raise RuntimeError(f"this DataLoader iterator is unusable: {self.failure}")
            d = self._dispatch
            if plan is None:
                self._progress.new_epoch()
            if not first_iter:
                d.new_epoch()
                for wid in range(self._num_workers):
                    self._sup.send(wid, P.Resume(d.epoch, self._shared_seed))
            skip = plan["yielded"] if plan else 0
            for _ in range(skip):
                self._next_index()  # type: ignore[no-untyped-call]
            self._num_yielded = skip
            d.start_at(skip, plan.get("replicas") if plan else None)
            self._pos = skip  # sampler position of the next index drawn
            self._skip: set[int] = set(plan["yielded_extra"]) if plan else set()
            self._prefix = skip  # in_order=False: positions below it are all consumed
            self._done: set[int] = set(self._skip)  # ... and these past it
            self._positions: list[int] = []  # in_order=False: seq -> sampler position
            for _ in range(d.max_tasks):  # torch primes the prefetch loop with this many attempts
                self._try_put()

    def _try_put(self) -> None:
        try:
            index = self._next_index()  # type: ignore[no-untyped-call]
            while self._skip and self._pos in self._skip:  # consumed before a resume
                self._skip.discard(self._pos)
                self._pos += 1
                index = self._next_index()  # type: ignore[no-untyped-call]
        except StopIteration:
            return
        self._pos += 1
        d = self._dispatch
        if d.in_order:
            d.put(index)
            return
        sent = d.tasks.sent
        d.put(index)
        if d.tasks.sent != sent:
            self._positions.append(self._pos - 1)

    # -- resume state ---------------------------------------------------------------------------

    def resume_state(self) -> dict[str, Any]:
        """This iterator's part of ``DataLoader.state_dict()`` (see :mod:`shmloader.state`)."""
        if self.failure is not None:
            raise RuntimeError(f"this DataLoader iterator is unusable: {self.failure}")
        d = self._dispatch
        while d.orphans:  # an abandoned epoch's tasks: the RNG state needed is after them
            self._receive()
        in_epoch = not self._ended
        return {
            "epoch": self.epoch_no if in_epoch else self.epoch_no + 1,
            "in_epoch": in_epoch,
            "yielded": (self._num_yielded if d.in_order else self._prefix) if in_epoch else 0,
            "yielded_extra": sorted(self._done) if in_epoch and not d.in_order else [],
            "base_seed": int(self._base_seed),
            "epoch_start": self.epoch_start.as_dict() if in_epoch else None,
            "workers": self._progress.rng_states(),
            "replicas": self._progress.replica_record(*d.assignment()) if in_epoch else None,
        }

    # -- receiving ------------------------------------------------------------------------------

    def __next__(self) -> Any:
        # torch's __next__ wraps every batch in a profiler range, which costs about 10 us even
        # when no profiler runs. Use it whenever it can matter (a profiler is on, the sampler
        # needs a reset, an IterableDataset length warning may be due); else skip the range.
        if (
            profiler_enabled()
            or self._sampler_iter is None
            or self._IterableDataset_len_called is not None
        ):
            return super().__next__()
        data = self._next_data()
        self._num_yielded += 1
        return data

    def _next_data(self) -> Any:
        if self.failure is not None:
            raise RuntimeError(f"this DataLoader iterator is unusable: {self.failure}")
        d = self._dispatch
        if self._leases.dead and self._leases.drain():
            d.offer()  # slots of batches whose views died since the last call
        while True:
            info = d.next_answer(d.status.__getitem__)
            if info is not None:
                return self._process(info)
            if not d.pending(d.status.__getitem__):
                self._ended = True
                if not self._persistent_workers:
                    self._finalizer()
                    self._leases.drain()
                raise StopIteration
            self._receive()

    def _receive(self) -> None:
        """Wait for worker frames and handle every one of them."""
        d = self._dispatch
        deadline = time.monotonic() + self._timeout if self._timeout > 0 else None
        while True:
            d.offer()  # slots freed by answers (spares, failures) since the last wait
            blocked = d.blocked_on(d.status.__getitem__)
            if blocked is not None:
                d.unblock(blocked)
            left = WAIT_SLICE_S if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"DataLoader timed out after {self._timeout} seconds")
            frames, deaths = self._sup.wait(left)
            for wid, frame in frames:
                self._handle(wid, P.decode(frame))  # type: ignore[arg-type]
            if deaths:
                self._fail(deaths)
            if frames:
                return

    def _handle(self, wid: int, msg: P.ToMain) -> None:
        d = self._dispatch
        if isinstance(msg, P.ReplicaState):
            self._progress.replica_state(msg, d.epoch)
            return
        if msg.epoch != d.epoch:
            d.orphan_answered(msg)
            if not isinstance(msg, P.NeedSlot):
                self._progress.orphan_answered(wid, msg.epoch, msg.seq)
            return
        info = d.tasks.get(msg.seq)
        if info is None or isinstance(msg, P.Dropped):
            raise RuntimeError(
                f"unexpected {type(msg).__name__} for task {msg.seq} from worker {wid}"
            )
        if isinstance(msg, P.Ready):
            if msg.ref != info.ref:
                raise RuntimeError(
                    f"worker {wid} answered task {msg.seq} in slot {msg.ref}, "
                    f"but the task was given {info.ref}"
                )
            d.arena.mark_ready(msg.ref)
            d.answer(info, msg)
        elif isinstance(msg, P.Failed):
            d.answer(info, msg)
        elif isinstance(msg, P.NeedSlot):
            d.need(info, msg)
        else:  # Exhausted: torch marks the worker unavailable, then tries to send one more task
            self._exhausted(wid, info)
            self._try_put()

    def _exhausted(self, wid: int, info: TaskInfo[Any]) -> None:
        d = self._dispatch
        d.drop(info.seq)
        d.status[wid] = False
        if not d.in_order:  # its later tasks will never be answered: nothing waits for them
            for later in [i for i in d.tasks if i.worker_id == wid and i.answer is None]:
                d.drop(later.seq)
        if not self._persistent_workers:
            self._sup.retire(wid)

    def _process(self, info: TaskInfo[Any]) -> Any:
        d = self._dispatch
        self._progress.consumed(info.worker_id, d.epoch, info.seq)
        if not d.in_order:
            self._consumed(self._positions[info.seq])
        d.num_tasks[info.worker_id] -= 1
        self._try_put()
        answer = info.answer
        if isinstance(answer, P.Failed):
            d.release(info.slots())
            answer.error.reraise()
        batch = self._leases.open(answer)  # type: ignore[arg-type]  # releases the slot if the batch cannot be rebuilt
        host = self._host
        if host.export is not None:
            host.export.tick(host.snapshot)
        return host.pinner.pin(batch)

    def _consumed(self, pos: int) -> None:
        """in_order=False: record that the batch at sampler position ``pos`` was consumed."""
        if pos != self._prefix:
            self._done.add(pos)
            return
        self._prefix += 1
        while self._prefix in self._done:
            self._done.discard(self._prefix)
            self._prefix += 1

    def _fail(self, deaths: list[WorkerDeath]) -> None:
        first = deaths[0]
        detail = (
            f"(shmloader worker {first.worker_id} of {self._num_workers}; the iterator has been "
            "shut down and its slots reclaimed; iterating the DataLoader again starts fresh "
            "workers)"
        )
        self.failure = first.describe() + detail
        self._sup.kill()  # the iterator is dead: no graceful wait for busy survivors
        self._shutdown_workers()
        raise RuntimeError(self.failure)

    def _shutdown_workers(self) -> None:
        self._finalizer()
        if self.here:
            self._leases.drain()
