"""One thread at a time inside an object: a method decorator over the object's re-entrant lock.

Training code calls a loader from several threads: a checkpoint thread takes ``state_dict()``
while the training thread iterates. The iterator's methods that read pipes or change dispatch
state run under its lock (``self._lock``, a ``threading.RLock``), one thread at a time.

Invariant: a decorated method called again on a thread already inside one of them, or inside the
object's lower locks (``self._busy_here()``: the lease and arena locks, which are always taken
after the iterator's), from a signal handler or a ``__del__`` run by the garbage collector,
raises ``RuntimeError`` naming the fix, instead of running on half-changed state, waiting for
itself, or waiting for a thread that waits for a lock it holds.

A process forked while another thread holds one of these locks (a checkpoint thread inside
``state_dict()``) would find it held for good: the owners registered with
:func:`reset_after_fork` have their ``_lock`` and ``_state_lock`` made free again in the child,
unless the forking thread itself holds them and the child goes on from the fork (``os.fork()``:
it returns through the frames that release them). A ``multiprocessing`` child never returns
there (it runs its target and exits), so it frees those too. An iterator whose ``_lock``
another thread held at the fork is half-way through that thread's step in the child: there
its decorated methods raise (``_torn_by_fork``; review 51: a fork-to-snapshot child's
``state_dict()`` described half a batch); ``iter(loader)`` starts a new one.
"""

from __future__ import annotations

import functools
import multiprocessing.util
import os
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def reentered(what: str) -> RuntimeError:
    """The error of ``what`` called on a thread already inside the loader's own steps."""
    return RuntimeError(
        f"{what} was called from inside this DataLoader iterator's own next(), iter() or "
        "state_dict() on the same thread (from a signal handler or a __del__?), where the "
        "iterator is half-way through a change. Set a flag there and call it between steps."
    )


def inside(obj: Any) -> bool:
    """Whether this thread is inside one of ``obj``'s decorated methods (or its lower locks)."""
    return bool(obj._lock._is_owned() or obj._busy_here())


def torn(what: str) -> RuntimeError:
    """The error of ``what`` on an iterator another thread was inside when this process forked."""
    return RuntimeError(
        f"{what} on a DataLoader iterator inherited through fork(): the process forked while "
        "another thread was inside this iterator's next() or state_dict(), so here it is "
        "half-way through that step (its sampler position, counts and RNG draws). Fork between "
        "steps (or take loader.state_dict() before forking and pass it on), or call "
        "iter(loader) here for a new epoch."
    )


def one_thread(what: str) -> Callable[[F], F]:
    """Run the method under ``self._lock`` (the object also has ``_busy_here()``); ``what``
    names it in the re-entrance error."""

    def wrap(method: F) -> F:
        @functools.wraps(method)
        def locked(self: Any, *args: Any, **kwargs: Any) -> Any:
            if inside(self):
                raise reentered(what)
            with self._lock:
                if self._torn_by_fork:
                    raise torn(what)
                return method(self, *args, **kwargs)

        return locked  # type: ignore[return-value]

    return wrap


# id -> weak reference: by id, since an owner need not be hashable (a DataLoader subclass with
# __eq__ and no __hash__ is not; review 48)
_resettable: dict[int, weakref.ref[Any]] = {}


def reset_after_fork(owner: Any) -> None:
    """Have a forked child free ``owner``'s ``_lock`` and ``_state_lock`` that another thread
    of the parent held at the fork (review 47: ``iter(loader)`` in a child hung for good)."""
    key = id(owner)

    def forget(ref: weakref.ref[Any]) -> None:
        if _resettable.get(key) is ref:
            del _resettable[key]

    _resettable[key] = weakref.ref(owner, forget)


def _free_inherited_locks(forking_threads_too: bool = False) -> None:
    for ref in list(_resettable.values()):
        owner = ref()
        if owner is None:
            continue
        for name in ("_lock", "_state_lock"):
            lock = getattr(owner, name, None)
            if lock is None:
                continue
            if lock._is_owned():  # by the forking thread
                if forking_threads_too:
                    lock._at_fork_reinit()
            elif lock.acquire(blocking=False):
                lock.release()  # free at the fork: nothing half done
            else:  # another thread of the parent was inside: its step is half done here
                lock._at_fork_reinit()
                if name == "_lock":
                    owner._torn_by_fork = True


class _Forever:
    """What multiprocessing's after-fork registry is keyed by (it keeps a weak reference)."""


_FOREVER = _Forever()
os.register_at_fork(after_in_child=_free_inherited_locks)
multiprocessing.util.register_after_fork(_FOREVER, lambda _: _free_inherited_locks(True))
