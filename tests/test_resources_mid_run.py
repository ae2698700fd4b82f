"""A process that runs short of descriptors or address space mid-run: the batch that cannot get
its slab fails alone, in the main process, with a shmloader error that names the resource, the
numbers and the fix; once the resource is back, the batches load again.

Review 10b: a worker briefly out of descriptors when a new slab was announced failed every later
batch in that slab, for the rest of the epoch and (persistent workers) every epoch after (t6),
with an ``OSError`` blaming a gone owner or ``/proc``; a worker under ``ulimit -v`` failed with a
bare ``OSError: [Errno 12] mmap ... failed`` (t5); and starting workers with too few descriptors
blamed "the batches you hold" (t4).
"""

from __future__ import annotations

import errno
import functools
import os
import resource
from pathlib import Path

import pytest
import torch

import arena.segment
import shmloader
from arena import ArenaCapacityError, ArenaDescriptorError
from tests.lifetime_checks import frees_its_loaders_on_failure

SAMPLE = 4 << 10  # float32 values of one sample: 16 KiB
BATCH = 4


class Rows(torch.utils.data.Dataset[torch.Tensor]):
    def __init__(self, n: int = 48, width: int = SAMPLE) -> None:
        self.n, self.width = n, width

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((self.width,), float(i))


def _rows(batch: torch.Tensor, k: int) -> bool:
    return torch.equal(batch[:, 0], torch.arange(k * BATCH, (k + 1) * BATCH, dtype=torch.float32))


def _no_descriptors_while(flag: str, worker_id: int) -> None:
    """worker_init_fn: while ``flag`` exists, this worker cannot open a descriptor to map a slab
    (``EMFILE``, as when its dataset holds all of them for a while)."""
    real = arena.segment.reopen_descriptor

    def reopen(owner_pid: int, fd: int, flags: int) -> int:
        if os.path.exists(flag):
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return real(owner_pid, fd, flags)

    arena.segment.reopen_descriptor = reopen


@frees_its_loaders_on_failure
def test_a_worker_briefly_out_of_descriptors_fails_only_the_batches_it_could_not_map(
    tmp_path: Path,
) -> None:
    flag = tmp_path / "no-descriptors"
    flag.touch()
    workers, prefetch = 1, 2
    loader = shmloader.DataLoader(
        Rows(), batch_size=BATCH, num_workers=workers, prefetch_factor=prefetch,
        persistent_workers=True, worker_init_fn=functools.partial(_no_descriptors_while, str(flag)),
        timeout=60,  # a regression times out, it does not hang
    )  # fmt: skip
    it = iter(loader)
    with pytest.raises(ArenaDescriptorError) as raised:
        next(it)  # the worker could not map the slab of batch 0
    flag.unlink()  # descriptors are back
    text = str(raised.value)
    # The main process sees the arena's type, and the worker's reason with the numbers and fix.
    assert "Caught ArenaDescriptorError in DataLoader worker process 0" in text
    assert "cannot attach a shared-memory slab of" in text and "Too many open files" in text
    assert "descriptors open" in text and "`ulimit -n` = " in text
    assert "worker_init_fn" in text and "num_workers" in text
    assert "owner may have exited" not in text
    failed, loaded = [0], []
    for k in range(1, len(loader)):
        try:
            batch = next(it)
        except ArenaDescriptorError:
            failed.append(k)  # a task the worker took before the descriptors came back
        else:
            assert _rows(batch, k)
            loaded.append(k)
    with pytest.raises(StopIteration):
        next(it)
    # Only tasks already sent while the worker was short may fail: at most the ones in flight
    # (prefetch_factor per worker) plus the one sent as batch 0's error was taken.
    assert failed == list(range(len(failed))) and len(failed) <= workers * prefetch + 1, failed
    assert loaded == list(range(len(failed), len(loader)))
    # The next epoch of the same (persistent) worker loads every batch.
    assert [_rows(b, k) for k, b in enumerate(loader)] == [True] * len(loader)
    del it, loader


def _address_space_capped(margin: int, worker_id: int) -> None:
    """worker_init_fn: the worker may map only ``margin`` bytes more than it maps now."""
    with open("/proc/self/status", encoding="ascii") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + margin, resource.RLIM_INFINITY))


@frees_its_loaders_on_failure
def test_a_worker_that_cannot_map_a_slab_under_ulimit_v_raises_a_capacity_error_in_main() -> None:
    width = 64 << 10  # 256 KiB samples: 1 MiB batches, in slabs of 32 slots
    loader = shmloader.DataLoader(
        Rows(16, width), batch_size=BATCH, num_workers=1, arena_slots_per_slab=32,
        worker_init_fn=functools.partial(_address_space_capped, 8 << 20), timeout=60,
    )  # fmt: skip
    it = iter(loader)
    with pytest.raises(ArenaCapacityError) as raised:
        next(it)
    text = str(raised.value)
    assert "Caught ArenaCapacityError in DataLoader worker process 0" in text
    assert "cannot map a shared-memory slab of" in text and "Cannot allocate memory" in text
    assert "(`ulimit -v`, RLIMIT_AS) is " in text
    assert "worker_init_fn" in text and "arena_slots_per_slab" in text
    # Iteration goes on: the next batch is tried (and fails the same way: the cap stays).
    with pytest.raises(ArenaCapacityError):
        next(it)
    del it, loader


@frees_its_loaders_on_failure
def test_too_few_descriptors_to_start_workers_says_it_is_the_workers_not_held_batches() -> None:
    loader = shmloader.DataLoader(Rows(), batch_size=BATCH, num_workers=2)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = len(os.listdir("/proc/self/fd")) + 4
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        with pytest.raises(ArenaDescriptorError) as raised:
            next(iter(loader))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    text = str(raised.value)
    assert "starting 2 DataLoader workers" in text and "RNG state" in text
    assert f"`ulimit -n` = {limit}" in text and "descriptors open" in text
    assert "RLIMIT_NOFILE" in text
    assert "batches you hold" not in text
    # With the limit back, the same loader starts its workers.
    assert [_rows(b, k) for k, b in enumerate(loader)] == [True] * len(loader)
    del loader
