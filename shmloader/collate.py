"""Collation straight into slot memory, in a worker: the one copy each batch byte gets.

While a worker runs a task, a :class:`SlotSession` is current. Two things allocate from it:
- the default collate (torch's own ``collate`` dispatch with the tensor and int rules replaced),
  which sizes each stacked leaf from its first sample and ``torch.stack``-s the samples into the
  slot (a large leaf with streaming stores where they measure faster: ``shmloader.stacking``),
  and writes a batch of plain int labels into the slot too;
- :func:`empty`, the public helper a custom ``collate_fn`` calls to allocate its outputs inside the
  slot (``torch.empty`` when no session is current, e.g. under torch's own DataLoader).

A dataset's ``__getitems__`` may return :class:`GatheredRows` (``shmloader.arrow`` does): to any
collate_fn it is the list of samples, but the default collate asks it to collate itself, which
lets it gather whole columns straight into the slot instead of stacking per-sample tensors.
Without workers, :func:`private_default_collate` gives GatheredRows the same say, in private
memory.

Invariants:
- Allocation never fails. When the slot is full (or there is none yet), :func:`empty` allocates in
  private memory and marks the session ``overflowed``; packing then asks for a bigger slot and
  copies once more. The default collate never allocates privately: it *plans* instead — the
  output becomes a ``meta`` tensor (shape and dtype, no bytes), the session is marked
  ``planned``, and once a big enough slot is granted the worker collates the same samples again,
  straight into it. Steady state takes no extra copy and no private batch-sized buffer.
- Allocation is thread-safe: a collate may call :func:`empty` from a pool of threads (each range
  is handed out once). Packing, after the collate returns, runs in the worker's own thread.
"""

from __future__ import annotations

import math
import operator
import threading
import weakref
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Sequence
from typing import Any, Final, NamedTuple

import numpy as np
import torch

from arena import SlotWriter
from arena._layout import page_align
from shmloader import kept, stacking
from shmloader._torch_compat import (
    collate,
    collate_float_fn,
    collate_int_fn,
    collate_numpy_array_fn,
    collate_numpy_scalar_fn,
    collate_str_fn,
    collate_tensor_fn,
    default_collate_fn_map,
    torch_function_mode_active,
)
from shmloader.dtypes import CODE_OF, NUMPY_DTYPE
from shmloader.kept import HANDED

_session: SlotSession | None = None

Alloc = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


class GatheredRows(list):  # type: ignore[type-arg]
    """A batch of samples that can collate itself (a dataset's ``__getitems__`` returns one).

    To every collate_fn, torch's ``default_collate`` included, it is the list of samples. The
    default collate instead calls :meth:`collate_into`, which returns what ``default_collate``
    would return for those samples, every tensor allocated by ``alloc(shape, dtype)`` (inside the
    slot, or a ``meta`` tensor to leave unfilled while the session plans), or ``NotImplemented``
    to have the samples collated one by one.
    """

    def collate_into(self, alloc: Alloc) -> Any:
        return NotImplemented


class SlotView(NamedTuple):
    """One slot's memory, viewed every way a session needs it (made once per slot and reused:
    a worker writes many batches into the same slots)."""

    memory: memoryview
    tensor: torch.Tensor  # uint8
    array: np.ndarray  # uint8, the same bytes
    base: int  # address of the first byte
    size: int

    @classmethod
    def of(cls, memory: memoryview) -> SlotView:
        array = np.frombuffer(memory, np.uint8)
        return cls(memory, torch.from_numpy(array), array, int(array.ctypes.data), len(memory))


class SlotSession:
    """One batch being written into one slot (``slot is None``: no slot granted yet)."""

    def __init__(self, slot: memoryview | SlotView | None) -> None:
        view = SlotView.of(slot) if isinstance(slot, memoryview) else slot
        self.slot = None if view is None else view.memory
        self.writer = SlotWriter(0 if view is None else view.size)
        self.bytes: torch.Tensor | None = None if view is None else view.tensor
        self.array: np.ndarray | None = None if view is None else view.array
        self.base = 0 if view is None else view.base
        self.overflowed = False
        self.planned = False
        # A batch that does not fit is planned (collated with placeholders, then again into a
        # slot that fits) only if collating twice is the same as once (_plannable): else it
        # goes to private memory, collated once.
        self.first_sample: Any = None
        self.may_plan = True
        self.placeholders: set[int] = set()  # ids of the meta tensors planning handed out
        self._lock = threading.Lock()

    def empty(
        self, shape: Sequence[int], dtype: torch.dtype, plan: bool = False, watch: bool = False
    ) -> torch.Tensor:
        """An uninitialised tensor inside the slot if it fits; else, with ``plan``, a ``meta``
        tensor (the session is then ``planned``), otherwise one in private memory. ``watch``:
        one in the slot is recorded in :data:`shmloader.kept.HANDED` (the public
        :func:`empty`'s, while the collate_fn runs)."""
        nbytes = math.prod(shape) * dtype.itemsize
        off = None
        if self.bytes is not None and dtype in CODE_OF and nbytes > 0 and not self.planned:
            with self._lock:  # a collate may call empty() from a thread pool
                off = self.writer.alloc(nbytes)
        if off is not None:
            # From a NumPy slice (several times cheaper than torch's), so that the tensor's
            # storage is its own bytes, as torch.empty's is: a view of the whole slot's storage
            # pickled whole when the collate returned it with requires_grad, or as a bits8
            # view or a storage, and the slot grew with every batch (review 35).
            raw = self.array[off : off + nbytes]  # type: ignore[index]
            npdtype = NUMPY_DTYPE.get(dtype)
            if npdtype is not None:
                raw = raw.view(npdtype).reshape(tuple(shape))
            if watch:
                HANDED.append(weakref.ref(raw))  # alive while the tensor's storage (shmloader.kept)
            if npdtype is not None:
                return torch.from_numpy(raw)
            return torch.from_numpy(raw).view(dtype).view(tuple(shape))
        if nbytes == 0 or dtype not in CODE_OF:
            return torch.empty(tuple(shape), dtype=dtype)
        self.overflowed = True
        if plan and self.may_plan and not self.planned:
            # Looked at once, when planning would start: a pure collate (the only kind planned)
            # has changed nothing in the sample so far.
            self.may_plan = self.first_sample is None or _plannable(self.first_sample)
        if plan and self.may_plan:
            self.planned = True
            out = torch.empty(tuple(shape), dtype=dtype, device="meta")
            self.placeholders.add(id(out))  # a meta tensor of the user's own is a plain object
            return out
        return torch.empty(tuple(shape), dtype=dtype)

    def slot_range(self) -> tuple[int, int] | None:
        """The ``(address, bytes)`` of the part of this session's slot handed out so far, in
        whole pages (a slot starts on a page and spans whole pages); None without a slot, or
        with none of it handed out."""
        used = self.writer.used
        return (self.base, page_align(used)) if self.slot is not None and used else None

    def holds(self, ptr: int, nbytes: int) -> bool:
        """Whether ``[ptr, ptr + nbytes)`` lies inside this session's slot."""
        return (
            self.bytes is not None
            and self.base <= ptr
            and ptr + nbytes <= (self.base + self.writer.capacity)
        )

    def shares(self, t: torch.Tensor) -> bool:
        """Whether ``t`` views this session's slot, however strided (its storage overlaps it)."""
        if self.bytes is None or t.is_meta or t.device.type != "cpu":
            return False
        storage = t.untyped_storage()
        lo = storage.data_ptr()
        return lo < self.base + self.writer.capacity and self.base < lo + storage.nbytes()

    def __enter__(self) -> SlotSession:
        global _session
        _session = self
        return self

    def __exit__(self, *exc: object) -> None:
        global _session
        _session = None


def current_session() -> SlotSession | None:
    """The session of the batch this process is writing now, if any (a worker inside a task)."""
    return _session


def end_session_after_fork() -> None:
    """In a child forked inside a task: no session (its slot is the parent's batch)."""
    global _session
    _session = None


# torch.empty's keywords that a slot cannot honour: their defaults are accepted, anything else is
# a TypeError giving the reason and what to do instead.
_SLOT_KEYWORDS: dict[str, tuple[Any, str]] = {
    "out": (None, "write into the tensor shmloader.empty() returns instead"),
    "layout": (torch.strided, "a slot holds strided tensors only"),
    "memory_format": (torch.contiguous_format, "a slot holds contiguous tensors only"),
    "pin_memory": (False, "pass pin_memory=True to the DataLoader: it pins the whole arena once"),
    "requires_grad": (False, "set requires_grad on the batch the loader yields"),
}


def _shape(size: tuple[Any, ...]) -> tuple[int, ...]:
    """``size`` as torch.empty reads it (ints, or one sequence of ints), with torch's errors."""
    items = size[0] if len(size) == 1 and isinstance(size[0], Sequence) else size
    shape = []
    for pos, item in enumerate(items):
        if isinstance(item, bool) or not hasattr(item, "__index__"):
            raise TypeError(
                "empty(): argument 'size' must be tuple of ints, but found element of type "
                f"{type(item).__name__} at pos {pos}"
            )
        shape.append(operator.index(item))
    return tuple(shape)


def empty(
    *size: Any,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """Like ``torch.empty(*size, dtype=dtype)``, allocated inside the current batch's arena slot.

    Call it from a custom ``collate_fn`` for the batch's output tensors (fill them in place, e.g.
    padding), and shmloader carries them to the main process without another copy. Outside a
    shmloader worker it is exactly ``torch.empty``. Memory is uninitialised, as with
    ``torch.empty``: write every element you use. In a slot the tensor cannot grow
    (``resize_`` past its size raises torch's error): allocate the size you need. The memory
    is the batch's: do not keep the tensor past the collate's call (the slot is reused once the
    batch is consumed; keep a ``.clone()``). A worker that finds one its collate_fn kept warns
    once (:mod:`shmloader.kept`).

    Accepted as in ``torch.empty``: the size as ints or one sequence (or ``size=``), ``dtype=``,
    ``device=`` (CPU only: a slot is host memory). ``out``, ``layout``, ``memory_format``,
    ``pin_memory`` and ``requires_grad`` are accepted at their defaults only; other values, and
    unknown keywords, raise ``TypeError`` — in and out of a worker alike, so a collate behaves
    the same under both loaders.
    """
    if "size" in kwargs:
        if size:
            raise TypeError("empty() got multiple values for argument 'size'")
        size = (kwargs.pop("size"),)
    for name, value in kwargs.items():
        if name not in _SLOT_KEYWORDS:
            raise TypeError(f"empty() got an unexpected keyword argument '{name}'")
        default, reason = _SLOT_KEYWORDS[name]
        if value is not default and value != default:
            raise TypeError(
                f"shmloader.empty() does not take {name}={value!r} ({reason}); "
                f"leave {name} at its default {default!r}"
            )
    if not size:
        raise TypeError('empty() missing 1 required positional arguments: "size"')
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(
            f"empty(): argument 'dtype' must be torch.dtype, not {type(dtype).__name__}"
        )
    if device is not None and torch.device(device).type != "cpu":
        raise ValueError(
            f"shmloader.empty() allocates in the batch's shared-memory slot, which is CPU memory; "
            f"got device={device!r}. Allocate on the CPU and move the batch in the training loop "
            f"(batch.to({str(device)!r}, non_blocking=True); with pin_memory=True that copy reads "
            "straight from the slot)"
        )
    shape = _shape(size)
    dt = torch.get_default_dtype() if dtype is None else dtype
    if _session is None:
        return torch.empty(shape, dtype=dt)
    return _session.empty(shape, dt, watch=kept.collating)


def _collate_tensor_in_slot(
    batch: Sequence[torch.Tensor], *, collate_fn_map: dict[Any, Any] | None = None
) -> torch.Tensor:
    elem = batch[0]
    if (
        _session is None
        or elem.layout is not torch.strided
        or elem.is_nested
        or elem.device.type != "cpu"
    ):
        return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)  # type: ignore[no-any-return]
    out = _session.empty((len(batch), *elem.shape), elem.dtype, plan=True)
    if out.is_meta:
        return out  # planning: the samples are stacked once a slot that fits is granted
    if (
        out.nbytes >= stacking.STREAM_MIN_BYTES
        and stacking.STREAMING
        and isinstance(batch, list | tuple)  # what torch.stack takes (else its TypeError below)
        and stacking.streamable(batch, elem, out)
    ):
        return stacking.stack_large(batch, out)
    try:
        # As torch passes it: a batch that is itself a Tensor (a dataset's __getitems__ may
        # return one) raises torch's TypeError, not stacked row by row (review 32).
        return torch.stack(batch, 0, out=out)  # type: ignore[arg-type]
    except TypeError:  # a non-tensor among the samples: raise exactly what torch raises, below
        pass  # (outside this block, so that torch's error does not carry ours as its context)
    except RuntimeError:
        # Samples of unequal sizes. torch's workers first size a shared output by the samples'
        # total numel and resize it to the stacked shape: when that total is short, the resize
        # fails before stack can, with this message (num_workers=0 gives stack's).
        if sum(x.numel() for x in batch) < out.numel():
            raise RuntimeError("Trying to resize storage that is not resizable") from None
        raise
    return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)  # type: ignore[no-any-return]


_INT64: Final = np.dtype(np.int64)
_PLAIN_INTS: Final = frozenset({int, bool})


def _collate_ints(
    batch: Sequence[int], *, collate_fn_map: dict[Any, Any] | None = None
) -> torch.Tensor:
    """torch's rule for a batch led by an ``int`` (``torch.tensor(batch)``), 6-7x faster.

    ``torch.tensor`` infers a type per element: 43 us for 256 labels, a tenth of a ``tabular``
    batch's collate. For a batch of plain ``int`` and ``bool`` only, ``np.array`` gives the same
    numbers, and int64 exactly when torch does (not all bools, all within int64). Any other
    batch (another element type, even an int subclass or a NumPy scalar, whose conversions and
    warnings differ; all bools; an int beyond int64), and any batch while a torch function mode
    is on (a default device, which ``torch.tensor`` follows and ``torch.from_numpy`` does not),
    goes to torch's own rule, which gives torch's tensor or raises torch's error. In a session
    the labels are written into the slot (planned, like a stacked leaf, when they do not fit)."""
    if torch_function_mode_active() or not {*map(type, batch)} <= _PLAIN_INTS:
        return torch.tensor(batch)
    arr = np.array(batch)
    if arr.dtype != _INT64:  # all bools, or an int beyond int64 (object or uint64)
        return torch.tensor(batch)
    if _session is None:
        return torch.from_numpy(arr)
    # Born in the slot like a stacked leaf, so packing finds it placed and copies nothing.
    out = _session.empty((len(arr),), torch.int64, plan=True)
    if not out.is_meta:
        out.numpy()[:] = arr
    return out


# torch's entries that slot versions replace, while they are torch's own: an entry the user
# registered (torch documents default_collate_fn_map as the way to extend default_collate) wins.
_SLOT_VERSIONS: Final = (
    (torch.Tensor, collate_tensor_fn, _collate_tensor_in_slot),
    (int, collate_int_fn, _collate_ints),
)
# torch's own entries of default_collate_fn_map and the slot versions: pure functions of the
# samples (what _plannable requires of every entry)
_PURE_COLLATES: Final = frozenset(
    {*(torchs for _, torchs, _ in _SLOT_VERSIONS), *(ours for _, _, ours in _SLOT_VERSIONS),
     collate_numpy_array_fn, collate_numpy_scalar_fn, collate_float_fn, collate_str_fn}
)  # fmt: skip
_map_of: tuple[tuple[Any, Any], ...] = ()  # default_collate_fn_map's items the map was made of
_slot_map: dict[Any, Any] = {}


def slot_collate_fn_map() -> dict[Any, Any]:
    """``default_collate_fn_map`` as it is now, torch's tensor and int entries replaced by ones
    that collate into the slot (made again only when the map changed)."""
    global _map_of, _slot_map
    items = tuple(default_collate_fn_map.items())
    if items != _map_of:
        fresh = dict(items)
        for typ, torchs, ours in _SLOT_VERSIONS:
            if fresh.get(typ) is torchs:
                fresh[typ] = ours
        _map_of, _slot_map = items, fresh
    return _slot_map


_PLAIN_CONTAINERS: Final = frozenset({dict, OrderedDict, defaultdict, list, tuple})
_PLAIN_LEAVES: Final = (np.ndarray, np.generic, int, float, str, bytes)


def _plannable(elem: Any) -> bool:
    """Whether a batch led by ``elem`` may be planned: collated with placeholders, then again
    into a slot that fits. Only when collating it twice is the same as once: every entry of
    torch's ``default_collate_fn_map`` is torch's own or a slot version (a user's may draw
    random numbers, or have other effects), and ``elem`` is built of plain containers (dict,
    OrderedDict, defaultdict, list, tuple, and named tuples as ``namedtuple`` or ``NamedTuple``
    made them, not subclasses that may redefine ``__new__``: torch's collate copies them apart or
    builds new ones) and plain tensors (not subclasses, whose ``__torch_function__`` may do
    anything), arrays, numbers and strings. Anything else (a custom mapping, whose
    ``copy.copy`` torch fills may share the sample's contents, or any other type) goes to
    private memory when it does not fit, collated once."""
    if any(fn not in _PURE_COLLATES for fn in default_collate_fn_map.values()):
        return False
    stack = [elem]
    while stack:
        x = stack.pop()
        kind = type(x)
        if kind in _PLAIN_CONTAINERS or (isinstance(x, tuple) and "_fields" in vars(kind)):
            stack.extend(x.values() if isinstance(x, dict) else x)
        elif kind is not torch.Tensor and not isinstance(x, _PLAIN_LEAVES):
            return False
    return True


def _alloc_in_slot(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if _session is None:
        return torch.empty(shape, dtype=dtype)
    return _session.empty(shape, dtype, plan=True)


def private_default_collate(batch: Any) -> Any:
    """``torch.utils.data.default_collate`` for the ``num_workers=0`` loader: the same batch, but
    :class:`GatheredRows` collate themselves (in private memory), so a dataset's own checks and
    error messages (``shmloader.arrow``'s ragged-column hint) are the same with and without
    workers, and whole columns are gathered instead of rows."""
    if isinstance(batch, GatheredRows):
        out = batch.collate_into(private_empty)
        if out is not NotImplemented:
            return out
    return torch.utils.data.default_collate(batch)


def private_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An :data:`Alloc` in this process's own memory, whatever session is current."""
    return torch.empty(shape, dtype=dtype)


def slot_default_collate(batch: Any) -> Any:
    """``torch.utils.data.default_collate`` with every stacked tensor born in the slot."""
    if isinstance(batch, GatheredRows):
        out = batch.collate_into(_alloc_in_slot)
        if out is not NotImplemented:
            return out
    if _session is not None and isinstance(batch, list | tuple) and batch:
        _session.first_sample = batch[0]  # looked at only if the batch must be planned
    return collate(batch, collate_fn_map=slot_collate_fn_map())
