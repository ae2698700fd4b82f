"""Dispatch: sampler indices to workers, and arena slots to tasks.

One :class:`Dispatch` per iterator. It sends tasks the way torch's iterator does and binds each
task to a slot of the loader's arena, as late as needed and no later.

Task states (``TaskInfo``; ``seq`` numbers tasks of an epoch in sampler order)::

    sent with a slot ---------------------------------------+--> answered --> yielded / raised
    sent without one --offer (a slot freed up)--> has a slot -+
          |                                                  |
          +--NEED_SLOT (or too small) --grant/grow--> has a bigger slot (old one kept as a spare)

Invariants:
- Worker choice and timing are torch's: ``prefetch_factor * num_workers`` send attempts when an
  epoch starts, then one per batch yielded (and one per exhausted IterableDataset replica); each
  attempt draws one index and gives it to the next live worker in round-robin order (with
  ``in_order=False``, the next one below its share of tasks), or drops it when there is none.
- A task takes a free slot of the largest batch size seen when it is sent; with none free it goes
  without, and free slots are offered to waiting tasks in sampler order whenever one frees up.
- Every NEED_SLOT is answered: GRANT of the task's own slot when the batch fits it, the grant
  already on its way when the worker had not seen it yet, or a bigger slot (GRANT) or DENY.
- The arena grows only for the batch the consumer needs next (in sampler order, or any batch with
  ``in_order=False``) and only when its worker waits for a slot; at the cap, slabs whose slots are
  all free are given back first, then garbage is collected; ``ArenaExhaustedError`` only when
  nothing else frees room, with exactly what the user holds.
- Every slot a task holds is named once (``ref`` and ``spares``) and released exactly once: with
  the batch's lease, when its task fails or is skipped, when its answer belongs to an abandoned
  epoch (``orphans``), or at teardown.
"""

from __future__ import annotations

import gc
from collections import deque
from collections.abc import Callable
from typing import Any

from arena import ArenaCapacityError, ArenaExhaustedError, SlotRef
from shmloader import protocol as P
from shmloader.host import ArenaHost
from shmloader.reorder import TaskInfo, TaskTable
from shmloader.supervisor import Supervisor

Answer = P.Ready | P.Failed


class MainError:
    """An error of the main process's own for one task (a batch that can never fit the arena),
    raised at that batch's turn like a worker's error."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def reraise(self) -> None:
        raise self.exc


class Dispatch:
    """The tasks of one iterator and the slots bound to them."""

    def __init__(
        self, host: ArenaHost, sup: Supervisor, num_workers: int, max_tasks: int, in_order: bool
    ) -> None:
        self.host = host
        self.arena = host.arena
        self.sup = sup
        self.num_workers = num_workers
        self.max_tasks = max_tasks
        self.in_order = in_order
        self.epoch = 0
        self.tasks: TaskTable[Answer] = TaskTable()
        self.arrived: deque[TaskInfo[Answer]] = deque()  # in_order=False: arrival order
        self.wanting: dict[int, int] = {}  # seq -> bytes of a slot the task waits for
        self.asked: set[int] = set()  # seqs whose worker sent NEED_SLOT and waits
        # (epoch, seq) -> (worker, slots) of tasks of abandoned epochs not yet answered
        self.orphans: dict[tuple[int, int], tuple[int, list[SlotRef]]] = {}
        self.status = [True] * num_workers
        self.num_tasks = [0] * num_workers
        self._next_worker = 0
        self._known_slabs: set[int] = set()

    # -- epochs ---------------------------------------------------------------------------------

    def new_epoch(self) -> None:
        """Abandon the current epoch: release what it holds; tasks still being written become
        orphans, released when their answer arrives (a worker never writes after answering)."""
        for info in [*self.arrived, *self.tasks]:
            slots = info.slots()
            # A worker waiting for a slot abandons that task when it reads RESUME.
            if info.answer is None and self.status[info.worker_id] and info.seq not in self.asked:
                self.orphans[(self.epoch, info.seq)] = (info.worker_id, slots)
            else:
                self.release(slots)
        self.epoch += 1
        self.tasks = TaskTable()
        self.arrived = deque()
        self.wanting = {}
        self.asked = set()
        self.status = [True] * self.num_workers
        self.num_tasks = [0] * self.num_workers
        self._next_worker = 0

    def orphan_answered(self, msg: P.ToMain) -> None:
        """An answer to a task of an abandoned epoch: its slots go back."""
        wid, slots = self.orphans.pop((msg.epoch, msg.seq), (msg.worker_id, []))
        if isinstance(msg, P.Exhausted):
            # The replica ended: the worker ignores its later tasks of that epoch.
            for key in [k for k, (w, _) in self.orphans.items() if k[0] == msg.epoch and w == wid]:
                slots += self.orphans.pop(key)[1]
        self.release(slots)

    def all_slots(self) -> list[SlotRef]:
        """Every slot the iterator holds (for teardown, once no worker writes any more)."""
        out: list[SlotRef] = []
        for info in [*self.arrived, *self.tasks]:
            out += info.slots()
        for _, slots in self.orphans.values():
            out += slots
        self.tasks, self.arrived, self.orphans = TaskTable(), deque(), {}
        return out

    def release(self, slots: list[SlotRef]) -> None:
        for ref in slots:
            self.arena.release(ref)

    # -- sending --------------------------------------------------------------------------------

    def _pick_worker(self) -> int | None:
        """torch's choice: the next live worker in round-robin order (below its share of tasks
        when not in order)."""
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
        """Send the task for ``index`` (drawn by the caller), or drop it as torch does when no
        worker may take it."""
        wid = self._pick_worker()
        if wid is None:
            return
        largest = self.host.largest
        ref = self._acquire(largest, grow=False) if largest else None
        info = self.tasks.add(wid, ref)
        self.num_tasks[wid] += 1
        self.sup.send(wid, P.Task(info.seq, self.epoch, ref, index))
        if ref is None and largest:
            self.wanting[info.seq] = largest

    # -- slots ----------------------------------------------------------------------------------

    def need(self, info: TaskInfo[Answer], msg: P.NeedSlot) -> None:
        """Answer a worker's NEED_SLOT (see the module invariants)."""
        cur = info.ref
        if msg.ref != cur:
            return  # it asked before the slot on its way reached it; that grant answers
        if cur is not None and msg.nbytes <= self.arena.slot_size(cur):
            self.sup.send(info.worker_id, P.Grant(info.seq, self.epoch, cur))
            return
        self.host.largest = max(self.host.largest, msg.nbytes)
        self.wanting[info.seq] = msg.nbytes
        self.asked.add(info.seq)
        self.offer()

    def offer(self) -> None:
        """Give free slots to the tasks waiting for one, in sampler order."""
        if not self.wanting:
            return
        for seq in sorted(self.wanting):
            info = self.tasks.get(seq)
            if info is None or info.answer is not None:
                del self.wanting[seq]
                self.asked.discard(seq)
                continue
            try:
                ref = self._acquire(self.wanting[seq], grow=False)
            except ArenaCapacityError as e:
                self._deny(info, e)
                continue
            if ref is not None:
                self._grant(info, ref)

    def _grant(self, info: TaskInfo[Answer], ref: SlotRef) -> None:
        if info.ref is not None:
            info.spares = [*(info.spares or []), info.ref]  # read by the worker until it answers
        info.ref = ref
        del self.wanting[info.seq]
        self.asked.discard(info.seq)
        self.sup.send(info.worker_id, P.Grant(info.seq, self.epoch, ref))

    def _deny(self, info: TaskInfo[Answer], exc: ArenaCapacityError) -> None:
        del self.wanting[info.seq]
        if info.seq in self.asked:
            self.asked.discard(info.seq)
            self.sup.send(info.worker_id, P.Deny(info.seq, self.epoch))
            self.answer(info, P.Failed(info.seq, self.epoch, info.worker_id, MainError(exc)))

    def _acquire(self, nbytes: int, grow: bool) -> SlotRef | None:
        ref = self.arena.acquire(nbytes, add_slab=grow)
        if ref is not None and ref.slab_id not in self._known_slabs:
            self._known_slabs.add(ref.slab_id)
            slab = self.arena.slab(ref.slab_id)
            self.host.pinner.register(slab)
            for wid in range(self.num_workers):
                if self.sup.procs[wid].exitcode is None:
                    self.sup.send(wid, P.Attach(slab.spec))
        return ref

    def blocked_on(self, active: Callable[[int], bool]) -> int | None:
        """The task the consumer needs next, if its worker waits for a slot: nothing moves
        until it gets one."""
        if not self.asked:
            return None
        if self.in_order:
            nxt = self.tasks.next_in_order(active)
            return nxt.seq if nxt is not None and nxt.seq in self.asked else None
        if self.arrived:
            return None
        waiting_workers = {self.tasks.get(s).worker_id for s in self.asked}  # type: ignore[union-attr]
        busy = {i.worker_id for i in self.tasks if i.answer is None and active(i.worker_id)}
        return min(self.asked) if busy <= waiting_workers else None

    def unblock(self, seq: int) -> None:
        """Find a slot for task ``seq``: grow the arena; at its cap give back idle slabs of other
        sizes; then collect garbage (views caught in reference cycles); else raise."""
        info = self.tasks.get(seq)
        assert info is not None
        nbytes = self.wanting[seq]
        leases = self.host.leases
        for step in ("drain", "grow", "give back", "collect"):
            if step == "give back":
                for slab_id in self.arena.give_back_idle():
                    self._forget_slab(slab_id)
            elif step == "collect":
                gc.collect()
            if leases.drain():
                self.offer()
                if seq not in self.wanting:
                    return
            try:
                ref = self._acquire(nbytes, grow=step != "drain")
            except ArenaCapacityError as e:
                self._deny(info, e)
                return
            if ref is not None:
                self._grant(info, ref)
                return
        raise self._exhausted(seq, nbytes)

    def _forget_slab(self, slab_id: int) -> None:
        self._known_slabs.discard(slab_id)
        self.host.pinner.unregister(slab_id)
        self.host.leases.forget_slab(slab_id)
        for wid in range(self.num_workers):
            if self.sup.procs[wid].exitcode is None:
                self.sup.send(wid, P.Detach(slab_id))

    def _exhausted(self, seq: int, nbytes: int) -> ArenaExhaustedError:
        st = self.arena.stats()
        lent = st.slots_by_state.get("lent", 0)
        return ArenaExhaustedError(
            f"no arena slot for the next batch ({nbytes:,} bytes): the user holds "
            f"{self.host.leases.held} batches ({st.bytes_by_state.get('lent', 0):,} bytes in "
            f"{lent} slots), {st.slots_by_state.get('ready', 0)} finished batches wait to be "
            f"yielded and {st.slots_by_state.get('writing', 0)} are being written, and the arena "
            f"is at its cap of {st.max_bytes:,} bytes ({st.bytes_reserved:,} reserved in "
            f"{st.slots_total} slots). Drop references to old batches, copy what you keep with "
            ".clone(), release them early with shmloader.release(batch, loader), or raise "
            "arena_max_bytes."
        )

    # -- answers --------------------------------------------------------------------------------

    def answer(self, info: TaskInfo[Answer], msg: Answer) -> None:
        """Record a task's answer; its spare slots go back (the worker is done reading them)."""
        info.answer = msg
        if info.spares:
            self.release(info.spares)
            info.spares = None
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
            self.release(skipped.slots())
        if info is not None and info.answer is not None:
            return self.tasks.take_next()
        return None

    def pending(self, active: Callable[[int], bool]) -> bool:
        """Whether any task may still be answered."""
        if not self.in_order:
            return bool(self.arrived) or any(active(i.worker_id) for i in self.tasks)
        return self.tasks.next_in_order(active) is not None
