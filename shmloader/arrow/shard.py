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
- A file shard is opened once, by its absolute path, and keeps that descriptor open for its
  whole life; the mapping is made from the descriptor, so it is the very file whose
  :class:`FileIdentity` (device, inode, size, mtime) was taken from that descriptor.
- It pickles as :class:`ShardSpec`: the absolute path, that identity, and where the descriptor
  lives (``owner_pid``, ``fd``). Re-opening (a spawn or forkserver worker, any unpickling)
  reaches the same inode through ``/proc/<owner_pid>/fd/<fd>`` (``dup`` in the owner itself), so
  a new file renamed over the path since is never seen; only when that is impossible (the owner
  exited, ``/proc`` is unreadable, the descriptor now names another inode) does it fall back to
  the path, and then a different inode is refused like any other change.
- :meth:`check_unchanged` (one ``fstat``) refuses a file whose identity changed: it guards every
  gather (a truncated mapping would otherwise kill the process with SIGBUS) and every re-open.
  Metadata changes (``chmod``, ``chown``, a new hard link) are not changes: a training job must
  not die of one. So an in-place rewrite that restores both size and mtime (``cp -p`` of a file
  of equal size) goes unseen: replace dataset files by renaming a new file over them.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import stat
import warnings
from dataclasses import dataclass
from typing import Final

import numpy as np
import pyarrow as pa
import torch

from arena.finalizers import on_death
from arena.segment import map_readonly, no_address_space, reopen_descriptor
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
class FileIdentity:
    """What ``fstat`` said of a file when it was opened: which inode, and its state then."""

    dev: int
    ino: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def same_inode(self, st: os.stat_result) -> bool:
        return (st.st_dev, st.st_ino) == (self.dev, self.ino)

    def changes(self, st: os.stat_result) -> str | None:
        """How the file ``st`` describes differs from this identity, or None if it does not."""
        if not self.same_inode(st):
            return (f"another file now has this path: device/inode {self.dev}/{self.ino} -> "
                    f"{st.st_dev}/{st.st_ino}")
        seen = []
        if st.st_size != self.size:
            seen.append(f"size {self.size} -> {st.st_size} bytes")
        if st.st_mtime_ns != self.mtime_ns:
            seen.append(f"mtime {self.mtime_ns} -> {st.st_mtime_ns} ns")
        return ", ".join(seen) or None


@dataclass(frozen=True)
class ShardSpec:
    """What a shard pickles as: a file's absolute path, its identity and the descriptor the
    opening process holds (``owner_pid``, ``fd``), or the IPC bytes of a table."""

    name: str
    identity: FileIdentity | None = None
    ipc: pa.Buffer | None = None  # an in-memory table's IPC bytes
    owner_pid: int = -1
    fd: int = -1


def _absolute(path: str | os.PathLike[str]) -> str:
    """``path`` joined to the current directory if relative (not normalised: ``..`` after a
    symlink keeps its meaning)."""
    name = os.fspath(path)
    return name if os.path.isabs(name) else os.path.join(os.getcwd(), name)


def _reopen(spec: ShardSpec) -> tuple[int, str]:
    """A descriptor of the file ``spec`` describes, and how it was reached (for errors): the
    owner's descriptor if it still names that inode, else the path (module docstring)."""
    assert spec.identity is not None
    how = f"its path (the process that opened it, pid {spec.owner_pid}, could not be reached)"
    if spec.owner_pid > 0 and spec.fd >= 0:
        fd = -1
        try:
            fd = reopen_descriptor(spec.owner_pid, spec.fd, os.O_RDONLY)
        except OSError as exc:
            how = (f"its path (/proc/{spec.owner_pid}/fd/{spec.fd} of the process that opened it: "
                   f"{os.strerror(exc.errno or 0)})")
        if fd >= 0:
            try:
                if spec.identity.same_inode(os.fstat(fd)):
                    return fd, f"/proc/{spec.owner_pid}/fd/{spec.fd}"
            except OSError:
                pass
            os.close(fd)
            how = f"its path (descriptor {spec.fd} of pid {spec.owner_pid} names another file now)"
    try:
        return _open(spec.name), how
    except OSError as exc:
        # (a spawned worker opens the file anew: permissions changed since, chmod, fail here;
        # review 57: the error said neither how nor why)
        raise type(exc)(
            exc.errno,
            f"{exc.strerror}: {spec.name} could not be opened again in this process through "
            f"{how}. A spawned or forkserver worker opens each dataset file anew, so it must "
            "stay readable while the loader starts workers (forked workers inherit it open)",
        ) from exc


def _open(name: str) -> int:
    """A descriptor of the file at ``name``. Never blocks: opening a FIFO for reading would
    wait for a writer (review 23); it is refused as "not a regular file" afterwards instead."""
    return os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)


class Shard:
    """A mapped Arrow source and its non-empty record batches (module docstring: invariants)."""

    _fd = -1

    def __init__(self, spec: ShardSpec, fd: int = -1) -> None:
        """Open ``spec``; ``fd``, if given, is a descriptor of its file this shard now owns."""
        self.spec = spec
        self.name = spec.name
        self._carriers: dict[int, torch.Tensor] = {}
        self._windows: dict[tuple[int, int], torch.Tensor] = {}
        self._bytes: memoryview | None = None
        if spec.ipc is not None:
            self.buffer = spec.ipc
        else:
            self.buffer = self._map_file(spec, fd)
        self.base = self.buffer.address
        self.size = self.buffer.size
        self.schema, batches = self._read_batches()
        self.batches = [b for b in batches if b.num_rows]
        for k, batch in enumerate(self.batches):
            self._check_in_mapping(batch, k)

    @classmethod
    def from_path(cls, path: str | os.PathLike[str]) -> Shard:
        name = _absolute(path)
        fd = _open(name)
        try:
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        return cls(ShardSpec(name, FileIdentity.of(st), None, os.getpid(), fd), fd)

    @classmethod
    def from_table(cls, table: pa.Table) -> Shard:
        sink = pa.BufferOutputStream()
        try:
            with pa.ipc.new_file(sink, table.schema) as writer:
                writer.write_table(table)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            # e.g. a dictionary column whose chunks have different dictionaries (review 23)
            raise ArrowSourceError(
                f"{IN_MEMORY}: cannot write the table as Arrow IPC ({exc}); pass columns=[...] "
                f"without the column at fault, or convert it first (a dictionary column: "
                f"table.column(name).cast(its value type), or pack the table with tools.pack)"
            ) from exc
        return cls(ShardSpec(IN_MEMORY, None, sink.getvalue()))

    # -- opening --------------------------------------------------------------------------------

    def _map_file(self, spec: ShardSpec, fd: int) -> pa.Buffer:
        how = "its path"
        if fd < 0:
            fd, how = _reopen(spec)
            # Copies of this shard reach the file through this process's descriptor from now
            # on: the one named in ``spec`` may be closed, or name another file, by then
            # (review 23: a deep copy outlived its original).
            self.spec = dataclasses.replace(spec, owner_pid=os.getpid(), fd=fd)
        self._fd = fd
        on_death(self, os.close, fd)
        self.check_unchanged(f"since it was opened (re-opened through {how})")
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ArrowSourceError(f"{spec.name}: not a regular file, not an Arrow IPC file")
        if st.st_size == 0:
            raise ArrowSourceError(f"{spec.name}: the file is empty, not an Arrow IPC file")
        # One descriptor per file shard: mmap.mmap would keep a duplicate of it (review 9:
        # 600 shards ran out of a 1,024-descriptor limit).
        try:
            return pa.py_buffer(map_readonly(fd, st.st_size))
        except OSError as e:
            if e.errno != errno.ENOMEM:
                raise
            cause, fixes = no_address_space()  # review 38: a bare OSError named neither
            raise ArrowSourceError(
                f"{spec.name}: cannot map its {st.st_size:,} bytes: {cause}. Fixes: {fixes}, "
                "or split the data into smaller files (one ArrowDataset reads several)"
            ) from None

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

    def check_unchanged(self, when: str = "while mapped") -> None:
        """Raise if the file was truncated, rewritten or replaced since it was first opened."""
        if self._fd < 0 or self.spec.identity is None:
            return
        why = self.spec.identity.changes(os.fstat(self._fd))
        if why is not None:
            raise ArrowSourceError(
                f"{self.name}: the file changed {when} ({why}); reading it now could crash the "
                f"process with SIGBUS or give wrong rows. Do not rewrite a dataset file in "
                f"place while a job uses it: write a new file, rename it over the old one, and "
                f"open a new ArrowDataset to read it"
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

    def bytes(self) -> memoryview:
        """The whole mapping as bytes (read-only; slices of it are copied out, never kept)."""
        if self._bytes is None:
            self._bytes = memoryview(self.buffer)
        return self._bytes

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
