"""Interruptions inside ``next()``: Ctrl-C, and exceptions that signal handlers raise.

A ``KeyboardInterrupt`` (or any exception a Python signal handler raises: a ``SIGALRM`` time
limit, a ``SIGTERM`` handler calling ``sys.exit``) can land between any two bytecodes of the main
process. While an iterator waits for its workers' frames (the ``poll`` in
:meth:`shmloader.supervisor.Supervisor.wait`) nothing is half done, and the iterator goes on
as if nothing happened when it is called again. Anywhere else it may be half-way through a
change: frame bytes read from a pipe and not yet stored, a frame taken from the inbox and not
yet recorded, a task decided and not yet sent. Going on from there could lose a batch (and wait
for it forever) or hand one out twice. torch's own iterator has the same windows.

Three more places are safe: between two frames read together (the rest wait in the inbox), the
sampler's draw (user code; the index drawn is dropped, as torch drops it) and rebuilding the
batch to return (it is dropped, and its slot freed). The iterator's ``_safe`` flag says so;
everything else in ``next()`` counts as half done.

Invariant: an iterator whose ``next()`` is interrupted anywhere else is marked unusable at once
(its workers are stopped and its slots reclaimed, as after a worker's death), and its arena is
retired (the loader's next iterator makes a fresh one; batches still held stay valid): its next
call raises an error saying so, and ``iter(loader)`` starts over. It never hangs waiting for a
batch the interruption lost. Errors the loader raises by design (a worker's exception, the
timeout, an exhausted arena, ``StopIteration``) are not interruptions and change nothing.
"""

from __future__ import annotations

import signal
from types import CodeType


def _handler_code() -> set[CodeType]:
    """The code of every Python-level signal handler installed now."""
    codes: set[CodeType] = set()
    for signum in signal.valid_signals():
        try:
            handler = signal.getsignal(signum)
        except (ValueError, OSError):
            continue
        func = getattr(handler, "__func__", handler)  # a bound method's function
        code = getattr(func, "__code__", None)
        if isinstance(code, CodeType):
            codes.add(code)
    return codes


def from_a_signal(exc: BaseException) -> bool:
    """Whether ``exc`` was raised asynchronously: a ``KeyboardInterrupt`` (Python's own SIGINT
    handler), or raised inside a Python signal handler (its frame is in the traceback)."""
    if isinstance(exc, KeyboardInterrupt):
        return True
    codes = _handler_code()
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code in codes:
            return True
        tb = tb.tb_next
    return False


def unusable_after(exc: BaseException) -> str:
    """Why an iterator interrupted by ``exc`` outside its wait cannot go on."""
    return (
        f"its next() was interrupted by {type(exc).__name__} while it was recording its "
        "workers' answers or sending them tasks (not while waiting for them), so going on could "
        "lose a batch or yield one twice; its workers have been stopped and its slots "
        "reclaimed. Iterating the DataLoader again starts fresh workers (the epoch starts "
        "over; a state_dict() saved before resumes where it was)."
    )
