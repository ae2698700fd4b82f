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
  held at once, plus those whose copy has not yet completed. A shmloader ``DataLoader`` is told
  so (``_consumer_will_hold``) and gives its new slabs a slot for each, so its workers do not
  wait for slots held here.
- A host batch — and so its arena slot — is kept alive until its copy's event has completed
  (``query()`` true, or ``synchronize()`` at the end), so a recycled slot is never overwritten
  under an in-flight DMA (FFCV and SPDL do the same). When the device batch shares nothing with
  it (every leaf a tensor that was copied), a shmloader ``DataLoader`` then gets its slots back
  at once (``_copies_done``), without the wait on the current stream that the copy fence
  (:mod:`shmloader.fence`) applies to batches whose copies it cannot see.
- Device tensors handed out are marked as used by the consumer stream (``record_stream``), so the
  caching allocator does not reuse their memory while the consumer still reads them.
- The CUDA calls sit behind :class:`CopyEngine`; tests pass a fake that records calls.
- On a ``cpu`` device it is a pass-through (the loader's batches, unchanged); a ``cuda`` device on
  a machine without CUDA is an error at construction, not at the first batch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import torch

from shmloader.lease import leaves_in

_END = object()  # the loader is exhausted


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
    """``batch`` with ``fn`` applied to every tensor, structure kept (as torch's pin_memory)."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return type(batch)({k: map_tensors(v, fn) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(map_tensors(v, fn) for v in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(map_tensors(v, fn) for v in batch)
    return batch


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
        map_tensors(device_batch, lambda t: t.record_stream(consumer))


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
            yield from self.loader
            return
        engine = self._engine or CudaCopyEngine(self.device)
        will_hold = getattr(self.loader, "_consumer_will_hold", None)
        if will_hold is not None:  # a shmloader DataLoader: slots for what is held here
            will_hold(self.depth + 2)
        done = getattr(self.loader, "_copies_done", None)  # a shmloader DataLoader's
        tell_ahead = getattr(self.loader, "_batches_ahead", None)  # a shmloader DataLoader's
        source = iter(self.loader)
        in_flight: deque[tuple[Any, Any, Event]] = deque()  # (host, device, event)
        retiring: deque[tuple[Any, Event]] = deque()  # host batches whose copy may still run
        try:
            ahead = next(source, _END)
            while ahead is not _END:
                in_flight.append((ahead, *engine.copy(ahead)))
                # Take the next host batch from the loader now, while the copy just issued runs
                # on the side stream: the loader's CPU time overlaps the DMA even when the
                # consumer waits for the whole device (torch.cuda.synchronize()) every step.
                ahead = next(source, _END)
                if len(in_flight) > self.depth:
                    batch = self._hand_over(engine, in_flight, retiring, done)
                    if tell_ahead is not None:  # taken, not yet handed out: not consumed
                        tell_ahead(len(in_flight) + (ahead is not _END))
                    yield batch
            while in_flight:
                batch = self._hand_over(engine, in_flight, retiring, done)
                if tell_ahead is not None:
                    tell_ahead(len(in_flight))
                yield batch
        finally:
            for _, event in retiring:
                event.synchronize()
            for _, _, event in in_flight:
                event.synchronize()
            retiring.clear()
            in_flight.clear()

    @staticmethod
    def _hand_over(
        engine: CopyEngine,
        in_flight: deque[tuple[Any, Any, Event]],
        retiring: deque[tuple[Any, Event]],
        done: Callable[[Any], None] | None,
    ) -> Any:
        host, device_batch, event = in_flight.popleft()
        engine.hand_over(device_batch, event)
        retiring.append((host, event))
        while retiring and retiring[0][1].query():
            host = retiring.popleft()[0]  # that copy is done: the host batch (and its slot) may go
            if done is not None and _copied_whole(host):
                done(host)
        return device_batch


def _copied_whole(batch: Any) -> bool:
    """Whether the device copy of ``batch`` shares nothing with it: every tensor and array in it
    is a tensor that :func:`map_tensors` copies. A NumPy leaf, or a tensor inside an object it
    does not walk (a custom batch class), reaches the user as it is, still a view of the slot."""
    copied: list[int] = []
    map_tensors(batch, lambda t: copied.append(id(t)))
    leaves = leaves_in(batch)
    return len(leaves) == len(copied) and {id(x) for x in leaves} == set(copied)

