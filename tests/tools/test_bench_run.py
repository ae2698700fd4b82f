"""tools.bench's run: the timed loop runs without the PSS sampler, whose kernel CPU would slow a
multi-process loader's workers; peak PSS comes from an untimed memory pass after it."""

from __future__ import annotations

import argparse
import io
from types import TracebackType
from typing import Any

import pytest

from tools import bench
from tools._loaders import resolve_columns
from tools._report import Progress
from tools._synthetic import make_workload


class _Sampler:
    """Stands in for ``PssSampler``: says whether it is sampling, and reports a known peak."""

    active = False

    def __init__(self, interval_s: float) -> None:
        self.peak_kb = 0

    def __enter__(self) -> _Sampler:
        _Sampler.active = True
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        _Sampler.active = False
        self.peak_kb = 3 * 1024


@pytest.mark.parametrize("interval", [0.05, 0.0])
def test_the_timed_loop_runs_without_the_sampler_and_peak_pss_comes_from_its_own_pass(
    monkeypatch: pytest.MonkeyPatch, interval: float
) -> None:
    seen: list[bool] = []  # per batch consumed: was the sampler on

    def touch(batch: Any) -> None:
        seen.append(_Sampler.active)

    monkeypatch.setattr(bench, "PssSampler", _Sampler)
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
        assert run.peak_pss_mb == 3.0
    else:
        assert len(rest) == run.batches  # no memory pass at all
        assert run.peak_pss_mb == 0.0
