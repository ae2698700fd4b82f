"""Streaming copies into slot memory: how a worker writes a large batch without the caches.

Mechanism only: :func:`gather` copies equal-sized blocks from given addresses into consecutive
places at ``dst`` with non-temporal stores (``arena/_stream.c``), which skip the
read-for-ownership of each destination line and leave the caches to the processes that read
them next. Whether a copy is large enough to gain, and whether streaming is faster on this
machine at all, is the caller's decision.

Invariants:
- :func:`gather` returns only after a store fence: every byte it wrote is visible to any other
  process before the caller's next store or system call (the READY that publishes the batch).
- ``AVAILABLE`` is False when the optional extension was not built (no C compiler at install)
  or the CPU has no streaming stores (non-x86); callers then copy as they always did.
- Addresses are trusted: the caller keeps the buffers alive for the call, and has checked that
  every source block and ``[dst, dst + len(srcs) * size)`` lie in memory it owns and do not
  overlap.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Final

_ext: ModuleType | None
try:
    from arena import _stream as _ext
except ImportError:  # built with optional=True: a machine without a C compiler still installs
    _ext = None

AVAILABLE: Final[bool] = _ext is not None and bool(_ext.STREAMING)


def gather(dst: int, size: int, srcs: Sequence[int]) -> None:
    """Copy block ``i`` (``size`` bytes at address ``srcs[i]``) to ``dst + i * size``, then
    fence. Raises ``RuntimeError`` when ``AVAILABLE`` is False."""
    if _ext is None or not AVAILABLE:
        raise RuntimeError(
            "arena.stream.gather: the streaming-copy extension (arena._stream) is not available "
            "on this install; check arena.stream.AVAILABLE first"
        )
    _ext.gather(dst, size, srcs)
