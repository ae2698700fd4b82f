"""Starting, watching and stopping the worker processes: the only owner of teardown.

Invariants:
- Each worker has one duplex pipe; the main process holds one end, the worker the other.
- The main process never blocks writing to a worker: its ends are non-blocking, and what a pipe
  cannot take now waits in that worker's outbox, in order, and goes out when :meth:`wait` finds
  the pipe writable. (A worker writing a large READY frame while the main process wrote a large
  TASK frame to it would otherwise block both for good.)
- :meth:`Supervisor.wait` returns as soon as a pipe is readable *or* a worker that should be alive
  has exited, so a dead worker is noticed at once, not by a periodic poll. Exits are watched
  through a pidfd per worker, which nothing but the exit makes readable: the process sentinel
  and the pipe are descriptors a process the worker forked keeps open after the worker died
  (no sentinel, no EOF), and that a worker closing its descriptors closes while it runs on
  (review 46). The sentinel is the fallback where pidfds are missing (Linux before 5.3), and a
  wait slice that ends with nothing read looks at every worker. A worker is reaped only once it
  has exited (never ``join()`` on a readable sentinel: that waits for a live one for good).
  The main process reads the pipes itself (one ``read`` per wake-up, cutting every whole frame
  from a per-worker buffer); frames are ``multiprocessing.connection``'s, as workers send them.
- Teardown is one method with a fixed order: STOP to every live worker -> join with a timeout ->
  terminate -> kill -> close the pipes. It is idempotent and safe on a half-started supervisor.
- Forked workers share the slots of the batches every loader lends when they start
  (:class:`shmloader.afterfork.Keep`, taken in each worker's own fork): those are kept from
  reuse until every worker is ended (exited, or killed), and only then let go: by teardown
  once its kills all went out, by :meth:`Supervisor.kill`, or by the finalizer of a supervisor
  dropped first (review 26: an interruption lifted them while workers ran on).
- A worker told to retire (its IterableDataset replica is exhausted) is expected to exit; its
  exit is not an error.
- Workers belong to the process that started them: after an ``os.fork()`` of the main process
  the child forgets them (it neither stops nor reaps its parent's workers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing.process
import os
import pickle
import select
import signal
import time
import weakref
from collections import deque
from collections.abc import Container
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from arena import userwarn
from arena.finalizers import on_death
from shmloader import afterfork
from shmloader import protocol as P
from shmloader.frames import READ_BYTES, cut_frames, framed
from shmloader.notes import add_note
from shmloader.worker import WorkerConfig, worker_main

# Every worker process object this process started. A plain os.fork() of the main process copies
# multiprocessing's list of children, and a child that exits normally would then terminate the
# parent's daemon workers; the fork hook below makes the child forget them.
_started: weakref.WeakSet[Any] = weakref.WeakSet()


def _forget_inherited_workers() -> None:
    children = multiprocessing.process._children  # type: ignore[attr-defined]
    for proc in list(_started):
        children.discard(proc)
    _started.clear()


os.register_at_fork(after_in_child=_forget_inherited_workers)

JOIN_S = 1.0  # how long teardown waits for a worker to exit after STOP before terminating it
KILL_S = 2.0  # how long it waits after SIGTERM before SIGKILL


@dataclass(frozen=True)
class WorkerDeath:
    worker_id: int
    pid: int
    exitcode: int | None  # None: reaped by someone else (SIGCHLD ignored, or a handler's wait())

    def describe(self) -> str:
        if self.exitcode is None:
            return (
                f"DataLoader worker (pid(s) {self.pid}) exited unexpectedly; its exit code is "
                "unknown because something else reaped it (SIGCHLD is set to SIG_IGN, or a "
                "SIGCHLD handler calls wait()). "
            )
        if self.exitcode < 0:
            try:
                name = signal.strsignal(-self.exitcode) or f"signal {-self.exitcode}"
            except ValueError:
                name = f"signal {-self.exitcode}"
            return f"DataLoader worker (pid {self.pid}) is killed by signal: {name}. "
        if self.exitcode == 0:  # torch's SIGCHLD handler lets it pass: its data queue's wording
            return f"DataLoader worker (pid(s) {self.pid}) exited unexpectedly. "
        return (  # torch's wording (its SIGCHLD handler's, which usually wins the race there)
            f"DataLoader worker (pid {self.pid}) exited unexpectedly with exit code "
            f"{self.exitcode}. Details are lost due to multiprocessing. Rerunning with "
            "num_workers=0 may give better error trace. "
        )


class Supervisor:
    """The worker processes of one iterator."""

    def __init__(self, ctx: Any, configs: list[WorkerConfig]) -> None:
        # The slots kept for these workers (each fork adds what is lent then), let go once
        # every worker is ended.
        self._keep = afterfork.Keep()
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        self.retired: set[int] = set()
        self._stopped = False
        self._closed = False  # the pipes are closed: their descriptor numbers may be reused
        self._poll: select.poll | None = None
        self._fds: dict[int, tuple[int, bool]] = {}  # fd -> (worker id, is its pipe)
        self._pidfds: list[int | None] = []  # per worker: a pidfd of it (None: unsupported)
        self._eof: set[int] = set()  # workers whose pipe reached EOF: no longer polled
        self._deaf: set[int] = set()  # workers whose sentinel fired while they ran on
        # A forkserver's workers are its children, not ours: it reaps them and sends the code
        self._own_children = ctx.get_start_method() != "forkserver"
        self._bufs: list[bytearray] = [bytearray() for _ in configs]  # bytes read, not yet cut
        self._wfds: list[int] = []  # the pipes' descriptors (non-blocking)
        self._outbox: list[bytearray] = [bytearray() for _ in configs]  # bytes not yet written
        self.inbox: deque[tuple[int, bytes]] = deque()  # (worker id, frame) read, not yet handled
        # True only inside the poll of wait(): an interruption there leaves nothing half done
        # (shmloader.interrupts); whoever catches one resets it.
        self.polling = False
        # ids of the workers known gone: never signalled again (their pids may be reused)
        self._gone: set[int] = set()
        # Workers whose supervisor is dropped unstopped (an interruption before its iterator
        # registered its teardown) are killed and reaped, not left running, and the slots kept
        # for them come back (review 25).
        on_death(
            self, _end_unstopped, os.getpid(), self.procs, self._keep, self._pidfds,
            self._own_children, self._gone,
        )  # fmt: skip
        try:
            forked = ctx.get_start_method() == "fork"
            with afterfork.forking_workers(self._keep):  # each fork keeps what is lent then
                self._start(ctx, configs, forked)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, ctx: Any, configs: list[WorkerConfig], forked: bool) -> None:
        """Start a worker per config (``forked``: under the fork start method)."""
        for cfg in configs:
            parent, child = ctx.Pipe(duplex=True)
            self.conns.append(parent)
            self._wfds.append(parent.fileno())
            os.set_blocking(parent.fileno(), False)
            if forked:
                # A forked worker inherits the main process's ends of every pipe made so
                # far, its own included; it closes them, so it sees EOF when the main
                # process goes and holds no other worker's pipe open.
                cfg = dataclasses.replace(cfg, close_fds=tuple(c.fileno() for c in self.conns))
            proc = ctx.Process(
                target=worker_main,
                args=(cfg, child),
                name=f"shmloader-worker-{cfg.worker_id}",
                daemon=True,
            )
            # A forked child keeps this mask: SIGINT stays blocked until worker_main ignores
            # it, so a Ctrl-C while the worker starts up does not kill it. (multiprocessing's
            # spawn and forkserver children start with an empty mask: for them a Ctrl-C
            # before worker_main still ends a starting worker.)
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                proc.start()
            except (pickle.PicklingError, TypeError, AttributeError) as e:
                _explain_start_error(e, cfg)
                raise
            finally:
                # Recorded once forked, even if start() was then interrupted (a signal
                # handler's exception: review 27), and before the mask is restored (a Ctrl-C
                # held back while it started is delivered there): the shutdown either leads to
                # must end it before the slots kept for it go.
                if proc.pid is not None:
                    self.procs.append(proc)
                    _started.add(proc)
                    # (a forkserver's workers: their sentinel, which it writes their code to)
                    self._pidfds.append(_open_pidfd(proc.pid) if self._own_children else None)
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
                child.close()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def alive(self, worker_id: int) -> bool:
        return worker_id not in self.retired and self.procs[worker_id].exitcode is None

    def send(self, worker_id: int, msg: P.ToWorker) -> None:
        """Send ``msg`` without blocking: what the pipe cannot take now waits in the worker's
        outbox. A broken pipe means the worker died, which :meth:`wait` reports."""
        if self._closed:
            raise RuntimeError(_CLOSED)
        data = framed(P.encode(msg))
        box = self._outbox[worker_id]
        if box:
            box += data  # behind what is already waiting
            return
        try:  # (not contextlib.suppress: that costs 0.5 us a task)
            n = os.write(self._wfds[worker_id], data)
        except BlockingIOError:
            n = 0
        except (BrokenPipeError, ConnectionResetError):
            return
        if n < len(data):
            box += memoryview(data)[n:]
            self._watch_writable(worker_id, True)

    def _flush(self, worker_id: int) -> None:
        """Write as much of the worker's outbox as its pipe takes now."""
        box = self._outbox[worker_id]
        try:
            n = os.write(self._wfds[worker_id], box)
        except BlockingIOError:
            return
        except (BrokenPipeError, ConnectionResetError):
            n = len(box)  # the worker died: wait() reports it
        del box[:n]
        if not box:
            self._watch_writable(worker_id, False)

    def _flush_all(self, timeout: float) -> None:
        """Write every outbox out, waiting at most ``timeout`` for the pipes to take it (a
        worker that is not reading keeps the rest: teardown terminates it)."""
        deadline = time.monotonic() + timeout
        while True:
            pending = {
                self._wfds[w]: w
                for w, p in enumerate(self.procs)
                if self._outbox[w] and p.exitcode is None
            }
            left = deadline - time.monotonic()
            if not pending or left <= 0:
                return
            poller = select.poll()
            for fd in pending:
                poller.register(fd, select.POLLOUT)
            for fd, _ in poller.poll(int(left * 1000) + 1):
                self._flush(pending[fd])

    def _watch_writable(self, worker_id: int, on: bool) -> None:
        if self._poll is not None and worker_id not in self.retired | self._eof:
            events = select.POLLIN | select.POLLOUT if on else select.POLLIN
            self._poll.modify(self._wfds[worker_id], events)

    def retire(self, worker_id: int) -> None:
        """Tell a worker to exit and stop watching it."""
        if worker_id not in self.retired:
            self.send(worker_id, P.Stop())
            self.retired.add(worker_id)
            self._poll = None

    def deaths(self, gone: Container[int] = ()) -> list[WorkerDeath]:
        """Workers that should be alive but have exited. ``gone``: workers whose exit was
        signalled or whose pipe closed; one of them that was reaped elsewhere never gets an exit
        code."""
        out = []
        for wid, p in enumerate(self.procs):
            if wid in self.retired:
                continue
            if p.exitcode is not None:
                out.append(WorkerDeath(wid, p.pid, p.exitcode))
            elif wid in gone and self._own_children and _reaped_elsewhere(p.pid):
                out.append(WorkerDeath(wid, p.pid, None))
        return out

    def _pidfd(self, wid: int) -> int | None:
        return _pidfd_of(self._pidfds, wid)

    def _exit_fd(self, wid: int) -> int | None:
        """What signals worker ``wid``'s exit: its pidfd, else its sentinel (None once that
        fired while the worker ran on: then only the wait slices' look finds its exit)."""
        pidfd = self._pidfd(wid)
        if pidfd is not None:
            return pidfd
        return None if wid in self._deaf else int(self.procs[wid].sentinel)

    def _poller(self) -> select.poll:
        """One poll set over the pipes and sentinels of the workers being watched, rebuilt only
        when that set changes (a worker retires)."""
        if self._poll is None:
            self._poll = select.poll()
            self._fds = {}
            for wid, c in enumerate(self.conns):
                if wid in self.retired:
                    continue
                if wid not in self._eof:
                    out = select.POLLOUT if self._outbox[wid] else 0
                    self._poll.register(c.fileno(), select.POLLIN | out)
                    self._fds[c.fileno()] = (wid, True)
                exit_fd = self._exit_fd(wid)
                if exit_fd is not None:
                    self._poll.register(exit_fd, select.POLLIN)
                    self._fds[exit_fd] = (wid, False)
        return self._poll

    def wait(self, timeout: float | None) -> list[WorkerDeath]:
        """Wait up to ``timeout`` for frames, which go to :attr:`inbox` as (worker id, frame);
        returns the workers found dead.

        One ``poll``, then one ``read`` per readable pipe, which may bring several frames (they
        are cut from a per-worker buffer; a partial frame waits there for the rest). Frames stay
        in the inbox until their reader takes them, so an exception (Ctrl-C) while they are
        handled loses none of those not yet taken."""
        if self._closed:
            raise RuntimeError(_CLOSED)
        poller = self._poller()
        frames = self.inbox
        gone: set[int] = set()
        exits: set[int] = set()  # workers whose exit descriptor fired
        ms = None if timeout is None else max(0, int(timeout * 1000))
        self.polling = True
        ready = poller.poll(ms)
        self.polling = False
        for fd, events in ready:
            wid, is_pipe = self._fds[fd]
            if not is_pipe:
                gone.add(wid)  # its pidfd (or sentinel): that worker exited
                exits.add(wid)
                continue
            if events & select.POLLOUT:
                self._flush(wid)
                if not events & (select.POLLIN | select.POLLHUP | select.POLLERR):
                    continue
            try:
                data = os.read(fd, READ_BYTES)
            except BlockingIOError:
                continue  # nothing to read after all
            except OSError:
                data = b""
            if not data:
                # EOF: it is exiting (its exit, signalled next, gives the code), or it closed
                # its pipe and runs on, unable to answer: the timeout, or its exit, ends the
                # wait. Either way the pipe is polled no more (EOF would wake every poll).
                gone.add(wid)
                self._eof.add(wid)
                self._poll = None
                continue
            buf = self._bufs[wid]
            buf += data
            for frame in cut_frames(buf):
                frames.append((wid, frame))
        if not ready:
            # A slice with nothing read: look at every worker, for an exit nothing signalled
            # (no pidfds, and a sentinel another process holds open).
            return self.deaths(range(len(self.procs)))
        if not gone:
            return []
        dead = self.deaths(gone)
        for wid in exits - {d.worker_id for d in dead}:
            if self._own_children and self._pidfd(wid) is None and wid not in self._deaf:
                # its sentinel fired, yet it runs on (it closed its end): stop polling it
                self._deaf.add(wid)
                self._poll = None
        return dead

    def kill(self) -> None:
        """SIGKILL every live worker and reap it: for a dead iterator, where nothing a worker
        could still finish is wanted. :meth:`shutdown` then only closes the pipes."""
        _kill_and_reap(self.procs, self._pidfds, self._own_children, self._gone)
        self._ended()

    def _wait_exit(self, wid: int, timeout: float) -> None:
        _wait_exit(self.procs[wid], self._pidfd(wid), self._own_children, timeout)

    def _ended(self) -> None:
        """Every worker is ended (exited, or killed: none of its code runs any more): the slots
        kept for them may be reused."""
        self._keep.lift()

    @property
    def stopped(self) -> bool:
        """Whether :meth:`shutdown` has begun: nothing may be sent to the workers any more."""
        return self._stopped

    def shutdown(self) -> None:
        """STOP -> join -> terminate -> kill -> close. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        try:
            self._stop_all()
        except BaseException:  # interrupted (Ctrl-C in a join): end them now, unwaited
            for wid, p in enumerate(self.procs):
                if p.exitcode is None and id(p) not in self._gone:
                    with contextlib.suppress(OSError):
                        _send(p, self._pidfd(wid), signal.SIGKILL)
            # Reached only once every kill went out: an interruption in this loop leaves the
            # kept slots to kill() or the finalizer, which end the rest first (review 26).
            self._ended()
            raise
        self._ended()

    def _stop_all(self) -> None:
        for wid, p in enumerate(self.procs):
            if p.exitcode is None:
                self.send(wid, P.Stop())
        self._flush_all(JOIN_S)
        deadline = time.monotonic() + JOIN_S
        for wid in range(len(self.procs)):
            self._wait_exit(wid, deadline - time.monotonic())
        for sig in (signal.SIGTERM, signal.SIGKILL):
            _signal_all(self.procs, self._pidfds, self._own_children, self._gone, sig)
        # Their descriptor numbers may name the user's files from now on: never poll, read or
        # write them again.
        self._closed = True
        self._poll = None
        for c in self.conns:
            c.close()
        _close_pidfds(self._pidfds)
        _forget_gone(self.procs, self._own_children)
        # The process objects stay open: the iterator exposes them as torch's ``_workers``
        # (pid, exitcode, is_alive(), join()); their sentinels close when they are collected.


# torch's warning when a worker's Process.start() fails to pickle its arguments (dataloader.py)
PICKLE_ERROR_WARNING = (
    "Got pickle error when attempting to start a worker Process. "
    "This might be because the worker Process arguments are not picklable. "
    "Python 3.14+ changed the multiprocessing start method in non-Mac POSIX platforms "
    "to 'forkserver', which requires the worker Process arguments to be picklable. "
    "You can also try multiprocessing.set_start_method('fork')."
)
_CLOSED = (
    "this DataLoader iterator's workers were shut down and their pipes closed; iterate the "
    "DataLoader again to start fresh workers"
)


def _end_unstopped(
    pid: int,
    procs: list[Any],
    keep: afterfork.Keep,
    pidfds: list[int | None],
    own: bool,
    gone: set[int],
) -> None:
    if os.getpid() == pid:  # inherited through fork(): they are the parent's
        _kill_and_reap(procs, pidfds, own, gone)
        keep.lift()  # (after a teardown that lifted already: a no-op)
        _forget_gone(procs, own)
    _close_pidfds(pidfds)  # (a forked child closes its copies)


def _open_pidfd(pid: int) -> int | None:
    """A pidfd of process ``pid`` (close-on-exec), or None where pidfds are missing (Linux
    before 5.3) or the process is gone already (then its sentinel tells)."""
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None


def _close_pidfds(pidfds: list[int | None]) -> None:
    """Close the pidfds (once: the list is emptied)."""
    while pidfds:
        fd = pidfds.pop()
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


def _forget_gone(procs: list[Any], own: bool) -> None:
    """Drop the workers that are gone from multiprocessing's list of children, as
    ``Process.join()`` does once it has an exit code (torch's shutdown joins every worker). The
    workers are waited for on their pidfds, not joined, and the list kept each process object,
    and with it its ``Popen``'s two pipe descriptors, until the next ``Process.start()`` or
    ``active_children()``: 4 descriptors of a 2-worker iterator outlived the loader (review 67).
    A worker reaped elsewhere (SIGCHLD ignored, or a handler's ``wait()``) never gets an exit
    code, and would stay in the list for good (review 46); it is gone all the same."""
    for p in procs:
        if p.exitcode is not None or (own and _reaped_elsewhere(p.pid)):
            multiprocessing.process._children.discard(p)  # type: ignore[attr-defined]


def _kill_and_reap(procs: list[Any], pidfds: list[int | None], own: bool, gone: set[int]) -> None:
    _signal_all(procs, pidfds, own, gone, signal.SIGKILL)


def _signal_all(
    procs: list[Any], pidfds: list[int | None], own: bool, gone: set[int], sig: int
) -> None:
    """Send ``sig`` to every worker still running, then wait ``KILL_S`` once for all of them
    (a teardown with N deaf workers takes one bound a step, not N: review 51), and record
    those now gone."""
    left = [wid for wid, p in enumerate(procs) if p.exitcode is None and id(p) not in gone]
    for wid in left:
        _send(procs[wid], _pidfd_of(pidfds, wid), sig)
    deadline = time.monotonic() + KILL_S
    for wid in left:
        _wait_exit(procs[wid], _pidfd_of(pidfds, wid), own, deadline - time.monotonic())
    _note_gone(procs, own, gone)


def _pidfd_of(pidfds: list[int | None], wid: int) -> int | None:
    """Worker ``wid``'s pidfd: None without one, or once the pidfds are closed (emptied)."""
    return pidfds[wid] if wid < len(pidfds) else None


def _note_gone(procs: list[Any], own: bool, gone: set[int]) -> None:
    """Record the workers known gone (exited, or reaped by something else): a later teardown
    step signals none of them. Their pids are free for any new process once reaped, and one
    reaped elsewhere (SIGCHLD ignored) never gets an exit code (review 52)."""
    for p in procs:
        if p.exitcode is not None or (own and _reaped_elsewhere(p.pid)):
            gone.add(id(p))


def _send(p: Any, pidfd: int | None, sig: int) -> None:
    """Signal worker ``p`` through its pidfd when it has one: never another process. With
    SIGCHLD ignored the kernel reaps a worker that exits, multiprocessing never learns it, and
    its ``terminate()`` / ``kill()`` would signal the pid, by then free for any new process
    (review 52). Without a pidfd (a forkserver's worker, an old kernel, or after the pidfds
    closed: callers skip workers known gone, ``_note_gone``), by pid."""
    if pidfd is not None:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, sig)
    elif sig == signal.SIGTERM:
        p.terminate()
    else:
        p.kill()


def _wait_exit(p: Any, pidfd: int | None, own: bool, timeout: float) -> None:
    """Wait up to ``timeout`` for worker ``p`` (a child of ours if ``own``, else a
    forkserver's) to exit, and reap it if it did. ``Process.join(timeout)`` waits on the
    sentinel, which a process the worker forked may hold open long after the worker died
    (review 47: 2 s a worker), and then reaps with a blocking ``waitpid``, which waits for
    good for a worker that closed its sentinel and runs on (review 46). So: the pidfd, which
    fires on the exit alone; or, without one, the sentinel and the status in 10 ms steps. (A
    forkserver's sentinel is the forkserver's, which sends the code there.)"""
    deadline = time.monotonic() + timeout
    fd = pidfd if pidfd is not None else int(p.sentinel)
    sure = pidfd is not None or not own  # fires only once it exited
    while p.exitcode is None:
        if own and _reaped_elsewhere(p.pid):
            return  # its code never comes: SIGCHLD ignored, or a handler's wait()
        left = deadline - time.monotonic()
        if left <= 0:
            return
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        if poller.poll(int(1000 * (left if sure else min(left, 0.01))) + 1) and not sure:
            time.sleep(min(left, 0.01))  # the sentinel of a live worker: look again soon


def _reaped_elsewhere(pid: int) -> bool:
    """Whether child ``pid`` is gone without its status reaching us: with SIGCHLD ignored the
    kernel reaps it, and a SIGCHLD handler's ``wait()`` may. multiprocessing then never learns an
    exit code (its ``poll`` swallows ``ECHILD``), so without this check a dead worker would look
    alive for good."""
    try:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return False


def _explain_start_error(e: Exception, cfg: WorkerConfig) -> None:
    """A worker's arguments could not be pickled (``spawn``, ``forkserver``): torch's warning,
    then its error as it is (type, words and attributes; review 67: rebuilt as ``type(e)(...)``
    it lost them, and a subclass with another constructor raised a TypeError about that), with
    what shmloader can add as a note."""
    userwarn.warn(PICKLE_ERROR_WARNING, UserWarning)
    add_note(
        e,
        f"shmloader could not send the worker's arguments (dataset {type(cfg.dataset).__name__}, "
        "collate_fn, worker_init_fn) to a new process: under the 'spawn' and 'forkserver' start "
        "methods they must be picklable. Define them at module top level (no lambdas or local "
        "functions), or pass multiprocessing_context='fork'.",
    )
