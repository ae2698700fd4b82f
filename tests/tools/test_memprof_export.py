"""shmloader/export.py, memprof's feed of arena rows from a user's command: rows keep coming while
no batch is yielded, the last one is the state the process exits in, and the thread that writes
them ends with its loader."""

from __future__ import annotations

import gc
import json
import os
import select
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

from shmloader import export as export_module
from shmloader.export import StatsExport

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 30.0  # a bound on any wait for a row; never reached when all is well
RUN_S = 120  # a bound on one memprof run


class FakeStats:
    def __init__(self, held: int) -> None:
        self.held = held

    def as_row(self) -> dict[str, Any]:
        return {"backend": "posix", "batches_held": self.held}


class FakeHost:
    """Stands for shmloader's host: ``snapshot`` is a bound method, as the iterator passes it."""

    def __init__(self) -> None:
        self.held = 0

    def snapshot(self) -> FakeStats:
        return FakeStats(self.held)


class Rows:
    """The read end of an export's pipe, row by row."""

    def __init__(self, fd: int) -> None:
        self.fd, self.buf = fd, b""

    def next(self) -> dict[str, Any]:
        while b"\n" not in self.buf:
            ready, _, _ = select.select([self.fd], [], [], WAIT_S)
            assert ready, f"no row within {WAIT_S} s"
            data = os.read(self.fd, 1 << 16)
            assert data, "the export's pipe was closed"
            self.buf += data
        line, _, self.buf = self.buf.partition(b"\n")
        return json.loads(line)


@pytest.fixture
def pipe():
    r, w = os.pipe()
    yield r, w
    for fd in (r, w):
        os.close(fd)


def _threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "shmloader-stats-export"]


def test_rows_keep_coming_with_the_latest_state_when_no_batch_is_yielded(pipe):
    r, w = pipe
    export, host, rows = StatsExport(w, 0.01), FakeHost(), Rows(r)
    host.held = 1
    export.tick(host.snapshot)
    assert rows.next()["batches_held"] == 1
    host.held = 40  # the job took more batches, then stopped yielding: no tick from here on
    while (row := rows.next())["batches_held"] != 40:
        assert row["batches_held"] == 1
    assert row["kind"] == "arena" and row["pid"] == os.getpid()
    del export, host
    gc.collect()


def test_rows_of_two_loaders_of_one_process_say_which_loader_wrote_them(pipe):
    # Review 66: rows carried only the pid, so memprof could not tell two loaders (train and
    # validation) apart and took one loader's row for the job's arena.
    r, w = pipe
    first, second, rows = StatsExport(w, 3600.0), StatsExport(w, 3600.0), Rows(r)
    first.tick(FakeHost().snapshot)
    second.tick(FakeHost().snapshot)
    a, b = rows.next(), rows.next()
    assert a["pid"] == b["pid"] == os.getpid() and a["loader"] != b["loader"]
    del first, second
    gc.collect()


@pytest.mark.parametrize("interval", [0.01, 3600.0])
def test_the_thread_ends_when_its_loader_is_gone_and_keeps_nothing_alive(pipe, interval):
    _, w = pipe
    before = set(_threads())
    host = FakeHost()
    host.export = StatsExport(w, interval)  # type: ignore[attr-defined]  # as shmloader's host
    host.export.tick(host.snapshot)  # type: ignore[attr-defined]
    (thread,) = set(_threads()) - before
    assert thread.daemon
    del host  # the thread holds it weakly: dropping it frees it, and ends the thread at once
    gc.collect()
    thread.join(WAIT_S)
    assert not thread.is_alive()


def test_a_tick_within_the_interval_writes_nothing(pipe):
    r, w = pipe
    export, host = StatsExport(w, 3600.0), FakeHost()
    export.tick(host.snapshot)
    export.tick(host.snapshot)
    os.set_blocking(r, False)
    assert os.read(r, 1 << 16).count(b"\n") == 1
    del export, host
    gc.collect()


EXITING = textwrap.dedent(
    """
    import sys
    from shmloader.export import StatsExport

    class Stats:
        def __init__(self, held): self.held = held
        def as_row(self): return {"batches_held": self.held}

    class Host:
        held = 1
        def snapshot(self): return Stats(self.held)

    host = Host()
    export = StatsExport(int(sys.argv[1]), 3600.0)  # no row from the interval before exit
    export.tick(host.snapshot)
    host.held = 40
    """
)


def test_the_last_row_is_the_state_the_process_exits_in(pipe):
    r, w = pipe
    proc = subprocess.run([sys.executable, "-c", EXITING, str(w)], cwd=REPO, pass_fds=(w,),
                          capture_output=True, text=True, timeout=RUN_S, check=False)
    assert proc.returncode == 0, proc.stderr
    os.set_blocking(r, False)
    rows = [json.loads(line) for line in os.read(r, 1 << 16).splitlines()]
    assert [row["batches_held"] for row in rows] == [1, 40]


HOLDER = textwrap.dedent(
    """
    import torch
    from torch.utils.data import TensorDataset
    import shmloader

    if __name__ == "__main__":
        data = TensorDataset(torch.zeros(4 * 24, 4096, dtype=torch.uint8))
        loader = shmloader.DataLoader(data, batch_size=4, num_workers=2)
        held = list(loader)  # keeps every batch of the epoch, then exits at once
        assert loader.stats().batches_held == 24
    """
)


def _memprof_script(tmp_path: Path, text: str) -> tuple[subprocess.CompletedProcess[str], Any]:
    """memprof over a script (its rows come from the export thread and its exit): the run and
    its summary."""
    script = tmp_path / "job.py"
    script.write_text(text)
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "tools.memprof", "--interval", "5", "--no-plot", "--out",
         str(out), "--", sys.executable, str(script)],
        cwd=REPO, capture_output=True, text=True, timeout=RUN_S, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done, json.loads((out / "summary.json").read_text())


def test_memprof_sees_the_peak_of_a_script_that_keeps_its_batches(tmp_path):
    _, summary = _memprof_script(tmp_path, HOLDER)
    assert summary["arena"]["peak_batches_held"] == 24


def test_a_reader_that_falls_behind_costs_rows_not_a_stalled_loop(pipe, monkeypatch):
    # Nobody reads the pipe: once it is full, ticks must still return (review 9: the training
    # loop and the export thread both blocked in os.write).
    r, w = pipe
    monkeypatch.setenv("SHMLOADER_STATS_FD", str(w))
    monkeypatch.setenv("SHMLOADER_STATS_INTERVAL", "0")
    monkeypatch.setattr(export_module, "_own", None)  # (this test's pipe gets its own)
    export = StatsExport.from_environment()
    assert export is not None
    try:
        with pytest.warns(RuntimeWarning, match="is behind; statistics rows are dropped"):
            for _ in range(20_000):  # ~1 MB of rows into a 64 KiB pipe
                export.write({"kind": "arena", "pad": "x" * 40})
        assert export.dropped > 0
        assert Rows(r).next()["kind"] == "arena"  # what fitted is whole lines
    finally:
        os.close(export.fd)  # the process's own descriptor of this test's pipe


TWO_LOADERS = textwrap.dedent(
    """
    import sys
    import torch
    from torch.utils.data import TensorDataset
    import shmloader

    if __name__ == "__main__":
        big = shmloader.DataLoader(TensorDataset(torch.zeros(16, 1 << 20, dtype=torch.uint8)),
                                   batch_size=4, num_workers=2)
        small = shmloader.DataLoader(TensorDataset(torch.zeros(16, 1 << 16, dtype=torch.uint8)),
                                     batch_size=4, num_workers=2)
        held = list(big) + list(small)  # both arenas stay whole until the process exits
        print(big.stats().bytes_reserved + small.stats().bytes_reserved, file=sys.stderr)
    """
)


def test_memprof_s_arena_peak_is_both_loaders_of_a_script_together(tmp_path):
    done, summary = _memprof_script(tmp_path, TWO_LOADERS)
    both = int(done.stderr.strip().splitlines()[-1])
    arena = summary["arena"]
    assert arena["loaders"] == 2 and arena["peak_bytes_reserved"] == both
    assert "2 loaders in 1 process," in done.stdout


def test_hand_over_gives_the_new_arena_s_export_the_loader_s_number_and_stops_the_old(pipe):
    r, w = pipe
    old, new, rows = StatsExport(w, 3600.0), StatsExport(w, 3600.0), Rows(r)
    host = FakeHost()
    old.tick(host.snapshot)
    assert rows.next()["loader"] == old.loader
    old.hand_over(new)
    old.tick(host.snapshot)  # (the old arena's iterator yields on: nothing more from it)
    old.final()
    new.tick(FakeHost().snapshot)
    assert rows.next()["loader"] == old.loader
    os.set_blocking(r, False)
    with pytest.raises(BlockingIOError):
        os.read(r, 1)
    del old, new, host
    gc.collect()


REPLACED = textwrap.dedent(
    """
    import sys
    import torch
    from torch.utils.data import TensorDataset
    import shmloader

    if __name__ == "__main__":
        data = TensorDataset(torch.zeros(16, 1 << 20, dtype=torch.uint8))
        loader = shmloader.DataLoader(data, batch_size=4, num_workers=2)
        old = iter(loader)
        first = next(old)
        replaced = loader._host
        # What loader.pin_memory = True between two iterators does on a GPU machine (the test
        # shmloader.loader._host_for makes): a new arena; the old one lives on with `old`.
        replaced.pin_setting = (True, "cuda")
        new = iter(loader)
        second = next(new)
        print(replaced.arena.stats().bytes_reserved, loader.stats().bytes_reserved,
              file=sys.stderr)
    """
)


def test_a_loader_whose_arena_was_replaced_is_one_loader_and_its_old_arena_counted_once(tmp_path):
    # Review 68: both arenas' exports wrote rows (the old one's iterator lives to the exit), so
    # memprof summed the old arena's reserved bytes and then its bytes_retired again, beside
    # the new one, and saw two loaders.
    done, summary = _memprof_script(tmp_path, REPLACED)
    old, new = map(int, done.stderr.strip().splitlines()[-1].split())
    arena = summary["arena"]
    assert arena["loaders"] == 1
    assert arena["peak_bytes_reserved"] == max(old, new) < old + new
    assert arena["peak_bytes_retired"] >= old
