"""The copy fence: slots of a page-locked slab go back to the arena only once the GPU has passed
every copy the user may have queued from them.

A view of a registered slab is pinned memory, so ``x.to("cuda", non_blocking=True)`` queues a
DMA that reads the slot *later*, when the stream gets to it. Once the user drops ``x`` its lease
dies at once, and a slot released then could be rewritten by a worker before that DMA has read
it. torch's own pinned batches are safe because its caching host allocator records an event for
every copy from them. Memory registered with ``cudaHostRegister`` gets no such event, so this
fence records one itself.

When leases die (:meth:`Leases.drain`), their slots are *held* behind one event recorded on the
current stream of the pinned device. They are released when that event has completed, which is
checked at every drain. When the batch the consumer needs next waits for a slot, the
dispatcher first *settles*: it waits for the held events rather than grow the arena.

Invariants:
- A held slot is released exactly once, after its event completed.
- Every wait is bounded: :meth:`CopyFence.settle` takes a timeout and returns what passed by then;
  the rest stays held.
- Held slots stay LENT in the arena: they are neither free nor counted as batches the user holds.
- Copies queued on the current stream (of the pinned device, at the drain) are covered. A copy on
  another stream must be waited for by the user, for example with ``DevicePrefetcher``, which
  holds each host batch until its own copy event has completed.
- Threads: the owner serializes every call (:class:`~shmloader.lease.Leases` holds its lock);
  :meth:`CopyFence.settle` takes that lock and holds it only between its waits.
- The event factory is a seam (:data:`EventFactory`): tests pass fakes, with no GPU.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

from arena import SlotRef


class Event(Protocol):
    def record(self) -> None: ...

    def query(self) -> bool: ...

    def wait(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for the event to complete; whether it did."""
        ...


EventFactory = Callable[[], Event]


class _CudaEvent:
    """A ``torch.cuda.Event`` recorded on the current stream of one device."""

    def __init__(self, device: str | None) -> None:
        import torch

        # An event records only on a stream of the device it was made on: fix that device now
        # (the named one, else the current one), so an event reused later matches its stream.
        if device and device.startswith("cuda:"):
            self._device = torch.device(device)
        else:
            self._device = torch.device("cuda", torch.cuda.current_device())
        self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]

    def record(self) -> None:
        import torch

        self._event.record(torch.cuda.current_stream(self._device))

    def query(self) -> bool:
        return bool(self._event.query())  # type: ignore[no-untyped-call]

    def wait(self, timeout: float) -> bool:
        # CUDA has no timed wait on an event: poll, sleeping between polls (50 us doubling up
        # to 200 us) so the wait leaves the core to the workers. This runs only when the batch
        # needed next waits for a slot the fence holds; it wakes at most 200 us late.
        deadline = time.monotonic() + timeout
        pause = 50e-6
        while not self._event.query():  # type: ignore[no-untyped-call]
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(pause, left))
            pause = min(2 * pause, 200e-6)
        return True


def cuda_events(device: str | None) -> EventFactory:
    """Events on the current stream of ``device`` (a ``cuda:N`` device name), or of the device
    current when the first event is made, when ``device`` names no index."""
    return lambda: _CudaEvent(device)


class CopyFence:
    """Slots whose batches died, each group behind the event recorded when they did."""

    def __init__(self, events: EventFactory) -> None:
        self._events = events
        self._held: deque[tuple[Event, list[SlotRef]]] = deque()
        self._spare: list[Event] = []  # completed events, recorded again instead of made anew

    def __bool__(self) -> bool:
        """Whether any slot is held."""
        return bool(self._held)

    @property
    def held(self) -> int:
        return sum(len(refs) for _, refs in self._held)

    def hold(self, refs: list[SlotRef]) -> None:
        """Hold ``refs`` until the GPU has passed everything queued on the stream so far."""
        event = self._spare.pop() if self._spare else self._events()
        try:
            event.record()
        except BaseException:  # nothing is held: the caller keeps its refs
            self._spare.append(event)
            raise
        self._held.append((event, refs))

    def passed(self) -> list[SlotRef]:
        """The held slots whose event has completed, oldest first (no waiting)."""
        out: list[SlotRef] = []
        held = self._held
        while held and held[0][0].query():
            event, refs = held.popleft()
            self._spare.append(event)
            out += refs
        return out

    def settle(
        self, timeout: float, lock: AbstractContextManager[Any] | None = None
    ) -> list[SlotRef]:
        """The held slots whose event completes within ``timeout`` seconds, oldest first; the
        rest stay held. ``lock`` (the owner's, when other threads use the fence too) is held
        while the fence is read or changed, never while it waits."""
        out: list[SlotRef] = []
        deadline = time.monotonic() + timeout
        lock = lock or contextlib.nullcontext()
        while True:
            with lock:
                if not self._held:
                    return out
                oldest = self._held[0]
            if not oldest[0].wait(max(0.0, deadline - time.monotonic())):  # raising: stays held
                return out
            with lock:
                # Another thread may have released this group meanwhile (and its event may be
                # recorded again since, for another group): only this very entry is ours.
                if self._held and self._held[0] is oldest:
                    self._held.popleft()
                    self._spare.append(oldest[0])
                    out += oldest[1]
