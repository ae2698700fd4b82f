"""``ArrowDataset``: a map-style dataset over memory-mapped Arrow files, gathered by column.

The rows live in the page cache, not in Python objects, so a forked worker never copies them
(pytorch#13246), and a spawned one re-maps the very files the opening process holds (through
``/proc/<pid>/fd``; by absolute path only when that is impossible) at a cost independent of their
size.
``ds[i]`` is a dict of the selected columns (types: :mod:`shmloader.arrow.columns`);
``ds.__getitems__(indices)``, which torch's fetcher calls, returns :class:`ArrowRows`, which
shmloader's default collate gathers column by column straight into the batch's slot.

Invariants:
- ``len(ds)`` is the total row count of the shards, in order; row ``i`` lives in record batch
  ``searchsorted(starts, i, "right") - 1`` (empty record batches are dropped at open).
- Open refuses what could fail later: a non-Arrow, compressed or truncated file, shards whose
  selected columns differ in type, a missing, duplicated or unsupported column, and any null
  outside a string or binary column (those give ``None``, as ``Table.to_pylist`` does).
  Afterwards a gather can fail only on an index out of range (``IndexError``, however large the
  index), an index that is not an integer (``TypeError``, as for a list) or a file changed on
  disk.
- Pickling carries :class:`ShardSpec` records (absolute paths, identities and the opening
  process's descriptors; an in-memory table's IPC bytes), the column names and the transform;
  never a mapped buffer.
- Unpickling never raises for a file that changed or vanished: the error (naming the file) is
  raised by the first ``len``/``ds[i]``/``__getitems__`` instead. A spawn or forkserver worker
  unpickles its dataset before it can report anything, so an error there would only kill it
  ("worker exited unexpectedly"); at the first fetch it reaches the main process as the
  worker's exception.
"""

from __future__ import annotations

import errno
import operator
import os
import resource
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeAlias

import numpy as np
import pyarrow as pa
from torch.utils.data import Dataset

from shmloader.arrow.build import build_plan, first_null_row
from shmloader.arrow.columns import Gatherer, Plan, Ragged, Where
from shmloader.arrow.errors import ArrowSourceError
from shmloader.arrow.rows import ArrowRows
from shmloader.arrow.shard import Shard, ShardSpec
from shmloader.collate import Alloc, private_empty
from shmloader.notes import raise_kept, traceless

Source: TypeAlias = "str | os.PathLike[str] | pa.Table | Sequence[str | os.PathLike[str]]"


class ArrowDataset(Dataset[dict[str, Any]]):
    """Rows of Arrow IPC files (or streams, or shards of them) as dicts of tensors and strings.

    Args:
        source: the path of an Arrow IPC file or stream file, a list of such paths (shards,
            concatenated in order), or an in-memory ``pyarrow.Table`` (or ``RecordBatch``). A
            table's selected columns are serialised once into an IPC buffer (one copy of their
            bytes); workers started by fork share it, but spawn and forkserver workers each
            receive a pickled copy — write the table to a file
            (``pyarrow.feather.write_feather(table, path, compression="uncompressed")``) for
            low-RAM jobs.
        columns: the columns to read, in this order (default: all).
        transform: called on each item (a dict) in ``ds[i]`` and ``__getitems__``, e.g. to decode
            an encoded image. With a transform, batches are collated item by item.
    """

    _broken: BaseException | None = None  # set only by unpickling a changed file (_restore)

    def __init__(
        self,
        source: Source,
        columns: Sequence[str] | None = None,
        transform: Callable[[dict[str, Any]], Any] | None = None,
    ) -> None:
        if isinstance(columns, str):
            raise TypeError(f"columns must be a list of column names, got the string {columns!r}")
        if columns is not None:
            columns = list(columns)  # once: a generator is used up by reading it (review 23)
            twice = sorted({c for c in columns if columns.count(c) > 1})
            if twice:
                raise ValueError(f"columns= lists {', '.join(map(repr, twice))} more than once")
        if isinstance(source, pa.RecordBatch):
            source = pa.Table.from_batches([source])
        if isinstance(source, pa.Table):
            shards = [Shard.from_table(_selected(source, columns))]
        elif isinstance(source, str | os.PathLike):
            shards = [Shard.from_path(source)]
        else:
            paths = _paths(source)
            if not paths:
                raise ValueError("ArrowDataset needs at least one source path, got an empty list")
            shards = [_open_shard(p, k, len(paths)) for k, p in enumerate(paths)]
        self._setup(shards, columns, transform)

    def _setup(self, shards: list[Shard], columns: list[str] | None,
               transform: Callable[[dict[str, Any]], Any] | None) -> None:
        self.transform = transform
        self._shards = shards
        self._specs = [s.spec for s in shards]
        first = shards[0]
        names = list(first.schema.names) if columns is None else columns
        for shard in shards:
            all_names = list(shard.schema.names)
            twice = sorted({c for c in names if all_names.count(c) > 1})
            if twice:
                raise ArrowSourceError(
                    f"{shard.name}: column {', '.join(map(repr, twice))} appears more than once "
                    f"in the file; ArrowDataset needs distinct names: rename the columns "
                    f"(pyarrow Table.rename_columns, or the CSV header) and pack it again, or "
                    f"pass columns=[...] without it"
                )
            missing = [c for c in names if c not in shard.schema.names]
            if missing:
                raise ArrowSourceError(
                    f"{shard.name}: no column {', '.join(map(repr, missing))}; the file has "
                    f"{', '.join(map(repr, shard.schema.names))}"
                )
            for c in names:
                a, b = first.schema.field(c).type, shard.schema.field(c).type
                if a != b:
                    raise ArrowSourceError(
                        f"{shard.name}: column {c!r} has type {b}, but {first.name} has {a}; "
                        f"every shard must have the same types"
                    )
        self._columns = names
        self.schema = pa.schema([first.schema.field(c) for c in names])
        owners: list[Shard] = []
        batch_shard: list[int] = []
        rows: list[int] = []
        in_file: list[int] = []  # row of the file where each record batch starts
        for k, shard in enumerate(shards):
            done = 0
            for batch in shard.batches:
                owners.append(shard)
                batch_shard.append(k)
                rows.append(batch.num_rows)
                in_file.append(done)
                done += batch.num_rows
        self._starts = np.concatenate([[0], np.cumsum(rows, dtype=np.int64)]).astype(np.int64)
        self._len = int(self._starts[-1])
        self._starts = self._starts[:-1]
        self._batch_shard = np.array(batch_shard, dtype=np.int64)
        self._gatherer = Gatherer(shards)
        self._plans: dict[str, Plan] = {}
        for c in names:
            arrays = [b.column(c) for s in shards for b in s.batches]
            # The type first: a column of type null is unsupported, not one to fill (review 38)
            plan = build_plan(c, first.schema.field(c).type, arrays, owners, first.name)
            self._check_nulls(c, arrays, owners, in_file)
            self._plans[c] = plan

    def _check_nulls(self, name: str, arrays: list[pa.Array], owners: list[Shard],
                     in_file: list[int]) -> None:
        for k, array in enumerate(arrays):
            row = first_null_row(array)
            if row is not None:
                raise ArrowSourceError(
                    f"{owners[k].name}: column {name!r} has a null at row {row + in_file[k]} "
                    f"of the file "
                    f"(row {int(row + self._starts[k])} of the dataset); ArrowDataset needs "
                    f"every value: fill or drop nulls before packing (pyarrow.compute.fill_null, "
                    f"Table.drop_null)"
                )

    # -- Dataset ---------------------------------------------------------------------------------

    def _usable(self) -> None:
        """Raise the error unpickling deferred, if any (module docstring)."""
        if self._broken is not None:
            # a copy: the kept one takes no caller's frames (review 81)
            raise_kept(self._broken)

    def __len__(self) -> int:
        self._usable()
        return self._len

    def __getitem__(self, index: int) -> Any:
        self._usable()
        i = operator.index(index)
        row = self._rows(self._where([i]))[0]
        return row if self.transform is None else self.transform(row)

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """The rows at ``indices``: :class:`ArrowRows` (gathered by column when collated), or
        with a transform the list of transformed items."""
        self._usable()
        where = self._where(indices)
        if self.transform is None:
            return ArrowRows(self, where)
        return [self.transform(row) for row in self._rows(where)]

    @property
    def columns(self) -> list[str]:
        return list(self._columns)

    def __repr__(self) -> str:
        names = [s.name for s in self._specs]
        if self._broken is not None:
            return f"ArrowDataset(unusable: {self._broken})"
        where = names[0] if len(names) == 1 else f"{names[0]} and {len(names) - 1} more shards"
        return f"ArrowDataset({self._len} rows, columns {self._columns}, from {where})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_restore, (self._specs, self._columns, self.transform))

    # -- gathering -------------------------------------------------------------------------------

    def _where(self, indices: Sequence[int]) -> Where:
        given = np.asarray(indices)
        if given.dtype.kind in "biu" and not (given.dtype.kind == "u" and given.itemsize == 8):
            idx = given.astype(np.int64).reshape(-1)
        elif given.size == 0:
            idx = np.zeros(0, dtype=np.int64)
        else:  # as a list indexes: integers only, however large (review 23: 1.7 read row 1)
            # (the given objects: NumPy turns [1, 2**63] into floats)
            items = indices.tolist() if hasattr(indices, "tolist") else list(indices)
            whole = [operator.index(i) for i in items]
            huge = [i for i in whole if not -(2**63) <= i < 2**63]
            if huge:  # beyond int64: out of range, as for a list (not OverflowError)
                raise IndexError(
                    f"ArrowDataset index {huge[0]} out of range for {self._len} rows "
                    f"({self._shards[0].name})"
                )
            idx = np.array(whole, dtype=np.int64)
        idx = np.where(idx < 0, idx + self._len, idx)
        bad = np.flatnonzero((idx < 0) | (idx >= self._len))
        if len(bad):
            raise IndexError(
                f"ArrowDataset index {int(np.asarray(indices).reshape(-1)[bad[0]])} out of range "
                f"for {self._len} rows ({self._shards[0].name})"
            )
        batch = np.searchsorted(self._starts, idx, side="right") - 1
        shard = self._batch_shard[batch]
        single: int | None = 0
        if len(shard) and len(self._shards) > 1:
            single = int(shard[0]) if (shard == shard[0]).all() else None
        return Where(batch, idx - self._starts[batch], shard, single)

    def _collate(self, where: Where, alloc: Alloc, ragged: Ragged) -> dict[str, Any]:
        """The batch of rows ``where``: what ``default_collate`` gives (``ragged="stack"``)."""
        shards = self._shards
        if where.single is not None:
            shards[where.single].check_unchanged()
        else:  # the shards read, not every one (review 57: 1,000 shards cost 1.2 ms a batch)
            for s in np.unique(where.shard).tolist():
                shards[s].check_unchanged()
        return {c: p.collate(where, self._gatherer, alloc, ragged) for c, p in self._plans.items()}

    def _rows(self, where: Where) -> list[dict[str, Any]]:
        """The rows ``where`` as item dicts (one gather into private memory, then split)."""
        batch = self._collate(where, private_empty, "rows")
        parts = {c: p.split(batch[c], len(where)) for c, p in self._plans.items()}
        return [{c: v[r] for c, v in parts.items()} for r in range(len(where))]


def _selected(table: pa.Table, columns: list[str] | None) -> pa.Table:
    """The columns of ``table`` the dataset reads, before it is serialised (review 23: the
    others travelled to every spawn worker); the whole table when one is missing or listed
    twice, for :meth:`ArrowDataset._setup` to say so."""
    names = table.schema.names
    if columns is None or any(names.count(c) != 1 for c in columns):
        return table
    return table.select(columns)


def _paths(source: Any) -> list[str | os.PathLike[str]]:
    """The shard paths of a list source; a TypeError naming what ArrowDataset takes for
    anything else (review 23: a dict's keys were read as paths, bytes as integers)."""
    taken = "a path, a list of paths, or a pyarrow.Table (or RecordBatch)"
    if isinstance(source, bytes | bytearray | Mapping):
        raise TypeError(f"ArrowDataset source must be {taken}, got {type(source).__name__}")
    try:
        paths = list(source)
    except TypeError:
        raise TypeError(
            f"ArrowDataset source must be {taken}, got {type(source).__name__}"
        ) from None
    for p in paths:
        if not isinstance(p, str | os.PathLike):
            raise TypeError(
                f"ArrowDataset source must be {taken}; the list holds a {type(p).__name__}: {p!r}"
            )
    return paths


def _open_shard(path: str | os.PathLike[str], k: int, count: int) -> Shard:
    """Shard ``k`` of ``count``; running out of descriptors says how many shards need one
    each, and the limit (review 23)."""
    try:
        return Shard.from_path(path)
    except OSError as exc:
        if exc.errno != errno.EMFILE:
            raise
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        raise OSError(
            errno.EMFILE,
            f"opening shard {k + 1} of {count} ({os.fspath(path)}): this process is out of file "
            f"descriptors (ulimit -n: {soft}); ArrowDataset keeps one open per shard, so "
            f"{count} shards need {count} besides the job's own: raise the limit (ulimit -n, "
            f"resource.setrlimit(RLIMIT_NOFILE)) or merge shards with `python -m tools.pack "
            f"SHARDS... -o OUT.arrow`",
        ) from exc


def _restore(specs: list[ShardSpec], columns: list[str],
             transform: Callable[[dict[str, Any]], Any] | None) -> ArrowDataset:
    """Unpickle: re-open every shard and rebuild the plans; a file changed or gone since makes a
    dataset whose first use raises that error (module docstring: why not raise here)."""
    ds = ArrowDataset.__new__(ArrowDataset)
    handled = sys.exc_info()[1]  # (unpickled while the caller handles an exception)
    try:
        shards = [Shard(spec) for spec in specs]
    except (ArrowSourceError, OSError) as exc:
        ds.transform, ds._specs, ds._columns, ds._shards = transform, specs, columns, []
        # Kept without frames (they held this dataset: a cycle; review 81), and without the
        # caller's own exception, whose traceback is theirs (review 82).
        ds._broken = traceless(exc, handled)
        return ds
    ds._setup(shards, columns, transform)
    return ds
