"""Dispatch: sampler indices to workers, and arena slots to tasks.

One :class:`Dispatch` per iterator. It sends tasks the way torch's iterator does and binds each
task to a slot of the loader's arena, as late as needed and no later.

Task states (``TaskInfo``; ``seq`` numbers tasks of an epoch in sampler order)::

    decided (torch's moment, torch's worker) --a slot is free--> sent with it --> answered
        |                                          ^                  |            |
        +--none free: unsent --a slot frees up-----+     NEED_SLOT (too small)     v
        +--no batch size known yet: sent without one --> NEED_SLOT --GRANT--> yielded / raised

Invariants:
- Worker choice and timing are torch's: ``prefetch_factor * num_workers`` send attempts when an
  epoch starts, then one per batch yielded (and one per exhausted IterableDataset replica); each
  attempt draws one index and gives it to the next live worker in round-robin order (with
  ``in_order=False``, the next one below its share of tasks), or drops it when there is none.
- A task takes a free slot of the size of the largest of the latest batches
  (:mod:`shmloader.slotsize`); with none free it waits, decided and unsent, and free slots go
  to waiting tasks in sampler order whenever one frees up. So steady state costs one TASK and
  one READY frame per batch, and no round trip; and once batches shrink, their tasks take slots
  of the smaller size (the arena serves them from a snug class, :mod:`arena.allocator`).
- Every NEED_SLOT is answered: GRANT of the task's own slot when the batch fits it, the grant
  already on its way when the worker had not seen it yet, or a bigger slot (GRANT) or DENY. A
  slot too small is freed when the NEED_SLOT arrives (the worker copied the batch out of it).
- The arena grows only for the batch the consumer needs next (in sampler order, or any batch with
  ``in_order=False``) and only when its worker waits for a slot of the size it measured (a task
  whose size is only the latest batches' largest is sent without a slot to be measured first),
  after waiting for the GPU's copies from slots the copy fence holds (:mod:`shmloader.fence`; up
  to the loader's ``timeout``, else without end and with a warning every ``FENCE_WARN_S``) --
  but for a snug slab, which the arena adds for a task far smaller than every free slot while it
  leaves as much room under the cap as it takes (:mod:`arena.allocator`); at the cap, slabs
  whose slots are all free are given back first, then garbage is collected;
  ``ArenaExhaustedError`` only when
  nothing else frees room, with exactly what the user holds. At the cap, free slots in slabs that
  also hold batches are hollowed (their memory goes back; ``arena.Arena.hollow``), and the batch
  needed next takes back room from every batch after it: tasks not yet started (queued behind a
  task their worker waits a slot for) give their slots back (REVOKE); finished later batches are
  copied out of their slots into the main process's memory (*spilled*, counted in ``stats()``);
  and it waits for later batches still being written to finish, then spills them too (a wait
  that lasts ``CAP_WARN_S`` warns, and the timeout's error names it: a slow later sample holds
  the batch needed next up, which torch's loader, without a cap, never does); the
  finished batches of the loader's other live iterators are spilled as well (their batches in
  flight are not waited for: nobody reads their workers' answers meanwhile, so the error counts
  them). So the error comes only when what the user holds (and slots kept for forked workers,
  and another live iterator's batches in flight) leaves no room.
- A slab the arena gives back is detached from the workers of every live iterator that
  attached it (:meth:`_forget_slab`), so no worker keeps memory the arena no longer counts.
- Another iterator's tasks are changed (spilled, or its workers told to detach) only under that
  iterator's lock, taken without waiting: one another thread is inside is left alone (its
  finished batches are not spilled; it detaches the slab itself at its next ``next()`` or
  ``iter()``).
- Every slot taken from the arena is named from that moment (``in_hand``, then its task's
  ``ref``), so an interruption between the two cannot lose it.
- Every slot a task holds is named once (``ref``) and released exactly once: with the batch's
  lease, when it is spilled, when its task fails or is skipped, when its answer belongs to an
  abandoned epoch (``orphans``), when its worker's replica ended before it, or at teardown.
"""

from __future__ import annotations

import gc
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

from arena import ArenaCapacityError, ArenaExhaustedError, SlotRef, userwarn
from arena._layout import page_align
from shmloader import protocol as P
from shmloader.host import ArenaHost
from shmloader.lease import Leases, Spilled
from shmloader.notes import raise_kept
from shmloader.reorder import TaskInfo, TaskTable
from shmloader.supervisor import Supervisor

Answer = P.Ready | P.Failed | P.Dropped | Spilled

FENCE_WARN_S = 30.0  # a wait for the GPU's copies warns each time this passes without an end
CAP_WARN_S = 30.0  # a wait at the cap for later batches being written warns once it lasts this


def fence_stuck(leases: Leases, waited: float) -> str:
    """Why the batch needed next still waits, when the copy fence holds slots."""
    held = leases.fence.held if leases.fence is not None else 0
    return (
        f"the batch needed next has waited {waited:.1f} s for a slot while {held} slots of "
        "page-locked memory wait for the GPU to pass copies queued from them (shmloader.fence); "
        "a busy GPU explains it, and timeout= makes the loader raise instead of waiting"
    )


class Orphan(NamedTuple):
    """A task of an abandoned epoch still with its worker: its slots go back when it answers."""

    worker: int
    slots: list[SlotRef]
    ref: SlotRef | None  # the slot the worker was last given for it


class MainError:
    """An error of the main process's own for one task (a batch that can never fit the arena),
    raised at that batch's turn like a worker's error.

    It keeps the error without the traceback and context it was caught with, and raises a copy
    (:func:`~shmloader.notes.raise_kept`): a traceback holds the frames it passed (the
    dispatch's, and through them the iterator's), and this object is held by the task's answer
    in the dispatch, so keeping or raising the caught error itself made a cycle that kept a
    dropped iterator, its workers and its slabs alive until the garbage collector ran (review
    42: a fresh loader's retry found /dev/shm still full)."""

    def __init__(self, exc: BaseException) -> None:
        exc.__traceback__ = exc.__context__ = exc.__cause__ = None
        self.exc = exc

    def reraise(self) -> None:
        raise_kept(self.exc)


class Dispatch:
    """The tasks of one iterator and the slots bound to them."""

    def __init__(
        self,
        host: ArenaHost,
        sup: Supervisor,
        num_workers: int,
        max_tasks: int,
        in_order: bool,
        lock: threading.RLock,
    ) -> None:
        self.host = host
        self.sizes = host.sizes  # the slot size for tasks not yet measured
        # The iterator's lock (shmloader.onethread): another iterator of the loader changes this
        # one's tasks (spills its batches, detaches a slab) only while it holds it.
        self.lock = lock
        self.arena = host.arena
        self.sup = sup
        self.num_workers = num_workers
        self.max_tasks = max_tasks
        self.in_order = in_order
        self.epoch = 0
        self.tasks: TaskTable[Answer] = TaskTable()
        self.arrived: deque[TaskInfo[Answer]] = deque()  # in_order=False: arrival order
        self.unsent: dict[int, Any] = {}  # seq -> index: decided, waiting for a free slot
        self.wanting: dict[int, int] = {}  # seq -> bytes of a slot a sent task waits for
        self.asked: set[int] = set()  # seqs whose worker sent NEED_SLOT and waits
        # seq -> why, kept without frames: DENY sent, not yet acknowledged (an error kept with
        # its traceback held the iterator's frames, and the iterator's finalizer holds this
        # dispatch: a dropped iterator was never freed, not even by a collection; review 82)
        self.denied: dict[int, MainError] = {}
        # (epoch, seq) -> (worker, slots) of tasks of abandoned epochs not yet answered
        self.orphans: dict[tuple[int, int], Orphan] = {}
        # (seq, worker) of this epoch's EXHAUSTED answers: no batch, yet the worker's RNG moved
        self.exhausted: list[tuple[int, int]] = []
        self.status = [True] * num_workers
        self.num_tasks = [0] * num_workers
        self._next_worker = 0
        self._forced: deque[int] = deque()  # workers of a resumed epoch's first tasks
        self._known_slabs: set[int] = set()  # slabs this iterator's workers were told to attach
        self.detach_later: set[int] = set()  # given back while another thread was inside it
        # The slot taken from the arena and not yet given to its task: an interruption between
        # the two leaves it here, and teardown frees it (all_slots).
        self.in_hand: SlotRef | None = None
        # (seq, since, warned): the batch needed next waits at the cap for later batches being
        # written, to copy them out of their slots once they are finished.
        self.cap_wait: tuple[int, float, bool] | None = None
        # Batches a consumer keeps at once: a DevicePrefetcher's depth + 2 (the iterator's
        # rewindable()); the cap's error counts them among the user's.
        self.consumer_holds = 1
        # The backing store's refusal of the last growth for a size slots already serve.
        self.store_full: str | None = None
        host.dispatches.add(self)

    # -- epochs ---------------------------------------------------------------------------------

    def new_epoch(self) -> list[tuple[int, int]]:
        """Abandon the current epoch: release what it holds; tasks still being written become
        orphans, released when their answer arrives (a worker never writes after answering).
        Returns ``(seq, worker)`` of the tasks answered and never consumed, in order: the
        abandonment consumes them, and their workers' RNGs moved past them."""
        answered = sorted(
            [(i.seq, i.worker_id) for i in [*self.arrived, *self.tasks] if i.answer is not None]
            + self.take_exhausted()
        )
        for seq, index in self.unsent.items():
            # torch's workers fetch every task sent to them, so decided tasks are still sent:
            # the worker fetches them as stale (its RNG use stays torch's) and drops them.
            info = self.tasks.get(seq)
            if info is not None and self.status[info.worker_id]:
                self.sup.send(info.worker_id, P.Task(seq, self.epoch, None, index))
                self.orphans[(self.epoch, seq)] = Orphan(info.worker_id, [], None)
        for info in [*self.arrived, *self.tasks]:
            if info.seq in self.unsent:
                continue
            slots = info.slots()
            # A worker waiting for a slot abandons that task when it reads RESUME.
            if info.answer is None and self.status[info.worker_id] and info.seq not in self.asked:
                self.orphans[(self.epoch, info.seq)] = Orphan(info.worker_id, slots, info.ref)
            else:
                self.release(slots)
        self.epoch += 1
        self.tasks = TaskTable()
        self.arrived = deque()
        self.unsent = {}
        self.wanting = {}
        self.asked = set()
        self.denied = {}
        self.status = [True] * self.num_workers
        self.num_tasks = [0] * self.num_workers
        self._next_worker = 0
        self._forced.clear()
        return answered

    def start_at(self, position: int, replay: dict[str, Any] | None = None) -> None:
        """A resumed epoch's first task is batch ``position`` of the sampler: torch's round robin
        gives it worker ``position % num_workers``, as in the run that was saved. ``replay``
        (IterableDatasets, :mod:`shmloader.progress`): the saved run's workers of its tasks in
        flight, in order, then its round-robin pointer."""
        self._next_worker = position % self.num_workers
        if replay is not None:
            self._forced = deque(replay["assign"])
            self._next_worker = replay["next_worker"]

    def assignment(self, consumed_again: dict[int, int] | None = None) -> tuple[list[int], int]:
        """The workers of the tasks decided and not yet consumed (and of ``consumed_again``,
        ``seq -> worker``: consumed tasks a saved state counts as not), in sampler order, and
        the round-robin pointer after them (what :meth:`start_at` replays)."""
        pending = {i.seq: i.worker_id for i in [*self.tasks, *self.arrived]}
        pending.update(consumed_again or {})
        forced = list(self._forced)  # a replay not finished yet comes after them
        return [pending[s] for s in sorted(pending)] + forced, self._next_worker

    def orphan_answered(self, msg: P.ToMain) -> None:
        """An answer to a task of an abandoned epoch: its slots go back."""
        if isinstance(msg, P.NeedSlot):
            orphan = self.orphans.get((msg.epoch, msg.seq))
            if orphan is not None and orphan.ref == msg.ref:
                # It asked knowing the slot it has, and no grant follows: on reading RESUME the
                # worker abandons the task without an answer, so its slots go back now. (A NEED
                # that crossed a grant names an older slot: that grant answers, and so will the
                # worker, in the abandoned epoch.)
                self.release(self.orphans.pop((msg.epoch, msg.seq)).slots)
            return
        wid, slots, _ = self.orphans.pop((msg.epoch, msg.seq), Orphan(msg.worker_id, [], None))
        if isinstance(msg, P.Exhausted):
            # The replica ended: the worker ignores its later tasks of that epoch.
            ended = [k for k, o in self.orphans.items() if k[0] == msg.epoch and o.worker == wid]
            for key in ended:
                slots += self.orphans.pop(key).slots
        self.release(slots)

    def all_slots(self) -> list[SlotRef]:
        """Every slot the iterator holds (for teardown, once no worker writes any more)."""
        out: list[SlotRef] = []
        for info in [*self.arrived, *self.tasks]:
            out += info.slots()
        for orphan in self.orphans.values():
            out += orphan.slots
        if self.in_hand is not None and self.in_hand not in out:
            out.append(self.in_hand)
        self.tasks, self.arrived, self.orphans = TaskTable(), deque(), {}
        self.in_hand = None
        return out

    def drop(self, seq: int) -> None:
        """Forget a task that will never be answered; its slots go back."""
        self._unbind(self.tasks.pop(seq))

    def _unbind(self, info: TaskInfo[Answer]) -> None:
        """Task ``info`` will be neither sent nor answered: it waits for no slot, and its slot
        goes back."""
        self.unsent.pop(info.seq, None)
        self.wanting.pop(info.seq, None)
        self.asked.discard(info.seq)
        self.release(info.slots())
        info.ref = None

    def retire(self, wid: int, info: TaskInfo[Answer]) -> None:
        """Worker ``wid`` answered task ``info`` with EXHAUSTED: its replica ended, so torch marks
        the worker unavailable. Its later tasks will never be answered (the worker skips them
        without touching their slots): with ``in_order=False`` they are dropped; in order they
        stay to be skipped at their turn, as torch's are, but give their slots back now."""
        self.drop(info.seq)
        self.exhausted.append((info.seq, wid))
        self.status[wid] = False
        for later in [i for i in self.tasks if i.worker_id == wid and i.answer is None]:
            if self.in_order:
                self._unbind(later)
            else:
                self.drop(later.seq)

    def take_exhausted(self) -> list[tuple[int, int]]:
        """``(seq, worker)`` of the EXHAUSTED answers since the last call, in arrival order."""
        out, self.exhausted = self.exhausted, []
        return out

    def release(self, slots: list[SlotRef]) -> None:
        for ref in slots:
            self.arena.release(ref)

    # -- sending --------------------------------------------------------------------------------

    def _pick_worker(self) -> int | None:
        """torch's choice: the next live worker in round-robin order (below its share of tasks
        when not in order)."""
        while self._forced:
            # The saved run sent each to a worker live then. Decided later here (a smaller
            # prefetch_factor), one may find its worker's replica ended already: the saved
            # run's worker skipped it, yielding nothing, so it is passed over, and the next one
            # (or the round robin that followed them) takes this index. The batches come in the
            # saved run's order: only tasks that yield nothing are left out (review 45: sent
            # anyway, a persistent worker whose replica had ended never ran to its end).
            wid = self._forced.popleft()
            if self.status[wid]:
                return wid
        n = self.num_workers
        for _ in range(n):
            wid = self._next_worker
            self._next_worker = (wid + 1) % n
            if self.status[wid] and (
                self.in_order or self.num_tasks[wid] < self.max_tasks // sum(self.status)
            ):
                return wid
        return None

    def put(self, index: Any) -> None:
        """Decide the task for ``index`` (drawn by the caller) as torch does -- or drop it when no
        worker may take it -- and send it with a free slot. With none free it waits, decided,
        until one frees up (the worker has other tasks queued meanwhile); only while no batch
        size is known yet is it sent without a slot, for the worker to size it."""
        wid = self._pick_worker()
        if wid is None:
            return
        info = self.tasks.add(wid, None)
        self.num_tasks[wid] += 1
        largest = self.sizes.largest
        # Tasks reach each worker in sampler order: behind a waiting task, a new one waits too.
        free = largest and not self.unsent and self.arena.free_slots
        ref = self._acquire(largest, grow=False) if free else None
        if ref is None and largest:
            self.unsent[info.seq] = index
            return
        info.ref = ref
        self.in_hand = None
        self.sup.send(wid, P.Task(info.seq, self.epoch, ref, index))

    # -- slots ----------------------------------------------------------------------------------

    def need(self, info: TaskInfo[Answer], msg: P.NeedSlot) -> None:
        """Answer a worker's NEED_SLOT (see the module invariants)."""
        cur = info.ref
        if msg.ref != cur:
            return  # it asked before the slot on its way reached it; that grant answers
        if cur is not None and msg.nbytes <= self.arena.slot_size(cur):
            self.sup.send(info.worker_id, P.Grant(info.seq, self.epoch, cur))
            return
        if cur is not None:
            self.arena.release(cur)  # the worker copied the batch out and never touches it again
            info.ref = None
        self.wanting[info.seq] = msg.nbytes
        self.asked.add(info.seq)
        self.offer()
        if (
            info.seq in self.wanting
            and not self.arena.has_class_for(msg.nbytes)
            and self._may_grow_ahead(info, msg.nbytes)
        ):
            self._grow_for(info, msg.nbytes)  # a new size: nothing in use could ever fit it

    def _may_grow_ahead(self, info: TaskInfo[Answer], nbytes: int) -> bool:
        """Whether a batch asking for a new size class gets a slab at once. The batch the
        consumer needs next always does; a later one only while the cap is far off (room for
        two such slabs), so that near the cap growth goes to the batch needed next, which gets
        it from :meth:`unblock` at its turn."""
        if not self.in_order or self.tasks.get(self.tasks.rcvd) is info:
            return True
        st = self.arena.stats()
        slab = page_align(nbytes) * self.arena.slots_per_slab
        return st.max_bytes - st.bytes_reserved >= 2 * slab

    def offer(self) -> None:
        """Give free slots to the tasks waiting for one, in sampler order: a decided task is
        sent with its slot; a sent one that asked (or lost its slot) gets a GRANT."""
        if not (self.unsent or self.wanting) or not self.arena.free_slots:
            return
        for seq in sorted([*self.unsent, *self.wanting]) if self.wanting else list(self.unsent):
            info = self.tasks.get(seq)
            if info is None or info.answer is not None:
                self.unsent.pop(seq, None)
                self.wanting.pop(seq, None)
                self.asked.discard(seq)
                continue
            # Tasks that have not asked take the latest batches' largest size, which may have
            # changed since.
            nbytes = self.wanting[seq] if seq in self.asked else self.sizes.largest
            try:
                ref = self._acquire(nbytes, grow=False)
            except ArenaCapacityError as e:
                self._deny(info, e)
                continue
            if ref is None:
                if not self.arena.free_slots:
                    return
                continue
            self._give(info, ref)

    def _give(self, info: TaskInfo[Answer], ref: SlotRef) -> None:
        # The slot size for tasks grows only with a slot actually given: a batch too big for
        # the arena never raises the size other tasks ask for.
        self.sizes.at_least(self.wanting.get(info.seq, 0))
        if info.seq in self.unsent:
            info.ref = ref
            self.in_hand = None
            index = self.unsent.pop(info.seq)
            self.sup.send(info.worker_id, P.Task(info.seq, self.epoch, ref, index))
        else:
            self._grant(info, ref)

    def _grow_for(self, info: TaskInfo[Answer], nbytes: int) -> bool:
        """Grow the arena for ``info`` (within the cap); deny a batch that can never fit. When
        the backing store has no room for another slab (a small ``/dev/shm`` with
        ``arena_backend="posix"``), the arena first gives the store what it holds idle (idle
        slabs of other sizes, free slots hollowed, as at the cap) and tries again (review 42);
        if that fails while slots that fit the batch exist, or slots are in use whose room
        comes back when they are free, it waits for them, as at the cap (review 38: the arena
        takes the slots the store has room for, so a loop that drops its batches runs on them);
        only a batch nothing can make room for is denied."""
        try:
            ref = self._acquire(nbytes, grow=True)
        except ArenaCapacityError as e:
            if page_align(nbytes) > self.arena.max_bytes or e.never:
                # Larger than the cap, or than the whole store (review 43: waiting for room
                # that cannot come raised the same batch's error at every call)
                self._deny(info, e)
                return True
            self._make_room()
            try:
                ref = self._acquire(nbytes, grow=True)
            except ArenaCapacityError as again:
                if self.arena.has_class_for(nbytes) or self._slots_in_use():
                    # Its words only: the error's traceback holds this dispatch's frames, and
                    # the iterator's finalizer holds this dispatch (it would live on).
                    self.store_full = str(again)  # named by the cap's error, if it comes to it
                    return False
                self._deny(info, again)
                return True
        self.store_full = None  # grown, or at the cap: the store is not what stops it now
        if ref is None:
            return False
        self._give(info, ref)
        return True

    def _slots_in_use(self) -> bool:
        """Whether any slot of the arena is not FREE (its room comes back when it is)."""
        st = self.arena.stats()
        return st.slots_total > st.slots_by_state.get("free", 0)

    def _grant(self, info: TaskInfo[Answer], ref: SlotRef) -> None:
        info.ref = ref
        self.in_hand = None
        del self.wanting[info.seq]
        self.asked.discard(info.seq)
        self.sup.send(info.worker_id, P.Grant(info.seq, self.epoch, ref))

    def _deny(self, info: TaskInfo[Answer], exc: ArenaCapacityError) -> None:
        """The batch cannot get a slot (larger than the cap, or the arena cannot reserve a slab:
        ``/dev/shm`` or RAM is full). A batch whose worker asked for its size is DENIED: the
        worker answers DROPPED once it has published the RNG state after that batch, and the
        task then fails with ``exc`` (:meth:`answer`). A decided task not yet sent had only the
        latest batches' largest size: it is sent without a slot (when it is its worker's next,
        so each worker still gets its tasks in sampler order), its worker fetches it as torch's
        would and asks for exactly its size, which then fits or is denied."""
        self.wanting.pop(info.seq, None)
        if info.seq in self.asked:
            self.asked.discard(info.seq)
            self.denied[info.seq] = MainError(exc)
            self.sup.send(info.worker_id, P.Deny(info.seq, self.epoch))
        elif info.seq in self.unsent and not any(
            seq < info.seq and self.tasks.get(seq).worker_id == info.worker_id  # type: ignore[union-attr]
            for seq in self.unsent
        ):
            self._measure(info)

    def _measure(self, info: TaskInfo[Answer]) -> None:
        """Send the decided task ``info`` without a slot: its worker sizes the batch and asks."""
        index = self.unsent.pop(info.seq)
        self.sup.send(info.worker_id, P.Task(info.seq, self.epoch, None, index))

    def _acquire(self, nbytes: int, grow: bool) -> SlotRef | None:
        # Slots kept for workers forked while their batches were held do not count against the
        # cap: the user no longer holds them, and they come back when those workers exit.
        past_cap = self.host.leases.kept_bytes if grow else 0
        ref = self.arena.acquire(nbytes, add_slab=grow, past_cap=past_cap)
        # (No interruption can land between a Python call's return and these stores: from here
        # the slot is named until its task is, and the two stores that bind it are adjacent.)
        self.in_hand = ref
        if ref is not None and ref.slab_id not in self._known_slabs:
            self._known_slabs.add(ref.slab_id)
            slab = self.arena.slab(ref.slab_id)
            self.host.pinner.register(slab)
            for wid in range(self.num_workers):
                if self.sup.procs[wid].exitcode is None:
                    self.sup.send(wid, P.Attach(slab.spec))
        return ref

    def blocked_on(self, active: Callable[[int], bool]) -> tuple[int, bool] | None:
        """The task the consumer needs next, if it cannot move without a slot (its worker asked
        for one, or it is decided and not sent for want of one), and whether it must have one.
        With ``in_order=False`` any answer will do: a worker whose task waits for a slot is
        idle, and while another worker is busy its answer will come, so that task gets a slot
        only if the arena can grow for it (``must`` False); torch's idle worker would go on,
        and one slow sample held every other worker up (review 59: 4 batches of 24 came before
        it, against torch's 22)."""
        if not (self.asked or self.unsent):
            return None
        if self.in_order:
            nxt = self.tasks.next_in_order(active)
            if nxt is None or (nxt.seq not in self.asked and nxt.seq not in self.unsent):
                return None
            return nxt.seq, True
        if self.arrived:
            return None
        stuck = self.asked | set(self.unsent)
        first: dict[int, int] = {}  # worker -> its first unanswered task: the one it works on
        for i in self.tasks:
            if i.answer is None and active(i.worker_id) and i.worker_id not in first:
                first[i.worker_id] = i.seq
        idle = [seq for seq in first.values() if seq in stuck]
        if any(seq not in stuck for seq in first.values()):  # a worker is busy
            return (min(idle), False) if idle else None
        return min(stuck), True

    def unblock(self, seq: int, deadline: float | None, must: bool = True) -> None:
        """Find a slot for task ``seq``, the batch the consumer needs next: wait for the GPU's
        copies from slots the copy fence holds (until ``deadline``, the loader's timeout, if one
        is set); then, for a task whose size is only the latest batches' largest, send it
        without a slot to be measured (the arena grows only for a size a worker asked for);
        else grow the arena; at its cap take back the slots of later tasks not yet started and
        give back idle slabs of other sizes; then collect garbage (views caught in reference
        cycles); then spill finished later batches. If it still has none: while later batches
        are being written, return (the caller waits for them, and spills them here next time);
        else raise, unless the fence still holds slots when ``deadline`` has passed: then the
        caller's timeout fires. Unless it ``must`` have one (another worker's answer will come:
        :meth:`blocked_on`), it only takes the slots that came back and grows the arena: it
        waits for neither the GPU nor anything at the cap."""
        info = self.tasks.get(seq)
        assert info is not None
        nbytes = self.wanting[seq] if seq in self.asked else self.sizes.largest
        leases = self.host.leases
        guess = seq in self.unsent and seq not in self.asked
        # Dead batches' slots; then those the copy fence holds, once the GPU passed them.
        frees = (leases.drain, lambda: self._settle(deadline)) if must else (leases.drain,)
        steps = ("drain", "grow", "give back", "collect") if must else ("drain", "grow")
        for step in steps:
            if step == "grow":
                self.host.end_pending()  # slots of an iterator whose ending was cut short
            elif step == "give back":
                self._revoke_unstarted()
                self._make_room()
            elif step == "collect":
                gc.collect()
            for free in frees:
                if free():
                    self.offer()
                    if seq not in self.wanting and seq not in self.unsent:
                        return
            if step == "drain":
                continue
            if guess:
                # Its size is only a guess (the latest batches' largest, which may be many
                # times what it needs): let its worker measure it and ask for exactly that,
                # which may well fit, before growing the arena, collecting garbage (tens of
                # milliseconds) or spilling for it. A slab grown for a guess would be held by
                # this batch for as long as the user holds it.
                self._measure(info)
                return
            if self._grow_for(info, nbytes):
                return
        if not must:
            return  # another worker's answer will come
        if self._spill_after(info, nbytes):
            return
        if self._slots_coming_back():
            self._wait_at_cap(seq, nbytes)
            return
        if leases.fence:
            return  # the deadline passed while the GPU still reads held slots: the caller's fires
        raise self._exhausted(seq, nbytes)

    def _spill_after(self, info: TaskInfo[Answer], nbytes: int) -> bool:
        """Copy finished batches after ``info`` out of their slots, one at a time, until
        ``info`` gets a slot of ``nbytes``: those whose slot fits it first (one copy frees the
        room), the latest first; then those of the loader's other live iterators. Whether it
        got one. (This iterator's own only with ``in_order=True``: otherwise a finished batch
        is yielded before anything waits.)"""
        size = self.arena.slot_size
        later = [i for i in self.tasks if i.seq > info.seq and type(i.answer) is P.Ready]
        later.sort(key=lambda i: (size(i.answer.ref) >= nbytes, i.seq), reverse=True)  # type: ignore[union-attr]
        if any(self._spill_for(info, nbytes, victim) for victim in later):
            return True
        # Then the finished batches another live iterator of the loader prefetched, under its
        # lock: one another thread is inside now is left alone (its batches are on their way
        # to its user; spilling one it is lending would free a slot the user then holds).
        for d in self._others():
            if not d.lock.acquire(blocking=False):
                continue
            try:
                if any(self._spill_for(info, nbytes, victim) for victim in d.ready_tasks()):
                    return True
            finally:
                d.lock.release()
        return False

    def _spill_for(self, info: TaskInfo[Answer], nbytes: int, victim: TaskInfo[Answer]) -> bool:
        """Spill ``victim``'s finished batch; whether ``info`` then got a slot of ``nbytes``."""
        ready = victim.answer
        assert type(ready) is P.Ready
        victim.answer = self.host.leases.spill(ready)
        victim.ref = None
        self.arena.release(ready.ref)
        # The freed room goes to this task only (an offer could hand it to a later one): the
        # slot itself if it fits; else idle slabs and free slots give their memory back, and
        # the arena grows into it.
        ref = self._acquire(nbytes, grow=False)
        if ref is not None:
            self._give(info, ref)
            return True
        self._make_room()
        return self._grow_for(info, nbytes)

    def _make_room(self) -> None:
        """At the cap: give back idle slabs, and hollow free slots beside held ones (neither
        then counts against the cap)."""
        gone: list[int] = []

        def unlock(slab_id: int) -> None:  # while the slab is still mapped (review 37)
            gone.append(slab_id)
            self.host.pinner.unregister(slab_id)

        try:
            self.arena.give_back_idle(before_close=unlock)
        finally:  # an unlock that raised: the workers still unmap every slab given back
            for slab_id in gone:
                self._forget_slab(slab_id)
        self.arena.hollow()

    def _slots_coming_back(self) -> bool:
        """Whether slots will come back without the user: later batches being written (spilled
        once finished), or batches of an abandoned epoch (freed when their workers answer).

        This iterator's own only. A batch another live iterator's worker is writing frees
        nothing this iterator can see: its READY is read by that iterator's ``next()``, so
        waiting for it here would hang a program that alternates the two iterators in one
        thread. The batch needed next raises instead (naming the other iterator's slots), and
        a later ``next()`` tries again (review 44)."""
        return any(
            i.ref is not None and i.answer is None and self.status[i.worker_id]
            for i in self.tasks
        ) or any(o.slots for o in self.orphans.values())

    def _settle(self, deadline: float | None) -> int:
        """Wait for the GPU to pass the copies queued from every slot the copy fence holds, and
        release them: until ``deadline``, or with none without end, warning every
        ``FENCE_WARN_S`` that passes with slots still held. Returns how many."""
        leases, n, since = self.host.leases, 0, time.monotonic()
        while leases.fence:
            now = time.monotonic()
            left = FENCE_WARN_S if deadline is None else min(FENCE_WARN_S, deadline - now)
            if left <= 0:
                break
            n += leases.settle(left)
            if leases.fence and time.monotonic() - since >= FENCE_WARN_S:
                userwarn.warn(fence_stuck(leases, time.monotonic() - since), RuntimeWarning)
        return n

    def _wait_at_cap(self, seq: int, nbytes: int) -> None:
        """Task ``seq`` (the batch needed next) waits for later batches being written: warn once
        if that lasts ``CAP_WARN_S``."""
        now = time.monotonic()
        if self.cap_wait is None or self.cap_wait[0] != seq:
            self.cap_wait = (seq, now, False)
        _, since, warned = self.cap_wait
        if not warned and now - since >= CAP_WARN_S:
            self.cap_wait = (seq, since, True)
            userwarn.warn(self._cap_stuck(nbytes, since), RuntimeWarning)

    def _cap_stuck(self, nbytes: int, since: float) -> str:
        """Why the batch needed next (waiting since ``since``) still waits at the cap (see
        :meth:`_wait_at_cap`)."""
        writing = [i for i in self.tasks if i.ref is not None and i.answer is None]
        orphans = sum(len(o.slots) for o in self.orphans.values())
        return (
            f"the batch needed next has waited {time.monotonic() - since:.1f} s for a slot of "
            f"{nbytes:,} bytes: the arena is at its cap of {self.arena.max_bytes:,} bytes "
            f"(arena_max_bytes), and the room not held by your batches is in {len(writing)} "
            f"later batches still being written (and {orphans} of an abandoned epoch), which "
            "are copied out of their slots once finished; a dataset that is slow for those "
            "later samples (or that waits for the main process) holds the batch needed next up "
            "with them, where torch's loader has no cap: raise arena_max_bytes"
        )

    def why_waiting(self, waited: float) -> str:
        """``"; "`` and why the batch needed next has no slot, when the copy fence holds slots
        or it waits at the cap for later batches; else ``""`` (for the timeout's error)."""
        if self.host.leases.fence:
            return "; " + fence_stuck(self.host.leases, waited)
        if self.cap_wait is not None:
            seq, since, _ = self.cap_wait
            if seq in self.wanting or seq in self.unsent:
                nbytes = self.wanting[seq] if seq in self.asked else self.sizes.largest
                return "; " + self._cap_stuck(nbytes, since)
        return ""

    def _revoke_unstarted(self) -> None:
        """Take back the slots of tasks their workers have not started: a worker runs its tasks
        in order, so every task after the one it waits a slot for is untouched. They ask again
        when their turn comes, for a slot of the size batches have now."""
        waiting: dict[int, int] = {}
        for seq in self.asked:
            wid = self.tasks.get(seq).worker_id  # type: ignore[union-attr]
            waiting[wid] = min(seq, waiting.get(wid, seq))
        for info in self.tasks:
            first = waiting.get(info.worker_id)
            if first is None or info.seq <= first or info.ref is None or info.answer is not None:
                continue
            self.arena.release(info.ref)
            info.ref = None
            self.wanting[info.seq] = self.sizes.largest
            self.sup.send(info.worker_id, P.Revoke(info.seq, self.epoch))

    def _forget_slab(self, slab_id: int) -> None:
        """The arena gave slab ``slab_id`` back (and the pinner unlocked it before its memory
        went): every live iterator's workers unmap it (each iterator that used it told its own
        workers to attach it)."""
        self.host.leases.forget_slab(slab_id)
        for d in self.host.dispatches.snapshot():
            if not d.lock.acquire(blocking=False):  # (this iterator's own: re-entered at once)
                d.detach_later.add(slab_id)  # another thread is inside it: it detaches it later
                continue
            try:
                d._detach(slab_id)
            finally:
                d.lock.release()

    def detach_deferred(self) -> None:
        """Detach the slabs given back while another thread was inside this iterator."""
        while self.detach_later:
            self._detach(self.detach_later.pop())

    def _detach(self, slab_id: int) -> None:
        if slab_id not in self._known_slabs:
            return
        self._known_slabs.discard(slab_id)
        if self.sup.stopped:
            return  # its workers are gone or going, and unmap everything as they exit
        for wid in range(self.num_workers):
            if self.sup.procs[wid].exitcode is None:
                self.sup.send(wid, P.Detach(slab_id))

    def _others(self) -> list[Dispatch]:
        """The dispatchers of the host's other live iterators."""
        return [d for d in self.host.dispatches.snapshot() if d is not self and not d.sup.stopped]

    def ready_tasks(self) -> list[TaskInfo[Answer]]:
        """Tasks whose batch is finished in a slot and not yet yielded."""
        return [i for i in [*self.arrived, *self.tasks] if type(i.answer) is P.Ready]

    def _exhausted(self, seq: int, nbytes: int) -> ArenaExhaustedError | ArenaCapacityError:
        """The error of a batch that finds no slot: ArenaExhaustedError at the cap; when the
        backing store stopped the arena below its cap (a full ``/dev/shm``), the store's own
        ArenaCapacityError, as when it stops the first slab (tests/test_no_room_for_a_slab.py),
        with what the user holds."""
        st, leases = self.arena.stats(), self.host.leases
        held = leases.live()
        held_bytes = sum(self.arena.slot_size(lease.slot) for lease in held)
        free = st.slots_by_state.get("free", 0) - st.slots_hollow  # hollow ones take no room
        why = "page-locked for CUDA" if self.host.pinner.pinned_bytes else "the kernel refused"
        stuck = (
            f"; its {free} free slots ({st.bytes_by_state.get('free', 0):,} bytes) are too "
            "small for it, and could not give their memory back beside the batches above "
            f"({why})"
            if free
            else ""
        )
        others = [i for d in self._others() for i in [*d.tasks, *d.arrived] if i.ref is not None]
        other_bytes = sum(self.arena.slot_size(i.ref) for i in others)
        shared = "arena_max_bytes" if self.store_full is None else "the arena"
        elsewhere = (
            f"; another live iterator of this loader holds {len(others)} slots "
            f"({other_bytes:,} bytes) for batches it prefetched (finish it, or drop it; "
            f"iterators used at once, in one thread or several, share {shared})"
            if others
            else ""
        )
        mine = [i for i in [*self.tasks, *self.arrived] if i.ref is not None]
        ready = sum(1 for i in mine if type(i.answer) is P.Ready)
        writing = len(mine) - ready + sum(len(o.slots) for o in self.orphans.values())
        limit = (
            f"is at its cap of {st.max_bytes:,} bytes ({st.slots_total} slots){stuck}"
            if self.store_full is None
            else f"cannot grow below its cap of {st.max_bytes:,} bytes ({st.slots_total} "
            f"slots){stuck}: the backing store has no room (below)"
        )
        store = "" if self.store_full is None else f" Growing failed: {self.store_full}"
        raise_it = (
            "or raise arena_max_bytes."
            if self.store_full is None
            else "or give the backing store more room (below)."
        )
        prefetcher = (
            f" (up to {self.consumer_holds} of them may be held by a DevicePrefetcher over "
            "this loader: its depth + 2, and those of prefetchers over it)"
            if self.consumer_holds > 1
            else ""
        )
        kind = ArenaExhaustedError if self.store_full is None else ArenaCapacityError
        return kind(
            f"no arena slot is free for the next batch: the user holds {len(held)} batches "
            f"({held_bytes:,} bytes){prefetcher}{self._kept()}, "
            f"{ready} finished batches wait to be yielded and {writing} are being "
            f"written{elsewhere}, and the arena {limit}; "
            f"{st.bytes_reserved:,} bytes are reserved and the next batch needs {nbytes:,}. "
            "Drop references to old batches, copy what you keep with .clone(), release them "
            "early with shmloader.release(batch, loader), "
            + ("lower the DevicePrefetcher's depth, " if prefetcher else "")
            + raise_it
            + store
        )

    def _kept(self) -> str:
        kept = self.host.leases.kept
        if not kept:
            return ""
        return (
            f", with {kept} slots ({self.host.leases.kept_bytes:,} bytes) of dropped batches "
            "kept until the workers forked while they were held exit"
        )

    # -- answers --------------------------------------------------------------------------------

    def answer(self, info: TaskInfo[Answer], msg: Answer) -> None:
        """Record a task's answer."""
        if isinstance(msg, P.Dropped):  # a denied task: it fails with the main process's error
            msg = P.Failed(msg.seq, msg.epoch, msg.worker_id, self.denied.pop(msg.seq))
        if isinstance(msg, P.Ready):
            if msg.ref != info.ref:
                raise RuntimeError(
                    f"worker {msg.worker_id} answered task {msg.seq} in slot {msg.ref}, "
                    f"but the task was given {info.ref}"
                )
            self.arena.mark_ready(msg.ref)
            if self.sizes.saw(msg.nbytes):  # batches shrank: big slots go out of use
                self.arena.requests_fell(self.sizes.largest)
        info.answer = msg
        self.wanting.pop(info.seq, None)
        self.asked.discard(info.seq)
        if not self.in_order:
            self.arrived.append(self.tasks.pop(info.seq))

    def next_answer(self, active: Callable[[int], bool]) -> TaskInfo[Answer] | None:
        """The task to yield now, if its answer is here (sampler order, or arrival order)."""
        if not self.in_order:
            return self.arrived.popleft() if self.arrived else None
        info = self.tasks.next_in_order(active)
        for skipped in self.tasks.skipped():
            self.unsent.pop(skipped.seq, None)
            self.release(skipped.slots())
        if info is not None and info.answer is not None:
            return self.tasks.take_next()
        return None

    def pending(self, active: Callable[[int], bool]) -> bool:
        """Whether any task may still be answered."""
        if not self.in_order:
            return bool(self.arrived) or any(active(i.worker_id) for i in self.tasks)
        return self.tasks.next_in_order(active) is not None
