"""The task table: tasks in flight keyed by sequence number, released in sampler order.

Pure bookkeeping (no I/O, no arena): which worker each task went to, which slot it writes, and its
answer once it arrives. ``pop_next`` hands out answers strictly by sequence number, skipping tasks
whose worker retired without answering (an exhausted IterableDataset replica), exactly as torch's
``_task_info`` / ``_rcvd_idx`` logic does.

Invariants: ``rcvd <= sent``; every key ``k`` of the table has ``rcvd <= k < sent``; a task leaves
the table exactly once (answered and popped, skipped, or popped out of order).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from arena import SlotRef

A = TypeVar("A")


@dataclass(slots=True)
class TaskInfo(Generic[A]):
    seq: int
    worker_id: int
    ref: SlotRef | None  # the slot the batch is (to be) written in
    answer: A | None = None

    def slots(self) -> list[SlotRef]:
        """Every slot the task holds."""
        return [] if self.ref is None else [self.ref]


class TaskTable(Generic[A]):
    """Tasks sent and not yet handed to the user, by sequence number."""

    def __init__(self) -> None:
        self.sent = 0
        self.rcvd = 0
        self._tasks: dict[int, TaskInfo[A]] = {}
        self._skipped: list[TaskInfo[A]] = []

    def add(self, worker_id: int, ref: SlotRef | None) -> TaskInfo[A]:
        info: TaskInfo[A] = TaskInfo(self.sent, worker_id, ref)
        self._tasks[self.sent] = info
        self.sent += 1
        return info

    def get(self, seq: int) -> TaskInfo[A] | None:
        return self._tasks.get(seq)

    def pop(self, seq: int) -> TaskInfo[A]:
        return self._tasks.pop(seq)

    def next_in_order(self, worker_active: Callable[[int], bool]) -> TaskInfo[A] | None:
        """Advance past tasks that will never be answered; the task the user gets next, or
        ``None`` when nothing is in flight. Skipped tasks are returned through :meth:`skipped`."""
        while self.rcvd < self.sent:
            info = self._tasks.get(self.rcvd)
            if info is not None:
                if info.answer is not None or worker_active(info.worker_id):
                    return info
                self._skipped.append(self._tasks.pop(self.rcvd))
            self.rcvd += 1
        return None

    def skipped(self) -> list[TaskInfo[A]]:
        """Tasks dropped by the last :meth:`next_in_order` calls (their slots need releasing)."""
        out, self._skipped = self._skipped, []
        return out

    def take_next(self) -> TaskInfo[A]:
        """Pop the task at ``rcvd`` (which has its answer) and advance."""
        info = self._tasks.pop(self.rcvd)
        self.rcvd += 1
        return info

    def __iter__(self) -> Iterator[TaskInfo[A]]:
        return iter(list(self._tasks.values()))

    def __len__(self) -> int:
        return len(self._tasks)
