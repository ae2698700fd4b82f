"""Errors raised by the arena. Each message says what happened, the numbers, and what to change."""

from __future__ import annotations


class ArenaError(RuntimeError):
    """Base class of every arena error."""


class ArenaCapacityError(ArenaError):
    """A segment could not be reserved: the backing store (``/dev/shm`` or RAM) lacks the bytes.
    ``never``: the segment is larger than the whole store, so no freeing makes room for it."""

    never: bool = False


class ArenaExhaustedError(ArenaError):
    """No slot is free, the arena is at its ``max_bytes`` cap, and nothing in flight frees one."""


class StaleSlotError(ArenaError):
    """A slot was released twice for the same generation, or used in a state that forbids it."""


class ArenaDescriptorError(ArenaError):
    """Another slab would leave the process without file descriptors (``ulimit -n``)."""


class InheritedArenaError(ArenaError):
    """An arena's books were used in a process that inherited them through ``fork()``."""
