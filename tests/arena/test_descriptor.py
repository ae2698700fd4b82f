"""Tests of arena.descriptor: the encoded record round-trips, and check() rejects overruns."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arena._layout import ARRAY_HEAD, DESC_HEAD, DTYPE_CODE, DTYPES, SHAPE_DIM
from arena.allocator import SlotRef
from arena.descriptor import ArraySpec, Descriptor

U16 = st.integers(0, (1 << 16) - 1)
U32 = st.integers(0, (1 << 32) - 1)
U64 = st.integers(0, (1 << 64) - 1)

array_specs = st.builds(
    ArraySpec,
    offset=U64,
    dtype=st.sampled_from(sorted(DTYPES)),
    shape=st.lists(U64, max_size=8).map(tuple),
)
descriptors = st.builds(
    Descriptor,
    ref=st.builds(SlotRef, slab_id=U32, slot=U32, generation=U32),
    arrays=st.lists(array_specs, max_size=6).map(tuple),
    payload_offset=U64,
    payload_len=U64,
    flags=U16,
)

F32 = DTYPE_CODE["float32"]
REF = SlotRef(slab_id=1, slot=2, generation=3)


def encoded_length(desc: Descriptor) -> int:
    """The length formula of arena._layout's docstring."""
    return DESC_HEAD.size + sum(
        ARRAY_HEAD.size + len(a.shape) * SHAPE_DIM.size for a in desc.arrays
    )


@settings(max_examples=200)
@given(desc=descriptors)
def test_decode_of_encode_round_trips(desc):
    data = desc.encode()
    assert len(data) == encoded_length(desc)
    assert Descriptor.decode(data) == desc


@settings(max_examples=50)
@given(desc=descriptors, prefix=st.binary(max_size=40))
def test_decode_reads_from_any_position_of_a_larger_buffer(desc, prefix):
    data = prefix + desc.encode() + b"trailing"
    assert Descriptor.decode(memoryview(data), len(prefix)) == desc


def test_decoded_shapes_are_tuples_of_ints():
    desc = Descriptor(REF, (ArraySpec(64, F32, (2, 3)), ArraySpec(0, F32, ())))
    decoded = Descriptor.decode(desc.encode())
    assert decoded.arrays[0].shape == (2, 3)
    assert decoded.arrays[1].shape == ()
    assert all(type(d) is int for d in decoded.arrays[0].shape)


def test_array_nbytes_is_elements_times_itemsize():
    assert ArraySpec(0, F32, (2, 3, 4)).nbytes == 2 * 3 * 4 * 4
    assert ArraySpec(0, DTYPE_CODE["bfloat16"], (5,)).nbytes == 10
    assert ArraySpec(0, F32, ()).nbytes == 4
    assert ArraySpec(0, F32, (0, 7)).nbytes == 0


def test_end_is_one_past_the_last_array_or_payload_byte():
    desc = Descriptor(REF, (ArraySpec(0, F32, (16,)), ArraySpec(128, F32, (4,))), 64, 8)
    assert desc.end == 144
    assert Descriptor(REF, (), payload_offset=256, payload_len=10).end == 266


def test_check_accepts_a_batch_that_fills_the_slot_exactly():
    desc = Descriptor(REF, (ArraySpec(0, F32, (16,)), ArraySpec(64, F32, (16,))), 128, 128)
    desc.check(256)


def test_check_rejects_an_array_that_overruns_the_slot():
    desc = Descriptor(REF, (ArraySpec(64, F32, (16,)),))
    with pytest.raises(ValueError, match="array at offset 64 of 64 bytes overruns slot of 127"):
        desc.check(127)


def test_check_rejects_a_payload_that_overruns_the_slot():
    desc = Descriptor(REF, (), payload_offset=100, payload_len=29)
    with pytest.raises(ValueError, match="payload at 100 of 29 bytes overruns slot of 128"):
        desc.check(128)


@pytest.mark.parametrize(
    "spec",
    [
        ArraySpec(0, 200, (1,)),
        ArraySpec(-64, F32, (1,)),
        ArraySpec(0, F32, (1,) * 65),
        ArraySpec(0, F32, (2, -1)),  # review 38: a view read to the slot's end
    ],
    ids=["unknown-dtype", "negative-offset", "too-many-dims", "negative-dim"],
)
def test_check_rejects_a_corrupt_array_record(spec):
    with pytest.raises(ValueError, match="corrupt array record"):
        Descriptor(REF, (spec,)).check(1 << 20)


def test_check_rejects_a_negative_payload_offset():
    with pytest.raises(ValueError, match="corrupt payload record: offset -8"):
        Descriptor(REF, (), payload_offset=-8, payload_len=8).check(128)


def test_decode_of_more_dimensions_than_numpy_allows_is_a_value_error():
    """Review 38: an IndexError from the shape table."""
    frame = DESC_HEAD.pack(0, 0, 1, 1, 0, 0, 0) + ARRAY_HEAD.pack(0, F32, 70) + bytes(8 * 70)
    with pytest.raises(ValueError, match="70 dimensions"):
        Descriptor.decode(frame)


@settings(max_examples=100)
@given(desc=descriptors, slot_size=st.integers(0, 1 << 66))
def test_check_passes_exactly_when_everything_ends_inside_the_slot(desc, slot_size):
    fits = desc.end <= slot_size
    if fits:
        desc.check(slot_size)
    else:
        with pytest.raises(ValueError, match="overruns"):
            desc.check(slot_size)


def test_descriptors_are_frozen_and_hashable():
    desc = Descriptor(REF, (ArraySpec(0, F32, (1,)),))
    with pytest.raises(AttributeError):
        desc.flags = 1  # type: ignore[misc]
    assert hash(desc) == hash(Descriptor.decode(desc.encode()))
