"""What a consumer holds of an iterator's batches, unseen by the user: the count a
``DevicePrefetcher`` pass keeps on a shmloader iterator for ``DataLoader.state_dict()``.

A pass takes batches ahead of its user. A state saved in the loop counts those as not consumed
(``ahead``), and an epoch whose end the pass found, not yet raised to the user, as not over
(``end_unseen``); from the moment the pass registers (:meth:`HeldUnseen._taken_unseen`) each
batch ``next()`` hands out counts at once (the iterator adds it under the lock a checkpoint
thread's state waits for), until the pass says how many it holds (:meth:`_batches_ahead`).

Invariants:
- One pass counts at a time: the latest to register, from 0 (the user goes on with it; what an
  earlier pass took and still holds, the user does not get, as after a ``break``). Only it sets
  the count, and only it turns counting off when it closes (it may still set the count after:
  a closed pass under another pass tells what that one holds). With ``persistent_workers``
  every ``iter(loader)`` returns the same iterator, so an older pass of it may close (or tell)
  after a newer one registered: its calls are ignored (review 51: its close turned the newer
  pass's counting off, and resumes skipped the batches that pass held).
- ``_reset_unseen`` (a new epoch) forgets the pass: it registers again after its ``iter()``.
- The pass is known by its ``id``, not held: an iterator the user keeps must not keep a
  dropped pass alive (its close turns the counting off). A dead pass's id, reused by a new
  pass, is harmless: the dead one calls no more.
"""

from __future__ import annotations


class HeldUnseen:
    """The count, for an iterator class that adds one to ``ahead`` for each batch it hands out
    while ``_count_unseen`` is set."""

    _ended: bool  # the iterator met its epoch's end (StopIteration raised to its consumer)
    ahead: int  # batches the consumer holds unseen
    end_unseen: bool  # the consumer found the epoch's end, not yet raised to its user
    _count_unseen: bool  # a batch handed out counts as held unseen at once
    _unseen_by: int | None  # id of the pass counting (not the pass: that would keep it alive)

    def _epoch_over(self) -> bool:
        """Whether the epoch is over for the user: the iterator met its end, and no consumer
        holds batches of it or its end unseen (the one rule ``state_dict()`` goes by)."""
        return self._ended and not self.ahead and not self.end_unseen

    def _reset_unseen(self) -> None:
        self.ahead, self.end_unseen = 0, False
        self._count_unseen, self._unseen_by = False, None

    def _taken_unseen(self, counting: bool = True, by: object | None = None) -> None:
        """Pass ``by`` takes this epoch's batches: each counts as held unseen from the moment
        ``next()`` hands it out until ``by`` says how many it holds (``_batches_ahead``); else a
        state taken in between counted it as seen, and the resume skipped it (review 48).
        ``counting=False``: ``by`` closed, and what it held the user never gets from it: the
        loop goes on without it (review 49: each plain ``next()`` after an abandoned pass
        counted as unseen). Ignored from a pass that is no longer the one counting."""
        if counting:
            # What an earlier pass told is no longer counted: it no longer holds this epoch's
            # batches for the user (review 52: counted on, they were resumed again).
            self.ahead, self.end_unseen = 0, False
            self._count_unseen, self._unseen_by = True, id(by)
        elif id(by) == self._unseen_by:
            # (still the one counting: a pass over another closes when its source ends, and
            # tells what the pass over it still holds)
            self.ahead, self.end_unseen, self._count_unseen = 0, False, False

    def _batches_ahead(
        self, batches: int, end_unseen: bool = False, by: object | None = None
    ) -> None:
        """Pass ``by`` holds ``batches`` of this iterator's, unseen, and maybe (``end_unseen``)
        the epoch's end: ``state_dict()`` counts them as not consumed, and the epoch as not
        over. Ignored from a pass that is not the one counting."""
        if id(by) == self._unseen_by:
            self.ahead, self.end_unseen = batches, end_unseen
