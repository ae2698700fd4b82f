"""Top-level (picklable) datasets, collates and fakes shared by the shmloader tests."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset

import shmloader
from shmloader.fence import CopyFence
from shmloader.host import ArenaHost
from shmloader.prefetch import map_tensors


class Squares(Dataset):
    """Sample i: a (3, 4) float tensor filled with i, and the label i."""

    def __init__(self, n: int = 64) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((3, 4), float(i)), i


class Growing(Dataset):
    """Sample i: a uint8 vector of length 1000 * (i + 1) filled with i % 251 — every batch is
    bigger than the one before, so the arena must keep adding larger slabs."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((1000 * (i + 1),), i % 251, dtype=torch.uint8)


def pad_collate(samples: list[torch.Tensor]) -> torch.Tensor:
    n = max(s.numel() for s in samples)
    out = shmloader.empty((len(samples), n), dtype=torch.uint8)
    out.zero_()
    for i, s in enumerate(samples):
        out[i, : s.numel()] = s
    return out


class Sleepy(Dataset):
    """Blocks forever on index 3 (waits on an event that never comes)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        if i == 3:
            import threading

            threading.Event().wait(3600)
        return i


class KillsItself(Dataset):
    """The worker that loads index ``victim`` dies of ``sig``."""

    def __init__(self, victim: int = 5, sig: int = signal.SIGKILL) -> None:
        self.victim = victim
        self.sig = sig

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> int:
        if i == self.victim:
            os.kill(os.getpid(), self.sig)
            time.sleep(10)  # the signal is fatal; this line is never reached
        return i


class Raises(Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> int:
        if i == 5:
            raise KeyError(f"bad index {i}")
        return i


class Counting(IterableDataset):
    """Each worker yields its share of range(n)."""

    def __init__(self, n: int = 40) -> None:
        self.n = n

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        wid, nw = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(wid, self.n, nw))


class FakeRegistrar:
    """Records cudaHostRegister / cudaHostUnregister calls, and the unregistrations of memory no
    longer mapped as an arena segment (``unmapped``: CUDA unlocks what the process maps, so
    the slab must still be there); can be told to fail."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.unmapped: list[int] = []

    def register(self, ptr: int, nbytes: int) -> None:
        if self.fail:
            raise RuntimeError("cudaHostRegister failed with error 2 (out of memory)")
        self.registered.append((ptr, nbytes))

    def unregister(self, ptr: int) -> None:
        self.unregistered.append(ptr)
        if not _segment_mapped_at(ptr):
            self.unmapped.append(ptr)


def _segment_mapped_at(ptr: int) -> bool:
    """Whether this process maps an arena segment (a /dev/shm file or a memfd) at ``ptr``."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= ptr < hi:
                return len(fields) == 6 and ("/dev/shm/" in fields[5] or "memfd:" in fields[5])
    return False


class FakeEvents:
    """An event factory for :class:`shmloader.fence.CopyFence` standing in for CUDA: an event
    completes only when the test says so (:meth:`complete_all`) or when someone waits on it
    (``wait``, which the fake counts); ``query`` never completes one by itself. While
    ``stuck_waits`` is positive the GPU is stuck: each wait uses up its whole timeout, as a
    real one would, fails, and counts ``stuck_waits`` down."""

    def __init__(self) -> None:
        self.made: list[FakeEvent] = []
        self.records = 0
        self.waits = 0
        self.stuck_waits = 0

    def __call__(self) -> FakeEvent:
        event = FakeEvent(self)
        self.made.append(event)
        return event

    def complete_all(self) -> None:
        for event in self.made:
            event.done = True


class FakeEvent:
    def __init__(self, events: FakeEvents) -> None:
        self.events = events
        self.done = True  # a new event has nothing queued before it

    def record(self) -> None:
        self.events.records += 1
        self.done = False

    def query(self) -> bool:
        return self.done

    def wait(self, timeout: float) -> bool:
        events = self.events
        events.waits += 1
        if not self.done and events.stuck_waits > 0:
            events.stuck_waits -= 1
            time.sleep(timeout)  # a real wait's timeout passing, not a synchronisation
            return False
        self.done = True
        return True


def fenced_loader(
    monkeypatch: Any, events: Any, dataset: Any = None, **kwargs: Any
) -> tuple[Any, Any]:
    """A loader (and its host) of ``dataset`` (default ``Squares(64)``) whose arena behaves as
    page-locked: slabs go through a fake registrar, batches are passed through as torch would
    pass views of registered memory, and copies are ``events``' fake events. Its ``timeout``
    defaults to 10 s."""
    monkeypatch.setattr("shmloader.pin.pin_memory", lambda batch, device: batch)
    kwargs.setdefault("timeout", 10)
    dataset = Squares(64) if dataset is None else dataset
    loader = shmloader.DataLoader(dataset, batch_size=4, num_workers=2, **kwargs)
    host = ArenaHost(
        backend="auto",
        max_bytes=kwargs.get("arena_max_bytes"),
        slots_per_slab=loader.arena_options.slots_per_slab or loader._default_slots_per_slab(),
        pin=True,
        pin_device="cuda",
    )
    host.pinner._registrar = FakeRegistrar()
    host.leases.fence = CopyFence(events)
    loader._host = host
    loader._host_for = lambda pin, device: host
    return loader, host


class DoneEvent:
    """A copy that has completed at once."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class CloningEngine:
    """A stand-in for the CUDA copy engine: the "device" batch is a clone, complete at once."""

    def copy(self, batch: Any) -> tuple[Any, DoneEvent]:
        return map_tensors(batch, torch.clone), DoneEvent()

    def hand_over(self, device_batch: Any, event: Any) -> None:
        pass
