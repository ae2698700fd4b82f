"""Lending batches: tensor views over a slot, and the slot's return when the last view dies.

For each yielded batch the main process takes one fresh ``memoryview`` of the slot; every tensor
and array of the batch is a zero-copy view created from that memoryview, so the memoryview lives
exactly as long as any view of the batch (slices, ``.view()``, ``.numpy()`` included; ``.clone()``
detaches). A weak reference to it, with a callback, releases the slot to the arena (a plain
``weakref.ref`` callback rather than ``weakref.finalize``: this runs once per batch, and costs a
fraction as much).

Invariants:
- A slot is LENT while any view of its batch lives, and FREE right after the last one dies.
- :meth:`Leases.release_early` releases ahead of time and forgets the lease; the later death of
  the views is then a no-op (the entry is gone; a stale generation is ignored by the arena).
- ``held`` counts batches lent and not yet returned.
"""

from __future__ import annotations

import io
import math
import pickle
import threading
import weakref
from typing import Any

import numpy as np
import torch

from arena import Arena, Descriptor, SlotRef, array_view
from shmloader.dtypes import TORCH_DTYPE
from shmloader.pack import NDARRAY, TENSOR


class Leases:
    """The batches of one arena that the user holds."""

    def __init__(self, arena: Arena) -> None:
        self.arena = arena
        self._lock = threading.Lock()
        # id(weakref) -> (the weakref, kept alive so its callback fires; the slot ref)
        self._live: dict[int, tuple[weakref.ref[memoryview], SlotRef]] = {}
        self._by_slot: dict[tuple[int, int], int] = {}  # (slab id, slot) -> id(weakref)
        self._bases: dict[int, tuple[int, int, int]] = {}  # slab_id -> (base, slot_size, nslots)

    @property
    def held(self) -> int:
        return len(self._live)

    def open(self, desc: Descriptor) -> Any:
        """The batch ``desc`` describes, as views of its slot; the slot becomes LENT."""
        ref = desc.ref
        slab = self.arena.slab(ref.slab_id)
        if ref.slab_id not in self._bases:
            base = np.frombuffer(slab.segment.buffer, np.uint8, count=1).ctypes.data
            self._bases[ref.slab_id] = (base, slab.slot_size, slab.nslots)
        mv = slab.slot_buffer(ref.slot)
        desc.check(len(mv))
        arrays = desc.arrays
        leaves: list[Any] = [None] * len(arrays)

        def persistent_load(pid: tuple[int, int]) -> Any:
            kind, i = pid
            if leaves[i] is None:
                a = arrays[i]
                if kind == TENSOR:
                    dtype = TORCH_DTYPE[a.dtype]
                    n = math.prod(a.shape)
                    leaves[i] = (
                        torch.frombuffer(mv, dtype=dtype, count=n, offset=a.offset).view(a.shape)
                        if n
                        else torch.empty(a.shape, dtype=dtype)
                    )
                elif kind == NDARRAY:
                    leaves[i] = array_view(mv, a)
                else:
                    raise pickle.UnpicklingError(f"unknown leaf kind {kind} in batch payload")
            return leaves[i]

        payload = mv[desc.payload_offset : desc.payload_offset + desc.payload_len]
        unpickler = pickle.Unpickler(io.BytesIO(payload))
        unpickler.persistent_load = persistent_load  # type: ignore[method-assign]
        batch = unpickler.load()
        payload.release()
        self.arena.lend(ref)
        wr = weakref.ref(mv, self._on_dead)
        with self._lock:
            self._live[id(wr)] = (wr, ref)
            self._by_slot[(ref.slab_id, ref.slot)] = id(wr)
        return batch  # if no leaf keeps `mv` alive, its slot is released as this frame ends

    def _on_dead(self, wr: weakref.ref[memoryview]) -> None:
        self._forget_and_release(id(wr))

    def _forget_and_release(self, wid: int) -> bool:
        with self._lock:
            entry = self._live.pop(wid, None)
            if entry is None:
                return False
            ref = entry[1]
            self._by_slot.pop((ref.slab_id, ref.slot), None)
        self.arena.release(ref)
        return True

    def release_early(self, batch: Any) -> int:
        """Return the slots of ``batch`` now, whatever views remain. Returns how many."""
        keys = {k for k in (self._key_of(t) for t in _tensors_in(batch)) if k is not None}
        n = 0
        for key in keys:
            with self._lock:
                wid = self._by_slot.get(key)
            if wid is not None and self._forget_and_release(wid):
                n += 1
        return n

    def _key_of(self, t: torch.Tensor | np.ndarray) -> tuple[int, int] | None:
        ptr = t.data_ptr() if isinstance(t, torch.Tensor) else t.ctypes.data
        for slab_id, (base, slot_size, nslots) in self._bases.items():
            if base <= ptr < base + slot_size * nslots:
                return (slab_id, (ptr - base) // slot_size)
        return None


def _tensors_in(obj: Any) -> list[torch.Tensor | np.ndarray]:
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
