"""Finalizers that an interruption cannot skip for good.

``weakref.finalize`` calls its function when its object dies, once. An exception that a signal
handler raises (Ctrl-C, a ``SIGALRM`` time limit) can land on the first line of that call, before
the finalizer takes itself out of its registry: the garbage collector prints the exception, the
function never runs, and the registry keeps its arguments alive until the process exits. For an
arena that is memory: a slab's mapping, a segment's descriptor, or a whole arena with its slabs
(a SIGALRM stress left such arenas behind).

:func:`on_death` makes a finalizer and remembers it; :func:`run_skipped` runs each remembered
one whose object is gone but whose function never ran, and forgets those that ran. Callers run
it at points where running any of these functions is safe (shmloader: before each new iterator
and in ``stats()``), never inside the garbage collector.

Invariants:
- A finalizer's function runs at most once: ``weakref.finalize`` takes itself out of its registry
  before it calls the function, whoever calls it (the weakref, :func:`run_skipped`, exit).
- Only finalizers made here are run, and only once their object is dead: a live object's is
  never touched.
- Remembering costs one list entry per live finalizer; dead ones are forgotten at each
  :func:`run_skipped`, and whenever the list has doubled since the last time.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from arena import userwarn

# No lock: a forked worker that makes a mapping would wait forever on one another thread of its
# parent held at the fork. ``append`` is atomic under the GIL; a finalizer made while a prune
# rebuilds the list may be left out of it, which only means it is not run if it is skipped.
_made: list[weakref.finalize[Any, Any]] = []
_kept_after_prune = [0]


def on_death(
    obj: object, func: Callable[..., Any], *args: Any, atexit: bool = True
) -> weakref.finalize[Any, Any]:
    """``weakref.finalize(obj, func, *args)`` (with ``atexit``), remembered for
    :func:`run_skipped`."""
    done = weakref.finalize(obj, func, *args)
    done.atexit = atexit
    _made.append(done)
    if len(_made) > 2 * _kept_after_prune[0] + 64:
        _prune()
    return done


def run_skipped() -> int:
    """Run every remembered finalizer whose object died without its function running (an
    interruption at the function's first line), and forget those that ran. Returns how many
    it ran. Not from inside the garbage collector (the functions may take locks); what one of
    them raises is reported as a warning, as the garbage collector would print it."""
    skipped = [f for f in list(_made) if f.alive and f.peek() is None]
    for f in skipped:
        try:
            f()
        except Exception as e:  # noqa: BLE001 (an interruption propagates: the rest run later)
            userwarn.warn(f"shmloader: a finalizer run late raised {e!r}", RuntimeWarning)
    _prune()
    return len(skipped)


def _prune() -> None:
    _made[:] = [f for f in _made if f.alive]
    _kept_after_prune[0] = len(_made)
