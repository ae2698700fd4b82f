"""Running a scenario in a fork of the test process, bounded in time.

Used where a failure can hang the main process itself (a deadlock inside the garbage collector
cannot be interrupted from the same process) or must not outlive its example (a failing example's
traceback would keep its loader and workers alive). The child reports through a pipe, leaves with
``os._exit``, and is always reaped; a child past its time is made to print its stack and killed.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import select
import signal
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any


def _own_forkserver() -> None:
    """A fork inherits the parent's forkserver handle, but that server is not the child's child
    (``waitpid`` on it fails): forget it, so the child starts its own when it needs one."""
    from multiprocessing import forkserver

    server = forkserver._forkserver  # type: ignore[attr-defined]
    server._forkserver_address = None
    server._forkserver_alive_fd = None
    server._forkserver_pid = None


class ForkedChild:
    """``body()`` running in a fork of this process. The child reports its JSON-able result (or
    its traceback) through a pipe and leaves with ``os._exit``; if it is still running
    ``timeout`` seconds after it started, faulthandler writes its stack to a second pipe and it
    exits. :meth:`result` waits (bounded), always reaps the child, and raises AssertionError
    with the child's traceback if it raised, or its stack if it hung (AssertionError, not
    ``pytest.fail``: hypothesis treats it as a failing example)."""

    def __init__(self, body: Callable[[], Any], timeout: float) -> None:
        self.timeout = timeout
        self.started = time.monotonic()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            code = 1
            try:
                os.close(out_r)
                os.close(err_r)
                err = os.fdopen(err_w, "w")
                faulthandler.dump_traceback_later(timeout, exit=True, file=err)
                _own_forkserver()
                try:
                    report = {"result": body()}
                except BaseException:  # noqa: BLE001 - the parent reports whatever happened
                    report = {"error": traceback.format_exc()}
                data = json.dumps(report).encode()
                while data:
                    data = data[os.write(out_w, data) :]
                code = 0
            finally:
                os._exit(code)
        os.close(out_w)
        os.close(err_w)
        self.pid, self._out, self._err = pid, out_r, err_r

    def result(self) -> Any:
        chunks: list[bytes] = []
        try:
            while True:
                left = self.started + self.timeout + 5.0 - time.monotonic()
                ready = _readable(self._out, max(0.0, left))
                if not ready:
                    break
                chunk = os.read(self._out, 1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
        finally:
            hung = not chunks
            if hung:
                with_stack = _readable(self._err, 0.0)
                stack = os.read(self._err, 1 << 16).decode(errors="replace") if with_stack else ""
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            os.close(self._out)
            os.close(self._err)
            if hung:
                _unlink_names_of(self.pid)
        if hung:
            raise AssertionError(
                f"the scenario hung for {self.timeout:.0f} s; the child's stack:\n{stack}"
            )
        report = json.loads(b"".join(chunks))
        if "error" in report:
            raise AssertionError(f"the scenario raised in the child:\n{report['error']}")
        return report["result"]


def _readable(fd: int, seconds: float) -> bool:
    """Whether ``fd`` becomes readable within ``seconds`` (poll: any descriptor number)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(int(seconds * 1000)))


def _unlink_names_of(pid: int) -> None:
    """Unlinks the /dev/shm names a killed child was creating (a segment's name exists for the
    moment of its creation; a child killed then leaves it). The hang is the test's failure; the
    name is only its debris, which must not fail the next test's leak check."""
    prefix = f"shmloader-{pid}-"
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir("/dev/shm"):
            if name.startswith(prefix):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join("/dev/shm", name))


def exit_code_of(pid: int, timeout: float) -> int:
    """The exit code of child ``pid`` (forked by the test with ``os.fork()``), reaped; one still
    running after ``timeout`` seconds is killed and reaped, and the test fails: it hung."""
    deadline = time.monotonic() + timeout
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        threading.Event().wait(0.01)  # (a bounded pause between looks)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise AssertionError(f"the forked child {pid} hung for {timeout} s")
    return os.waitstatus_to_exitcode(done[1])


def exit_code_of_fork(child: Callable[[], int], timeout: float) -> int:
    """Fork; the child runs ``child()`` and exits with what it returns (1 if it raised); the
    test gets that code (:func:`exit_code_of`)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = child()
        finally:
            os._exit(code)
    return exit_code_of(pid, timeout)
