"""Interruptions inside ``next()`` (and ``iter()``, ``state_dict()``): Ctrl-C, exceptions that
signal handlers raise, and errors of the loader's own bookkeeping.

A ``KeyboardInterrupt`` (or any exception a signal handler raises: a ``SIGALRM`` time limit, a
``SIGTERM`` handler calling ``sys.exit``, whatever the handler is: a function, a
``functools.partial``, an object) can land between any two bytecodes of the main process. Most
places in ``next()`` are half-way through a change when it does: frame bytes read from a pipe
and not yet stored, a frame taken from the inbox and not yet recorded, a task decided and not
yet sent, a dead batch's slot popped and not yet released. Going on from there could lose a
batch (and wait for it forever) or hand one out twice. torch's own iterator has the same
windows.

Safe places (the iterator's ``_safe`` flag, and the supervisor's ``polling``): the ``poll`` of
the wait for workers' frames (where an idle loader spends its time), between two frames read
together (the rest wait in the inbox), the sampler's draw (user code: what it raises drops one
index, as in torch) and rebuilding the batch to return (it is dropped, and its slot freed); in
``iter()`` of a persistent iterator, everything before the workers hear of the new epoch (the
next ``iter()`` redoes it).

Invariants:
- An exception that leaves ``next()`` from a safe place, or that is one of the loader's own
  errors raised where its books are whole (``DESIGNED``; the timeout, a dead worker, a worker's
  exception re-raised, an inherited iterator: each marks the place safe before it raises),
  changes nothing: the same iterator goes on.
- Any other exception (from ``next()``, or from ``state_dict()`` while it waits for an
  abandoned epoch's answers) marks the iterator unusable at once: its workers are stopped and
  its slots reclaimed, as after a worker's death; its next call raises an error saying why, and
  ``iter(loader)`` starts over. It never hangs waiting for a batch the interruption lost.
- When that exception went through the arena's or the lease table's own code
  (:func:`touched_the_books`), the loader's arena is retired too: the next iterator makes a fresh
  one. Batches still held from the old one stay valid, and ``stats()`` counts them apart
  (``batches_retired``: read from the old lease table's weak references, not from its books)
  until they are dropped; ``bytes_retired`` is the whole old arena while an iterator of it
  lives (a saved traceback can keep one), then the slots held when it closed, in the slabs
  those batches keep mapped (:meth:`shmloader.lease.Leases.counter`). The fresh arena has
  the whole ``arena_max_bytes`` (a double hand-out of a slot from half-changed books would be
  worse than holding a few batches' memory outside the cap).
"""

from __future__ import annotations

import os
from typing import Final

import arena
from arena import ArenaError

# The loader's own errors raised where its books are whole (others mark the place safe).
DESIGNED: Final = (StopIteration, ArenaError)

_BOOKS: Final = (
    os.path.dirname(os.path.abspath(arena.__file__)) + os.sep,
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "lease.py"),
)


def touched_the_books(exc: BaseException) -> bool:
    """Whether ``exc`` was raised inside the arena's or the lease table's code."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.startswith(_BOOKS):
            return True
        tb = tb.tb_next
    return False


def unusable_after(exc: BaseException, where: str) -> str:
    """Why an iterator that ``exc`` left half-way through a change (in ``where``: ``next()``,
    ``iter()`` or ``state_dict()``) cannot go on."""
    return (
        f"its {where} was interrupted by {type(exc).__name__} while it was recording its "
        "workers' answers or sending them tasks (not while waiting for them), so going on could "
        "lose a batch or yield one twice; its workers have been stopped and its slots "
        "reclaimed. Iterating the DataLoader again starts fresh workers (the epoch starts "
        "over; a state_dict() saved before resumes where it was)."
    )
