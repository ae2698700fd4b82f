"""tools.memprof end to end (built-in job, a command after --, --compare), its summary and its
live view, and the optional plot."""

import csv
import io
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tools import _plot, memprof
from tools._memlive import LiveView, frame
from tools._memrecord import Recording
from tools._procmem import ProcessTree, ProcSample, ShmUsage

REPO = Path(__file__).resolve().parents[2]
RUN_S = 120  # a bound on one CLI run; a quick run takes a few seconds


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
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["exit_code"] == 0 and summary["job"]["batches"] == 50
    assert summary["peak_total_pss"] >= max(p["peak_pss"] for p in summary["processes"]) > 0
    assert summary["arena"]["peak_bytes_reserved"] > 0
    assert "peak total PSS of the tree" in done.stdout
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
        data = TensorDataset(torch.arange(4000.0).view(-1, 1))
        loader = shmloader.DataLoader(data, batch_size=8, num_workers=2)
        assert sum(1 for _ in loader) == 500
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
