"""The multi-process iterator: wires sampler -> dispatch -> workers -> reorder -> lease.

One instance per ``iter(loader)`` (or one for the loader's life with ``persistent_workers``).
Everything runs in the caller's thread: there is no background thread in the main process. Each
``__next__`` tops up the tasks in flight, then reads worker answers until the next batch in
sampler order (or any batch, with ``in_order=False``) is ready, and lends it.

Invariants:
- Tasks sent and not yet yielded ``<= prefetch_factor * num_workers`` (torch's bound, and the
  same number of sampler indices drawn ahead as torch). A task takes a free slot when sent; if
  none is free it goes without one and is offered the next slot to free up, before its worker
  reaches it if possible. A worker that reaches a task without a slot (or with too small a slot)
  asks for one (NEED_SLOT) and waits for the GRANT.
- The arena grows by another slab of a size class only when every worker with work is waiting
  for a slot, i.e. the user holds every other slot; at its cap that is ArenaExhaustedError. So
  in steady state the slots in use are the batch the user holds, the one being handed over and
  the tasks in flight.
- Batch ``i`` of an epoch goes to the ``i``-th live worker in round-robin order, as in torch, so
  worker-side randomness gives the same batches as torch.
- A slot is released exactly once: when the user's last view dies, when its task fails or is
  skipped, when its answer belongs to an abandoned epoch, or when its worker dies.
- Base seed and sampler iterator come from torch's ``_BaseDataLoaderIter``, drawn at the same
  moments as torch, so the main process's RNG state afterwards is torch's.
"""

from __future__ import annotations

import functools
import gc
import os
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch

from arena import Arena, ArenaCapacityError, ArenaExhaustedError, SlotRef
from shmloader import protocol as P
from shmloader._torch_compat import (
    IterDataPipe,
    MapDataPipe,
    _BaseDataLoaderIter,
    _sharding_worker_init_fn,
    profiler_enabled,
)
from shmloader.books import Books
from shmloader.collate import slot_default_collate
from shmloader.host import ArenaHost
from shmloader.reorder import TaskInfo
from shmloader.supervisor import Supervisor, WorkerDeath
from shmloader.worker import WorkerConfig

if TYPE_CHECKING:
    from shmloader.loader import DataLoader

WAIT_SLICE_S = 5.0  # longest single wait when no timeout is set (deaths still wake it at once)

Answer = P.Ready | P.Failed


class _Raise:
    """An error of the main process's own for one task (a batch that can never fit the arena),
    raised at that batch's turn like a worker's error."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def reraise(self) -> None:
        raise self.exc


def _teardown(sup: Supervisor, books: Books[Answer], arena: Arena) -> None:
    try:
        sup.shutdown()
    finally:
        books.release_all(arena)  # no worker writes any more


class ShmDataLoaderIter(_BaseDataLoaderIter):
    """Iterates over a DataLoader with worker processes writing into a shared-memory arena."""

    def __init__(
        self, loader: DataLoader[Any], host_for: Callable[[ShmDataLoaderIter], ArenaHost]
    ) -> None:
        super().__init__(loader)
        self._prefetch_factor: int = loader.prefetch_factor or 2
        self._in_order: bool = loader.in_order
        nw: int = self._num_workers
        ctx = loader.multiprocessing_context or torch.multiprocessing.get_context()
        init_fn = loader.worker_init_fn
        if isinstance(self._dataset, IterDataPipe | MapDataPipe):
            init_fn = functools.partial(
                _sharding_worker_init_fn, init_fn, self._world_size, self._rank
            )
        collate_fn = self._collate_fn
        if collate_fn is torch.utils.data.default_collate:
            collate_fn = slot_default_collate
        self._host = host_for(self)
        self._arena = self._host.arena
        self._pinner = self._host.pinner
        self._leases = self._host.leases
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
                main_pid=os.getpid(),
                shared_seed=self._shared_seed,
            )
            for i in range(nw)
        ]
        self._sup = Supervisor(ctx, configs)
        self._books: Books[Answer] = Books()
        # Dropped, exhausted or failed: stop the workers, then give back every slot in flight.
        self._finalizer = weakref.finalize(self, _teardown, self._sup, self._books, self._arena)
        self._host.worker_pids = tuple(self._sup.pids)
        if self._host.export is not None:
            self._host.export.write({"kind": "workers", "pids": list(self._sup.pids)})
        self._epoch = 0
        self._known_slabs: set[int] = set()
        self.failure: str | None = None
        self._reset(loader, first_iter=True)

    # -- epochs ---------------------------------------------------------------------------------

    def _reset(self, loader: DataLoader[Any], first_iter: bool = False) -> None:
        super()._reset(loader, first_iter)
        if self.failure is not None:
            raise RuntimeError(f"this DataLoader iterator is unusable: {self.failure}")
        if not first_iter:
            self._abandon_epoch()
            self._epoch += 1
            for wid in range(self._num_workers):
                self._sup.send(wid, P.Resume(self._epoch, self._shared_seed))
            self._books.new_epoch()
        self._sampler_done = False
        self._status = [True] * self._num_workers
        self._num_tasks = [0] * self._num_workers
        self._next_worker = 0
        self._fill()

    def _abandon_epoch(self) -> None:
        """Release what the old epoch holds; tasks still being written become orphans, released
        when their answer arrives (a worker never writes a slot after answering)."""
        waiting = {seq for _, seq, _ in self._books.pending}
        for info in self._books.arrived:
            for r in (info.ref, info.spare):
                if r is not None:
                    self._arena.release(r)
        for info in self._books.tasks:
            refs = [r for r in (info.ref, info.spare) if r is not None]
            busy = info.answer is None and self._status[info.worker_id] and info.seq not in waiting
            if busy:
                self._books.orphans[(self._epoch, info.seq)] = (info.worker_id, refs)
            else:
                for r in refs:
                    self._arena.release(r)
        self._books.pending.clear()

    # -- dispatch -------------------------------------------------------------------------------

    @property
    def _max_tasks(self) -> int:
        return self._prefetch_factor * self._num_workers

    def _pick_worker(self) -> int | None:
        """torch's choice: the next live worker in round-robin order (balanced if not in_order)."""
        n = self._num_workers
        for _ in range(n):
            wid = self._next_worker
            self._next_worker = (wid + 1) % n
            if self._status[wid] and (
                self._in_order or self._num_tasks[wid] < self._max_tasks // sum(self._status)
            ):
                return wid
        return None

    def _fill(self) -> None:
        # Bound: tasks sent and not yet handed to the user (torch sends one task per yielded
        # batch after its initial prefetch_factor * num_workers, which keeps the same bound).
        books = self._books
        while len(books.tasks) + len(books.arrived) < self._max_tasks and not self._sampler_done:
            if not self._put_task():
                return

    def _put_task(self) -> bool:
        # A free slot goes with the task; with none free the task still goes (torch's prefetch),
        # and its slot is offered as soon as one frees up (_offer_slots).
        ref = self._acquire(self._host.largest, add_slab=False) if self._host.largest else None
        try:
            index = self._next_index()  # type: ignore[no-untyped-call]
        except StopIteration:
            self._sampler_done = True
            if ref is not None:
                self._arena.release(ref)
            return False
        wid = self._pick_worker()
        if wid is None:
            if ref is not None:
                self._arena.release(ref)
            return False
        info = self._books.tasks.add(wid, ref)
        self._num_tasks[wid] += 1
        self._sup.send(wid, P.Task(info.seq, self._epoch, ref, index))
        if ref is None and self._host.largest:
            self._books.slotless.append(info.seq)
        return True

    def _offer_slots(self) -> None:
        """Give free slots to tasks sent without one, oldest first, before their worker asks."""
        while self._books.slotless:
            info = self._books.tasks.get(self._books.slotless[0])
            if info is None or info.ref is not None or info.answer is not None:
                self._books.slotless.popleft()
                continue
            ref = self._acquire(self._host.largest, add_slab=False)
            if ref is None:
                return
            self._books.slotless.popleft()
            info.ref = ref
            self._sup.send(info.worker_id, P.Grant(info.seq, self._epoch, ref))

    def _acquire(self, nbytes: int, add_slab: bool = True) -> SlotRef | None:
        ref = self._arena.acquire(nbytes, add_slab=add_slab)
        if ref is not None and ref.slab_id not in self._known_slabs:
            self._known_slabs.add(ref.slab_id)
            spec = self._arena.slab(ref.slab_id).spec
            self._pinner.register(self._arena.slab(ref.slab_id))
            for wid in range(self._num_workers):
                if self._sup.procs[wid].exitcode is None:
                    self._sup.send(wid, P.Attach(spec))
        return ref

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
        while True:
            self._fill()
            self._offer_slots()  # slots the user released since the last call
            self._retry_grants()
            info = self._books.tasks.next_in_order(lambda w: self._status[w])
            for skipped in self._books.tasks.skipped():
                for r in (skipped.ref, skipped.spare):
                    if r is not None:
                        self._arena.release(r)
            if info is not None and info.answer is not None:
                return self._process(self._books.tasks.take_next())
            if self._books.arrived:
                return self._process(self._books.arrived.popleft())
            if info is None:
                if not self._persistent_workers:
                    self._finalizer()
                raise StopIteration
            self._receive()

    def _receive(self) -> None:
        """Wait for worker frames and handle every one of them."""
        deadline = time.monotonic() + self._timeout if self._timeout > 0 else None
        while True:
            self._offer_slots()
            self._retry_grants()
            if self._blocked():
                self._unblock()
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
        if msg.epoch != self._epoch:
            self._handle_orphan(msg)
            return
        info = self._books.tasks.get(msg.seq)
        if info is None or isinstance(msg, P.Dropped):
            raise RuntimeError(
                f"unexpected {type(msg).__name__} for task {msg.seq} from worker {wid}"
            )
        if isinstance(msg, P.NeedSlot):
            if info.ref is not None and msg.nbytes <= self._arena.slot_size(info.ref):
                return  # it asked while the slot offered to it was on its way: that one fits
            if info.ref is None and msg.seq in self._books.slotless:
                self._books.slotless.remove(msg.seq)  # served by the grant it asked for
            self._books.pending.append((wid, msg.seq, msg.nbytes))
            self._retry_grants()
            return
        if isinstance(msg, P.Exhausted):
            self._books.tasks.pop(msg.seq)
            for r in (info.ref, info.spare):
                if r is not None:
                    self._arena.release(r)
            self._status[wid] = False
            if not self._persistent_workers:
                self._sup.retire(wid)
            return
        if isinstance(msg, P.Ready):
            if msg.desc.ref != info.ref:
                raise RuntimeError(
                    f"worker {wid} answered task {msg.seq} in slot {msg.desc.ref}, "
                    f"but the task was given {info.ref}"
                )
            self._arena.mark_ready(msg.desc.ref)
            if info.spare is not None:
                self._arena.release(info.spare)
                info.spare = None
            self._host.largest = max(self._host.largest, msg.desc.end)
        self._answer(info, msg)

    def _answer(self, info: TaskInfo[Answer], msg: Answer) -> None:
        info.answer = msg
        if not self._in_order and info.seq != self._books.tasks.rcvd:
            # in_order=False: yielded as it came
            self._books.arrived.append(self._books.tasks.pop(info.seq))

    def _handle_orphan(self, msg: P.ToMain) -> None:
        """An answer to a task of an abandoned epoch: its slots go back (any kind of answer
        means the worker is done with them)."""
        wid, refs = self._books.orphans.pop((msg.epoch, msg.seq), (msg.worker_id, []))
        if isinstance(msg, P.Exhausted):
            # The replica ended: the worker ignores its later tasks of that epoch.
            orphans = self._books.orphans
            for key in [k for k, (w, _) in orphans.items() if k[0] == msg.epoch and w == wid]:
                refs += orphans.pop(key)[1]
        for r in refs:
            self._arena.release(r)

    def _retry_grants(self, add_slab: bool = False) -> None:
        """Grant the slots workers asked for, oldest first. A new size class is always created;
        another slab of an existing class only with ``add_slab`` (when nothing else can move)."""
        still: list[tuple[int, int, int]] = []
        for wid, seq, nbytes in self._books.pending:
            info = self._books.tasks.get(seq)
            if info is None:
                continue
            grow = add_slab or not self._arena.has_class_for(nbytes)
            try:
                ref = self._acquire(nbytes, add_slab=grow) if not still or grow else None
            except ArenaCapacityError as e:  # this batch can never fit: its turn raises
                self._sup.send(wid, P.Deny(seq, self._epoch))
                self._answer(info, P.Failed(seq, self._epoch, wid, _Raise(e)))
                continue
            if ref is None:
                still.append((wid, seq, nbytes))
                continue
            add_slab = False  # one new slab per call is enough to move again
            self._host.largest = max(self._host.largest, nbytes)
            if info.ref is not None:
                info.spare = info.ref  # too small: released when the answer arrives
            info.ref = ref
            self._sup.send(wid, P.Grant(seq, self._epoch, ref))
        self._books.pending = still

    def _blocked(self) -> bool:
        """What the user needs next cannot move without another slot: in sampler order, the
        next batch's task waits for a grant; in any order, every worker with work does. No slot
        comes back while the user holds all the others."""
        books = self._books
        if not books.pending:
            return False
        waiting = {seq for _, seq, _ in books.pending}
        unanswered = [i for i in books.tasks if i.answer is None and self._status[i.worker_id]]
        if self._in_order and unanswered and min(i.seq for i in unanswered) in waiting:
            return True
        return {i.worker_id for i in unanswered} <= {wid for wid, _, _ in books.pending}

    def _unblock(self) -> None:
        """Add a slab (within the cap); failing that, collect garbage (views caught in
        reference cycles); failing that, raise."""
        self._retry_grants(add_slab=True)
        if not self._blocked():
            return
        gc.collect()
        self._retry_grants()
        if not self._blocked():
            return
        st = self._arena.stats()
        raise ArenaExhaustedError(
            f"every arena slot is in use: the user holds {self._leases.held} batches "
            f"({st.bytes_in_use:,} bytes) and the arena is at its cap of {st.max_bytes:,} bytes "
            f"({st.slots_total} slots). Drop references to old batches, copy what you keep with "
            ".clone(), release them early with shmloader.release(batch, loader), or raise "
            "arena_max_bytes."
        )

    def _process(self, info: TaskInfo[Answer]) -> Any:
        self._num_tasks[info.worker_id] -= 1
        self._fill()
        answer = info.answer
        if isinstance(answer, P.Failed):
            for r in (info.ref, info.spare):
                if r is not None:
                    self._arena.release(r)
            answer.error.reraise()
        batch = self._leases.open(cast(P.Ready, answer).desc)
        if self._host.export is not None:
            self._host.export.tick(self._host.snapshot)
        return self._pinner.pin(batch)

    def _fail(self, deaths: list[WorkerDeath]) -> None:
        first = deaths[0]
        detail = (
            f"(shmloader worker {first.worker_id} of {self._num_workers}; the iterator has been "
            "shut down and its slots reclaimed; iterating the DataLoader again starts fresh "
            "workers)"
        )
        self.failure = first.describe() + detail
        self._sup.kill()  # the iterator is dead: no graceful wait for busy survivors
        self._finalizer()
        raise RuntimeError(self.failure)

    def _shutdown_workers(self) -> None:
        self._finalizer()
