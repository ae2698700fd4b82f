"""End-to-end behaviour of shmloader.DataLoader that torch has no counterpart for."""

import gc
import itertools
import os
import signal

import psutil
import pytest
import torch

import shmloader
from arena import ArenaExhaustedError

from .fakes import Counting, Growing, KillsItself, Raises, Sleepy, Squares, pad_collate


def test_every_slot_is_free_after_three_epochs_of_dropped_batches():
    loader = shmloader.DataLoader(
        Squares(64), batch_size=8, shuffle=True, num_workers=2, persistent_workers=True
    )
    for _ in range(3):
        for x, y in loader:
            assert torch.equal(x[:, 0, 0], y.float())
    del x, y
    st = loader.stats()
    assert st.slots_total > 0
    assert st.slots_free == st.slots_total
    assert st.batches_held == 0


def test_batches_kept_in_a_list_stay_intact_while_later_batches_arrive():
    loader = shmloader.DataLoader(Squares(96), batch_size=4, num_workers=2)
    kept = list(loader)
    for i, (x, y) in enumerate(kept):
        assert torch.equal(y, torch.arange(4 * i, 4 * i + 4))
        assert torch.equal(x, y.float().view(4, 1, 1).expand(4, 3, 4))
    assert loader.stats().batches_held == len(kept)
    del kept, x, y
    assert loader.stats().batches_held == 0


def test_holding_every_batch_past_the_cap_raises_a_clear_error():
    # Each batch needs one 4 kB page; a 6-page cap leaves room for 6 slots.
    loader = shmloader.DataLoader(
        Squares(64), batch_size=4, num_workers=1, arena_max_bytes=6 * 4096
    )
    kept = []
    with pytest.raises(ArenaExhaustedError, match=r"the user holds \d+ batches") as err:
        for batch in loader:
            kept.append(batch)
    assert "arena_max_bytes" in str(err.value) and ".clone()" in str(err.value)
    assert len(kept) >= 4


def test_dropping_batches_keeps_a_tiny_arena_going_without_error():
    loader = shmloader.DataLoader(
        Squares(64), batch_size=4, num_workers=2, arena_max_bytes=6 * 4096
    )
    assert sum(1 for _ in loader) == 16


def test_batches_that_keep_growing_get_ever_larger_slots():
    loader = shmloader.DataLoader(Growing(), batch_size=2, num_workers=2, collate_fn=pad_collate)
    for i, batch in enumerate(loader):
        n = 1000 * (2 * i + 2)
        assert batch.shape == (2, n)
        assert torch.all(batch[0, : n - 1000] == (2 * i) % 251)
        assert torch.all(batch[0, n - 1000 :] == 0)
        assert torch.all(batch[1] == (2 * i + 1) % 251)
    sizes = loader.stats().arena.slot_sizes
    assert len(sizes) >= 2
    assert all(b >= 2 * a for a, b in itertools.pairwise(sizes))


def test_a_dataset_error_names_the_worker_and_iteration_continues():
    loader = shmloader.DataLoader(Raises(), batch_size=2, num_workers=2)
    it = iter(loader)
    assert next(it).tolist() == [0, 1]
    assert next(it).tolist() == [2, 3]
    with pytest.raises(KeyError, match="in DataLoader worker process 0"):
        next(it)
    assert next(it).tolist() == [6, 7]
    assert len(list(it)) == 4


def test_a_killed_worker_raises_torchs_message_with_pid_and_signal():
    loader = shmloader.DataLoader(KillsItself(victim=9), batch_size=4, num_workers=2)
    killed = r"DataLoader worker \(pid \d+\) is killed by signal: Killed"
    with pytest.raises(RuntimeError, match=killed) as e:
        for _ in loader:
            pass
    assert "shmloader worker 0 of 2" in str(e.value)


def test_after_a_worker_death_a_persistent_loader_starts_fresh_workers():
    loader = shmloader.DataLoader(
        KillsItself(victim=2), batch_size=4, num_workers=2, persistent_workers=True
    )
    with pytest.raises(RuntimeError, match="is killed by signal"):
        list(loader)
    with pytest.raises(RuntimeError, match="is killed by signal"):
        list(loader)  # the same dataset kills again, but from a fresh iterator


def test_timeout_raises_torchs_error():
    loader = shmloader.DataLoader(Sleepy(), batch_size=1, num_workers=1, timeout=1.5)
    it = iter(loader)
    assert [next(it).item() for _ in range(3)] == [0, 1, 2]
    with pytest.raises(RuntimeError, match=r"DataLoader timed out after 1.5 seconds"):
        next(it)


def test_a_partially_consumed_iterator_that_is_dropped_stops_its_workers():
    loader = shmloader.DataLoader(Squares(64), batch_size=2, num_workers=2)
    it = iter(loader)
    next(it)
    pids = loader.stats().worker_pids
    assert all(psutil.pid_exists(p) for p in pids)
    del it
    gc.collect()
    _, alive = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], 5)
    assert not alive


def test_two_live_iterators_interleave():
    loader = shmloader.DataLoader(Squares(16), batch_size=4, num_workers=2)
    a, b = iter(loader), iter(loader)
    got = [(next(a)[1].tolist(), next(b)[1].tolist()) for _ in range(4)]
    assert got == [(list(range(4 * i, 4 * i + 4)),) * 2 for i in range(4)]


def test_an_iterable_dataset_is_sharded_by_worker_info():
    loader = shmloader.DataLoader(Counting(40), batch_size=5, num_workers=2)
    seen = sorted(v for batch in loader for v in batch.tolist())
    assert seen == list(range(40))


def test_workers_ignore_sigint_so_the_main_process_handles_ctrl_c():
    loader = shmloader.DataLoader(Squares(32), batch_size=4, num_workers=2)
    it = iter(loader)
    next(it)
    for pid in loader.stats().worker_pids:
        os.kill(pid, signal.SIGINT)
    assert len(list(it)) == 7


def test_an_unknown_backend_is_rejected_with_the_choices():
    choices = r"arena_backend must be one of \['auto', 'posix', 'memfd'\]"
    with pytest.raises(ValueError, match=choices):
        shmloader.DataLoader(Squares(4), arena_backend="tmpfs")


@pytest.mark.parametrize("backend", ["posix", "memfd"])
def test_both_backends_deliver_the_same_batches(backend):
    loader = shmloader.DataLoader(Squares(32), batch_size=8, num_workers=2, arena_backend=backend)
    assert [y.tolist() for _, y in loader] == [list(range(i, i + 8)) for i in range(0, 32, 8)]
    assert loader.stats().arena.backend == backend


def test_an_epoch_of_equal_batches_needs_exactly_one_slab():
    # The first batch of each worker (no slot size known yet) is planned, then collated into a
    # slot of the one size class; no second class or slab is ever needed.
    loader = shmloader.DataLoader(Squares(32), batch_size=8, num_workers=2)
    batches = [y.tolist() for _, y in loader]
    assert batches == [list(range(i, i + 8)) for i in range(0, 32, 8)]
    st = loader.stats().arena
    assert st.growth_events == 1 and len(st.slot_sizes) == 1


def test_batches_are_recorded_by_the_torch_profiler_when_it_runs():
    loader = shmloader.DataLoader(Squares(16), batch_size=4, num_workers=1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        n = sum(1 for _ in loader)
    assert n == 4
    names = [e.name for e in prof.events()]
    # one range per batch, and one for the call that ends the epoch (as torch records)
    assert names.count("enumerate(DataLoader)#ShmDataLoaderIter.__next__") == n + 1


def test_forked_workers_do_not_hold_each_others_pipes():
    loader = shmloader.DataLoader(
        Squares(32), batch_size=4, num_workers=3, multiprocessing_context="fork"
    )
    it = iter(loader)
    next(it)
    sockets = []
    for pid in loader.stats().worker_pids:
        links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        sockets.append(sum(link.startswith("socket:") for link in links))
    del it
    assert sockets == [1, 1, 1], f"pipe ends (sockets) held per worker: {sockets}"
