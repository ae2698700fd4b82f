import collections
import gc

import numpy as np
import pytest
import torch

from arena import SlotState
from shmloader import protocol as P
from shmloader.collate import SlotSession, slot_default_collate
from shmloader.lease import KeptTables, Leases
from shmloader.pack import Packed, used_bytes

Pair = collections.namedtuple("Pair", ["a", "b"])


def _roundtrip(arena, batch, nbytes=1 << 16):
    ref = arena.acquire(nbytes)
    with SlotSession(arena.slot_buffer(ref)) as s:
        packed = Packed(s, batch)
    if packed.fits:
        desc = packed.describe(ref)
    else:
        big = arena.acquire(packed.needed)
        desc = packed.write_into(big, arena.slot_buffer(big))
        arena.release(ref)
        ref = big
    arena.mark_ready(ref)
    assert used_bytes(desc) == desc.end  # the payload is laid out last, either way
    return Leases(arena), P.decode(P.ready(0, 0, 0, desc, used_bytes(desc))), ref


def test_a_nested_batch_comes_back_equal_with_tensors_as_views(arena):
    batch = {
        "x": torch.arange(12, dtype=torch.float32).view(3, 4),
        "names": ["a", "b", "c"],
        "pair": Pair(np.arange(5, dtype=np.int32), torch.tensor([True, False])),
        "bf": torch.ones(2, dtype=torch.bfloat16),
        "empty": torch.zeros(0, 3),
        "grad": torch.ones(2, requires_grad=True),
    }
    leases, desc, ref = _roundtrip(arena, batch)
    out = leases.open(desc)
    assert torch.equal(out["x"], batch["x"])
    assert out["names"] == ["a", "b", "c"]
    assert isinstance(out["pair"], Pair) and isinstance(out["pair"].a, np.ndarray)
    assert np.array_equal(out["pair"].a, batch["pair"].a)
    assert out["bf"].dtype == torch.bfloat16 and torch.equal(out["bf"], batch["bf"])
    assert out["empty"].shape == (0, 3)
    assert out["grad"].requires_grad  # not a slot dtype case: pickled whole, keeps autograd flag
    assert arena.state(ref) is SlotState.LENT
    slab_base = np.frombuffer(arena.slot_buffer(ref), np.uint8, count=1).ctypes.data
    assert slab_base <= out["x"].data_ptr() < slab_base + arena.slot_size(ref)


def test_the_slot_is_free_only_after_the_last_view_dies(arena):
    leases, desc, ref = _roundtrip(arena, [torch.arange(100), torch.ones(3)])
    out = leases.open(desc)
    part = out[0][10:20].view(2, 5)
    arr = out[1].numpy()
    del out
    gc.collect()
    assert arena.state(ref) is SlotState.LENT and leases.held == 1
    del part
    leases.drain()
    assert arena.state(ref) is SlotState.LENT
    del arr
    assert arena.state(ref) is SlotState.LENT  # the death is queued, not acted on in the GC
    leases.drain()
    assert arena.state(ref) is SlotState.FREE and leases.held == 0


def test_a_clone_does_not_keep_the_slot(arena):
    leases, desc, ref = _roundtrip(arena, torch.arange(100))
    out = leases.open(desc)
    keep = out.clone()
    del out
    leases.drain()
    assert arena.state(ref) is SlotState.FREE
    assert torch.equal(keep, torch.arange(100))


def test_a_batch_without_arrays_frees_its_slot_at_once(arena):
    leases, desc, ref = _roundtrip(arena, ["only", "strings"])
    assert leases.open(desc) == ["only", "strings"]
    assert leases.held == 0 and arena.state(ref) is SlotState.FREE


def test_an_oversized_batch_is_laid_out_again_in_a_bigger_slot(arena):
    big = torch.arange(100_000, dtype=torch.int64)  # 800 kB into a 64 kB slot
    leases, desc, ref = _roundtrip(arena, {"big": big, "s": "x"})
    assert arena.slot_size(ref) >= 800_000
    out = leases.open(desc)
    assert torch.equal(out["big"], big) and out["s"] == "x"


def test_collated_leaves_already_in_the_slot_are_not_copied_again(arena):
    ref = arena.acquire(1 << 16)
    with SlotSession(arena.slot_buffer(ref)) as s:
        out = slot_default_collate([torch.ones(10), torch.ones(10)])
        used_after_collate = s.writer.used
        packed = Packed(s, out)
    leaf = packed.leaves[0]
    assert leaf.offset == out.data_ptr() - s.base
    assert packed.describe(ref).arrays[0].offset < used_after_collate
    arena.release(ref)


def test_release_early_returns_the_slot_while_views_live(arena):
    leases, desc, ref = _roundtrip(arena, {"x": torch.arange(10)})
    out = leases.open(desc)
    assert leases.release_early(out) == 1
    assert arena.state(ref) is SlotState.FREE
    assert leases.release_early(out) == 0
    del out  # the lease was forgotten: its death releases nothing twice
    assert leases.drain() == 0
    assert arena.stats().slots_free == arena.stats().slots_total


def test_an_interruption_while_a_batch_is_lent_leaves_no_slot_unwatched(arena, monkeypatch):
    # Ctrl-C (or any exception) while the lease is being registered: the batch never reaches
    # the user, so its slot must come back rather than stay LENT with nothing watching it.
    leases, desc, ref = _roundtrip(arena, [torch.arange(100), torch.ones(3)])

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(torch.Tensor, "untyped_storage", interrupted)
    with pytest.raises(KeyboardInterrupt):
        leases.open(desc)
    monkeypatch.undo()
    gc.collect()
    leases.drain()  # the unreturned batch's views are gone: nothing is released twice
    assert arena.state(ref) is SlotState.FREE and leases.held == 0
    assert arena.stats().slots_free == arena.stats().slots_total


def test_a_quarantined_slot_goes_back_only_once_every_quarantine_holding_it_is_lifted(arena):
    # Two iterators of one loader fork their workers while the same batch is held: the slot may
    # be reused only when the workers of both are gone, in whichever order they go.
    leases, desc, ref = _roundtrip(arena, [torch.arange(100)])
    batch = leases.open(desc)
    kept_a = KeptTables()
    kept_b = KeptTables()  # two keepers (the workers of two iterators): a quarantine each
    leases.quarantine(kept_a)
    leases.quarantine(kept_b)
    ((_, first, _),), ((_, second, _),) = kept_a.values(), kept_b.values()
    del batch
    assert leases.drain() == 0 and arena.state(ref) is SlotState.LENT and leases.kept == 1
    leases.lift(first)
    assert leases.drain() == 0 and arena.state(ref) is SlotState.LENT and leases.kept == 1
    leases.lift(second)
    assert leases.drain() == 1 and arena.state(ref) is SlotState.FREE and leases.kept == 0
    fresh = KeptTables()
    leases.quarantine(fresh)
    assert fresh == {}  # nothing lent: nothing to keep


class _CountingValues(dict):  # type: ignore[type-arg]
    """A lease table that counts the walks of its values."""

    walks = 0

    def values(self):  # type: ignore[override]
        self.walks += 1
        return super().values()


def test_a_keeper_walks_the_lent_batches_again_only_after_a_lend(arena):
    # A loader's N workers fork one after another, each asking every table to keep what it
    # lends: with nothing lent between two forks the second has nothing to add, and must not
    # walk every lease again (10,000 held batches made each fork of `iter()` ~4 ms dearer). A
    # batch lent between two forks must still be kept.
    leases, desc, ref = _roundtrip(arena, [torch.arange(100)])
    first = leases.open(desc)
    leases._live = counting = _CountingValues(leases._live)
    kept = KeptTables()
    leases.quarantine(kept)  # the first worker's fork
    leases.quarantine(kept)  # the second's: nothing lent since
    assert counting.walks == 1
    ((_, q, _),) = kept.values()
    assert q.refs == {ref}
    _, desc2, ref2 = _roundtrip(arena, [torch.arange(7)])
    second = leases.open(desc2)  # lent between two forks
    leases.quarantine(kept)
    assert counting.walks == 2 and q.refs == {ref, ref2}
    leases.quarantine(kept)
    assert counting.walks == 2
    other = KeptTables()  # another keeper (a plain fork) walks for itself
    leases.quarantine(other)
    assert counting.walks == 3 and next(iter(other.values()))[1].refs == {ref, ref2}
    del first, second
    kept.lifted = True  # as the keeper lifts (afterfork.Keep.lift)
    leases.lift(q)
    leases.drain()
    leases.quarantine(kept)  # a lend racing the lift: it takes nothing more, walks nothing
    assert counting.walks == 3


class _LiftedMidway(KeptTables):
    """A keeper that another thread lifts (as ``afterfork.Keep`` does: flag first, then every
    quarantine in a snapshot of its entries) while a table is adding its quarantine."""

    def get(self, key, default=None):  # type: ignore[no-untyped-def]
        have = super().get(key, default)
        self.lifted = True
        for leases, q, _ in list(self.values()):  # (the new entry is not in it yet)
            leases.lift(q)
        return have


def test_a_quarantine_added_while_its_keeper_lifts_is_lifted_too(arena):
    # Review 29's residue: a lend racing the lift of a fork's keeper added a quarantine after
    # the lift's snapshot; nothing ever lifted it, and the slot stayed out of use for good.
    leases, desc, ref = _roundtrip(arena, [torch.arange(100)])
    batch = leases.open(desc)
    kept = _LiftedMidway()
    leases.quarantine(kept)
    assert kept.lifted and len(kept) == 1
    assert [q for q in leases.quarantines if q.active] == []
    del batch
    assert leases.drain() == 1 and arena.state(ref) is SlotState.FREE and leases.kept == 0


class _InterruptedAfterRecording(KeptTables):
    """A keeper whose first entry is recorded, then Ctrl-C lands (before the table keeps it)."""

    armed = True

    def __setitem__(self, key, value):  # type: ignore[no-untyped-def]
        super().__setitem__(key, value)
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt


def test_a_quarantine_interrupted_between_recording_and_keeping_is_kept_by_the_retry(arena):
    # Review 33: the retry (afterfork retries a fork hook's take once) saw the entry recorded,
    # active, with nothing lent since, and returned: the table never kept the slot, which went
    # back to the arena while the workers shared it.
    leases, desc, ref = _roundtrip(arena, [torch.arange(100)])
    batch = leases.open(desc)
    kept = _InterruptedAfterRecording()
    with pytest.raises(KeyboardInterrupt):
        leases.quarantine(kept)
    leases.quarantine(kept)
    ((_, q, _),) = kept.values()
    assert q in leases.quarantines and q.refs == {ref}
    del batch
    assert leases.drain() == 0 and arena.state(ref) is SlotState.LENT and leases.kept == 1
    kept.lifted = True
    leases.lift(q)
    assert leases.drain() == 1 and arena.state(ref) is SlotState.FREE


def test_a_batch_with_many_atoms_is_not_cached_but_a_small_structure_is(arena):
    """Review 12: the worker's payload cache kept every structure's signature and payload, and a
    batch of token lists (one atom per token) never matches another: 256 of them held 437 MB
    in each worker. Only structures of at most MAX_ATOMS atoms are kept."""
    from shmloader import pack

    pack._PAYLOADS.clear()
    tokens = {"input_ids": [[i * 512 + j for j in range(512)] for i in range(4)], "n": 4}
    leases, msg, _ = _roundtrip(arena, tokens)
    assert not pack._PAYLOADS, "a batch of 2,049 atoms was cached"
    batch = leases.open(msg)
    assert batch == tokens
    del batch
    small = {"x": torch.arange(4), "kind": "train", "n": 4}
    leases2, msg2, _ = _roundtrip(arena, small)
    assert len(pack._PAYLOADS) == 1
    got = leases2.open(msg2)
    assert torch.equal(got["x"], small["x"]) and got["kind"] == "train" and got["n"] == 4
    pack._PAYLOADS.clear()


def test_an_interruption_right_after_a_drain_marks_its_thread_leaves_no_mark(arena):
    """Review 59: a KeyboardInterrupt between marking the thread inside a drain and the block
    that unmarks it left the mark for good: every later drain did nothing, and the iterator
    refused every next() and iter() as called from inside itself."""
    import inspect
    import sys

    leases = Leases(arena)
    code = Leases._as_owner.__code__
    lines, first = inspect.getsourcelines(Leases._as_owner)
    marked = first + next(k for k, line in enumerate(lines) if "self._inside = threading" in line)

    def local(frame, event, arg):
        if event == "line" and frame.f_lineno > marked:
            raise KeyboardInterrupt  # as a signal handler's would, at the next line
        return local

    def tracer(frame, event, arg):
        return local if frame.f_code is code else None

    sys.settrace(tracer)
    try:
        with pytest.raises(KeyboardInterrupt):
            leases.drain()
    finally:
        sys.settrace(None)
    assert not leases.busy_here()
    assert not leases.lock._is_owned()
