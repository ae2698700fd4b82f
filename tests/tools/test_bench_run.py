"""tools.bench's run: the timed loop runs without the memory sampler, whose kernel CPU would slow
a multi-process loader's workers; the peak footprint comes from an untimed memory pass after it,
and counts shared memory no process maps."""

from __future__ import annotations

import argparse
import io
import os
from types import TracebackType
from typing import Any

import pytest

from tools import bench
from tools._loaders import resolve_columns
from tools._measure import FootprintSampler
from tools._procmem import read_shm
from tools._report import Progress
from tools._synthetic import make_workload


class _Sampler:
    """Stands in for ``FootprintSampler``: says whether it is sampling, and reports a known peak."""

    active = False

    def __init__(self, interval_s: float, shm_baseline: int) -> None:
        self.peak_bytes = 0

    def __enter__(self) -> _Sampler:
        _Sampler.active = True
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        _Sampler.active = False
        self.peak_bytes = 3 << 20


@pytest.mark.parametrize("interval", [0.05, 0.0])
def test_the_timed_loop_runs_without_the_sampler_and_the_peak_comes_from_its_own_pass(
    monkeypatch: pytest.MonkeyPatch, interval: float
) -> None:
    seen: list[bool] = []  # per batch consumed: was the sampler on

    def touch(batch: Any) -> None:
        seen.append(_Sampler.active)

    monkeypatch.setattr(bench, "FootprintSampler", _Sampler)
    monkeypatch.setattr(bench, "touch", touch)
    workload = make_workload("null", seed=0, quick=True, batch_size=2000)
    epoch = -(-workload.samples // workload.batch_size)
    progress = Progress(io.StringIO())
    (column,) = resolve_columns(["torch-0"], 0, False, True, progress)
    args = argparse.Namespace(
        prefetch_factor=None, max_batches=None, min_seconds=0.0, pss_interval=interval, seed=0
    )
    run = bench.run_once(column, workload, args, "null | torch-0", progress)

    warm_up, rest = seen[:epoch], seen[epoch:]
    timed = rest[: run.batches]
    assert run.batches == epoch  # min_seconds=0: one timed epoch
    assert not any(warm_up) and not any(timed)
    if interval > 0:
        memory = rest[run.batches :]
        assert memory and all(memory)  # whole epochs, every batch sampled
        assert len(memory) % epoch == 0
        assert run.peak_footprint_mb == 3.0
    else:
        assert len(rest) == run.batches  # no memory pass at all
        assert run.peak_footprint_mb == 0.0


@pytest.mark.parametrize("loader", ["torch", "shmloader"])
def test_workers_started_afresh_every_epoch_have_their_cpu_counted(loader: str) -> None:
    """Review 41: with --fresh-workers the workers were listed once, after the warm-up epoch;
    those had exited by the timed epochs, whose new workers were never counted: worker CPU 0."""
    workload = make_workload("null", seed=0, quick=True)
    progress = Progress(io.StringIO())
    (column,) = resolve_columns([loader], 2, True, True, progress)
    assert not column.persistent
    args = argparse.Namespace(
        prefetch_factor=None, max_batches=None, min_seconds=0.3, pss_interval=0.0, seed=0
    )
    run = bench.run_once(column, workload, args, f"null | {loader}", progress)
    assert run.batches > 0 and run.worker_cpu_seconds > 0


def test_a_worker_whose_command_line_names_a_helper_is_still_a_child() -> None:
    """Review 41: workers inherit the bench's argv; an --out path holding 'forkserver' made
    every worker look like multiprocessing's helper, and their CPU went uncounted."""
    import subprocess
    import sys

    from tools._measure import children

    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()", "--out", "/tmp/forkserver"],
        stdin=subprocess.PIPE,
    )
    try:
        assert child.pid in {p.pid for p in children()}
    finally:
        child.communicate(b"", timeout=30)


@pytest.mark.parametrize("max_batches", [None, 3])
@pytest.mark.parametrize("loader", ["torch", "shmloader"])
def test_a_runs_loader_is_gone_before_its_workers_are_reaped(
    monkeypatch: pytest.MonkeyPatch, loader: str, max_batches: int | None
) -> None:
    """Review 62: a reference to the loader outlived the run's teardown, so its persistent
    workers were still up when the run reaped them: each waited out the reap's timeout, was
    named on stderr and terminated."""
    from tools import _measure

    monkeypatch.setattr(_measure, "REAP_TIMEOUT_S", 5.0)
    workload = make_workload("null", seed=0, quick=True)
    out = io.StringIO()
    progress = Progress(out)
    (column,) = resolve_columns([loader], 2, False, True, progress)
    assert column.persistent
    args = argparse.Namespace(
        prefetch_factor=None, max_batches=max_batches, min_seconds=0.0, pss_interval=0.0, seed=0
    )
    run = bench.run_once(column, workload, args, f"null | {loader}", progress)
    assert run.batches > 0
    assert "still running" not in out.getvalue()


def test_the_footprint_counts_shared_memory_that_no_process_maps() -> None:
    """Review 66: the bench summed PSS, which counts a shared page only where a process maps
    it: torch's queued batches, unmapped files in /dev/shm, were left out of torch's column while
    shmloader's mapped arena counted whole."""
    size = 8 << 20
    baseline = read_shm().used_bytes
    path = f"/dev/shm/shmloader-test-footprint-{os.getpid()}"
    with open(path, "wb") as f:  # a queued batch: written, closed, mapped by nobody
        f.write(b"\1" * size)
    try:
        with FootprintSampler(3600.0, baseline) as queued:
            pass  # (the first sample is taken on entry)
    finally:
        os.unlink(path)
    with FootprintSampler(3600.0, baseline) as gone:
        pass
    assert queued.peak_bytes - gone.peak_bytes >= size - (1 << 20)
