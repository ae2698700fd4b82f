"""The arena a DataLoader keeps across its iterators: slabs, leases, pinning, batch-size hint.

Created at the loader's first multi-worker ``iter()`` *in a process* and kept while the loader or
any of its iterators lives there (each holds it; it closes itself when the last of them is gone).
So slabs are reserved, pre-faulted and page-locked once per loader, not once per epoch, and an
epoch's first tasks already know the batch size. Iterators borrow the host; their workers attach
its slabs.

Invariants:
- One host per loader per process: a host belongs to the process that made it (``pid``). A loader
  used in another process (after ``os.fork()``, or unpickled elsewhere) makes its own host there
  and never hands out the other process's slots; an inherited host's teardown does nothing.
- Every iterator of the loader allocates from the same arena, one at a time (all in the
  caller's thread), so interleaved iterators never share a slot. ``dispatches`` holds each live
  iterator's dispatcher, so that room made at the cap and slabs given back are seen by all of
  them (a slab given back is detached from every iterator's workers; another iterator's
  finished batches may be spilled for the batch needed next).
- ``sizes.largest`` is the largest of the latest batches of any iterator, in bytes
  (:mod:`shmloader.slotsize`); dispatch takes slots of that size, so steady state needs no
  NEED_SLOT round trip, and small batches stop taking big slots once batches have shrunk.
- ``endings`` keeps each iterator's :class:`~shmloader.ending.Ending` until it has run to its
  end; :meth:`end_pending` finishes those an interruption cut short.
- ``close()`` waits (at most ``CLOSE_SETTLE_S``) for the GPU's copies from the fence's slots
  and from the batches still held (one more event, ``Leases.fence_held``), unregisters pinned
  memory, then closes the arena; views still alive stay valid. A slab the
  GPU may still read from is never unregistered: after that wait it is left page-locked.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

from arena import Arena, Backend, userwarn
from arena.finalizers import on_death
from shmloader import afterfork
from shmloader.ending import Ending
from shmloader.export import StatsExport
from shmloader.fence import CopyFence, cuda_events
from shmloader.lease import Leases
from shmloader.pin import Pinner
from shmloader.rngstate import RngRing
from shmloader.slotsize import SlotSize
from shmloader.stats import LoaderStats

T = TypeVar("T")


class Members(Generic[T]):
    """A weak set that other threads read while the iterating thread adds to it (stats() in a
    logging thread as an iterator starts): a WeakSet read while another thread adds raises "Set
    changed size during iteration". ``add`` and ``snapshot`` take one re-entrant lock (a signal
    handler or ``__del__`` on the adding thread may read); members that die leave by
    themselves, which a WeakSet already defers while it is read."""

    def __init__(self) -> None:
        self._set: weakref.WeakSet[T] = weakref.WeakSet()
        self._lock = threading.RLock()

    def add(self, item: T) -> None:
        with self._lock:
            self._set.add(item)

    def snapshot(self) -> list[T]:
        with self._lock:
            return list(self._set)


# A retired host, as its successor keeps it: a reader of the batches still held from it, and
# the host itself, weakly (an iterator of it, or a traceback holding one, keeps it whole).
Retired = tuple[Callable[[], tuple[int, int]], "weakref.ref[ArenaHost]"]


class ArenaHost:
    """A loader's arena, lease table and pinner, in the process that made them."""

    def __init__(
        self,
        *,
        backend: Backend,
        max_bytes: int | None,
        slots_per_slab: int,
        pin: bool,
        pin_device: str | None,
        predecessors: Iterable[Retired] = (),
    ) -> None:
        self.pid = os.getpid()
        self.pin_setting = (pin, pin_device)  # as the iterator that made it asked
        # Retired with its books whole: pin_memory changed, and its iterators may still run.
        self.superseded = False
        self.arena = Arena(backend=backend, max_bytes=max_bytes, slots_per_slab=slots_per_slab)
        self.pinner = Pinner(pin, pin_device)
        # Page-locked slabs keep their pages: the GPU's copies may read any of them.
        registered = self.pinner.registered
        self.arena.can_hollow = lambda slab_id: not registered(slab_id)
        # Slots of page-locked slabs wait for the GPU's copies from them (shmloader.fence).
        fence = CopyFence(cuda_events(pin_device)) if pin else None
        self.leases = leases = Leases(self.arena, fence, self.pinner.registered)
        afterfork.track(self.leases)  # a child forked while batches are held keeps them
        self.sizes = SlotSize()
        self.worker_pids: tuple[int, ...] = ()
        # The RNG snapshot rings of the iterators that borrow this host (each closes with its
        # iterator): reported in stats, as every byte the loader holds is.
        self.rng_rings: Members[RngRing] = Members()
        # The dispatchers (shmloader.dispatch.Dispatch) of the iterators borrowing this host.
        self.dispatches: Members[Any] = Members()
        # Their endings, kept until each has run to its end (shmloader.ending).
        self.endings: list[Ending] = []
        self.export = StatsExport.from_environment()  # None unless a profiler asked
        # The loader's hosts retired before this one (their whole chain), each as a reader of
        # the batches the user still holds from it (Leases.counter) and a weak reference to it:
        # every snapshot -- stats(), and the export's rows -- counts what they still hold.
        self.predecessors: list[Retired] = list(predecessors)
        replaced = self.predecessors[-1][1]() if self.predecessors else None
        if replaced is not None and replaced.export is not None and self.export is not None:
            replaced.export.hand_over(self.export)  # one loader, one row stream (review 68)
        self._closer = on_death(self, _close, self.pid, self.pinner, self.arena, leases)

    @property
    def here(self) -> bool:
        """Whether this host belongs to the calling process."""
        return self.pid == os.getpid()

    @property
    def retired(self) -> bool:
        """Set when an iterator was interrupted half-way through a change of the books
        (shmloader.interrupts): the loader's next iterator makes a fresh host, and this one,
        once nothing uses it, closes keeping the memory only of the slots still read."""
        return self.leases.retired

    @retired.setter
    def retired(self, value: bool) -> None:
        self.leases.retired = value

    def snapshot(self) -> LoaderStats:
        leases = self.leases
        # One moment: no batch is lent between the reads. Re-entered from inside a lease or
        # arena operation (a signal handler, a __del__), it reads without the lock: waiting for
        # it there could wait on a thread that waits for the arena lock this thread holds.
        lock = contextlib.nullcontext() if leases.busy_here() else leases.lock
        with lock:
            held = leases.held  # drains first (unless re-entered): deaths so far are counted
            arena = self.arena.stats()
            kept, kept_bytes = leases.kept, leases.kept_bytes
            spilled = leases.spilled()
        rings = sum(r.nbytes for r in self.rng_rings.snapshot())
        retired = self.retired_held()
        return LoaderStats(
            arena, held, self.pinner.pinned_bytes, self.worker_pids,
            slots_kept=kept, bytes_kept=kept_bytes,
            batches_spilled=len(spilled), bytes_spilled=sum(spilled), bytes_rng_rings=rings,
            batches_retired=retired[0], bytes_retired=retired[1],
        )  # fmt: skip

    def succession(self) -> list[Retired]:
        """What a host that replaces this retired one carries: this one's predecessors, then
        this one."""
        return [*self.predecessors, (self.leases.counter(), weakref.ref(self))]

    def lenders(self) -> list[ArenaHost]:
        """The hosts whose iterators may still lend this loader's batches: this one, then those
        superseded before it (pin_memory changed between iterators) whose arena is still open,
        newest first. A host retired by an interruption lends nothing more: its books may be
        half-changed, and its iterator is unusable."""
        out = [self]
        for _, host_ref in reversed(self.predecessors):
            host = host_ref()
            if host is not None and host.superseded and not host.arena.closed:
                out.append(host)
        return out

    def retired_held(self) -> tuple[int, int]:
        """Batches the user holds from the retired hosts before this one, and the shared memory
        those hosts still hold: one still alive (not closed) holds its whole arena and its
        iterators' RNG rings; once closed, the slots held when it closed, in each slab a view
        still keeps mapped (Leases.counter). One closed with nothing left is forgotten (each
        removed alone: another thread may read too)."""
        batches, nbytes = 0, 0
        for entry in list(self.predecessors):
            count, host_ref = entry
            n, b = count()
            host = host_ref()
            if host is not None and not host.arena.closed:
                b = host.arena.bytes_reserved + sum(r.nbytes for r in host.rng_rings.snapshot())
            elif not n and not b:
                with contextlib.suppress(ValueError):
                    self.predecessors.remove(entry)
            batches, nbytes = batches + n, nbytes + b
        return batches, nbytes

    def end_pending(self) -> None:
        """At a safe point: finish the endings an interruption cut short, of iterators that are
        gone or asked to end, and forget those that finished."""
        if not self.here:
            return
        for ending in self.endings:
            ending.end_if_due()
        self.endings = [e for e in self.endings if not e.done]

    def close(self) -> None:
        """Unregister pinned slabs, then close the arena. Idempotent."""
        self._closer()


CLOSE_SETTLE_S = 60.0  # at close, the longest wait for the GPU's copies from the fence's slots


def _close(pid: int, pinner: Pinner, arena: Arena, leases: Leases) -> None:
    if os.getpid() != pid:
        return  # inherited through fork(): the owner closes its own
    fence = leases.fence
    try:
        # Slots of batches that died since the last drain go back first: the arena's close then
        # hollows every free slot, so a slab a held view (or a forked child) keeps alive keeps
        # only the memory of the slots still held.
        try:
            leases.drain()
        except BaseException:  # interrupted: the books may be half-changed (review 25)
            leases.retired = True
            raise
        stuck, held = False, 0
        # Copies still queued from the slabs finish before they are unlocked: those from the
        # slots of dead batches (the fence holds them), and those from batches the user still
        # holds (one more event). At interpreter exit CUDA may already be gone; then there is
        # nothing left to wait for.
        with contextlib.suppress(Exception):
            held = leases.fence_held()
        if fence:
            with contextlib.suppress(Exception):
                fence.settle(CLOSE_SETTLE_S)
                stuck = bool(fence)
        if stuck and fence is not None:
            # Unlocking slabs the GPU still reads could fault its copies: leave them locked.
            userwarn.warn(
                f"shmloader: the GPU has not passed copies queued from {fence.held + held} "
                f"page-locked arena slots after {CLOSE_SETTLE_S:.0f} s; the loader closes its "
                "arena but leaves its slabs page-locked until the process exits",
                RuntimeWarning,
            )
        else:
            pinner.close()
    finally:

        def books() -> None:
            # What the batches still held keep (Leases.counter): every slab whole until the
            # stranded slots are emptied (review 26: an interruption there skipped the books,
            # and stats missed what workers still mapped).
            leases.close_books(whole=True)
            if leases.retired:
                # A slot an interruption stranded (LENT, and no lease names it) is FREE nowhere
                # in the books: close() alone would keep its memory while a view keeps its slab.
                arena.empty_all_but(leases.read_ranges())
            leases.close_books()

        # Each step runs whatever another one raised.
        _every(books, arena.close, lambda: afterfork.track_closed(leases))


def _every(*steps: Callable[[], object]) -> None:
    """Run every step in order, each whatever the ones before it raised; then raise the first
    error, if any."""
    first: BaseException | None = None
    for step in steps:
        try:
            step()
        except BaseException as e:  # noqa: BLE001 - re-raised below, after the other steps
            first = first or e
    if first is not None:
        try:
            raise first
        finally:  # (a local holding the error its traceback holds this frame by: a cycle;
            first = None  # review 81)
