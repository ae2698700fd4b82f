"""Arrow tables and files the ArrowDataset tests share: one column per supported type."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

ROWS = 1000
CHUNK = 97  # rows per record batch: batches of a test batch straddle record batches

NUMBER_TYPES = {
    "i8": (pa.int8(), torch.int8), "i16": (pa.int16(), torch.int16),
    "i32": (pa.int32(), torch.int32), "i64": (pa.int64(), torch.int64),
    "u8": (pa.uint8(), torch.uint8), "u16": (pa.uint16(), torch.uint16),
    "u32": (pa.uint32(), torch.uint32), "u64": (pa.uint64(), torch.uint64),
    "f16": (pa.float16(), torch.float16), "f32": (pa.float32(), torch.float32),
    "f64": (pa.float64(), torch.float64),
}


def _numbers(rng: np.random.Generator, t: pa.DataType, n: int) -> pa.Array:
    dtype = t.to_pandas_dtype()
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return pa.array(rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True))
    return pa.array((rng.standard_normal(n) * 100).astype(dtype))


def every_type_table(rows: int = ROWS, seed: int = 0) -> pa.Table:
    """One column of every type ArrowDataset reads (names: see the dict below)."""
    rng = np.random.default_rng(seed)
    cols: dict[str, pa.Array] = {k: _numbers(rng, t, rows) for k, (t, _) in NUMBER_TYPES.items()}
    cols["flag"] = pa.array(rng.random(rows) > 0.5)
    cols["vec"] = pa.FixedSizeListArray.from_arrays(
        pa.array(rng.random(rows * 64).astype(np.float32)), 64)
    cols["grid"] = pa.FixedSizeListArray.from_arrays(
        pa.FixedSizeListArray.from_arrays(
            pa.array(rng.integers(-100, 100, rows * 6, dtype=np.int16)), 3), 2)
    cols["tensor"] = pa.ExtensionArray.from_storage(
        pa.fixed_shape_tensor(pa.uint8(), [2, 3, 4]),
        pa.FixedSizeListArray.from_arrays(
            pa.array(rng.integers(0, 256, rows * 24, dtype=np.uint8)), 24))
    cols["tokens"] = pa.array(
        [rng.integers(0, 1000, int(k)).tolist() for k in rng.integers(0, 9, rows)],
        pa.list_(pa.int64()))
    cols["big_tokens"] = pa.array([[float(i)] * (i % 4) for i in range(rows)],
                                  pa.large_list(pa.float32()))
    cols["name"] = pa.array([f"row-{i}-é" * (i % 3) for i in range(rows)])
    cols["large_name"] = pa.array([f"L{i}" for i in range(rows)], pa.large_string())
    cols["blob"] = pa.array([bytes([i % 256]) * (i % 5) for i in range(rows)])
    cols["large_blob"] = pa.array([bytes([i % 7]) * 3 for i in range(rows)], pa.large_binary())
    cols["digest"] = pa.array([i.to_bytes(4, "little") for i in range(rows)], pa.binary(4))
    cols["meta"] = pa.array([{"id": i, "tag": f"t{i % 10}"} for i in range(rows)])
    return pa.table(cols)


def write_file(table: pa.Table, path: Path, chunk: int = CHUNK, **options: object) -> Path:
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(
        sink, table.schema, options=pa.ipc.IpcWriteOptions(**options)  # type: ignore[arg-type]
    ) as writer:
        writer.write_table(table, max_chunksize=chunk)
    return path


def write_stream(table: pa.Table, path: Path, chunk: int = CHUNK) -> Path:
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=chunk)
    return path


def tabular_table(rows: int, seed: int = 0) -> pa.Table:
    """The bench's shape: a 64-float32 fixed-size list, an int64 label and a string."""
    rng = np.random.default_rng(seed)
    return pa.table({
        "features": pa.FixedSizeListArray.from_arrays(
            pa.array(rng.random(rows * 64).astype(np.float32)), 64),
        "label": pa.array(np.arange(rows, dtype=np.int64) % 10),
        "name": pa.array([f"row-{i}" for i in range(rows)]),
    })
