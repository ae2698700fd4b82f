"""Reading one Arrow column for many rows at once: a plan per column type, built at open.

A plan knows, for every record batch of every shard, the byte offsets (from the shard's base) of
the column's buffers, so a batch of rows is gathered with a few vectorised ``index_select`` calls
over the mapped file, never a Python loop over rows for fixed-width data. Plans are built from
the Arrow types in :mod:`shmloader.arrow.build`:

==========================================  ===============================================
Arrow type                                  item (``ds[i][col]``) / batch (default collate)
==========================================  ===============================================
int8..int64, uint8..uint64, float16..64     0-d tensor of that dtype / ``[B]``
bool                                        0-d ``torch.bool`` / ``[B]``
fixed_size_list (nested), fixed_shape_tensor  tensor of the row shape / ``[B, *shape]``
list / large_list of a number type          1-D tensor / ``[B, L]`` if every length is ``L``,
                                            else an error naming ``collate_padded``
string / large_string, binary, fixed binary ``str`` / ``bytes`` (null: ``None``); a list
struct of any of these                      dict / dict of the fields' batches
==========================================  ===============================================

Invariants:
- :meth:`Plan.collate` returns exactly what ``torch.utils.data.default_collate`` returns for the
  rows' items; every tensor comes from ``alloc(shape, dtype)`` (the slot) and is written once. A
  ``meta`` tensor from ``alloc`` (shmloader planning a slot) is returned unfilled.
- :meth:`Plan.split` turns a batch collated with ``ragged="list"`` back into per-row items; the
  items of ``ds[i]`` come from that path, so items and batches cannot disagree.
- Nulls are refused at open (``build.first_null_row``) except in strings and binaries, whose
  plan reads the validity bitmap and gives ``None``; no other gather ever meets one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, Final, Literal

import numpy as np
import torch

from shmloader.arrow.shard import CARRIERS, Shard
from shmloader.collate import Alloc, current_session
from shmloader.notes import add_note

Ragged = Literal["stack", "list", "pad", "rows"]  # "rows": the items of ds[i] (no checks)
NONE_IN_BATCH = (  # torch's default_collate, when a batch's first value is None
    "default_collate: batch must contain tensors, numpy arrays, numbers, dicts or lists; found {}"
)


def _unequal_rows(lengths: np.ndarray) -> str:
    """What torch raises collating rows of these lengths as 1-D tensors: in a worker, its
    collate first sizes a shared output by the rows' total length and reshapes it to ``rows x
    first length``, which fails when the total is short (``shmloader.collate`` keeps the same
    rule); then, as without workers, ``torch.stack`` names the first row of another length."""
    if current_session() is not None and int(lengths.sum()) < len(lengths) * int(lengths[0]):
        return "Trying to resize storage that is not resizable"
    other = int(np.flatnonzero(lengths != lengths[0])[0])
    return (
        f"stack expects each tensor to be equal size, but got [{int(lengths[0])}] at entry 0 "
        f"and [{int(lengths[other])}] at entry {other}"
    )


@dataclass(frozen=True)
class Where:
    """Where the requested rows live: per row its global record batch and row inside it."""

    batch: np.ndarray  # int64, global record batch index of each row
    local: np.ndarray  # int64, row inside that record batch
    shard: np.ndarray  # int64, shard of each row
    single: int | None  # the one shard holding every row, or None

    def __len__(self) -> int:
        return len(self.local)


class Gatherer:
    """The shards of a dataset and the one primitive every plan uses: gather byte rows."""

    def __init__(self, shards: Sequence[Shard]) -> None:
        self.shards = list(shards)

    def rows(
        self, out: torch.Tensor, shard: np.ndarray, single: int | None, addr: np.ndarray, s: int
    ) -> None:
        """Fill ``out`` (``[R, n]`` of the ``s``-byte carrier) with the ``n`` elements found at
        byte offset ``addr[r]`` of shard ``shard[r]``, for every row ``r``."""
        n = out.shape[1]
        if single is not None:
            win = self.shards[single].window(s, n)
            torch.index_select(win, 0, torch.from_numpy(addr // s), out=out)
            return
        for k in np.unique(shard).tolist():
            pos = np.flatnonzero(shard == k)
            win = self.shards[k].window(s, n)
            out[torch.from_numpy(pos)] = win.index_select(0, torch.from_numpy(addr[pos] // s))

    def concat(self, shard: np.ndarray, single: int | None, start: np.ndarray,
               end: np.ndarray) -> bytes:
        """The byte ranges ``[start[r], end[r])`` of shard ``shard[r]``, back to back: one
        slice of the mapping per row (review 23: gathering byte by byte took 11x the batch's
        bytes in addresses, and 20-90x the time, on image-sized rows)."""
        spans = zip(start.tolist(), end.tolist(), strict=True)
        if single is not None:
            data = self.shards[single].bytes()
            return b"".join([data[a:b] for a, b in spans])
        views = [s.bytes() for s in self.shards]
        return b"".join([views[k][a:b] for k, (a, b) in zip(shard.tolist(), spans, strict=True)])


# Elements per row, on average, from which a variable-length list column is gathered row by
# row (one slice each) rather than element by element (VarListPlan._fill).
LONG_ROWS: Final = 16


class Plan:
    """How to gather one column (module docstring: the table of types)."""

    def collate(self, w: Where, g: Gatherer, alloc: Alloc, ragged: Ragged) -> Any:
        raise NotImplementedError

    def split(self, collated: Any, rows: int) -> list[Any]:
        raise NotImplementedError


def _carrier_size(itemsize: int, offsets: np.ndarray) -> int:
    """The widest carrier every address is aligned to (Arrow aligns buffers to 8 bytes)."""
    return itemsize if not len(offsets) or not (offsets % itemsize).any() else 1


class FixedPlan(Plan):
    """Numbers, fixed-size lists of numbers (nested) and fixed-shape tensors: ``[B, *shape]``."""

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...], data: np.ndarray) -> None:
        self.dtype, self.shape, self.data = dtype, shape, data
        self.rowbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        self.s = _carrier_size(dtype.itemsize, data)

    def collate(self, w: Where, g: Gatherer, alloc: Alloc, ragged: Ragged) -> Any:
        out = alloc((len(w), *self.shape), self.dtype)
        if out.is_meta or out.numel() == 0:
            return out
        addr = self.data[w.batch] + w.local * self.rowbytes
        carrier = out.view(len(w), -1).view(CARRIERS[self.s])
        g.rows(carrier, w.shard, w.single, addr, self.s)
        return out

    def split(self, collated: Any, rows: int) -> list[Any]:
        return list(collated.unbind(0))


class Bits:
    """A bitmap per record batch (values of a bool column, or validity): ``data`` its address,
    ``bit0`` the array's offset in bits; ``present[k]`` False where batch ``k`` has none (all
    ones, Arrow's way of saying "no nulls")."""

    def __init__(self, data: np.ndarray, bit0: np.ndarray, present: np.ndarray) -> None:
        self.data, self.bit0, self.present = data, bit0, present

    def read(self, w: Where, g: Gatherer, out: torch.Tensor) -> None:
        """Write the rows' bits (0 or 1) into ``out`` (``[R]`` uint8): the byte holding each bit
        is gathered, then the bit is extracted."""
        bit = self.bit0[w.batch] + w.local
        raw = torch.empty((len(w), 1), dtype=torch.uint8)
        g.rows(raw, w.shard, w.single, self.data[w.batch] + (bit >> 3), 1)
        shift = torch.from_numpy((bit & 7).astype(np.uint8))
        torch.bitwise_and(raw[:, 0].bitwise_right_shift(shift), 1, out=out)
        if not self.present.all():
            out[torch.from_numpy(~self.present[w.batch])] = 1


class BoolPlan(Plan):
    """Bit-packed booleans."""

    def __init__(self, bits: Bits) -> None:
        self.bits = bits

    def collate(self, w: Where, g: Gatherer, alloc: Alloc, ragged: Ragged) -> Any:
        out = alloc((len(w),), torch.bool)
        if not out.is_meta and len(w):
            self.bits.read(w, g, out.view(torch.uint8))
        return out

    def split(self, collated: Any, rows: int) -> list[Any]:
        return list(collated.unbind(0))


class Spans:
    """Shared by variable-length types: gather each row's ``[start, end)`` from its offsets."""

    def __init__(self, offsets: np.ndarray, width: int) -> None:
        self.offsets, self.width = offsets, width  # offsets buffer address (row 0), 4 or 8

    def bounds(self, w: Where, g: Gatherer) -> tuple[np.ndarray, np.ndarray]:
        pair = torch.empty((len(w), 2), dtype=CARRIERS[self.width])
        if len(w):
            addr = self.offsets[w.batch] + w.local * self.width
            g.rows(pair, w.shard, w.single, addr, _carrier_size(self.width, self.offsets))
        both = pair.numpy().astype(np.int64)
        return both[:, 0], both[:, 1]


class VarListPlan(Plan):
    """``list``/``large_list`` of numbers: 1-D tensors per row.

    ``ragged`` chooses the batch: ``stack`` (``default_collate``: ``[B, L]``, an error when the
    lengths differ), ``list`` (a list of 1-D tensors, views of one buffer) or ``pad`` (a tuple of
    a zero-padded ``[B, max L]`` tensor and the int64 lengths ``[B]``).
    """

    def __init__(self, name: str, dtype: torch.dtype, spans: Spans, values: np.ndarray) -> None:
        self.name, self.dtype, self.spans, self.values = name, dtype, spans, values
        self.s = _carrier_size(dtype.itemsize, values)

    def collate(self, w: Where, g: Gatherer, alloc: Alloc, ragged: Ragged) -> Any:
        start, end = self.spans.bounds(w, g)
        lengths = end - start
        total = int(lengths.sum())
        if ragged == "stack":
            if len(w) and (lengths != lengths[0]).any():
                error = RuntimeError(_unequal_rows(lengths))
                add_note(
                    error,
                    f"shmloader.arrow: column {self.name!r} holds variable-length lists (lengths "
                    f"{lengths.min()}..{lengths.max()} in this batch), which default_collate "
                    f"cannot stack; pass collate_fn=shmloader.arrow.collate_ragged (a list of 1-D "
                    f"tensors) or collate_fn=shmloader.arrow.collate_padded (padded tensor and "
                    f"lengths)",
                )
                try:
                    raise error
                finally:  # (a local holding the error its traceback holds this frame by: a
                    del error  # cycle that kept the iterator until a collection; review 81)
            width = int(lengths[0]) if len(w) else 0
            out = alloc((len(w), width), self.dtype)
            self._fill(out.view(-1), w, g, start, lengths, total)
            return out
        if ragged in ("list", "rows"):
            flat = alloc((total,), self.dtype)
            self._fill(flat, w, g, start, lengths, total)
            return list(torch.split(flat, lengths.tolist()))
        longest = int(lengths.max()) if len(w) else 0
        padded = alloc((len(w), longest), self.dtype)
        lens = alloc((len(w),), torch.int64)
        if not padded.is_meta:
            padded.zero_()
            flat = torch.empty((total,), dtype=self.dtype)
            self._fill(flat, w, g, start, lengths, total)
            mask = torch.arange(longest) < torch.from_numpy(lengths)[:, None]
            # As bits of the same width: torch has no masked store for uint16/32/64 (review 23).
            carrier = CARRIERS[self.dtype.itemsize]
            padded.view(carrier)[mask] = flat.view(carrier)
        if not lens.is_meta:
            lens.copy_(torch.from_numpy(lengths))
        return padded, lens

    def _fill(self, out: torch.Tensor, w: Where, g: Gatherer, start: np.ndarray,
              lengths: np.ndarray, total: int) -> None:
        if out.is_meta or total == 0:
            return
        size = self.dtype.itemsize
        row_addr = self.values[w.batch] + start * size
        if total >= LONG_ROWS * len(w):
            # Long lists (audio, token streams): one slice of the mapping per row, then one
            # copy. Element by element, the addresses below took about 6x the batch's bytes
            # (review 57: 154 MB for a 26 MB batch), as binary rows did before review 23.
            data = g.concat(w.shard, w.single, row_addr, row_addr + lengths * size)
            out.view(torch.uint8).numpy()[: len(data)] = np.frombuffer(data, np.uint8)
            return
        first = np.cumsum(lengths) - lengths
        within = np.arange(total, dtype=np.int64) - np.repeat(first, lengths)
        addr = np.repeat(row_addr, lengths) + within * self.dtype.itemsize
        shard = np.repeat(w.shard, lengths) if w.single is None else w.shard
        carrier = out.view(CARRIERS[self.s] if self.s == self.dtype.itemsize else torch.uint8)
        g.rows(carrier.view(total, -1), shard, w.single, addr, self.s)

    def split(self, collated: Any, rows: int) -> list[Any]:
        return list(collated)


class BytesPlan(Plan):
    """Strings and binaries (variable or fixed width): ``str`` / ``bytes`` items, lists batched.

    Nulls are allowed here (Hugging Face image structs hold ``path: null``) and come back as
    ``None``; a batch whose first value is None raises what ``default_collate`` raises for it,
    with a note naming the column.
    """

    def __init__(self, name: str, text: bool, data: np.ndarray, spans: Spans | None, width: int,
                 valid: Bits | None) -> None:
        self.name, self.text, self.data, self.spans, self.width = name, text, data, spans, width
        self.valid = valid  # None: no record batch has a null

    def collate(self, w: Where, g: Gatherer, alloc: Alloc, ragged: Ragged) -> Any:
        values = self._values(w, g)
        if self.valid is not None and len(w):
            ok = torch.empty(len(w), dtype=torch.uint8)
            self.valid.read(w, g, ok)
            for r in np.flatnonzero(ok.numpy() == 0).tolist():
                values[r] = None
            if values[0] is None and ragged != "rows":
                # torch's words, and a note with what torch cannot say: where the None came from
                error = TypeError(NONE_IN_BATCH.format(type(None)))
                add_note(
                    error,
                    f"shmloader.arrow: the first row of this batch holds a null in column "
                    f"{self.name!r}; default_collate cannot batch None: fill the nulls before "
                    f"packing (pyarrow.compute.fill_null) or pass a collate_fn that takes None"
                )
                try:
                    raise error
                finally:
                    del error  # (as above)
        return values

    def _values(self, w: Where, g: Gatherer) -> list[Any]:
        if self.spans is None:
            start = self.data[w.batch] + w.local * self.width
            end = start + self.width
        else:
            lo, hi = self.spans.bounds(w, g)
            start, end = self.data[w.batch] + lo, self.data[w.batch] + hi
        blob = g.concat(w.shard, w.single, start, end)
        cuts = np.concatenate([[0], np.cumsum(end - start)]).tolist()
        bounds = pairwise(cuts)
        if not self.text:
            return [blob[a:b] for a, b in bounds]
        if blob.isascii():  # byte offsets are character offsets: decode once, then slice
            text = blob.decode("ascii")
            return [text[a:b] for a, b in bounds]
        view = memoryview(blob)
        return [str(view[a:b], "utf-8") for a, b in bounds]

    def split(self, collated: Any, rows: int) -> list[Any]:
        return list(collated)


class StructPlan(Plan):
    """A struct: a dict of its fields, each gathered by its own plan."""

    def __init__(self, fields: dict[str, Plan]) -> None:
        self.fields = fields

    def collate(self, w: Where, g: Gatherer, alloc: Alloc, ragged: Ragged) -> Any:
        return {k: p.collate(w, g, alloc, ragged) for k, p in self.fields.items()}

    def split(self, collated: Any, rows: int) -> list[Any]:
        parts = {k: p.split(collated[k], rows) for k, p in self.fields.items()}
        return [{k: v[r] for k, v in parts.items()} for r in range(rows)]
