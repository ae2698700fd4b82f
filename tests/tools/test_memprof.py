"""tools.memprof end to end (built-in job, a command after --, --compare), its summary and its
live view, and the optional plot."""

import csv
import io
import json
import os
import select
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import shmloader
from tools import _plot, memprof
from tools._memlive import LiveView, frame
from tools._memrecord import MIB, Recording, format_summary
from tools._procmem import ProcessTree, ProcSample, ShmUsage

REPO = Path(__file__).resolve().parents[2]
RUN_S = 120  # a bound on one CLI run; a quick run takes a few seconds
SEEN_S = 30  # a bound on memprof's first status lines (one a second on a pipe)


def _memprof(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tools.memprof", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=RUN_S,
        check=False,
    )


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_built_in_shmloader_job_writes_samples_shm_arena_and_summary(tmp_path):
    done = _memprof(
        "--workload",
        "tabular",
        "--loader",
        "shmloader",
        "--batches",
        "50",
        "--quick",
        "--interval",
        "0.02",
        "--live",
        "--no-plot",
        "--out",
        str(tmp_path),
    )
    assert done.returncode == 0, done.stderr
    samples = _rows(tmp_path / "samples.csv")
    roles = {r["role"] for r in samples}
    assert {"main", "worker0", "worker1"} <= roles
    assert all(int(r["pss"]) > 0 and int(r["uss"]) <= int(r["rss"]) for r in samples)
    assert len(_rows(tmp_path / "shm.csv")) >= len({r["t"] for r in samples})
    arena = [r for r in _rows(tmp_path / "arena.csv") if r["backend"] not in ("", "none")]
    assert arena, "no arena rows from loader.stats()"
    assert all(int(r["slots_total"]) > 0 and int(r["bytes_reserved"]) > 0 for r in arena)
    # Review 37 F4: the CSV kept a fixed list of columns and dropped every newer stats() field.
    with open(tmp_path / "arena.csv") as f:
        header = set(next(csv.reader(f)))
    fields = shmloader.DataLoader(range(4), num_workers=2).stats().as_row()
    assert set(fields) <= header, sorted(set(fields) - header)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["exit_code"] == 0 and summary["job"]["batches"] == 50
    assert summary["peak_total_pss"] >= max(p["peak_pss"] for p in summary["processes"]) > 0
    assert summary["arena"]["peak_bytes_reserved"] > 0
    assert "peak total PSS of the tree" in done.stdout
    assert "MiB of spilled batches" in done.stdout and "MiB of RNG rings" in done.stdout
    assert "slots free=" in done.stdout  # --live, stdout not a TTY: plain status lines


SCRIPT = textwrap.dedent("""
    import subprocess, sys, time
    payload = b"x" * 20_000_000
    # a child that holds 40 MB for half a second: long enough to be sampled many times
    subprocess.run([sys.executable, "-c",
                    "import time; b = b'y' * 40_000_000; time.sleep(0.5)"], check=True)
    sys.exit(3)
""")


def test_a_command_after_double_dash_is_followed_with_its_child_and_its_exit_status(tmp_path):
    done = _memprof(
        "--interval",
        "0.02",
        "--no-plot",
        "--out",
        str(tmp_path),
        "--",
        sys.executable,
        "-c",
        SCRIPT,
    )
    assert done.returncode == 3, done.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    by_role = {p["role"]: p for p in summary["processes"]}
    assert by_role["main"]["peak_uss"] > 20_000_000
    assert by_role["child"]["peak_uss"] > 40_000_000
    assert summary["arena"] is None
    assert _rows(tmp_path / "arena.csv") == []  # header only: the script uses no shmloader


LOADER_SCRIPT = textwrap.dedent(
    """
    import torch
    from torch.utils.data import TensorDataset
    import shmloader

    if __name__ == "__main__":
        # Persistent workers over 20 epochs: both live through the whole run (a few seconds),
        # not the tenth of a second one epoch takes, which a 0.05 s sampler could miss.
        data = TensorDataset(torch.arange(4000.0).view(-1, 1))
        loader = shmloader.DataLoader(data, batch_size=8, num_workers=2,
                                      persistent_workers=True)
        assert sum(1 for _ in range(20) for _ in loader) == 20 * 500
    """
)


def test_a_user_script_with_a_shmloader_loader_exports_arena_rows_and_worker_roles(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(LOADER_SCRIPT)
    out = tmp_path / "out"
    done = _memprof(
        "--interval", "0.05", "--no-plot", "--out", str(out), "--", sys.executable, str(script)
    )
    assert done.returncode == 0, done.stderr
    rows = _rows(out / "arena.csv")
    assert rows and all(int(r["slots_total"]) >= 1 for r in rows)
    roles = {r["role"] for r in _rows(out / "samples.csv")}
    assert {"main", "worker0", "worker1"} <= roles


def test_compare_runs_torch_then_shmloader_and_prints_the_ratio(tmp_path):
    done = _memprof(
        "--workload",
        "tabular",
        "--compare",
        "--quick",
        "--batches",
        "20",
        "--no-plot",
        "--out",
        str(tmp_path),
    )
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / "summary.json").read_text())
    runs = result["runs"]
    assert runs["torch"]["arena"] is None and runs["shmloader"]["arena"] is not None
    expected = runs["shmloader"]["peak_total_pss"] / runs["torch"]["peak_total_pss"]
    assert result["ratio_peak_total_pss"] == pytest.approx(expected)
    assert (tmp_path / "torch" / "samples.csv").exists()
    assert "peak total PSS ratio (shmloader / torch)" in done.stdout


def test_a_command_that_cannot_start_is_reported_with_status_127(tmp_path, capsys):
    assert memprof.main(["--out", str(tmp_path), "--", "/nonexistent/prog"]) == 127
    assert "cannot run '/nonexistent/prog'" in capsys.readouterr().err


def test_workload_and_command_together_are_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        memprof.parse_args(["--workload", "image", "--", "python", "-c", "pass"])
    assert exc.value.code == 2
    assert "not both" in capsys.readouterr().err


def _sample(t: float, pid: int, role: str, pss: int, shmem: int = 0) -> ProcSample:
    return ProcSample(t, pid, 1, role, "python", pss * 2, pss, pss // 2, shmem)


def _recording(ticks: list[tuple[list[ProcSample], int]]) -> Recording:
    rec = Recording(ProcessTree(2**22 + 1), t0=0.0, interval_s=0.1, command=["x"])
    for rows, shm_used in ticks:
        rec.add_tick(rows, ShmUsage(shm_used, 0))
    return rec


def test_peak_total_pss_is_the_largest_sum_over_one_tick_not_the_sum_of_peaks():
    rec = _recording(
        [
            ([_sample(0.0, 10, "main", 100), _sample(0.0, 11, "child", 50)], 0),
            ([_sample(0.1, 10, "main", 40), _sample(0.1, 11, "child", 90)], 0),
        ]
    )
    s = rec.summary()
    assert s["peak_total_pss"] == 150 and s["peak_total_pss_t"] == 0.0
    assert {p["pid"]: p["peak_pss"] for p in s["processes"]} == {10: 100, 11: 90}


def test_footprint_counts_shared_memory_once_from_dev_shm_when_it_grew():
    # Two processes each claim 60 of shmem (read a moment apart); /dev/shm grew by 80 only.
    rec = _recording(
        [
            ([_sample(0.0, 10, "main", 10)], 1000),
            (
                [_sample(0.1, 10, "main", 100, shmem=60), _sample(0.1, 11, "child", 70, shmem=60)],
                1080,
            ),
        ]
    )
    s = rec.summary()
    assert s["peak_total_pss"] == 170
    assert s["peak_footprint"] == (100 - 60) + (70 - 60) + 80
    assert s["shm"]["peak_added_bytes"] == 80


def test_footprint_counts_memfd_bytes_too_when_dev_shm_also_grew():
    # An arena with one slab in /dev/shm (40) and two in memfds (120): both processes map all of
    # it (80 each of shmem PSS); the footprint counts 40 + 120 once, besides the private parts.
    rec = _recording([([_sample(0.0, 10, "main", 10)], 1000)])
    rows = [_sample(0.1, 10, "main", 100, shmem=80), _sample(0.1, 11, "child", 90, shmem=80)]
    rec.add_tick(rows, ShmUsage(1040, 0), memfd_bytes=120)
    s = rec.summary()
    assert s["peak_footprint"] == (100 - 80) + (90 - 80) + 40 + 120
    assert s["shm"]["peak_memfd_bytes"] == 120


def test_footprint_of_a_job_all_in_memfds_counts_them_once():
    rec = _recording([([_sample(0.0, 10, "main", 10)], 1000)])
    rows = [_sample(0.1, 10, "main", 100, shmem=70), _sample(0.1, 11, "child", 90, shmem=70)]
    rec.add_tick(rows, ShmUsage(1000, 0), memfd_bytes=120)  # read apart: 140 of PSS, 120 held
    assert rec.summary()["peak_footprint"] == (100 - 70) + (90 - 70) + 120


def test_shm_csv_has_the_memfd_bytes_of_each_tick(tmp_path):
    rec = _recording([([_sample(0.0, 10, "main", 10)], 0)])
    rec.add_tick([_sample(0.1, 10, "main", 10)], ShmUsage(0, 0), memfd_bytes=4096)
    rec.write(tmp_path)
    assert [r["memfd_bytes"] for r in _rows(tmp_path / "shm.csv")] == ["0", "4096"]


MEMFD_SCRIPT = textwrap.dedent(
    """
    import mmap, os, sys
    # 24 MiB in /dev/shm and 48 MiB in a memfd, both mapped here and in a forked child
    path = f"/dev/shm/memprof-test-{os.getpid()}"
    shm_fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.unlink(path)
    memfd = os.memfd_create("memprof-test")
    maps = []
    chunk = b"z" * (1 << 20)  # written a MiB at a time: no private copy of the whole size
    for fd, mib in ((shm_fd, 24), (memfd, 48)):
        os.ftruncate(fd, mib << 20)
        maps.append(mmap.mmap(fd, mib << 20))
        for off in range(0, mib << 20, 1 << 20):
            maps[-1][off:off + (1 << 20)] = chunk
    r, w = os.pipe()
    if os.fork() == 0:
        os.close(w)
        os.read(r, 1)  # until the parent exits
        os._exit(0)
    # until memprof has printed a status line (it has sampled the tree): stdin says when
    sys.stdin.read()
    """
)


def test_the_footprint_of_a_command_counts_its_memfd_and_dev_shm_bytes_once(tmp_path):
    # memprof --live on a pipe prints one status line a second; the second one is printed after
    # a tick that saw the script's shared memory, then the script is let go (stdin closed).
    script = tmp_path / "shared.py"
    script.write_text(MEMFD_SCRIPT)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "tools.memprof", "--interval", "0.05", "--live", "--no-plot",
           "--linger", "10", "--out", str(out), "--", sys.executable, str(script)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        deadline = time.monotonic() + SEEN_S
        line = ""
        while "memfd_mib=48.0" not in line:
            ready, _, _ = select.select([proc.stdout], [], [], deadline - time.monotonic())
            assert ready, f"no status line with the memfd within {SEEN_S} s"
            line = proc.stdout.readline()
            assert line, "memprof ended before it saw the memfd"
        proc.communicate(input="", timeout=RUN_S)  # closes stdin: the script exits
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["shm"]["peak_memfd_bytes"] == 48 << 20
    assert summary["shm"]["peak_added_bytes"] >= 24 << 20
    # each shared byte once: not twice (two processes map them), not left out (the memfd)
    private = summary["peak_footprint"] - (48 << 20) - summary["shm"]["peak_added_bytes"]
    assert 0 < private < 48 << 20


def test_live_frame_shows_slots_by_state_and_each_process():
    rows = [_sample(1.0, 10, "main", 3 << 20), _sample(1.0, 11, "worker0", 2 << 20)]
    arena = {
        "backend": "posix",
        "slots_total": 6,
        "slots_free": 4,
        "slots_writing": 1,
        "slots_lent": 1,
        "bytes_reserved": 6 << 20,
    }
    lines = frame(1.0, rows, ShmUsage(6 << 20, 0), arena, "job")
    text = "\n".join(lines)
    assert "free 4 | writing 1 | ready 0 | lent 1" in text
    assert any(line.split()[:2] == ["11", "worker0"] for line in lines)


def test_live_view_redraws_in_place_on_a_terminal():
    out = io.StringIO()
    view = LiveView("job", stream=out, tty=True)
    rows = [_sample(0.0, 10, "main", 1 << 20)]
    view.update(0.0, rows, ShmUsage(0, 0), None)
    view.update(0.1, rows, ShmUsage(0, 0), None)  # within the redraw period: skipped
    view.update(1.0, rows, ShmUsage(0, 0), None)
    drawn = len(frame(0.0, rows, ShmUsage(0, 0), None, "job"))
    assert out.getvalue().count(f"\x1b[{drawn}F") == 1


def test_plot_is_skipped_with_a_message_when_matplotlib_is_missing(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    assert _plot.render_timeline(tmp_path) is None
    assert capsys.readouterr().out.strip() == "plot skipped: matplotlib not installed"


def test_plot_renders_a_timeline_from_the_csv_files(tmp_path):
    pytest.importorskip("matplotlib")
    rec = _recording([([_sample(t / 10, 10, "main", 5 << 20)], 0) for t in range(5)])
    rec.arena.append({"t": 0.2, "backend": "posix", "bytes_free": 1 << 20, "bytes_lent": 1 << 20})
    rec.write(tmp_path)
    path = _plot.render_timeline(tmp_path)
    assert path is not None and path.stat().st_size > 1000


def _arena_row(t: float, pid: int, loader: int, reserved: int, **more: object) -> dict:
    return {"kind": "arena", "t": t, "pid": pid, "loader": loader, "backend": "posix",
            "bytes_reserved": reserved, "bytes_in_use": reserved // 2, "slots_total": 5,
            "slot_sizes": str(reserved // 5), "batches_held": 1, "bytes_kept": 0,
            "growth_events": 1, **more}


def _with_arena_rows(rows: list[dict]) -> Recording:
    rec = _recording([([_sample(0.0, 10, "main", 10)], 0)])
    for row in rows:
        rec.add_report({**row, "t": rec.t0 + row["t"]})
    return rec


def test_the_arena_peak_is_every_loader_s_together_not_the_largest_row():
    # Review 66: two loaders of one process (80 and 20 reserved), then two ranks (40 each):
    # the summary took the largest single row (80, then 40) for the job's arena.
    rec = _with_arena_rows([
        _arena_row(0.1, 10, 1, 80), _arena_row(0.15, 10, 2, 20),
        _arena_row(0.2, 10, 1, 80), _arena_row(0.25, 10, 2, 20),
    ])  # fmt: skip
    arena = rec.summary()["arena"]
    assert arena["peak_bytes_reserved"] == 100 and arena["loaders"] == 2
    assert sorted(p["peak_bytes_reserved"] for p in arena["per_loader"]) == [20, 80]
    assert arena["growth_events"] == 2 and arena["loader_processes"] == 1
    ranks = _with_arena_rows([_arena_row(0.1 + i / 100, 20 + i % 2, 1, 40) for i in range(6)])
    arena = ranks.summary()["arena"]
    assert arena["peak_bytes_reserved"] == 80 and arena["loader_processes"] == 2
    assert "2 loaders in 2 processes" in format_summary(ranks.summary())


def test_a_loader_that_is_gone_is_not_counted_past_its_last_row():
    # A training loader (60) finishes, then a validation loader (50) runs: never 110 at once.
    rec = _with_arena_rows([
        _arena_row(0.1, 10, 1, 60), _arena_row(0.2, 10, 1, 60),
        _arena_row(0.3, 10, 2, 50), _arena_row(0.4, 10, 2, 50),
    ])  # fmt: skip
    arena = rec.summary()["arena"]
    assert arena["peak_bytes_reserved"] == 60 and arena["loaders_live_at_most"] == 1
    assert rec.live_arena(stale_s=0.15)["bytes_reserved"] == 50  # the live view: the one left


def test_kept_bytes_are_reported_inside_the_arena_not_beside_it():
    # Review 66: kept slots are lent slots, inside bytes_reserved; the summary listed them
    # "beside the arena", where they read as memory on top of it.
    rec = _with_arena_rows([_arena_row(0.1, 10, 1, 40 * MIB, bytes_kept=4 * MIB)])
    text = format_summary(rec.summary())
    beside = next(line for line in text.splitlines() if "beside the arena" in line)
    assert "kept" not in beside
    assert "4.0 MiB of it kept for forked workers" in text


def test_the_arena_panel_stacks_every_loader_s_bytes_together():
    # Review 68: the plot drew arena.csv's rows as they came, loader 1, 2, 1, 2: a sawtooth
    # between 24 and 6 MiB where both loaders together held 30.
    rows = [{"t": str(0.1 * i), "pid": "10", "loader": str(1 + i % 2),
             "bytes_lent": str((24 if i % 2 == 0 else 6) * MIB)} for i in range(6)]
    ts, layers = _plot.arena_layers(rows)
    lent = layers[_plot.STATES.index("lent")]
    assert ts == [0.1 * i for i in range(6)]
    # (loader 1's last row is at 0.4 s: past it, it counts as gone, as in the summary)
    assert lent == [24.0, 30.0, 30.0, 30.0, 30.0, 6.0]


def test_a_line_on_the_stats_pipe_that_is_no_row_is_skipped_and_counted():
    # Review 71: a job whose stdout landed on the stats pipe killed memprof in json.loads,
    # and no summary was written.
    r, w = os.pipe()
    try:
        rec = _recording([([_sample(0.0, 10, "main", 10)], 0)])
        reports = memprof._Reports(r, rec)
        row = {"kind": "arena", "t": rec.t0 + 0.1, "pid": 10, "loader": 1, "bytes_reserved": 40}
        os.write(w, b"hello from print()\n" + json.dumps(row).encode() + b"\n[1, 2]\n")
        assert reports.drain()
    finally:
        os.close(r)
        os.close(w)
    summary = rec.summary()
    assert summary["unreadable_report_lines"] == 2
    assert summary["arena"]["peak_bytes_reserved"] == 40
    assert "2 lines on the stats pipe were no JSON row" in format_summary(summary)


@pytest.mark.parametrize("line", [
    b'{"t": "12:00:01", "msg": "epoch 1"}', b'{"kind": "workers", "pids": 5}', b'{"t": null}',
    b'{"kind": "arena", "t": 1.0, "pid": "x"}', b'{"kind": "arena", "t": 1.0, "pid": 1e999}',
    b'{"kind": "arena", "t": 1.0, "bytes_reserved": null}', b'{"kind": "workers", "pids": "42"}',
    b'{"kind": "arena", "t": 1.0, "slots_total": "many"}',
    b'{"kind": "workers", "pids": [42, [1]]}',
])  # fmt: skip
def test_a_json_line_that_is_no_row_is_skipped_too(line):
    # Review 72: a structured-log line (a dict) passed json.loads and then raised in
    # add_report, out of memprof's loop.
    r, w = os.pipe()
    try:
        rec = _recording([([_sample(0.0, 10, "main", 10)], 0)])
        reports = memprof._Reports(r, rec)
        os.write(w, line + b"\n")
        assert reports.drain()
    finally:
        os.close(r)
        os.close(w)
    assert rec.unreadable_lines == 1 and rec.arena == [] and rec.summary()["arena"] is None
    assert rec.pending_roles == {}  # (nothing of a rejected line is recorded, review 73)
