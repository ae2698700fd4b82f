"""Lending batches: views over a slot, and the slot's return once the last view is gone.

A batch is rebuilt (:mod:`shmloader.rebuild`) from one per-batch NumPy array over its slot, whose
base ``memoryview`` every view of the batch keeps alive. A :class:`Lease` is a weak reference to
that memoryview naming the slot *and its generation* (a :class:`~arena.SlotRef`).

Lease life cycle::

    open: READY -> LENT, lease live --last view dies--> dead (queued) --drain--> slot FREE
                            |
                            +--release_early--> slot FREE, lease forgotten (a later death: no-op)
                            +--let_go, views die with it--> slot FREE at once (no fence)

Invariants:
- A slot is released only after every view of its batch is gone (or by ``release_early``).
- Nothing here that can run inside the garbage collector takes a lock or touches the arena: a
  view's death (the weakref callback) and an iterator's finalizer only *append* to :attr:`dead`
  (``deque.append``, atomic under the GIL). The owner drains :attr:`dead` at safe points
  (:meth:`Leases.drain`: each ``__next__``, each ``stats()``, before the arena grows).
- Threads: one re-entrant lock guards the lease tables, the fence and the quarantines, so
  ``stats()``, ``shmloader.release()`` and the iterator may run in different threads. Code that
  runs *inside* a lease or arena operation of its own thread (a signal handler, a ``__del__``
  run by the garbage collector) and calls back in never waits for that thread: a drain there
  does nothing, and an early release is queued on :attr:`dead` for the next drain.
- Every release names a generation: a second release of a lease, or of a slot that has moved on
  to another batch, is a no-op that returns 0.
- ``held`` (after a drain) is the number of batches lent and not yet returned.
- With a :class:`~shmloader.fence.CopyFence` (a page-locked arena), the slot of a batch whose last
  view died, or that was released early, goes back only once the GPU has passed the copies the
  user may have queued from it; until then it stays LENT and is not counted in ``held``.
- A slot lent when shmloader workers were forked (they share its pages) goes back only once
  those workers are gone (:class:`Quarantine`); until then it stays LENT, counted in ``kept``,
  not in ``held``, and not against the arena's cap.
- A finished batch the dispatcher *spills* (:meth:`Leases.spill`: copied out of its READY slot so
  the batch needed next can have that room) is rebuilt from the copy, with no lease; the copies
  alive (waiting their turn, or views of them with the user) are in :meth:`Leases.spilled`.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

from arena import Arena, Mapping, SlotRef
from shmloader import protocol as P
from shmloader.fence import CopyFence
from shmloader.rebuild import Rebuilder

# The keeps (``afterfork.Keep.tables``) of forks under way in this process, from their first
# hook until the fork is done: a batch lent meanwhile joins each (the child shares, or copies,
# what was lent at the fork itself, which other threads may lend to after the hook's snapshot).
FORKS_PENDING: list[KeptTables] = []


class Kept(NamedTuple):
    """A keeper's quarantine of one lease table, and the table's :attr:`Leases.lends` when the
    quarantine last took every batch lent (:meth:`Leases.quarantine`)."""

    table: Leases
    quarantine: Quarantine
    lends: int


class KeptTables(dict):  # type: ignore[type-arg]
    """A keeper's :class:`Kept` entries, by ``id`` of their lease table; ``lifted`` once let
    go, after which it takes no more. ``thread``: the thread whose fork it is pending for, while
    in :data:`FORKS_PENDING`."""

    lifted = False
    thread: int | None = None


def forks_of_other_threads() -> list[KeptTables]:
    """The keeps in :data:`FORKS_PENDING` a lend by the calling thread joins: those of forks
    under way in other threads. A thread that lends is inside no fork of its own, so an entry
    of its own was left by an interruption in its fork hooks, which nothing may stop (review
    64: a Ctrl-C there kept every later batch for the workers forked then, past the cap); the
    thread's next fork drops it (``afterfork``)."""
    me = threading.get_ident()
    return [kept for kept in list(FORKS_PENDING) if kept.thread != me]


class Lease(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to a batch's keep-alive memoryview, naming its slot and generation."""

    __slots__ = ("hi", "keys", "lo", "slot")
    slot: SlotRef
    keys: tuple[int, ...]  # early-release keys: leaf storages and the keep-alive's id
    lo: int  # address range of the slot
    hi: int


class Spilled(NamedTuple):
    """A finished batch copied out of its slot: ``ready`` (its READY message: the layout and
    descriptor) over ``buffer``, the slot's bytes in the main process's own memory."""

    ready: P.Ready
    buffer: np.ndarray


class Quarantine:
    """The slots lent when shmloader workers (of any loader) were forked. Those workers share the
    slots' pages (they skip :mod:`shmloader.afterfork`'s private copy), and code they run may
    still read a batch the main process has since dropped, as a torch worker reads its
    copy-on-write one; so none of these slots is reused until the workers are gone
    (:meth:`Leases.lift`)."""

    __slots__ = ("active", "held", "refs")

    def __init__(self, refs: list[SlotRef]) -> None:
        self.refs = set(refs)
        self.held: list[SlotRef] = []  # of refs, those whose batch the main process let go
        self.active = True


class ClosedSlab(NamedTuple):
    """A slab of a closed arena, for :meth:`Leases.counter`."""

    held: int  # bytes of the slots held (or kept) when it closed
    mapping: Mapping | None  # this process's mapping (weak); None: kept whole for good


class ClosedBooks(NamedTuple):
    """What a closed arena keeps: its slabs, and the quarantines of the shmloader workers that
    may share its slots (the table's own list: :mod:`shmloader.afterfork` adds to it)."""

    slabs: dict[int, ClosedSlab]
    kept: list[Quarantine]


def _held_ranges(live: dict[int, Lease]) -> list[tuple[int, int]]:
    """The ``(address, bytes)`` of the slots of the leases in ``live`` whose views are alive."""
    return [(lease.lo, lease.hi - lease.lo) for lease in list(live.values()) if lease() is not None]


class Leases:
    """The batches of one arena that the user holds."""

    def __init__(
        self,
        arena: Arena,
        fence: CopyFence | None = None,
        fenced: Callable[[int], bool] = lambda slab_id: True,
    ) -> None:
        self.arena = arena
        # Guards everything below but `dead` against other threads (see the module's invariants).
        self.lock = threading.RLock()
        self._inside: int | None = None  # the thread inside a drain, early release or settle
        self.fence = fence  # None: slots go back as soon as their batch is gone
        self._fenced = fenced  # whether a slab's slots go through the fence (it is page-locked)
        self.dead: deque[Lease | SlotRef | Quarantine] = deque()  # appended from callbacks
        self.quarantines: list[Quarantine] = []  # active, or lifted and not yet drained
        self.rebuilder = Rebuilder()
        self._live: dict[int, Lease] = {}  # id -> lease (a weakref hashes as its referent)
        self._by_key: dict[int, Lease] = {}
        self._slabs: dict[int, tuple[memoryview, int, int]] = {}  # id -> (buffer, slot size, base)
        self._spilled: list[weakref.ref[np.ndarray]] = []  # copies, some perhaps dead
        # Batches lent so far: a keeper whose quarantine took every batch lent when this was
        # the same has nothing to add (each worker's fork of an iterator asks again).
        self.lends = 0
        # An interruption may have left these books (or the arena's) half-changed: the host is
        # retired, and at its close only what is known to be read keeps its memory (read_ranges).
        self.retired = False
        # What the arena keeps once closed (close_books); None while open. In a box of its own:
        # counter() reads it without holding this table.
        self.at_close: list[ClosedBooks | None] = [None]

    def live(self) -> list[Lease]:
        """The leases of batches lent and not yet returned (as of the last drain)."""
        return list(self._live.values())

    @property
    def held(self) -> int:
        self.drain()
        return len(self._live)

    def read_ranges(self) -> list[tuple[int, int]]:
        """The ``(address, bytes)`` of every slot something may still read: a batch whose views
        are alive, or a slot kept for workers forked while it was lent (a :class:`Quarantine`
        not yet lifted). Read from the weak references and the quarantines, not the books."""
        out = _held_ranges(self._live)
        slabs = {slab.slab_id: slab for slab in self.arena.slabs()}
        for q in list(self.quarantines):
            for ref in list(q.refs) if q.active else []:
                slab = slabs.get(ref.slab_id)
                if slab is not None:
                    out.append((slab.segment.address + ref.slot * slab.slot_size, slab.slot_size))
        return out

    def close_books(self, whole: bool = False) -> None:
        """For an arena about to close: note, per slab, the bytes of the slots batches still
        hold. A closed arena empties its free slots only; a held batch's slot keeps its memory
        until the slab's mapping goes with its last view (emptying it when the batch dies
        instead would zero what a process forked since still reads), and :meth:`counter`
        reports exactly that. A slab still page-locked (the GPU had not passed the copies from
        it, :func:`shmloader.host._close`) stays locked, whole, until the process exits.
        ``whole``: note every slab whole, for a close whose exact count may not be reached (an
        interruption must not leave a closed arena counted as an open one, one slot a batch
        and none for workers: review 25), or whose stranded slots were not emptied (review 26);
        this first step also runs before the exact count."""
        now = self.arena.slabs()
        whole_slabs = {
            s.slab_id: ClosedSlab(s.nslots * s.slot_size, s.segment.mapping) for s in now
        }
        self.at_close[0] = ClosedBooks(whole_slabs, self.quarantines)
        if whole:
            return
        per_slab: dict[int, int] = {}
        held = [lease.slot for lease in list(self._live.values()) if lease() is not None]
        kept = [ref for q in list(self.quarantines) if q.active for ref in list(q.held)]
        for ref in held + kept:  # kept: dropped, but workers forked while lent may read them
            per_slab[ref.slab_id] = per_slab.get(ref.slab_id, 0) + 1
        slabs: dict[int, ClosedSlab] = {}
        for slab in now:
            sid = slab.slab_id
            if self.fence is not None and self._fenced(sid):
                slabs[sid] = ClosedSlab(whole_slabs[sid].held, None)  # for good
            else:
                nbytes = per_slab.get(sid, 0) * slab.slot_size
                slabs[sid] = ClosedSlab(nbytes, whole_slabs[sid].mapping)
        self.at_close[0] = ClosedBooks(slabs, self.quarantines)

    def counter(self) -> Callable[[], tuple[int, int]]:
        """A reader of the batches of this table whose views are alive, and of the shared
        memory they keep, for a retired arena (:mod:`shmloader.interrupts`): their slots while
        the arena is open; once it closed, the slots held (or kept) then in each slab that is
        still mapped: here (a view of it lives: a batch, or one released early), or by
        shmloader workers forked while its batches were lent (review 24: a quarantine outlives
        the close, and one starts after it, :class:`shmloader.afterfork.Keep`; review 25:
        a worker's mapping of one slot keeps the whole file), and every slab left page-locked.
        It holds only the table of weak references and the close record (weak references to
        the mappings), not this object, its arena or its mappings, and reads without a drain,
        so it touches no book an interruption may have left half-changed."""
        live, box = self._live, self.at_close

        def count() -> tuple[int, int]:
            alive = [lease for lease in list(live.values()) if lease() is not None]
            books = box[0]
            if books is None:  # open: each batch's own slot
                return len(alive), sum(lease.hi - lease.lo for lease in alive)
            # Closed: a slab keeps the slots held when it closed while anything maps it: this
            # process, or live workers sharing some of its slots.
            shared = {ref.slab_id for q in list(books.kept) if q.active for ref in list(q.refs)}
            mapped = [
                c.held
                for sid, c in list(books.slabs.items())
                if sid in shared or c.mapping is None or c.mapping.alive()
            ]
            return len(alive), sum(mapped)

        return count

    @property
    def kept(self) -> int:
        """Slots whose batch is gone, kept from reuse while workers forked with them live.
        (Read from copies, without the lock: also safe where :meth:`busy_here`.)"""
        return sum(len(q.held) for q in list(self.quarantines))

    @property
    def kept_bytes(self) -> int:
        """Bytes of the slots counted in :attr:`kept`."""
        return sum(
            (self._slabs.get(ref.slab_id) or self._map(ref.slab_id))[1]
            for q in list(self.quarantines)
            for ref in list(q.held)
        )

    def busy_here(self) -> bool:
        """Whether the calling thread is inside a lease or arena operation already: code that
        runs there (a signal handler, a ``__del__`` run by the garbage collector) must not drain
        or release."""
        return self._inside == threading.get_ident() or self.arena.owned_here()

    def locked_here(self) -> bool:
        """Whether the calling thread holds the lease or the arena lock (for callers whose own
        lock is always taken before these, to refuse rather than invert that order)."""
        return bool(self.lock._is_owned()) or self.arena.owned_here()  # type: ignore[attr-defined]

    def _as_owner(self, work: Callable[..., int], *args: Any) -> int:
        """``work(*args)`` under the lock, with this thread marked inside (:meth:`busy_here`)."""
        with self.lock:
            try:  # marked inside the try: an interruption right after leaves no mark (review 59)
                self._inside = threading.get_ident()
                return work(*args)
            finally:
                self._inside = None

    def quarantine(self, kept: KeptTables) -> None:
        """Before a fork: keep every slot lent now out of use until :meth:`lift`, in the
        quarantine ``kept`` holds for this table (one per keeper: a later fork adds the slots
        lent since to it), or a new one, recorded in ``kept`` before it keeps anything
        (whoever lifts from ``kept`` knows it: review 27). Nothing when nothing is lent; no
        walk of the batches lent when none was lent since this keeper's last one (a loader's
        N workers' forks walk them once, not N times: each walk also writes the reference
        counts of every lease, pages a child forked before shares copy-on-write)."""
        with self.lock:
            if kept.lifted:  # (a lend racing the keeper's lift)
                return
            have = kept.get(id(self))
            mine = have.quarantine if have is not None and have.quarantine.active else None
            if mine is not None and mine not in self.quarantines:
                # An interruption came between recording it and keeping it (review 33): kept
                # now, by the retry (afterfork._keep_until_forked) or the next fork.
                self.quarantines.append(mine)
            lends = self.lends
            if mine is not None and have is not None and have.lends == lends:
                return  # every batch lent since its last walk is in it already
            refs = [lease.slot for lease in list(self._live.values()) if lease() is not None]
            if mine is not None:
                mine.refs.update(refs)
                kept[id(self)] = Kept(self, mine, lends)
            elif refs:
                q = Quarantine(refs)
                kept[id(self)] = Kept(self, q, lends)
                self.quarantines.append(q)
                if kept.lifted:
                    # The keeper lifted meanwhile (another thread), from a snapshot of ``kept``
                    # taken after it set ``lifted`` and, so, maybe before this entry: lifted
                    # here too, or the slots stayed kept for good (review 29's residue).
                    self.lift(q)

    def lift(self, q: Quarantine) -> None:
        """The workers forked under ``q`` are gone: its slots may be reused. Safe to call from a
        finalizer (it only stores and appends; the next drain releases them). It forgets the
        slots it kept at once: a table nobody drains (a loader left holding batches while
        another runs epochs with fresh workers) gains one empty quarantine per epoch until its
        next drain, not a copy of every slot it lends (10,000 held: 0.5 MiB an epoch)."""
        q.active = False
        q.refs = set()  # (read only while active)
        self.dead.append(q)

    def _give_back(self, ref: SlotRef, kept: int = 0) -> int:
        """Release a slot whose batch is gone, unless live workers may still read it; how many
        slots went back (``kept`` when it was kept)."""
        for q in self.quarantines:
            if q.active and ref in q.refs:
                q.held.append(ref)
                return kept
        return self.arena.release(ref)

    def open(self, msg: P.Ready | Spilled) -> Any:
        """The batch a READY message names, as views of its slot; the slot becomes LENT. If the
        batch cannot be rebuilt, its slot is released and the error propagates. A spilled batch
        is rebuilt over its copy."""
        if type(msg) is Spilled:
            ready = msg.ready
            return self.rebuilder.build(msg.buffer, P.layout(ready), lambda: P.descriptor(ready))[0]
        with self.lock:
            return self._open(msg)  # type: ignore[arg-type]

    def spill(self, msg: P.Ready) -> Spilled:
        """Copy the batch in ``msg``'s READY slot into this process's memory (the caller then
        frees the slot)."""
        ref = msg.ref
        with self.lock:
            buf, size, _ = self._slabs.get(ref.slab_id) or self._map(ref.slab_id)
            end = P.descriptor(msg).end
            copy = np.frombuffer(buf, np.uint8, end, ref.slot * size).copy()
            self._spilled = [r for r in self._spilled if r() is not None]
            self._spilled.append(weakref.ref(copy))
        return Spilled(msg, copy)

    def spilled(self) -> list[int]:
        """The sizes of the spilled copies still alive."""
        alive = [a for a in (r() for r in list(self._spilled)) if a is not None]
        return [a.nbytes for a in alive]

    def _open(self, msg: P.Ready) -> Any:
        ref = msg.ref
        lease = None
        try:
            buf, size, base = self._slabs.get(ref.slab_id) or self._map(ref.slab_id)
            arr = np.frombuffer(buf, np.uint8, size, ref.slot * size)
            batch, leaves = self.rebuilder.build(arr, P.layout(msg), lambda: P.descriptor(msg))
            keep = arr.base
            lease = Lease(keep, self.dead.append)
            lease.slot = ref
            lease.lo = base + ref.slot * size
            lease.hi = lease.lo + size
            keys = [id(keep)]
            for leaf in leaves:
                if type(leaf) is torch.Tensor:
                    keys.append(leaf.untyped_storage()._cdata)
            lease.keys = tuple(keys)
            self.lends += 1  # before the lease is live: a keeper skips no live lease unwalked
            self._live[id(lease)] = lease
            for kept in forks_of_other_threads() if FORKS_PENDING else ():  # (a fork under way)
                self.quarantine(kept)
            by_key = self._by_key
            for k in keys:
                by_key[k] = lease
            self.arena.lend(ref)  # last: an interruption before it leaves no LENT slot unwatched
        except BaseException:
            if lease is not None and id(lease) in self._live:
                self._forget(lease)
            self.arena.release(ref)
            raise
        return batch  # if no leaf keeps `keep` alive, the lease is dead as this frame ends

    def _map(self, slab_id: int) -> tuple[memoryview, int, int]:
        slab = self.arena.slab(slab_id)
        buf = slab.segment.buffer
        base = int(np.frombuffer(buf, np.uint8, count=1).ctypes.data)
        self._slabs[slab_id] = entry = (buf, slab.slot_size, base)
        return entry

    def forget_slab(self, slab_id: int) -> None:
        """The arena gave the slab back: drop the cached mapping (live views keep theirs)."""
        self._slabs.pop(slab_id, None)

    def drain(self) -> int:
        """Release the slots of every batch whose views died, and of every slot a finalizer
        queued. Call only at a safe point (never from a callback); re-entered from one (see
        :meth:`busy_here`) it does nothing. Returns how many."""
        return 0 if self.busy_here() else self._as_owner(self._drain)

    def _drain(self) -> int:
        dead, live, n = self.dead, self._live, 0
        fence, held, holding = self.fence, [], set()
        while dead:
            x = dead.popleft()
            if isinstance(x, Lease):
                if id(x) not in live:
                    continue  # released early already
                if self._through_fence(x.slot):
                    # (Queued twice: released from inside a drain, then its views died.)
                    if id(x) not in holding:
                        holding.add(id(x))
                        held.append(x)
                    continue
                self._forget(x)
                n += self._give_back(x.slot)
            elif isinstance(x, Quarantine):  # lifted: its workers are gone
                if x in self.quarantines:
                    self.quarantines.remove(x)  # (another iterator's workers may still read)
                    n += sum(self._give_back(ref) for ref in x.held)
            else:
                n += self.arena.release(x)  # a slot never lent: no copy can read it
        if fence is not None:
            if held:
                try:
                    fence.hold([x.slot for x in held])
                except BaseException:
                    dead.extend(held)  # no event recorded: the next drain tries again
                    raise
                for x in held:
                    self._forget(x)
            if fence:
                for ref in fence.passed():
                    n += self._give_back(ref)
        arena = self.arena
        if n and arena.bytes_reserved > arena.max_bytes:
            # Past the cap by an allowance for kept slots that have come back since: free slots
            # go back to the system until the arena is within it again.
            arena.hollow(past_cap=self.kept_bytes)
        return n

    def _through_fence(self, ref: SlotRef) -> bool:
        """Whether ``ref``'s slot goes back through the copy fence (its slab is page-locked)."""
        return self.fence is not None and self._fenced(ref.slab_id)

    def settle(self, timeout: float) -> int:
        """Wait at most ``timeout`` seconds for the GPU to pass the copies from the slots the
        fence holds, and release those it passed. Returns how many. Other threads may drain
        and take ``stats()`` while it waits."""
        if not self.fence:
            return 0
        passed = self.fence.settle(timeout, self.lock)
        return self._as_owner(lambda: sum(self._give_back(ref) for ref in passed))

    def fence_held(self) -> int:
        """For a close that will unlock the slabs: one fence event behind every copy queued so
        far, on the current stream, if a batch the user still holds lies in a page-locked slab
        (review 58: its slab was unlocked with a copy from it still queued; the fence covered
        only batches already dead). How many such batches; 0: no event recorded."""
        with self.lock:
            fence = self.fence
            if fence is None:
                return 0
            held = [x for x in list(self._live.values())
                    if x() is not None and self._through_fence(x.slot)]
            if held:
                fence.hold([])  # a barrier: no slot of its own (the batches still hold theirs)
            return len(held)

    def _forget(self, lease: Lease) -> None:
        del self._live[id(lease)]
        by_key = self._by_key
        for k in lease.keys:
            if by_key.get(k) is lease:
                del by_key[k]

    def release_early(self, batch: Any) -> int:
        """Return the slots of ``batch`` now, whatever views remain, through the fence if any.
        Returns how many; 0 for a batch released before (its generation has moved on) or
        holding no slot. Re-entered from a lease or arena operation of this thread (see
        :meth:`busy_here`), the release is queued for the next drain instead."""
        if self.busy_here():
            found = self._leases_of(batch)
            self.dead.extend(found)  # the next drain releases them, as if they had died
            return len(found)
        return self._as_owner(self._release_early, batch)

    def let_go(self, box: list[Any]) -> int:
        """A consumer whose own copies from the batch in ``box`` (its only element) have all
        completed lets go of it (a ``DevicePrefetcher`` over the iterator that lent it): if
        the batch is one of this table's, ``box`` is emptied here, and the slots of those of
        its leases whose views died with that go back at once, without the copy fence (no copy
        the consumer made from them is still running, and no other code saw them: review 58).
        A lease whose views something else still holds (a view in the device batch: review
        50) is left alone: it goes back when those die, as any. Returns how many went
        back; ``box`` is left as it was when the batch is none of this table's."""
        if self.busy_here():
            if self._leases_of(box[0]):
                box.clear()  # its leases' deaths are drained later, through the fence
            return 0
        return self._as_owner(self._let_go, box)

    def _let_go(self, box: list[Any]) -> int:
        found = self._leases_of(box[0])
        if not found:
            return 0
        box.clear()  # the consumer's last reference: views nobody else holds die here
        n = 0
        live = self._live
        for lease in found:
            if lease() is None and id(lease) in live:
                self._forget(lease)  # (its death, queued, is then a no-op)
                n += self._give_back(lease.slot, kept=1)
        return n

    def _leases_of(self, batch: Any) -> list[Lease]:
        """The live leases whose slots ``batch``'s tensors and arrays are views of, once each."""
        found: dict[int, Lease] = {}
        for obj in leaves_in(batch):
            key, ptr = _key_of(obj)
            lease = self._by_key.get(key)
            if lease is not None and id(lease) in self._live and lease.lo <= ptr < lease.hi:
                found[id(lease)] = lease
        return list(found.values())

    def _release_early(self, batch: Any) -> int:
        self._drain()
        n = 0
        for lease in self._leases_of(batch):
            self._forget(lease)
            if self.fence is not None and self._through_fence(lease.slot):
                self.fence.hold([lease.slot])  # released: its copies may still be queued
                n += 1
            else:
                n += self._give_back(lease.slot, kept=1)  # out of the user's hands either way
        return n


def _key_of(obj: torch.Tensor | np.ndarray) -> tuple[int, int]:
    """The lease key of a view (its storage, or its keep-alive memoryview) and its address."""
    if isinstance(obj, torch.Tensor):
        return obj.untyped_storage()._cdata, obj.data_ptr()
    ptr = int(obj.ctypes.data)
    base: Any = obj
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, torch.Tensor):
        return base.untyped_storage()._cdata, ptr
    return id(base), ptr


def leaves_in(obj: Any) -> list[torch.Tensor | np.ndarray]:
    """Tensors and arrays reachable through dicts, lists, tuples and object attributes."""
    out: list[torch.Tensor | np.ndarray] = []
    stack, seen = [obj], set()
    while stack:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, torch.Tensor | np.ndarray):
            out.append(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, list | tuple):
            stack.extend(x)
        elif hasattr(x, "__dict__"):
            stack.extend(vars(x).values())
    return out
