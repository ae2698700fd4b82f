"""Device prefetch: copy the next batch to the GPU on a side stream while the current one is used.

``DevicePrefetcher(loader, "cuda")`` wraps any iterable of host batches (a shmloader or torch
DataLoader). It keeps up to ``depth`` batches in flight: for each it issues the host-to-device
copies of every tensor on a side stream (``non_blocking=True``; from a pinned arena slab this is
a DMA straight out of the slot), records a CUDA event, and hands the device batch to the user once
the current stream has been told to wait for that event.

Invariants:
- Order is the loader's order. When a device batch is handed out, the copies of the next
  ``depth`` batches have been issued and the batch after those is already taken from the loader
  (not yet copied): taking it happens while the last copy runs, so the loader's CPU time overlaps
  the DMA. So ``depth + 2`` host batches (the one handed out, ``depth`` copying, one taken) are
  held at once, plus at most one more whose copy has not yet completed (an older one is waited
  for, so a device that falls behind cannot make this hold the loader's memory unbounded). A
  shmloader ``DataLoader`` is told so (``_consumer_will_hold``) and gives its new slabs a slot
  for each, so its workers do not wait for slots held here; its iterator is also told, at each
  hand-over, how many of its batches are held here unseen (``_batches_ahead``), which the
  loader's ``state_dict()`` counts as not consumed. The same holds when the prefetcher is given
  the loader's iterator, a wrapper whose ``iter()`` returns it, or another prefetcher (whose
  iterator adds this one's count to its own); not through a generator, which hides the iterator.
- An error the loader raises, or the copy engine raises for a batch, reaches the user at that
  batch's turn, in its place, after the batches before it, and iteration may go on past it, as
  with the loader (the iteration is an iterator object, not a generator that an exception would
  end). Once raised, the error makes no reference cycle with this pass (review 81), so a pass
  the user drops after catching it goes, the loader's iterator with it. One still queued when
  the pass is dropped does: its traceback holds the frame that queued it, and so the pass, until
  a garbage collection (clearing its traceback would cost the user the traceback of what they
  were handling; review 77).
- A host batch — and so its arena slot — is kept alive until its copy's event has completed
  (``query()`` true, or ``synchronize()`` at the end), so a recycled slot is never overwritten
  under an in-flight DMA (FFCV and SPDL do the same). Then the prefetcher lets go of it. When
  its source is a shmloader iterator itself (given the loader, its iterator, or a wrapper whose
  ``iter()`` is that iterator), no other code saw the batch, and the iterator gets back at once
  the slots of the views that die with that (``_copies_done``), without the wait on the current
  stream that the copy fence (:mod:`shmloader.fence`) applies to batches whose copies it cannot
  see. A view something else still holds (the device batch, if the engine or a custom batch
  class left one in it) keeps its slot until it dies, and then goes through the fence as any
  (review 50). Batches from any other source (a wrapper or loader subclass whose ``iter()``
  yields its own batches: it may have kept them, or queued copies from them) always go through
  the fence (review 58).
- Device tensors handed out are marked as used by the consumer stream (``record_stream``), so the
  caching allocator does not reuse their memory while the consumer still reads them.
- Batches are walked as torch's ``pin_memory`` walks them (:func:`map_tensors`); a custom batch
  class is handed out as it is, its tensors not copied.
- The CUDA calls sit behind :class:`CopyEngine`; tests pass a fake that records calls.
- On a ``cpu`` device it is a pass-through (the loader's batches, unchanged); a ``cuda`` device on
  a machine without CUDA is an error at construction, not at the first batch.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import (
    Callable,
    Iterable,
    Iterator,
    Mapping,
    MutableMapping,
    MutableSequence,
    Sequence,
)
from typing import Any, Protocol

import torch


class Event(Protocol):
    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class CopyEngine(Protocol):
    def copy(self, batch: Any) -> tuple[Any, Event]:
        """Start copying ``batch`` to the device; the device batch and its completion event."""
        ...

    def hand_over(self, device_batch: Any, event: Event) -> None:
        """Make the consumer's stream wait for ``event`` and own ``device_batch``."""
        ...


def map_tensors(batch: Any, fn: Any) -> Any:
    """``batch`` with ``fn`` applied to every tensor, structure kept, walked as torch's
    ``pin_memory`` walks a batch: mappings (a mutable one copied with ``copy.copy`` and
    updated, so a ``defaultdict`` or a ``UserDict`` keeps its kind), named tuples, tuples and
    sequences; strings and any other object are left as they are."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, str | bytes):
        return batch
    if isinstance(batch, Mapping):
        items = {k: map_tensors(v, fn) for k, v in batch.items()}
        try:
            if isinstance(batch, MutableMapping):
                clone = copy.copy(batch)
                clone.update(items)
                return clone
            return type(batch)(items)  # type: ignore[call-arg]
        except TypeError:  # a mapping type that cannot be rebuilt so: a plain dict, as torch
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(map_tensors(v, fn) for v in batch))
    if isinstance(batch, tuple):  # a subclass keeps its kind (torch.return_types.max ...)
        return type(batch)(map_tensors(v, fn) for v in batch)
    if isinstance(batch, Sequence):
        values = [map_tensors(v, fn) for v in batch]
        try:
            if isinstance(batch, MutableSequence):
                seq = copy.copy(batch)
                for i, v in enumerate(values):
                    seq[i] = v
                return seq
            return type(batch)(values)  # type: ignore[call-arg]
        except TypeError:
            return values
    return batch


def each_tensor(batch: Any) -> Iterator[torch.Tensor]:
    """Every tensor of ``batch``, walked as :func:`map_tensors` walks it, nothing rebuilt (a
    tuple subclass whose constructor checks what it holds must not be rebuilt from ``None``s:
    review 39)."""
    stack = [batch]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, str | bytes):
            continue
        elif isinstance(x, Mapping):
            stack.extend(x.values())
        elif isinstance(x, Sequence):
            stack.extend(x)


class CudaCopyEngine:
    """Copies on one side stream of ``device``."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]

    def copy(self, batch: Any) -> tuple[Any, Event]:
        with torch.cuda.stream(self.stream):
            out = map_tensors(batch, lambda t: t.to(self.device, non_blocking=True))
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self.stream)
        return out, event

    def hand_over(self, device_batch: Any, event: Event) -> None:
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(event)  # type: ignore[arg-type]
        for t in each_tensor(device_batch):
            t.record_stream(consumer)


class DevicePrefetcher:
    """Iterates device copies of ``loader``'s batches, ``depth`` copies ahead."""

    def __init__(
        self,
        loader: Iterable[Any],
        device: torch.device | str = "cuda",
        depth: int = 1,
        engine: CopyEngine | None = None,
    ) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        kind = torch.device(device).type
        if engine is None and kind not in ("cpu", "cuda"):
            raise ValueError(
                f"DevicePrefetcher copies to 'cuda' devices (or passes batches through on 'cpu'), "
                f"got device {device!r}"
            )
        if engine is None and kind == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(
                f"DevicePrefetcher(device={device!r}) needs CUDA, and torch reports none "
                "(torch.cuda.is_available() is False); pass device='cpu' to iterate the loader "
                "unchanged, or run where a GPU is visible."
            )
        self.loader = loader
        self.device = device
        self.depth = depth
        self._engine = engine
        # On the CPU there is nothing to copy: the loader's batches pass through unchanged.
        self._passthrough = engine is None and kind == "cpu"

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        if self._passthrough:
            return iter(self.loader)
        return _Prefetching(self, self._engine or CudaCopyEngine(self.device))

    def _consumer_will_hold(self, batches: int) -> None:
        """Another prefetcher over this one keeps up to ``batches`` of its batches: a shmloader
        loader behind it is told of those and of the ``depth + 2`` held here."""
        will_hold = getattr(self.loader, "_consumer_will_hold", None)
        if will_hold is not None:
            will_hold(batches if self._passthrough else batches + self.depth + 2)


_NONE = object()  # no batch taken ahead


class _LoaderError:
    """An error the loader raised when a batch was taken: raised at that batch's turn.
    ``consumed``: whether it used up a batch (a sample's error does; a timeout, or the arena
    at its cap, does not: the loader gives that batch at the next call)."""

    def __init__(self, error: Exception, consumed: bool = True) -> None:
        self.error = error
        self.consumed = consumed


class _Prefetching:
    """One pass of a :class:`DevicePrefetcher` over its loader. An iterator, not a generator:
    an error the loader raises reaches the user at that batch's turn, after the batches before
    it, and the user may go on past it, as with the loader itself."""

    def __init__(self, owner: DevicePrefetcher, engine: CopyEngine) -> None:
        # In the loader's order: (host, device, event) of copies issued, or an error (the
        # loader's, or the engine's for that batch), raised at its turn.
        self.queue: deque[tuple[Any, Any, Event] | _LoaderError] = deque()
        # Handed out, copy may still run: (host, event)
        self.retiring: deque[tuple[Any, Event]] = deque()
        self.ahead: Any = _NONE  # taken from the loader, not copied yet
        self.ended = False
        # An error that used up no batch is queued: take nothing more from the loader until it
        # is raised (review 39: taking on raised the same cap error twice, and each counted
        # as a batch held, so a state saved there repeated one).
        self.stalled = False
        self.taken = 0  # batches (and errors that used one up) handed out: _batches_taken()
        self.end_raised = False  # StopIteration raised to this pass's consumer
        # What a prefetcher over this one holds unseen (_batches_ahead), counted with ours.
        self.outer: tuple[int, bool] = (0, False)
        # Such a prefetcher takes this pass's batches: each handed out counts in ``outer``
        # until it says how many it holds (_taken_unseen); the pass of it that counts
        self.count_unseen = False
        self.outer_by: int | None = None  # (its id: shmloader.unseen)
        loader = owner.loader
        will_hold = getattr(loader, "_consumer_will_hold", None)
        if will_hold is not None:  # a shmloader DataLoader: slots for what is held here
            will_hold(owner.depth + 2)
        self.depth = owner.depth
        self.engine = engine
        self.source = iter(loader)
        # Only a shmloader iterator taken as it is (from the loader, a loader subclass or a
        # wrapper whose iter() is it, or given itself): then no code but this pass has seen its
        # batches, so no copy of theirs but this pass's own can be queued. Never the loader's
        # hook reached through a wrapper or subclass whose iter() yields batches of its own: it
        # may have queued a copy from a view it then dropped, on the current stream, which only
        # the copy fence waits for (review 58: 10 of 16 such copies read a later batch).
        self.done: Callable[[list[Any]], None] | None = getattr(
            self.source, "_copies_done", None
        )
        # Also over a shmloader iterator the loader did not size (the prefetcher was given
        # iter(loader), or a wrapper whose iter() returns it; review 37), its state_dict()
        # rewinds what is held here. (Such a loader's slabs keep their slot count: the arena
        # adds a slab if the workers need one.)
        self.rewindable(0)
        # A shmloader iterator counts what is held here unseen, for its loader's state_dict()
        # (per iterator: two prefetchers over one loader keep their own counts).
        # (as this pass: with persistent workers, other passes have the same iterator)
        self.tell_ahead: Callable[[int, bool, object], None] | None = getattr(
            self.source, "_batches_ahead", None
        )
        # ... from the moment it hands one out: a state_dict() before _tell() counts it
        taken_unseen = getattr(self.source, "_taken_unseen", None)
        if taken_unseen is not None:
            taken_unseen(True, self)
        # How many batches the source has used up, errors included (a shmloader iterator, or a
        # prefetcher's pass): whether an error it raises used one up.
        self.source_taken: Callable[[], int] | None = getattr(
            self.source, "_batches_taken", None
        )

    def __iter__(self) -> _Prefetching:
        return self

    def __next__(self) -> Any:
        while True:
            # Hand out the oldest copy once ``depth`` more are issued behind it (and the next
            # batch is taken), or once the loader has nothing more.
            if self.queue and (len(self.queue) > self.depth or self.ended or self.stalled):
                item = self.queue.popleft()
                if isinstance(item, _LoaderError):
                    self.stalled = self.stalled and item.consumed
                    self.taken += item.consumed
                    self._handed_unseen(item.consumed)
                    self._tell()
                    # Raised, the error's traceback holds this frame: no local of it may hold
                    # the error (a cycle that kept the loader's iterator alive until a garbage
                    # collection; review 81).
                    error = item.error
                    del item
                    try:
                        raise error
                    finally:
                        del error
                self.taken += 1
                self._handed_unseen(1)
                try:
                    batch = self._hand_over(item)
                finally:
                    self._tell()  # handed out, or its error raised in its place: not held here
                del item  # (else this frame still held the host batch _retire lets go of)
                self._retire_completed()
                return batch
            if self.ended:
                self.close()
                self._tell(end_seen=True)
                raise StopIteration
            if self.ahead is not _NONE:
                host, self.ahead = self.ahead, _NONE
                try:
                    self.queue.append((host, *self.engine.copy(host)))
                except Exception as e:  # noqa: BLE001 - raised at this batch's turn, in its place
                    self.queue.append(_LoaderError(e))
                del host  # held in the queue alone (_retire)
            # Take the next host batch from the loader now, while the copy just issued runs
            # on the side stream: the loader's CPU time overlaps the DMA even when the consumer
            # waits for the whole device (torch.cuda.synchronize()) every step.
            taken = self.source_taken
            before = None if taken is None else taken()
            try:
                self.ahead = next(self.source)
            except StopIteration:
                self.ended = True
            except Exception as e:  # noqa: BLE001 - the loader's error, raised in its turn
                consumed = taken is None or taken() != before
                self.queue.append(_LoaderError(e, consumed))
                self.stalled = not consumed

    def _tell(self, end_seen: bool = False) -> None:
        """Tell a shmloader iterator how many of its batches are held here unseen, and whether
        the epoch's end, found here, is still unseen by the user (not once it was raised);
        a prefetcher over this one adds its own (:meth:`_batches_ahead`)."""
        self.end_raised = self.end_raised or end_seen
        if self.tell_ahead is not None:
            held = sum(not isinstance(i, _LoaderError) or i.consumed for i in self.queue)
            held += (self.ahead is not _NONE) + self.outer[0]
            self.tell_ahead(held, (self.ended and not self.end_raised) or self.outer[1], self)

    def _batches_ahead(self, batches: int, end_unseen: bool = False, by: object = None) -> None:
        """A prefetcher's pass ``by`` over this one holds ``batches`` of this pass's, unseen by
        the user (and maybe the end): the shmloader iterator behind is told of them with those
        held here. Ignored from a pass that is not the one counting (shmloader.unseen)."""
        if id(by) == self.outer_by:
            self.outer = (batches, end_unseen)
            self._tell()

    def _handed_unseen(self, batches: int) -> None:
        """``batches`` handed to a prefetcher over this one that counts them held unseen from
        now (:meth:`_taken_unseen`) until it says how many it holds (:meth:`_batches_ahead`)."""
        if self.count_unseen and batches:
            self.outer = (self.outer[0] + batches, self.outer[1])

    def _taken_unseen(self, counting: bool = True, by: object = None) -> None:
        """A prefetcher's pass ``by`` over this one takes this pass's batches: as a shmloader
        iterator's (:mod:`shmloader.unseen`), each counts as held unseen from the moment it is
        handed out, else a checkpoint thread's state during the outer one's first steps
        skipped them (review 49). ``counting=False``: that pass is closed, and what it held is
        dropped."""
        if counting:
            self.count_unseen, self.outer_by = True, id(by)
            self.outer = (0, False)  # (an earlier pass's count: shmloader.unseen)
            self._tell()
        elif id(by) == self.outer_by:
            self.count_unseen = False
            self.outer = (0, False)
            self._tell()

    def _batches_taken(self) -> int:
        """Batches this pass handed out, errors that used one up included (for a prefetcher
        over this one)."""
        return self.taken

    def rewindable(self, batches: int) -> None:
        """A prefetcher over this one holds up to ``batches`` ahead: the shmloader iterator
        behind keeps enough to rewind those and the ``depth + 2`` held here."""
        rewindable = getattr(self.source, "rewindable", None)
        if rewindable is not None:
            rewindable(batches + self.depth + 2)

    def _hand_over(self, item: tuple[Any, Any, Event]) -> Any:
        host, device_batch, event = item
        self.retiring.append((host, event))  # its copy may still read the host batch
        self.engine.hand_over(device_batch, event)
        return device_batch

    def _retire_completed(self) -> None:
        """Let go of the host batches whose copies have completed. Host batches kept for
        copies not done: the one handed out last, and at most one before it (its copy was
        issued depth + 1 batches ago): wait for older ones, so that a device that falls behind
        cannot make this hold the loader's memory unbounded."""
        while self.retiring and self.retiring[0][1].query():
            self._retire()
        while len(self.retiring) > 2:
            self.retiring[0][1].synchronize()
            self._retire()

    def _retire(self) -> None:
        """The oldest host batch's copy is done: let go of it. A shmloader loader gets the slots
        of the views that die with it back at once, without the copy fence (``_copies_done``);
        those still held elsewhere (the device batch, or whatever else kept the host batch) go
        back when they die, as any."""
        box = [self.retiring.popleft()[0]]
        if self.done is not None:
            self.done(box)

    def close(self) -> None:
        """Wait for every copy issued, then let go of the host batches (their slots may then
        be reused: no copy still reads them)."""
        for _, event in self.retiring:
            event.synchronize()
        for item in self.queue:
            if not isinstance(item, _LoaderError):
                item[2].synchronize()
        self.retiring.clear()
        self.queue.clear()
        self.ahead = _NONE
        # the source's next batches are its user's own again (a pass cut short in __init__
        # has no source)
        taken_unseen = getattr(getattr(self, "source", None), "_taken_unseen", None)
        if taken_unseen is not None:
            taken_unseen(False, self)

    def __del__(self) -> None:
        self.close()
