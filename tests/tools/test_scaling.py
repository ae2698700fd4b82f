"""tools.scaling: the quick sweep end to end (JSON, CSV, PNGs), and the plan of the full sweep."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools import scaling

REPO = Path(__file__).resolve().parents[2]
RUN_S = 120  # a bound on the CLI run; --quick takes about 10 s on 2 cores


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("scaling")
    shm_before = set(os.listdir("/dev/shm"))
    done = subprocess.run(
        [sys.executable, "-m", "tools.scaling", "--quick", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=RUN_S,
        check=False,
    )
    new_shm = {n for n in set(os.listdir("/dev/shm")) - shm_before if n.startswith("shmloader-")}
    return done, out, new_shm


def test_quick_run_exits_cleanly_and_prints_the_table(quick_run):
    done, _, new_shm = quick_run
    assert done.returncode == 0, done.stderr
    assert "torch b/s" in done.stdout and "shm b/s" in done.stdout
    assert not new_shm


def test_quick_json_has_both_loaders_with_positive_numbers_at_every_point(quick_run):
    _, out, _ = quick_run
    data = json.loads((out / "scaling.json").read_text())
    points = data["points"]
    assert [p["batch_bytes"] for p in points if p["sweep"] == "bytes"] == list(scaling.QUICK_SIZES)
    assert [p["workers"] for p in points if p["sweep"] == "workers"] == list(scaling.QUICK_WORKERS)
    for p in points:
        assert p["limit_batches_per_s"] > 0 and p["limit_gb_per_s"] > 0
        by_name = {lr["loader"]: lr for lr in p["loaders"]}
        assert set(by_name) == {"torch", "shmloader"}
        for lr in by_name.values():
            s = lr["summary"]
            assert len(lr["seconds"]) == 1  # --quick: one repeat
            assert lr["batches_per_repeat"][0] >= 8
            assert s["batches_per_s"] > 0 and s["gb_per_s"] > 0 and s["cpu_us_per_batch"] > 0
            assert lr["bytes_per_batch"] == p["batch_bytes"]
        assert by_name["torch"]["summary"]["x_torch"] == pytest.approx(1.0)


def test_quick_csv_has_one_row_per_point_and_loader(quick_run):
    _, out, _ = quick_run
    with open(out / "scaling.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    points = len(scaling.QUICK_SIZES) + len(scaling.QUICK_WORKERS)
    assert len(rows) == 2 * points
    assert all(float(r["batches_per_s"]) > 0 for r in rows)


def test_quick_run_draws_both_plots(quick_run):
    pytest.importorskip("matplotlib")
    _, out, _ = quick_run
    for name in ("scaling_bytes.png", "scaling_workers.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_full_plan_spans_64_kib_to_256_mib_and_prefetches_one_batch_from_64_mib():
    points = scaling.plan(quick=False, sweeps=["bytes", "workers"])
    sizes = [p.batch_bytes for p in points if p.sweep == "bytes"]
    assert sizes[0] == 64 * 1024 and sizes[-1] == 256 * 1024 * 1024
    assert all(p.prefetch_factor == (1 if p.batch_bytes >= 64 << 20 else 2) for p in points)
    assert [p.workers for p in points if p.sweep == "workers"] == [1, 2, 3, 4]


@pytest.mark.parametrize("bad", ["0", "1,x", "2,,4"])
def test_a_bad_worker_list_is_refused_by_the_parser(bad, capsys):
    """Review 41: --workers 0 ended in torch's traceback, 1,x in a bare ValueError's."""
    with pytest.raises(SystemExit):
        scaling.parse_args(["--workers", bad])
    assert "argument --workers" in capsys.readouterr().err
