import gc
import sys
import weakref

import pytest
import torch

import shmloader
from shmloader.prefetch import _NONE, DevicePrefetcher, map_tensors
from tests.lifetime_checks import frees_its_loaders_on_failure

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


def test_the_next_host_batch_is_taken_while_the_last_issued_copy_runs():
    # Taking a batch from the loader costs the main process CPU time; done between issuing a
    # copy and handing the previous batch over, it overlaps the DMA (measured on an H100 under
    # tools.bench --workload pinned, where the consumer synchronizes the device every step).
    engine = FakeEngine()

    def source():
        for i in range(4):
            engine.log.append(("take", i))
            yield Host([torch.tensor([i])])

    out = []
    for batch in DevicePrefetcher(source(), depth=1, engine=engine):
        engine.log.append(("yield", batch[0].item()))
        out.append(batch[0].item())
    assert out == [0, 1, 2, 3]
    assert [e for e in engine.log if e[0] != "sync"] == [
        ("take", 0), ("copy", 0), ("take", 1), ("copy", 1), ("take", 2),
        ("hand_over", 0), ("yield", 0),
        ("copy", 2), ("take", 3), ("hand_over", 1), ("yield", 1),
        ("copy", 3), ("hand_over", 2), ("yield", 2),
        ("hand_over", 3), ("yield", 3),
    ]


def test_a_host_batch_lives_until_its_copy_event_completes():
    engine = FakeEngine()

    def source():
        for i in range(3):
            yield Host([torch.tensor([i])])

    it = iter(DevicePrefetcher(source(), depth=1, engine=engine))
    next(it)  # batch 0 handed over; its copy has not completed
    gc.collect()
    refs = [weakref.ref(h) for h, _ in it.retiring]
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
    assert synced == {0, 1, 2}  # batch 3 was taken from the loader but never copied


def test_arena_slots_return_only_after_the_copy_completes():
    loader = shmloader.DataLoader(Squares(32), batch_size=8, num_workers=2)
    engine = FakeEngine()
    it = iter(DevicePrefetcher(loader, depth=1, engine=engine))
    _, y = next(it)
    assert torch.equal(y, torch.arange(8))
    held = loader.stats().batches_held
    assert held >= 3  # batch 0 (copy not complete), batch 1 (in flight), batch 2 (taken)
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


def test_a_prefetcher_gives_the_loaders_slabs_a_slot_for_each_batch_it_holds():
    # depth 1 holds 3 host batches (handed out, copying, taken); with only the default
    # prefetch_factor * num_workers + 1 slots the workers would wait for them.
    loader = shmloader.DataLoader(Squares(32), batch_size=8, num_workers=2)
    engine = FakeEngine()
    it = iter(DevicePrefetcher(loader, depth=1, engine=engine))
    next(it)
    assert loader._host.arena.slots_per_slab == 2 * 2 + 3
    for ev in engine.events:
        ev.done = True
    list(it)
    explicit = shmloader.DataLoader(Squares(32), batch_size=8, num_workers=2,
                                    arena_slots_per_slab=2)
    list(DevicePrefetcher(explicit, depth=1, engine=FakeEngine()))
    assert explicit._host.arena.slots_per_slab == 2  # the user's setting is kept


# -- review 17: what the prefetcher hands out, and what it keeps -------------------------------


class Done(FakeEngine):
    """Copies that have completed as soon as they are issued (a fast device)."""

    def copy(self, batch):
        out, ev = super().copy(batch)
        ev.done = True
        return out, ev


class Rows(torch.utils.data.Dataset):
    """Sample ``i``: four copies of ``i``; sample 13 raises when ``bad`` is set."""

    def __init__(self, n=64, bad=False):
        self.n, self.bad = n, bad

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.bad and i == 13:
            raise ValueError(f"bad sample {i}")
        return torch.full((4,), float(i))


class Slotted:
    __slots__ = ("boxes",)

    def __init__(self, boxes):
        self.boxes = boxes


class Target:
    def __init__(self, boxes):
        self.boxes = boxes


# Each collate hands out one tensor that the device copy does not replace: still a view of the
# slot, reachable only through something the prefetcher's walk does not enter.
KEEPS = {
    "__slots__ object": (lambda b: {"x": b, "o": Slotted(b[:, 0].clone())}, lambda d: d["o"].boxes),
    "deque": (lambda b: {"x": b, "o": __import__("collections").deque([b[:, 0]])},
              lambda d: d["o"][0]),
    "frozenset": (lambda b: {"x": b, "o": frozenset([b[:, 0]])}, lambda d: next(iter(d["o"]))),
    "a tensor also in an object": (lambda b: {"x": b, "t": Target(b)}, lambda d: d["t"].boxes),
}  # fmt: skip


@pytest.mark.parametrize("case", list(KEEPS))
def test_a_slot_view_the_device_copy_leaves_behind_is_never_overwritten(case):
    """Review 17 F1: the prefetcher gave a batch's slots back once its copy completed when its
    walk found every tensor it knew of copied; a tensor behind a ``__slots__`` object, a deque, a
    frozenset, or shared with an object, reached the user still viewing the slot, and later
    batches overwrote it (9 of 16)."""
    make, pick = KEEPS[case]

    def collate(samples):
        return make(torch.stack(samples))

    loader = shmloader.DataLoader(Rows(), batch_size=4, num_workers=2, collate_fn=collate)
    kept = [pick(d) for d in DevicePrefetcher(loader, "cpu", depth=1, engine=Done())]
    assert [k[:, 0].tolist() if k.dim() == 2 else k.tolist() for k in kept] == [
        [4.0 * i + j for j in range(4)] for i in range(16)
    ]


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("loader_kind", ["shmloader", "torch"])
def test_a_loader_error_comes_at_its_turn_and_iteration_goes_on(depth, loader_kind):
    """Review 17 F4: an error taking a batch ended the prefetcher's generator: the batches
    already copied were lost and the error came early ([0, ValueError] at depth 1)."""
    kind = shmloader.DataLoader if loader_kind == "shmloader" else torch.utils.data.DataLoader
    loader = kind(Rows(32, bad=True), batch_size=4, num_workers=2)
    it = iter(DevicePrefetcher(loader, "cpu", depth=depth, engine=Done()))
    assert _first_rows_or_errors(it, ValueError) == [0, 1, 2, "ValueError", 4, 5, 6, 7]


def _first_rows_or_errors(it, error, on_error=lambda: None):
    """Each batch's first sample (rows of ``Rows``, 4 a batch), or the text of the ``error``
    raised in its place (then ``on_error()``), iterating on past it as a training loop that
    catches it would."""
    got = []
    while True:
        try:
            got.append(int(next(it)[0, 0]) // 4)
        except StopIteration:
            return got
        except error as e:
            got.append(str(e) if error is not ValueError else "ValueError")
            on_error()


def test_mappings_and_sequences_keep_their_kind_and_are_copied():
    """Review 17 F6 and F10: a defaultdict batch raised TypeError; a UserDict's tensors were not
    copied (the shape of Hugging Face's BatchEncoding)."""
    from collections import UserDict, defaultdict

    d = defaultdict(list, {"x": torch.zeros(2)})
    u = UserDict({"x": torch.zeros(2)})
    out = map_tensors([d, u, (torch.zeros(1),)], lambda t: t + 1)
    assert type(out[0]) is defaultdict and out[0].default_factory is list
    assert type(out[1]) is UserDict and torch.equal(out[1]["x"], torch.ones(2))
    assert torch.equal(out[0]["x"], torch.ones(2)) and torch.equal(out[2][0], torch.ones(1))
    assert torch.equal(u["x"], torch.zeros(2))  # the host batch is left as it was


class Pair(tuple):  # a plain tuple subclass, as a user's batch type
    pass


def test_tuple_subclasses_keep_their_kind_as_torchs_pin_memory_keeps_them():
    """Review 37 F2: a tuple subclass (torch.return_types.max, a user's) came out a plain tuple,
    so ``batch.values`` broke behind the prefetcher only; torch's ``pin_memory`` rebuilds it
    with ``type(data)(...)``."""
    top = torch.tensor([[1.0, 3.0], [4.0, 2.0]]).max(dim=1)
    out = map_tensors([top, Pair((torch.zeros(1),))], lambda t: t + 1)
    assert type(out[0]) is type(top) and torch.equal(out[0].values, top.values + 1)
    assert type(out[1]) is Pair and torch.equal(out[1][0], torch.ones(1))


def test_host_batches_held_for_slow_copies_stay_bounded():
    """Review 17 F9: copies that had not completed kept every host batch alive (15 at a 16 MiB
    cap with 1 MiB batches, and the cap error blamed the user); now at most the one handed out
    and one before it wait for their copies, older ones are waited for."""
    engine = FakeEngine()  # its events complete only when synchronized
    it = iter(DevicePrefetcher([Host([torch.tensor([i])]) for i in range(12)], depth=1,
                               engine=engine))  # fmt: skip
    for i in range(12):
        assert next(it)[0].item() == i
        assert len(it.retiring) <= 2
    synced = sorted(n for kind, n in engine.log if kind == "sync")
    assert synced == list(range(10))  # each but the last two, once two are waiting
    list(it)


class FailsOnce(Done):
    """A fast engine whose ``copy`` or ``hand_over`` raises once, at its 3rd call."""

    def __init__(self, where):
        super().__init__()
        self.where, self.calls = where, 0

    def _maybe_fail(self, where):
        if where == self.where:
            self.calls += 1
            if self.calls == 3:
                raise RuntimeError(f"{where} failed")

    def copy(self, batch):
        self._maybe_fail("copy")
        return super().copy(batch)

    def hand_over(self, device_batch, event):
        self._maybe_fail("hand_over")
        super().hand_over(device_batch, event)


@pytest.mark.parametrize("where", ["copy", "hand_over"])
def test_an_engine_error_comes_in_its_batchs_place_at_its_turn(where):
    """Review 19: a copy error came before the batches copied earlier and lost one; a hand-over
    error lost its batch without telling the loader, whose state then counted it as held."""
    loader = shmloader.DataLoader(Rows(24), batch_size=4, num_workers=2)
    it = iter(DevicePrefetcher(loader, "cpu", depth=1, engine=FailsOnce(where)))

    def told_what_is_held():
        assert it.source.ahead == len(it.queue) + (it.ahead is not _NONE)

    got = _first_rows_or_errors(it, RuntimeError, told_what_is_held)
    assert got == [0, 1, f"{where} failed", 3, 4, 5]


def test_a_prefetcher_whose_loader_fails_to_start_leaves_nothing_on_stderr(monkeypatch):
    """Review 19: iter(loader) failing inside the prefetcher's constructor left an object whose
    __del__ raised AttributeError ("Exception ignored in ...")."""
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    loader = shmloader.DataLoader(Rows(8), batch_size=4, timeout=5)  # torch: needs timeout 0
    with pytest.raises(AssertionError, match="timeout == 0"):
        iter(DevicePrefetcher(loader, "cpu", engine=Done()))
    gc.collect()
    assert unraisable == []


def test_at_the_cap_the_error_names_the_batches_a_prefetcher_holds():
    """Review 37 F3: with a cap of 4 slots under a prefetcher of depth 3 (5 batches held), the
    error blamed the user for the prefetcher's batches and offered fixes that do not apply."""
    from arena.errors import ArenaExhaustedError

    loader = shmloader.DataLoader(Rows(400), batch_size=4, num_workers=2,
                                  arena_max_bytes=4 * 4096, timeout=20)  # fmt: skip
    with pytest.raises(
        ArenaExhaustedError,
        match=r"up to 5 of them may be held by a DevicePrefetcher over this loader: its "
        r"depth \+ 2, and those of prefetchers over it\).*"
        r"lower the DevicePrefetcher's depth, or raise arena_max_bytes",
    ):
        for _ in DevicePrefetcher(loader, "cuda", depth=3, engine=Done()):
            pass


class Checked(tuple):
    """A tuple subclass whose constructor checks that it holds tensors only."""

    def __new__(cls, items):
        items = tuple(items)
        if not all(isinstance(t, torch.Tensor) for t in items):
            raise TypeError("Checked holds tensors only")
        return super().__new__(cls, items)


class Recorded(torch.Tensor):
    """A tensor that logs ``record_stream`` (a CPU stand-in for a device tensor)."""

    log: list = []  # noqa: RUF012 - one log for the test

    def record_stream(self, stream):
        Recorded.log.append((id(self), stream))


def test_the_hand_over_marks_every_tensor_and_rebuilds_nothing(monkeypatch):
    """Review 39: the CUDA hand-over walked the device batch with map_tensors to call
    record_stream, rebuilding every container from the calls' Nones: a tuple subclass that
    checks what it holds raised on every batch (torch's pin_memory passes it tensors)."""
    from shmloader.prefetch import CudaCopyEngine

    class Consumer:
        def __init__(self):
            self.waited = []

        def wait_event(self, event):
            self.waited.append(event)

    consumer = Consumer()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: consumer)
    engine = object.__new__(CudaCopyEngine)  # no CUDA here: no side stream to make
    engine.device = torch.device("cuda")
    a, b, c = (torch.zeros(1).as_subclass(Recorded) for _ in range(3))
    batch = {"x": Checked([a, b]), "y": [c, "label", 3]}
    Recorded.log.clear()
    engine.hand_over(batch, "event")
    assert consumer.waited == ["event"]
    assert sorted(i for i, _ in Recorded.log) == sorted(map(id, (a, b, c)))
    assert all(s is consumer for _, s in Recorded.log)


# -- review 50: the slots of a host batch go back only once nothing holds a view of it ---------


class Viewing(Done):
    """A fast engine whose "device" copy is a view of the host tensor (``detach()``): another
    tensor object over the same slot."""

    def copy(self, batch):
        ev = FakeEvent(self.log, len(self.events))
        ev.done = True
        self.events.append(ev)
        return map_tensors(batch, torch.Tensor.detach), ev


class KeepsEvery:
    """A wrapper that forwards attributes to its loader (as accelerate's adapter does, so the
    prefetcher finds the loader's hooks through it) and keeps every batch it yields."""

    def __init__(self, loader):
        self.loader, self.kept = loader, []

    def __getattr__(self, name):
        return getattr(self.loader, name)

    def __iter__(self):
        for batch in self.loader:
            self.kept.append(batch)
            yield batch


class KeepingLoader(shmloader.DataLoader):
    """A loader subclass whose ``__iter__`` keeps every batch it yields."""

    def __iter__(self):
        self.kept = []
        for batch in super().__iter__():
            self.kept.append(batch)
            yield batch


@pytest.mark.parametrize("holder", ["wrapper", "subclass"])
@frees_its_loaders_on_failure
def test_a_host_batch_kept_beside_the_prefetcher_is_never_overwritten(holder):
    """Review 50: once a batch's copy completed the prefetcher gave its slots back, whatever
    else held it: a wrapper that forwards to the loader, or a loader subclass, that kept the
    batch then read later batches in it (27 of 32)."""
    if holder == "wrapper":
        source = KeepsEvery(shmloader.DataLoader(Rows(), batch_size=4, num_workers=2,
                                                 prefetch_factor=1))  # fmt: skip
    else:
        source = KeepingLoader(Rows(), batch_size=4, num_workers=2, prefetch_factor=1)
    out = [b[:, 0].tolist() for b in DevicePrefetcher(source, "cpu", depth=1, engine=Done())]
    expected = [[4.0 * i + j for j in range(4)] for i in range(16)]
    assert out == expected
    assert [k[:, 0].tolist() for k in source.kept] == expected
    source.kept.clear()
    gc.collect()
    loader = source.loader if holder == "wrapper" else source
    assert loader.stats().batches_held == 0  # the slots came back once the views died


@frees_its_loaders_on_failure
def test_a_device_batch_that_views_the_slot_is_never_overwritten():
    """Review 50: whether the device batch still views the slot was judged by the identity of
    its tensors, so an engine whose copy is a view (another tensor object) had its batches'
    slots given back under the user's views."""
    loader = shmloader.DataLoader(Rows(), batch_size=4, num_workers=2, prefetch_factor=1)
    kept = list(DevicePrefetcher(loader, "cpu", depth=1, engine=Viewing()))
    assert [k[:, 0].tolist() for k in kept] == [[4.0 * i + j for j in range(4)]
                                                for i in range(16)]  # fmt: skip
