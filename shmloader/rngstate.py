"""Worker RNG snapshots: torch, ``random`` and NumPy global states as one fixed-size record, and
the per-worker shared-memory ring where each worker publishes one after every task.

A snapshot is the state a worker's generators are in *after* a task, i.e. before its next one.
The main process needs, for each worker, the snapshot after the last task of that worker whose
batch the user has consumed (yielded, raised, or dropped with an abandoned epoch): restored in a
fresh worker, the worker continues the same random streams from the first batch not yet consumed.

Record layout (``SNAPSHOT``, little-endian, declared here and nowhere else)::

    torch  : 5056 bytes, ``torch.get_rng_state()`` (mt19937 + philox fields, torch's own format)
    random : int32 index, uint32 key[624]  (CPython's ``_random.Random`` object layout),
             uint8 has_gauss_next, 7 pad, float64 gauss_next
    numpy  : uint32 key[624], int32 pos    (``mt19937_state``, numpy's ``bit_generator.ctypes``),
             int32 has_gauss, 4 pad, float64 gauss   (the legacy ``RandomState`` Box-Muller cache)

Reading the three states through their public getters costs ~45 us a task (``random.getstate()``
builds 625 ints, ``np.random.get_state()`` a dict and a tuple). Capture therefore copies the
generators' C state with ``memmove`` (~5 us a task on the 2-core machine): the offsets are
*calibrated* at startup against the public getters and the fast path is used only when the two
agree; otherwise the public getters are used. Restoring always goes through the public setters.

Ring (one slab, ``nworkers * depth`` entries of ``ENTRY_SIZE`` bytes): worker ``w`` writes its
``k``-th snapshot into entry ``w * depth + k % depth``: the record first, then its tag
``(epoch + 1, seq)`` (0 = empty). A worker publishes before it sends the task's answer, so an
answer the main process has seen always has its entry. Invariant: a worker answers at most
``prefetch_factor`` tasks beyond the last one the user consumed, so with ``depth >
prefetch_factor + 1`` the entry the main process needs is never overwritten (the iterator adds
an entry for each batch a ``DevicePrefetcher`` holds beyond one, which a state rewinds); the
reader checks the tag before and after copying and raises if it was. The ring holds one
descriptor in the main process; when the process has none to spare as the iterator starts its
workers, the ``ArenaDescriptorError`` names the ring and the workers being started, with the
numbers.
"""

from __future__ import annotations

import ctypes
import random
import struct
from typing import Any, Final

import numpy as np

# Imported now, not lazily at first use: a fork while another thread ran that import would leave
# its module lock held for good in the child (a worker seeding NumPy would hang).
import numpy.random
import torch

from arena import Slab, SlabSpec
from arena._layout import PAGE
from shmloader import afterfork

TORCH_BYTES: Final = 5056
_PY: Final = struct.Struct("<i2496sB7xd")  # index, key, has_gauss_next, gauss_next
_NP: Final = struct.Struct("<2496sii4xd")  # key, pos, has_gauss, gauss
_PY_AT: Final = TORCH_BYTES
_NP_AT: Final = _PY_AT + _PY.size
SNAPSHOT: Final = _NP_AT + _NP.size  # bytes of one record
_TAG: Final = struct.Struct("<QQ")  # epoch + 1, seq
ENTRY_SIZE: Final = -(-(_TAG.size + SNAPSHOT) // PAGE) * PAGE  # slab slots are whole pages


class _Calibration:
    """Where the C state of ``random._inst`` and of NumPy's global ``RandomState`` live, checked
    against the public getters. ``None`` fields fall back to those getters."""

    def __init__(self) -> None:
        self.py_at: int | None = None  # offset of ``index`` in the _random.Random object
        self.np_gauss: tuple[int, int] | None = None  # offsets of has_gauss, gauss
        self.np_bg: Any = None
        self.np_addr = 0
        try:
            self._calibrate()
        except (ValueError, AttributeError, TypeError):
            self.py_at = None
            self.np_gauss = None

    def _calibrate(self) -> None:
        inst = random._inst
        key = random.getstate()[1]
        raw = ctypes.string_at(id(inst), type(inst).__basicsize__)
        at = raw.find(struct.pack("<624I", *key[:624]))
        if at >= 4 and struct.unpack_from("<i", raw, at - 4)[0] == key[624]:
            self.py_at = at - 4
        probes = []
        for has, value in ((1, 0.123456789), (0, 0.987654321)):
            rs = np.random.RandomState(0)
            st = rs.get_state()
            rs.set_state((st[0], st[1], st[2], has, value))  # type: ignore[index]
            probes.append((rs, ctypes.string_at(id(rs), type(rs).__basicsize__)))
        (_, a), (_, b) = probes
        g = a.find(struct.pack("<d", 0.123456789))
        if g > 0 and b[g : g + 8] == struct.pack("<d", 0.987654321):
            for h in (g - 8, g - 4, g + 8):
                if (
                    struct.unpack_from("<i", a, h)[0] == 1
                    and struct.unpack_from("<i", b, h)[0] == 0
                ):
                    self.np_gauss = (h, g)
                    break
        out = bytearray(SNAPSHOT)
        _capture_with(memoryview(out), self)
        if bytes(out) != _slow_capture():
            self.py_at = None
            self.np_gauss = None


_cal: _Calibration | None = None


def _calibration() -> _Calibration:
    global _cal
    if _cal is None:
        _cal = _Calibration()
    return _cal


def _slow_capture() -> bytes:
    out = bytearray(SNAPSHOT)
    out[:TORCH_BYTES] = torch.get_rng_state().numpy().tobytes()
    _, key, gauss = random.getstate()
    _PY.pack_into(
        out, _PY_AT, key[624], struct.pack("<624I", *key[:624]), gauss is not None, gauss or 0.0
    )
    _, nkey, pos, has, cached = np.random.get_state(legacy=True)
    _NP.pack_into(out, _NP_AT, np.asarray(nkey, dtype="<u4").tobytes(), pos, has, cached)
    return bytes(out)


def capture_into(buf: memoryview) -> None:
    """Write this process's snapshot into ``buf`` (at least ``SNAPSHOT`` bytes)."""
    if len(buf) < SNAPSHOT:  # the fast path memmoves: never past the end of a short buffer
        raise ValueError(f"an RNG snapshot needs {SNAPSHOT} bytes, the buffer has {len(buf)}")
    _capture_with(buf, _calibration())


def _capture_with(buf: memoryview, cal: _Calibration) -> None:
    if cal.py_at is None or cal.np_gauss is None:
        buf[:SNAPSHOT] = _slow_capture()
        return
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    state = torch.get_rng_state()
    ctypes.memmove(base, state.data_ptr(), TORCH_BYTES)
    inst: Any = random._inst
    ctypes.memmove(base + _PY_AT, id(inst) + cal.py_at, 2500)
    gauss = inst.gauss_next
    struct.pack_into("<B7xd", buf, _PY_AT + 2500, gauss is not None, gauss or 0.0)
    rs = np.random.mtrand._rand
    bg = rs._bit_generator
    if bg is not cal.np_bg:
        cal.np_bg, cal.np_addr = bg, bg.ctypes.state_address
    ctypes.memmove(base + _NP_AT, cal.np_addr, 2500)
    h, g = cal.np_gauss
    ctypes.memmove(base + _NP_AT + 2500, id(rs) + h, 4)
    ctypes.memmove(base + _NP_AT + 2508, id(rs) + g, 8)


def capture() -> bytes:
    """This process's snapshot as bytes."""
    out = bytearray(SNAPSHOT)
    capture_into(memoryview(out))
    return bytes(out)


def restore(snapshot: bytes) -> None:
    """Set this process's torch, ``random`` and NumPy global states from ``snapshot``."""
    if len(snapshot) != SNAPSHOT:
        raise ValueError(f"an RNG snapshot has {SNAPSHOT} bytes, got {len(snapshot)}")
    torch.set_rng_state(torch.frombuffer(bytearray(snapshot[:TORCH_BYTES]), dtype=torch.uint8))
    index, key, has, gauss = _PY.unpack_from(snapshot, _PY_AT)
    random.setstate((3, (*struct.unpack("<624I", key), index), gauss if has else None))
    nkey, pos, nhas, ngauss = _NP.unpack_from(snapshot, _NP_AT)
    np.random.set_state(("MT19937", np.frombuffer(nkey, dtype="<u4"), pos, nhas, ngauss))


class set_to:  # (lower case: used as a function, ``with set_to(snapshot):``)
    """Inside: this process's torch, ``random`` and NumPy states set from ``snapshot``; after,
    however it ends, put back as they were (a draw made again from a saved run's RNGs that
    leaves this run's as they are). A class, not ``contextlib.contextmanager``: that assigns
    the ``__traceback__`` of an exception passing through, which some refuse (a frozen
    dataclass: review 77)."""

    def __init__(self, snapshot: bytes) -> None:
        self.snapshot = snapshot
        self.outer = b""

    def __enter__(self) -> None:
        self.outer = capture()
        try:
            restore(self.snapshot)
        except BaseException:
            restore(self.outer)
            raise

    def __exit__(self, *exc: object) -> None:
        restore(self.outer)


class RngRing:
    """The snapshot ring of one iterator's workers. The main process creates it (and closes it
    with the iterator); each worker attaches it by spec and publishes into its own entries."""

    def __init__(self, slab: Slab, depth: int) -> None:
        self.slab = slab
        self.depth = depth
        self._count = 0  # publisher side: snapshots written by this worker

    @classmethod
    def create(cls, nworkers: int, depth: int, backend: Any) -> RngRing:
        """The ring of an iterator that starts ``nworkers`` workers. It takes one descriptor in
        this process while it lives; without one to spare, the :class:`ArenaDescriptorError`
        says it is the ring, made when workers start (not an arena slab for held batches)."""
        purpose = (
            f"starting {nworkers} DataLoader worker{'s' if nworkers != 1 else ''}: the "
            "shared-memory ring they publish their RNG state into takes one descriptor here "
            "while the iterator lives, and each worker a few more (a pipe and a process handle)"
        )
        slab = Slab.create(-1, ENTRY_SIZE, nworkers * depth, backend, purpose=purpose)
        afterfork.track_private(slab.segment)  # a child forked beside it lets it go
        return cls(slab, depth)

    @classmethod
    def attach(cls, spec: SlabSpec, depth: int) -> RngRing:
        slab = Slab.attach(spec)
        afterfork.track_private(slab.segment)  # a child the worker forks lets it go
        return cls(slab, depth)

    def publish(self, worker_id: int, epoch: int, seq: int) -> None:
        """Worker side: snapshot this process's RNGs as of now, tagged with the task."""
        buf = self.slab.slot_buffer(worker_id * self.depth + self._count % self.depth)
        self._count += 1
        _TAG.pack_into(buf, 0, 0, 0)
        capture_into(buf[_TAG.size :])
        _TAG.pack_into(buf, 0, epoch + 1, seq)

    def read(self, worker_id: int, epoch: int, seq: int) -> bytes:
        """Main side: the snapshot worker ``worker_id`` published after task ``(epoch, seq)``."""
        tag = (epoch + 1, seq)
        for k in range(self.depth):
            buf = self.slab.slot_buffer(worker_id * self.depth + k)
            if _TAG.unpack_from(buf) == tag:
                out = bytes(buf[_TAG.size : _TAG.size + SNAPSHOT])
                if _TAG.unpack_from(buf) == tag:
                    return out
        raise RuntimeError(
            f"the RNG snapshot of worker {worker_id} after task {seq} of epoch {epoch} is no "
            f"longer in its ring of {self.depth} entries: a bug in shmloader, please report it"
        )

    @property
    def nbytes(self) -> int:
        """The ring's shared memory, in bytes (whole pages); 0 once closed."""
        return 0 if self.slab.segment.closed else self.slab.size

    def close(self) -> None:
        self.slab.close()
