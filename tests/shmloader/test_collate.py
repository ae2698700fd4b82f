import collections
import enum
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

import shmloader
from shmloader.collate import SlotSession, slot_default_collate

Point = collections.namedtuple("Point", ["x", "y"])


def test_empty_outside_a_worker_is_torch_empty():
    t = shmloader.empty((2, 3), dtype=torch.int16)
    assert t.shape == (2, 3) and t.dtype == torch.int16
    assert shmloader.empty(4, 5).shape == (4, 5)


def test_empty_inside_a_session_allocates_inside_the_slot(arena):
    ref = arena.acquire(8192)
    with SlotSession(arena.slot_buffer(ref)) as s:
        t = shmloader.empty((10, 10), dtype=torch.float32)
        assert s.holds(t.data_ptr(), t.numel() * 4)
        assert not s.overflowed
        t.fill_(3.0)
        again = torch.frombuffer(arena.slot_buffer(ref), dtype=torch.float32, count=100)
        assert torch.equal(again, torch.full((100,), 3.0))


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.complex32]
)
def test_empty_inside_a_session_has_a_storage_of_its_own_bytes_as_torch_empty(arena, dtype):
    # Review 35: for a dtype NumPy lacks, empty() viewed the whole slot's storage; a collate
    # returning it with requires_grad (or as a bits8 view, or its storage) pickled the whole
    # slot into the payload, the next slot was bigger, and so on until the OOM killer came.
    ref = arena.acquire(1 << 16)
    with SlotSession(arena.slot_buffer(ref)) as s:
        shmloader.empty(3, dtype=torch.uint8)  # not at the slot's start
        t = shmloader.empty((4, 8), dtype=dtype)
        assert s.holds(t.data_ptr(), t.nbytes)
        want = torch.empty((4, 8), dtype=dtype).untyped_storage().nbytes()
        assert t.untyped_storage().nbytes() == want == t.nbytes
        assert t.untyped_storage().data_ptr() == t.data_ptr()


def test_a_tensor_that_does_not_fit_goes_to_private_memory_and_marks_overflow(arena):
    ref = arena.acquire(4096)
    with SlotSession(arena.slot_buffer(ref)) as s:
        t = shmloader.empty((4096 * 4,), dtype=torch.uint8)
        assert not s.holds(t.data_ptr(), t.numel())
        assert s.overflowed


def test_a_session_without_a_slot_allocates_privately_and_overflows():
    with SlotSession(None) as s:
        t = shmloader.empty((8,), dtype=torch.int64)
        assert t.shape == (8,)
        assert s.overflowed


SAMPLES = [
    [
        {
            "img": torch.arange(6).view(2, 3) + i,
            "n": np.float32(i),
            "id": i,
            "f": 0.5 * i,
            "ok": bool(i % 2),
            "name": f"s{i}",
            "pt": Point(np.arange(3) * i, (i, "t")),
        }
        for i in range(4)
    ],
    [(torch.rand(2), np.ones((2, 2), dtype=np.int16) * i) for i in range(3)],
    [torch.tensor(i, dtype=torch.bfloat16) for i in range(5)],
]


@pytest.mark.parametrize("samples", SAMPLES, ids=["nested", "tuples", "bfloat16"])
def test_slot_collate_matches_default_collate_value_for_value(arena, samples):
    ref = arena.acquire(1 << 16)
    expected = torch.utils.data.default_collate(samples)
    with SlotSession(arena.slot_buffer(ref)):
        got = slot_default_collate(samples)
    _assert_same(got, expected)


def test_slot_collate_raises_torchs_error_for_ragged_tensors(arena):
    ref = arena.acquire(1 << 16)
    samples = [torch.zeros(3), torch.zeros(4)]
    with pytest.raises(RuntimeError) as torch_err:
        torch.utils.data.default_collate(samples)
    with SlotSession(arena.slot_buffer(ref)), pytest.raises(RuntimeError) as ours:
        slot_default_collate(samples)
    assert str(ours.value) == str(torch_err.value)


def _assert_same(a, b):
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


def test_the_default_collate_plans_with_meta_tensors_when_the_slot_is_too_small(arena):
    ref = arena.acquire(4096)
    samples = [torch.ones(1000) for _ in range(8)]  # 32 kB: does not fit one page
    with SlotSession(arena.slot_buffer(ref)) as s:
        out = slot_default_collate(samples)
    assert out.is_meta and out.shape == (8, 1000)
    assert s.planned and s.overflowed


def test_a_session_without_a_slot_plans_the_default_collate():
    with SlotSession(None) as s:
        out = slot_default_collate([{"a": torch.zeros(3)}, {"a": torch.ones(3)}])
    assert out["a"].is_meta and s.planned


class _Label(enum.IntEnum):
    A = 1
    B = 2


INT_LED = {
    "ints": [3, 1, 4, 1, 5],
    "int-and-bool": [1, True, False],
    "bool-and-int": [True, 1],
    "all-bools": [True, False],
    "int-and-float": [1, 2.5],
    "int64-extremes": [-(2**63), 2**63 - 1],
    "beyond-int64": [1, 2**63],
    "far-beyond-int64": [-1, 2**70],
    "int-and-str": [1, "a"],
    "int-and-none": [1, None],
    "int-and-list": [1, [2]],
    "int-enum": [_Label.A, _Label.B],
    "numpy-bool": [1, np.True_],
    "numpy-ints": [1, np.int32(5), np.int64(6)],
    "numpy-0d-array": [1, np.array(3)],
    "0d-tensor": [1, torch.tensor(3, dtype=torch.int32)],
    "tuple-of-ints": (7, 8),
}


@pytest.mark.parametrize("samples", INT_LED.values(), ids=INT_LED.keys())
def test_int_led_batches_collate_to_torchs_tensor_or_error(arena, samples):
    # Warnings are not compared: the one torch gives for a list holding an ndarray is a C++
    # warn-once, so only the first of the two calls would see it (ours hands that list to
    # torch.tensor itself, as torch does).
    def outcome(collate):
        try:
            return ("ok", collate(samples))
        except Exception as e:  # noqa: BLE001 - the error is what is compared
            return ("error", type(e), str(e))

    expected = outcome(torch.utils.data.default_collate)
    ref = arena.acquire(1 << 16)
    with SlotSession(arena.slot_buffer(ref)):
        got = outcome(slot_default_collate)
    assert got[0] == expected[0], (got, expected)
    if got[0] == "ok":
        _assert_same(got[1], expected[1])
    else:
        assert got == expected


def test_int_labels_are_written_into_the_slot(arena):
    # Born in the slot, so packing finds them placed and copies nothing.
    ref = arena.acquire(1 << 16)
    labels = [7, -3, 2**62, 0, 5]
    with SlotSession(arena.slot_buffer(ref)) as s:
        got = slot_default_collate(labels)
        assert s.holds(got.data_ptr(), got.nbytes)
    assert not s.overflowed
    _assert_same(got, torch.utils.data.default_collate(labels))
    again = torch.frombuffer(arena.slot_buffer(ref), dtype=torch.int64, count=len(labels))
    assert again.tolist() == labels


def test_int_labels_that_do_not_fit_the_slot_are_planned(arena):
    ref = arena.acquire(4096)
    labels = list(range(1000))  # 8000 bytes
    with SlotSession(arena.slot_buffer(ref)) as s:
        got = slot_default_collate(labels)
    assert got.is_meta and got.shape == (1000,) and got.dtype == torch.int64
    assert s.planned


def test_int_labels_follow_a_default_device_as_torch_does(arena):
    # torch.tensor follows torch.set_default_device / `with torch.device(...)`; np.array does not.
    ref = arena.acquire(1 << 16)
    with torch.device("meta"):
        expected = torch.utils.data.default_collate([1, 2, 3])
        with SlotSession(arena.slot_buffer(ref)):
            got = slot_default_collate([1, 2, 3])
    assert expected.device.type == "meta"
    assert got.device == expected.device and got.dtype == expected.dtype
    assert got.shape == expected.shape


def test_empty_from_a_thread_pool_hands_out_each_range_once():
    # A collate that decodes samples in threads, each into shmloader.empty(): a thread switch
    # inside the bump allocation gave two threads the same range. A tiny switch interval makes
    # such switches common.
    before = sys.getswitchinterval()
    buf = bytearray(8 << 20)
    sys.setswitchinterval(1e-6)
    try:
        with SlotSession(memoryview(buf)) as s, ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(lambda _: shmloader.empty(16, dtype=torch.int32), range(40_000)))
    finally:
        sys.setswitchinterval(before)
    ptrs = [t.data_ptr() for t in outs]
    assert all(s.holds(p, 64) for p in ptrs)
    assert len(set(ptrs)) == len(ptrs), f"{len(ptrs) - len(set(ptrs))} ranges handed out twice"
