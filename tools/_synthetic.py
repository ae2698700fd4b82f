"""Built-in synthetic workloads: deterministic datasets, their collates and their batch sizes.

Every dataset is generated from a seed at construction, so the same seed gives bit-identical
samples in every process and every run. Each holds a small pool of data and serves many indices
from it, so ``__getitem__`` is cheap and a benchmark measures the loader's data path:

- ``image``   ``ImagePoolDataset``: sample ``i`` is ``(pool[i % 8], i % 1000)``, the pool being
  8 random uint8 images of 3x512x512; no copy in ``__getitem__``.
- ``tabular`` ``TabularDataset``: one float32 table ``rows x 64``; sample ``i`` is
  ``(table[i], i % 1000)``, a view of one row.
- ``null``    ``NullDataset``: sample ``i`` is one preallocated 1-element float32 tensor and the
  int ``0``; ``__getitem__`` and the collate copy cost next to nothing, so what a loader's
  workers spend per batch beyond a bare ``collate([ds[i] ...])`` is the loader's own overhead.
- ``ragged``  ``RaggedImageDataset``: sample ``i`` is a ``3 x H_i x W_i`` view cropped from the
  image pool, ``H_i, W_i`` drawn once per index from ``[384, 512]``; batched by ``pad_collate``,
  which pads to the largest ``H, W`` of the batch.
- ``decode``  ``JpegDataset`` (needs Pillow): small JPEGs encoded once in memory at construction
  and decoded on every ``__getitem__``.
- ``pinned``  the ``image`` dataset loaded with ``pin_memory=True``; the consumer copies every
  batch to ``cuda`` (needs CUDA).
- ``arrow``   ``shmloader.arrow.ArrowDataset`` over an Arrow IPC file of ``rows`` rows of
  ``features`` (64 float32, a fixed-size list), ``label`` (int64) and ``name`` (a string), written
  once by :func:`arrow_file` into the temp directory and reused (about 280 bytes per row).
- ``arrow-list`` the same rows as a Python list of dicts (``features`` a list of 64 floats, as
  ``Table.to_pylist()`` gives them), converted to tensors per item: ``PyRowsDataset``; the same
  batches as ``arrow`` under ``default_collate``.

``BlobPoolDataset`` (not a named workload) serves flat uint8 samples of any size from a small pool;
``tools.scaling`` sizes it so that one batch has a target number of bytes.

All datasets are top-level classes holding only tensors, bytes and ints (or, for ``arrow``, a
path), so they pickle for spawned workers.
"""

from __future__ import annotations

import importlib.util
import io
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

WORKLOADS: tuple[str, ...] = (
    "image", "tabular", "null", "ragged", "decode", "pinned", "arrow", "arrow-list"
)
NUM_LABELS = 1000
POOL_SIZE = 8
IMAGE_SHAPE = (3, 512, 512)
RAGGED_SIDE = (384, 512)  # inclusive bounds of H and W
TABULAR_COLUMNS = 64
JPEG_SIDE = 256
JPEG_QUALITY = 90
PIXELS_SHAPE = (3, 32, 32)  # rows of the "pixels" Arrow table (the memprof arrow workload)
PIXELS_BYTES = 3 * 32 * 32
DEVICE = "cuda"  # where the pinned workload's consumer copies each batch

# samples (rows for tabular) and batch size per workload: (full run, --quick run, batch size)
SIZES: dict[str, tuple[int, int, int]] = {
    "image": (1024, 128, 32),
    "tabular": (200_000, 20_000, 256),
    "null": (200_000, 20_000, 256),
    "ragged": (1024, 128, 32),
    "decode": (256, 64, 32),
    "pinned": (1024, 128, 32),
    "arrow": (200_000, 20_000, 256),
    "arrow-list": (200_000, 20_000, 256),
}
ARROW_CHUNK_ROWS = 65_536  # rows per record batch of the files arrow_file writes


class WorkloadUnavailable(RuntimeError):
    """A workload cannot run here; the message says why (for example a missing optional package)."""


def _image_pool(seed: int, shape: Sequence[int]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    pool = torch.randint(0, 256, (POOL_SIZE, *shape), dtype=torch.uint8, generator=generator)
    return [image.clone() for image in pool]


class ImagePoolDataset(Dataset[tuple[torch.Tensor, int]]):
    """``n`` samples of ``(uint8 image, label)`` served from ``POOL_SIZE`` distinct images."""

    def __init__(self, n: int, seed: int, shape: Sequence[int] = IMAGE_SHAPE) -> None:
        self.n = n
        self.pool = _image_pool(seed, shape)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.pool[index % POOL_SIZE], index % NUM_LABELS


class TabularDataset(Dataset[tuple[torch.Tensor, int]]):
    """``rows`` samples of ``(float32 row of TABULAR_COLUMNS, label)``, all views of one table."""

    def __init__(self, rows: int, seed: int, columns: int = TABULAR_COLUMNS) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.table = torch.rand((rows, columns), dtype=torch.float32, generator=generator)

    def __len__(self) -> int:
        return self.table.shape[0]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.table[index], index % NUM_LABELS


class NullDataset(Dataset[tuple[torch.Tensor, int]]):
    """Every sample is the same preallocated tensor: the loader's fixed cost, and nothing else."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.sample = torch.zeros(1)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.sample, 0


class BlobPoolDataset(Dataset[torch.Tensor]):
    """``n`` samples of ``sample_bytes`` random uint8 each, served from ``pool`` distinct tensors
    (``pool[i % pool]``, no copy in ``__getitem__``)."""

    def __init__(self, n: int, sample_bytes: int, seed: int, pool: int = 4) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.n = n
        self.pool = [torch.randint(0, 256, (sample_bytes,), dtype=torch.uint8, generator=generator)
                     for _ in range(pool)]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.pool[index % len(self.pool)]


class RaggedImageDataset(Dataset[tuple[torch.Tensor, int]]):
    """``n`` samples of ``(3 x H x W uint8 view, label)``, ``H, W`` fixed per index by the seed."""

    def __init__(self, n: int, seed: int, side: tuple[int, int] = RAGGED_SIDE) -> None:
        self.pool = _image_pool(seed, (IMAGE_SHAPE[0], side[1], side[1]))
        generator = torch.Generator().manual_seed(seed + 1)
        hw = torch.randint(side[0], side[1] + 1, (n, 2), generator=generator)
        self.sizes: list[tuple[int, int]] = [(int(h), int(w)) for h, w in hw.tolist()]

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        h, w = self.sizes[index]
        return self.pool[index % POOL_SIZE][:, :h, :w], index % NUM_LABELS


def _empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """``shmloader.empty`` when shmloader is loaded and has it, else ``torch.empty``.

    Looked up in ``sys.modules`` rather than imported: the helper only matters inside a shmloader
    worker, where shmloader is necessarily loaded, and a torch-only run never imports shmloader.
    """
    shmloader = sys.modules.get("shmloader")
    empty: Callable[..., torch.Tensor] = getattr(shmloader, "empty", torch.empty)
    return empty(tuple(shape), dtype=dtype)


def pad_collate(batch: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack ``C x H_i x W_i`` images into ``B x C x max H x max W`` (zero-padded), int64 labels."""
    channels = batch[0][0].shape[0]
    height = max(image.shape[1] for image, _ in batch)
    width = max(image.shape[2] for image, _ in batch)
    images = _empty((len(batch), channels, height, width), torch.uint8)
    labels = _empty((len(batch),), torch.int64)
    for i, (image, label) in enumerate(batch):
        h, w = image.shape[1], image.shape[2]
        images[i, :, :h, :w].copy_(image)
        images[i, :, h:, :].zero_()
        images[i, :, :h, w:].zero_()
        labels[i] = label
    return images, labels


def pillow_available() -> bool:
    return importlib.util.find_spec("PIL") is not None


class JpegDataset(Dataset[tuple[torch.Tensor, int]]):
    """``n`` samples of ``(3 x side x side uint8 image decoded from JPEG, label)``; needs Pillow."""

    def __init__(self, n: int, seed: int, side: int = JPEG_SIDE) -> None:
        from PIL import Image

        rng = np.random.default_rng(seed)
        self.jpegs: list[bytes] = []
        for _ in range(n):
            # Blocky colour fields plus mild noise: compresses like a photo, not like pure noise.
            coarse = rng.integers(0, 256, (side // 16, side // 16, 3), dtype=np.uint8)
            pixels = np.repeat(np.repeat(coarse, 16, axis=0), 16, axis=1)
            noise = rng.integers(0, 16, pixels.shape, dtype=np.uint8)
            buffer = io.BytesIO()
            Image.fromarray(pixels | noise, mode="RGB").save(buffer, "JPEG", quality=JPEG_QUALITY)
            self.jpegs.append(buffer.getvalue())

    def __len__(self) -> int:
        return len(self.jpegs)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        with Image.open(io.BytesIO(self.jpegs[index])) as image:
            pixels = np.array(image.convert("RGB"))
        return torch.from_numpy(pixels).permute(2, 0, 1), index % NUM_LABELS


def _arrow_rows(kind: str, start: int, stop: int, seed: int) -> Any:
    """Rows ``[start, stop)`` of the synthetic table ``kind`` as a ``pyarrow.RecordBatch``; row
    ``i`` depends only on ``(seed, i)``, so any chunking gives the same table.

    ``tabular``: ``features`` 64 float32 (fixed-size list), ``label`` int64, ``name`` string.
    ``pixels``: ``pixels`` 3x32x32 uint8 (fixed-shape tensor), ``label`` int64, ``name`` string.
    """
    import pyarrow as pa

    rng = np.random.default_rng([seed, start])
    n = stop - start
    index = np.arange(start, stop, dtype=np.int64)
    names = pa.array([f"row-{i:09d}" for i in range(start, stop)])
    labels = pa.array(index % NUM_LABELS)
    if kind == "tabular":
        features = pa.FixedSizeListArray.from_arrays(
            pa.array(rng.random(n * TABULAR_COLUMNS, dtype=np.float32)), TABULAR_COLUMNS)
        return pa.RecordBatch.from_pydict({"features": features, "label": labels, "name": names})
    pixels = pa.ExtensionArray.from_storage(
        pa.fixed_shape_tensor(pa.uint8(), list(PIXELS_SHAPE)),
        pa.FixedSizeListArray.from_arrays(
            pa.array(rng.integers(0, 256, n * PIXELS_BYTES, dtype=np.uint8)), PIXELS_BYTES))
    return pa.RecordBatch.from_pydict({"pixels": pixels, "label": labels, "name": names})


def arrow_file_path(kind: str, rows: int, seed: int, directory: str | None = None) -> str:
    """Where :func:`arrow_file` keeps the file ``kind`` of ``rows`` rows for ``seed``."""
    folder = directory or tempfile.gettempdir()
    return os.path.join(folder, f"shmloader-{kind}-{rows}-{seed}.arrow")


def arrow_file(kind: str, rows: int, seed: int, directory: str | None = None) -> str:
    """The path of the synthetic Arrow IPC file ``kind`` (see ``_arrow_rows``), written on first
    use into ``directory`` (default: the temp directory) and reused while it exists; written
    under a temporary name and renamed, so a reader never sees a partial file."""
    import pyarrow as pa

    path = arrow_file_path(kind, rows, seed, directory)
    if os.path.exists(path):
        return path
    tmp = f"{path}.partial-{os.getpid()}"
    try:
        with pa.OSFile(tmp, "wb") as sink:
            first = _arrow_rows(kind, 0, min(rows, ARROW_CHUNK_ROWS), seed)
            with pa.ipc.new_file(sink, first.schema) as writer:
                writer.write_batch(first)
                for start in range(ARROW_CHUNK_ROWS, rows, ARROW_CHUNK_ROWS):
                    writer.write_batch(_arrow_rows(kind, start, min(rows, start + ARROW_CHUNK_ROWS),
                                                   seed))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


class PyRowsDataset(Dataset[dict[str, Any]]):
    """Rows held as a Python list of dicts (the objects pytorch#13246 is about); each item turns
    the ``tensor_columns`` (name -> dtype, row shape) into tensors, the rest passes through, so
    ``default_collate`` gives the batches ``ArrowDataset`` gives for the same rows."""

    def __init__(self, rows: list[dict[str, Any]],
                 tensor_columns: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> None:
        self.rows = rows
        self.tensor_columns = tensor_columns

    @classmethod
    def from_arrow(cls, path: str) -> PyRowsDataset:
        """The rows of an ``arrow_file`` (``pixels`` kept as bytes, lists as lists)."""
        import pyarrow as pa

        # read batch by batch, not mapped, through malloc (which gives freed batches back)
        malloc = pa.system_memory_pool()
        reader = pa.ipc.open_file(pa.OSFile(path, memory_pool=malloc), memory_pool=malloc)
        columns: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        rows: list[dict[str, Any]] = []
        for i in range(reader.num_record_batches):
            batch = reader.get_batch(i)
            if "pixels" in batch.schema.names:
                flat = batch.column("pixels").storage.flatten().to_numpy()
                part = batch.drop_columns(["pixels"]).to_pylist()
                rows += [{"pixels": flat[k * PIXELS_BYTES : (k + 1) * PIXELS_BYTES].tobytes(), **r}
                         for k, r in enumerate(part)]
                columns["pixels"] = (torch.uint8, PIXELS_SHAPE)
            else:
                rows += batch.to_pylist()
                columns["features"] = (torch.float32, (TABULAR_COLUMNS,))
        return cls(rows, columns)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        row = self.rows[index]
        out = dict(row)
        for name, (dtype, shape) in self.tensor_columns.items():
            value = row[name]
            if isinstance(value, bytes):
                out[name] = torch.frombuffer(bytearray(value), dtype=dtype).view(shape)
            else:
                out[name] = torch.tensor(value, dtype=dtype).view(shape)
        return out


@dataclass(frozen=True)
class Workload:
    """One benchmark workload: the dataset, how it is batched, and a one-line description."""

    name: str
    dataset: Dataset[Any]
    batch_size: int
    collate_fn: Callable[[list[Any]], Any] | None
    description: str
    pin_memory: bool = False
    device: str | None = None  # set: the consumer copies each batch there and synchronizes

    @property
    def samples(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]


def make_workload(name: str, *, seed: int, quick: bool, batch_size: int | None = None) -> Workload:
    """Build workload ``name``; raises ``WorkloadUnavailable`` when it cannot run here."""
    if name not in SIZES:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    full, small, default_batch = SIZES[name]
    n = small if quick else full
    batch = batch_size or default_batch
    shape = "x".join(map(str, IMAGE_SHAPE))
    if name == "image":
        return Workload(name, ImagePoolDataset(n, seed), batch, None,
                        f"{n} x {shape} uint8 (a pool of {POOL_SIZE} images)")
    if name == "pinned":
        if not torch.cuda.is_available():
            raise WorkloadUnavailable("no CUDA")
        desc = (f"{n} x {shape} uint8 (a pool of {POOL_SIZE} images), pin_memory=True, "
                f".to({DEVICE!r}) + synchronize; GB/s = H2D")
        return Workload(name, ImagePoolDataset(n, seed), batch, None, desc, True, DEVICE)
    if name == "tabular":
        desc = f"{n} rows x {TABULAR_COLUMNS} float32"
        return Workload(name, TabularDataset(n, seed), batch, None, desc)
    if name == "null":
        return Workload(name, NullDataset(n), batch, None, f"{n} x one preallocated float32")
    if name in ("arrow", "arrow-list"):
        from shmloader.arrow import ArrowDataset

        path = arrow_file("tabular", n, seed)
        desc = f"{n} rows: 64 float32 + int64 + string"
        if name == "arrow":
            return Workload(name, ArrowDataset(path), batch, None, f"{desc}, ArrowDataset")
        return Workload(name, PyRowsDataset.from_arrow(path), batch, None,
                        f"{desc}, Python list of dicts")
    if name == "ragged":
        lo, hi = RAGGED_SIDE
        desc = f"{n} x 3x[{lo}..{hi}]x[{lo}..{hi}] uint8, padded"
        return Workload(name, RaggedImageDataset(n, seed), batch, pad_collate, desc)
    if not pillow_available():
        raise WorkloadUnavailable("Pillow not installed")
    desc = f"{n} JPEGs 3x{JPEG_SIDE}x{JPEG_SIDE} decoded per sample"
    return Workload(name, JpegDataset(n, seed), batch, None, desc)
