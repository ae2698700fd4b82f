"""Slot memory the user's code keeps past its batch, found in the worker and reported once.

:func:`shmloader.empty` hands out memory inside the batch's slot. Code that keeps it past its
batch (a collate_fn's pool of earlier batches, a "last good batch") sees a later batch's bytes
there once the main process is done with the batch and the slot is reused, where torch's
``torch.empty`` would have stayed as it was (review 50). Copying would defeat the zero-copy
point and the slot cannot be held back for the worker, so the worker says so.

Invariants:
- ``empty()`` records a weak reference to the array each slot tensor's storage holds
  (:data:`HANDED`): alive while any view of that memory is (a view, ``numpy()``,
  ``detach()``), not only the tensor object (review 52).
- The worker looks right after each task (:meth:`KeptWatch.look`), once its own references
  are gone: memory still alive then is kept, unless a suspended generator of the dataset's
  (a ``batch_size=None`` stream) merely still names its last batch, or a reference cycle holds
  it (collected first, a few times per worker at most; then the worker stops looking). A
  one-deep cache is caught there: looked at after the next fetch instead, it had already let
  go of the memory it read (review 53).
- Looking never raises. The warning is emitted once per worker, at the start of the next task,
  inside its error handling (:meth:`KeptWatch.warn`): with warnings as errors that batch
  raises it, as a dataset's error, and the worker lives on (review 52).
"""

from __future__ import annotations

import gc
import inspect
import warnings
import weakref
from typing import Any

import numpy as np
import torch

HANDED: list[weakref.ref[np.ndarray]] = []  # appended by shmloader.collate.empty
LOOKS = 3  # garbage collections a worker spends on this before it stops looking


class KeptWatch:
    """One worker's look-out for kept slot memory."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.looks = LOOKS
        self.pending = 0  # kept memory found, not yet reported

    def look(self, fetcher: Any) -> None:
        """After a task: is memory ``empty()`` handed out for it still alive?"""
        refs = HANDED[:]
        del HANDED[: len(refs)]
        if self.looks <= 0:
            return
        try:
            alive = _unnamed(_alive(refs), fetcher)
            if not alive:
                return
            self.looks -= 1
            del alive
            gc.collect()  # (only a cycle holds it?)
            kept = len(_unnamed(_alive(refs), fetcher))
        except Exception:  # noqa: BLE001 - a look-out must not fail the worker
            return
        if kept:
            self.looks, self.pending = 0, kept

    def warn(self) -> None:
        """Report what :meth:`look` found, once (call where an error fails the task)."""
        kept, self.pending = self.pending, 0
        warnings.warn(
            f"{self.where}: {kept} tensor(s) that shmloader.empty() allocated in a batch's slot "
            "are still alive after that batch (kept by the collate_fn or the dataset). That "
            "memory is the batch's: once the training loop is done with the batch its slot is "
            "reused, and what was kept shows a later batch's bytes. Keep a copy (.clone()) "
            "instead, or allocate what you keep with torch.empty",
            UserWarning,
            stacklevel=1,
        )


def _alive(refs: list[weakref.ref[np.ndarray]]) -> list[np.ndarray]:
    return [a for a in (ref() for ref in refs) if a is not None]


def _unnamed(alive: list[np.ndarray], fetcher: Any) -> list[np.ndarray]:
    """Of ``alive``, the memory no variable of the dataset's suspended generators names."""
    if not alive:
        return alive
    named = _named_by_generators(fetcher)
    if not named:
        return alive
    out = []
    for a in alive:
        lo = int(a.ctypes.data)
        hi = lo + a.nbytes
        if not any(lo <= p < hi for p in named):
            out.append(a)
    return out


def _named_by_generators(fetcher: Any) -> list[int]:
    """Addresses of the tensors and arrays the local variables of the dataset's iterator name,
    if it is a suspended generator (and of those it delegates to with ``yield from``), looking
    into dicts, lists and tuples."""
    gen = getattr(fetcher, "dataset_iter", None)
    found: list[int] = []
    while inspect.isgenerator(gen) and gen.gi_frame is not None:
        stack: list[Any] = list(gen.gi_frame.f_locals.values())
        seen = 0
        while stack and seen < 1000:
            x = stack.pop()
            seen += 1
            if isinstance(x, torch.Tensor):
                if x.device.type == "cpu" and not x.is_meta:
                    found.append(x.data_ptr())
            elif isinstance(x, np.ndarray):
                found.append(int(x.ctypes.data))
            elif isinstance(x, dict):
                stack.extend(x.values())
            elif isinstance(x, list | tuple):
                stack.extend(x)
        gen = gen.gi_yieldfrom
    return found
