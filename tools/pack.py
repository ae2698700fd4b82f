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
  ``.npy`` files are memory-mapped and read one chunk at a time; they become columns named by
  their stems (two with the same stem are an error); a big-endian array is byte-swapped; a 0-d
  array (no rows) is an error. Pack reads arrays of bool, integers and floats (rows of any shape
  holding at least one value) and 1-D arrays of str, bytes, datetime64 and timedelta64 (in a
  unit Arrow has: s, ms, us, ns; days for datetime64); any other dtype or shape (complex,
  structured, object, float128, rows of shape ``(0,)``, 2-D strings) is refused naming the file,
  the dtype and the shape, before anything is written. Bool rows (2 or more dimensions) are
  stored as uint8 (0/1), with a note on stderr naming the column: ArrowDataset reads bool only
  as a plain column, and pack writes no NumPy column ArrowDataset refuses; a 1-D bool array stays a
  bool column.
- Image folder (torchvision's ImageFolder layout): columns ``image`` (the encoded file bytes,
  never decoded here), ``label`` (int64: the index of the class folder, folders sorted) and
  ``path`` (relative to the folder); the class names are in the schema metadata under
  ``classes`` (JSON). Decode in the workers: ``ArrowDataset(..., transform=DecodeImage())``.
  The files are read into record batches of at most ``--batch-rows`` images and ``--batch-mib``
  MiB of file bytes (at least one image a batch), so memory stays bounded and no ``image``
  array reaches the 2 GiB a binary column holds; a single image file over 2 GiB - 1 bytes is
  refused naming it.
- Tables (Parquet, CSV, Arrow IPC file or stream, Feather v1; suffixes in any case): a
  dictionary (categorical) column is decoded to its values; a date, time, timestamp or duration
  column is stored as int64 in its unit (days or milliseconds since 1970-01-01 for dates, the
  unit since midnight for times, since 1970-01-01 UTC for timestamps), with a note on stderr
  naming the column and the unit. ArrowDataset reads neither type, and both only inside other
  types (a struct field, a list's values) are refused naming the column. Sources whose schemas
  differ only in the nullability of a column are unified (the column is declared not null only
  if every source declares it so), and so are sources differing only in a column's dictionary
  encoding (decoded, both are its value type); sources differing in a column's own type
  (int64 versus int32, timestamp[ms] versus timestamp[us], date32 versus date64: stored as int64
  in their own units they would mix units silently) are refused naming both files, the column
  and both types: cast one source first. Duplicate column names are refused.
- CSV (and TSV) files are streamed in blocks (memory stays bounded); pyarrow infers each
  column's type from the first block only. A later value that does not fit (``x`` in a column of
  integers) is refused naming the file, the column and the value, with the fix: give the
  column's type with ``--csv-types col=type[,col=type]`` (pyarrow type names: ``string``,
  ``int64``, ``float64``, ``bool``, ``timestamp[ms]``...; passed to pyarrow's
  ``ConvertOptions(column_types=...)`` for every CSV source). Pack does not guess again by
  re-reading the file: a value that does not fit is as often a data error (a stray header, a
  missing-value marker) as a string column, and the option makes the choice explicit.
- Sources are told apart by suffix: ``.parquet``/``.pq``; ``.csv``/``.tsv`` (also ``.gz``,
  ``.bz2``); ``.arrow``/``.arrows``/``.feather``/``.ipc``/``.stream`` (IPC file or stream, or
  Feather v1, by magic); ``.npy``/``.npz``; or a folder (images). A file with any other suffix
  is read by its first bytes if they are Parquet's, Arrow's (IPC file or stream), Feather v1's,
  NumPy's or a zip's (``.npz``), since ArrowDataset advises packing such a file whatever its
  name; otherwise (a text file: CSV or JSON lines under another suffix) it is refused naming
  the suffixes pack reads, never guessed.

Invariant: the output appears under its final name only when complete (written to a temporary
name beside it, then renamed), so a crashed pack never leaves a truncated dataset behind.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import pyarrow as pa

UNIT_WORDS = {"s": "seconds", "ms": "milliseconds", "us": "microseconds", "ns": "nanoseconds"}
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
PARQUET_SUFFIXES = (".parquet", ".pq")
CSV_SUFFIXES = (".csv", ".csv.gz", ".csv.bz2")
TSV_SUFFIXES = (".tsv", ".tsv.gz", ".tsv.bz2")
ARROW_SUFFIXES = (".arrow", ".arrows", ".feather", ".ipc", ".stream")
SUFFIX_KINDS = (
    (PARQUET_SUFFIXES, "parquet"),
    (CSV_SUFFIXES, "csv"),
    (TSV_SUFFIXES, "tsv"),
    (ARROW_SUFFIXES, "arrow"),
    ((".npy",), "npy"),
    ((".npz",), "npz"),
)
MAGIC_KINDS = (  # a file under another suffix, by its first bytes
    (b"PAR1", "parquet"),
    (b"ARROW1", "arrow"),
    (b"FEA1", "arrow"),  # Feather v1
    (b"\xff\xff\xff\xff", "arrow"),  # an IPC stream's first continuation marker
    (b"\x93NUMPY", "npy"),
    (b"PK\x03\x04", "npz"),  # a zip archive
)
READS = (
    "pack reads .parquet/.pq, .csv/.tsv (also .gz, .bz2), .arrow/.arrows/.feather/.ipc/.stream "
    "(Arrow IPC file or stream, Feather), .npy/.npz, or one image folder "
    "(<folder>/<class>/<images>)"
)
NUMPY_READS = (
    "pack reads NumPy arrays of bool, integers and floats (rows of any shape, at least one value "
    "a row) and 1-D arrays of str, bytes, datetime64 and timedelta64"
)
NUMPY_FIX = (
    "convert it first, e.g. np.save(path, a.astype(np.float32)); a complex array as two arrays "
    "(a.real, a.imag), a structured array as one .npy per field (a['name'])"
)
MAX_BINARY_BYTES = 2**31 - 1  # the values a pa.binary() array holds: 32-bit offsets
CSV_BLOCK_BYTES = 1 << 20  # pyarrow's default; column types are inferred from the first block
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
    """A NumPy chunk (rows first) as an Arrow column (module docstring: conversions); bool rows
    become uint8 (0/1), since ArrowDataset reads bool only as a plain column."""
    values = np.ascontiguousarray(values, dtype=values.dtype.newbyteorder("="))  # native order
    if values.ndim == 1:
        return pa.array(values)
    if values.dtype == np.bool_:
        values = values.view(np.uint8)
    row = values.shape[1:]
    flat = pa.array(values.reshape(-1))
    if len(row) == 1:
        return pa.FixedSizeListArray.from_arrays(flat, row[0])
    storage = pa.FixedSizeListArray.from_arrays(flat, int(np.prod(row)))
    return pa.ExtensionArray.from_storage(pa.fixed_shape_tensor(flat.type, list(row)), storage)


def _npy_header(f: Any, origin: str) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype an open ``.npy`` file declares, read from its header only (loading an
    object array would fail, or unpickle it)."""
    fmt = np.lib.format
    try:
        version = fmt.read_magic(f)
        header = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
        shape, _, dtype = header(f)
    except ValueError as exc:
        raise PackError(f"{origin}: not a NumPy .npy array ({exc}); {NUMPY_READS}") from exc
    return tuple(shape), dtype


def _check_array(origin: str, shape: tuple[int, ...], dtype: np.dtype) -> None:
    """Refuse an array pack cannot store as a column ArrowDataset reads (``NUMPY_READS``)."""
    if dtype.fields is None and dtype.kind in "biuf" and dtype.itemsize <= 8:  # no float128
        if len(shape) > 1 and 0 in shape[1:]:
            raise PackError(
                f"{origin}: rows of shape {shape[1:]} (dtype {dtype}) hold no values; {NUMPY_READS}"
                f": drop the empty column, or reshape the array"
            )
        return
    units = ("s", "ms", "us", "ns", *("D" if dtype.kind == "M" else ()))  # Arrow's
    if dtype.kind in "Mm" and np.datetime_data(dtype) not in [(u, 1) for u in units]:
        raise PackError(
            f"{origin}: dtype {dtype}: Arrow has no type for that unit; {NUMPY_READS} in units of "
            f"{', '.join(units)}: convert it first, e.g. a.astype('{dtype.kind}8[s]')"
        )
    if dtype.fields is None and dtype.kind in "USMm" and len(shape) <= 1:
        return
    raise PackError(f"{origin}: dtype {dtype} of shape {shape}: {NUMPY_READS}; {NUMPY_FIX}")


def numpy_batches(
    paths: Sequence[Path], rows: int, stream: TextIO | None = None
) -> tuple[int, Iterator[pa.RecordBatch]]:
    """``.npy`` files (one column each, named by the stem) or one ``.npz`` (one column per
    array); every array needs at least one dimension, its rows, and a dtype and shape pack
    stores (``_check_array``: checked from the headers before anything is read). A note on
    ``stream`` (stderr) names each bool column stored as uint8."""
    arrays: dict[str, np.ndarray] = {}
    origin: dict[str, str] = {}
    for p in paths:
        if _kind(p) == "npz":
            with np.load(p) as archive:
                members = set(archive.zip.namelist())
                for k in archive.files:
                    where = f"array {k!r} of {p}"
                    with archive.zip.open(f"{k}.npy" if f"{k}.npy" in members else k) as f:
                        _check_array(where, *_npy_header(f, where))
                    arrays[k], origin[k] = archive[k], where
        else:
            if p.stem in origin:
                raise PackError(
                    f"{origin[p.stem]} and {p} would both be column {p.stem!r}; "
                    f"rename one of the files (the column is named by the stem)"
                )
            with open(p, "rb") as f:
                _check_array(str(p), *_npy_header(f, str(p)))
            arrays[p.stem], origin[p.stem] = np.load(p, mmap_mode="r"), str(p)
    scalars = [origin[k] for k, v in arrays.items() if v.ndim == 0]
    if scalars:
        raise PackError(
            f"{', '.join(scalars)}: a 0-d array (a single value, no rows); every "
            f"column needs one row per item, e.g. np.atleast_1d(value)"
        )
    lengths = {k: len(v) for k, v in arrays.items()}
    if len(set(lengths.values())) > 1:
        raise PackError(f"arrays differ in length: {lengths}; every column needs the same rows")
    total = next(iter(lengths.values()), 0)
    for k, v in arrays.items():
        if v.dtype == np.bool_ and v.ndim > 1:
            print(
                f"pack: note: column {k!r} (bool rows of shape {v.shape[1:]}) is stored as uint8 "
                f"(0/1): ArrowDataset reads bool only as a plain column",
                file=sys.stderr if stream is None else stream,
            )

    def column(k: str, start: int) -> pa.Array:
        try:
            return _array_column(arrays[k][start : start + rows])
        except pa.ArrowException as exc:  # e.g. a datetime64 unit Arrow has no type for
            raise PackError(f"{origin[k]}: dtype {arrays[k].dtype}: {exc}; {NUMPY_READS}") from exc

    def gen() -> Iterator[pa.RecordBatch]:
        for start in range(0, total, rows):
            yield pa.RecordBatch.from_pydict({k: column(k, start) for k in arrays})

    return total, gen()


def image_folder_batches(
    root: Path, rows: int, max_bytes: int
) -> tuple[int, Iterator[pa.RecordBatch], bytes]:
    """ImageFolder: ``root/<class>/<file>`` with an image extension, read into record batches of
    at most ``rows`` images and ``max_bytes`` (capped at ``MAX_BINARY_BYTES``) bytes of files,
    at least one image a batch; so pack holds at most one batch and one more file. A file
    over ``MAX_BINARY_BYTES`` (no binary array holds it) is refused naming it."""
    classes = sorted(d.name for d in root.iterdir() if d.is_dir())
    if not classes:
        raise PackError(f"{root}: no class folders; expected {root}/<class>/<image files>")
    files = [
        (path, label)
        for label, c in enumerate(classes)
        for path in sorted((root / c).rglob("*"))
        if path.suffix.lower() in IMAGE_EXTENSIONS
    ]
    if not files:
        raise PackError(f"{root}: no image files ({', '.join(IMAGE_EXTENSIONS)}) in {classes}")
    schema = pa.schema([("image", pa.binary()), ("label", pa.int64()), ("path", pa.string())])
    budget = max(1, min(max_bytes, MAX_BINARY_BYTES))

    def batch(part: list[tuple[Path, int, bytes]]) -> pa.RecordBatch:
        return pa.RecordBatch.from_pydict(
            {
                "image": [data for _, _, data in part],
                "label": [label for _, label, _ in part],
                "path": [str(p.relative_to(root)) for p, _, _ in part],
            },
            schema=schema,
        )

    def gen() -> Iterator[pa.RecordBatch]:
        part: list[tuple[Path, int, bytes]] = []
        held = 0
        for path, label in files:
            size = path.stat().st_size
            if size > MAX_BINARY_BYTES:
                raise PackError(
                    f"{path}: {size:,} bytes, over the {MAX_BINARY_BYTES:,} bytes (2 GiB - 1) a "
                    f"binary column's 32-bit offsets address, so no record batch can hold it; "
                    f"shrink or re-encode the image, or move it out of {root}"
                )
            data = path.read_bytes()
            if part and (len(part) >= rows or held + len(data) > budget):
                yield batch(part)
                part, held = [], 0
            part.append((path, label, data))
            held += len(data)
        if part:
            yield batch(part)

    return len(files), gen(), json.dumps(classes).encode()


def _kind(p: Path) -> str:
    """``parquet``, ``csv``, ``tsv``, ``arrow`` (IPC file or stream, Feather v1: told apart by
    magic when read), ``npy`` or ``npz``, by suffix, or under another suffix by the file's first
    bytes (``MAGIC_KINDS``: ArrowDataset advises packing a Parquet, Feather v1 or NumPy file
    whatever its name); anything else is refused (``READS``) rather than guessed."""
    name = p.name.lower()
    for suffixes, kind in SUFFIX_KINDS:
        if name.endswith(suffixes):
            return kind
    with open(p, "rb") as f:
        head = f.read(8)
    for magic, kind in MAGIC_KINDS:
        if head.startswith(magic):
            return kind
    suffix = "".join(p.suffixes[-2:]) if p.suffix.lower() in (".gz", ".bz2") else p.suffix
    raise PackError(
        f"{p}: unknown suffix {suffix or '(none)'}, and not Parquet, Arrow or NumPy by its first "
        f"bytes; {READS}; rename the file if it holds one of these, or convert it first (e.g. "
        f"JSON lines: pyarrow.json.read_json, then pyarrow.parquet.write_table)"
    )


def declared_schema(p: Path) -> pa.Schema | None:
    """The schema ``p`` declares without reading its rows, or None (CSV, Feather v1: unknown)."""
    import pyarrow.parquet as pq

    kind = _kind(p)
    try:
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
    except pa.ArrowInvalid as exc:
        raise PackError(f"{p}: not a readable {kind} file ({exc}); {READS}") from exc


def _decoded(t: pa.DataType) -> pa.DataType:
    """The type column ``t`` holds once its dictionary is decoded (the encoding is not the data);
    a date or time type stays itself, before it becomes int64 (its unit is the data)."""
    while pa.types.is_dictionary(t):
        t = t.value_type
    return t


def _same_columns(first: Path, a: pa.Schema, p: Path, b: pa.Schema) -> None:
    """Refuse source ``p`` (schema ``b``) unless its columns are those of the ``first`` source
    (schema ``a``) in name, order and type (dictionary encoding and nullability aside: module
    docstring); compared before conversion, as two units both become int64."""
    if a.names != b.names:
        raise PackError(
            f"sources differ in schema: {first} has columns {a.names} but {p} has {b.names}; "
            f"every source needs the same columns in the same order: select or rename them "
            f"(pyarrow Table.select, Table.rename_columns) and pack again"
        )
    for fa, fb in zip(a, b, strict=True):
        ta, tb = _decoded(fa.type), _decoded(fb.type)
        if ta == tb:
            continue
        why, csv = "", ""
        if any(x.name.lower().endswith(CSV_SUFFIXES + TSV_SUFFIXES) for x in (first, p)):
            csv = f"; for a CSV source --csv-types {fa.name}={ta}"
        if _is_temporal(ta) and _is_temporal(tb):
            why = (
                f"pack stores both as int64 in their own units ({_unit_words(ta)} versus "
                f"{_unit_words(tb)}), which one column cannot mix; "
            )
        raise PackError(
            f"sources differ in schema: column {fa.name!r} is {fa.type} in {first} but {fb.type} "
            f"in {p}; {why}cast one source to the other's type first (pyarrow Table.cast{csv}) "
            f"and pack again"
        )


def _csv_error(
    p: Path,
    exc: pa.ArrowInvalid,
    names: list[str] | None,
    inferred: pa.Schema | None,
    csv_types: dict[str, pa.DataType],
) -> PackError:
    """The error for a CSV block pyarrow cannot read, naming the file, and for a value that
    does not fit its column's type, the column and the fix (``--csv-types``)."""
    found = re.match(r"In CSV column #(\d+): (.*)", str(exc), re.DOTALL)
    if found is None or names is None or int(found[1]) >= len(names):
        return PackError(f"{p}: {exc}")
    name, why = names[int(found[1])], found[2]
    if name in csv_types:
        return PackError(
            f"{p}: column {name!r}: {why}, the type --csv-types gives it ({csv_types[name]}); "
            f"give another, e.g. --csv-types {name}=string, and pack again"
        )
    seen = f", where {name!r} looked like {inferred.field(name).type}" if inferred else ""
    return PackError(
        f"{p}: column {name!r}: {why}. pack streams a CSV in blocks of {CSV_BLOCK_BYTES:,} bytes "
        f"and pyarrow infers each column's type from the first block{seen}; give the column's "
        f"type: --csv-types {name}=string (or e.g. {name}=float64; several: "
        f"--csv-types a=string,b=int64) and pack again"
    )


def csv_batches(
    p: Path,
    delimiter: str,
    csv_types: dict[str, pa.DataType],
) -> Iterator[pa.RecordBatch]:
    """The record batches of a CSV (or TSV) file, streamed block by block; a value that does not
    fit the type inferred from the first block (or given by ``csv_types``) is a PackError naming
    the file, the column and the fix (module docstring)."""
    import pyarrow.csv as pcsv

    read = pcsv.ReadOptions(block_size=CSV_BLOCK_BYTES)
    parse = pcsv.ParseOptions(delimiter=delimiter)
    try:
        reader = pcsv.open_csv(
            p,
            read_options=read,
            parse_options=parse,
            convert_options=pcsv.ConvertOptions(column_types=csv_types),
        )
    except pa.ArrowInvalid as exc:  # the first block: only a type --csv-types gives can fail
        try:
            with pcsv.open_csv(p, read_options=read, parse_options=parse) as plain:
                names: list[str] | None = plain.schema.names
        except pa.ArrowInvalid:
            names = None
        raise _csv_error(p, exc, names, None, csv_types) from exc
    with reader:
        unknown = [c for c in csv_types if c not in reader.schema.names]
        if unknown:
            raise PackError(
                f"{p}: --csv-types names column {', '.join(map(repr, unknown))}, which is not "
                f"in its header ({', '.join(reader.schema.names)}); fix the name"
            )
        while True:
            try:
                batch = reader.read_next_batch()
            except StopIteration:
                return
            except pa.ArrowInvalid as exc:
                raise _csv_error(p, exc, reader.schema.names, reader.schema, csv_types) from exc
            yield batch


def table_batches(
    paths: Sequence[Path], rows: int, csv_types: dict[str, pa.DataType] | None = None
) -> tuple[int | None, Iterator[pa.RecordBatch]]:
    """Parquet, CSV or Arrow (file or stream, compressed or not; Feather v1) sources,
    concatenated; each source's columns must be the first one's (``_same_columns``)."""
    import pyarrow.feather as feather
    import pyarrow.parquet as pq

    csv_types = csv_types or {}
    kinds = [_kind(p) for p in paths]
    total: int | None = 0
    for p, kind in zip(paths, kinds, strict=True):
        if kind == "parquet":
            total = None if total is None else total + pq.ParquetFile(p).metadata.num_rows
        else:
            total = None

    def one(p: Path, kind: str) -> Iterator[pa.RecordBatch]:
        if kind == "parquet":
            yield from pq.ParquetFile(p).iter_batches(batch_size=rows)
        elif kind in ("csv", "tsv"):
            yield from csv_batches(p, "\t" if kind == "tsv" else ",", csv_types)
        else:
            with pa.memory_map(str(p)) as source:
                head = source.read(6)
                source.seek(0)
                if head.startswith(b"FEA1"):  # Feather v1: no IPC reader; read it whole
                    yield from feather.read_table(source).to_batches(max_chunksize=rows)
                    return
                reader: Any = (
                    pa.ipc.open_file(source) if head == b"ARROW1" else pa.ipc.open_stream(source)
                )
                if head == b"ARROW1":
                    for i in range(reader.num_record_batches):
                        yield reader.get_batch(i)
                else:
                    yield from reader

    def gen() -> Iterator[pa.RecordBatch]:
        first: tuple[Path, pa.Schema] | None = None
        for p, kind in zip(paths, kinds, strict=True):
            checked = False  # one file's batches share its schema: check its first
            try:
                for batch in one(p, kind):
                    if not checked:
                        if first is None:
                            first = (p, batch.schema)
                        else:
                            _same_columns(*first, p, batch.schema)
                        checked = True
                    yield batch
            except pa.ArrowInvalid as exc:
                raise PackError(f"{p}: not a readable {kind} file ({exc}); {READS}") from exc

    return total, gen()


def open_sources(
    paths: Sequence[Path],
    rows: int,
    max_bytes: int,
    csv_types: dict[str, pa.DataType] | None = None,
) -> tuple[int | None, Iterator[pa.RecordBatch], dict[bytes, bytes], list[pa.Schema | None] | None]:
    """The record batches of ``paths`` (one kind of source), their row count if known, the
    schema metadata to add, and (several table sources) each source's declared schema, for
    unifying nullability (None: the first batch's schema stands). ``max_bytes`` bounds the
    image bytes read into one batch; ``csv_types`` the types of CSV columns (``--csv-types``)."""
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise PackError(f"no such file or folder: {', '.join(missing)}")
    if csv_types and not any(
        not p.is_dir() and p.name.lower().endswith(CSV_SUFFIXES + TSV_SUFFIXES) for p in paths
    ):
        raise PackError("--csv-types applies to CSV and TSV sources, and none is given: drop it")
    if len(paths) == 1 and paths[0].is_dir():
        total, batches, classes = image_folder_batches(paths[0], rows, max_bytes)
        return total, batches, {b"classes": classes}, None
    if any(p.is_dir() for p in paths):
        raise PackError("an image folder must be the only source")
    kinds = [_kind(p) for p in paths]
    if all(k in ("npy", "npz") for k in kinds):
        if "npz" in kinds and len(paths) > 1:
            raise PackError("give one .npz, or .npy files only")
        total, batches = numpy_batches(paths, rows)
        return total, batches, {}, None
    if any(k in ("npy", "npz") for k in kinds):
        raise PackError("NumPy arrays cannot be mixed with table sources")
    t, batches = table_batches(paths, rows, csv_types)
    if len(paths) == 1:
        return t, batches, {}, None
    declared = [declared_schema(p) for p in paths]
    known = [(p, d) for p, d in zip(paths, declared, strict=True) if d is not None]
    for p, d in known[1:]:  # refused before writing; the batches are checked again as read
        _same_columns(*known[0], p, d)
    return t, batches, {}, declared


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
    return bool(
        pa.types.is_date(t)
        or pa.types.is_time(t)
        or pa.types.is_timestamp(t)
        or pa.types.is_duration(t)
    )


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
        return lambda a: a.dictionary_decode() if inner is None else inner(a.dictionary_decode())
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
        self._noted: set[str] = set()  # dictionary<int8, date32> and <int16, date32>: one note
        for f in schema:
            self._converter(f.name, f.type)  # refuse nested ones before writing anything

    def _converter(self, name: str, t: pa.DataType) -> Any:
        key = (name, t)
        if key not in self._converters:
            notes: list[str] = []
            self._converters[key] = _converter(name, t, notes)
            for note in notes:
                if note not in self._noted:
                    self._noted.add(note)
                    print(f"pack: note: {note}", file=self.stream)
        return self._converters[key]

    def __call__(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        converters = [self._converter(f.name, f.type) for f in batch.schema]
        if all(c is None for c in converters):
            return batch
        columns = [
            col if c is None else c(col) for c, col in zip(converters, batch.columns, strict=True)
        ]
        return pa.RecordBatch.from_arrays(columns, names=batch.schema.names)


def _unify(schema: pa.Schema, declared: list[pa.Schema | None] | None) -> pa.Schema:
    """``schema`` with each top-level column declared not null only if every source says so."""
    if declared is None:
        return schema
    fields = []
    for f in schema:
        strict = all(
            d is not None and d.get_field_index(f.name) >= 0 and not d.field(f.name).nullable
            for d in declared
        )
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


def _rechunk(
    batches: Iterator[pa.RecordBatch],
    rows: int,
    max_bytes: int,
) -> Iterator[pa.RecordBatch]:
    """Split batches to at most ``rows`` rows and about ``max_bytes`` bytes."""
    for batch in batches:
        if not batch.num_rows:
            continue
        per_row = max(batch.nbytes // batch.num_rows, 1)
        step = max(1, min(rows, max_bytes // per_row))
        for start in range(0, batch.num_rows, step):
            yield batch.slice(start, step)


def pack(
    sources: Sequence[Path],
    out: Path,
    *,
    rows: int = 65536,
    max_mib: float = 64.0,
    bar: Bar | None = None,
    csv_types: dict[str, pa.DataType] | None = None,
) -> tuple[int, int, pa.Schema]:
    """Write ``sources`` into ``out``; returns (rows, bytes of the file, schema). ``csv_types``:
    the types of CSV columns (``--csv-types``; the others are inferred)."""
    max_bytes = max(1, int(max_mib * 2**20))
    total, batches, metadata, declared = open_sources(sources, rows, max_bytes, csv_types)
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
            for batch in _rechunk(batches, rows, max_bytes):
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


def _csv_types(text: str) -> dict[str, pa.DataType]:
    """``--csv-types``: ``col=type[,col=type]``, types by pyarrow name (``pa.type_for_alias``)."""
    types: dict[str, pa.DataType] = {}
    for item in text.split(","):
        name, sep, alias = (part.strip() for part in item.partition("="))
        if not (name and sep and alias):
            raise argparse.ArgumentTypeError(
                f"{item.strip()!r} is not col=type; e.g. --csv-types label=string,score=float64"
            )
        try:
            types[name] = pa.type_for_alias(alias)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{alias!r} (column {name!r}) is not a pyarrow type name; e.g. string, int64, "
                f"float64, bool, timestamp[ms]"
            ) from None
    return types


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.pack", description=__doc__.split("\n")[0])
    p.add_argument(
        "sources",
        nargs="+",
        type=Path,
        help="Parquet, CSV, .npy/.npz, Arrow files, or one image folder",
    )
    p.add_argument("-o", "--out", type=Path, required=True, help="the Arrow IPC file to write")
    p.add_argument("--batch-rows", type=int, default=65536, help="rows per record batch at most")
    p.add_argument("--batch-mib", type=float, default=64.0, help="MiB per record batch, about")
    p.add_argument(
        "--csv-types",
        type=_csv_types,
        default={},
        metavar="COL=TYPE[,COL=TYPE]",
        help="types of CSV columns (pyarrow names: string, int64, float64...); the "
        "others are inferred from each file's first block",
    )
    args = p.parse_args(argv)
    if args.batch_rows < 1 or args.batch_mib <= 0:
        p.error("--batch-rows and --batch-mib must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        rows, nbytes, schema = pack(
            args.sources,
            args.out,
            rows=args.batch_rows,
            max_mib=args.batch_mib,
            csv_types=args.csv_types,
        )
    except (PackError, pa.ArrowException, OSError) as exc:
        print(f"pack: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}: {rows:,} rows, {nbytes:,} bytes ({nbytes / 2**20:,.1f} MiB)")
    print(schema.to_string(show_schema_metadata=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
