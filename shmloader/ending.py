"""An iterator's end: stop its workers, then queue every slot it holds for release; run to its
end even when an interruption lands before its first line.

An iterator ends three ways: its last ``next()`` (an epoch of a non-persistent loader), a failure
(a dead worker, an interruption half-way through a change: :mod:`shmloader.nextbatch`), or the
garbage collector (a dropped iterator). A ``KeyboardInterrupt`` (or any exception a signal
handler raises) can land at the first line of the teardown on any of those ways, and then
nothing ran: ``weakref.finalize`` forgets its callback *before* it calls it, and the garbage
collector only prints what a callback raises. The iterator's slots then stayed WRITING or READY
for good, and the arena had that much less room (at a tight ``arena_max_bytes``, the next
batch found none: ``ArenaExhaustedError``, blaming an iterator the user had dropped).

So an :class:`Ending` is done only when the teardown returned, and until then the loader's
:class:`~shmloader.host.ArenaHost` keeps it: :meth:`ArenaHost.end_pending` runs again every
ending whose iterator is gone or asked for it. The loader does so before each new iterator and
in ``stats()``, and dispatch when the batch needed next finds no slot
(:meth:`Dispatch.unblock`). Until then a dropped iterator's workers, idle, stay too (the ending
keeps them, to kill them before their slots go back); at exit they end with the process.

Invariants:
- An ending that returned drops what it holds, so a finished ending keeps no supervisor,
  dispatcher or arena alive; what a teardown does twice is harmless (stopping stopped workers;
  the slots are taken once, by :meth:`Dispatch.all_slots`, which empties the dispatcher).
- No worker can write a slot the ending hands back: the workers are killed and reaped first.
- The slots go straight from the dispatcher to ``leases.dead``: :meth:`Dispatch.all_slots`
  empties the dispatcher after its last call, and nothing that could run a signal handler lies
  between that and ``extend`` taking the list. Nothing of the dispatcher is queued, so
  ``leases.dead`` (which the loader's arena keeps until it closes) never keeps the dispatcher,
  and through it the arena, alive.
- Runs at a sweep only for an iterator that is gone or asked to end, and only with its lock
  (never one another thread is inside).
- Takes no lock itself and leaves the releases to the next safe point (``leases.dead``): it may
  run inside the garbage collector.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shmloader.dispatch import Dispatch
    from shmloader.lease import Leases
    from shmloader.supervisor import Supervisor


def _teardown(pid: int, sup: Supervisor, dispatch: Dispatch, leases: Leases) -> None:
    """Stop the workers, then queue every slot the iterator holds for release. Everything is
    inside the ``try``, so an interruption anywhere after its first line still ends the workers
    and queues the slots (hence the two pid tests)."""
    try:
        if os.getpid() == pid:  # inherited through fork(): the workers and slots are the parent's
            sup.shutdown()
    finally:
        if os.getpid() == pid:
            sup.kill()  # reaps at once; ends any worker an interruption left running
            leases.dead.extend(dispatch.all_slots())  # no worker of it can write them now


class Ending:
    """One iterator's teardown: call it to end the iterator (again, if an interruption cut the
    last call short); ``weakref.finalize`` calls it when the iterator is dropped."""

    __slots__ = ("_lock", "_owner", "_parts", "asked")

    def __init__(
        self,
        owner: Any,
        lock: threading.RLock,
        sup: Supervisor,
        dispatch: Dispatch,
        leases: Leases,
    ) -> None:
        self._owner = weakref.ref(owner)  # weak: the ending must not keep its iterator alive
        self._lock = lock  # the iterator's: a sweep never ends one another thread is inside
        self._parts: tuple[int, Supervisor, Dispatch, Leases] | None = (
            os.getpid(), sup, dispatch, leases
        )  # fmt: skip
        self.asked = False  # the iterator asked to end (or was dropped)

    @property
    def done(self) -> bool:
        return self._parts is None

    def __call__(self) -> None:
        self.asked = True
        parts = self._parts
        if parts is not None:
            _teardown(*parts)
            self._parts = None

    def end_if_due(self) -> None:
        """At a safe point: finish this ending if its iterator is gone or asked to end and no
        other thread is inside it."""
        if self._parts is None or not (self.asked or self._owner() is None):
            return
        if self._lock.acquire(blocking=False):
            try:
                self()
            finally:
                self._lock.release()
