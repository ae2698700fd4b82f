"""memprof's ``--live`` view: the arena's slots by state and each process's memory, as a job runs.

On a terminal the view is a block of lines redrawn in place (ANSI: cursor up ``n`` lines to the
block's first column, erase to the end of the screen, print the new block) at most every
``TTY_PERIOD_S``. When the stream is not a terminal (a log, a pipe) it prints one plain status line
at most every ``PLAIN_PERIOD_S`` instead, so a log stays readable.

Invariant: the view only reads the rows it is given; it never samples anything itself.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

from ._memrecord import mib
from ._procmem import ProcSample, ShmUsage

TTY_PERIOD_S = 0.25  # ~4 Hz redraw on a terminal
PLAIN_PERIOD_S = 1.0  # one status line per second otherwise
STATES = ("free", "writing", "ready", "lent")


def _slots(arena: dict[str, Any]) -> str:
    return " | ".join(f"{s} {arena.get(f'slots_{s}', 0)}" for s in STATES)


def frame(t: float, rows: list[ProcSample], shm: ShmUsage, arena: dict[str, Any] | None,
          label: str, memfd_bytes: int = 0) -> list[str]:
    """The lines of one redraw (``memfd_bytes``: shared memory outside /dev/shm)."""
    pss = sum(r.pss for r in rows)
    lines = [f"memprof {label}  t={t:7.2f} s  tree PSS {mib(pss)} MiB in {len(rows)} processes"
             f"  /dev/shm {mib(shm.used_bytes)} MiB, {shm.entries} entries"
             f"  memfd {mib(memfd_bytes)} MiB"]
    if arena is None:
        lines.append("arena: none (torch loader, not started yet, or a user script)")
    else:
        lines.append(f"arena {arena.get('backend', '')}: {arena.get('slots_total', 0)} slots  "
                     f"[{_slots(arena)}]  reserved {mib(arena.get('bytes_reserved', 0))} MiB  "
                     f"in use {mib(arena.get('bytes_in_use', 0))} MiB  "
                     f"held {arena.get('batches_held', 0)}")
    lines.append(f"{'pid':>8}  {'role':<10} {'RSS':>9} {'PSS':>9} {'USS':>9} {'shmem':>9}  MiB")
    for r in rows:
        lines.append(f"{r.pid:>8}  {r.role:<10} {mib(r.rss):>9} {mib(r.pss):>9} {mib(r.uss):>9} "
                     f"{mib(r.pss_shmem):>9}")
    return lines


def status_line(t: float, rows: list[ProcSample], shm: ShmUsage,
                arena: dict[str, Any] | None, memfd_bytes: int = 0) -> str:
    """The one-line form used when the stream is not a terminal."""
    line = (f"t={t:.2f}s tree_pss_mib={mib(sum(r.pss for r in rows))} processes={len(rows)} "
            f"shm_mib={mib(shm.used_bytes)} shm_entries={shm.entries} "
            f"memfd_mib={mib(memfd_bytes)}")
    if arena is not None:
        line += " slots " + " ".join(f"{s}={arena.get(f'slots_{s}', 0)}" for s in STATES)
    return line


class LiveView:
    """Redraws ``frame`` in place on a terminal, or prints ``status_line`` to a plain stream."""

    def __init__(self, label: str, stream: TextIO = sys.stdout, tty: bool | None = None) -> None:
        self.label = label
        self.stream = stream
        self.tty = stream.isatty() if tty is None else tty
        self.period_s = TTY_PERIOD_S if self.tty else PLAIN_PERIOD_S
        self._drawn = 0  # lines of the block currently on screen
        self._last = float("-inf")

    def update(self, t: float, rows: list[ProcSample], shm: ShmUsage,
               arena: dict[str, Any] | None, force: bool = False, memfd_bytes: int = 0) -> None:
        if not force and t - self._last < self.period_s:
            return
        self._last = t
        if not self.tty:
            self.stream.write(status_line(t, rows, shm, arena, memfd_bytes) + "\n")
        else:
            lines = frame(t, rows, shm, arena, self.label, memfd_bytes)
            up = f"\x1b[{self._drawn}F" if self._drawn else ""
            self.stream.write(up + "\x1b[J" + "\n".join(lines) + "\n")
            self._drawn = len(lines)
        self.stream.flush()

    def close(self) -> None:
        """Leave the last block on screen; the next output starts below it."""
        self._drawn = 0
