"""What one iterator holds in flight, and the one place that gives all of it back.

The books: the task table of the current epoch (:class:`TaskTable`), answers that arrived out of
order and are not yet yielded, orphans (tasks of abandoned epochs still being written), the
slots workers asked for and have not been granted, and tasks sent without a slot.

Invariants:
- Every slot an iterator holds (to be written, written and not yet lent) is named exactly once
  in the books, as a task's ``ref`` or ``spare`` or in an orphan's list.
- :meth:`Books.release_all` runs only once no worker can write any more (after teardown); it
  releases every slot the books name and empties them. The iterator's finalizer calls it after
  stopping the workers, so an iterator dropped mid-epoch leaks no slot into the loader's arena.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

from arena import Arena, SlotRef
from shmloader.reorder import TaskInfo, TaskTable

A = TypeVar("A")


class Books(Generic[A]):
    def __init__(self) -> None:
        self.tasks: TaskTable[A] = TaskTable()
        self.arrived: deque[TaskInfo[A]] = deque()  # answered out of order, not yet yielded
        self.slotless: deque[int] = deque()  # tasks sent without a slot, waiting for one
        self.pending: list[tuple[int, int, int]] = []  # grants asked for: (worker, seq, nbytes)
        # (epoch, seq) -> (worker, slots) of tasks of abandoned epochs not yet answered
        self.orphans: dict[tuple[int, int], tuple[int, list[SlotRef]]] = {}

    def new_epoch(self) -> None:
        """Fresh per-epoch books (orphans and their slots carry over until answered)."""
        self.tasks = TaskTable()
        self.arrived = deque()
        self.slotless = deque()
        self.pending = []

    def refs(self) -> list[SlotRef]:
        """Every slot the books name."""
        out: list[SlotRef] = []
        for info in [*self.tasks, *self.arrived]:
            out += [r for r in (info.ref, info.spare) if r is not None]
        for _, refs in self.orphans.values():
            out += refs
        return out

    def release_all(self, arena: Arena) -> None:
        """Give every slot back and empty the books. Only once no worker writes any more."""
        for ref in self.refs():
            arena.release(ref)
        self.new_epoch()
        self.orphans.clear()
