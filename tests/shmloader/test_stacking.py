"""shmloader.stacking: a large stacked leaf may be copied with streaming stores, each process
picks the faster copy by timing both, and streaming never changes what the collate returns or
raises.

Each collate case runs the same samples twice, streaming on (decided) and off, with the threshold
at 0 so small samples take the streaming path too, and compares value for value (or error for
error). A spy on ``shmloader.stacking.gather`` says which path ran."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import shmloader
import shmloader.collate as collate_mod
from arena import stream
from shmloader import stacking
from shmloader.collate import SlotSession, slot_default_collate
from shmloader.stacking import CopyChoice

pytestmark = pytest.mark.skipif(not stream.AVAILABLE, reason="arena._stream not built here")


class _Spy:
    def __init__(self) -> None:
        self.calls = 0
        self.real = stacking.gather

    def __call__(self, dst: int, size: int, srcs: list[int]) -> None:
        self.calls += 1
        self.real(dst, size, srcs)


def _collate(
    arena, monkeypatch, samples, *, streaming: bool, min_bytes: int = 0, slot_bytes: int = 1 << 16
):
    spy = _Spy()
    monkeypatch.setattr(stacking, "gather", spy)
    monkeypatch.setattr(stacking, "STREAMING", streaming)
    monkeypatch.setattr(stacking, "STREAM_MIN_BYTES", min_bytes)
    monkeypatch.setattr(stacking, "_choice", CopyChoice(decided=True))
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
def test_any_other_batch_goes_to_torch_stack_with_its_result_or_error(arena, monkeypatch, samples):
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
    limit = stacking.STREAM_MIN_BYTES
    assert limit == 4 << 20

    def batch(sample_bytes: int) -> list[torch.Tensor]:
        return [torch.full((sample_bytes,), i, dtype=torch.uint8) for i in range(4)]

    below = _collate(
        arena, monkeypatch, batch(limit // 4 - 1), streaming=True, min_bytes=limit, slot_bytes=limit
    )
    at = _collate(
        arena, monkeypatch, batch(limit // 4), streaming=True, min_bytes=limit, slot_bytes=limit
    )
    assert (below[1], at[1]) == (0, 1)
    assert torch.equal(below[0][-1], torch.stack(batch(limit // 4 - 1)))
    assert torch.equal(at[0][-1], torch.stack(batch(limit // 4)))


MODES_AT_IMPORT = {None: "auto True None", "auto": "auto True None", " Auto ": "auto True None",
                   "1": "1 True True", "0": "0 False None"}  # fmt: skip
# One fresh interpreter imports the module once per value (the setting is read at import).
_IMPORT_EACH = """
import importlib, json, os, sys
seen = {}
for value in json.loads(sys.argv[1]):
    os.environ.pop(ENV := "SHMLOADER_STREAMING", None)
    if value is not None:
        os.environ[ENV] = value
    sys.modules.pop("shmloader.stacking", None)
    try:
        s = importlib.import_module("shmloader.stacking")
        seen[repr(value)] = f"{s.MODE} {s.STREAMING} {s.choice().decided}"
    except ValueError as e:
        seen[repr(value)] = f"ValueError: {e}"
print(json.dumps(seen))
"""


@pytest.fixture(scope="module")
def modes_at_import() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != stacking.ENV}
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_EACH, json.dumps([*MODES_AT_IMPORT, "yes"])],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return json.loads(done.stdout)  # type: ignore[no-any-return]


@pytest.mark.parametrize(("value", "expected"), list(MODES_AT_IMPORT.items()))
def test_shmloader_streaming_says_auto_always_or_never(modes_at_import, value, expected):
    assert modes_at_import[repr(value)] == expected


def test_an_unknown_shmloader_streaming_value_names_the_values_it_takes(modes_at_import):
    said = modes_at_import[repr("yes")]
    assert said.startswith("ValueError: SHMLOADER_STREAMING='yes': expected 'auto'")
    assert "'1' (always stream large leaves) or '0' (never)" in said


def _measured(stack_ns: list[int], stream_ns: list[int]) -> CopyChoice:
    """A choice fed the given times (per 1,000 bytes) in the order it asks for the copies."""
    c = CopyChoice()
    times = {False: iter(stack_ns), True: iter(stream_ns)}
    while c.decided is None:
        streams = c.next_streams()
        c.record(streams, next(times[streams]), 1000)
    return c


def test_a_choice_alternates_from_torch_stack_and_decides_after_its_trials():
    c = CopyChoice()
    asked = []
    for _ in range(2 * (c.WARMUP + c.TRIALS)):
        assert c.decided is None
        asked.append(c.next_streams())
        c.record(asked[-1], 100, 1000)
    assert asked == [False, True] * (c.WARMUP + c.TRIALS)
    assert c.decided is not None


def test_the_faster_median_wins_and_warmup_copies_do_not_count():
    # the first pair (warm-up) says the opposite; one slow outlier each does not move a median
    assert _measured([1, 500, 500, 9000, 500], [9000, 300, 300, 300, 5000]).decided is True
    assert _measured([9000, 300, 300, 300, 5000], [1, 500, 500, 9000, 500]).decided is False
    assert _measured([400] * 5, [400] * 5).decided is False  # a tie keeps torch.stack


def test_a_decided_choice_stays_and_records_nothing():
    c = _measured([500] * 5, [300] * 5)
    before = (c.seen, [list(x) for x in c.ns_per_byte])
    for _ in range(5):
        assert c.next_streams() is True
        c.record(False, 1, 1000)
    assert (c.seen, [list(x) for x in c.ns_per_byte]) == before


def test_a_forked_child_measures_afresh(monkeypatch):
    monkeypatch.setattr(stacking, "_choice", _measured([500] * 5, [300] * 5))
    assert stacking.choice().decided is True
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child reports what it sees, then exits at once
        os.write(w, repr(stacking.choice().decided).encode())
        os._exit(0)
    os.close(w)
    seen = os.read(r, 100).decode()
    os.close(r)
    os.waitpid(pid, 0)
    assert seen == "None"
    assert stacking.choice().decided is True


_STREAMED_HERE = [0]  # streaming copies made by this process (a worker, after _count_streams)


def _count_streams(worker_id: int) -> None:
    real = stacking.gather

    def counting(dst: int, size: int, srcs: list[int]) -> None:
        _STREAMED_HERE[0] += 1
        real(dst, size, srcs)

    stacking.gather = counting


def _always_stream(worker_id: int) -> None:
    _count_streams(worker_id)
    stacking._choice = CopyChoice(decided=True)


class _Frames(torch.utils.data.Dataset):
    """Odd-sized uint8 frames, 8 of them make a batch above STREAM_MIN_BYTES; each sample says
    how many streaming copies its worker had made when it was fetched."""

    SHAPE = (3, 255, 701)  # 536,265 bytes: every sample after the first starts misaligned

    def __init__(self, n: int) -> None:
        self.n = n
        self.pool = torch.randint(
            0, 256, (4, *self.SHAPE), dtype=torch.uint8, generator=torch.Generator().manual_seed(5)
        )

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.pool[i % 4] + (i // 4), _STREAMED_HERE[0]


def test_workers_stream_large_batches_and_yield_torchs_batches():
    ds = _Frames(48)
    assert 8 * ds.pool[0].nbytes >= stacking.STREAM_MIN_BYTES
    ours = shmloader.DataLoader(ds, batch_size=8, num_workers=2, worker_init_fn=_always_stream)
    theirs = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=2)
    got = [(frames.clone(), seen) for frames, seen in ours]
    want = [frames for frames, _ in theirs]
    assert len(got) == len(want) == 6
    for k, ((frames, seen), expected) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(frames, expected), k
        # batch k is its worker's (k // 2)-th: every batch before it there was streamed
        assert seen.tolist() == [k // 2] * 8, k
    del ours


class _ChoiceFrames(_Frames):
    """Each sample says where its worker's choice stood when it was fetched: -1 still
    measuring, 0 torch.stack, 1 streaming."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        decided = stacking.choice().decided
        return self.pool[i % 4] + (i // 4), -1 if decided is None else int(decided)


def test_each_worker_measures_both_copies_then_keeps_one_and_batches_stay_torchs(monkeypatch):
    monkeypatch.setattr(stacking, "MODE", "auto")
    monkeypatch.setattr(stacking, "_choice", CopyChoice())  # what a worker inherits by default
    trials = 2 * (CopyChoice.WARMUP + CopyChoice.TRIALS)
    per_worker = trials + 3
    ds = _ChoiceFrames(8 * 2 * per_worker)
    ours = shmloader.DataLoader(ds, batch_size=8, num_workers=2)
    theirs = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=2)
    got = [(frames.clone(), state.tolist()) for frames, state in ours]
    want = [frames for frames, _ in theirs]
    assert len(got) == len(want) == 2 * per_worker
    kept: dict[int, set[int]] = {0: set(), 1: set()}
    for k, ((frames, state), expected) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(frames, expected), k
        assert len(set(state)) == 1, (k, state)
        if k // 2 < trials:  # this worker's first `trials` batches were its measurements
            assert state[0] == -1, k
        else:
            assert state[0] in (0, 1), k
            kept[k % 2].add(state[0])
    assert all(len(v) == 1 for v in kept.values()), kept  # once made, the choice stays
    del ours
