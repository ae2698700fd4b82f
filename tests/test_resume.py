"""Exact resume: save a loader's state after k batches in one process, resume it in another,
and compare the batches with the uninterrupted run's, bit for bit (``tests/resume_job.py``).

The uninterrupted run that saves the state runs in the test's own process (its global RNGs
restored afterwards); the resume runs in a fresh interpreter, whose RNGs it scrambles first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from shmloader import rngstate
from tests.resume_items import kept_rngs
from tests.resume_job import make_loader, run

ROOT = Path(__file__).resolve().parents[1]


def _run(spec: dict[str, Any], out: Path) -> list[torch.Tensor]:
    subprocess.run(
        # Not ``-m tests.resume_job``: its classes would be ``__main__``'s, and a state saved
        # with ``tests.resume_job.StatefulSampler`` is rightly refused by a ``__main__`` one.
        [sys.executable, "-c", "from tests.resume_job import main; main()", json.dumps(spec),
         str(out)],
        cwd=ROOT, check=True, timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    return torch.load(out, weights_only=True)["batches"]  # type: ignore[no-any-return]


def _saved_and_resumed(
    tmp_path: Path, spec: dict[str, Any]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    state = str(tmp_path / "state.pt")
    k = spec["save_after"]
    with kept_rngs(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # as PYTHONWARNINGS=ignore does for the resume
        full = run({**spec, "mode": "save", "state": state})
    resumed = _run({**spec, "mode": "resume", "state": state}, tmp_path / "resumed.pt")
    return full[k:], resumed


CASES = {
    "0 workers, RandomSampler": {"workers": 0},
    "0 workers, explicit generator": {"workers": 0, "generator": 5},
    "2 workers, RandomSampler": {"workers": 2},
    "2 workers, explicit generator": {"workers": 2, "generator": 3},
    "2 workers, persistent": {"workers": 2, "persistent": True},
    "2 workers, persistent, generator": {"workers": 2, "persistent": True, "generator": 3},
    "2 workers, sequential": {"workers": 2, "sampler": "seq", "save_after": 3},
    "2 workers, batch_sampler": {"workers": 2, "sampler": "batch_sampler"},
    "2 workers, custom stateful sampler": {"workers": 2, "sampler": "stateful"},
    "2 workers, replacement": {"workers": 2, "sampler": "replacement"},
    "2 workers, saved at an epoch's last batch": {"workers": 2, "save_after": 10},
    "2 workers, first epoch": {"workers": 2, "save_after": 1, "persistent": True},
    "3 workers, batch size 3": {"workers": 3, "batch_size": 3, "save_after": 17},
    # IterableDatasets: replicas of 19/18 (2 workers) or 13/12/12 items (3 workers), 4 a batch
    "iterable, Stateful, 0 workers": {"dataset": "stateful_stream", "workers": 0},
    "iterable, fast-forward, 0 workers": {"dataset": "stream", "workers": 0},
    "iterable, Stateful, 2 workers": {"dataset": "stateful_stream", "workers": 2},
    "iterable, fast-forward, 2 workers": {"dataset": "stream", "workers": 2},
    "iterable, Stateful, persistent": {
        "dataset": "stateful_stream", "workers": 2, "persistent": True, "save_after": 7,
    },
    # 3 workers: in each 10-batch epoch workers 1 and 2 run out after 3 batches, worker 0
    # after 4; saved after batch 8 of the second epoch, past two exhausted replicas
    "iterable, Stateful, 3 workers, saved past exhausted replicas": {
        "dataset": "stateful_stream", "workers": 3, "save_after": 18,
    },
    "iterable, fast-forward, 3 workers, saved past exhausted replicas": {
        "dataset": "stream", "workers": 3, "save_after": 19,
    },
    # worker 0 runs out at its second task while workers 1 and 2 have 5 batches each: after
    # that torch's round robin skips it, so a batch's worker is no longer its position % 3
    "iterable, 3 workers, one replica exhausted early": {
        "dataset": "stateful_stream", "workers": 3, "n": 61, "short_first": True,
        "save_after": 5,
    },
    "iterable, 3 workers, one replica exhausted early, fast-forward": {
        "dataset": "stream", "workers": 3, "n": 61, "short_first": True, "save_after": 16,
    },
}


@pytest.mark.parametrize("case", list(CASES))
def test_resumed_run_yields_the_uninterrupted_runs_batches_bit_for_bit(
    tmp_path: Path, case: str
) -> None:
    spec = {"epochs": 3, "save_after": 13, **CASES[case]}
    expected, resumed = _saved_and_resumed(tmp_path, spec)
    assert len(resumed) == len(expected)
    for i, (a, b) in enumerate(zip(expected, resumed, strict=True)):
        assert torch.equal(a, b), f"batch {i} after the save point differs"


def test_out_of_order_resume_yields_each_remaining_batch_once(tmp_path: Path) -> None:
    """in_order=False: the batches not yet consumed, each exactly once (arrival order and the
    worker that fetches each are timing-dependent, as in any in_order=False run)."""
    spec = {"epochs": 2, "save_after": 6, "workers": 2, "in_order": False}
    expected, resumed = _saved_and_resumed(tmp_path, spec)

    def keys(batches: list[torch.Tensor]) -> list[tuple[float, ...]]:
        return sorted(tuple(b[:, 0].tolist()) for b in batches)

    assert keys(resumed) == keys(expected)


def test_out_of_order_iterable_resume_yields_each_remaining_item_once(tmp_path: Path) -> None:
    """in_order=False over an IterableDataset: each worker's batches are consumed in the order
    it produced them, so its replica's record is exact; which worker's batch comes next is
    timing-dependent, so only the set is compared."""
    spec = {"epochs": 2, "save_after": 6, "workers": 2, "in_order": False,
            "dataset": "stateful_stream"}  # fmt: skip
    expected, resumed = _saved_and_resumed(tmp_path, spec)

    def keys(batches: list[torch.Tensor]) -> list[tuple[float, ...]]:
        return sorted(tuple(b[:, 0].tolist()) for b in batches)

    assert keys(resumed) == keys(expected)


def test_a_version_1_state_of_an_iterable_dataset_mid_epoch_is_refused() -> None:
    sd = _state({"dataset": "stateful_stream", "workers": 0})
    old = {k: v for k, v in sd.items() if k != "replicas"} | {"version": 1}
    with pytest.raises(ValueError, match=r"version 1.*IterableDataset"):
        make_loader({"dataset": "stateful_stream", "workers": 0}).load_state_dict(old)
    map_style = {k: v for k, v in _state({"workers": 0}).items() if k != "replicas"}
    make_loader({"workers": 0}).load_state_dict(map_style | {"version": 1})  # still loads


def test_state_before_iterating_resumes_at_the_start() -> None:
    a = make_loader({"workers": 0, "generator": 1})
    sd = a.state_dict()
    full = [b.clone() for b in a]
    b = make_loader({"workers": 0, "generator": 1})
    b.load_state_dict(sd)
    assert all(torch.equal(x, y) for x, y in zip(full, b, strict=True))


def _state(spec: dict[str, Any], k: int = 2) -> dict[str, Any]:
    loader = make_loader(spec)
    it = iter(loader)
    for _ in range(k):
        next(it)
    return loader.state_dict()


@pytest.mark.parametrize(
    ("changed", "named"),
    [
        ({"batch_size": 5}, "batch_size"),
        ({"n": 40}, "dataset_len"),
        ({"sampler": "seq"}, "sampler"),
        ({"workers": 2}, "num_workers"),
    ],
)
def test_a_state_from_another_loader_is_refused_naming_the_mismatch(
    changed: dict[str, Any], named: str
) -> None:
    sd = _state({"workers": 0})
    loader = make_loader({"workers": 0, **changed})
    with pytest.raises(ValueError, match=f"mismatch.*{named}"):
        loader.load_state_dict(sd)


@pytest.mark.parametrize(
    ("saved", "loaded", "named"),
    [
        ({}, {"generator": 3}, "torch.Generators"),
        ({"generator": 3}, {}, "torch.Generators"),
    ],
)
def test_a_state_of_other_rngs_is_refused_before_the_global_rngs_change(
    saved: dict[str, Any], loaded: dict[str, Any], named: str
) -> None:
    with kept_rngs():
        sd = _state({"workers": 0, **saved})
        loader = make_loader({"workers": 0, **loaded})
        before = rngstate.capture()
        with pytest.raises(ValueError, match=f"mismatch.*{named}"):
            loader.load_state_dict(sd)
        assert rngstate.capture() == before  # refused at load, not at the first iter()


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda sd: "not a dict",
        lambda sd: {**sd, "format": "torchdata"},
        lambda sd: {k: v for k, v in sd.items() if k != "yielded"},
        lambda sd: {**sd, "yielded": -3},
        lambda sd: {**sd, "main_rng": b"short"},
        lambda sd: {**sd, "epoch_start": None},
        lambda sd: {**sd, "replicas": {"workers": "x"}},
        lambda sd: {**sd, "replicas": {"workers": [{"batches": 1}] * 3, "assign": [],
                                       "next_worker": 0}},
        # review 45: each was accepted, then failed at iter() or later
        lambda sd: {**sd, "replicas": {"workers": [{"batches": 1}], "assign": [7],
                                       "next_worker": 0}},
        lambda sd: {**sd, "replicas": {"workers": [{"batches": 1}], "assign": [],
                                       "next_worker": -1}},
        lambda sd: {**sd, "replicas": {"workers": [{"batches": -2}], "assign": [],
                                       "next_worker": 0}},
        lambda sd: {**sd, "base_seed": 1 << 80},
        lambda sd: {**sd, "base_seed": -1},
        lambda sd: {**sd, "yielded": 1, "yielded_extra": [3]},  # (an in_order=True loader)
        lambda sd: {**sd, "rewound_rngs": [b"short"]},
        lambda sd: {**sd, "rewound_rngs": [sd["main_rng"]], "in_epoch": False},
    ],
)
def test_a_corrupted_state_is_refused(corrupt: Any) -> None:
    sd = _state({"workers": 0})
    with pytest.raises(ValueError, match="DataLoader state"):
        make_loader({"workers": 0}).load_state_dict(corrupt(sd))


def test_loading_into_a_loader_being_iterated_is_refused() -> None:
    sd = _state({"workers": 0})
    loader = make_loader({"workers": 0})
    it = iter(loader)
    next(it)
    with pytest.raises(RuntimeError, match="being iterated"):
        loader.load_state_dict(sd)


def test_state_dict_survives_torch_save_with_weights_only(tmp_path: Path) -> None:
    sd = _state({"workers": 2, "persistent": True})
    torch.save(sd, tmp_path / "s.pt")
    back = torch.load(tmp_path / "s.pt", weights_only=True)
    assert back == sd
