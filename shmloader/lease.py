"""Lending batches: tensor views over a slot, and the slot's return when the last view dies.

For each yielded batch the main process takes one fresh ``memoryview`` of the slot; every tensor
and array of the batch is a zero-copy view created from that memoryview, so the memoryview lives
exactly as long as any view of the batch (slices, ``.view()``, ``.numpy()`` included; ``.clone()``
detaches). A ``weakref.finalize`` on it releases the slot to the arena.

Invariants:
- A slot is LENT while any view of its batch lives, and FREE right after the last one dies.
- :meth:`Leases.release_early` runs the same finalizer ahead of time; the later death of the views
  is then a no-op (the finalizer runs once; a stale generation is ignored by the arena).
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
        self._live: dict[tuple[int, int], weakref.finalize[Any, Any]] = {}
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
        key = (ref.slab_id, ref.slot)
        with self._lock:
            self._live[key] = weakref.finalize(mv, self._return, key, ref)
        return batch  # when no leaf kept `mv` alive, the finalizer has already run

    def _return(self, key: tuple[int, int], ref: SlotRef) -> None:
        with self._lock:
            self._live.pop(key, None)
        self.arena.release(ref)

    def release_early(self, batch: Any) -> int:
        """Return the slots of ``batch`` now, whatever views remain. Returns how many."""
        keys = {k for k in (self._key_of(t) for t in _tensors_in(batch)) if k is not None}
        n = 0
        for key in keys:
            with self._lock:
                fin = self._live.get(key)
            if fin is not None and fin.alive:
                fin()
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
