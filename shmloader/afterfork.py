"""Batches held across ``fork()``: a process forked while the user holds batches keeps them, and
lets go of the rest of its parent's arenas.

A held batch is a view of a slot of a shared mapping, and a forked child inherits that mapping
shared. Once the parent drops the batch, the slot goes back to the workers, and without this
module the child would see the next batch written there. torch's child keeps its batch (its
batches are shared-memory files never reused, or private memory copied on write); so here, right
after a fork, the child replaces the slot of every batch its parent was lending by a private
copy of the same bytes (:func:`arena.privatize`), and the parent's ``fork()`` returns only once
the child has done so or has died (it warns if the copy failed, or took over
:data:`COPY_WAIT_S`). A child that never reads the batches, such as a torch DataLoader's
worker, pays that copy too: the held batches' bytes, once per child.

Every other part of the parent's arenas (free slots, slots being written, slots of dropped
batches) the child never reads, so it replaces those mappings by empty private pages
(:func:`arena.forsake`) and closes the slabs' inherited descriptors; so too with the parent's
other shared memory that no child reads (:func:`track_private`: the iterators' RNG rings).
Otherwise a long-lived child (a persistent worker of another loader, a
``multiprocessing.Process``) would keep every slab alive in ``/dev/shm`` after the parent gave
it back or dropped its loader, unseen by ``stats()``. (The slab of a slot a shmloader worker
shares stays alive until that worker exits.)

An arena that closes while the user still holds its batches (the loader was dropped, or
replaced its arena) keeps each slab those batches' views map; its table leaves :data:`_tracked`
for :data:`_closed` (:func:`track_closed`), which holds only weak references, so that a child
forked later still copies those batches and lets go of those slabs (review 22: it kept them in
``/dev/shm`` for its whole life, after the parent dropped the batches).

Invariants:
- Only slots lent by the forking process are copied (a grandchild's copies came with its parent),
  and only the slots of batches whose views are still alive (a slot the copy fence holds belongs
  to a batch that is gone).
- No slot the child copies is reused before its copy is complete: from just before the fork until
  the child has reported, every loader keeps the slots it lends from reuse (a quarantine, lifted
  in the parent after the fork), since the parent's other threads run on meanwhile and may drop
  those batches.
- shmloader's workers (forked inside :func:`forking_workers`, in the forking thread only) copy
  nothing: instead every loader of this process keeps the slots it lends at that fork from reuse
  until those workers are gone (:func:`keep_lent`, :class:`~shmloader.lease.Quarantine`), and
  the workers keep sharing those slots' pages. That costs no copy and no memory per worker, and
  the workers' code (a dataset holding batches of this or another loader: a replay pool, a
  memory bank) still sees those batches as they were.
- Nothing here takes a lock in the child (another thread of the parent may have held it at the
  fork): the child reads its copy of the parent's tables under the GIL.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, NamedTuple

from arena import Mapping, Segment, privatize, userwarn
from shmloader.lease import Quarantine

if TYPE_CHECKING:
    from shmloader.lease import Lease, Leases

COPY_WAIT_S = 30.0  # longest a fork waits for the child to copy the batches it inherits


class _Closed(NamedTuple):
    """A closed arena of process ``owner``, while a view of one of its slabs lives there."""

    owner: int
    leases: list[Lease]  # the batches lent when it closed (weak)
    mappings: list[Mapping]  # its slabs' mappings (weak)
    kept: list[Quarantine]  # its table's quarantines, which its stats count (Leases.counter)


_tracked: weakref.WeakKeyDictionary[Leases, int] = weakref.WeakKeyDictionary()  # -> owner pid
_closed: list[_Closed] = []  # arenas closed while views of them live (track_closed)
# Other shared memory of this process's loaders that no child reads (RNG rings) -> owner pid.
_private: weakref.WeakKeyDictionary[Segment, int] = weakref.WeakKeyDictionary()
# Per forking thread, from before the fork to after: the forking pid, the handshake pipe, the
# quarantine to lift, and whether it is starting shmloader workers (which copy nothing).
# Thread-local: another thread's fork, even while workers start here, copies as usual.
_fork = threading.local()


def track(leases: Leases) -> None:
    """Copy ``leases``' lent slots into every child this process forks from now on."""
    _tracked[leases] = os.getpid()


def track_closed(leases: Leases) -> None:
    """``leases``' arena has just closed in this process (its owner): a child forked from now
    on still copies the batches lent then and lets go of the slabs their views keep mapped, for
    as long as any of them is (after ``leases`` itself is gone too). Its slots are never reused,
    so a fork keeps them from nothing; but the shmloader workers it forks share them, and
    :func:`keep_lent` says so to the table's stats. The table is in ``_tracked`` or in
    ``_closed`` at every step (an interruption here must not lose it: review 24)."""
    mappings = [slab.segment.mapping for slab in leases.arena.slabs()]
    _closed[:] = [c for c in _closed if any(m.alive() for m in c.mappings)]
    if any(m.alive() for m in mappings):
        _closed.append(_Closed(os.getpid(), leases.live(), mappings, leases.quarantines))
    _tracked.pop(leases, None)


def track_private(segment: Segment) -> None:
    """Let every child this process forks from now on give ``segment`` up at once: shared
    memory that no child reads through the mapping it inherits (an iterator's RNG ring; its own
    workers attach it afresh). Review 14: other loaders' persistent workers, and any other child,
    kept each ring they were forked beside for their whole life, unseen by ``stats()``."""
    _private[segment] = os.getpid()


@contextlib.contextmanager
def forking_workers(lifts: list[Callable[[], None]]) -> Iterator[None]:
    """Around starting shmloader workers in this thread: their forks copy nothing; instead each
    fork keeps the slots every loader lends at that moment from reuse (:func:`keep_lent`, in
    the fork's own hook: a batch another thread lends while the workers start is kept too,
    review 27), and adds to ``lifts`` the function that lets them go."""
    _fork.workers = lifts
    try:
        yield
    finally:
        _fork.workers = None


def lift_all(lifts: list[Callable[[], None]]) -> None:
    """Call every lift :func:`keep_lent` added to ``lifts``; interrupted, call them all once
    more (each is idempotent) before the interruption goes on, so that no slot stays kept for
    good (review 27: an interruption in an at-fork hook or a finalizer is never retried)."""
    try:
        for lift in list(lifts):
            lift()
    except BaseException:
        for lift in list(lifts):
            lift()
        raise


def keep_lent(lifts: list[Callable[[], None]]) -> None:
    """Every loader of this process keeps the slots it lends now from reuse (before forking
    shmloader workers, or a child that copies them), and adds to ``lifts``, before anything is
    kept, the function that lets them go once no child needs them (safe to call from a
    finalizer, and more than once; an interruption here leaves what was kept so far to it:
    review 26). A closed arena's slots are never reused, but while such children live they
    share those lent now, and its stats count them
    (:meth:`~shmloader.lease.Leases.counter`)."""
    pid = os.getpid()
    kept: list[tuple[Leases, Quarantine]] = []
    shared: list[tuple[list[Quarantine], Quarantine]] = []

    def lift() -> None:
        for leases, q in list(kept):
            leases.lift(q)
        for quarantines, q in list(shared):
            q.active = False
            with contextlib.suppress(ValueError):
                quarantines.remove(q)

    lifts.append(lift)
    for leases, owner in list(_tracked.items()):
        if owner == pid:
            leases.quarantine(kept)
    for closed in [c for c in list(_closed) if c.owner == pid]:
        refs = [lease.slot for lease in closed.leases if lease() is not None]
        if refs:
            q = Quarantine(refs)
            shared.append((closed.kept, q))
            closed.kept.append(q)


def _lent(pid: int) -> list[tuple[int, int]]:
    """The address ranges of the slots process ``pid`` lends, as of its last drain, from open
    arenas and closed ones."""
    tables = [leases.live() for leases, owner in list(_tracked.items()) if owner == pid]
    tables += [c.leases for c in list(_closed) if c.owner == pid]
    return [(lease.lo, lease.hi - lease.lo) for t in tables for lease in t if lease() is not None]


def _let_go(pid: int, keep: list[tuple[int, int]]) -> None:
    """In a child: give up process ``pid``'s arenas, open or closed, but the ranges in
    ``keep``."""
    arenas = {id(x.arena): x.arena for x, owner in list(_tracked.items()) if owner == pid}
    for arena in arenas.values():
        arena.let_go_after_fork(keep)
    for closed in [c for c in list(_closed) if c.owner == pid]:
        for mapping in closed.mappings:
            mapping.let_go_after_fork(keep)
    for segment in [seg for seg, owner in list(_private.items()) if owner == pid]:
        segment.let_go_after_fork([])


def _before() -> None:
    pid = os.getpid()
    _fork.parent = pid
    _fork.pipe = None
    _fork.lifts = []
    workers: list[Callable[[], None]] | None = getattr(_fork, "workers", None)
    if workers is not None:  # a shmloader worker: it shares what is lent now, until it ends
        try:
            keep_lent(workers)
        except BaseException:
            # Once more (keeping twice is harmless): nothing a fork hook raises stops the
            # fork, so an interruption must not leave the worker sharing a slot not kept.
            keep_lent(workers)
            raise
    _fork.copy = workers is None and bool(_lent(pid))
    if _fork.copy:
        # The parent's other threads run on while the child copies, and may drop those batches.
        keep_lent(_fork.lifts)
        with contextlib.suppress(OSError):  # no pipe (no descriptors left): the child still
            _fork.pipe = os.pipe()  # copies, but the parent cannot wait for it


def _my_end(child: bool) -> int | None:
    """This side's end of the handshake pipe made before the fork (the other end closed here):
    the child writes, the parent reads. None when no pipe was made."""
    pipe: tuple[int, int] | None = getattr(_fork, "pipe", None)
    _fork.pipe = None
    if pipe is None:
        return None
    r, w = pipe
    os.close(r if child else w)
    return w if child else r


def _in_child() -> None:
    copy, _fork.copy = getattr(_fork, "copy", False), False
    parent, _fork.parent = getattr(_fork, "parent", None), None
    _fork.lifts = []  # the parent's to call
    w = _my_end(child=True)
    if parent is None:
        return
    done = b"x"  # copying failed: the parent warns
    keep = _lent(parent)
    try:
        if copy:
            for addr, nbytes in keep:
                privatize(addr, nbytes)
        done = b"c"
    finally:
        if w is not None:
            with contextlib.suppress(OSError):
                os.write(w, done)
            os.close(w)
    with contextlib.suppress(OSError):  # (no memory for the page tables: a mapping stays)
        _let_go(parent, keep)


def _in_parent() -> None:
    _fork.copy = False
    lifts, _fork.lifts = getattr(_fork, "lifts", []), []
    r = _my_end(child=False)
    try:
        if r is None:
            return
        poller = select.poll()  # not select(): descriptors past 1024 are common in big jobs
        poller.register(r, select.POLLIN)
        if not poller.poll(int(COPY_WAIT_S * 1000)):
            _warn(f"did not copy them within {COPY_WAIT_S:.0f} s (is it stopped?)")
        elif os.read(r, 1) == b"x":  # (EOF: the child died first, and holds nothing)
            _warn("could not copy them (out of memory?)")
    finally:
        if r is not None:
            os.close(r)
        lift_all(lifts)


def _warn(what: str) -> None:
    userwarn.warn(
        f"a process forked while batches were held {what}; once you drop those batches, it may "
        "see later batches in their place. Drop or .clone() batches before forking.",
        RuntimeWarning,
    )


os.register_at_fork(before=_before, after_in_parent=_in_parent, after_in_child=_in_child)
