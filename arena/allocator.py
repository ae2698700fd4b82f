"""The owner's arena: slabs in size classes, the slot-state table, growth up to a byte cap.

Slot life cycle (one state per slot, changed only here)::

    FREE --acquire--> WRITING --mark_ready--> READY --lend--> LENT --release--> FREE
       ^                 |                      |                                 |
       +----release------+-------release--------+---------------------------------+

Invariants:
- A slot's ``generation`` increases by one on every ``acquire``; a :class:`SlotRef` names the
  generation it was handed out for. Releasing a ref whose generation is not the slot's current one
  is stale and a no-op; releasing the current generation twice is a bug and raises
  :class:`StaleSlotError`.
- ``bytes_reserved <= max_bytes``, except by an allowance the owner passes to :meth:`Arena.acquire`
  (``past_cap``) for slots it holds but cannot use; other growth that would pass the cap does not
  happen.
- Size classes: a request that fits no existing class creates the class ``max(page_align(n), 2 *
  largest_class)`` (at least doubling, like DALI) or, if that would take more than half the room
  left under the cap, ``page_align(n)``; a request whose classes are all busy adds a slab of the
  smallest fitting class, with as many slots as that class has already (at least
  ``slots_per_slab``; cut to the room under the cap), so a class grows geometrically; when not
  even one slot of that class fits under the cap, it creates the class ``page_align(n)`` instead.
  ``acquire`` always prefers the smallest class that fits.
- Snug slots: a class is *loose* for a request when it is at least ``LOOSE`` times the request
  and at least ``LOOSE_MIN_BYTES``. A request whose smallest fitting class is loose is served
  from the *snug* class, the power of two at or above it. Growth for it grows that class (as
  above, doubling). Where a loose slot is free instead, a snug slab is added only when it leaves
  at least as much room under the cap as it takes (else the loose slot serves); then the free
  slots of the classes loose for the request are hollowed (their memory goes back: the batches
  have become smaller), and so is every slot of those classes released later, until a bigger
  request comes (more than a ``LOOSE``-th of the size from which they are loose). An owner
  that knows its requests fell says so (:meth:`Arena.requests_fell`), with the same effect. So
  a held small batch never pins a big slot while there is room for a small one, and the
  arena's memory follows batches that shrink.
- A slab whose slots are all FREE can be given back (``give_back_idle``), lowering
  ``bytes_reserved``; its slab id is never reused, so refs to its slots stay stale forever.
- A FREE slot can be *hollowed* (``hollow``): its pages go back to the system (``MADV_REMOVE``)
  and its bytes leave ``bytes_reserved`` and ``bytes_by_state["free"]`` (it still counts in
  ``slots_by_state["free"]``, and in ``slots_hollow``). Acquiring it reserves its bytes again,
  only within the cap. So the cap bounds the memory slots really hold, not the address space of
  slabs: free slots beside a held one stop counting against it. Slabs the owner marks as not
  to be hollowed (``can_hollow``: page-locked ones) never are. After ``close()``, every FREE slot
  is hollowed, and every slot released later: slabs that live on (views, forked children that
  map them) keep only the memory of the slots still held.
- Thread safety: every method takes one lock. It is re-entrant, so code that runs inside an
  arena call of its own thread (a signal handler, a ``__del__`` run by the garbage collector)
  can still read :meth:`Arena.stats`; an owner that would change slots from there asks
  :meth:`Arena.owned_here` first and defers (the loader does).
- After ``close()`` the slabs are unmapped in this process (views still alive keep their pages) and
  ``acquire`` raises, but bookkeeping goes on: late releases still move slots to FREE, so
  statistics taken after close stay true.
- An arena's books belong to the process that made it. A forked child's copy of them is out of
  date the moment the parent moves on, so there every call that hands out, takes back or empties
  slots raises :class:`InheritedArenaError` (before taking the lock, which a parent's thread may
  have held at the fork), and ``close()`` closes the child's handles only: hollowing a slot the
  copy lists as FREE would zero the parent's batch in it (review 38). A child reads slots by
  attaching slabs (:meth:`Slab.attach`), or makes its own arena.
"""

from __future__ import annotations

import bisect
import enum
import itertools
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import NamedTuple

from arena._layout import page_align
from arena.errors import (
    ArenaCapacityError,
    ArenaDescriptorError,
    InheritedArenaError,
    StaleSlotError,
)
from arena.segment import Backend, mem_available_bytes
from arena.slab import Slab
from arena.stats import ArenaStats


class SlotState(enum.IntEnum):
    FREE = 0
    WRITING = 1
    READY = 2
    LENT = 3


_STATE_NAMES = tuple(s.name.lower() for s in SlotState)  # indexed by state value
_FREE = int(SlotState.FREE)


class SlotRef(NamedTuple):
    """A handle on one slot for one generation (a named tuple: made per batch, so cheap)."""

    slab_id: int
    slot: int
    generation: int


LOOSE = 4  # a class at least this many times a request is loose for it ...
LOOSE_MIN_BYTES = 1 << 20  # ... when it is at least this big (smaller slots waste too little)
_NEVER = 1 << 62  # a slot size no class reaches


def loose_from(need: int) -> int:
    """The smallest class that is loose for a request of ``need`` (page-aligned) bytes."""
    return max(LOOSE * need, LOOSE_MIN_BYTES)


def default_max_bytes() -> int:
    """Default cap: half of the RAM available when the arena is made."""
    return mem_available_bytes() // 2


_arenas: weakref.WeakSet[Arena] = weakref.WeakSet()  # every arena of this process


def _mark_inherited() -> None:
    """In a forked child: every arena here is the parent's (module invariants)."""
    for arena in list(_arenas):
        arena._inherited = True


os.register_at_fork(after_in_child=_mark_inherited)


class Arena:
    """Owns slabs and hands out their slots. Lives in one process; slabs attach elsewhere."""

    _closed = True  # class default: close() is safe on a half-built object
    _inherited = False  # set in a forked child (_mark_inherited)

    def __init__(
        self,
        *,
        backend: Backend | str = Backend.AUTO,
        max_bytes: int | None = None,
        slots_per_slab: int = 4,
    ) -> None:
        if slots_per_slab < 1:
            raise ValueError(f"slots_per_slab must be >= 1, got {slots_per_slab}")
        self.backend = Backend(backend)
        self.max_bytes = default_max_bytes() if max_bytes is None else int(max_bytes)
        if self.max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {self.max_bytes}")
        self.slots_per_slab = slots_per_slab
        # The hot paths take the bare lock (``with self._lock``: no Python-level __enter__);
        # waits and notifies go through the condition built on that same lock.
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._slabs: dict[int, Slab] = {}
        self._states: dict[int, list[SlotState]] = {}
        self._gens: dict[int, list[int]] = {}
        self._classes: list[int] = []  # sorted slot sizes
        self._free: dict[int, list[tuple[int, int]]] = {}  # slot size -> [(slab_id, slot)]
        self._hollow: dict[int, list[tuple[int, int]]] = {}  # the same, for hollowed FREE slots
        self._nhollow = 0
        # Which slabs may be hollowed (the owner says no for page-locked ones).
        self.can_hollow: Callable[[int], bool] = lambda slab_id: True
        # Counters indexed by state value (plain lists: this is the per-batch hot path).
        self._slots_by_state = [0] * len(SlotState)
        self._bytes_by_state = [0] * len(SlotState)
        self._sizes: dict[int, int] = {}  # slab id -> slot size
        self._waiters = 0
        # Classes of this size and up are out of use since requests shrank (snug slots): their
        # slots are hollowed as they are released.
        self._idle_from = _NEVER
        self._reserved = 0
        self._high_water = 0
        self._growth_events = 0
        self._ids = itertools.count()
        self._pid = os.getpid()
        self._closed = False
        _arenas.add(self)

    # -- acquiring -----------------------------------------------------------------------------

    def acquire(
        self, nbytes: int, timeout: float = 0.0, *, add_slab: bool = True, past_cap: int = 0
    ) -> SlotRef | None:
        """A WRITING slot of at least ``nbytes``, growing the arena if needed and allowed.

        With ``add_slab=False`` only an existing free slot is taken (no growth). Growth may pass
        the cap by ``past_cap`` bytes (the owner's allowance for slots it holds but cannot use).
        Returns ``None`` when no fitting slot became free within ``timeout`` seconds and growth
        was not allowed or would pass the cap. Raises :class:`ArenaCapacityError` when ``nbytes``
        can never fit. While it waits, only a released slot of a fitting size serves it: room
        that idle slabs of other sizes hold comes back through :meth:`give_back_idle` alone,
        which the owner calls (other processes must unmap what it gives back).
        """
        if self._inherited:
            raise self._not_here("hand out a slot")
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        need = page_align(nbytes)
        if need > self.max_bytes:
            raise ArenaCapacityError(
                f"a batch of {nbytes:,} bytes needs a {need:,}-byte slot, larger than the arena "
                f"cap max_bytes={self.max_bytes:,}; raise the cap (arena_max_bytes) or make "
                "batches smaller (batch_size)"
            )
        with self._lock:
            if self._closed:
                self._check_open()
            if LOOSE * need > self._idle_from:
                self._idle_from = _NEVER  # requests this big want those classes again
            ref = self._take(need, past_cap)
            if ref is None and add_slab and self._grow(need, past_cap):
                ref = self._take(need, past_cap)
            if ref is not None or timeout <= 0:
                return ref
            deadline = time.monotonic() + timeout
            self._waiters += 1
            try:
                while ref is None:
                    left = deadline - time.monotonic()
                    if left <= 0 or not self._cond.wait(left):
                        return None
                    self._check_open()
                    ref = self._take(need, past_cap)
            finally:
                self._waiters -= 1
            return ref

    def _take(self, need: int, past_cap: int = 0) -> SlotRef | None:
        for size in self._classes[bisect.bisect_left(self._classes, need) :]:
            free = self._free[size]
            if free:
                # (loose_from inlined: this is every batch's path)
                if size >= LOOSE * need and size >= LOOSE_MIN_BYTES and self._grow_snug(
                    need, past_cap
                ):
                    return self._take(need, past_cap)  # the snug class now has a free slot
                slab_id, slot = free.pop()
                return self._hand_out(slab_id, slot)
        if self._nhollow:
            return self._take_hollow(need, past_cap)
        return None

    def _grow_snug(self, need: int, past_cap: int) -> bool:
        """Grow the snug class for ``need`` when its slab leaves at least as much room under the
        cap as it takes, then hollow the free slots of the classes loose for ``need`` (module
        invariants). False, and nothing changed, when it does not fit."""
        loose = loose_from(need)
        size, nslots = self._plan(need, past_cap)
        room = self.max_bytes + past_cap - self._reserved
        if nslots < 1 or size >= loose or 2 * size * nslots > room:
            return False
        try:
            self._add_slab(size, nslots)
        except (ArenaCapacityError, ArenaDescriptorError):
            return False  # no memory or descriptor for it now: a loose slot serves the request
        self._out_of_use(loose)
        return True

    def requests_fell(self, nbytes: int) -> int:
        """The owner's requests are at most ``nbytes`` from now on: the classes loose for it go
        out of use (module invariants). Returns the bytes given back now."""
        if self._inherited:
            raise self._not_here("give slots' memory back")
        with self._lock:
            return self._out_of_use(loose_from(page_align(nbytes)))

    def _out_of_use(self, loose: int) -> int:
        """Classes of ``loose`` bytes and up go out of use: their free slots are hollowed now,
        their other slots as they are released. Returns the bytes given back now."""
        self._idle_from = min(self._idle_from, loose)
        classes = self._classes[bisect.bisect_left(self._classes, loose) :]
        return sum(self._hollow_class(cls) for cls in classes)

    def _take_hollow(self, need: int, past_cap: int) -> SlotRef | None:
        """A hollowed slot of at least ``need``, its bytes reserved again, if the cap allows (a
        slab of the snug class first, if a hollowed slot would be loose for ``need``)."""
        loose = loose_from(need)
        for size in self._classes[bisect.bisect_left(self._classes, need) :]:
            hollow = self._hollow.get(size)
            if not hollow or self._reserved + size > self.max_bytes + past_cap:
                continue
            if size >= loose and self._grow_snug(need, past_cap):
                return self._take(need, past_cap)
            slab_id, slot = hollow[-1]
            if not self._slabs[slab_id].segment.recommit(slot * size, size):
                continue
            hollow.pop()
            self._nhollow -= 1
            self._reserved += size
            self._bytes_by_state[_FREE] += size
            return self._hand_out(slab_id, slot)
        return None

    def _hand_out(self, slab_id: int, slot: int) -> SlotRef:
        gen = self._gens[slab_id][slot] + 1
        self._gens[slab_id][slot] = gen
        self._move(slab_id, slot, SlotState.WRITING)
        return SlotRef(slab_id, slot, gen)

    def hollow(self, past_cap: int | None = None) -> int:
        """Hollow FREE slots (see the module's invariants): all of them, or with ``past_cap``
        only until ``bytes_reserved`` is back within the cap plus that allowance (largest slots
        first). Returns the bytes given back."""
        if self._inherited:
            raise self._not_here("give slots' memory back")
        with self._lock:
            return self._hollow_free(past_cap)

    def _hollow_free(self, past_cap: int | None = None) -> int:
        done = 0
        for size in reversed(self._classes):
            done += self._hollow_class(size, past_cap)
        return done

    def _hollow_class(self, size: int, past_cap: int | None = None) -> int:
        """Hollow the FREE slots of class ``size`` (with ``past_cap``, only while over the cap
        plus that allowance). Returns the bytes given back."""
        done = 0
        # (.get: a class an interruption left without its free list holds no FREE slot)
        free, kept = self._free.get(size, []), []
        while free:
            if past_cap is not None and self._reserved <= self.max_bytes + past_cap:
                break
            slab_id, slot = entry = free.pop()
            if self.can_hollow(slab_id) and self._punch(slab_id, slot, size):
                done += size
            else:
                kept.append(entry)
        free.extend(reversed(kept))
        return done

    def _punch(self, slab_id: int, slot: int, size: int) -> bool:
        """Hollow one FREE slot (already off its free list); False, and nothing changed, when
        the kernel cannot."""
        if not self._slabs[slab_id].segment.punch(slot * size, size):
            return False
        self._hollow.setdefault(size, []).append((slab_id, slot))
        self._nhollow += 1
        self._reserved -= size
        self._bytes_by_state[_FREE] -= size
        return True

    def _grow(self, need: int, past_cap: int = 0) -> bool:
        size, nslots = self._plan(need, past_cap)
        if nslots < 1:
            return False
        while True:
            try:
                self._add_slab(size, nslots)
                return True
            except ArenaCapacityError:
                # The backing store (a small /dev/shm, the RAM) has no room for the whole slab:
                # fewer slots, down to one (review 38: a 64 MB /dev/shm with room for three more
                # batches failed a five-slot slab), then one of just the size asked for where an
                # existing bigger class was planned (review 43: 27 MB free failed a 28 MB slot
                # for a 20 MB batch).
                if nslots == 1 and size == need:
                    raise
                size, nslots = (need, 1) if nslots == 1 else (size, nslots // 2)

    def _plan(self, need: int, past_cap: int) -> tuple[int, int]:
        """The slot size and count of the slab that growth for ``need`` adds (module
        invariants); a count below one when none fits under the cap."""
        room = self.max_bytes + past_cap - self._reserved
        fitting = self._classes[bisect.bisect_left(self._classes, need) :]
        if fitting:
            size = fitting[0]
            if size >= loose_from(need):
                size = 1 << (need - 1).bit_length()  # the snug class: a power of two of pages
            if size > room:
                size = need  # at the cap: a slab of just this size, if that still fits
        else:
            size = max(need, 2 * self._classes[-1]) if self._classes else need
            if size > room // 2:
                # Near the cap a doubled class would hold a batch of ``need`` in up to twice the
                # room it needs, and leave too little for the next: exactly this size instead.
                size = need
        # Another slab of a busy class doubles the class (at least slots_per_slab): a user who
        # holds n batches costs O(log n) slabs, and so O(log n) descriptors, not n.
        in_class = sum(len(self._states[sid]) for sid, sz in self._sizes.items() if sz == size)
        return size, min(max(self.slots_per_slab, in_class), room // size)

    def _add_slab(self, size: int, nslots: int) -> None:
        try:
            slab = Slab.create(next(self._ids), size, nslots, self.backend)
        except ArenaDescriptorError as e:
            raise ArenaDescriptorError(
                f"the arena holds {len(self._slabs)} descriptors ({len(self._slabs)} slabs of "
                f"{sum(self._slots_by_state)} slots, {self._reserved:,} bytes). {e}"
            ) from None
        self._slabs[slab.slab_id] = slab
        self._states[slab.slab_id] = [SlotState.FREE] * nslots
        self._gens[slab.slab_id] = [0] * nslots
        if size not in self._free:
            bisect.insort(self._classes, size)
            self._free[size] = []
        # Pop from the end hands out slot 0 first.
        self._free[size].extend((slab.slab_id, s) for s in reversed(range(nslots)))
        self._sizes[slab.slab_id] = size
        self._slots_by_state[_FREE] += nslots
        self._bytes_by_state[_FREE] += size * nslots
        self._reserved += size * nslots
        self._growth_events += 1

    def give_back_idle(self, before_close: Callable[[int], None] | None = None) -> list[int]:
        """Close every slab whose slots are all FREE, making room under the cap for another
        size class. Returns their ids (other processes should unmap them). Refs to their slots
        become stale: releasing one is a no-op. Each slab's memory goes back before it closes
        (unless it may not be hollowed): a mapping something still keeps -- a view of a batch
        released early, a process forked meanwhile -- keeps address space, not the bytes the
        arena no longer counts. ``before_close(slab_id)`` runs for each while its memory is
        still mapped here (the owner unlocks a page-locked slab there; review 37: it was
        unlocked after the unmap); an owner that must learn the ids even when a call raises
        records them there."""
        if self._inherited:
            raise self._not_here("give slabs back")
        with self._cond:
            idle = [
                sid
                for sid, states in self._states.items()
                if all(state is SlotState.FREE for state in states)
            ]
            gone = [self._forget_slab(sid) for sid in idle]
        # Every slab is closed, and handed to before_close first, even if before_close raises
        # for one (a failed unlock, a Ctrl-C in it): the first error is raised after them all
        # (review 39: the rest were left to the garbage collector, unmapped while locked).
        # Whether it may be hollowed is asked after before_close: a slab unlocked there gives
        # its memory back now, not when the last worker unmaps it (review 43).
        failed: BaseException | None = None
        for sid, slab in zip(idle, gone, strict=True):
            try:
                if before_close is not None:
                    before_close(sid)
            except BaseException as e:  # noqa: BLE001 - raised once every slab is closed
                failed = failed or e
            if self.can_hollow(sid):
                slab.segment.punch(0, slab.size)
            slab.close()
        if failed is not None:
            try:
                raise failed
            finally:  # (a local holding the error its traceback holds this frame by: a
                failed = None  # cycle that kept the caller alive until a collection; review 81)
        return idle

    def _forget_slab(self, slab_id: int) -> Slab:
        size = self._sizes.pop(slab_id)
        nslots = len(self._states.pop(slab_id))
        del self._gens[slab_id]
        hollow = self._hollow.get(size, [])
        nhollow = sum(1 for entry in hollow if entry[0] == slab_id)
        if nhollow:
            self._hollow[size] = [entry for entry in hollow if entry[0] != slab_id]
            self._nhollow -= nhollow
        free = [entry for entry in self._free[size] if entry[0] != slab_id]
        if free or any(s == size for s in self._sizes.values()):
            self._free[size] = free
        else:
            del self._free[size]
            self._hollow.pop(size, None)
            self._classes.remove(size)
        committed = size * (nslots - nhollow)
        self._slots_by_state[_FREE] -= nslots
        self._bytes_by_state[_FREE] -= committed
        self._reserved -= committed
        return self._slabs.pop(slab_id)

    # -- transitions ---------------------------------------------------------------------------

    @property
    def bytes_reserved(self) -> int:
        """Bytes reserved now (read without the lock: a hint, like :attr:`free_slots`)."""
        return self._reserved

    @property
    def free_slots(self) -> int:
        """How many slots are FREE (a counter read without the lock: a hint, exact when no
        other thread uses the arena)."""
        return self._slots_by_state[_FREE]

    def has_class_for(self, nbytes: int) -> bool:
        """Whether some slab's slots can hold ``nbytes`` (busy or not)."""
        with self._cond:
            return bool(self._classes) and self._classes[-1] >= page_align(nbytes)

    def mark_ready(self, ref: SlotRef) -> None:
        """WRITING -> READY: the writer has finished."""
        self._transition(ref, SlotState.WRITING, SlotState.READY)

    def lend(self, ref: SlotRef) -> None:
        """READY -> LENT: views of the slot are now with the user."""
        self._transition(ref, SlotState.READY, SlotState.LENT)

    def _transition(self, ref: SlotRef, src: SlotState, dst: SlotState) -> None:
        if self._inherited:
            raise self._not_here(f"move a slot to {dst.name}")
        with self._lock:
            if self._closed:
                self._check_open()
            gens = self._gens.get(ref.slab_id)
            if gens is None or not 0 <= ref.slot < len(gens) or gens[ref.slot] != ref.generation:
                raise self._stale(ref)
            state = self._states[ref.slab_id][ref.slot]
            if state is not src:
                raise StaleSlotError(
                    f"slot {ref.slot} of slab {ref.slab_id} (generation {ref.generation}) is "
                    f"{state.name}, expected {src.name} before moving it to {dst.name}"
                )
            self._move(ref.slab_id, ref.slot, dst)

    def release(self, ref: SlotRef) -> bool:
        """Any state -> FREE. False if the ref is stale (a no-op); raises on a double release,
        and on a slot number the slab does not have."""
        if self._inherited:
            raise self._not_here("take a slot back")
        with self._lock:
            gens = self._gens.get(ref.slab_id)
            if gens is None or not 0 <= ref.slot < len(gens) or gens[ref.slot] != ref.generation:
                if gens is not None and not 0 <= ref.slot < len(gens):
                    raise self._stale(ref)  # not a slot of its slab: a bug, not a late release
                return False
            if self._states[ref.slab_id][ref.slot] is SlotState.FREE:
                raise StaleSlotError(
                    f"double release of slot {ref.slot} of slab {ref.slab_id} "
                    f"(generation {ref.generation})"
                )
            self._move(ref.slab_id, ref.slot, SlotState.FREE)
            size = self._sizes[ref.slab_id]
            # After close, or in a class out of use: its memory goes back now.
            out_of_use = self._closed or size >= self._idle_from
            hollow = out_of_use and self.can_hollow(ref.slab_id)
            if not (hollow and self._punch(ref.slab_id, ref.slot, size)):
                self._free[size].append((ref.slab_id, ref.slot))
            if self._waiters:  # a hollow slot can serve a waiter too (reserved again)
                self._cond.notify_all()
            return True

    def state(self, ref: SlotRef) -> SlotState:
        """Current state of the slot ``ref`` names (FREE if ``ref`` is stale)."""
        with self._cond:
            gens = self._gens.get(ref.slab_id)
            if gens is None or not 0 <= ref.slot < len(gens) or gens[ref.slot] != ref.generation:
                return SlotState.FREE
            return self._states[ref.slab_id][ref.slot]

    def _stale(self, ref: SlotRef) -> StaleSlotError:
        """The error for a reference whose generation is not the slot's current one, or whose
        slot number its slab does not have."""
        gens = self._gens.get(ref.slab_id)
        if gens is not None and not 0 <= ref.slot < len(gens):
            return StaleSlotError(
                f"no slot {ref.slot} in slab {ref.slab_id}: it has slots 0 to {len(gens) - 1}"
            )
        return StaleSlotError(
            f"stale reference to slot {ref.slot} of slab {ref.slab_id}: generation "
            f"{ref.generation}, current {None if gens is None else gens[ref.slot]}"
        )

    def _not_here(self, what: str) -> InheritedArenaError:
        return InheritedArenaError(
            f"cannot {what}: this arena was made by process {self._pid} and this process "
            f"({os.getpid()}) inherited it through fork(); its books are that process's, and "
            "changing them here would overwrite or free the slots it uses. Attach its slabs "
            "here to read them (Slab.attach), or make an Arena in this process."
        )

    def _move(self, slab_id: int, slot: int, dst: SlotState) -> None:
        states = self._states[slab_id]
        src = states[slot]
        size = self._sizes[slab_id]
        states[slot] = dst
        counts, nbytes = self._slots_by_state, self._bytes_by_state
        counts[src] -= 1
        counts[dst] += 1
        nbytes[src] -= size
        nbytes[dst] += size
        used = self._reserved - nbytes[_FREE]
        if used > self._high_water:
            self._high_water = used

    # -- access ---------------------------------------------------------------------------------

    def slab(self, slab_id: int) -> Slab:
        return self._slabs[slab_id]

    def slabs(self) -> list[Slab]:
        with self._cond:
            return list(self._slabs.values())

    def owned_here(self) -> bool:
        """Whether the calling thread is inside an arena call (holds its lock)."""
        return bool(self._lock._is_owned())  # type: ignore[attr-defined]

    def let_go_after_fork(self, keep: list[tuple[int, int]]) -> None:
        """In a forked child that will not use this arena: give up its shared memory, but for
        the address ranges in ``keep`` (:meth:`Segment.let_go_after_fork`). Takes no lock: the
        child's copy of it may be held for good, by a thread of the parent that does not exist
        here; under the GIL the slab table is never half-changed."""
        for slab in list(self._slabs.values()):
            slab.segment.let_go_after_fork(keep)

    def empty_all_but(self, keep: list[tuple[int, int]]) -> int:
        """Give back the memory of every slot but those overlapping the ``(address, bytes)``
        ranges in ``keep``, whatever the books say, and leave the books alone: for an owner
        whose books an interruption may have left half-changed, about to close the arena, that
        knows for sure only which slots are still read. Slabs that may not be hollowed keep
        theirs. Returns the slots emptied."""
        if self._inherited:
            raise self._not_here("empty slots")
        with self._cond:
            slabs = [s for sid, s in self._slabs.items() if self.can_hollow(sid)]
        done = 0
        for slab in slabs:
            size, base = slab.slot_size, slab.segment.address
            for i in range(slab.nslots):
                lo = base + i * size
                if all(lo + size <= at or at + n <= lo for at, n in keep):
                    done += slab.segment.punch(i * size, size)
        return done

    def slot_buffer(self, ref: SlotRef) -> memoryview:
        return self._slabs[ref.slab_id].slot_buffer(ref.slot)

    def slot_size(self, ref: SlotRef) -> int:
        return self._slabs[ref.slab_id].slot_size

    def stats(self) -> ArenaStats:
        with self._cond:
            backends = {s.backend.value for s in self._slabs.values()}
            return ArenaStats(
                backend="+".join(sorted(backends)) if backends else "none",
                bytes_reserved=self._reserved,
                max_bytes=self.max_bytes,
                bytes_by_state=dict(zip(_STATE_NAMES, self._bytes_by_state, strict=True)),
                slots_by_state=dict(zip(_STATE_NAMES, self._slots_by_state, strict=True)),
                slots_total=sum(self._slots_by_state),
                slot_sizes=tuple(self._classes),
                high_water_bytes=self._high_water,
                growth_events=self._growth_events,
                slabs=len(self._slabs),
                slots_hollow=self._nhollow,
            )

    # -- teardown -------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the arena is closed")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close every slab in this process. Idempotent. Views still alive stay valid. In a
        forked child, only the child's handles close: the memory and the books stay the
        parent's (module invariants)."""
        if self._closed:
            return
        if self._inherited:  # no lock: a parent's thread may have held it at the fork
            self._closed = True
            for slab in list(self._slabs.values()):
                slab.close()
            return
        failed: Exception | None = None
        with self._cond:
            self._closed = True
            try:
                self._hollow_free()  # slabs that views keep alive keep only the slots in use
            except Exception as e:  # noqa: BLE001 - raised once every slab is closed
                failed = e  # (books an interruption left half-changed: review 59)
            slabs = list(self._slabs.values())
            self._cond.notify_all()
        for slab in slabs:
            slab.close()
        if failed is not None:
            try:
                raise failed
            finally:
                failed = None  # (as in give_back_idle)

    def __repr__(self) -> str:
        return (
            f"Arena(backend={self.backend.value}, reserved={self._reserved:,}, "
            f"max_bytes={self.max_bytes:,}, slabs={len(self._slabs)})"
        )
