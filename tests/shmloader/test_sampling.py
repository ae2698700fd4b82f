"""The stock-sampler fast path (shmloader.sampling) against torch's own batch sampler."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, RandomSampler

from shmloader import sampling
from shmloader.sampling import fast_batches

BIG = 100_000  # above randperm's parallel grain (32768): its identity fill runs in parallel


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _sampler(seed: int, bs: int, drop_last: bool) -> tuple[BatchSampler, torch.Generator]:
    g = torch.Generator().manual_seed(seed)
    return BatchSampler(RandomSampler(range(BIG), generator=g), bs, drop_last), g


def _threads_of_each_draw(monkeypatch) -> list[int]:
    """Run a 50,000-index sampler (2 batches) and return torch's intra-op thread count at each
    randperm it draws: the pass, then the (empty) remainder drawn past its end."""
    seen: list[int] = []
    real = torch.randperm

    def recording(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "randperm", recording)
    fast = fast_batches(_sampler(0, 50_000, False)[0])
    assert fast is not None
    assert len(list(fast)) == 2
    return seen


@pytest.mark.parametrize("drop_last", [False, True])
def test_big_random_permutations_match_torch_with_several_threads(two_threads, drop_last):
    theirs, g_theirs = _sampler(3, 4096, drop_last)
    ours, g_ours = _sampler(3, 4096, drop_last)
    for _ in range(2):  # two passes: each draws its own permutation
        expected = list(theirs)
        fast = fast_batches(ours)
        assert fast is not None
        got = [np.frombuffer(b, "<i8").tolist() for b in fast]
        assert got == expected
        assert torch.equal(g_ours.get_state(), g_theirs.get_state())


def test_the_permutation_is_drawn_on_one_thread_and_the_setting_restored(two_threads, monkeypatch):
    if not sampling._openmp():
        pytest.skip("torch's parallel backend here is not OpenMP (the pinned CPU build's is)")
    seen = _threads_of_each_draw(monkeypatch)
    assert seen == [1, 1]
    assert torch.get_num_threads() == 2


def test_the_setting_is_restored_when_the_draw_fails(two_threads, monkeypatch):
    monkeypatch.setattr(sampling, "_openmp", lambda: True)  # the path that changes the setting

    def failing(*args, **kwargs):
        raise RuntimeError("randperm failed")

    monkeypatch.setattr(torch, "randperm", failing)
    fast = fast_batches(_sampler(0, 10, False)[0])
    assert fast is not None
    with pytest.raises(RuntimeError, match="randperm failed"):
        next(fast)
    assert torch.get_num_threads() == 2


def test_other_parallel_backends_draw_with_the_callers_threads(two_threads, monkeypatch):
    # torch's native pool does not spin, and warns when resized after parallel work started.
    monkeypatch.setattr(sampling, "_openmp", lambda: False)
    assert _threads_of_each_draw(monkeypatch) == [2, 2]

