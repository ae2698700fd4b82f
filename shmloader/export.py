"""Exporting a loader's statistics to another process (a memory profiler) as JSON lines.

Off unless the environment names a file descriptor: ``SHMLOADER_STATS_FD=N`` (a pipe a profiler
such as ``python -m tools.memprof`` passes to the job it runs). Then each loader's main process
writes one line ``{"kind": "arena", "t": <CLOCK_MONOTONIC seconds>, "pid": ..., <stats row>}`` at
most every ``SHMLOADER_STATS_INTERVAL`` seconds (default 0.1) as batches are yielded, and a line
``{"kind": "workers", "pids": [...]}`` when workers start.

Invariants: a line is one ``os.write`` of fewer than ``PIPE_BUF`` bytes, so lines of several
processes (ranks, several loaders) never interleave; when unset, the per-batch cost is one
attribute test; a write that fails (the reader went away) turns the export off with one warning.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Callable
from typing import Any

from shmloader.stats import LoaderStats

ENV_FD = "SHMLOADER_STATS_FD"
ENV_INTERVAL = "SHMLOADER_STATS_INTERVAL"


class StatsExport:
    """Writes a loader's rows to the descriptor the environment names, throttled."""

    def __init__(self, fd: int, interval: float) -> None:
        self.fd = fd
        self.interval = interval
        self._next = 0.0

    @classmethod
    def from_environment(cls) -> StatsExport | None:
        text = os.environ.get(ENV_FD)
        if not text:
            return None
        try:
            fd, interval = int(text), float(os.environ.get(ENV_INTERVAL, "0.1"))
        except ValueError:
            warnings.warn(
                f"{ENV_FD}={text!r} / {ENV_INTERVAL}={os.environ.get(ENV_INTERVAL)!r} are not "
                "numbers; shmloader exports no statistics",
                RuntimeWarning,
                stacklevel=3,
            )
            return None
        return cls(fd, interval)

    def tick(self, snapshot: Callable[[], LoaderStats]) -> None:
        """Write a row if ``interval`` has passed since the last one."""
        now = time.monotonic()
        if now >= self._next:
            self._next = now + self.interval
            self.write({"kind": "arena", "t": now, "pid": os.getpid(), **snapshot().as_row()})

    def write(self, message: dict[str, Any]) -> None:
        try:
            os.write(self.fd, (json.dumps(message) + "\n").encode())
        except OSError as e:
            self.interval = float("inf")
            self._next = float("inf")
            warnings.warn(
                f"shmloader stops exporting statistics to fd {self.fd} ({ENV_FD}): {e}",
                RuntimeWarning,
                stacklevel=2,
            )
