"""Typed messages between the main process and one worker, and their byte encoding.

Every message is one ``bytes`` frame on that worker's duplex pipe. Its first byte is a
:class:`Kind`; the rest is fixed ``struct`` fields, followed for some kinds by one pickle (an
exception, a slab spec) or raw bytes (a batch's indices, a batch's layout).

Main -> worker: ``TASK`` (fetch this index into this slot -- or into no slot yet, when none was
free at dispatch), ``GRANT`` (the slot for a task: offered as soon as one frees up, or the answer
to a ``NEED_SLOT``), ``DENY`` (that slot can never exist: the batch is larger than the arena's
cap; the main process raises the error, the worker moves on), ``ATTACH`` (map a new slab),
``DETACH`` (unmap a slab the arena gave back), ``REVOKE`` (a task the worker has not started
loses the slot it was sent with: it asks for one when it gets there), ``RESUME`` (a new epoch
begins), ``STOP`` (exit).
Worker -> main: ``READY`` (the batch is in the slot, using so many of its bytes; its layout
follows), ``NEED_SLOT`` (the batch needs ``nbytes``; the worker waits for ``GRANT`` or
``DENY``), ``FAILED`` (dataset or collate raised), ``EXHAUSTED`` (the worker's IterableDataset
replica is done), ``DROPPED`` (the task belongs to an epoch that a later ``RESUME`` abandoned:
fetched, as torch does, but its slot was not touched), ``REPLICA`` (the state of the worker's
IterableDataset replica after a task, pickled, sent just before that task's answer; only for
datasets with ``state_dict`` / ``load_state_dict``, for ``DataLoader.state_dict()``).

A task's index travels as raw little-endian int64 when it is a :class:`PackedIndices` (the fast
sampler path, :mod:`shmloader.sampling`: the worker gets a ``list`` of ``int``, as torch's batch
sampler gives) and pickled otherwise.

A ``READY`` frame is ``_READY`` + the batch's :class:`~arena.Descriptor` bytes. The descriptor's
bytes after its slot reference (``LAYOUT_AT``) are the batch's *layout*: equal layouts describe
batches with the same arrays at the same offsets, which the main process rebuilds from a cached
template (:mod:`shmloader.rebuild`) without decoding the descriptor again.

Invariants: frames of one worker arrive in the order sent; every ``TASK`` is answered by exactly
one of ``READY``, ``FAILED``, ``EXHAUSTED``, ``DROPPED``, or a ``NEED_SLOT`` the worker then
abandons because a ``RESUME`` or ``STOP`` came instead of the answer -- unless the worker is told
to ``STOP``, dies, or its replica is already exhausted and the task is of the current epoch
(then it answers nothing and the main process reclaims the slot). Every ``NEED_SLOT`` is
answered by ``GRANT`` (possibly of the slot the task already has) or ``DENY``, unless its epoch
was abandoned. ``epoch`` tags let the main
process release the slots of tasks of an abandoned epoch as their answers arrive.
"""

from __future__ import annotations

import enum
import pickle
import struct
from array import array
from typing import Any, Final, NamedTuple

from arena import Descriptor, SlabSpec, SlotRef


class Kind(enum.IntEnum):
    TASK = 1
    GRANT = 2
    ATTACH = 3
    RESUME = 4
    STOP = 5
    DENY = 6
    DETACH = 7
    REVOKE = 8
    READY = 16
    NEED_SLOT = 17
    FAILED = 18
    EXHAUSTED = 19
    DROPPED = 20
    REPLICA = 21


class IndexCoding(enum.IntEnum):
    PICKLE = 0
    INT64 = 1


class PackedIndices(bytes):
    """A batch of sampler indices as little-endian int64 bytes (from :mod:`shmloader.sampling`);
    the worker receives it as a ``list`` of ``int``."""

    __slots__ = ()


# kind, seq, epoch, has_slot, slab_id, slot, generation, index coding
_TASK: Final = struct.Struct("<BQIBIIIB")
# kind, seq, epoch, worker_id, the bytes of the slot the batch uses (+ descriptor)
_READY: Final = struct.Struct("<BQIIQ")
# the descriptor's leading slab_id, slot, generation (arena._layout.DESC_HEAD's first fields)
_REF: Final = struct.Struct("<III")
# where a READY frame's layout starts: after _READY and the descriptor's (slab, slot, generation)
LAYOUT_AT: Final = _READY.size + _REF.size
# kind, seq, epoch, worker_id, nbytes, has_slot, slab_id, slot, generation (the slot it has)
_NEED: Final = struct.Struct("<BQIIQBIII")
# kind, seq, epoch, slab_id, slot, generation
_GRANT: Final = struct.Struct("<BQIIII")
# kind, epoch
_RESUME: Final = struct.Struct("<BI")
# kind, seq, epoch (DENY and REVOKE)
_DENY: Final = struct.Struct("<BQI")
# kind, slab_id
_DETACH: Final = struct.Struct("<BI")
# kind, seq, epoch, worker_id (+ pickle)
_EVENT: Final = struct.Struct("<BQII")
_KIND: Final = struct.Struct("<B")
_PICKLE = pickle.HIGHEST_PROTOCOL
_NO_SLOT: Final = (0, 0, 0, 0)


class Task(NamedTuple):
    seq: int
    epoch: int
    ref: SlotRef | None
    index: Any


class Grant(NamedTuple):
    seq: int
    epoch: int
    ref: SlotRef


class Attach(NamedTuple):
    spec: SlabSpec


class Detach(NamedTuple):
    slab_id: int


class Resume(NamedTuple):
    epoch: int
    shared_seed: int | None


class Stop(NamedTuple):
    pass


class Revoke(NamedTuple):
    seq: int
    epoch: int


class Deny(NamedTuple):
    seq: int
    epoch: int


class Ready(NamedTuple):
    """A batch is in ``ref``, using its first ``nbytes`` bytes; ``frame`` is the whole READY
    frame (see :func:`descriptor`)."""

    seq: int
    epoch: int
    worker_id: int
    ref: SlotRef
    nbytes: int
    frame: bytes


class NeedSlot(NamedTuple):
    seq: int
    epoch: int
    worker_id: int
    nbytes: int
    ref: SlotRef | None  # the slot it had (None: none); it never touches that slot again


class Failed(NamedTuple):
    seq: int
    epoch: int
    worker_id: int
    error: Any  # torch._utils.ExceptionWrapper


class Exhausted(NamedTuple):
    seq: int
    epoch: int
    worker_id: int


class Dropped(NamedTuple):
    seq: int
    epoch: int
    worker_id: int


class ReplicaState(NamedTuple):
    seq: int
    epoch: int
    worker_id: int
    state: bytes  # pickle of the replica's ``state_dict()`` after task ``seq``, or UNSAVABLE + why
    ended: bool  # the replica ran out inside that batch (a short last batch): none comes after


UNSAVABLE: Final = b"!"  # no pickle starts so (protocol 2+ begins with PROTO, b"\x80")


ToWorker = Task | Grant | Attach | Detach | Resume | Stop | Deny | Revoke
ToMain = Ready | NeedSlot | Failed | Exhausted | Dropped | ReplicaState


def as_received(index: Any) -> Any:
    """``index`` as a worker receives it in a TASK (a copy through its pickle; a
    :class:`PackedIndices` as it is): what an index drawn long before its task is sent keeps
    (a sampler may change the object it yielded at its next draw). One that does not pickle
    is kept as it is: sending it raises then, as torch's loader does."""
    if type(index) is PackedIndices:
        return index
    try:
        return pickle.loads(pickle.dumps(index, _PICKLE))
    except Exception:  # noqa: BLE001
        return index


def ready(seq: int, epoch: int, worker_id: int, desc: Descriptor, nbytes: int) -> bytes:
    """The READY frame for a batch described by ``desc`` that uses ``nbytes`` of its slot
    (``desc.end``; the worker's hot path)."""
    return _READY.pack(Kind.READY, seq, epoch, worker_id, nbytes) + desc.encode()


def descriptor(msg: Ready) -> Descriptor:
    """The full descriptor a READY frame carries (decoded on demand: cached layouts skip it)."""
    return Descriptor.decode(msg.frame, _READY.size)


def layout(msg: Ready) -> bytes:
    """The layout bytes of a READY frame: equal for batches laid out alike in any slot."""
    return msg.frame[LAYOUT_AT:]


def encode(msg: ToWorker | ToMain) -> bytes:
    """One frame for ``msg``."""
    if isinstance(msg, Task):
        r = msg.ref
        slot = _NO_SLOT if r is None else (1, r.slab_id, r.slot, r.generation)
        if type(msg.index) is PackedIndices:
            return _TASK.pack(Kind.TASK, msg.seq, msg.epoch, *slot, IndexCoding.INT64) + msg.index
        head = _TASK.pack(Kind.TASK, msg.seq, msg.epoch, *slot, IndexCoding.PICKLE)
        return head + pickle.dumps(msg.index, _PICKLE)
    if isinstance(msg, Ready):
        return msg.frame
    if isinstance(msg, NeedSlot):
        r = msg.ref
        slot = _NO_SLOT if r is None else (1, r.slab_id, r.slot, r.generation)
        return _NEED.pack(Kind.NEED_SLOT, msg.seq, msg.epoch, msg.worker_id, msg.nbytes, *slot)
    if isinstance(msg, Grant):
        r = msg.ref
        return _GRANT.pack(Kind.GRANT, msg.seq, msg.epoch, r.slab_id, r.slot, r.generation)
    if isinstance(msg, Failed):
        head = _EVENT.pack(Kind.FAILED, msg.seq, msg.epoch, msg.worker_id)
        return head + pickle.dumps(msg.error, _PICKLE)
    if isinstance(msg, Exhausted):
        return _EVENT.pack(Kind.EXHAUSTED, msg.seq, msg.epoch, msg.worker_id)
    if isinstance(msg, Dropped):
        return _EVENT.pack(Kind.DROPPED, msg.seq, msg.epoch, msg.worker_id)
    if isinstance(msg, ReplicaState):
        head = _EVENT.pack(Kind.REPLICA, msg.seq, msg.epoch, msg.worker_id)
        return head + (b"\x01" if msg.ended else b"\x00") + msg.state
    if isinstance(msg, Attach):
        return _KIND.pack(Kind.ATTACH) + pickle.dumps(msg.spec, _PICKLE)
    if isinstance(msg, Detach):
        return _DETACH.pack(Kind.DETACH, msg.slab_id)
    if isinstance(msg, Resume):
        return _RESUME.pack(Kind.RESUME, msg.epoch) + pickle.dumps(msg.shared_seed, _PICKLE)
    if isinstance(msg, Stop):
        return _KIND.pack(Kind.STOP)
    if isinstance(msg, Deny):
        return _DENY.pack(Kind.DENY, msg.seq, msg.epoch)
    if isinstance(msg, Revoke):
        return _DENY.pack(Kind.REVOKE, msg.seq, msg.epoch)
    raise TypeError(f"not a protocol message: {msg!r}")


def decode(frame: bytes) -> ToWorker | ToMain:
    """The message ``frame`` encodes."""
    kind = frame[0]
    if kind == Kind.READY:
        _, seq, epoch, wid, nbytes = _READY.unpack_from(frame)
        slot_ref = SlotRef._make(_REF.unpack_from(frame, _READY.size))
        return Ready(seq, epoch, wid, slot_ref, nbytes, frame)
    if kind == Kind.TASK:
        _, seq, epoch, has, slab_id, slot, gen, coding = _TASK.unpack_from(frame)
        task_ref = SlotRef(slab_id, slot, gen) if has else None
        body = memoryview(frame)[_TASK.size :]
        if coding == IndexCoding.INT64:
            indices = array("q")
            indices.frombytes(body)
            return Task(seq, epoch, task_ref, indices.tolist())
        return Task(seq, epoch, task_ref, pickle.loads(body))
    if kind == Kind.NEED_SLOT:
        _, seq, epoch, wid, nbytes, has, slab_id, slot, gen = _NEED.unpack_from(frame)
        ref = SlotRef(slab_id, slot, gen) if has else None
        return NeedSlot(seq, epoch, wid, nbytes, ref)
    if kind == Kind.GRANT:
        _, seq, epoch, slab_id, slot, gen = _GRANT.unpack_from(frame)
        return Grant(seq, epoch, SlotRef(slab_id, slot, gen))
    if kind == Kind.FAILED:
        _, seq, epoch, wid = _EVENT.unpack_from(frame)
        return Failed(seq, epoch, wid, pickle.loads(memoryview(frame)[_EVENT.size :]))
    if kind == Kind.EXHAUSTED:
        _, seq, epoch, wid = _EVENT.unpack_from(frame)
        return Exhausted(seq, epoch, wid)
    if kind == Kind.DROPPED:
        _, seq, epoch, wid = _EVENT.unpack_from(frame)
        return Dropped(seq, epoch, wid)
    if kind == Kind.REPLICA:
        _, seq, epoch, wid = _EVENT.unpack_from(frame)
        ended = frame[_EVENT.size] == 1
        return ReplicaState(seq, epoch, wid, bytes(memoryview(frame)[_EVENT.size + 1 :]), ended)
    if kind == Kind.ATTACH:
        return Attach(pickle.loads(memoryview(frame)[_KIND.size :]))
    if kind == Kind.DETACH:
        return Detach(_DETACH.unpack_from(frame)[1])
    if kind == Kind.RESUME:
        _, epoch = _RESUME.unpack_from(frame)
        return Resume(epoch, pickle.loads(memoryview(frame)[_RESUME.size :]))
    if kind == Kind.STOP:
        return Stop()
    if kind == Kind.DENY:
        _, seq, epoch = _DENY.unpack_from(frame)
        return Deny(seq, epoch)
    if kind == Kind.REVOKE:
        _, seq, epoch = _DENY.unpack_from(frame)
        return Revoke(seq, epoch)
    raise ValueError(f"unknown message kind {kind} in a frame of {len(frame)} bytes")

