import numpy as np
import pytest
import torch

from arena import ArraySpec, Descriptor, SlabSpec, SlotRef
from arena.segment import Backend, SegmentSpec
from shmloader import protocol as P
from shmloader._torch_compat import wrap_current_exception

REF = SlotRef(2, 5, 7)
DESC = Descriptor(REF, (ArraySpec(0, 8, (4, 3)), ArraySpec(64, 6, ())), 128, 33)


@pytest.mark.parametrize(
    "msg",
    [
        P.Task(3, 1, REF, [1, 2, 3]),
        P.Task(4, 0, None, None),
        P.Grant(9, 2, REF),
        P.Attach(SlabSpec(1, 4096, 3, SegmentSpec(123, 7, 12288, Backend.MEMFD))),
        P.Resume(2, None),
        P.Resume(3, 12345),
        P.Stop(),
        P.Deny(4, 1),
        P.decode(P.ready(11, 2, 1, DESC, DESC.end)),
        P.NeedSlot(12, 0, 1, 1 << 33, None),
        P.NeedSlot(12, 0, 1, 1 << 33, REF),
        P.Detach(7),
        P.Exhausted(13, 1, 0),
        P.ReplicaState(14, 2, 1, b"\x80\x05state", False),
        P.ReplicaState(15, 2, 1, b"", True),
    ],
    ids=lambda m: type(m).__name__,
)
def test_every_message_survives_encode_and_decode(msg):
    assert P.decode(P.encode(msg)) == msg


def test_a_ready_frame_names_the_slot_and_carries_the_whole_descriptor():
    msg = P.decode(P.ready(11, 2, 1, DESC, DESC.end))
    assert isinstance(msg, P.Ready) and (msg.seq, msg.epoch, msg.worker_id) == (11, 2, 1)
    assert msg.ref == REF and P.descriptor(msg) == DESC
    assert msg.nbytes == DESC.end == 161  # the payload, 33 bytes at 128, ends last


def test_packed_indices_arrive_as_a_list_of_ints():
    idx = P.PackedIndices(np.array([5, 0, 2**40], dtype="<i8").tobytes())
    out = P.decode(P.encode(P.Task(1, 0, None, idx)))
    assert out.index == [5, 0, 2**40] and all(type(i) is int for i in out.index)


def test_failed_message_carries_the_exception_type_and_worker_traceback():
    try:
        raise ValueError("boom in dataset")
    except ValueError:
        wrapped = wrap_current_exception("in DataLoader worker process 1")
    out = P.decode(P.encode(P.Failed(1, 0, 1, wrapped)))
    assert isinstance(out, P.Failed)
    with pytest.raises(ValueError, match="in DataLoader worker process 1") as info:
        out.error.reraise()
    assert "boom in dataset" in str(info.value)


def test_an_unknown_frame_kind_is_reported_with_its_size():
    with pytest.raises(ValueError, match="unknown message kind 99 in a frame of 3 bytes"):
        P.decode(bytes([99, 0, 0]))


def test_encoding_something_that_is_not_a_message_raises():
    with pytest.raises(TypeError):
        P.encode(torch.zeros(1))  # type: ignore[arg-type]


class _Refilled(list):  # type: ignore[type-arg]
    """A list subclass a batch sampler refills in place."""


def test_an_index_kept_before_its_task_is_sent_is_what_the_worker_receives():
    """Review 76: indices a resumed epoch draws ahead are kept until their tasks are sent; the
    sampler may refill what it yielded (a list, a list subclass, a tuple of lists) meanwhile."""
    refilled = _Refilled([1, 2])
    nested = ([3, 4], "k")
    kept = [P.as_received(i) for i in (refilled, nested, np.array([5, 6]))]
    refilled[0] = nested[0][0] = 0
    assert kept[0] == [1, 2] and type(kept[0]) is _Refilled
    assert kept[1] == ([3, 4], "k")
    assert kept[2].tolist() == [5, 6]
    packed = P.PackedIndices(b"\x01" * 8)
    assert P.as_received(packed) is packed
    unpicklable = lambda: 0  # noqa: E731  (sending it raises later, as torch's loader does)
    assert P.as_received(unpicklable) is unpicklable
