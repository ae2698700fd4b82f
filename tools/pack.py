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
  ``.npy`` files become columns named by their stems (two with the same stem are an error); a
  big-endian array is byte-swapped; a 0-d array (no rows) is an error.
- Tables (Parquet, CSV, Arrow IPC file or stream, Feather v1; suffixes in any case): a
  dictionary (categorical) column is decoded to its values; a date, time, timestamp or duration
  column is stored as int64 in its unit (days or milliseconds since 1970-01-01 for dates, the
  unit since midnight for times, since 1970-01-01 UTC for timestamps), with a note on stderr
  naming the column and the unit. ArrowDataset reads neither type, and both only inside other
  types (a struct field, a list's values) are refused naming the column. Sources whose schemas
  differ only in the nullability of a column are unified (the column is declared not null only
  if every source declares it so); duplicate column names are refused.

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

UNIT_WORDS = {"s": "seconds", "ms": "milliseconds", "us": "microseconds", "ns": "nanoseconds"}
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
    values = np.ascontiguousarray(values, dtype=values.dtype.newbyteorder("="))  # native order
    if values.ndim == 1:
        return pa.array(values)
    row = values.shape[1:]
    flat = pa.array(values.reshape(-1))
    if len(row) == 1:
        return pa.FixedSizeListArray.from_arrays(flat, row[0])
    storage = pa.FixedSizeListArray.from_arrays(flat, int(np.prod(row)))
    return pa.ExtensionArray.from_storage(pa.fixed_shape_tensor(flat.type, list(row)), storage)


def numpy_batches(paths: Sequence[Path], rows: int) -> tuple[int, Iterator[pa.RecordBatch]]:
    """``.npy`` files (one column each, named by the stem) or one ``.npz`` (one column per
    array); every array needs at least one dimension, its rows."""
    arrays: dict[str, np.ndarray] = {}
    origin: dict[str, str] = {}
    for p in paths:
        if p.suffix.lower() == ".npz":
            with np.load(p) as archive:
                for k in archive.files:
                    arrays[k], origin[k] = archive[k], f"array {k!r} of {p}"
        else:
            if p.stem in origin:
                raise PackError(f"{origin[p.stem]} and {p} would both be column {p.stem!r}; "
                                f"rename one of the files (the column is named by the stem)")
            arrays[p.stem], origin[p.stem] = np.load(p, mmap_mode="r"), str(p)
    scalars = [origin[k] for k, v in arrays.items() if v.ndim == 0]
    if scalars:
        raise PackError(f"{', '.join(scalars)}: a 0-d array (a single value, no rows); every "
                        f"column needs one row per item, e.g. np.atleast_1d(value)")
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


def _kind(p: Path) -> str:
    """``parquet``, ``csv``, ``tsv`` or ``arrow`` (IPC file or stream, Feather v1: by magic)."""
    name = p.name.lower()
    if name.endswith((".parquet", ".pq")):
        return "parquet"
    if name.endswith((".csv", ".csv.gz", ".csv.bz2")):
        return "csv"
    if name.endswith((".tsv", ".tsv.gz", ".tsv.bz2")):
        return "tsv"
    return "arrow"


def declared_schema(p: Path) -> pa.Schema | None:
    """The schema ``p`` declares without reading its rows, or None (CSV, Feather v1: unknown)."""
    import pyarrow.parquet as pq

    kind = _kind(p)
    if kind == "parquet":
        return pq.read_schema(p)
    if kind != "arrow":
        return None
    with pa.memory_map(str(p)) as source:
        head = source.read(6)
        source.seek(0)
        if head == b"ARROW1":
            return pa.ipc.open_file(source).schema
        if head.startswith(b"FEA1"):
            return None
        return pa.ipc.open_stream(source).schema


def table_batches(paths: Sequence[Path], rows: int) -> tuple[int | None, Iterator[pa.RecordBatch]]:
    """Parquet, CSV or Arrow (file or stream, compressed or not; Feather v1) sources,
    concatenated."""
    import pyarrow.csv as pcsv
    import pyarrow.feather as feather
    import pyarrow.parquet as pq

    total: int | None = 0
    for p in paths:
        if _kind(p) == "parquet":
            total = None if total is None else total + pq.ParquetFile(p).metadata.num_rows
        else:
            total = None

    def one(p: Path) -> Iterator[pa.RecordBatch]:
        kind = _kind(p)
        if kind == "parquet":
            yield from pq.ParquetFile(p).iter_batches(batch_size=rows)
        elif kind in ("csv", "tsv"):
            delimiter = "\t" if kind == "tsv" else ","
            yield from pcsv.open_csv(p, parse_options=pcsv.ParseOptions(delimiter=delimiter))
        else:
            with pa.memory_map(str(p)) as source:
                head = source.read(6)
                source.seek(0)
                if head.startswith(b"FEA1"):  # Feather v1: no IPC reader; read it whole
                    yield from feather.read_table(source).to_batches(max_chunksize=rows)
                    return
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


def open_sources(paths: Sequence[Path], rows: int) -> tuple[
    int | None, Iterator[pa.RecordBatch], dict[bytes, bytes], list[pa.Schema | None] | None
]:
    """The record batches of ``paths`` (one kind of source), their row count if known, the
    schema metadata to add, and (several table sources) each source's declared schema, for
    unifying nullability (None: the first batch's schema stands)."""
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise PackError(f"no such file or folder: {', '.join(missing)}")
    if len(paths) == 1 and paths[0].is_dir():
        total, batches, classes = image_folder_batches(paths[0], rows)
        return total, batches, {b"classes": classes}, None
    if any(p.is_dir() for p in paths):
        raise PackError("an image folder must be the only source")
    suffixes = [p.suffix.lower() for p in paths]
    if all(s in (".npy", ".npz") for s in suffixes):
        if ".npz" in suffixes and len(paths) > 1:
            raise PackError("give one .npz, or .npy files only")
        total, batches = numpy_batches(paths, rows)
        return total, batches, {}, None
    if any(s in (".npy", ".npz") for s in suffixes):
        raise PackError("NumPy arrays cannot be mixed with table sources")
    t, batches = table_batches(paths, rows)
    return t, batches, {}, [declared_schema(p) for p in paths] if len(paths) > 1 else None


# -- storable types -------------------------------------------------------------------------------


def _unit_words(t: pa.DataType) -> str:
    """What the int64 a date, time, timestamp or duration column becomes counts."""
    if pa.types.is_date32(t):
        return "days since 1970-01-01"
    if pa.types.is_date64(t):
        return "milliseconds since 1970-01-01"
    unit = UNIT_WORDS[t.unit]
    if pa.types.is_time(t):
        return f"{unit} since midnight"
    if pa.types.is_timestamp(t):
        return f"{unit} since 1970-01-01 00:00 UTC"
    return unit  # duration


def _is_temporal(t: pa.DataType) -> bool:
    return bool(pa.types.is_date(t) or pa.types.is_time(t) or pa.types.is_timestamp(t)
                or pa.types.is_duration(t))


def _needs_conversion(t: pa.DataType) -> bool:
    return bool(pa.types.is_dictionary(t) or _is_temporal(t))


def _nested_conversion(t: pa.DataType) -> pa.DataType | None:
    """A dictionary or temporal type anywhere inside ``t`` (not ``t`` itself), or None."""
    if isinstance(t, pa.ExtensionType):
        t = t.storage_type
    for i in range(t.num_fields):
        child = t.field(i).type
        if _needs_conversion(child):
            return child
        inner = _nested_conversion(child)
        if inner is not None:
            return inner
    return None


def _converter(name: str, t: pa.DataType, notes: list[str]) -> Any:
    """The function turning column ``name`` of type ``t`` into a type ArrowDataset reads (None
    if it already is one); appends a note for every column stored as int64."""
    if pa.types.is_dictionary(t):
        inner = _converter(name, t.value_type, notes)
        return lambda a: (a.dictionary_decode() if inner is None else inner(a.dictionary_decode()))
    if _is_temporal(t):
        physical = pa.int32() if t.bit_width == 32 else pa.int64()
        notes.append(f"column {name!r} ({t}) is stored as int64: {_unit_words(t)}")
        return lambda a: a.view(physical).cast(pa.int64())
    inner_type = _nested_conversion(t)
    if inner_type is not None:
        raise PackError(
            f"column {name!r} has type {t}: pack decodes dictionaries and stores dates and times "
            f"as int64 only in top-level columns, not inside a {t}; cast {inner_type} to a "
            f"plain type before packing (pyarrow Table.cast)"
        )
    return None


class Storable:
    """Decodes dictionary columns and stores temporal ones as int64 (module docstring), batch by
    batch, printing a note on ``stream`` the first time a column is stored as int64. Built from
    the first batch's schema, whose column names must be distinct."""

    def __init__(self, schema: pa.Schema, source: str, stream: TextIO | None = None) -> None:
        twice = sorted({n for n in schema.names if schema.names.count(n) > 1})
        if twice:
            raise PackError(
                f"{source}: column {', '.join(map(repr, twice))} appears more than once; "
                f"ArrowDataset needs distinct column names: rename them (the CSV header, or "
                f"pyarrow Table.rename_columns) and pack again"
            )
        self.stream = sys.stderr if stream is None else stream
        self._converters: dict[tuple[str, pa.DataType], Any] = {}
        for f in schema:
            self._converter(f.name, f.type)  # refuse nested ones before writing anything

    def _converter(self, name: str, t: pa.DataType) -> Any:
        key = (name, t)
        if key not in self._converters:
            notes: list[str] = []
            self._converters[key] = _converter(name, t, notes)
            for note in notes:
                print(f"pack: note: {note}", file=self.stream)
        return self._converters[key]

    def __call__(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        converters = [self._converter(f.name, f.type) for f in batch.schema]
        if all(c is None for c in converters):
            return batch
        columns = [col if c is None else c(col)
                   for c, col in zip(converters, batch.columns, strict=True)]
        return pa.RecordBatch.from_arrays(columns, names=batch.schema.names)


def _unify(schema: pa.Schema, declared: list[pa.Schema | None] | None) -> pa.Schema:
    """``schema`` with each top-level column declared not null only if every source says so."""
    if declared is None:
        return schema
    fields = []
    for f in schema:
        strict = all(d is not None and d.get_field_index(f.name) >= 0
                     and not d.field(f.name).nullable for d in declared)
        fields.append(f.with_nullable(not strict))
    return pa.schema(fields, metadata=schema.metadata)


def _conform(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    """``batch`` under ``schema`` when they differ at most in top-level nullability."""
    if batch.schema.equals(schema, check_metadata=False):
        return batch
    if batch.schema.names != schema.names or any(
        a.type != b.type for a, b in zip(batch.schema, schema, strict=True)
    ):
        raise PackError(f"sources differ in schema: {schema} versus {batch.schema}")
    for f, col in zip(schema, batch.columns, strict=True):
        if not f.nullable and col.null_count:
            raise PackError(f"column {f.name!r} holds nulls, but the sources declare it not null")
    return pa.RecordBatch.from_arrays(batch.columns, schema=schema)


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
    total, batches, metadata, declared = open_sources(sources, rows)
    bar = bar or Bar(total)
    if bar.total is None:
        bar.total = total
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    done = 0
    writer: pa.ipc.RecordBatchFileWriter | None = None
    schema: pa.Schema | None = None
    storable: Storable | None = None
    try:
        with pa.OSFile(str(tmp), "wb") as sink:
            for batch in _rechunk(batches, rows, int(max_mib * 2**20)):
                if storable is None:
                    storable = Storable(batch.schema, ", ".join(map(str, sources)))
                batch = storable(batch)
                if writer is None:
                    first = _unify(batch.schema, declared)
                    schema = first.with_metadata({**(first.metadata or {}), **metadata})
                    writer = pa.ipc.new_file(sink, schema)
                assert schema is not None
                batch = _conform(batch, schema)
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
