import gc
import weakref

import pytest
import torch

from shmloader.pin import Pinner

from .fakes import FakeRegistrar


def _new_slab(arena, nbytes):
    ref = arena.acquire(nbytes)
    return arena.slab(ref.slab_id)


def test_each_slab_is_registered_once_and_unregistered_at_close(arena):
    reg = FakeRegistrar()
    pinner = Pinner(True, "cuda", reg)
    slab = _new_slab(arena, 1 << 16)
    pinner.register(slab)
    pinner.register(slab)
    assert len(reg.registered) == 1
    assert reg.registered[0][1] == slab.size
    assert pinner.pinned_bytes == slab.size
    other = _new_slab(arena, 1 << 20)
    pinner.register(other)
    assert pinner.pinned_bytes == slab.size + other.size
    pinner.close()
    assert sorted(reg.unregistered) == sorted(p for p, _ in reg.registered)
    assert pinner.pinned_bytes == 0
    pinner.close()
    assert len(reg.unregistered) == 2


def test_large_slabs_are_registered_in_chunks(arena, monkeypatch):
    monkeypatch.setattr("shmloader.pin.CHUNK_BYTES", 1 << 16)
    reg = FakeRegistrar()
    pinner = Pinner(True, "cuda", reg)
    slab = _new_slab(arena, 1 << 18)  # 2 slots of 256 kB -> 8 chunks
    pinner.register(slab)
    assert [n for _, n in reg.registered] == [1 << 16] * (slab.size >> 16)
    pinner.close()


def test_a_failed_registration_falls_back_to_copying_with_one_warning(arena):
    pinner = Pinner(True, "cuda", FakeRegistrar(fail=True))
    with pytest.warns(RuntimeWarning, match="could not page-lock.*ulimit -l") as got:
        pinner.register(_new_slab(arena, 1 << 16))
    assert [w.filename for w in got] == [__file__]  # the caller's line, not shmloader's
    assert pinner.fallback and pinner.pinned_bytes == 0
    pinner.register(_new_slab(arena, 1 << 20))  # no second warning, no second attempt
    pinner.close()


def test_pinning_disabled_passes_batches_through_untouched():
    pinner = Pinner(False, None, FakeRegistrar())
    batch = [torch.ones(2)]
    assert pinner.pin(batch) is batch


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_views_of_a_registered_slab_are_pinned_on_a_real_gpu():
    import shmloader

    from .fakes import Squares

    loader = shmloader.DataLoader(Squares(64), batch_size=8, num_workers=2, pin_memory=True)
    for x, y in loader:
        assert x.is_pinned() and y.is_pinned()
        assert torch.equal(x.to("cuda", non_blocking=True).cpu(), x)
    assert loader.stats().pinned_bytes > 0


class RefusesPinning:
    """A custom batch whose ``pin_memory()`` raises."""

    def pin_memory(self):
        raise ValueError("custom pin failed")


def test_a_custom_pin_memory_error_is_wrapped_as_torchs_pin_thread_wraps_it():
    """Review 17 F8: the bare ValueError reached the user; torch's pin thread wraps it, so its
    message names the thread and carries the original traceback."""
    pinner = Pinner(True, "cuda", FakeRegistrar())
    with pytest.raises(ValueError, match=r"Caught ValueError in pin memory thread for device 0\."):
        pinner.pin(RefusesPinning())


def test_a_custom_pin_memory_error_keeps_no_cycle_to_the_batch():
    """Review 81: torch's ``reraise`` keeps the exception it raises in a local of its frame, which
    the exception's traceback holds: a cycle that kept the batch (and, in the loader, the
    iterator whose ``next()`` frames the traceback holds) alive until a garbage collection."""
    pinner = Pinner(True, "cuda", FakeRegistrar())
    batch = RefusesPinning()
    gone = weakref.ref(batch)
    gc.collect()
    gc.disable()
    try:
        with pytest.raises(ValueError, match="in pin memory thread"):
            pinner.pin(batch)
        del batch
        assert gone() is None
    finally:
        gc.enable()


@pytest.fixture
def accelerator(monkeypatch):
    """Pinning as on a machine with CUDA: torch sees an accelerator, slabs go through a fake
    registrar, batches pass through torch's pinning walk unchanged, copies are fake events."""
    import shmloader.host
    import shmloader.pin

    from .fakes import FakeEvents

    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator",
                        lambda check_available=False: torch.device("cuda"))  # fmt: skip
    monkeypatch.setattr(shmloader.pin, "CudaRegistrar", FakeRegistrar)
    monkeypatch.setattr(shmloader.pin, "pin_memory", lambda batch, device: batch)
    monkeypatch.setattr(shmloader.host, "cuda_events", lambda device: FakeEvents())


@pytest.mark.parametrize("first", [False, True], ids=["then pinned", "then not"])
def test_pin_memory_changed_between_iterators_is_honoured(accelerator, first):
    """Review 17 F7: the loader kept the arena, and so the pinning, of its first iterator; torch's
    next iterator reads pin_memory anew. Batches held from before stay intact."""
    import shmloader

    from .fakes import Squares

    loader = shmloader.DataLoader(Squares(16), batch_size=4, num_workers=2, pin_memory=first)
    held = next(iter(loader))
    old = loader._host
    assert old.pinner.enabled is first
    loader.pin_memory = not first
    batch = next(iter(loader))
    assert loader._host is not old and loader._host.pinner.enabled is (not first)
    assert (loader._host.pinner.pinned_bytes > 0) is (not first)
    assert old.retired and loader.stats().batches_retired == 1
    assert held[1].tolist() == batch[1].tolist() == [0, 1, 2, 3]
    assert torch.equal(held[0], batch[0]) and held[0][3].unique().tolist() == [3.0]


def test_release_reaches_a_batch_of_an_iterator_started_before_a_pin_change(accelerator):
    """Review 20 F4: release() looked in the loader's current arena only; a batch of an iterator
    started before pin_memory changed (its arena superseded, still running) released nothing."""
    import shmloader

    from .fakes import Squares

    loader = shmloader.DataLoader(Squares(16), batch_size=4, num_workers=2, pin_memory=False)
    old = iter(loader)
    before = next(old)
    assert shmloader.release(before, loader) == 1
    loader.pin_memory = True
    new = iter(loader)
    assert shmloader.release(next(old), loader) == 1  # from the superseded arena
    assert shmloader.release(next(new), loader) == 1
    del old, new


class Growing(torch.utils.data.Dataset):
    """Batches (of 4) whose size rises past the cap's room, so that the arena gives idle slabs
    of the smaller sizes back to grow the larger."""

    KIB = (4, 8, 16, 32, 64, 128, 256)

    def __len__(self):
        return 4 * len(self.KIB)

    def __getitem__(self, i):
        return torch.full((self.KIB[i // 4] * 256,), i, dtype=torch.int32)


def test_a_slab_the_arena_gives_back_is_unlocked_while_still_mapped(monkeypatch):
    """Review 37 F5: a page-locked slab given back at the cap was unmapped, then unregistered
    (cudaHostUnregister of memory no longer there)."""
    from .fakes import FakeEvents, fenced_loader

    events = FakeEvents()
    loader, host = fenced_loader(monkeypatch, events, Growing(), arena_max_bytes=4 << 20)
    registrar = host.pinner._registrar
    try:
        for i, batch in enumerate(loader):
            assert batch[:, 0].tolist() == list(range(4 * i, 4 * i + 4))
            del batch
            events.complete_all()
        assert registrar.unregistered  # slabs were given back
        assert registrar.unmapped == []
    finally:
        del loader
        host.close()
    assert registrar.unmapped == []
