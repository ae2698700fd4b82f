"""Packing a collated batch into its slot: arrays as descriptor records, the rest as a payload.

The batch object is pickled with a ``persistent_id`` hook: every dense CPU tensor and every
NumPy array with a slot dtype becomes a *leaf* — its bytes are placed in the slot (in place if
collate already put them there, else copied once) and the pickle keeps only ``(kind, index)``.
Everything else (structure, strings, odd types) stays in the pickle, the *payload*, which is also
written into the slot. The main process rebuilds the object with the matching
``persistent_load`` (see :mod:`shmloader.lease`).

Invariants:
- Leaf ``i`` of the pickle is ``desc.arrays[i]``; kind ``TENSOR`` comes back as a tensor, kind
  ``NDARRAY`` as a NumPy array, each a view of the slot.
- A leaf already inside the slot (allocated by the session) is never copied.
- A batch made only of exact tuples, lists and dicts, leaves and immutable atoms is walked, not
  pickled, once its structure has been seen: the walk places leaves in the pickler's order, and
  the payload of that structure (the same bytes whatever the leaves hold) is reused.
- If anything did not fit, :attr:`Packed.needed` is the slot size that holds it all and
  :meth:`Packed.write_into` lays the batch out afresh in that bigger slot.
- The payload is laid out last, so a batch uses its slot's bytes up to the payload's end
  (:func:`used_bytes`).
"""

from __future__ import annotations

import copyreg
import io
import pickle
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

import numpy as np
import torch

from arena import DTYPE_CODE, DTYPES, ArraySpec, Descriptor, SlotRef, SlotWriter
from shmloader.collate import SlotSession, SlotView
from shmloader.dtypes import CODE_OF

TENSOR: Final = 0
NDARRAY: Final = 1
# The payload of each batch structure seen (structure signature -> pickle): a steady-state batch
# has the structure of the last one, so the worker pickles it once, not once per batch. Only
# small structures are kept: a batch with many atoms (token lists, file names) carries its data
# in them, so it never matches another, and its signature and payload would only fill the
# worker's memory (256 batches of 32 x 512 token ids held 437 MB per worker).
MAX_PAYLOADS: Final = 256
MAX_ATOMS: Final = 64  # a structure with more atoms than this is pickled every time, as torch
MAX_CACHED_PAYLOAD: Final = 64 << 10  # bytes; a larger payload is not kept either
_PAYLOADS: dict[Any, bytes] = {}
_ATOMS: Final = (type(None), bool, int, float, complex, str, bytes)
_F64: Final = struct.Struct("<d")
_PROTOCOL: Final = pickle.HIGHEST_PROTOCOL


@dataclass
class _Leaf:
    obj: torch.Tensor  # the bytes to place (a NumPy leaf is held as a tensor over its memory)
    code: int
    shape: tuple[int, ...]
    nbytes: int
    offset: int | None  # None: not in the slot (overflow)


def used_bytes(desc: Descriptor) -> int:
    """The bytes of its slot a batch laid out here uses: ``desc.end``, read in O(1)."""
    return desc.payload_offset + desc.payload_len


class Packed:
    """A batch pickled against one session; ready to describe, or to re-lay into a bigger slot."""

    def __init__(self, session: SlotSession, batch: Any) -> None:
        self.session = session
        self.leaves: list[_Leaf] = []
        self._seen: dict[int, int] = {}
        self._walked: set[int] = set()  # ids of the containers walked
        self._atoms = 0
        signature = self._walk(batch)
        payload = _PAYLOADS.get(signature) if signature is not None else None
        if payload is None:  # the pickler finds the walked leaves placed already (_seen)
            payload = self._pickle(batch)
            small = len(payload) <= MAX_CACHED_PAYLOAD
            if signature is not None and small and len(_PAYLOADS) < MAX_PAYLOADS:
                _PAYLOADS[signature] = payload
        self.payload = payload
        self.payload_offset = session.writer.alloc(len(payload))
        if self.payload_offset is None:
            session.overflowed = True
        elif session.array is not None:
            start = self.payload_offset
            session.array[start : start + len(payload)] = np.frombuffer(payload, np.uint8)

    def _pickle(self, batch: Any) -> bytes:
        buf = io.BytesIO()
        pickler = pickle.Pickler(buf, _PROTOCOL)
        pickler.persistent_id = self._persistent_id  # type: ignore[method-assign]
        pickler.dispatch_table = _reducers()
        pickler.dump(batch)
        return buf.getvalue()

    def _walk(self, obj: Any) -> Any:
        """The batch's structure as a hashable signature, placing its leaves in the order the
        pickler would; None when the structure holds anything but exact tuples, lists and dicts,
        leaves and immutable atoms, or one container twice (then the batch is pickled: its
        memo gives the shared container, which a cached payload would give to batches that
        merely look alike)."""
        t = type(obj)
        if t is torch.Tensor or t is np.ndarray:
            pid = self._persistent_id(obj)
            return None if pid is None else pid
        if t is tuple or t is list or t is dict:
            if id(obj) in self._walked:
                return None
            self._walked.add(id(obj))
        if t is tuple or t is list:
            parts = []
            for x in obj:
                sig = self._walk(x)
                if sig is None:
                    return None
                parts.append(sig)
            return (t, *parts)
        if t is dict:
            items = []
            for k, v in obj.items():
                sig = self._walk(v)
                self._atoms += 1  # the key
                if sig is None or type(k) not in _ATOMS or self._atoms > MAX_ATOMS:
                    return None
                items.append((_atom(k), sig))
            return (t, *items)
        if t in _ATOMS:
            self._atoms += 1
            return _atom(obj) if self._atoms <= MAX_ATOMS else None
        return None

    @property
    def fits(self) -> bool:
        return not self.session.overflowed

    @property
    def needed(self) -> int:
        """Bytes of a slot that holds every leaf and the payload, laid out afresh."""
        return SlotWriter.size_of([leaf.nbytes for leaf in self.leaves] + [len(self.payload)])

    def _in_slot(self, leaf: _Leaf) -> bool:
        """Whether ``leaf`` reads the current slot: placed there, or a view of it that could not
        be placed (a non-contiguous view of a ``shmloader.empty`` tensor, say)."""
        return bool(leaf.nbytes) and (leaf.offset is not None or self.session.shares(leaf.obj))

    def detach(self) -> None:
        """Copy every leaf that reads the slot out of it: before the batch is laid out again in
        the same slot (a scratch buffer made it overflow, yet the batch fits), or before the
        worker gives the slot up for a bigger one (the main process frees it at once). A planned
        batch is collated again from its samples: nothing of it is needed from the slot."""
        if self.session.planned:
            return
        for leaf in self.leaves:
            if self._in_slot(leaf):
                leaf.obj = leaf.obj.clone()
                leaf.offset = None

    def describe(self, ref: SlotRef) -> Descriptor:
        """The descriptor of a batch that fit its slot."""
        if not self.fits or self.payload_offset is None:
            raise RuntimeError("batch did not fit its slot; call write_into with a bigger one")
        arrays = tuple(ArraySpec(leaf.offset or 0, leaf.code, leaf.shape) for leaf in self.leaves)
        return Descriptor(ref, arrays, self.payload_offset, len(self.payload))

    def write_into(self, ref: SlotRef, slot: memoryview | SlotView) -> Descriptor:
        """Copy every leaf and the payload into ``slot`` (a bigger one) and describe it there."""
        view = SlotView.of(slot) if isinstance(slot, memoryview) else slot
        writer = SlotWriter(view.size)
        dst = view.tensor
        arrays = []
        for leaf in self.leaves:
            off = writer.alloc(leaf.nbytes)
            if off is None:
                raise RuntimeError(f"slot of {view.size} bytes cannot hold {self.needed} bytes")
            if leaf.nbytes:
                dst[off : off + leaf.nbytes].copy_(_as_bytes(leaf.obj))
            arrays.append(ArraySpec(off, leaf.code, leaf.shape))
        poff = writer.alloc(len(self.payload))
        if poff is None:
            raise RuntimeError(f"slot of {view.size} bytes cannot hold {self.needed} bytes")
        dst[poff : poff + len(self.payload)].numpy()[:] = np.frombuffer(self.payload, np.uint8)
        return Descriptor(ref, tuple(arrays), poff, len(self.payload))

    # -- pickling hook --------------------------------------------------------------------------

    def _persistent_id(self, obj: Any) -> tuple[int, int] | None:
        t = type(obj)
        if t is torch.Tensor:
            kind, tensor = TENSOR, obj
            code = CODE_OF.get(obj.dtype)
            if (
                code is None
                or obj.layout is not torch.strided
                or obj.is_nested  # nested tensors report a strided layout, but have no one shape
                or (obj.device.type != "cpu" and id(obj) not in self.session.placeholders)
                or obj.requires_grad
                or obj.is_conj()
                or obj.is_neg()
            ):
                return None
        elif t is np.ndarray:
            code = DTYPE_CODE.get(obj.dtype.name)
            if (
                code is None
                or not DTYPES[code][2]
                or obj.dtype.byteorder == ">"
                or (obj.flags.f_contiguous and not obj.flags.c_contiguous)  # pickle keeps F order
            ):
                return None
            kind, tensor = NDARRAY, torch.from_numpy(np.ascontiguousarray(obj).reshape(obj.shape))
        else:
            return None
        key = id(obj)
        if key in self._seen:
            return (kind, self._seen[key])
        self._seen[key] = len(self.leaves)
        self.leaves.append(self._place(tensor, code))
        return (kind, self._seen[key])

    def _place(self, t: torch.Tensor, code: int) -> _Leaf:
        shape = tuple(t.shape)
        nbytes = t.numel() * t.element_size()
        s = self.session
        if nbytes == 0:
            return _Leaf(t, code, shape, 0, 0)
        if t.is_meta:  # a planned leaf (one of the session's placeholders): only its size counts
            s.overflowed = True
            return _Leaf(t, code, shape, nbytes, None)
        if t.is_contiguous() and s.holds(t.data_ptr(), nbytes):
            return _Leaf(t, code, shape, nbytes, t.data_ptr() - s.base)
        off = s.writer.alloc(nbytes) if s.bytes is not None else None
        if off is None or s.bytes is None:
            s.overflowed = True
            return _Leaf(t, code, shape, nbytes, None)
        s.bytes[off : off + nbytes].view(t.dtype).view(shape).copy_(t)
        return _Leaf(t, code, shape, nbytes, off)


# Review 32: plain pickle of a CPU ``UntypedStorage`` (torch 2.13) goes through torch's legacy
# ``torch.save``, whose load raises ``AttributeError`` (no ``dtype``), and so did every tensor
# pickled with its storage (``bits8``: a dtype no slot holds). torch's workers send them with
# their ForkingPickler (shared memory), so torch's loader delivers them; shmloader pickles the
# storage's bytes instead, and delivers a private copy.


def _untyped_storage(data: bytes) -> torch.UntypedStorage:
    """A CPU ``UntypedStorage`` holding ``data``."""
    return torch.UntypedStorage.from_buffer(data, dtype=torch.uint8)


def _typed_storage(data: bytes, dtype: torch.dtype) -> Any:
    """What torch's tensor rebuild functions take: a ``TypedStorage`` over ``data``."""
    return torch.TypedStorage(  # type: ignore[no-untyped-call]
        wrap_storage=_untyped_storage(data), dtype=dtype, _internal=True
    )


def _storage_bytes(storage: torch.UntypedStorage) -> bytes:
    """A CPU storage's bytes, copied at memory speed (``bytes(storage)`` reads them one by one
    in Python: 1.5 s a MiB, review 34)."""
    if not storage.nbytes():
        return b""
    view = torch.empty(0, dtype=torch.uint8).set_(storage)
    return view.numpy().tobytes()


def _reduce_storage(storage: torch.UntypedStorage) -> Any:
    if storage.device.type != "cpu":
        return storage.__reduce__()  # type: ignore[no-untyped-call]
    return _untyped_storage, (_storage_bytes(storage),)


class _StorageOf(NamedTuple):
    """Pickles as the ``TypedStorage`` a tensor rebuild takes, over a CPU storage's bytes."""

    storage: torch.UntypedStorage
    dtype: torch.dtype

    def __reduce__(self) -> Any:
        return _typed_storage, (_storage_bytes(self.storage), self.dtype)


_REBUILDS: Final = (torch._utils._rebuild_tensor_v2, torch._utils._rebuild_tensor_v3)


class _TensorReducer:
    """For one pickle: a plain tensor no slot holds (``persistent_id`` declined it), as torch
    pickles it, with a CPU storage pickled as its bytes, once per storage and dtype (one
    ``_StorageOf`` each, which the pickle's memo then sends once: tensors viewing one storage
    share it again after the unpickle, as torch's do)."""

    __slots__ = ("_of",)

    def __init__(self) -> None:
        self._of: dict[tuple[int, torch.dtype], _StorageOf] = {}

    def __call__(self, t: torch.Tensor) -> Any:
        rv = t.__reduce_ex__(_PROTOCOL)  # type: ignore[no-untyped-call]
        if (
            isinstance(rv, tuple)
            and rv[0] in _REBUILDS
            and type(rv[1][0]) is torch.UntypedStorage
            and rv[1][0].device.type == "cpu"
        ):
            storage = rv[1][0]
            key = (storage._cdata, t.dtype)
            of = self._of.get(key)
            if of is None:
                of = self._of[key] = _StorageOf(storage, t.dtype)
            return rv[0], (of, *rv[1][1:]), *rv[2:]
        return rv


def _reducers() -> dict[type, Callable[[Any], Any]]:
    """The payload pickler's dispatch table: copyreg's as it is now (a user's registrations
    apply, as with plain pickle), plus the storage and tensor reductions above."""
    return {
        **copyreg.dispatch_table,
        torch.UntypedStorage: _reduce_storage,
        torch.Tensor: _TensorReducer(),
    }


def _atom(obj: Any) -> Any:
    """An atom's part of a signature: equal only for atoms that pickle the same. Floats and
    complex numbers go by their bits (``0.0 == -0.0``, and NaN's sign is kept)."""
    t = type(obj)
    if t is float:
        return (t, _F64.pack(obj))
    if t is complex:
        return (t, _F64.pack(obj.real), _F64.pack(obj.imag))
    return (t, obj)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    flat = t.contiguous().reshape(-1)
    if flat.numel() == 1 and flat.stride(0) != 1:
        # One element is "contiguous" whatever its stride (``boxes[:, 0]`` of a one-row matrix,
        # ``expand(1)``), and ``contiguous()`` keeps that stride, which a byte view refuses.
        flat = flat.as_strided((1,), (1,))
    return flat.view(torch.uint8)
