"""Tests of arena._layout: alignment, slot geometry, record formats and the dtype table."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from arena._layout import (
    ALIGN,
    ARRAY_HEAD,
    DESC_HEAD,
    DTYPE_CODE,
    DTYPES,
    MAX_NDIM,
    PAGE,
    SHAPE_DIM,
    SHAPES,
    align_up,
    itemsize,
    page_align,
)


def test_page_is_the_kernel_page_size_and_a_power_of_two():
    assert mmap.PAGESIZE == PAGE
    assert PAGE & (PAGE - 1) == 0


def test_align_is_one_cache_line_and_divides_a_page():
    assert ALIGN == 64
    assert PAGE % ALIGN == 0


@given(n=st.integers(0, 1 << 48), shift=st.integers(0, 16))
def test_align_up_gives_the_smallest_multiple_not_below_n(n, shift):
    alignment = 1 << shift
    up = align_up(n, alignment)
    assert up % alignment == 0
    assert n <= up < n + alignment


@given(n=st.integers(0, 1 << 40))
def test_page_align_rounds_up_to_whole_pages_and_never_below_one_page(n):
    aligned = page_align(n)
    assert aligned % PAGE == 0
    assert aligned >= max(n, PAGE)
    assert aligned - max(n, 1) < PAGE


def test_descriptor_records_are_little_endian_without_padding():
    for record in (DESC_HEAD, ARRAY_HEAD, SHAPE_DIM):
        assert record.format.startswith("<")
    assert DESC_HEAD.size == 3 * 4 + 2 * 2 + 2 * 8
    assert ARRAY_HEAD.size == 8 + 1 + 1
    assert SHAPE_DIM.size == 8


def test_shape_records_cover_every_ndim_up_to_numpys_limit():
    assert len(SHAPES) == MAX_NDIM + 1
    for ndim, record in enumerate(SHAPES):
        assert record.size == ndim * SHAPE_DIM.size


def test_dtype_codes_and_names_map_one_to_one():
    assert len(DTYPE_CODE) == len(DTYPES)
    for code, (name, _, _) in DTYPES.items():
        assert DTYPE_CODE[name] == code
        assert 0 < code < 256  # one byte in ARRAY_HEAD


def test_itemsize_reads_the_dtype_table():
    for code, (_, size, _) in DTYPES.items():
        assert itemsize(code) == size


@pytest.mark.parametrize("code", [c for c, (_, _, ok) in DTYPES.items() if ok])
def test_numpy_viewable_dtypes_have_numpys_itemsize(code):
    name, size, _ = DTYPES[code]
    assert np.dtype(name).itemsize == size
