"""The DataLoader's extra ``arena_*`` arguments, validated once, at construction.

:func:`arena_options` is the one place these arguments are checked; ``DataLoader.__init__`` calls
it before anything else and keeps the resulting :class:`ArenaOptions`. Every error names the
argument, the value it got, and what to give instead.

Invariants of an :class:`ArenaOptions`:
- ``backend`` is a :class:`arena.Backend`.
- ``max_bytes`` is ``None`` (the default cap, half the available RAM when the arena is made) or a
  plain ``int >= PAGE``: a cap below one page could never hold a batch, since every slot is at
  least one page. Any integral type is accepted (``int``, ``np.int64``, anything with
  ``__index__``); ``bool`` and ``float`` are not.
- ``slots_per_slab`` is ``None`` (the loader's default) or a plain ``int >= 1``, accepted the
  same way.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, SupportsIndex

from arena import PAGE, Backend, default_max_bytes

_HINTS = {
    "arena_max_bytes": "give the cap in bytes, e.g. arena_max_bytes=8 * 2**30 for 8 GiB",
    "arena_slots_per_slab": "give a whole number of slots, e.g. arena_slots_per_slab=4",
}


@dataclass(frozen=True)
class ArenaOptions:
    """The validated ``arena_*`` arguments of one loader (see the module invariants)."""

    backend: Backend = Backend.AUTO
    max_bytes: int | None = None
    slots_per_slab: int | None = None

    def planned_max_bytes(self) -> int:
        """The cap an arena made now would get: ``max_bytes``, or half the available RAM."""
        return default_max_bytes() if self.max_bytes is None else self.max_bytes


def _integer(name: str, value: Any) -> int | None:
    """``value`` as a plain int (None stays None); TypeError naming ``name`` otherwise."""
    if value is None:
        return None
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(
        f"{name} must be an integer or None, got {value!r} ({type(value).__name__}); "
        f"{_HINTS[name]}"
    )


def arena_options(
    arena_backend: Backend | str,
    arena_max_bytes: SupportsIndex | None,
    arena_slots_per_slab: SupportsIndex | None,
) -> ArenaOptions:
    """Check the three ``arena_*`` arguments and return them normalised (module invariants)."""
    try:
        backend = Backend(arena_backend)
    except ValueError:
        raise ValueError(
            f"arena_backend must be one of {[b.value for b in Backend]}, got {arena_backend!r}"
        ) from None
    max_bytes = _integer("arena_max_bytes", arena_max_bytes)
    slots_per_slab = _integer("arena_slots_per_slab", arena_slots_per_slab)
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"arena_max_bytes must be positive, got {max_bytes}")
    if max_bytes is not None and max_bytes < PAGE:
        raise ValueError(
            f"arena_max_bytes={max_bytes:,} is below one page ({PAGE:,} bytes), the smallest "
            f"slot, so no batch could ever fit; {_HINTS['arena_max_bytes']}"
        )
    if slots_per_slab is not None and slots_per_slab < 1:
        raise ValueError(f"arena_slots_per_slab must be >= 1, got {slots_per_slab}")
    return ArenaOptions(backend, max_bytes, slots_per_slab)
