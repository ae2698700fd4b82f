"""Behaviours that PyTorch's own test/test_dataloader.py checks, run on the loader under test.

These are absolute checks (the batch i of a sequential loader holds samples i*b .. i*b+b-1, each
worker gets its own seed, ...), complementing the side-by-side comparison with torch in
test_parity_with_torch.py. The arena-stats and view-flag tests are shmloader-specific.
"""

from __future__ import annotations

import gc
import math
import os
import traceback
from collections import Counter

import numpy as np
import psutil
import pytest
import torch
from torch.utils.data import TensorDataset

from tests import parity_datasets as pd

DATA = torch.arange(40 * 6, dtype=torch.float32).reshape(40, 2, 3)
LABELS = torch.arange(40) % 7
TENSORS = TensorDataset(DATA, LABELS)


def make(*args, **kwargs):
    return pd.candidate_loader_class()(*args, **kwargs)


def raised(fn, expected):
    """Runs ``fn`` and returns the ``expected`` exception it raises, with its frames cleared so
    that the exception keeps no loader iterator (and so no worker) alive."""
    try:
        fn()
    except expected as exc:
        traceback.clear_frames(exc.__traceback__)
        return exc
    pytest.fail(f"expected {expected.__name__}, nothing was raised")


def ids_of(batch):
    return batch[1].tolist() if isinstance(batch[1], torch.Tensor) else [batch[1]]


def worker_children():
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        if "forkserver" not in cmd and "resource_tracker" not in cmd:
            out.append(p)
    return out


# ------------------------------------------------------------------------ order and coverage


@pytest.mark.parametrize(
    ("batch_size", "num_workers", "prefetch_factor"),
    [(None, 2, None), (1, 2, None), (2, 4, 3), (3, 2, 1)],
    ids=[
        "no-batching-2-workers",
        "batch-1-2-workers",
        "batch-2-4-workers-prefetch-3",
        "batch-3-2-workers-prefetch-1",
    ],
)
def test_sequential_batches_hold_consecutive_samples(batch_size, num_workers, prefetch_factor):
    loader = make(
        TENSORS, batch_size=batch_size, num_workers=num_workers, prefetch_factor=prefetch_factor
    )
    count = 0
    for i, (x, y) in enumerate(loader):
        if batch_size is None:
            assert torch.equal(x, DATA[i]) and torch.equal(y, LABELS[i])
        else:
            assert torch.equal(x, DATA[i * batch_size : (i + 1) * batch_size])
            assert torch.equal(y, LABELS[i * batch_size : (i + 1) * batch_size])
        count += 1
    assert count == len(loader) == (40 if batch_size is None else math.ceil(40 / batch_size))


@pytest.mark.parametrize("batch_size", [None, 1, 3], ids=lambda b: f"batch-{b}")
def test_shuffled_epoch_yields_every_sample_exactly_once(batch_size):
    loader = make(
        pd.ArangeDataset(50),
        batch_size=batch_size,
        shuffle=True,
        num_workers=2,
        generator=torch.Generator().manual_seed(7),
    )
    seen = []
    for batch in loader:
        ids = ids_of(batch)
        expected_x = torch.stack([pd.ArangeDataset()[i][0] for i in ids])
        assert torch.equal(batch[0].reshape(-1, 3, 4), expected_x)
        seen += ids
    assert Counter(seen) == Counter(range(50))
    assert seen != sorted(seen)


def test_batch_sampler_of_uneven_tuples_is_followed_exactly():
    batches = []
    for i in range(0, 20, 5):
        batches += [tuple(range(i, i + 2)), tuple(range(i + 2, i + 5))]
    loader = make(pd.ArangeDataset(), batch_sampler=batches, num_workers=2)
    assert len(loader) == 8
    assert [tuple(ids_of(b)) for b in loader] == batches


def test_plain_range_sampler_is_followed_and_sets_len():
    loader = make(pd.ArangeDataset(), sampler=range(2, 12), batch_size=2, num_workers=2)
    assert len(loader) == 5
    assert [ids_of(b) for b in loader] == [[i, i + 1] for i in range(2, 12, 2)]


def test_sampler_of_index_lists_without_batching_fetches_whole_lists():
    loader = make(
        pd.BulkDataset(35), batch_size=None, num_workers=2, sampler=pd.BulkIndexSampler(35, 4)
    )
    batches = list(loader)
    assert [len(b) for b in batches] == [4] * 8 + [3]
    assert sorted(torch.cat(batches).tolist()) == list(range(35))


@pytest.mark.parametrize("num_workers", [0, 1], ids=lambda w: f"{w}-workers")
def test_loader_converts_into_builtin_collections(num_workers):
    for collection in (list, tuple):
        fetched = collection(make(list(range(20)), batch_size=None, num_workers=num_workers))
        assert fetched == collection(range(20))
        assert all(type(v) is int for v in fetched)
        batches = collection(make(pd.CountingIterable(20), batch_size=2, num_workers=num_workers))
        assert [b.tolist() for b in batches] == [[i, i + 1] for i in range(0, 20, 2)]


def test_a_multiprocessing_context_object_is_accepted():
    context = torch.multiprocessing.get_context("fork")
    loader = make(list(range(11)), batch_size=3, num_workers=2, multiprocessing_context=context)
    assert [b.tolist() for b in loader] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10]]


def test_two_loaders_can_be_iterated_interleaved():
    first = iter(make(TENSORS, batch_size=2, num_workers=1))
    second = iter(make(TENSORS, batch_size=4, num_workers=2))
    for i in range(3):
        assert torch.equal(next(first)[0], DATA[2 * i : 2 * i + 2])
        assert torch.equal(next(second)[0], DATA[4 * i : 4 * i + 4])


def test_batches_are_dealt_round_robin_to_workers():
    dataset = pd.WorkerQueueDataset(32)
    loader = make(dataset, batch_size=4, num_workers=3, worker_init_fn=dataset.remember_worker)
    for i, (worker_ids, sample_ids) in enumerate(loader):
        assert worker_ids.tolist() == [i % 3] * 4
        assert sample_ids.tolist() == list(range(4 * i, 4 * i + 4))


# ------------------------------------------------------------------------- seeds and worker info


def _seeds(loader):
    """The set of (worker id, torch.initial_seed(), WorkerInfo.seed) seen over one epoch."""
    out = set()
    for ids, initials, seeds in loader:
        out |= set(zip(ids.tolist(), initials.tolist(), seeds.tolist(), strict=True))
    return out


def test_each_worker_gets_its_own_seed_base_plus_id():
    seeds = _seeds(make(pd.SeedReportingDataset(6), batch_size=1, num_workers=3))
    assert {wid for wid, _, _ in seeds} == {0, 1, 2}
    assert all(initial == seed for _, initial, seed in seeds)
    assert len({seed - wid for wid, _, seed in seeds}) == 1


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh-workers", "persistent-workers"])
def test_worker_seeds_change_per_epoch_unless_workers_persist(persistent):
    loader = make(
        pd.SeedReportingDataset(4), batch_size=1, num_workers=2, persistent_workers=persistent
    )
    first, second = _seeds(loader), _seeds(loader)
    assert len(first) == 2
    assert (first == second) if persistent else not (first & second)


def test_worker_seeds_repeat_with_an_identically_seeded_generator():
    def seeds(generator_seed):
        generator = torch.Generator().manual_seed(generator_seed)
        return _seeds(
            make(pd.SeedReportingDataset(4), batch_size=2, num_workers=2, generator=generator)
        )

    assert seeds(42) == seeds(42)
    assert seeds(42) != seeds(43)


def test_worker_init_fn_can_reseed_each_worker():
    loader = make(
        pd.SeedReportingDataset(4),
        batch_size=2,
        num_workers=2,
        worker_init_fn=pd.reseed_torch_12345,
    )
    assert {initial for _, initial, _ in _seeds(loader)} == {12345}


def test_get_worker_info_describes_the_worker_and_its_dataset_copy():
    assert torch.utils.data.get_worker_info() is None
    assert pd.candidate_get_worker_info() is None
    dataset = pd.WorkerInfoProbeDataset(8)
    loader = make(dataset, batch_size=None, num_workers=2, worker_init_fn=pd.mark_worker_init_fn)
    samples = list(loader)
    assert [s["id"] for s in samples] == [i % 2 for i in range(8)]
    for s in samples:
        assert s["num_workers"] == 2
        assert s["seed"] == s["initial_seed"]
        assert s["marker"] == 100 + s["id"]
        assert s["dataset_is_fetching_copy"] and s["read_only"] and s["repr_names_fields"]
        assert s["exported_matches"]
    pids = {s["pid"] for s in samples}
    assert len(pids) == 2 and os.getpid() not in pids
    assert torch.utils.data.get_worker_info() is None
    assert not hasattr(dataset, "marker")


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh-workers", "persistent-workers"])
def test_worker_processes_are_reused_across_epochs_only_when_persistent(persistent):
    loader = make(
        pd.WorkerInfoProbeDataset(4), batch_size=None, num_workers=2, persistent_workers=persistent
    )
    first, second = ({s["pid"] for s in loader} for _ in range(2))
    assert len(first) == 2
    assert (first == second) if persistent else not (first & second)


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh-workers", "persistent-workers"])
def test_persistent_workers_keep_the_dataset_they_started_with(persistent):
    dataset = pd.ModeDataset(4)
    loader = make(dataset, batch_size=None, num_workers=2, persistent_workers=persistent)
    assert list(loader) == [0] * 4
    dataset.mode = 5
    assert list(loader) == ([0] * 4 if persistent else [5] * 4)


# ---------------------------------------------------------------------------- iterable datasets


@pytest.mark.parametrize(
    ("num_workers", "prefetch_factor"),
    [(2, 4), (3, 2)],
    ids=["2-workers-prefetch-4", "3-workers-prefetch-2"],
)
def test_iterable_dataset_sharded_by_worker_info_has_no_duplicates(num_workers, prefetch_factor):
    loader = make(
        pd.ShardedRangeIterable(50),
        batch_size=4,
        num_workers=num_workers,
        prefetch_factor=prefetch_factor,
    )
    assert len(loader) == 13
    ids = [i for batch in loader for i in ids_of(batch)]
    assert Counter(ids) == Counter(range(50))


@pytest.mark.parametrize(
    ("drop_last", "expected"),
    [
        (False, {tuple(range(4)), tuple(range(7)), tuple(range(7, 14)), tuple(range(14, 20))}),
        (True, {tuple(range(7)), tuple(range(7, 14))}),
    ],
    ids=["keep-last", "drop-last"],
)
def test_iterable_dataset_batches_and_drops_per_worker(drop_last, expected):
    loader = make(
        pd.WorkerSpecificIterable((0, 4, 20)), batch_size=7, num_workers=3, drop_last=drop_last
    )
    batches = [tuple(b.tolist()) for b in loader]
    assert len(batches) == len(expected) and set(batches) == expected


def test_iterable_with_persistent_workers_round_robins_every_epoch():
    loader = make(pd.WorkerIdIterable(20), batch_size=5, num_workers=2, persistent_workers=True)
    for _ in range(3):
        batches = [b.tolist() for b in loader]
        assert batches == [[i % 2] * 5 for i in range(4)]


@pytest.mark.parametrize("num_workers", [0, 2], ids=lambda w: f"{w}-workers")
def test_iterable_len_rounds_by_batch_size_and_drop_last(num_workers):
    for batch_size, drop_last, expected in [
        (1, False, 10),
        (1, True, 10),
        (2, False, 5),
        (2, True, 5),
        (3, False, 4),
        (3, True, 3),
    ]:
        loader = make(
            pd.CountingIterable(10),
            batch_size=batch_size,
            drop_last=drop_last,
            num_workers=num_workers,
        )
        assert len(loader) == expected, (batch_size, drop_last)


def test_len_warning_waits_for_len_and_for_the_length_to_be_exceeded(recwarn):
    loader = make(pd.CountingIterable(20), batch_size=None, num_workers=2)
    assert len(list(loader)) == 40
    assert not [w for w in recwarn if "samples have been fetched" in str(w.message)]
    assert len(loader) == 20
    it = iter(loader)
    for _ in range(20):
        next(it)
    assert not [w for w in recwarn if "samples have been fetched" in str(w.message)]
    for _ in range(3):
        with pytest.warns(
            UserWarning,
            match=r"but [0-9]+ samples have been fetched\. For "
            "multiprocessing data-loading, this",
        ):
            next(it)


# ----------------------------------------------------------------------------------- errors


def test_every_failing_batch_raises_in_the_main_process_and_loading_goes_on():
    loader = make(pd.NotImplementedDataset(21), batch_size=2, shuffle=True, num_workers=2)
    it = iter(loader)
    errors = [raised(lambda: next(it), NotImplementedError) for _ in range(len(loader))]
    assert all("in DataLoader worker process" in str(e) for e in errors)
    raised(lambda: next(it), StopIteration)


def test_batches_after_a_failing_one_still_arrive_in_order():
    it = iter(make(pd.FailingDataset(12, bad=(5,)), batch_size=2, num_workers=2))
    assert next(it).tolist() == [[0, 0], [1, 1]]
    assert next(it).tolist() == [[2, 2], [3, 3]]
    error = raised(lambda: next(it), ValueError)
    assert "Caught ValueError in DataLoader worker process 0" in str(error)
    assert "sample 5 is cursed" in str(error)
    assert [b[:, 0].tolist() for b in it] == [[6, 7], [8, 9], [10, 11]]


def test_error_in_worker_init_fn_reaches_the_main_process():
    loader = make(TENSORS, batch_size=4, num_workers=2, worker_init_fn=pd.failing_worker_init_fn)
    error = raised(lambda: list(loader), RuntimeError)
    assert "Error in worker_init_fn" in str(error)


@pytest.mark.parametrize("num_workers", [0, 2], ids=lambda w: f"{w}-workers")
def test_error_in_iterable_dataset_iter_reaches_the_main_process(num_workers):
    loader = make(pd.FailingIterable(), num_workers=num_workers)
    error = raised(lambda: next(iter(loader)), RuntimeError)
    assert "Error in __iter__" in str(error)


# --------------------------------------------------------------------------- worker lifetime


def test_workers_exit_when_a_partially_read_iterator_is_dropped():
    before = {p.pid for p in worker_children()}
    it = iter(make(TENSORS, batch_size=2, num_workers=2))
    for _ in range(3):
        next(it)
    workers = [p for p in worker_children() if p.pid not in before]
    assert len(workers) >= 2
    del it
    gc.collect()
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive


def test_persistent_workers_restart_cleanly_after_partial_epochs():
    loader = make(TENSORS, batch_size=4, num_workers=2, persistent_workers=True)
    for take in (3, None, 1, None):
        got = 0
        for i, (x, _) in enumerate(loader):
            assert torch.equal(x, DATA[4 * i : 4 * i + 4])
            got += 1
            if got == take:
                break
        assert got == (take or 10)


# ----------------------------------------------------------------------- collation and length


def test_numpy_values_collate_to_matching_tensor_types():
    batch = next(iter(make(pd.NumpyTypesDataset(6), batch_size=2, num_workers=2)))
    expected = [
        torch.float64,
        torch.float32,
        torch.float16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    ]
    assert [t.dtype for t in batch[:-1]] == expected
    assert batch[-1].dtype == torch.float64 and batch[-1].shape == (2, 2, 3)


@pytest.mark.parametrize("batch_size", [None, 3], ids=["no-batching", "batch-3"])
def test_dict_and_namedtuple_samples_keep_their_structure(batch_size):
    batch = next(iter(make(pd.NestedDataset(6), batch_size=batch_size, num_workers=2)))
    assert isinstance(batch, dict)
    assert list(batch) == ["image", "meta", "pair", "point", "scalars", "half"]
    assert isinstance(batch["point"], pd.Point)
    assert isinstance(batch["pair"], list)  # torch turns plain tuples into lists
    if batch_size is None:
        assert batch["meta"] == {"id": 0, "name": "sample-0", "weight": 0.0, "flag": True}
        assert batch["point"].x == 0 and batch["point"].label == "0"
    else:
        assert batch["meta"]["name"] == ["sample-0", "sample-1", "sample-2"]
        assert list(batch["point"].label) == ["0", "1", "2"]
        assert batch["point"].x.tolist() == [0, 1, 2]
        assert batch["meta"]["flag"].dtype == torch.bool
        assert batch["image"].shape == (3, 2, 3) and batch["image"].dtype == torch.uint8


def test_len_follows_a_growing_dataset():
    dataset = [torch.ones(4) for _ in range(4)]
    sequential, shuffled = make(dataset), make(dataset, shuffle=True)
    dataset.append(torch.ones(4))
    assert len(sequential) == len(shuffled) == 5


def test_excessive_worker_count_warns_at_construction():
    with pytest.warns(UserWarning, match="excessive worker creation might get DataLoader"):
        make(TENSORS, batch_size=2, num_workers=1000)


# ------------------------------------------------------------------------- shmloader-specific


@pytest.mark.skipif(pd.selftest_mode(), reason="torch's DataLoader has no arena stats")
@pytest.mark.parametrize("persistent", [False, True], ids=["fresh-workers", "persistent-workers"])
def test_arena_slots_are_all_free_after_three_epochs_of_dropped_batches(persistent):
    # SHMLOADER-SPECIFIC: assumes loader.stats() has fields slots_free and slots_total.
    loader = make(pd.ArangeDataset(50), batch_size=4, num_workers=2, persistent_workers=persistent)
    for _ in range(3):
        for batch in loader:
            del batch
    stats = loader.stats()
    assert stats.slots_total > 0
    assert stats.slots_free == stats.slots_total


class OneElementViews(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Leaves of one element with a stride other than 1 (one-row ``boxes[:, 0]``, ``expand(1)``,
    a NumPy column of a one-row matrix): "contiguous", yet no byte view can be made of them as
    they are (review 8a: every batch failed in the worker)."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> dict[str, object]:
        boxes = torch.arange(4.0).view(1, 4) + i
        return {
            "x0": boxes[:, 0],
            "ids": torch.arange(3).view(1, 3)[:, 2] + i,
            "one": torch.tensor(float(i)).expand(1),
            "np": (np.arange(2.0).reshape(1, 2) + i)[:, 0],
        }


@pytest.mark.parametrize(
    "kwargs",
    [{"batch_size": None}, {"batch_size": 2, "collate_fn": list}],
    ids=["no-auto-collation", "pass-through-collate"],
)
def test_one_element_leaves_with_any_stride_arrive_as_torch_gives_them(kwargs):
    ours = list(make(OneElementViews(), num_workers=2, **kwargs))
    theirs = list(torch.utils.data.DataLoader(OneElementViews(), num_workers=0, **kwargs))
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        pairs = zip(a, b, strict=True) if isinstance(a, list) else [(a, b)]
        for sa, sb in pairs:
            assert sa.keys() == sb.keys()
            for key in sa:
                assert type(sa[key]) is type(sb[key]), key
                assert np.array_equal(np.asarray(sa[key]), np.asarray(sb[key])), key


def _shared_then_distinct(batch: list[int]) -> tuple[list[str], list[str]]:
    if batch[0] == 0:
        shared = ["a", "b"]
        return (shared, shared)  # one list twice
    return (["a", "b"], ["a", "b"])  # two equal lists


@pytest.mark.parametrize("order", ["shared-first", "distinct-first"])
def test_a_container_shared_within_a_batch_is_shared_only_in_that_batch(order):
    # Batches that look alike share a cached payload in the worker; one whose containers are
    # the same object must not lend that identity to the others, nor borrow theirs (review 8a).
    indices = list(range(6)) if order == "shared-first" else [2, 3, 0, 1, 4, 5]
    sampler = torch.utils.data.BatchSampler(indices, 2, False)

    def identity(cls):
        collate = _shared_then_distinct
        loader = cls(range(6), batch_sampler=sampler, num_workers=1, collate_fn=collate)
        return [x[0] is x[1] for x in loader]

    assert identity(make) == identity(torch.utils.data.DataLoader)


class FlaggedViews(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Leaves whose values depend on a view flag or a byte order: a conjugate view, a negative
    view and (unbatched only: torch's collate refuses it) a big-endian array. torch's own
    workers lose the flags and the byte order (review 12b: ``(1+2j)`` arrives for ``(1-2j)``);
    its ``num_workers=0`` keeps them, and so do we."""

    def __init__(self, big_endian: bool) -> None:
        self.big_endian = big_endian

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> dict[str, object]:
        z = torch.tensor([1 + 2j, 3 - 1j]) * (i + 1)
        out: dict[str, object] = {"conj": z.conj(), "neg": (z.real + i)._neg_view()}
        if self.big_endian:
            out["big_endian"] = (np.arange(3) + i).astype(">i4")
        return out


def _keep(sample):
    return sample


@pytest.mark.skipif(pd.selftest_mode(), reason="torch's workers drop the view flags")
@pytest.mark.parametrize(
    "kwargs",
    [{"batch_size": None, "collate_fn": _keep}, {"batch_size": 2}],
    ids=["no-auto-collation", "default-collate"],
)
def test_conjugate_negative_and_big_endian_leaves_arrive_as_with_no_workers(kwargs):
    unbatched = kwargs["batch_size"] is None
    ours = list(make(FlaggedViews(unbatched), num_workers=2, **kwargs))
    theirs = list(torch.utils.data.DataLoader(FlaggedViews(unbatched), num_workers=0, **kwargs))
    assert len(ours) == len(theirs) == (4 if unbatched else 2)
    for a, b in zip(ours, theirs, strict=True):
        assert a.keys() == b.keys()
        for key in ("conj", "neg"):
            assert (a[key].is_conj(), a[key].is_neg()) == (b[key].is_conj(), b[key].is_neg())
            assert torch.equal(
                a[key].resolve_conj().resolve_neg(), b[key].resolve_conj().resolve_neg()
            )
        if unbatched:
            assert a["big_endian"].dtype == b["big_endian"].dtype == np.dtype(">i4")
            assert a["big_endian"].tolist() == b["big_endian"].tolist()
