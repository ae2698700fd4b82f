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
- Only slots lent by the forking process are copied (a grandchild's copies came with its
  parent), those a shmloader worker shares uncopied when that worker forks (``_shared_from``:
  its parent's, and those its parent shares uncopied in turn, in a worker of a loader made
  inside a worker), and, inside a worker's task, the slot it is writing (:func:`_writing`);
  of lent slots, only those of batches whose views are still alive at the fork itself (a slot
  the copy fence holds belongs to a batch that is gone).
- No slot the child copies is reused before its copy is complete: from this fork's hook until
  the child has reported, every loader keeps the slots it lends, and any it lends before the
  fork is done (``lease.FORKS_PENDING``), from reuse (a quarantine, lifted in the parent after
  the fork), since the parent's other threads run on meanwhile and may drop those batches.
- shmloader's workers (forked inside :func:`forking_workers`, in the forking thread only) copy
  nothing: instead every loader of this process keeps the slots it lends at that fork from reuse
  until those workers are gone (:class:`Keep`, :class:`~shmloader.lease.Quarantine`), and
  the workers keep sharing those slots' pages. That costs no copy and no memory per worker, and
  the workers' code (a dataset holding batches of this or another loader: a replay pool, a
  memory bank) still sees those batches as they were.
- Nothing here takes a lock in the child (another thread of the parent may have held it at the
  fork): the child reads its copy of the parent's tables under the GIL.
- An interruption in a hook (a signal handler's exception: CPython reports it and forks on) is
  survived: the parent's before-fork work is done once more, reusing what the first try made;
  a pending keep names its forking thread, whose lends skip it and whose next fork drops it;
  the parent waits for the child's copy whatever it was interrupted at; the child copies once,
  and says it failed if interrupted, so that the parent warns (reviews 63-65). Not covered: a
  hook's first lines, before any ``try`` (the interpreter checks for signals on entry).
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
import time
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple, TypeVar

from arena import Mapping, Segment, privatize, userwarn
from shmloader import collate
from shmloader.lease import FORKS_PENDING, KeptTables, Quarantine

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
# In a shmloader worker: the processes whose lent slots it shares without a copy: its parent,
# and, in a worker of a loader made inside a worker, that worker's own (review 30: a process a
# nested worker forked copied its parent's lent slots but not the main process's).
_shared_from: tuple[int, ...] = ()
# Other shared memory of this process's loaders that no child reads (RNG rings) -> owner pid.
_private: weakref.WeakKeyDictionary[Segment, int] = weakref.WeakKeyDictionary()
_pending_lock = threading.Lock()  # changes to lease.FORKS_PENDING, in the parent (never held
# across a fork: a child starts with it free)
# Per forking thread, from before the fork to after: the forking pid, the handshake pipe, the
# quarantine to lift, and whether it is starting shmloader workers (which copy nothing).
# Thread-local: another thread's fork, even while workers start here, copies as usual.
_fork = threading.local()

K = TypeVar("K")
V = TypeVar("V")


def _entries(table: weakref.WeakKeyDictionary[K, V]) -> list[tuple[K, V]]:
    """``table``'s live entries, read at once. Iterating a weak dictionary raises
    ``RuntimeError`` (dictionary changed size) when code that the garbage collector runs
    meanwhile changes it explicitly: a loader's finalizer closing its arena
    (:func:`track_closed` pops its table), inside a fork hook (review 31). Copying the
    underlying dict allocates nothing per entry, so no collection runs inside the copy."""
    data: dict[weakref.ref[K], V] = table.data  # type: ignore[attr-defined]
    refs = data.copy()
    return [(k, v) for k, v in ((ref(), v) for ref, v in refs.items()) if k is not None]


def track(leases: Leases) -> None:
    """Copy ``leases``' lent slots into every child this process forks from now on."""
    _tracked[leases] = os.getpid()


def track_closed(leases: Leases) -> None:
    """``leases``' arena has just closed in this process (its owner): a child forked from now
    on still copies the batches lent then and lets go of the slabs their views keep mapped, for
    as long as any of them is (after ``leases`` itself is gone too). Its slots are never reused,
    so a fork keeps them from nothing; but the shmloader workers it forks share them, and
    :class:`Keep` says so to the table's stats. The table is in ``_tracked`` or in
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


class Keep:
    """The slots kept from reuse for one set of children (a supervisor's workers, or one plain
    child while it copies): one quarantine per loader (and per closed arena), to which each
    later fork adds what is lent then (review 28: one per fork piled up in a loader not
    drained). :meth:`lift` lets them all go: safe from a finalizer, more than once, and after
    an interruption in :meth:`take` (which records before it keeps anything)."""

    __slots__ = ("closed", "tables")

    def __init__(self) -> None:
        self.tables = KeptTables()  # id(leases) -> its quarantine
        self.closed: dict[int, tuple[list[Quarantine], Quarantine]] = {}  # id(record's list)

    def take(self, pid: int) -> None:
        """Keep every slot the loaders of process ``pid`` lend now (call in ``pid``)."""
        for leases, owner in _entries(_tracked):
            if owner == pid:
                leases.quarantine(self.tables)
        for record in [c for c in list(_closed) if c.owner == pid]:
            refs = [lease.slot for lease in record.leases if lease() is not None]
            have = self.closed.get(id(record.kept))
            if have is not None:
                have[1].refs.update(refs)
            elif refs:
                q = Quarantine(refs)
                self.closed[id(record.kept)] = (record.kept, q)
                record.kept.append(q)

    def lift(self) -> None:
        """Let every slot kept go; interrupted, try all once more before the interruption
        goes on (review 27: one in an at-fork hook or a finalizer is never retried)."""
        try:
            self._lift()
        except BaseException:
            self._lift()
            raise

    def _lift(self) -> None:
        self.tables.lifted = True  # a lend racing this lift adds nothing more (review 29)
        for leases, q, _ in list(self.tables.values()):
            leases.lift(q)
        for quarantines, q in list(self.closed.values()):
            q.active = False
            q.refs = set()  # (read only while active)
            with contextlib.suppress(ValueError):
                quarantines.remove(q)


@contextlib.contextmanager
def forking_workers(keep: Keep) -> Iterator[None]:
    """Around starting shmloader workers in this thread: their forks copy nothing; instead each
    fork adds to ``keep`` the slots every loader lends at that moment (in the fork's own hook,
    and any lent until the fork is done: a batch another thread lends while the workers start
    is kept too, reviews 27 and 28)."""
    _fork.workers = keep
    try:
        yield
    finally:
        _fork.workers = None


def _lent(*pids: int | None) -> list[tuple[int, int]]:
    """The address ranges of the slots processes ``pids`` lend, as of their last drain, from
    open arenas and closed ones."""
    tables = [leases.live() for leases, owner in _entries(_tracked) if owner in pids]
    tables += [c.leases for c in list(_closed) if c.owner in pids]
    return [(lease.lo, lease.hi - lease.lo) for t in tables for lease in t if lease() is not None]


def _in_task() -> bool:
    """Whether this is a shmloader worker inside a task with a slot (a fork here copies what
    is written by then, :func:`_writing`; decided at the hook, since another thread may
    allocate before the fork: review 33)."""
    session = collate.current_session()
    return session is not None and session.slot is not None


def _writing() -> tuple[int, int] | None:
    """In a shmloader worker, inside a task: the ``(address, bytes)`` of the part of the slot
    written so far (read in the child, as of the fork). A process forked there (in the dataset
    or the collate_fn) copies it: the main process reuses the slot once that batch is gone
    (review 30: a child forked in a collate_fn that filled ``shmloader.empty()`` read the next
    epoch's batch there)."""
    session = collate.current_session()
    return None if session is None else session.slot_range()


def _let_go(pid: int, keep: list[tuple[int, int]]) -> None:
    """In a child: give up process ``pid``'s arenas, open or closed, but the ranges in
    ``keep``."""
    arenas = {id(x.arena): x.arena for x, owner in _entries(_tracked) if owner == pid}
    for arena in arenas.values():
        arena.let_go_after_fork(keep)
    for closed in [c for c in list(_closed) if c.owner == pid]:
        for mapping in closed.mappings:
            mapping.let_go_after_fork(keep)
    for segment in [seg for seg, owner in _entries(_private) if owner == pid]:
        segment.let_go_after_fork([])


def _before() -> None:
    # Nothing a fork hook raises stops the fork: interrupted (a signal handler's exception),
    # the work is done once more, reusing what the first try made, before the interruption is
    # reported (review 64: interrupted early, a plain child copied nothing and read later
    # batches in the slots it had been forked with).
    fresh = [True]
    try:
        _prepare_fork(fresh)
    except BaseException:
        _prepare_fork(fresh)
        raise


def _prepare_fork(fresh: list[bool]) -> None:
    pid = os.getpid()
    if fresh[0]:  # (this fork's first try)
        _fork.parent = pid
        _fork.pipe = None
        _fork.keep = None
        fresh[0] = False
    workers: Keep | None = getattr(_fork, "workers", None)
    _fork.worker = workers is not None
    if workers is not None:  # a shmloader worker: it shares what is lent now, until it ends
        _keep_until_forked(workers, pid)
    # A plain child copies what is lent at the fork itself: also when nothing is lent at this
    # hook, if a loader of this process may lend before the fork (review 29).
    may_lend = any(owner == pid for _, owner in _entries(_tracked))
    _fork.copy = workers is None and (
        may_lend or _in_task() or bool(_lent(pid, *_shared_from))
    )
    if _fork.copy:
        # The parent's other threads run on while the child copies, and may drop those batches.
        if _fork.keep is None:
            _fork.keep = Keep()
        _keep_until_forked(_fork.keep, pid)
        if _fork.pipe is None:
            with contextlib.suppress(OSError):  # no pipe (no descriptors left): the child
                _fork.pipe = os.pipe()  # still copies, but the parent cannot wait for it


def _keep_until_forked(keep: Keep, pid: int) -> None:
    """Add to ``keep`` every slot lent now, and every slot lent from now until the fork is done
    (:data:`shmloader.lease.FORKS_PENDING`, cleared after the fork on both sides): Python runs
    other fork hooks (logging's lock), takes the import lock and forks after this one, and
    other threads lent meanwhile (review 28: a worker shared, or a plain child copied, a slot
    not kept). Nothing a fork hook raises stops the fork, so an interruption takes it once
    more (it only adds) before it is reported."""
    me = threading.get_ident()
    keep.tables.thread = me
    _fork.pending = keep.tables
    with _pending_lock:
        # first: a lend racing the snapshot adds itself; and without what an interruption in
        # this thread's earlier fork hooks left (this thread is in no other fork: review 64)
        FORKS_PENDING[:] = [k for k in FORKS_PENDING if k.thread != me]
        FORKS_PENDING.append(keep.tables)
    try:
        keep.take(pid)
    except BaseException:
        keep.take(pid)
        raise


def _fork_done() -> None:
    """After the fork (either side): lends no longer join this fork's keep. Nothing a fork
    hook raises stops the fork, so an interruption takes it once more (it only removes) before
    it is reported (review 63: a Ctrl-C there left the keep pending for good, and every batch
    lent from then on was kept for the persistent workers: the arena grew past its cap)."""
    try:
        _forget_pending(getattr(_fork, "pending", None))
    except BaseException:
        _forget_pending(getattr(_fork, "pending", None))
        raise
    finally:
        _fork.pending = None


def _forget_pending(pending: KeptTables | None) -> None:
    if pending is None:
        return
    with _pending_lock:  # (the parent only; by identity: another fork's keep may be equal)
        FORKS_PENDING[:] = [kept for kept in FORKS_PENDING if kept is not pending]


def _take_pipe() -> tuple[int, int] | None:
    """The handshake pipe made before the fork, ``(read end, write end)``, taken from this
    thread's fork record in one step (review 65: read, then cleared, an interruption between
    lost both ends); None when no pipe was made. The child writes, the parent reads."""
    pipe: tuple[int, int] | None
    pipe, _fork.pipe = getattr(_fork, "pipe", None), None
    return pipe


def _in_child() -> None:
    # The pipe first, and the word to the parent in a finally: interrupted anywhere after, the
    # parent hears "failed" at once and warns (review 64: it waited COPY_WAIT_S for a child that
    # never copied). Not done twice: a step repeated after an interruption can lose what the
    # first did (review 65: the slot being written; a range half remapped, copied as zeros).
    pipe = _take_pipe()
    done = b"x"  # copying failed, or was interrupted: the parent warns
    copied = None
    try:
        if pipe is not None:
            os.close(pipe[0])
        copied = _child_side()
        done = b"c"
    finally:
        if pipe is not None:
            with contextlib.suppress(OSError):
                os.write(pipe[1], done)
            os.close(pipe[1])
    if copied is not None:
        with contextlib.suppress(OSError):  # (no memory for the page tables: a mapping stays)
            _let_go(*copied)


def _child_side() -> tuple[int, list[tuple[int, int]]] | None:
    """The child's after-fork work: fresh fork books; then a plain child copies the slots its
    parent lent at the fork. The parent's pid and the ranges kept, for :func:`_let_go`; None
    when the parent's hook did not run."""
    global _shared_from, _pending_lock
    # Another thread of the parent may have held it at the fork (review 29: the child's next
    # fork waited for good): a fresh one.
    _pending_lock = threading.Lock()
    FORKS_PENDING.clear()  # the parent's forks; none of this process
    _fork.pending = None
    _fork.workers = None  # the parent was starting workers; a fork here is no worker's
    copy, _fork.copy = getattr(_fork, "copy", False), False
    parent, _fork.parent = getattr(_fork, "parent", None), None
    _fork.keep = None  # the parent's to lift
    if parent is None:
        return None
    keep = _lent(parent, *_shared_from)
    writing = _writing()
    if writing is not None:
        keep.append(writing)
    # The parent's batch in progress is not this process's: shmloader.empty() here allocates
    # privately, as outside a worker (review 33: it handed out the parent's slot, shared,
    # whose pages the main process lends later).
    collate.end_session_after_fork()
    if getattr(_fork, "worker", False):
        # A shmloader worker shares its parent's lent slots uncopied: a process it forks
        # copies them (review 28: a grandchild read a slot reused once the worker ended), and
        # those its parent shares uncopied in turn.
        _shared_from = (*_shared_from, parent)
    if copy:
        for addr, nbytes in keep:
            privatize(addr, nbytes)
    return parent, keep


def _in_parent() -> None:
    try:
        _fork_done()
    finally:  # (interrupted there: the child still copies, and is waited for, then it is raised)
        _wait_for_the_copy()


def _wait_for_the_copy() -> None:
    """The parent's side of a plain child's copy of the slots lent at the fork: wait for it
    (at most ``COPY_WAIT_S``), then lift this fork's keep. Interrupted (a signal handler's
    exception; the fork goes on regardless), it does what is left, the wait included, before
    the keep is lifted and the interruption goes on (reviews 64, 65: lifted at once, the slot
    was reused under the child's copy)."""
    deadline = time.monotonic() + COPY_WAIT_S
    keep: Keep | None = None
    pipe: tuple[int, int] | None = None
    waited = False

    def steps() -> None:
        """Each step once: called again after an interruption, it does what is left."""
        nonlocal keep, pipe, waited
        _fork.copy = False
        if keep is None:
            keep, _fork.keep = getattr(_fork, "keep", None), None
        if pipe is None:
            pipe = _take_pipe()
            if pipe is not None:
                os.close(pipe[1])
        if pipe is not None and not waited:
            _await_copy(pipe[0], deadline)
        waited = True

    try:
        try:
            steps()
        except BaseException:
            with contextlib.suppress(Exception):
                steps()
            raise
    finally:
        if pipe is not None:
            os.close(pipe[0])
        if keep is not None:
            keep.lift()


def _await_copy(r: int, deadline: float) -> None:
    """Wait until ``deadline`` for the child's word on ``r``: warn if it is late or failed."""
    poller = select.poll()  # not select(): descriptors past 1024 are common in big jobs
    poller.register(r, select.POLLIN)
    if not poller.poll(max(0, int((deadline - time.monotonic()) * 1000))):
        _warn(f"did not copy them within {COPY_WAIT_S:.0f} s (is it stopped?)")
    elif os.read(r, 1) == b"x":  # (EOF: the child died first, and holds nothing)
        _warn("could not copy them (out of memory?)")


def _warn(what: str) -> None:
    userwarn.warn(
        f"a process forked while batches were held {what}; once you drop those batches, it may "
        "see later batches in their place. Drop or .clone() batches before forking.",
        RuntimeWarning,
    )


os.register_at_fork(before=_before, after_in_parent=_in_parent, after_in_child=_in_child)
