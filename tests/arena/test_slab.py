"""Tests of arena.slab: slot geometry, pickling by spec, attaching from other processes."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import pickle
from multiprocessing.connection import Connection

import numpy as np
import pytest

from arena._layout import PAGE
from arena.segment import Backend, Segment
from arena.slab import Slab, SlabSpec

CHILD_TIMEOUT_S = 60.0
BACKENDS = ["posix", "memfd"]
START_METHODS = ["spawn", "forkserver", "fork"]
SLOT = 2  # the slot the cross-process tests write


def pattern(seed: int, nbytes: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


@pytest.fixture(params=BACKENDS)
def slab(request: pytest.FixtureRequest):
    s = Slab.create(slab_id=7, slot_size=2 * PAGE, nslots=4, backend=request.param)
    yield s
    s.close()


def test_slab_size_is_slot_size_times_slots(slab):
    assert slab.size == 2 * PAGE * 4
    assert slab.spec.segment.size == slab.size


def test_slot_buffers_tile_the_segment_without_overlap(slab):
    for slot in range(slab.nslots):
        buf = slab.slot_buffer(slot)
        assert len(buf) == slab.slot_size
        assert slab.slot_offset(slot) == slot * slab.slot_size
        buf[:] = bytes([slot + 1]) * slab.slot_size
    whole = np.frombuffer(slab.segment.buffer, dtype=np.uint8).reshape(slab.nslots, -1)
    for slot in range(slab.nslots):
        assert (whole[slot] == slot + 1).all()


@pytest.mark.parametrize("slot", [-1, 4, 100])
def test_slot_out_of_range_raises_index_error(slab, slot):
    with pytest.raises(IndexError, match=f"slot {slot} out of range"):
        slab.slot_buffer(slot)


@pytest.mark.parametrize(
    ("slot_size", "nslots", "segment_size"),
    [(PAGE + 1, 1, PAGE + 1), (PAGE, 0, PAGE), (PAGE, 2, PAGE)],
)
def test_bad_geometry_raises_value_error(slot_size, nslots, segment_size):
    seg = Segment.create(segment_size, "memfd")
    try:
        with pytest.raises(ValueError, match="bad slab geometry"):
            Slab(0, slot_size, nslots, seg)
    finally:
        seg.close()


def test_backend_is_the_segments(slab):
    assert slab.backend is slab.segment.backend
    assert slab.backend in (Backend.POSIX, Backend.MEMFD)


def test_pickling_a_slab_pickles_only_its_spec():
    big = Slab.create(slab_id=3, slot_size=16 << 20, nslots=4, backend="memfd")
    try:
        assert big.size == 64 << 20
        data = pickle.dumps(big)
        assert len(data) < 300
        copy = pickle.loads(data)
        try:
            assert isinstance(copy, Slab)
            assert copy.spec.slab_id == 3
            big.slot_buffer(1)[:4] = b"same"
            assert bytes(copy.slot_buffer(1)[:4]) == b"same"
        finally:
            copy.close()
    finally:
        big.close()


def test_spec_pickles_as_a_few_integers(slab):
    spec = pickle.loads(pickle.dumps(slab.spec))
    assert spec == slab.spec
    assert isinstance(spec, SlabSpec)


def test_close_is_idempotent_and_live_slot_views_stay_valid(slab):
    view = np.frombuffer(slab.slot_buffer(1), dtype=np.uint8)
    view[:] = 42
    slab.close()
    slab.close()
    assert slab.segment.closed
    assert (view == 42).all()


def test_repr_shows_id_geometry_and_backend(slab):
    assert repr(slab) == f"Slab(id=7, slots=4x{2 * PAGE:,}, backend={slab.backend.value})"


# -- other processes -------------------------------------------------------------------------------


def _child_writes(spec: SlabSpec, seed: int, conn: Connection) -> None:
    slab = Slab.attach(spec)
    try:
        slab.slot_buffer(SLOT)[:] = pattern(seed, spec.slot_size)
    finally:
        slab.close()
    conn.send(seed)


def _child_reads(slab: Slab, conn: Connection) -> None:
    # ``slab`` arrives pickled as its spec and attaches here, on unpickling.
    try:
        digest = hashlib.sha256(slab.slot_buffer(SLOT)).hexdigest()
    finally:
        slab.close()
    conn.send(digest)


def _run_child(method: str, target: object, args: tuple[object, ...]) -> object:
    ctx = mp.get_context(method)
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, args=(*args, child))
    proc.start()
    child.close()
    try:
        assert parent.poll(CHILD_TIMEOUT_S), f"{method} child sent nothing"
        answer = parent.recv()
        proc.join(CHILD_TIMEOUT_S)
        assert proc.exitcode == 0
        return answer
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(CHILD_TIMEOUT_S)
        parent.close()


@pytest.mark.parametrize("method", START_METHODS)
def test_child_attaches_from_the_spec_and_the_parent_reads_its_bytes(slab, method):
    seed = 1234
    assert _run_child(method, _child_writes, (slab.spec, seed)) == seed
    assert bytes(slab.slot_buffer(SLOT)) == pattern(seed, slab.slot_size)
    assert not any(slab.slot_buffer(SLOT - 1))  # neighbours untouched
    assert not any(slab.slot_buffer(SLOT + 1))


@pytest.mark.parametrize("method", START_METHODS)
def test_parent_writes_and_a_child_reads_the_same_bytes(slab, method):
    data = pattern(99, slab.slot_size)
    slab.slot_buffer(SLOT)[:] = data
    assert _run_child(method, _child_reads, (slab,)) == hashlib.sha256(data).hexdigest()
