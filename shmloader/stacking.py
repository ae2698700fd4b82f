"""How a worker stacks a large leaf into its slot: ``torch.stack``, or streaming stores.

A slot is written once by a worker and read later by another process, usually after other
batches have gone through the caches. For such a write, non-temporal (streaming) stores
(``arena.stream.gather``) skip reading each destination line first and leave the caches alone.
Whether that is faster depends on the machine: on the 2-core AMD development machine they copy
image batches (32 x 786 KB) 1.5x faster than ``torch.stack``; on a 16-core Intel host with a
300 MiB L3, streaming copies measured about 0.9x at 14 processes. Cache sizes as the OS reports
them are unreliable in VMs (here sysfs says 32 MiB of L3, glibc's CPUID reading 320 MiB), so
each worker *measures* instead: its first eligible leaves alternate between the two copies,
timed, and from then on it uses the faster one (:class:`CopyChoice`).

``SHMLOADER_STREAMING`` (read once, at import; workers inherit it): ``auto`` (default) measures
as above, ``1`` always streams, ``0`` never does.

Invariants:
- Both copies give the same bytes; :func:`streamable` admits only batches where copying each
  sample's bytes is exactly ``torch.stack(batch, out=out)`` (anything else is stacked by torch,
  with torch's result or error).
- Only leaves of at least ``STREAM_MIN_BYTES`` are candidates: below it the batch and the slots
  in flight fit the caches and ``torch.stack`` wins everywhere measured.
- The choice is per process (a forked child starts measuring afresh) and, once made, final.
  A loader without persistent workers measures again in each epoch's workers: at most
  ``WARMUP + TRIALS`` (5) copies the slower way per worker, against a worker start-up that
  costs far more.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from typing import Final

import torch

from arena.stream import AVAILABLE, gather
from shmloader._torch_compat import torch_function_mode_active

# 2 processes at once, 4 slots each, 32 samples (development machine): torch.stack 57 GB/s vs
# 34 streaming at 2 MiB batches, 20-28 vs 33-42 at 8 MiB, 24 vs 35-37 at 25 MiB.
STREAM_MIN_BYTES: Final = 4 << 20
ENV: Final = "SHMLOADER_STREAMING"
_MODES: Final = ("auto", "1", "0")


def _mode() -> str:
    mode = os.environ.get(ENV, "auto").strip().lower()
    if mode not in _MODES:
        raise ValueError(
            f"{ENV}={os.environ[ENV]!r}: expected 'auto' (time both copies in each worker, "
            "keep the faster), '1' (always stream large leaves) or '0' (never)"
        )
    return mode


MODE: Final = _mode()
STREAMING: Final = AVAILABLE and MODE != "0"  # whether any leaf may stream in this process
# Named tensors (torch.stack refuses them) exist in the older torch releases setup.cfg admits.
_NAMED: Final = hasattr(torch.Tensor, "names")


class CopyChoice:
    """Which copy a process uses for large leaves: decided by timing both on its first
    ``2 * (WARMUP + TRIALS)`` eligible leaves, alternating (torch.stack first), the first
    ``WARMUP`` of each discarded; streaming wins if its median time per byte is lower."""

    WARMUP: Final = 1
    TRIALS: Final = 4

    def __init__(self, decided: bool | None = None) -> None:
        self.decided = decided  # None: still measuring; else whether to stream
        self.pid = os.getpid()
        self.ns_per_byte: tuple[list[float], list[float]] = ([], [])  # (stack, stream)
        self.seen = 0

    def next_streams(self) -> bool:
        """Whether the next eligible leaf streams."""
        if self.decided is not None:
            return self.decided
        return self.seen % 2 == 1

    def record(self, streamed: bool, ns: int, nbytes: int) -> None:
        """Account one timed copy (only while measuring)."""
        if self.decided is not None:
            return
        self.seen += 1
        if self.seen > 2 * self.WARMUP:
            self.ns_per_byte[streamed].append(ns / nbytes)
        stack, stream = self.ns_per_byte
        if len(stack) >= self.TRIALS and len(stream) >= self.TRIALS:
            self.decided = statistics.median(stream) < statistics.median(stack)


def _initial() -> bool | None:
    return True if MODE == "1" else None


_choice = CopyChoice(_initial())


def choice() -> CopyChoice:
    """This process's :class:`CopyChoice` (a fresh one in a forked child)."""
    global _choice
    if _choice.pid != os.getpid():
        _choice = CopyChoice(_initial())
    return _choice


def streamable(batch: Sequence[torch.Tensor], elem: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether copying each sample's bytes gives exactly what ``torch.stack(batch, out=out)``
    gives: every sample a plain dense CPU tensor of ``elem``'s dtype and shape, holding its
    values as stored (no conjugate or negative bit, no names, no grad to track), none
    overlapping ``out``, and no torch function mode to redirect the call."""
    if torch_function_mode_active():
        return False
    dtype, shape, size = elem.dtype, elem.shape, elem.nbytes
    lo = out.data_ptr()
    hi = lo + out.nbytes
    tensor = torch.Tensor
    for t in batch:
        if (
            type(t) is not tensor
            or t.dtype is not dtype
            or t.shape != shape
            or not t.is_cpu
            or t.layout is not torch.strided
            or t.is_nested
            or not t.is_contiguous()
            or t.requires_grad
            or t.is_conj()
            or t.is_neg()
            or (_NAMED and any(t.names))  # type: ignore[attr-defined,unused-ignore]
        ):
            return False
        ptr = t.data_ptr()
        if ptr < hi and lo < ptr + size:
            return False
    return True


def stack_large(batch: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """``torch.stack(batch, 0, out=out)`` for a :func:`streamable` batch of at least
    ``STREAM_MIN_BYTES``, with the copy this process has found faster."""
    c = choice()
    stream = c.next_streams()
    t0 = time.perf_counter_ns() if c.decided is None else 0
    if stream:
        gather(out.data_ptr(), batch[0].nbytes, [t.data_ptr() for t in batch])
    else:
        torch.stack(list(batch), 0, out=out)
    if t0:
        c.record(stream, time.perf_counter_ns() - t0, out.nbytes)
    return out
