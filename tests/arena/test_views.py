"""Tests of arena.views: zero-copy NumPy views over a slot, raw bytes for torch-only dtypes."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from arena._layout import ALIGN, DTYPE_CODE, DTYPES, PAGE
from arena.allocator import SlotRef
from arena.descriptor import ArraySpec, Descriptor
from arena.slab import Slab
from arena.views import array_view, payload, views

NUMPY_CODES = [c for c, (_, _, ok) in DTYPES.items() if ok]
TORCH_ONLY_CODES = [c for c, (_, _, ok) in DTYPES.items() if not ok]
REF = SlotRef(slab_id=0, slot=1, generation=1)
SHAPE = (3, 5)


@pytest.fixture
def slab() -> Iterator[Slab]:
    # Views see a memoryview; the backend behind it is test_segment's business.
    s = Slab.create(slab_id=0, slot_size=PAGE, nslots=2, backend="memfd")
    yield s
    s.close()


@pytest.mark.parametrize("code", NUMPY_CODES, ids=[DTYPES[c][0] for c in NUMPY_CODES])
def test_numpy_dtype_view_is_zero_copy_both_ways(slab, code):
    name, size, _ = DTYPES[code]
    slot = slab.slot_buffer(1)
    view = array_view(slot, ArraySpec(ALIGN, code, SHAPE))
    assert view.dtype == np.dtype(name)
    assert view.shape == SHAPE
    assert view.flags.c_contiguous and view.flags.writeable

    nbytes = 15 * size
    slot[ALIGN : ALIGN + nbytes] = bytes(range(1, nbytes + 1))
    assert view.tobytes() == bytes(range(1, nbytes + 1))  # writes to the slot show in the view

    view[...] = np.zeros(SHAPE, dtype=name)
    assert not any(slot[ALIGN : ALIGN + nbytes])  # and writes to the view land in the slot
    assert slot[ALIGN - 1] == 0 and slot[ALIGN + nbytes] == 0  # and nowhere else


@pytest.mark.parametrize("code", TORCH_ONLY_CODES, ids=[DTYPES[c][0] for c in TORCH_ONLY_CODES])
def test_torch_only_dtype_comes_back_as_raw_bytes_with_an_item_axis(slab, code):
    _, size, _ = DTYPES[code]
    slot = slab.slot_buffer(1)
    view = array_view(slot, ArraySpec(2 * ALIGN, code, SHAPE))
    assert view.dtype == np.uint8
    assert view.shape == (*SHAPE, size)
    slot[2 * ALIGN] = 0xAB
    assert view[0, 0, 0] == 0xAB
    view[-1, -1, -1] = 0xCD
    assert slot[2 * ALIGN + 15 * size - 1] == 0xCD


def test_scalar_and_empty_arrays_view_correctly(slab):
    slot = slab.slot_buffer(0)
    scalar = array_view(slot, ArraySpec(0, DTYPE_CODE["int64"], ()))
    assert scalar.shape == ()
    scalar[()] = -7
    assert int.from_bytes(slot[:8], "little", signed=True) == -7
    empty = array_view(slot, ArraySpec(PAGE, DTYPE_CODE["float32"], (0, 4)))
    assert empty.shape == (0, 4)


def test_views_returns_every_array_in_place(slab):
    slot = slab.slot_buffer(1)
    desc = Descriptor(
        REF,
        (
            ArraySpec(0, DTYPE_CODE["float32"], (4, 4)),
            ArraySpec(128, DTYPE_CODE["int64"], (8,)),
        ),
    )
    images, labels = views(slot, desc)
    images[...] = 1.5
    labels[...] = np.arange(8)
    assert np.frombuffer(slot, dtype=np.float32, count=16).sum() == 24.0
    assert np.frombuffer(slot, dtype=np.int64, count=8, offset=128).tolist() == list(range(8))
    assert np.shares_memory(images, np.frombuffer(slot, dtype=np.uint8))


def test_views_checks_the_descriptor_before_viewing(slab):
    desc = Descriptor(REF, (ArraySpec(PAGE - ALIGN, DTYPE_CODE["float64"], (9,)),))
    with pytest.raises(ValueError, match="overruns slot"):
        views(slab.slot_buffer(0), desc)


def test_payload_is_the_bytes_in_place(slab):
    slot = slab.slot_buffer(1)
    desc = Descriptor(REF, (), payload_offset=256, payload_len=5)
    data = payload(slot, desc)
    assert len(data) == 5
    slot[256:261] = b"batch"
    assert bytes(data) == b"batch"


def test_views_stay_valid_after_the_slab_is_closed(slab):
    view = array_view(slab.slot_buffer(1), ArraySpec(0, DTYPE_CODE["uint8"], (PAGE,)))
    view[:] = 3
    slab.close()
    assert int(view.sum()) == 3 * PAGE
