"""pack: convert data into the Arrow IPC file ``shmloader.arrow.ArrowDataset`` memory-maps.

    python -m tools.pack train.parquet -o train.arrow            # Parquet (several: concatenated)
    python -m tools.pack rows.csv -o rows.arrow                  # CSV, types inferred by pyarrow
    python -m tools.pack x.npy y.npy -o xy.arrow                 # one column per .npy (its stem)
    python -m tools.pack arrays.npz -o arrays.arrow              # one column per array
    python -m tools.pack images/ -o images.arrow                 # ImageFolder: images/<class>/*.jpg
    python -m tools.pack cache-00000.arrow -o plain.arrow        # IPC stream or compressed -> plain

The output is always an uncompressed Arrow IPC file written in record batches of at most
``--batch-rows`` rows and about ``--batch-mib`` MiB (so a reader never needs one huge array), with
a progress bar on stderr; at the end it prints the rows, the bytes and the schema.

Conversions:
- NumPy: a 1-D array is a plain column; rows of shape ``(n,)`` become ``fixed_size_list<n>``;
  rows of 2 or more dimensions become the ``arrow.fixed_shape_tensor`` extension type.
  ``.npy`` files are memory-mapped and read one chunk at a time.
- Image folder (torchvision's ImageFolder layout): columns ``image`` (the encoded file bytes,
  never decoded here), ``label`` (int64: the index of the class folder, folders sorted) and
  ``path`` (relative to the folder); the class names are in the schema metadata under
  ``classes`` (JSON). Decode in the workers: ``ArrowDataset(..., transform=DecodeImage())``.

Invariant: the output appears under its final name only when complete (written to a temporary
name beside it, then renamed), so a crashed pack never leaves a truncated dataset behind.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import pyarrow as pa

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
ARROW_SUFFIXES = (".arrow", ".feather", ".ipc", ".stream")
PROGRESS_INTERVAL_S = 0.1


class PackError(ValueError):
    """A source pack cannot convert; the message names it and says why."""


class Bar:
    """A progress bar on stderr, redrawn in place on a TTY (silent otherwise)."""

    def __init__(self, total: int | None, stream: TextIO = sys.stderr) -> None:
        self.total, self.stream, self.next = total, stream, 0.0
        self.tty = stream.isatty()

    def update(self, rows: int, nbytes: int, force: bool = False) -> None:
        now = time.monotonic()
        if not self.tty or (now < self.next and not force):
            return
        self.next = now + PROGRESS_INTERVAL_S
        if self.total:
            done = min(rows / self.total, 1.0)
            bar = "#" * int(done * 30)
            head = f"[{bar:<30}] {done:4.0%} {rows:,}/{self.total:,} rows"
        else:
            head = f"{rows:,} rows"
        self.stream.write(f"\r\x1b[K{head}, {nbytes / 2**20:,.1f} MiB")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


# -- sources --------------------------------------------------------------------------------------


def _array_column(values: np.ndarray) -> pa.Array:
    """A NumPy chunk (rows first) as an Arrow column (module docstring: conversions)."""
    values = np.ascontiguousarray(values)
    if values.ndim == 1:
        return pa.array(values)
    row = values.shape[1:]
    flat = pa.array(values.reshape(-1))
    if len(row) == 1:
        return pa.FixedSizeListArray.from_arrays(flat, row[0])
    storage = pa.FixedSizeListArray.from_arrays(flat, int(np.prod(row)))
    return pa.ExtensionArray.from_storage(pa.fixed_shape_tensor(flat.type, list(row)), storage)


def numpy_batches(paths: Sequence[Path], rows: int) -> tuple[int, Iterator[pa.RecordBatch]]:
    """``.npy`` files (one column each) or one ``.npz`` (one column per array)."""
    arrays: dict[str, np.ndarray] = {}
    for p in paths:
        if p.suffix == ".npz":
            with np.load(p) as archive:
                arrays.update({k: archive[k] for k in archive.files})
        else:
            arrays[p.stem] = np.load(p, mmap_mode="r")
    lengths = {k: len(v) for k, v in arrays.items()}
    if len(set(lengths.values())) > 1:
        raise PackError(f"arrays differ in length: {lengths}; every column needs the same rows")
    total = next(iter(lengths.values()), 0)

    def gen() -> Iterator[pa.RecordBatch]:
        for start in range(0, total, rows):
            cols = {k: _array_column(v[start : start + rows]) for k, v in arrays.items()}
            yield pa.RecordBatch.from_pydict(cols)

    return total, gen()


def image_folder_batches(root: Path, rows: int) -> tuple[int, Iterator[pa.RecordBatch], bytes]:
    """ImageFolder: ``root/<class>/<file>`` with an image extension."""
    classes = sorted(d.name for d in root.iterdir() if d.is_dir())
    if not classes:
        raise PackError(f"{root}: no class folders; expected {root}/<class>/<image files>")
    files = [(path, label) for label, c in enumerate(classes)
             for path in sorted((root / c).rglob("*")) if path.suffix.lower() in IMAGE_EXTENSIONS]
    if not files:
        raise PackError(f"{root}: no image files ({', '.join(IMAGE_EXTENSIONS)}) in {classes}")
    schema = pa.schema([("image", pa.binary()), ("label", pa.int64()), ("path", pa.string())])

    def gen() -> Iterator[pa.RecordBatch]:
        for start in range(0, len(files), rows):
            part = files[start : start + rows]
            yield pa.RecordBatch.from_pydict({
                "image": [p.read_bytes() for p, _ in part],
                "label": [label for _, label in part],
                "path": [str(p.relative_to(root)) for p, _ in part],
            }, schema=schema)

    return len(files), gen(), json.dumps(classes).encode()


def table_batches(paths: Sequence[Path], rows: int) -> tuple[int | None, Iterator[pa.RecordBatch]]:
    """Parquet, CSV or Arrow (file or stream, compressed or not) sources, concatenated."""
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    total: int | None = 0
    for p in paths:
        if p.suffix in (".parquet", ".pq"):
            total = None if total is None else total + pq.ParquetFile(p).metadata.num_rows
        else:
            total = None

    def one(p: Path) -> Iterator[pa.RecordBatch]:
        if p.suffix in (".parquet", ".pq"):
            yield from pq.ParquetFile(p).iter_batches(batch_size=rows)
        elif p.suffix in (".csv", ".tsv") or p.name.endswith((".csv.gz", ".csv.bz2")):
            delimiter = "\t" if p.suffix == ".tsv" else ","
            yield from pcsv.open_csv(p, parse_options=pcsv.ParseOptions(delimiter=delimiter))
        else:
            with pa.memory_map(str(p)) as source:
                head = source.read(6)
                source.seek(0)
                reader: Any = (pa.ipc.open_file(source) if head == b"ARROW1"
                               else pa.ipc.open_stream(source))
                if head == b"ARROW1":
                    for i in range(reader.num_record_batches):
                        yield reader.get_batch(i)
                else:
                    yield from reader

    def gen() -> Iterator[pa.RecordBatch]:
        for p in paths:
            yield from one(p)

    return total, gen()


def open_sources(paths: Sequence[Path], rows: int) -> tuple[int | None, Iterator[pa.RecordBatch],
                                                             dict[bytes, bytes]]:
    """The record batches of ``paths`` (one kind of source), their row count if known, and the
    schema metadata to add."""
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise PackError(f"no such file or folder: {', '.join(missing)}")
    if len(paths) == 1 and paths[0].is_dir():
        total, batches, classes = image_folder_batches(paths[0], rows)
        return total, batches, {b"classes": classes}
    if any(p.is_dir() for p in paths):
        raise PackError("an image folder must be the only source")
    if all(p.suffix in (".npy", ".npz") for p in paths):
        if any(p.suffix == ".npz" for p in paths) and len(paths) > 1:
            raise PackError("give one .npz, or .npy files only")
        total, batches = numpy_batches(paths, rows)
        return total, batches, {}
    if any(p.suffix in (".npy", ".npz") for p in paths):
        raise PackError("NumPy arrays cannot be mixed with table sources")
    t, batches = table_batches(paths, rows)
    return t, batches, {}


# -- writing --------------------------------------------------------------------------------------


def _rechunk(batches: Iterator[pa.RecordBatch], rows: int, max_bytes: int,
             ) -> Iterator[pa.RecordBatch]:
    """Split batches to at most ``rows`` rows and about ``max_bytes`` bytes."""
    for batch in batches:
        if not batch.num_rows:
            continue
        per_row = max(batch.nbytes // batch.num_rows, 1)
        step = max(1, min(rows, max_bytes // per_row))
        for start in range(0, batch.num_rows, step):
            yield batch.slice(start, step)


def pack(sources: Sequence[Path], out: Path, *, rows: int = 65536, max_mib: float = 64.0,
         bar: Bar | None = None) -> tuple[int, int, pa.Schema]:
    """Write ``sources`` into ``out``; returns (rows, bytes of the file, schema)."""
    total, batches, metadata = open_sources(sources, rows)
    bar = bar or Bar(total)
    if bar.total is None:
        bar.total = total
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    done = 0
    writer: pa.ipc.RecordBatchFileWriter | None = None
    schema: pa.Schema | None = None
    try:
        with pa.OSFile(str(tmp), "wb") as sink:
            for batch in _rechunk(batches, rows, int(max_mib * 2**20)):
                if writer is None:
                    schema = batch.schema.with_metadata({**(batch.schema.metadata or {}),
                                                         **metadata})
                    writer = pa.ipc.new_file(sink, schema)
                elif not batch.schema.equals(schema, check_metadata=False):
                    raise PackError(f"sources differ in schema: {schema} versus {batch.schema}")
                writer.write_batch(batch)
                done += batch.num_rows
                bar.update(done, sink.tell())
            if writer is None:
                raise PackError(f"no rows in {', '.join(map(str, sources))}")
            writer.close()
        os.replace(tmp, out)
    finally:
        bar.close()
        if tmp.exists():
            tmp.unlink()
    assert schema is not None
    return done, out.stat().st_size, schema


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.pack", description=__doc__.split("\n")[0])
    p.add_argument("sources", nargs="+", type=Path,
                   help="Parquet, CSV, .npy/.npz, Arrow files, or one image folder")
    p.add_argument("-o", "--out", type=Path, required=True, help="the Arrow IPC file to write")
    p.add_argument("--batch-rows", type=int, default=65536, help="rows per record batch at most")
    p.add_argument("--batch-mib", type=float, default=64.0, help="MiB per record batch, about")
    args = p.parse_args(argv)
    if args.batch_rows < 1 or args.batch_mib <= 0:
        p.error("--batch-rows and --batch-mib must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        rows, nbytes, schema = pack(args.sources, args.out, rows=args.batch_rows,
                                    max_mib=args.batch_mib)
    except (PackError, pa.ArrowException, OSError) as exc:
        print(f"pack: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}: {rows:,} rows, {nbytes:,} bytes ({nbytes / 2**20:,.1f} MiB)")
    print(schema.to_string(show_schema_metadata=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
