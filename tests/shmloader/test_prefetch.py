import gc
import weakref

import pytest
import torch

import shmloader
from shmloader.prefetch import DevicePrefetcher, map_tensors

from .fakes import Squares


class FakeEvent:
    def __init__(self, log, n):
        self.log, self.n, self.done = log, n, False

    def query(self):
        return self.done

    def synchronize(self):
        self.log.append(("sync", self.n))
        self.done = True


class FakeEngine:
    """Records copies and hand-overs; copies 'complete' only when the test says so."""

    def __init__(self):
        self.log = []
        self.events = []

    def copy(self, batch):
        ev = FakeEvent(self.log, len(self.events))
        self.events.append(ev)
        self.log.append(("copy", ev.n))
        return map_tensors(batch, lambda t: t.clone()), ev

    def hand_over(self, device_batch, event):
        self.log.append(("hand_over", event.n))


class Host(list):
    """A weak-referenceable host batch."""


def test_batches_come_out_in_order_with_copies_issued_depth_ahead():
    engine = FakeEngine()
    batches = [Host([torch.tensor([i])]) for i in range(4)]
    out = [b[0].item() for b in DevicePrefetcher(batches, depth=2, engine=engine)]
    assert out == [0, 1, 2, 3]
    first_hand_over = engine.log.index(("hand_over", 0))
    assert engine.log[:first_hand_over] == [("copy", 0), ("copy", 1), ("copy", 2)]


def test_a_host_batch_lives_until_its_copy_event_completes():
    engine = FakeEngine()

    def source():
        for i in range(3):
            yield Host([torch.tensor([i])])

    it = iter(DevicePrefetcher(source(), depth=1, engine=engine))
    next(it)  # batch 0 handed over; its copy has not completed
    gc.collect()
    refs = [weakref.ref(h) for h, _ in _retiring(it)]
    assert len(refs) == 1 and refs[0]() is not None
    engine.events[0].done = True
    next(it)  # the next hand-over retires batch 0, whose event has completed
    gc.collect()
    assert refs[0]() is None
    list(it)


def test_unfinished_copies_are_synchronised_when_iteration_stops_early():
    engine = FakeEngine()
    it = iter(DevicePrefetcher([Host([torch.zeros(1)]) for _ in range(5)], depth=2, engine=engine))
    next(it)
    it.close()
    synced = {n for kind, n in engine.log if kind == "sync"}
    assert synced == {0, 1, 2}


def test_arena_slots_return_only_after_the_copy_completes():
    loader = shmloader.DataLoader(Squares(32), batch_size=8, num_workers=2)
    engine = FakeEngine()
    it = iter(DevicePrefetcher(loader, depth=1, engine=engine))
    _, y = next(it)
    assert torch.equal(y, torch.arange(8))
    held = loader.stats().batches_held
    assert held >= 2  # batch 0 (copy not complete) and batch 1 (in flight)
    for ev in engine.events:
        ev.done = True
    rest = list(it)
    del it
    gc.collect()
    assert len(rest) == 3
    assert loader.stats().batches_held == 0


def test_depth_must_be_positive():
    with pytest.raises(ValueError, match="depth must be >= 1"):
        DevicePrefetcher([], depth=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prefetched_batches_arrive_on_the_gpu_equal_to_the_host_batches():
    loader = shmloader.DataLoader(Squares(64), batch_size=8, num_workers=2, pin_memory=True)
    for i, (x, y) in enumerate(DevicePrefetcher(loader, "cuda", depth=2)):
        assert x.is_cuda and y.is_cuda
        assert torch.equal(y.cpu(), torch.arange(8 * i, 8 * i + 8))


def _retiring(gen):
    # The generator's local 'retiring' deque: (host batch, event) pairs not yet released.
    return gen.gi_frame.f_locals["retiring"]
