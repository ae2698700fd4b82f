"""Batches held across ``fork()``: a process forked while the user holds batches keeps them.

A held batch is a view of a slot of a shared mapping, and a forked child inherits that mapping
shared. Once the parent drops the batch, the slot goes back to the workers, and without this
module the child would see the next batch written there. torch's child keeps its batch (its
batches are shared-memory files never reused, or private memory copied on write); so here, right
after a fork, the child replaces the slot of every batch its parent was lending by a private
copy of the same bytes (:func:`arena.privatize`), and the parent's ``fork()`` returns only once
the child has done so (or has died, or :data:`COPY_WAIT_S` passed: then it warns). A child that
never reads the batches, such as another DataLoader's worker, pays that copy too: the held
batches' bytes, once per child.

Invariants:
- Only slots lent by the forking process are copied (a grandchild's copies came with its parent),
  and only the slots of batches whose views are still alive (a slot the copy fence holds belongs
  to a batch that is gone).
- No slot the child copies is reused before its copy is complete: the parent can release a slot
  only after its own ``fork()`` has returned.
- shmloader's own workers are forked without it (:func:`forking_workers`): they never read the
  batches the main process lends, and write only through their own mappings.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
import warnings
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

from arena import privatize

if TYPE_CHECKING:
    from shmloader.lease import Leases

COPY_WAIT_S = 30.0  # longest a fork waits for the child to copy the batches it inherits

_tracked: weakref.WeakKeyDictionary[Leases, int] = weakref.WeakKeyDictionary()  # -> owner pid
_skip = False
_fork = threading.local()  # the forking thread's handshake pipe, from before the fork to after


def track(leases: Leases) -> None:
    """Copy ``leases``' lent slots into every child this process forks from now on."""
    _tracked[leases] = os.getpid()


@contextlib.contextmanager
def forking_workers() -> Iterator[None]:
    """Around starting shmloader's own workers: their forks copy nothing."""
    global _skip
    _skip = True
    try:
        yield
    finally:
        _skip = False


def _lent(pid: int) -> list[tuple[int, int]]:
    """The address ranges of the slots process ``pid`` lends, as of its last drain."""
    return [
        (lease.lo, lease.hi - lease.lo)
        for leases, owner in list(_tracked.items())
        if owner == pid
        for lease in leases.live()
        if lease() is not None
    ]


def _before() -> None:
    _fork.pipe = None if _skip or not _lent(os.getpid()) else os.pipe()


def _my_end(child: bool) -> int | None:
    """This side's end of the handshake pipe made before the fork (the other end closed here):
    the child writes, the parent reads. None when no pipe was made (nothing to copy)."""
    pipe: tuple[int, int] | None = getattr(_fork, "pipe", None)
    _fork.pipe = None
    if pipe is None:
        return None
    r, w = pipe
    os.close(r if child else w)
    return w if child else r


def _in_child() -> None:
    w = _my_end(child=True)
    if w is None:
        return
    try:
        for addr, nbytes in _lent(os.getppid()):
            privatize(addr, nbytes)
    finally:
        os.write(w, b"c")
        os.close(w)


def _in_parent() -> None:
    r = _my_end(child=False)
    if r is None:
        return
    try:
        if select.select([r], [], [], COPY_WAIT_S)[0]:
            os.read(r, 1)  # the child's byte, or EOF: it died before copying
        else:
            warnings.warn(
                f"a process forked while batches were held did not copy them within "
                f"{COPY_WAIT_S:.0f} s (is it stopped?); once you drop those batches, it may see "
                "later batches in their place. Drop or .clone() batches before forking.",
                RuntimeWarning,
                stacklevel=2,
            )
    finally:
        os.close(r)


os.register_at_fork(before=_before, after_in_parent=_in_parent, after_in_child=_in_child)
