"""End-to-end behaviour of shmloader.DataLoader that torch has no counterpart for."""

import contextlib
import gc
import itertools
import math
import multiprocessing
import os
import signal
from typing import Any

import numpy as np
import psutil
import pytest
import torch

import shmloader
from arena import ArenaExhaustedError
from shmloader.worker import worker_main
from tests.lifetime_checks import frees_its_loaders_on_failure

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
    page = 4096
    loader = shmloader.DataLoader(
        Squares(64), batch_size=4, num_workers=1, arena_max_bytes=6 * page, timeout=30
    )
    kept = []
    with pytest.raises(ArenaExhaustedError) as err:
        for batch in loader:
            kept.append(batch)
    message = str(err.value)
    # the user holds exactly what the cap allows, and the message gives exactly those numbers
    assert len(kept) == 6
    assert f"the user holds 6 batches ({6 * page:,} bytes)" in message, message
    assert f"the arena is at its cap of {6 * page:,} bytes (6 slots)" in message, message
    for fix in (".clone()", "shmloader.release(batch, loader)", "arena_max_bytes"):
        assert fix in message
    for i, (x, y) in enumerate(kept):  # still intact: the error handed out no slot in use
        assert torch.equal(y, torch.arange(4 * i, 4 * i + 4))
        assert torch.equal(x, y.float().view(4, 1, 1).expand(4, 3, 4))
    st = loader.stats()
    assert st.batches_held == 6 and st.arena.slots_by_state["lent"] == 6


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


_SIGNALLED = multiprocessing.get_context("fork").Event()


def _worker_main_after_the_signal(cfg: Any, conn: Any) -> None:
    """A forked worker's entry, held before shmloader's own until the test has sent SIGINT."""
    if not _SIGNALLED.wait(30):
        os._exit(3)
    worker_main(cfg, conn)


def test_a_ctrl_c_while_a_forked_worker_starts_up_does_not_kill_it(monkeypatch):
    # A CI run sent SIGINT to a worker still in multiprocessing's bootstrap, before it ignored
    # SIGINT: it died of KeyboardInterrupt. Here every worker waits at that point for the
    # signal; SIGINT is blocked there now (until worker_main ignores it), so they live on.
    monkeypatch.setattr("shmloader.supervisor.worker_main", _worker_main_after_the_signal)
    loader = shmloader.DataLoader(Squares(32), batch_size=4, num_workers=2)
    it = iter(loader)
    for pid in loader.stats().worker_pids:
        os.kill(pid, signal.SIGINT)
    _SIGNALLED.set()
    try:
        assert len(list(it)) == 8
    finally:
        _SIGNALLED.clear()


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


@frees_its_loaders_on_failure
def test_forked_workers_do_not_hold_each_others_pipes():
    loader = shmloader.DataLoader(
        Squares(32), batch_size=4, num_workers=3, multiprocessing_context="fork"
    )
    it = iter(loader)
    next(it)
    sockets = []
    for pid in loader.stats().worker_pids:
        links = []
        for fd in os.listdir(f"/proc/{pid}/fd"):
            # A worker attaching a slab holds its descriptor only while it maps it: such a
            # descriptor can be gone by the time it is read. The pipe ends live as long as it.
            with contextlib.suppress(FileNotFoundError):
                links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        sockets.append(sum(link.startswith("socket:") for link in links))
    del it
    assert sockets == [1, 1, 1], f"pipe ends (sockets) held per worker: {sockets}"


# ------------------------------------------------------------------ defaults the README states


@pytest.mark.parametrize(
    ("num_workers", "prefetch_factor", "slots"), [(1, None, 3), (2, None, 5), (2, 3, 7)]
)
def test_a_slab_has_prefetch_factor_times_workers_plus_one_slots_by_default(
    num_workers, prefetch_factor, slots
):
    loader = shmloader.DataLoader(
        Squares(64), batch_size=4, num_workers=num_workers, prefetch_factor=prefetch_factor
    )
    assert [y.tolist() for _, y in loader] == [list(range(i, i + 4)) for i in range(0, 64, 4)]
    st = loader.stats().arena
    assert (st.slabs, st.slots_total) == (1, slots)  # equal batches: one slab of one class


def _mem_available() -> int:
    with open("/proc/meminfo", encoding="ascii") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024


def test_the_default_arena_cap_is_half_the_ram_available_when_the_arena_is_made():
    loader = shmloader.DataLoader(Squares(16), batch_size=4, num_workers=1)
    before = _mem_available()
    it = iter(loader)  # the arena is made here
    after = _mem_available()
    assert next(it)[1].tolist() == [0, 1, 2, 3]
    cap = loader.stats().arena.max_bytes
    assert min(before, after) // 2 * 0.98 <= cap <= max(before, after) // 2 * 1.02
    del it


# ---------------------------------------------------------------------- shmloader.release()


def test_release_returns_a_held_batchs_slot_at_once_and_counts_it():
    loader = shmloader.DataLoader(Squares(64), batch_size=4, num_workers=2, timeout=30)
    it = iter(loader)
    x, y = batch = next(it)
    assert loader.stats().batches_held == 1
    lent_before = loader.stats().arena.slots_by_state["lent"]
    assert shmloader.release(batch, loader) == 1  # one slot, whatever the number of tensors
    st = loader.stats()
    assert st.batches_held == 0
    assert st.arena.slots_by_state["lent"] == lent_before - 1
    assert shmloader.release(batch, loader) == 0  # nothing left to release (slot not reused)
    assert shmloader.release(x, loader) == 0
    del x, y, batch, it


def test_release_of_something_the_loader_did_not_lend_returns_zero():
    loader = shmloader.DataLoader(Squares(16), batch_size=4, num_workers=2, timeout=30)
    assert shmloader.release(torch.zeros(4), loader) == 0  # no arena yet
    it = iter(loader)
    held = next(it)
    assert shmloader.release((torch.zeros(4), [1, "a"], {"k": None}), loader) == 0
    assert loader.stats().batches_held == 1
    assert torch.equal(held[1], torch.arange(4))
    del held, it


def test_a_released_batch_keeps_its_data_until_its_slot_is_reused_and_only_then_changes():
    loader = shmloader.DataLoader(Squares(128), batch_size=4, num_workers=2, timeout=30)
    it = iter(loader)
    x0, y0 = next(it)
    for i in range(1, 8):  # held, batch 0 stays intact while later batches arrive
        y = next(it)[1]
        assert y.tolist() == list(range(4 * i, 4 * i + 4))
        assert y0.tolist() == [0, 1, 2, 3] and torch.all(x0[:, 0, 0] == y0.float())
    del y
    assert shmloader.release((x0, y0), loader) == 1
    later = None
    for i in range(8, 32):  # drop each batch: the released slot is soon reused
        y = next(it)[1]
        if y0.tolist() == y.tolist():
            later = i
            break
    assert later is not None, "no later batch was written into the released slot"
    assert y0.tolist() == list(range(4 * later, 4 * later + 4))  # a later batch's bytes
    assert torch.all(x0[:, 0, 0] == y0.float())
    del x0, y0, y, it
    gc.collect()
    st = loader.stats()
    assert st.batches_held == 0 and st.arena.slots_free == st.arena.slots_total


def test_releasing_every_batch_early_keeps_a_one_slab_arena_going():
    # 1 worker, prefetch 2: 3 slots; without release, holding 4 batches would need a new slab
    loader = shmloader.DataLoader(
        Squares(64), batch_size=4, num_workers=1, arena_max_bytes=3 * 4096, timeout=30
    )
    kept = []
    for i, (x, y) in enumerate(loader):
        assert y.tolist() == list(range(4 * i, 4 * i + 4))
        assert shmloader.release((x, y), loader) == 1
        kept.append((x, y))  # still referenced, but released: the slot is the arena's again
    assert len(kept) == 16
    assert loader.stats().batches_held == 0
    del kept, x, y


class MetaAndSignedZeros(torch.utils.data.Dataset):
    """Samples with a meta tensor (a shape placeholder) and a signed zero that flips every two
    samples."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        spec = torch.empty(2, 3, device="meta")
        return {"x": torch.full((4,), i), "spec": spec, "sign": -0.0 if (i // 2) % 2 else 0.0}


def first_sign_as_a_float(samples):
    """torch's default collate, but ``sign`` stays a Python float: the batch's first."""
    rest = [{k: v for k, v in s.items() if k != "sign"} for s in samples]
    batch = torch.utils.data.default_collate(rest)
    batch["sign"] = samples[0]["sign"]
    return batch


@pytest.mark.parametrize("collate_fn", [None, first_sign_as_a_float], ids=["default", "custom"])
@frees_its_loaders_on_failure
def test_meta_tensors_and_signed_zeros_arrive_as_torch_yields_them(collate_fn):
    # A user's meta tensor was taken for the default collate's own planning placeholder (every
    # batch failed: "Cannot copy out of meta tensor"), and a cached payload for 0.0 was reused
    # for -0.0 (a cache keyed by (float, value), and 0.0 == -0.0).
    def seen(loader):
        out = []
        for b in loader:
            sign = b["sign"].tolist() if torch.is_tensor(b["sign"]) else [b["sign"]]
            spec = (b["spec"].device.type, tuple(b["spec"].shape))
            out.append((b["x"][:, 0].tolist(), spec, [math.copysign(1, v) for v in sign]))
        return out

    kwargs = {"batch_size": 2, "num_workers": 2, "collate_fn": collate_fn}
    ours = seen(shmloader.DataLoader(MetaAndSignedZeros(), **kwargs))
    assert ours == seen(torch.utils.data.DataLoader(MetaAndSignedZeros(), **kwargs))
    assert {signs[0] for *_, signs in ours} == {1.0, -1.0}


def fortran_rows(samples):
    """A Fortran-ordered NumPy leaf and a C-ordered one."""
    rows = np.stack(samples)
    return {"f": np.asfortranarray(rows), "c": rows}


@frees_its_loaders_on_failure
def test_numpy_leaves_keep_their_memory_order_as_torch_keeps_it():
    kwargs = {"batch_size": 4, "num_workers": 2, "collate_fn": fortran_rows}

    def seen(loader):
        return [
            (b["f"].tolist(), b["f"].flags.f_contiguous, b["c"].flags.c_contiguous) for b in loader
        ]

    ours = seen(shmloader.DataLoader(Rows(), **kwargs))
    assert ours == seen(torch.utils.data.DataLoader(Rows(), **kwargs))
    assert all(f and c for _, f, c in ours)


class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 12

    def __getitem__(self, i):
        return np.arange(3, dtype=np.float32) + 10 * i


def test_a_thread_token_is_its_threads_own_even_for_threads_threading_did_not_start():
    """Review 80: the thread allowed to make a resumed epoch's owed draws was matched by its
    Thread object, which threading hands again to a later thread it did not start (a
    C-extension callback) that reuses the dead one's id. Each thread has a token of its own."""
    import _thread
    import threading
    import weakref

    from shmloader.single import thread_token

    first: list[weakref.ref] = []  # type: ignore[type-arg]
    seen: list[bool] = []
    done = [threading.Event(), threading.Event()]

    def record() -> None:
        first.append(weakref.ref(thread_token()))
        done[0].set()

    def compare() -> None:
        seen.append(first[0]() is thread_token())
        done[1].set()

    _thread.start_new_thread(record, ())
    assert done[0].wait(10)
    _thread.start_new_thread(compare, ())
    assert done[1].wait(10)
    assert seen == [False]
    assert thread_token() is thread_token()  # one per thread for its life
