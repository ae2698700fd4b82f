"""Slot memory a collate_fn keeps past its batch, found in the worker and reported once.

:func:`shmloader.empty` hands out memory inside the batch's slot. A collate_fn that keeps it
past its batch (a pool of earlier batches for mixup, a "last good batch") sees a later batch's
bytes there once the main process is done with the batch and the slot is reused, where torch's
``torch.empty`` would have stayed as it was (review 50). Copying would defeat the zero-copy
point and the slot cannot be held back for the worker, so the worker says so.

Invariants:
- Watched is the memory ``empty()`` hands out while the worker's collate_fn runs
  (:data:`collating`, threads of a pool it runs included): ``empty()`` records a weak reference
  to the array the tensor's storage holds (:data:`HANDED`), alive while any view of that memory
  is (a view, ``numpy()``, ``detach()``), not only the tensor object (review 52). Memory the
  dataset allocates is not watched: a generator names its last batch until it is resumed, and
  no look at liveness tells that from keeping it (reviews 53, 54: the look-outs that tried
  missed one-deep caches, or generators that kept, or warned of common generator shapes, and
  one walked every local of the generator after each task). The README states the rule for
  both.
- The worker looks right after each task (:meth:`KeptWatch.look`), once its own references
  are gone; memory alive then only through a reference cycle is collected first: the young
  generations, then, 3 times per worker at most, all of them (after that the worker stops
  looking). Looking runs no user code but the finalizers a collection runs.
- The warning is emitted once per worker, in the next task after its fetch, inside its error
  handling (:meth:`KeptWatch.warn`): with warnings as errors that batch raises it, as a
  dataset's error raised after its fetch would, and the worker lives on (review 52; raised
  before the fetch, an IterableDataset's replica did not advance for the batch counted as
  consumed, and a resume lost a batch: review 54).
"""

from __future__ import annotations

import gc
import warnings
import weakref

import numpy as np

HANDED: list[weakref.ref[np.ndarray]] = []  # appended by shmloader.collate.empty
collating = False  # the worker's collate_fn is running (set by the worker)
LOOKS = 3  # full garbage collections a worker spends on this before it stops looking


class KeptWatch:
    """One worker's look-out for slot memory its collate_fn kept."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.looks = LOOKS
        self.pending = 0  # kept memory found, not yet reported

    def look(self) -> None:
        """After a task: is memory ``empty()`` handed out to its collate_fn still alive?"""
        refs = HANDED[:]
        del HANDED[: len(refs)]
        if self.looks <= 0 or not any(ref() is not None for ref in refs):
            return
        # Only a cycle made during the task holds it? Such a cycle is young: a collection of
        # the young generations frees it at little cost, and spends nothing (review 55: cycles
        # in every batch used up the budget, and a keep that began later went unseen).
        gc.collect(1)
        if not any(ref() is not None for ref in refs):
            return
        self.looks -= 1
        gc.collect()
        kept = sum(ref() is not None for ref in refs)
        if kept:
            self.looks, self.pending = 0, kept

    def warn(self) -> None:
        """Report what :meth:`look` found, once (call where an error fails the task)."""
        kept, self.pending = self.pending, 0
        warnings.warn(
            f"{self.where}: {kept} tensor(s) that shmloader.empty() allocated in a batch's slot "
            "are still alive after that batch (kept by the collate_fn). That memory is the "
            "batch's: once the training loop is done with the batch its slot is reused, and "
            "what was kept shows a later batch's bytes. Keep a copy (.clone()) instead, or "
            "allocate what you keep with torch.empty",
            UserWarning,
            stacklevel=1,
        )
