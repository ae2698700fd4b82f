"""The slot size a loader's tasks are sent with: the largest batch among the latest ones.

A task is sent with a slot of ``SlotSize.largest`` bytes before its batch exists, so that steady
state needs no NEED_SLOT round trip. That size follows the batches both ways: it grows at once
with any batch larger than it, and falls back when batches have become smaller, so that small
batches stop taking slots sized for big ones (held, each would pin a big slot: the arena serves
a request far smaller than its free slots from a snug class, :mod:`arena.allocator`).

Invariants:
- ``largest`` is the largest batch among the last ``WINDOW`` to ``2 * WINDOW - 1`` batches
  answered, and any slot granted on request since, in bytes; 0 before the first.
- One update per batch answered, in the main process: a comparison and a count, no allocation.
"""

from __future__ import annotations

from typing import Final

# Batches a size is remembered for, at least. Short, so a shrink takes effect within a few
# batches (a small batch sent meanwhile may still take a big slot, and keep it while held); a
# batch larger than every one remembered costs one round trip (NEED_SLOT, GRANT) when it
# outgrows the slot its task was sent with (size classes at least double, so often it fits).
WINDOW: Final = 8


class SlotSize:
    """The slot size for tasks not yet measured (see the module docstring)."""

    __slots__ = ("_current", "_left", "largest")

    def __init__(self) -> None:
        self.largest = 0
        self._current = 0  # the largest batch of the window being filled
        self._left = WINDOW  # batches until it is whole

    def saw(self, nbytes: int) -> bool:
        """A batch of ``nbytes`` bytes was laid out in a slot. True when ``largest`` fell."""
        if nbytes > self._current:
            self._current = nbytes
            if nbytes > self.largest:
                self.largest = nbytes
        self._left -= 1
        if self._left:
            return False
        # A whole window: remember it alone from now on.
        fell = self._current < self.largest
        self.largest, self._current, self._left = self._current, 0, WINDOW
        return fell

    def at_least(self, nbytes: int) -> None:
        """A slot of ``nbytes`` was granted to a batch that asked for it: tasks sent from now on
        get one as big (its READY then counts it as one batch seen)."""
        if nbytes > self._current:
            self._current = nbytes
            if nbytes > self.largest:
                self.largest = nbytes
