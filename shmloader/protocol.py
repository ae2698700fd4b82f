"""Typed messages between the main process and one worker, and their byte encoding.

Every message is one ``bytes`` frame on that worker's duplex pipe. Its first byte is a
:class:`Kind`; the rest is fixed ``struct`` fields, followed for some kinds by one pickle (a
sampler index, an exception, a slab spec). The hot-path frames (``TASK``, ``READY``) carry no
pickle apart from the index.

Main -> worker: ``TASK`` (fetch this index into this slot — or into no slot yet, when none was
free at dispatch), ``GRANT`` (the slot for a task: offered as soon as one frees up, or the bigger
slot an oversized batch asked for), ``DENY`` (that slot can never exist: the batch is larger
than the arena's cap; the main process raises the error, the worker moves on), ``ATTACH`` (map
a new slab), ``RESUME`` (a new epoch begins), ``STOP`` (exit).
Worker -> main: ``READY`` (the batch is in the slot; a descriptor follows), ``NEED_SLOT`` (the
batch needs ``nbytes``; the worker waits for a ``GRANT``), ``FAILED`` (dataset or collate
raised), ``EXHAUSTED`` (the worker's IterableDataset replica is done), ``DROPPED`` (the task
belongs to an epoch that a later ``RESUME`` abandoned: fetched, as torch does, but its slot was
not touched).

Invariants: frames of one worker arrive in the order sent; every ``TASK`` is answered by exactly
one of ``READY``, ``FAILED``, ``EXHAUSTED``, ``DROPPED``, or a ``NEED_SLOT`` the worker then
abandons because a ``RESUME`` or ``STOP`` came instead of the ``GRANT`` — unless the worker is
told to ``STOP``, dies, or its replica is already exhausted (then it answers nothing and the main
process reclaims the slot). ``epoch`` tags let the main process release the slots of tasks of an
abandoned epoch as their answers arrive.
"""

from __future__ import annotations

import enum
import pickle
import struct
from typing import Any, Final, NamedTuple

from arena import Descriptor, SlabSpec, SlotRef


class Kind(enum.IntEnum):
    TASK = 1
    GRANT = 2
    ATTACH = 3
    RESUME = 4
    STOP = 5
    DENY = 6
    READY = 16
    NEED_SLOT = 17
    FAILED = 18
    EXHAUSTED = 19
    DROPPED = 20


# kind, seq, epoch, has_slot, slab_id, slot, generation
_TASK: Final = struct.Struct("<BQIBIII")
# kind, seq, epoch, worker_id (+ descriptor)
_READY: Final = struct.Struct("<BQII")
# kind, seq, epoch, worker_id, nbytes
_NEED: Final = struct.Struct("<BQIIQ")
# kind, seq, epoch, slab_id, slot, generation
_GRANT: Final = struct.Struct("<BQIIII")
# kind, epoch
_RESUME: Final = struct.Struct("<BI")
# kind, seq, epoch
_DENY: Final = struct.Struct("<BQI")
# kind, seq, epoch, worker_id (+ pickle)
_EVENT: Final = struct.Struct("<BQII")
_KIND: Final = struct.Struct("<B")
_PICKLE = pickle.HIGHEST_PROTOCOL


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


class Resume(NamedTuple):
    epoch: int
    shared_seed: int | None


class Stop(NamedTuple):
    pass


class Deny(NamedTuple):
    seq: int
    epoch: int


class Ready(NamedTuple):
    seq: int
    epoch: int
    worker_id: int
    desc: Descriptor


class NeedSlot(NamedTuple):
    seq: int
    epoch: int
    worker_id: int
    nbytes: int


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


ToWorker = Task | Grant | Attach | Resume | Stop | Deny
ToMain = Ready | NeedSlot | Failed | Exhausted | Dropped


def encode(msg: ToWorker | ToMain) -> bytes:
    """One frame for ``msg``."""
    if isinstance(msg, Task):
        r = msg.ref
        head = (
            _TASK.pack(Kind.TASK, msg.seq, msg.epoch, 1, r.slab_id, r.slot, r.generation)
            if r is not None
            else _TASK.pack(Kind.TASK, msg.seq, msg.epoch, 0, 0, 0, 0)
        )
        return head + pickle.dumps(msg.index, _PICKLE)
    if isinstance(msg, Ready):
        return _READY.pack(Kind.READY, msg.seq, msg.epoch, msg.worker_id) + msg.desc.encode()
    if isinstance(msg, NeedSlot):
        return _NEED.pack(Kind.NEED_SLOT, msg.seq, msg.epoch, msg.worker_id, msg.nbytes)
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
    if isinstance(msg, Attach):
        return _KIND.pack(Kind.ATTACH) + pickle.dumps(msg.spec, _PICKLE)
    if isinstance(msg, Resume):
        return _RESUME.pack(Kind.RESUME, msg.epoch) + pickle.dumps(msg.shared_seed, _PICKLE)
    if isinstance(msg, Stop):
        return _KIND.pack(Kind.STOP)
    if isinstance(msg, Deny):
        return _DENY.pack(Kind.DENY, msg.seq, msg.epoch)
    raise TypeError(f"not a protocol message: {msg!r}")


def decode(frame: bytes) -> ToWorker | ToMain:
    """The message ``frame`` encodes."""
    kind = frame[0]
    if kind == Kind.READY:
        _, seq, epoch, wid = _READY.unpack_from(frame)
        return Ready(seq, epoch, wid, Descriptor.decode(frame, _READY.size))
    if kind == Kind.TASK:
        _, seq, epoch, has, slab_id, slot, gen = _TASK.unpack_from(frame)
        ref = SlotRef(slab_id, slot, gen) if has else None
        return Task(seq, epoch, ref, pickle.loads(memoryview(frame)[_TASK.size :]))
    if kind == Kind.NEED_SLOT:
        _, seq, epoch, wid, nbytes = _NEED.unpack_from(frame)
        return NeedSlot(seq, epoch, wid, nbytes)
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
    if kind == Kind.ATTACH:
        return Attach(pickle.loads(memoryview(frame)[_KIND.size :]))
    if kind == Kind.RESUME:
        _, epoch = _RESUME.unpack_from(frame)
        return Resume(epoch, pickle.loads(memoryview(frame)[_RESUME.size :]))
    if kind == Kind.STOP:
        return Stop()
    if kind == Kind.DENY:
        _, seq, epoch = _DENY.unpack_from(frame)
        return Deny(seq, epoch)
    raise ValueError(f"unknown message kind {kind} in a frame of {len(frame)} bytes")
