"""One thread at a time inside an object: a method decorator over the object's re-entrant lock.

Training code calls a loader from several threads: a checkpoint thread takes ``state_dict()``
while the training thread iterates. The iterator's methods that read pipes or change dispatch
state run under its lock (``self._lock``, a ``threading.RLock``), one thread at a time.

Invariant: a decorated method called again on a thread already inside one of them, or inside the
object's lower locks (``self._busy_here()``: the lease and arena locks, which are always taken
after the iterator's), from a signal handler or a ``__del__`` run by the garbage collector,
raises ``RuntimeError`` naming the fix, instead of running on half-changed state, waiting for
itself, or waiting for a thread that waits for a lock it holds.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def one_thread(what: str) -> Callable[[F], F]:
    """Run the method under ``self._lock`` (the object also has ``_busy_here()``); ``what``
    names it in the re-entrance error."""

    def wrap(method: F) -> F:
        @functools.wraps(method)
        def locked(self: Any, *args: Any, **kwargs: Any) -> Any:
            lock = self._lock
            if lock._is_owned() or self._busy_here():
                raise RuntimeError(
                    f"{what} was called from inside this DataLoader iterator's own next(), "
                    "iter() or state_dict() on the same thread (from a signal handler or a "
                    "__del__?), where the iterator is half-way through a change. Set a flag "
                    "there and call it between steps."
                )
            with lock:
                return method(self, *args, **kwargs)

        return locked  # type: ignore[return-value]

    return wrap
