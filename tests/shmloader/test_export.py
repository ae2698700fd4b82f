import json
import os
import subprocess
import sys
import threading
import warnings

import pytest

from shmloader import export
from shmloader.export import ENV_FD, ENV_PIPE, StatsExport
from shmloader.stats import no_arena

EMPTY = no_arena(0)
WAIT_S = 30.0  # a bound on any wait; never reached when all is well


def test_export_is_off_unless_the_environment_names_a_descriptor(monkeypatch, fresh_process_state):
    monkeypatch.delenv(ENV_FD, raising=False)
    monkeypatch.delenv(ENV_PIPE, raising=False)
    assert StatsExport.from_environment() is None
    r, w = os.pipe()
    try:
        monkeypatch.setenv(ENV_FD, str(w))
        exp = StatsExport.from_environment()
        assert exp is not None and exp.named_fd == w and exp.interval == 0.1
        assert export.identity(exp.fd) == export.identity(w)  # its own descriptor of the pipe
    finally:
        os.close(r)
        os.close(w)


@pytest.fixture
def fresh_process_state(monkeypatch):
    """This process as if no export had been made, failed or been refused yet; the descriptor
    a test's exports made of its pipe is closed after it."""
    monkeypatch.setattr(export, "_failed", set())
    monkeypatch.setattr(export, "_refused", False)
    monkeypatch.setattr(export, "_own", None)
    yield
    if export._own is not None:
        os.close(export._own)


def _named_pipe(monkeypatch) -> tuple[int, int]:
    """A pipe (read, write), named in the environment as memprof names its own."""
    r, w = os.pipe()
    pipe = os.fstat(w)
    monkeypatch.setenv(ENV_FD, str(w))
    monkeypatch.setenv(ENV_PIPE, f"{pipe.st_dev}:{pipe.st_ino}")
    return r, w


def _rows_in(path) -> str:
    with open(path) as f:
        return f.read()


@pytest.mark.parametrize("named", [True, False], ids=["pipe-named", "pipe-unnamed"])
def test_a_descriptor_that_is_not_the_profiler_s_pipe_gets_nothing(
    monkeypatch, tmp_path, fresh_process_state, named
):
    # Review 69: a process the job started without passing the descriptor on inherits
    # SHMLOADER_STATS_FD, and under that number has a file of its own (its log): the first
    # loader wrote JSON rows into it.
    r, w = os.pipe()
    try:
        pipe = os.fstat(w)
        with open(tmp_path / "log.txt", "w") as log:
            monkeypatch.setenv(ENV_FD, str(log.fileno()))
            if named:
                monkeypatch.setenv(ENV_PIPE, f"{pipe.st_dev}:{pipe.st_ino}")
            else:
                monkeypatch.delenv(ENV_PIPE, raising=False)
            with pytest.warns(RuntimeWarning, match="does not name the profiler's pipe"):
                assert StatsExport.from_environment() is None
            assert StatsExport.from_environment() is None  # (warned once a process)
    finally:
        os.close(r)
        os.close(w)
    assert _rows_in(tmp_path / "log.txt") == ""


def test_a_pipe_that_failed_stays_off_and_a_reused_number_gets_nothing(
    monkeypatch, tmp_path, fresh_process_state
):
    # Review 69: after the reader went away the export turned off, but the next loader's
    # export (an arena replaced) was made from the environment again; once the job had closed
    # that descriptor and opened a file under its number, the rows went into the file.
    r, w = _named_pipe(monkeypatch)
    first = StatsExport.from_environment()
    assert first is not None
    os.close(r)
    with pytest.warns(RuntimeWarning, match="stops exporting statistics"):
        first.tick(lambda: EMPTY)
    assert StatsExport.from_environment() is None  # the same pipe: off for good
    later = StatsExport(w, interval=0, pipe=first.pipe)  # made before the number was reused
    with open(tmp_path / "log.txt", "w") as log:
        os.dup2(log.fileno(), w)  # the job closed the pipe; the number now names its log
        try:
            with pytest.warns(RuntimeWarning, match="no longer names the pipe"):
                later.tick(lambda: EMPTY)
            with pytest.warns(RuntimeWarning, match="does not name the profiler's pipe"):
                assert StatsExport.from_environment() is None
        finally:
            os.close(w)
    assert _rows_in(tmp_path / "log.txt") == ""


def test_a_hand_over_inside_a_row_being_written_is_not_undone(monkeypatch):
    # Review 69: hand_over() set _next to inf while the old export's thread was inside _due,
    # between its check and its store, which then wrote a finite _next back: the old arena's
    # rows went on under the loader's number, alternating with the new arena's.
    r, w = os.pipe()
    old, new = StatsExport(w, interval=0.01), StatsExport(w, interval=0.01)

    def snapshot():
        old.hand_over(new)  # (the iterating thread, while the old export's thread takes a row)
        return EMPTY

    try:
        old.tick(snapshot)
        old._next = 0.0  # (as if its interval had passed)
        old.tick(lambda: EMPTY)
        new.tick(lambda: EMPTY)
        os.close(w)
        rows = [json.loads(line) for line in os.read(r, 1 << 16).decode().splitlines()]
    finally:
        os.close(r)
    assert [row["loader"] for row in rows] == [new.loader] and old.loader == new.loader


def test_rows_are_json_lines_written_at_most_once_per_interval():
    r, w = os.pipe()
    try:
        exp = StatsExport(w, interval=3600)
        exp.tick(lambda: EMPTY)
        exp.tick(lambda: EMPTY)  # within the interval: nothing written
        os.close(w)
        lines = os.read(r, 1 << 16).decode().splitlines()
    finally:
        os.close(r)
    assert len(lines) == 1
    row = json.loads(lines[0])
    assert row["kind"] == "arena" and row["pid"] == os.getpid()


def test_a_reader_that_went_away_turns_the_export_off_with_one_warning():
    r, w = os.pipe()
    os.close(r)
    exp = StatsExport(w, interval=0)
    try:
        with pytest.warns(RuntimeWarning, match="stops exporting statistics"):
            exp.tick(lambda: EMPTY)
        exp.tick(lambda: EMPTY)  # off: no second write, no second warning
    finally:
        os.close(w)


def test_rows_go_to_the_pipe_after_the_job_reuses_the_number_it_was_named_by(
    monkeypatch, tmp_path, fresh_process_state
):
    # Review 70: the check before a write and the write were two steps: a number the job
    # closed and reused in between (dup2 of its log onto it) still got a row. The export writes
    # through a descriptor of its own, which the job never reuses.
    r, w = _named_pipe(monkeypatch)
    exp = StatsExport.from_environment()
    assert exp is not None
    try:
        with open(tmp_path / "log.txt", "w") as log:
            os.dup2(log.fileno(), w)  # the job's own file under the number it was named by
        exp.tick(lambda: EMPTY)
        os.set_blocking(r, False)
        row = json.loads(os.read(r, 1 << 16).decode().splitlines()[0])
    finally:
        os.close(r)
        os.close(w)
    assert row["kind"] == "arena"
    assert _rows_in(tmp_path / "log.txt") == ""


def test_the_export_s_warnings_never_fail_the_job_under_an_error_filter(
    monkeypatch, tmp_path, fresh_process_state
):
    # Review 70: with warnings as errors (-W error, pytest's filterwarnings = error), a helper
    # process of a profiled job that had not been given the pipe died at its first iter().
    with open(tmp_path / "log.txt", "w") as log:
        monkeypatch.setenv(ENV_FD, str(log.fileno()))
        monkeypatch.delenv(ENV_PIPE, raising=False)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert StatsExport.from_environment() is None
    r, w = os.pipe()
    os.close(r)
    exp = StatsExport(w, interval=0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            exp.tick(lambda: EMPTY)  # the reader went away: off, quietly
    finally:
        os.close(w)
    assert exp._off


def test_a_hand_over_waits_for_a_row_being_written_and_no_old_row_follows_it(monkeypatch):
    # Reviews 70, 71: a hand-over between the old export's check and its write let one old row
    # out after the new one. Now the hand-over waits for a row being written, then stops the
    # old export: that row lands first, and nothing of the old export after it.
    r, w = os.pipe()
    old, new = StatsExport(w, interval=3600), StatsExport(w, interval=3600)
    inside, go_on = threading.Event(), threading.Event()
    real = export.identity

    def slow_identity(fd: int):
        inside.set()
        assert go_on.wait(WAIT_S)
        return real(fd)

    monkeypatch.setattr(export, "identity", slow_identity)
    writer = threading.Thread(target=old.write, args=({"who": "old"},))
    writer.start()
    try:
        assert inside.wait(WAIT_S)
        handing = threading.Thread(target=old.hand_over, args=(new,))
        handing.start()
        go_on.set()
        handing.join(WAIT_S)
        writer.join(WAIT_S)
        monkeypatch.setattr(export, "identity", real)
        new.write({"who": "new"})
        old.write({"who": "old, after"})
        os.set_blocking(r, False)
        rows = [json.loads(line)["who"] for line in os.read(r, 1 << 16).decode().splitlines()]
    finally:
        go_on.set()
        os.close(r)
        os.close(w)
    assert rows == ["old", "new"]


STDOUT_CLOSED = """
import os, sys
from shmloader import export
r, w = os.pipe()
os.environ["SHMLOADER_STATS_FD"] = str(w)
os.close(1)  # the job closed its stdout: fd 1 is the lowest free number
exports = [export.StatsExport.from_environment() for _ in range(3)]
del exports[0]  # a dropped loader's export closes nothing
print(*sorted({e.fd for e in exports}), os.path.sameopenfile(exports[0].fd, w), file=sys.stderr)
"""


def test_the_process_s_exports_share_one_descriptor_above_stdio_and_never_close_it():
    # Review 71: the export's own duplicate took the lowest free number, fd 1 for a job that had
    # closed its stdout, whose prints then went down memprof's pipe (memprof died in
    # json.loads); and a dropped export's finalizer closed that number, by then another
    # loader's descriptor of the pipe or a file of the job's.
    done = subprocess.run([sys.executable, "-c", STDOUT_CLOSED], capture_output=True, text=True,
                          timeout=WAIT_S, check=False)
    assert done.returncode == 0, done.stderr
    fds, same = done.stderr.split()
    assert int(fds) >= 3 and same == "True"


def test_no_descriptor_to_spare_means_no_rows_not_a_failed_iter(monkeypatch, fresh_process_state):
    # (review 72's brief) A process at its descriptor limit could not duplicate the pipe: the
    # OSError came out of the loader's iter().
    r, w = _named_pipe(monkeypatch)

    def no_room(*args: object) -> int:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(export.fcntl, "fcntl", no_room)
    try:
        with pytest.warns(RuntimeWarning, match="Too many open files"):
            assert StatsExport.from_environment() is None
    finally:
        os.close(r)
        os.close(w)


def test_a_warning_hook_that_waits_for_a_hand_over_does_not_deadlock(monkeypatch):
    # Review 72: the export warned while holding its write lock, which a hand-over takes: a
    # warning hook that waited on the thread replacing the loader's arena (a checkpoint hook
    # taking the loader's lock, inside iter()) deadlocked both.
    r, w = os.pipe()
    os.set_blocking(w, False)
    old, new = StatsExport(w, interval=0), StatsExport(w, interval=0)
    handed = threading.Event()

    def hand_over() -> None:
        old.hand_over(new)
        handed.set()

    def hook(*args: object, **kwargs: object) -> None:
        other = threading.Thread(target=hand_over, daemon=True)
        other.start()
        other.join(WAIT_S)

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            monkeypatch.setattr(warnings, "showwarning", hook)
            while not old.dropped:  # fill the pipe: the first dropped row warns
                old.write({"kind": "arena", "pad": "x" * 100})
    finally:
        os.close(r)
        os.close(w)
    assert handed.is_set()
