"""Exporting a loader's statistics to another process (a memory profiler) as JSON lines.

Off unless the environment names a file descriptor: ``SHMLOADER_STATS_FD=N`` (a pipe a profiler
such as ``python -m tools.memprof`` passes to the job it runs). Then each loader's main process
writes one line ``{"kind": "arena", "t": <CLOCK_MONOTONIC seconds>, "pid": ..., "loader": ...,
<stats row>}`` every ``SHMLOADER_STATS_INTERVAL`` seconds (default 0.1) from its first yielded
batch on, whether or not batches are still being yielded, and once more at interpreter exit;
and a line ``{"kind": "workers", "pids": [...]}`` when workers start.

Why a thread: a row written only as batches are yielded (at most once per interval) never shows
the state after the last yields of a burst, which is where a job that keeps its batches peaks and
where it then sits (evaluating, checkpointing, exiting). So the first yielded batch in a process
starts one daemon thread per export that writes ``stats()`` (thread-safe) whenever an interval
has passed without a row. Yields keep writing on the leading edge, so a row follows a change
within one interval either way, and the per-batch cost while the interval has not passed stays a
clock read and a comparison. An ``atexit`` hook writes the state the process ends in, which can
be less than an interval after the last row.

``loader`` numbers the loaders of the process that made them, so rows of several loaders, or of
several processes that hold the pipe, are told apart by ``(pid, loader)``: a profiler sums them
(``tools._memrecord``), never takes one loader's row for the job's. A loader whose arena is
replaced (retired after an interruption, or ``pin_memory`` changed) keeps its number: the new
arena's export takes it over and the old one writes no more (:meth:`StatsExport.hand_over`), as
the new rows count what the old arena still holds (``bytes_retired``); rows of both would count
it twice.

Only the profiler's pipe gets rows. memprof also names it by its identity
(``SHMLOADER_STATS_PIPE=<st_dev>:<st_ino>``; without it, the descriptor must be a pipe), and an
export is made only when the descriptor is that pipe; it then writes through the process's own
duplicate of it (close-on-exec, numbered 3 or more, shared by its exports, never closed:
:func:`_own_descriptor`), checked again before each write, under a lock a hand-over takes too. A
process the job started without passing the descriptor on (``subprocess`` closes inherited
descriptors by default; so do torchrun's ranks and ``spawn`` children) inherits the variables, but
under that number has another file, perhaps its own log: it exports nothing (one warning). A pipe
a write failed on (the reader went away) stays off for every later loader of the process (review
69: JSON rows landed in a user's file). Rows come from the processes that hold the pipe: the
job's, its forked children, and processes given the descriptor (``pass_fds``). The export's
warnings never escalate into errors (:func:`_tell`).

Invariants: a line is one ``os.write`` of fewer than ``PIPE_BUF`` bytes, so lines of several
processes and threads (several loaders, forked children) never interleave; when unset, the
per-batch cost is one attribute test; the descriptor is non-blocking, so a reader that falls
behind costs rows (one warning), never a stalled training step; a write that fails otherwise (the
reader went away) turns the export off with one warning, and its thread ends. The thread holds
the loader's state only weakly (it ends once the loader is gone) and never runs in a forked
child: a child that yields batches of an inherited loader starts its own. Rows of one process may
arrive a few microseconds
out of ``t`` order.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import itertools
import json
import os
import stat
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from arena import userwarn
from shmloader.stats import LoaderStats

ENV_FD = "SHMLOADER_STATS_FD"
ENV_INTERVAL = "SHMLOADER_STATS_INTERVAL"
ENV_PIPE = "SHMLOADER_STATS_PIPE"  # the pipe's identity, "<st_dev>:<st_ino>" (module docstring)
MIN_PERIOD_S = 0.01  # the thread's shortest period, whatever the interval (0 writes every yield)

Snapshot = Callable[[], LoaderStats]
_exporting: weakref.WeakSet[StatsExport] = weakref.WeakSet()  # exports with a thread, for atexit
_exit_hook = threading.Lock()
_exit_hooked = False
_serials = itertools.count(1)  # the exports of this process, in the order made
_failed: set[tuple[int, int]] = set()  # pipes a write failed on in this process: off for good
_own: int | None = None  # this process's descriptor of the pipe (_own_descriptor)
_LOWEST = 3  # never 0, 1 or 2: a job that closed one of those reuses it for its stdio
_refused = False  # whether this process warned that the descriptor is not the profiler's


def identity(fd: int) -> tuple[int, int] | None:
    """What ``fd`` names, as ``(st_dev, st_ino)``; None if it names nothing."""
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _ours(fd: int) -> tuple[int, int] | None:
    """The identity of ``fd`` if it is the profiler's pipe (module docstring), else None."""
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    expected = os.environ.get(ENV_PIPE)
    if expected is None:
        return (st.st_dev, st.st_ino) if stat.S_ISFIFO(st.st_mode) else None
    return (st.st_dev, st.st_ino) if expected == f"{st.st_dev}:{st.st_ino}" else None


class StatsExport:
    """Writes a loader's rows to the descriptor the environment names, throttled (module
    docstring: a thread writes them too while no batch is yielded)."""

    def __init__(self, fd: int, interval: float, pipe: tuple[int, int] | None = None) -> None:
        self.fd = fd
        self.interval = interval
        self.pipe = identity(fd) if pipe is None else pipe  # what fd names: checked per write
        self.named_fd = fd  # the number the environment named (fd is a duplicate of it)
        self._off = False  # handed over to a new arena's export, or failed: writes nothing
        # held across the check of _off and the write, and by hand_over (review 71: a row of the
        # old arena could still land after the new one's); re-entrant for a hand-over from a
        # signal handler, or a test, inside a write
        self._writing = threading.RLock()
        self.loader = next(_serials)  # with the pid, names the loader's rows (module docstring)
        self._next = 0.0
        self._claim = threading.Lock()  # one row per interval between the yields and the thread
        self._source: Callable[[], Snapshot | None] | None = None  # the loader's, held weakly
        self._thread_pid = 0  # the process whose thread writes for this export (0: none yet)
        self.dropped = 0  # rows not written because the reader's pipe was full

    @classmethod
    def from_environment(cls) -> StatsExport | None:
        text = os.environ.get(ENV_FD)
        if not text:
            return None
        try:
            fd, interval = int(text), float(os.environ.get(ENV_INTERVAL, "0.1"))
        except ValueError:
            _tell(
                f"{ENV_FD}={text!r} / {ENV_INTERVAL}={os.environ.get(ENV_INTERVAL)!r} are not "
                "numbers; shmloader exports no statistics"
            )
            return None
        pipe = _ours(fd)
        if pipe is None or pipe in _failed:
            if pipe is None:
                _refuse(fd)
            return None
        # Written through a descriptor of its own (close-on-exec): the number the environment
        # names may be closed and reused by the job for a file of its own later (review 70).
        try:
            own = _own_descriptor(fd, pipe)
        except OSError as e:  # no descriptor to spare (RLIMIT_NOFILE): no rows, never a failure
            _tell(f"shmloader exports no statistics to {ENV_FD}={fd} from this loader: {e}")
            return None
        export = cls(own, interval, pipe)
        export.named_fd = fd
        return export

    def tick(self, snapshot: Snapshot) -> None:
        """Write a row if ``interval`` has passed since the last one; the first call in a process
        starts the thread that writes rows while no batch is yielded."""
        if time.monotonic() >= self._next:
            self._due(snapshot)
            if self._thread_pid != os.getpid():
                self._start(snapshot)

    def _due(self, snapshot: Snapshot) -> None:
        """Write a row unless another thread wrote one within the interval. The claim is taken
        without calling ``snapshot`` under it: ``stats()`` takes the loader's own locks."""
        with self._claim:
            now = time.monotonic()
            if now < self._next or self._off:
                return
            self._next = now + self.interval
        self._row(snapshot, now)

    def _row(self, snapshot: Snapshot, now: float) -> None:
        row = snapshot().as_row()  # (handed over meanwhile: write() drops it, under its lock)
        self.write({"kind": "arena", "t": now, "pid": os.getpid(), "loader": self.loader, **row})

    def _start(self, snapshot: Snapshot) -> None:
        global _exit_hooked
        self._thread_pid = os.getpid()
        source: Callable[[], Snapshot | None]
        try:
            source = weakref.WeakMethod(snapshot)
        except TypeError:  # a plain function: nothing of the loader's to keep alive
            source = lambda: snapshot  # noqa: E731
        self._source = source
        wake = threading.Event()  # set when this export is gone (with its loader): end at once
        threading.Thread(
            target=_repeat, args=(weakref.ref(self, lambda _: wake.set()), source, wake),
            name="shmloader-stats-export", daemon=True,
        ).start()  # fmt: skip
        _exporting.add(self)
        with _exit_hook:
            if not _exit_hooked:
                # Registered after the loader's finalizers (weakref registers them with atexit
                # when the first is made, before any batch), so it runs before them: the arena
                # is still open when the final row is read.
                atexit.register(_final_rows)
                _exit_hooked = True

    def hand_over(self, successor: StatsExport) -> None:
        """The loader's arena was replaced: ``successor`` (the new arena's export) writes its
        rows under this one's number from now on, and this one writes none (its thread ends at
        its next wake-up; no final row at exit)."""
        with self._writing:
            successor.loader = self.loader
            self._off = True
            self._next = float("inf")

    def final(self) -> None:
        """Write the current state now, throttle or not (at exit), if this process exports it."""
        source = self._source
        snapshot = None if source is None else source()
        if snapshot is None or self._thread_pid != os.getpid() or self._off:
            return
        with contextlib.suppress(Exception):  # at exit, a row is not worth a traceback
            self._row(snapshot, time.monotonic())

    def write(self, message: dict[str, Any]) -> None:
        line = (json.dumps(message) + "\n").encode()
        say = None  # warned after the lock is let go (review 72: a warning hook that took the
        # loader's lock deadlocked a hand-over, and a slow one held up the training loop)
        with self._writing:  # (a hand-over waits for a row being written, then stops the next)
            if self._off:
                return
            if identity(self.fd) != self.pipe:
                say = self._stop("the descriptor it writes through no longer names the pipe "
                                 "(the job closed it, and that number may name another file now)")
            else:
                try:
                    os.write(self.fd, line)
                except BlockingIOError:
                    # The reader is behind (a whole line or nothing: lines are under PIPE_BUF).
                    if not self.dropped:
                        say = (f"shmloader: the reader of {ENV_FD}={self.named_fd} is behind; "
                               "statistics rows are dropped while its pipe is full")
                    self.dropped += 1
                except OSError as e:
                    if self.pipe is not None:
                        _failed.add(self.pipe)  # every later export of this process stays off
                    say = self._stop(str(e))
        if say is not None:
            _tell(say)

    def _stop(self, why: str) -> str:
        """Turn the export off; what to warn (once the write's lock is let go)."""
        self._off = True
        self._next = float("inf")  # (a yield's tick then stops at its one comparison)
        return f"shmloader stops exporting statistics to fd {self.named_fd} ({ENV_FD}): {why}"


def _own_descriptor(fd: int, pipe: tuple[int, int]) -> int:
    """This process's own descriptor of the profiler's pipe, shared by its exports: a
    close-on-exec duplicate of ``fd``, numbered 3 or more (review 71: a job that had closed its
    stdout got the duplicate as fd 1, and its prints went down the pipe), made once and never
    closed (review 71: a finalizer that closed it by number closed what the job, or another
    loader's export, had under that number by then). A job that closed it meanwhile gets a new
    one; the number it had is left alone."""
    global _own
    if _own is not None and identity(_own) == pipe:
        return _own
    own = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, _LOWEST)
    # A reader that falls behind must never stall training: a full pipe drops rows.
    os.set_blocking(own, False)
    _own = own
    return own


def _tell(message: str) -> None:
    """A RuntimeWarning about the export, which never escalates: under an error filter
    (``-W error``, pytest's ``filterwarnings = error``) it is dropped, not raised into the
    training loop (review 70: a helper process of a profiled job died at its first ``iter()``).
    The export is a side channel; it never fails the job."""
    with contextlib.suppress(Warning):
        userwarn.warn(message, RuntimeWarning)


def _refuse(fd: int) -> None:
    """Say, once a process, that the descriptor the environment names is not the pipe."""
    global _refused
    if not _refused:
        _refused = True
        _tell(
            f"{ENV_FD}={fd} does not name the profiler's pipe in this process (a process "
            "started without the descriptor passed on, where that number is another file, or "
            "none); shmloader exports no statistics from it"
        )


def _repeat(
    export_ref: weakref.ref[StatsExport],
    source: Callable[[], Snapshot | None],
    gone: threading.Event,
) -> None:
    """The export thread: write a row whenever an interval passed without one; end when the
    export is off or its loader or the export is gone. Holds neither between rows."""
    while True:
        export = export_ref()
        if export is None or export._off:
            return
        wait = max(export._next - time.monotonic(), MIN_PERIOD_S)
        del export
        if gone.wait(wait):  # the rows are samples in time: a period, cut short by the end
            return
        export, snapshot = export_ref(), source()
        if export is None or snapshot is None:
            return
        try:
            export._due(snapshot)
        except Exception as e:  # noqa: BLE001 - stats() failed: stop this thread, keep the job
            _tell(f"shmloader stops exporting statistics between batches: {e!r}")
            return
        del export, snapshot


def _final_rows() -> None:
    for export in list(_exporting):
        export.final()
