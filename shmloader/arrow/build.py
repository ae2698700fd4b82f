"""From an Arrow column to its gather plan: the supported types, the shapes, the null check.

``build_plan`` maps a column's Arrow type and its arrays (one per record batch) to a
:class:`shmloader.arrow.columns.Plan`, recording each buffer's offset from its shard's base; a
type outside ``SUPPORTED`` is refused naming the file, the column and the type.
``first_null_row`` finds the first row holding a null anywhere (children included), so open can
refuse it naming the row.

Invariant: a fixed-shape tensor's row shape is its ``shape``; a non-identity ``permutation`` is
refused (the bytes would not be in the logical order).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final

import numpy as np
import pyarrow as pa
import torch

from shmloader.arrow.columns import (
    Bits,
    BoolPlan,
    BytesPlan,
    FixedPlan,
    Plan,
    Spans,
    StructPlan,
    VarListPlan,
)
from shmloader.arrow.errors import ArrowSourceError
from shmloader.arrow.shard import Shard

NUMBER_DTYPES: Final[dict[pa.DataType, torch.dtype]] = {
    pa.int8(): torch.int8, pa.int16(): torch.int16, pa.int32(): torch.int32,
    pa.int64(): torch.int64, pa.uint8(): torch.uint8, pa.uint16(): torch.uint16,
    pa.uint32(): torch.uint32, pa.uint64(): torch.uint64, pa.float16(): torch.float16,
    pa.float32(): torch.float32, pa.float64(): torch.float64,
}
SUPPORTED: Final = (
    "int8..int64, uint8..uint64, float16/32/64, bool, fixed_size_list and fixed_shape_tensor of "
    "numbers, list/large_list of numbers, string/large_string, binary/large_binary/"
    "fixed_size_binary, struct of these"
)


def _offsets(arrays: Sequence[pa.Array], shards: Sequence[Shard], pick: Callable[[pa.Array], int],
             ) -> np.ndarray:
    """Per record batch, ``pick(array)`` (an absolute address) as an offset from its shard."""
    return np.array([pick(a) - s.base for a, s in zip(arrays, shards, strict=True)],
                    dtype=np.int64)


def _buffer_address(buf: pa.Buffer | None) -> int:
    return 0 if buf is None else int(buf.address)


def _fixed_shape(t: pa.DataType) -> tuple[pa.DataType, tuple[int, ...]]:
    """The number type at the bottom of nested fixed-size lists / a fixed-shape tensor, and the
    row shape."""
    if isinstance(t, pa.FixedShapeTensorType):
        return t.value_type, tuple(int(d) for d in t.shape)
    shape: list[int] = []
    while pa.types.is_fixed_size_list(t):
        shape.append(t.list_size)
        t = t.value_type
    return t, tuple(shape)


def _flat_values(a: pa.Array) -> pa.Array:
    """The number array under nested fixed-size lists, sliced to start at row 0."""
    if isinstance(a, pa.ExtensionArray):
        a = a.storage
    while pa.types.is_fixed_size_list(a.type):
        a = a.flatten()
    return a


def build_plan(name: str, t: pa.DataType, arrays: Sequence[pa.Array], shards: Sequence[Shard],
               source: str) -> Plan:
    """The plan of column ``name`` of type ``t``; ``arrays[k]`` is its array in record batch
    ``k``, which lives in ``shards[k]``; ``source`` names the file in errors."""

    def refuse(why: str = "") -> ArrowSourceError:
        return ArrowSourceError(
            f"{source}: column {name!r} has type {t}{why}, which ArrowDataset cannot read; "
            f"supported: {SUPPORTED}. {_fix(name, t, source)}"
        )

    if t in NUMBER_DTYPES or pa.types.is_fixed_size_list(t) or isinstance(
        t, pa.FixedShapeTensorType
    ):
        if isinstance(t, pa.FixedShapeTensorType) and t.permutation is not None and list(
            t.permutation
        ) != list(range(len(t.shape))):
            raise refuse(f" (permutation {list(t.permutation)})")
        value_type, shape = _fixed_shape(t)
        if value_type not in NUMBER_DTYPES:
            raise refuse()
        dtype = NUMBER_DTYPES[value_type]
        flats = [_flat_values(a) for a in arrays]
        data = _offsets(flats, shards, lambda f: _buffer_address(f.buffers()[1])
                        + f.offset * dtype.itemsize)
        return FixedPlan(dtype, shape, data)
    if pa.types.is_boolean(t):
        return BoolPlan(_bits(arrays, shards, 1))
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        if t.value_type not in NUMBER_DTYPES:
            raise refuse()
        dtype = NUMBER_DTYPES[t.value_type]
        width = 8 if pa.types.is_large_list(t) else 4
        offs = _offsets(arrays, shards, lambda a: _buffer_address(a.buffers()[1])
                        + a.offset * width)
        values = _offsets(arrays, shards, lambda a: _buffer_address(a.values.buffers()[1])
                          + a.values.offset * dtype.itemsize)
        return VarListPlan(name, dtype, Spans(offs, width), values)
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or (
        pa.types.is_large_binary(t)
    ):
        text = pa.types.is_string(t) or pa.types.is_large_string(t)
        width = 8 if pa.types.is_large_string(t) or pa.types.is_large_binary(t) else 4
        offs = _offsets(arrays, shards, lambda a: _buffer_address(a.buffers()[1])
                        + a.offset * width)
        data = _offsets(arrays, shards, lambda a: _buffer_address(a.buffers()[2]))
        return BytesPlan(name, text, data, Spans(offs, width), 0, _validity(arrays, shards))
    if pa.types.is_fixed_size_binary(t):
        data = _offsets(arrays, shards, lambda a: _buffer_address(a.buffers()[1])
                        + a.offset * t.byte_width)
        return BytesPlan(name, False, data, None, t.byte_width, _validity(arrays, shards))
    if pa.types.is_struct(t):
        fields = [t.field(i).name for i in range(t.num_fields)]
        twice = sorted({f for f in fields if fields.count(f) > 1})
        if twice:  # review 38: a dict row kept the last of them, and lost the others
            raise ArrowSourceError(
                f"{source}: struct column {name!r} has field {', '.join(map(repr, twice))} "
                "more than once; ArrowDataset gives a struct as a dict and needs distinct "
                "field names: cast the column to a struct type whose fields are renamed "
                "(pyarrow Array.cast) and pack it again, or pass columns=[...] without it"
            )
        children = [a.flatten() for a in arrays]
        return StructPlan({
            t.field(i).name: build_plan(f"{name}.{t.field(i).name}", t.field(i).type,
                                        [c[i] for c in children], shards, source)
            for i in range(t.num_fields)
        })
    raise refuse()


def _fix(name: str, t: pa.DataType, source: str) -> str:
    """What to do about unsupported column ``name`` (``a.b`` inside a struct): what tools.pack
    really converts (top-level dictionary and date/time columns), else cast it yourself."""
    packable = pa.types.is_dictionary(t) or pa.types.is_date(t) or pa.types.is_time(t) or (
        pa.types.is_timestamp(t) or pa.types.is_duration(t))
    if packable and "." not in name:
        return (f"Repack it: `python -m tools.pack {source} -o OUT.arrow` decodes dictionary "
                f"columns and stores dates, times, timestamps and durations as int64")
    return ("Cast it to a supported type before packing (pyarrow Table.cast or "
            "pyarrow.compute: e.g. decimals to float64, nested lists flattened, dictionaries "
            "decoded); tools.pack converts only top-level dictionary and date/time columns")


def _bits(arrays: Sequence[pa.Array], shards: Sequence[Shard], buffer: int) -> Bits:
    """Bitmap ``buffer`` (0: validity, 1: a bool array's values) of every record batch."""
    bufs = [a.buffers()[buffer] for a in arrays]
    data = _offsets(arrays, shards, lambda a: _buffer_address(a.buffers()[buffer]))
    data[[b is None for b in bufs]] = 0
    bit0 = np.array([a.offset for a in arrays], dtype=np.int64)
    return Bits(data, bit0, np.array([b is not None for b in bufs], dtype=bool))


def _validity(arrays: Sequence[pa.Array], shards: Sequence[Shard]) -> Bits | None:
    """The validity bitmaps of a column that may hold nulls, or None if no batch has one."""
    return _bits(arrays, shards, 0) if any(a.null_count for a in arrays) else None


def may_be_null(t: pa.DataType) -> bool:
    """Types whose nulls ``ds[i]`` gives as None: strings and binaries."""
    return bool(pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
                or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t))


def first_null_row(a: pa.Array) -> int | None:
    """The first row of ``a`` that is null or holds a null anywhere inside (nulls of strings and
    binaries, which may be null, aside), or None."""
    if isinstance(a, pa.ExtensionArray):
        a = a.storage
    candidates: list[int] = []
    if a.null_count and not may_be_null(a.type):
        candidates.append(int(np.flatnonzero(a.is_null().to_numpy(zero_copy_only=False))[0]))
    t = a.type
    if pa.types.is_fixed_size_list(t):
        inner = first_null_row(a.flatten())
        if inner is not None:
            candidates.append(inner // t.list_size)
    elif pa.types.is_list(t) or pa.types.is_large_list(t):
        inner = first_null_row(a.flatten())
        if inner is not None:
            offsets = a.offsets.to_numpy()
            candidates.append(int(np.searchsorted(offsets - offsets[0], inner, "right")) - 1)
    elif pa.types.is_struct(t):
        for child in a.flatten():
            inner = first_null_row(child)
            if inner is not None:
                candidates.append(inner)
    return min(candidates) if candidates else None
