"""One Arrow source mapped into memory: its bytes, its record batches, typed views over it.

A shard is an Arrow IPC file (``ARROW1`` magic, Feather v2), an IPC stream file (what Hugging Face
``datasets`` keeps in its cache), or an in-memory ``pyarrow.Table`` serialised once into an IPC
buffer. Files are opened with ``pyarrow.memory_map`` and read through a ``BufferReader`` over the
whole mapping, so every record batch's buffers are slices of that one mapping: zero copies, no
read into process memory, batches used as written (never concatenated).

Invariants:
- Every buffer of every record batch lies inside ``[base, base + size)`` (checked at open). A
  buffer outside it is a decompressed (or re-aligned) copy: the source is refused, because it
  cannot be served without copying the whole file into memory.
- Addresses handed to the gather code are byte offsets from ``base``. :meth:`carrier` views the
  whole mapping as integers of 1, 2, 4 or 8 bytes (read-only memory: those tensors are never
  written and never handed out); ``window(s, n)`` is the overlapping view whose row ``e`` is the
  ``n`` elements starting at element ``e``, so one ``index_select`` gathers rows from anywhere.
- A file shard pickles as its path plus the ``(size, mtime_ns)`` seen when it was first opened;
  re-opening (a spawn or forkserver worker) refuses a file whose size or mtime changed.
  :meth:`check_unchanged` (one ``fstat``) guards every gather the same way: a truncated mapping
  would otherwise kill the process with SIGBUS.
"""

from __future__ import annotations

import os
import warnings
import weakref
from dataclasses import dataclass
from typing import Final

import numpy as np
import pyarrow as pa
import torch

from shmloader.arrow.errors import ArrowSourceError

FILE_MAGIC: Final = b"ARROW1"
# Other formats a user may hand us by mistake, and what to do instead.
FOREIGN_MAGIC: Final = {
    b"PAR1": "a Parquet file",
    b"FEA1": "a Feather v1 file",
    b"\x93NUMPY": "a NumPy .npy file",
    b"PK\x03\x04": "a zip archive (.npz?)",
}
CARRIERS: Final = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NUMPY_CARRIERS: Final = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
IN_MEMORY: Final = "<in-memory pyarrow.Table>"


@dataclass(frozen=True)
class ShardSpec:
    """What a shard pickles as: a path and the file's identity, or the IPC bytes of a table."""

    name: str
    identity: tuple[int, int] | None = None  # (size, mtime_ns) of a file
    ipc: pa.Buffer | None = None  # an in-memory table's IPC bytes


class Shard:
    """A mapped Arrow source and its non-empty record batches (module docstring: invariants)."""

    _fd = -1

    def __init__(self, spec: ShardSpec) -> None:
        self.spec = spec
        self.name = spec.name
        self._carriers: dict[int, torch.Tensor] = {}
        self._windows: dict[tuple[int, int], torch.Tensor] = {}
        if spec.ipc is not None:
            self.buffer = spec.ipc
        else:
            self.buffer = self._map_file(spec)
        self.base = self.buffer.address
        self.size = self.buffer.size
        self.schema, batches = self._read_batches()
        self.batches = [b for b in batches if b.num_rows]
        for k, batch in enumerate(self.batches):
            self._check_in_mapping(batch, k)

    @classmethod
    def from_path(cls, path: str | os.PathLike[str]) -> Shard:
        name = os.fspath(path)
        st = os.stat(name)
        return cls(ShardSpec(name, (st.st_size, st.st_mtime_ns)))

    @classmethod
    def from_table(cls, table: pa.Table) -> Shard:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        return cls(ShardSpec(IN_MEMORY, None, sink.getvalue()))

    # -- opening --------------------------------------------------------------------------------

    def _map_file(self, spec: ShardSpec) -> pa.Buffer:
        fd = os.open(spec.name, os.O_RDONLY | os.O_CLOEXEC)
        self._fd = fd
        weakref.finalize(self, os.close, fd)
        self.check_unchanged()
        if os.fstat(fd).st_size == 0:
            raise ArrowSourceError(f"{spec.name}: the file is empty, not an Arrow IPC file")
        mapped = pa.memory_map(spec.name, "r")
        return mapped.read_buffer(mapped.size())

    def _read_batches(self) -> tuple[pa.Schema, list[pa.RecordBatch]]:
        head = self.buffer[:8].to_pybytes()
        for magic, what in FOREIGN_MAGIC.items():
            if head.startswith(magic):
                raise ArrowSourceError(
                    f"{self.name}: this is {what}, not an Arrow IPC file; convert it with "
                    f"`python -m tools.pack {self.name} -o OUT.arrow`"
                )
        try:
            if head.startswith(FILE_MAGIC):
                reader = pa.ipc.open_file(pa.BufferReader(self.buffer))
                batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
                return reader.schema, batches
            stream = pa.ipc.open_stream(pa.BufferReader(self.buffer))
            return stream.schema, list(stream)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError) as exc:
            what = "IPC file" if head.startswith(FILE_MAGIC) else "IPC stream"
            raise ArrowSourceError(
                f"{self.name}: cannot read it as an Arrow {what} (truncated, or not Arrow: it "
                f"starts with {head!r}): {exc}"
            ) from exc

    def _check_in_mapping(self, batch: pa.RecordBatch, k: int) -> None:
        end = self.base + self.size
        for name, column in zip(batch.schema.names, batch.columns, strict=True):
            for buf in _all_buffers(column):
                if buf is not None and buf.size and not (
                    self.base <= buf.address and buf.address + buf.size <= end
                ):
                    raise ArrowSourceError(
                        f"{self.name}: column {name!r} of record batch {k} is not stored as "
                        f"plain bytes in the file (the IPC file is compressed with lz4 or zstd), "
                        f"so it cannot be memory-mapped without copying it into memory; rewrite "
                        f"it uncompressed: `python -m tools.pack {self.name} -o OUT.arrow`"
                    )

    # -- while mapped ---------------------------------------------------------------------------

    def check_unchanged(self) -> None:
        """Raise if the file was truncated or rewritten since it was first opened."""
        if self._fd < 0 or self.spec.identity is None:
            return
        st = os.fstat(self._fd)
        size, mtime = self.spec.identity
        if st.st_size < size or st.st_mtime_ns != mtime:
            raise ArrowSourceError(
                f"{self.name}: the file changed while mapped (size {size} -> {st.st_size} "
                f"bytes, mtime {mtime} -> {st.st_mtime_ns} ns); reading it now could crash the "
                f"process with SIGBUS. Do not rewrite a dataset file in place while a job uses "
                f"it: write a new file and open that"
            )

    def carrier(self, itemsize: int) -> torch.Tensor:
        """The whole mapping as a flat read-only tensor of ``itemsize``-byte integers."""
        flat = self._carriers.get(itemsize)
        if flat is None:
            array = np.frombuffer(
                self.buffer, dtype=_NUMPY_CARRIERS[itemsize], count=self.size // itemsize
            )
            with warnings.catch_warnings():  # read-only memory: never written, never handed out
                warnings.simplefilter("ignore", UserWarning)
                flat = self._carriers[itemsize] = torch.from_numpy(array)
        return flat

    def window(self, itemsize: int, n: int) -> torch.Tensor:
        """Rows of ``n`` carrier elements starting at every element (overlapping, read-only)."""
        key = (itemsize, n)
        win = self._windows.get(key)
        if win is None:
            flat = self.carrier(itemsize)
            win = self._windows[key] = flat.as_strided((max(flat.numel() - n + 1, 0), n), (1, 1))
        return win


def _all_buffers(array: pa.Array) -> list[pa.Buffer | None]:
    """Every buffer of ``array`` and its children (``Array.buffers()`` recurses already)."""
    if isinstance(array, pa.ExtensionArray):
        array = array.storage
    return list(array.buffers())
