"""Streaming copies in the default collate: a large stacked leaf is copied with streaming stores,
and streaming never changes what the collate returns or raises.

Each case collates the same samples twice, streaming on and off, with the threshold at 0 so small
samples take the streaming path too, and compares value for value (or error for error). A spy on
``shmloader.collate.gather`` says which path ran."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import shmloader
import shmloader.collate as collate_mod
from arena import stream
from shmloader.collate import SlotSession, slot_default_collate

pytestmark = pytest.mark.skipif(not stream.AVAILABLE, reason="arena._stream not built here")


class _Spy:
    def __init__(self) -> None:
        self.calls = 0
        self.real = collate_mod.gather

    def __call__(self, dst: int, size: int, srcs: list[int]) -> None:
        self.calls += 1
        self.real(dst, size, srcs)


def _collate(arena, monkeypatch, samples, *, streaming: bool, min_bytes: int = 0,
             slot_bytes: int = 1 << 16):
    spy = _Spy()
    monkeypatch.setattr(collate_mod, "gather", spy)
    monkeypatch.setattr(collate_mod, "STREAMING", streaming)
    monkeypatch.setattr(collate_mod, "STREAM_MIN_BYTES", min_bytes)
    ref = arena.acquire(slot_bytes)
    try:
        with SlotSession(arena.slot_buffer(ref)):
            samples = samples() if callable(samples) else samples
            try:
                out = slot_default_collate(samples)
            except (RuntimeError, TypeError, ValueError) as e:  # compared: type, message
                return ("raised", type(e), str(e)), spy.calls
            return ("returned", type(out), out.dtype, out.clone()), spy.calls
    finally:
        monkeypatch.undo()


def _same(a, b) -> bool:
    if a[0] != b[0] or a[:-1] != b[:-1]:
        return False
    if a[0] == "raised":
        return a == b
    return a[-1].shape == b[-1].shape and torch.equal(a[-1], b[-1])


def _big(i: int) -> torch.Tensor:
    return torch.arange(3 * 5 * 7, dtype=torch.uint8).view(3, 5, 7) + i


STREAMED = {
    "uint8 odd sizes": [_big(i) for i in range(4)],
    "float32": [torch.randn(2, 3) for _ in range(3)],
    "bfloat16": [torch.randn(5).to(torch.bfloat16) for _ in range(3)],
    "complex64": [torch.randn(3, dtype=torch.complex64) for _ in range(2)],
    "bool": [torch.rand(9) > 0.5 for _ in range(3)],
    "0-dim float64": [torch.tensor(float(i), dtype=torch.float64) for i in range(5)],
    "one sample": [torch.arange(11)],
    "rows of one tensor": list(torch.arange(60, dtype=torch.int16).view(4, 15)),
}


@pytest.mark.parametrize("samples", STREAMED.values(), ids=STREAMED.keys())
def test_a_plain_batch_streams_and_gives_torch_stacks_values(arena, monkeypatch, samples):
    on, on_calls = _collate(arena, monkeypatch, samples, streaming=True)
    off, off_calls = _collate(arena, monkeypatch, samples, streaming=False)
    assert (on_calls, off_calls) == (1, 0)
    assert on[0] == "returned" and _same(on, off)
    assert torch.equal(on[-1], torch.stack(samples))


class _Sub(torch.Tensor):
    pass


def _neg_bit() -> list[torch.Tensor]:
    # contiguous, so only the bit tells that the stored values are not the tensor's
    samples = [torch._neg_view(torch.arange(6.0) + i) for i in range(2)]
    assert all(t.is_neg() and t.is_contiguous() for t in samples)
    return samples


def _overlapping_out() -> list[torch.Tensor]:
    # The slot's first bytes are where the output will go: torch refuses an input it overlaps.
    slot = collate_mod._session.bytes  # type: ignore[union-attr]
    return [slot[:16], torch.zeros(16, dtype=torch.uint8)]


def _under_a_function_mode() -> list[torch.Tensor]:
    return [torch.ones(4), torch.zeros(4)]


FALLBACK = {
    "non-contiguous": [torch.randn(3, 4).t() for _ in range(2)],
    "mixed dtypes": [torch.ones(3), torch.ones(3, dtype=torch.float64)],
    "mixed shapes": [torch.ones(3), torch.ones(4)],
    "requires grad": [torch.ones(3), torch.ones(3, requires_grad=True)],
    "conjugate bit": [(torch.arange(3) + 1j * i).to(torch.complex64).conj() for i in range(2)],
    "negative bit": _neg_bit,
    "subclass": [torch.ones(3).as_subclass(_Sub), torch.ones(3).as_subclass(_Sub)],
    "a non-tensor": [torch.ones(3), 5],
    "overlapping the output": _overlapping_out,
}


@pytest.mark.parametrize("samples", FALLBACK.values(), ids=FALLBACK.keys())
def test_any_other_batch_goes_to_torch_stack_with_its_result_or_error(arena, monkeypatch,
                                                                       samples):
    on, on_calls = _collate(arena, monkeypatch, samples, streaming=True)
    off, off_calls = _collate(arena, monkeypatch, samples, streaming=False)
    assert (on_calls, off_calls) == (0, 0)
    assert _same(on, off), (on, off)


def test_a_batch_under_a_torch_function_mode_goes_to_torch_stack(arena, monkeypatch):
    samples = [torch.ones(4), torch.zeros(4)]
    with torch.device("cpu"):
        on, on_calls = _collate(arena, monkeypatch, samples, streaming=True)
    assert on_calls == 0
    assert torch.equal(on[-1], torch.stack(samples))


def test_only_a_stacked_leaf_of_stream_min_bytes_or_more_streams(arena, monkeypatch):
    limit = collate_mod.STREAM_MIN_BYTES
    assert limit == 4 << 20

    def batch(sample_bytes: int) -> list[torch.Tensor]:
        return [torch.full((sample_bytes,), i, dtype=torch.uint8) for i in range(4)]

    below = _collate(arena, monkeypatch, batch(limit // 4 - 1), streaming=True,
                     min_bytes=limit, slot_bytes=limit)
    at = _collate(arena, monkeypatch, batch(limit // 4), streaming=True, min_bytes=limit,
                  slot_bytes=limit)
    assert (below[1], at[1]) == (0, 1)
    assert torch.equal(below[0][-1], torch.stack(batch(limit // 4 - 1)))
    assert torch.equal(at[0][-1], torch.stack(batch(limit // 4)))


@pytest.mark.parametrize(("value", "expected"), [("0", "False"), ("1", "True"), (None, "True")])
def test_shmloader_streaming_0_turns_streaming_off(value, expected):
    env = {k: v for k, v in os.environ.items() if k != "SHMLOADER_STREAMING"}
    if value is not None:
        env["SHMLOADER_STREAMING"] = value
    done = subprocess.run(
        [sys.executable, "-c", "import shmloader.collate as c; print(c.STREAMING)"],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    )
    assert done.stdout.strip() == expected


_STREAMED_HERE = [0]  # streaming copies made by this process (a worker, after _count_streams)


def _count_streams(worker_id: int) -> None:
    real = collate_mod.gather

    def counting(dst: int, size: int, srcs: list[int]) -> None:
        _STREAMED_HERE[0] += 1
        real(dst, size, srcs)

    collate_mod.gather = counting


class _Frames(torch.utils.data.Dataset):
    """Odd-sized uint8 frames, 8 of them make a batch above STREAM_MIN_BYTES; each sample says
    how many streaming copies its worker had made when it was fetched."""

    SHAPE = (3, 255, 701)  # 536,265 bytes: every sample after the first starts misaligned

    def __init__(self, n: int) -> None:
        self.n = n
        self.pool = torch.randint(0, 256, (4, *self.SHAPE), dtype=torch.uint8,
                                  generator=torch.Generator().manual_seed(5))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.pool[i % 4] + (i // 4), _STREAMED_HERE[0]


def test_workers_stream_large_batches_and_yield_torchs_batches():
    ds = _Frames(48)
    assert 8 * ds.pool[0].nbytes >= collate_mod.STREAM_MIN_BYTES
    ours = shmloader.DataLoader(ds, batch_size=8, num_workers=2, worker_init_fn=_count_streams)
    theirs = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=2)
    got = [(frames.clone(), seen) for frames, seen in ours]
    want = [frames for frames, _ in theirs]
    assert len(got) == len(want) == 6
    for k, ((frames, seen), expected) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(frames, expected), k
        # batch k is its worker's (k // 2)-th: every batch before it there was streamed
        assert seen.tolist() == [k // 2] * 8, k
    del ours
