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
  :mod:`shmloader.lease`'s; starting the workers is :mod:`shmloader.startup`'s and the resume
  records are :mod:`shmloader.progress`'s; this module only wires them and turns answers into
  batches or errors.
- Every slot that reaches the main process leaves it: yielded (then released with its lease),
  released when its batch fails to rebuild or the sampler raises while it is handed out, or
  released at teardown (a finished, dropped or failed iterator stops its workers, then queues
  every slot it holds for release).
- A dead worker fails the iterator within one wait: pipes and process sentinels are watched
  together. An iterator inherited through ``fork()`` refuses to yield: its slots are the parent's.
- One thread at a time (:mod:`shmloader.onethread`): ``__next__``, ``iter()`` of a persistent
  iterator and ``state_dict()`` take the iterator's lock, so a checkpoint thread may call
  ``state_dict()`` while another iterates.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from shmloader import protocol as P
from shmloader._torch_compat import _BaseDataLoaderIter, profiler_enabled
from shmloader.dispatch import Dispatch
from shmloader.host import ArenaHost
from shmloader.interrupts import DESIGNED, touched_the_books, unusable_after
from shmloader.lease import Leases
from shmloader.onethread import one_thread
from shmloader.progress import SamplerProgress
from shmloader.reorder import TaskInfo
from shmloader.sampling import fast_batches
from shmloader.startup import start_workers
from shmloader.state import EpochStart, untouched_rngs
from shmloader.supervisor import Supervisor, WorkerDeath

# A tuple: `P.Ready | P.Failed` would build a union per frame. DROPPED answers only a task the
# main process denied (the worker acknowledges the DENY, its RNG snapshot published).
_ANSWERS = (P.Ready, P.Failed, P.Dropped)
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
        self._plan = plan
        self._ended = False
        self._lock = threading.RLock()  # one thread at a time in the iterator (see invariants)
        self._host = host = host_for(self._pin_memory, self._pin_memory_device)
        self._leases = host.leases
        self._pid = os.getpid()
        self._sup, self._progress = start_workers(self, loader, plan, self._pid)
        host.rng_rings.add(self._progress.ring)
        self._workers = self._sup.procs  # torch's name: pid, exitcode, is_alive(), join()
        max_tasks = (loader.prefetch_factor or 2) * nw
        self._dispatch = Dispatch(host, self._sup, nw, max_tasks, loader.in_order)
        # Dropped, exhausted or failed: stop the workers, then give back every slot in flight.
        self._finalizer = weakref.finalize(
            self, _teardown, self._pid, self._sup, self._dispatch, self._leases
        )
        host.worker_pids = tuple(self._sup.pids)
        if host.export is not None:
            host.export.write({"kind": "workers", "pids": list(self._sup.pids)})
        self.failure: str | None = None
        self._safe = False  # whether an interruption of next() now leaves nothing half done
        self._reset(loader, first_iter=True)

    def _busy_here(self) -> bool:
        """Whether this thread holds the lease or arena lock (taken only after this one's)."""
        return self._leases.locked_here()

    @property
    def here(self) -> bool:
        """Whether this iterator belongs to the calling process (not inherited by fork)."""
        return self._pid == os.getpid()

    # -- epochs ---------------------------------------------------------------------------------

    @one_thread("iter()")
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
            self._num_yielded = self._consumed = skip  # consumed: yielded, or raised
            d.start_at(skip, plan.get("replicas") if plan else None)
            self._at = SamplerProgress(skip, plan["yielded_extra"] if plan else ())
            for _ in range(d.max_tasks):  # torch primes the prefetch loop with this many attempts
                self._try_put()

    def _try_put(self) -> None:
        self._safe = True  # the sampler (user code): what it raises drops one index, as in torch
        try:
            index = self._at.draw(self._next_index)
        except StopIteration:
            self._safe = False
            return
        self._safe = False
        d = self._dispatch
        sent = d.tasks.sent
        d.put(index)
        if not d.in_order and d.tasks.sent != sent:  # the sampler position each task came from
            self._at.of_seq.append(self._at.next - 1)

    # -- resume state ---------------------------------------------------------------------------

    @one_thread("state_dict()")
    def resume_state(self) -> dict[str, Any]:
        """This iterator's part of ``DataLoader.state_dict()`` (see :mod:`shmloader.state`)."""
        if self.failure is not None:
            raise RuntimeError(f"this DataLoader iterator is unusable: {self.failure}")
        d = self._dispatch
        try:
            while d.orphans:  # an abandoned epoch's tasks: the RNG state needed is after them
                self._receive()
        except BaseException as e:
            self._left(e)
            raise
        in_epoch = not self._ended
        return {
            "epoch": self.epoch_no if in_epoch else self.epoch_no + 1,
            "in_epoch": in_epoch,
            "yielded": (self._consumed if d.in_order else self._at.prefix) if in_epoch else 0,
            "yielded_extra": sorted(self._at.done) if in_epoch and not d.in_order else [],
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

    @one_thread("next()")
    def _next_data(self) -> Any:
        try:
            return self._next_batch()
        except BaseException as e:
            self._left(e)
            raise

    def _left(self, e: BaseException) -> None:
        """``e`` is leaving ``next()`` or ``state_dict()``: from a safe place, or as one of our
        own errors, it changes nothing; else the iterator is unusable (shmloader.interrupts)."""
        safe = self._safe or self._sup.polling or isinstance(e, DESIGNED)
        self._safe = self._sup.polling = False
        if not safe and self.failure is None:
            self.failure = unusable_after(e)
            if touched_the_books(e):
                self._host.retired = True  # the arena's books may be half-changed too
            self._sup.kill()
            self._shutdown_workers()

    def _next_batch(self) -> Any:
        self._safe = False  # from here on an interruption may leave a change half done
        if self.failure is not None:
            raise RuntimeError(f"this DataLoader iterator is unusable: {self.failure}")
        if self._pid != os.getpid():  # inherited through fork(): workers and slots are not ours
            self._safe = True
            raise RuntimeError(
                f"this DataLoader iterator belongs to process {self._pid}, not to this one "
                f"({os.getpid()}), which inherited it through fork(); call iter(loader) here "
                "to iterate with this process's own workers and arena"
            )
        d, leases = self._dispatch, self._leases
        if (leases.dead or leases.fence) and leases.drain():
            d.offer()  # slots of batches whose views died (and whose copies ended) since then
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
        """Wait for worker frames (unless some read before an interruption are still in the
        inbox) and handle every one of them. Safe to interrupt only in the wait and between
        frames (``_safe``); it returns with ``_safe`` false, as it found it."""
        self._safe = False
        d, inbox = self._dispatch, self._sup.inbox
        deaths: list[WorkerDeath] = []
        deadline = time.monotonic() + self._timeout if self._timeout > 0 else None
        while not inbox and not deaths:
            d.offer()  # slots freed by answers (spares, failures) since the last wait
            blocked = d.blocked_on(d.status.__getitem__)
            if blocked is not None:
                d.unblock(blocked, deadline)
            left = WAIT_SLICE_S if deadline is None else deadline - time.monotonic()
            if left <= 0:
                why = d.gpu_wait(self._timeout)  # empty unless copy-fenced slots held it up
                self._safe = True
                raise RuntimeError(f"DataLoader timed out after {self._timeout} seconds{why}")
            deaths = self._sup.wait(left)
        while inbox:  # one frame at a time: an interruption leaves the rest for the next call
            self._safe = False
            wid, frame = inbox.popleft()
            self._handle(wid, P.decode(frame))  # type: ignore[arg-type]
        self._safe = False
        if deaths:
            self._fail(deaths)

    def _handle(self, wid: int, msg: P.ToMain) -> None:
        """Record one frame; once it is recorded, an interruption leaves nothing half done."""
        d = self._dispatch
        if isinstance(msg, P.ReplicaState):
            self._progress.replica_state(msg, d.epoch)
        elif msg.epoch != d.epoch:
            d.orphan_answered(msg)
            if not isinstance(msg, P.NeedSlot):
                self._progress.orphan_answered(wid, msg.epoch, msg.seq)
        else:
            info = d.tasks.get(msg.seq)
            if info is None or (isinstance(msg, P.Dropped) and msg.seq not in d.denied):
                raise RuntimeError(
                    f"unexpected {type(msg).__name__} for task {msg.seq} from worker {wid}"
                )
            if isinstance(msg, _ANSWERS):
                d.answer(info, msg)
            elif isinstance(msg, P.NeedSlot):
                d.need(info, msg)
            else:  # Exhausted: torch marks the worker unavailable, then tries to send one more
                d.retire(wid, info)
                if not self._persistent_workers:
                    self._sup.retire(wid)
                self._try_put()
        self._safe = True  # between frames (shmloader.interrupts)

    def _process(self, info: TaskInfo[Any]) -> Any:
        d = self._dispatch
        self._consumed += 1  # taken from the table: yielded or raised, never produced again
        try:
            self._progress.consumed(info.worker_id, d.epoch, info.seq)
            if not d.in_order:
                self._at.consumed(info.seq)
            d.num_tasks[info.worker_id] -= 1
            self._try_put()  # torch draws the next index before it hands this batch out
        except BaseException:  # the sampler raised (or Ctrl-C): torch drops the batch
            d.release(info.slots())
            raise
        answer = info.answer
        if isinstance(answer, P.Failed):
            d.release(info.slots())
            self._safe = True
            answer.error.reraise()
        self._safe = True  # an interruption from here on drops this batch, and nothing else
        batch = self._leases.open(answer)  # type: ignore[arg-type]  # releases the slot if the batch cannot be rebuilt
        host = self._host
        if host.export is not None:
            host.export.tick(host.snapshot)
        return host.pinner.pin(batch)

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
