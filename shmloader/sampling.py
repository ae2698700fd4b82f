"""Batches of sampler indices without a Python loop per index, for torch's stock samplers.

torch's ``BatchSampler`` pulls indices one at a time from its sampler (about 0.1 us each, more
beside busy workers): 26-50 us per batch of 256 in the main process. For the exact stock
combination ``BatchSampler(RandomSampler(replacement=False) | SequentialSampler)`` this module
yields each batch as one slice of the permutation, as :class:`~shmloader.protocol.PackedIndices`
(int64 bytes the worker turns into the same ``list`` of ``int``).

Invariant: the fast path gives the same batches *and* the same random-number draws at the same
moments as torch's code. ``RandomSampler.__iter__`` draws its seed (when it has no generator)
when the first index is requested, and one ``randperm`` when the index that starts each pass is
requested -- including a final ``randperm`` for the remainder, drawn when the index after the last
full pass is requested, even if the remainder is empty. ``BatchSampler`` requests indices until it
has a batch or the sampler is exhausted, so "requested" here means: every index of the batch, and
one past the end for the batch that runs out. Any other sampler (a subclass included) keeps
torch's own iterator.

Each pass's permutation is drawn on the calling thread alone (:func:`_randperm`): the same
numbers, without waking torch's OpenMP team, whose idle threads would otherwise spin for several
milliseconds on cores the workers need.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler

from shmloader.protocol import PackedIndices


def fast_batches(index_sampler: Iterable[Any]) -> Iterator[PackedIndices] | None:
    """A fast iterator equivalent to ``iter(index_sampler)``, or None when there is none."""
    if type(index_sampler) is not BatchSampler:
        return None
    bs, drop_last = index_sampler.batch_size, index_sampler.drop_last
    sampler = index_sampler.sampler
    if type(bs) is not int or bs <= 0:
        return None
    if type(sampler) is SequentialSampler:
        return _sequential(sampler, bs, drop_last)
    if type(sampler) is RandomSampler and not sampler.replacement:
        return _random(sampler, bs, drop_last)
    return None


def _sequential(sampler: SequentialSampler, bs: int, drop_last: bool) -> Iterator[PackedIndices]:
    order = np.arange(len(sampler.data_source), dtype="<i8")  # len() at first next(), as torch
    yield from _slices(order, bs, drop_last)


def _slices(order: np.ndarray, bs: int, drop_last: bool) -> Iterator[PackedIndices]:
    n = len(order)
    stop = n - n % bs if drop_last else n
    for start in range(0, stop, bs):
        yield PackedIndices(order[start : start + bs].tobytes())


def _random(sampler: RandomSampler, bs: int, drop_last: bool) -> Iterator[PackedIndices]:
    n = len(sampler.data_source)
    num_samples = sampler.num_samples
    if sampler.generator is None:
        seed = int(torch.empty((), dtype=torch.int64).random_().item())
        generator = torch.Generator()
        generator.manual_seed(seed)
    else:
        generator = sampler.generator
    full = num_samples // n  # passes drawn whole; pass `full` is the remainder
    parts: list[np.ndarray] = []
    drawn = 0
    order = np.empty(0, dtype="<i8")
    pos = 0
    while True:
        # Indices requested for this batch: pos .. pos + bs - 1, or up to one past the end.
        last_requested = min(pos + bs, num_samples + 1) - 1
        if drawn <= full and drawn * n <= last_requested:
            while drawn <= full and drawn * n <= last_requested:
                perm = _randperm(n, generator)
                parts.append(perm if drawn < full else perm[: num_samples % n])
                drawn += 1
            order = np.concatenate(parts) if len(parts) > 1 else parts[0]
            parts = [order]
        stop = min(pos + bs, num_samples)
        if stop <= pos or (drop_last and stop - pos < bs):
            return
        yield PackedIndices(order[pos:stop].astype("<i8", copy=False).tobytes())
        pos = stop


def _randperm(n: int, generator: torch.Generator) -> np.ndarray:
    """``torch.randperm(n, generator=generator)`` with one intra-op thread, as an ndarray.

    randperm's only parallel step is the identity fill before its serial shuffle, so the numbers
    and the generator's state do not depend on the thread count. But with n >= 32768 that fill
    runs as an OpenMP parallel region, after which each thread of the team busy-waits (libgomp's
    default spin, about 15 ms) for more work that never comes: once per pass, CPU taken from the
    workers and counted as the main process's (30 us a batch on ``tools.bench``'s 781-batch
    ``null`` epochs, on 2 cores). ``torch.set_num_threads`` is thread-local for the OpenMP
    backend and costs well under a microsecond; the caller's setting is restored. Other
    backends are left alone: torch's native pool sleeps instead of spinning, and it warns when
    its size changes after parallel work has started."""
    threads = torch.get_num_threads()
    if threads == 1 or not _openmp():
        return torch.randperm(n, generator=generator).numpy()
    torch.set_num_threads(1)
    try:
        return torch.randperm(n, generator=generator).numpy()
    finally:
        torch.set_num_threads(threads)


@functools.cache
def _openmp() -> bool:
    """Whether torch's intra-op parallel backend is OpenMP (read once: 12 us)."""
    return "parallel backend: OpenMP" in torch.__config__.parallel_info()
