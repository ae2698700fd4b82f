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
  generations at once; all of them (a full collection, whose cost grows with the heap) the
  first 3 times it is needed, then once each time the worker's task count doubles, memory
  still alive waiting its turn. So a worker spends O(log tasks) full collections on this, and
  a keep is reported however many old cycles came before it (review 61). Looking runs no user
  code but the finalizers a collection runs.
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
LOOKS = 3  # full garbage collections a worker spends at once; then one each time tasks double
LATER = 8  # the first task at which a further one may be spent
SUSPECTS = 64  # memory waiting for a full collection: the newest this many


class KeptWatch:
    """One worker's look-out for slot memory its collate_fn kept."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.looks = LOOKS
        self.tasks = 0
        self.next_look = LATER
        # Memory alive after its task's young collection, not yet judged by a full one.
        self.suspects: list[weakref.ref[np.ndarray]] = []
        self.found = False  # reported (or about to be): nothing more to look for
        self.pending = 0  # kept memory found, not yet reported

    def look(self) -> None:
        """After a task: is memory ``empty()`` handed out to its collate_fn still alive?"""
        refs = HANDED[:]
        del HANDED[: len(refs)]
        self.tasks += 1
        if self.found or not (refs or self.suspects):
            return
        alive = [ref for ref in refs if ref() is not None]
        if alive:
            # Only a cycle made during the task holds it? Such a cycle is young: a collection
            # of the young generations frees it at little cost, and spends nothing (review 55:
            # cycles in every batch used up the budget, and a keep that began later went
            # unseen).
            gc.collect(1)
        suspects = [r for r in self.suspects + alive if r() is not None][-SUSPECTS:]
        self.suspects = suspects
        if not suspects:
            return
        # Alive through an old cycle, or kept. A full collection tells, but costs in proportion
        # to the worker's heap: spent at once LOOKS times, then once each time the tasks double
        # (review 61: cycles promoted to the oldest generation used up the budget, and a keep
        # that began later went unseen). Meanwhile the suspects wait (the interpreter's own
        # full collections free the cycles among them).
        if self.looks > 0:
            self.looks -= 1
        elif self.tasks >= self.next_look:
            self.next_look = 2 * self.tasks
        else:
            return
        gc.collect()
        kept = sum(ref() is not None for ref in suspects)
        self.suspects = []
        if kept:
            self.found, self.pending = True, kept

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
