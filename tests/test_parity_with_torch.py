"""shmloader.DataLoader against torch.utils.data.DataLoader, batch by batch.

Each case builds both loaders with identical arguments from the same global RNG state (torch,
``random`` and NumPy seeded alike) and an identically seeded generator, then runs its epochs
(``None`` = a full epoch, ``k`` = stop after k batches). torch's run is kept; the candidate's is
compared as it goes, one batch at a time, so no slot view outlives its comparison. Compared: every
batch (type, structure, dtype, shape, bytes) in order, or as a multiset for ``in_order=False``;
re-raised dataset errors (type, first and last lines); UserWarnings and the batch they came with;
``len(loader)``; and after every epoch the main-process RNG states and the generator state.
"""

from __future__ import annotations

import traceback
import typing
import warnings
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch
from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler

from tests import parity_datasets as pd

TORCH_LOADER = torch.utils.data.DataLoader
EXCESSIVE_WORKERS = "excessive worker creation"


@dataclass(frozen=True)
class Case:
    id: str
    dataset: typing.Callable
    kwargs: dict = field(default_factory=dict)
    build: typing.Callable | None = None  # fresh stateful arguments (samplers) per loader
    generator: bool = False
    epochs: tuple = (None,)
    call_len: bool = True
    errors: tuple = ()  # exception types the dataset raises on purpose
    unordered: bool = False

    def param(self):
        return pytest.param(self, id=self.id)


@dataclass
class Run:
    batches: list = field(default_factory=list)  # per epoch: batches, canonical forms or errors
    ends: list = field(default_factory=list)  # per epoch: (batches seen, rng snapshot)
    warnings: list = field(default_factory=list)  # (epoch, batch, category, message)
    length: object = None


def _error_record(exc, num_workers):
    text = str(exc)
    if num_workers == 0:
        return ("error", type(exc), text)
    lines = text.strip().splitlines()
    assert "in DataLoader worker process" in lines[0], text
    return ("error", type(exc), lines[0], lines[-1])


def _length(loader):
    try:
        return len(loader)
    except TypeError as exc:
        return ("TypeError", str(exc))


def drive(loader_cls, case, seed, on_batch):
    """Runs ``case`` on ``loader_cls``; ``on_batch(epoch, i, item)`` sees each batch or error."""
    run = Run()
    with warnings.catch_warnings(record=True) as log:
        warnings.simplefilter("always")
        try:
            _run_case(loader_cls, case, seed, on_batch, run, log)
        except BaseException as exc:
            # pytest keeps the traceback of a failure; clearing the finished frames' locals
            # keeps it from holding the loader, so the loader's workers still stop at once.
            traceback.clear_frames(exc.__traceback__)
            raise
    return run


def _run_case(loader_cls, case, seed, on_batch, run, log):
    pd.seed_all(seed)
    generator = torch.Generator().manual_seed(seed + 1) if case.generator else None
    kwargs = dict(case.kwargs)
    if case.build is not None:
        kwargs.update(case.build())
    if generator is not None:
        kwargs["generator"] = generator
    loader = loader_cls(case.dataset(), **kwargs)
    if case.call_len:
        run.length = _length(loader)
    for epoch, take in enumerate(case.epochs):
        i = 0
        try:
            it = iter(loader)
        except case.errors as exc:  # single-process loading builds the fetcher here
            on_batch(epoch, i, _error_record(exc, 0))
            traceback.clear_frames(exc.__traceback__)
            run.ends.append((1, pd.rng_snapshot(generator)))
            continue
        while take is None or i < take:
            seen = len(log)
            try:
                item = next(it)
            except StopIteration:
                break
            except case.errors as exc:
                item = _error_record(exc, loader.num_workers)
                # torch's re-raise leaves a cycle (exception -> frame -> exception) that would
                # keep the iterator alive until gc, and torch then needs 5 s per worker to stop.
                traceback.clear_frames(exc.__traceback__)
            for w in log[seen:]:
                if issubclass(w.category, UserWarning) and EXCESSIVE_WORKERS not in str(w.message):
                    run.warnings.append((epoch, i, w.category, str(w.message)))
            on_batch(epoch, i, item)
            del item
            i += 1
        del it
        run.ends.append((i, pd.rng_snapshot(generator)))


def assert_parity(case, seed=1234):
    """The heart of the suite: torch's run is the reference, the candidate must match it."""
    expected = {}
    actual_multiset = {}

    def keep(epoch, i, item):
        expected.setdefault(epoch, []).append(pd.canonical(item) if case.unordered else item)

    reference = drive(TORCH_LOADER, case, seed, keep)
    assert sum(n for n, _ in reference.ends) > 0, "the case yields nothing: it would prove nothing"

    def check(epoch, i, item):
        if case.unordered:
            actual_multiset.setdefault(epoch, Counter())[pd.canonical(item)] += 1
            return
        batches = expected.get(epoch, [])
        assert i < len(batches), f"epoch {epoch}: candidate yields more than {len(batches)} batches"
        if isinstance(batches[i], tuple) and batches[i][:1] == ("error",):
            assert isinstance(item, tuple) and item == batches[i], (
                f"epoch {epoch} batch {i}: expected {batches[i]!r}, got {item!r}"
            )
        else:
            pd.assert_same_batch(batches[i], item, f"epoch {epoch} batch {i}")

    candidate = drive(pd.candidate_loader_class(), case, seed, check)

    for epoch, ((n_ref, rng_ref), (n_cand, rng_cand)) in enumerate(
        zip(reference.ends, candidate.ends, strict=True)
    ):
        assert n_cand == n_ref, f"epoch {epoch}: {n_cand} batches, torch yields {n_ref}"
        if case.unordered:
            assert actual_multiset.get(epoch, Counter()) == Counter(expected.get(epoch, [])), (
                f"epoch {epoch}: the batches differ from torch's as a multiset"
            )
        pd.assert_same_rng(rng_ref, rng_cand, f"after epoch {epoch}")
    assert candidate.length == reference.length
    assert candidate.warnings == reference.warnings


# --------------------------------------------------------------------------------- the matrix

A = pd.ArangeDataset
R = pd.RandomValuesDataset
N = pd.NestedDataset


def _uneven_tuples():
    batches = []
    for i in range(0, 20, 5):
        batches += [tuple(range(i, i + 2)), tuple(range(i + 2, i + 5))]
    return {"batch_sampler": batches}


MAP_CASES = [
    *(
        Case(f"map-sequential-{w}-workers", A, {"batch_size": 4, "num_workers": w})
        for w in (0, 1, 2, 4)
    ),
    Case(
        "map-sequential-3-workers-prefetch-1",
        A,
        dict(batch_size=5, num_workers=3, prefetch_factor=1),
    ),
    *(
        Case(
            f"map-shuffle-generator-{w}-workers",
            A,
            {"batch_size": 4, "shuffle": True, "num_workers": w},
            generator=True,
        )
        for w in (0, 2)
    ),
    Case(
        "map-shuffle-generator-3-workers-prefetch-4",
        A,
        dict(batch_size=3, shuffle=True, num_workers=3, prefetch_factor=4),
        generator=True,
    ),
    *(
        Case(
            f"map-shuffle-global-rng-{w}-workers",
            A,
            {"batch_size": 4, "shuffle": True, "num_workers": w},
        )
        for w in (0, 2)
    ),
    *(
        Case(
            f"map-drop-last-{w}-workers", A, {"batch_size": 7, "drop_last": True, "num_workers": w}
        )
        for w in (0, 2)
    ),
    *(
        Case(
            f"map-batch-size-none-shuffled-{w}-workers",
            A,
            {"batch_size": None, "shuffle": True, "num_workers": w},
            generator=True,
        )
        for w in (0, 2)
    ),
    Case(
        "map-custom-sampler-2-workers",
        A,
        dict(batch_size=3, num_workers=2),
        build=lambda: {"sampler": pd.FixedOrderSampler([7, 3, 49, 0, 11, 12, 30, 31, 2, 5])},
    ),
    Case(
        "map-range-as-sampler-2-workers", A, dict(batch_size=2, num_workers=2, sampler=range(2, 12))
    ),
    Case(
        "map-random-sampler-with-replacement-2-workers",
        A,
        dict(batch_size=6, num_workers=2),
        build=lambda: {"sampler": RandomSampler(range(50), replacement=True, num_samples=37)},
    ),
    Case(
        "map-global-rng-sampler-2-workers",
        A,
        dict(batch_size=4, num_workers=2),
        build=lambda: {"sampler": pd.GlobalRNGSampler(30)},
    ),
    *(
        Case(
            f"map-variable-batch-sampler-{w}-workers",
            A,
            {"num_workers": w},
            build=lambda: {"batch_sampler": pd.VariableBatchSampler(23)},
        )
        for w in (0, 2)
    ),
    Case("map-batch-sampler-of-tuples-3-workers", A, dict(num_workers=3), build=_uneven_tuples),
    Case(
        "map-torch-batch-sampler-drop-last-2-workers",
        A,
        dict(num_workers=2),
        build=lambda: {"batch_sampler": BatchSampler(SequentialSampler(range(50)), 8, True)},
    ),
    Case(
        "map-list-sampler-without-batching-2-workers",
        lambda: pd.BulkDataset(35),
        dict(batch_size=None, num_workers=2),
        build=lambda: {"sampler": pd.BulkIndexSampler(35, 4)},
    ),
    *(Case(f"nested-samples-{w}-workers", N, {"batch_size": 5, "num_workers": w}) for w in (0, 2)),
    Case("nested-samples-without-batching-2-workers", N, dict(batch_size=None, num_workers=2)),
    *(
        Case(
            f"custom-collate-{w}-workers",
            A,
            {"batch_size": 4, "num_workers": w, "collate_fn": pd.tagged_stack_collate},
        )
        for w in (0, 2)
    ),
    Case(
        "pin-memory-without-accelerator-2-workers",
        A,
        dict(batch_size=8, num_workers=2, pin_memory=True),
    ),
]

RANDOM_CASES = [
    *(
        Case(
            f"worker-randomness-{w}-workers",
            R,
            {"batch_size": 4, "shuffle": True, "num_workers": w},
            generator=True,
        )
        for w in (0, 1, 2, 3, 4)
    ),
    Case("worker-randomness-global-rng-2-workers", R, dict(batch_size=3, num_workers=2)),
    Case("worker-randomness-without-batching-3-workers", R, dict(batch_size=None, num_workers=3)),
    Case(
        "worker-randomness-with-numpy-reseeding-init-fn",
        R,
        dict(batch_size=4, num_workers=2, worker_init_fn=pd.reseed_numpy_from_torch),
    ),
    Case(
        "worker-randomness-with-torch-reseeding-init-fn",
        R,
        dict(batch_size=4, num_workers=2, worker_init_fn=pd.reseed_torch_12345),
    ),
    Case(
        "worker-randomness-over-3-epochs",
        R,
        dict(batch_size=4, shuffle=True, num_workers=2),
        generator=True,
        epochs=(None, None, None),
    ),
]

PERSISTENT_AND_PARTIAL_CASES = [
    Case(
        "persistent-shuffle-3-epochs",
        A,
        dict(batch_size=4, shuffle=True, num_workers=2, persistent_workers=True),
        generator=True,
        epochs=(None, None, None),
    ),
    Case(
        "persistent-worker-randomness-3-epochs",
        R,
        dict(batch_size=4, shuffle=True, num_workers=3, persistent_workers=True),
        generator=True,
        epochs=(None, None, None),
    ),
    Case(
        "partial-epoch-then-full-epoch-2-workers",
        A,
        dict(batch_size=4, shuffle=True, num_workers=2),
        generator=True,
        epochs=(3, None),
    ),
    Case(
        "partial-epoch-global-rng-sampler-prefetch-1",
        A,
        dict(batch_size=2, num_workers=2, prefetch_factor=1),
        build=lambda: {"sampler": pd.GlobalRNGSampler(30)},
        epochs=(2, None),
    ),
    Case(
        "partial-epoch-global-rng-sampler-prefetch-4",
        A,
        dict(batch_size=2, num_workers=2, prefetch_factor=4),
        build=lambda: {"sampler": pd.GlobalRNGSampler(30)},
        epochs=(2, None),
    ),
    Case(
        "persistent-partial-epochs-worker-randomness",
        R,
        dict(batch_size=3, num_workers=2, persistent_workers=True),
        epochs=(2, None, 5, None),
    ),
    Case(
        "persistent-partial-epochs-global-rng-sampler",
        A,
        dict(batch_size=2, num_workers=2, persistent_workers=True),
        build=lambda: {"sampler": pd.GlobalRNGSampler(24)},
        epochs=(3, 1, None),
    ),
    Case("single-process-partial-epochs", R, dict(batch_size=4, shuffle=True), epochs=(2, None)),
]

UNORDERED_CASES = [
    # Only deterministic samples: out of order, which worker fetches which batch depends on timing.
    Case(
        "out-of-order-shuffle-2-workers",
        A,
        dict(batch_size=4, shuffle=True, num_workers=2, in_order=False),
        generator=True,
        unordered=True,
    ),
    Case(
        "out-of-order-shuffle-3-workers-2-epochs",
        A,
        dict(batch_size=3, shuffle=True, num_workers=3, in_order=False, persistent_workers=True),
        generator=True,
        unordered=True,
        epochs=(None, None),
    ),
]

ITERABLE_CASES = [
    *(
        Case(
            f"iterable-sharded-{w}-workers",
            pd.ShardedRangeIterable,
            {"batch_size": 4, "num_workers": w},
        )
        for w in (0, 1, 2, 3)
    ),
    Case(
        "iterable-sharded-without-batching-2-workers",
        pd.ShardedRangeIterable,
        dict(batch_size=None, num_workers=2),
    ),
    Case(
        "iterable-sharded-drop-last-3-workers",
        pd.ShardedRangeIterable,
        dict(batch_size=4, drop_last=True, num_workers=3),
    ),
    Case(
        "iterable-worker-randomness-2-workers",
        lambda: pd.ShardedRangeIterable(30, True),
        dict(batch_size=4, num_workers=2),
        generator=True,
    ),
    Case(
        "iterable-persistent-3-epochs",
        lambda: pd.ShardedRangeIterable(30, True),
        dict(batch_size=4, num_workers=2, persistent_workers=True),
        epochs=(None, None, None),
    ),
    Case(
        "iterable-partial-epochs-persistent",
        lambda: pd.ShardedRangeIterable(30, True),
        dict(batch_size=3, num_workers=2, persistent_workers=True),
        epochs=(2, None),
    ),
    Case(
        "iterable-custom-collate-2-workers",
        pd.ShardedRangeIterable,
        dict(batch_size=4, num_workers=2, collate_fn=pd.tagged_stack_collate),
    ),
    Case(
        "iterable-uneven-workers",
        pd.WorkerSpecificIterable,
        dict(batch_size=7, num_workers=3),
        unordered=True,
    ),
    Case(
        "iterable-uneven-workers-drop-last",
        pd.WorkerSpecificIterable,
        dict(batch_size=7, num_workers=3, drop_last=True),
        unordered=True,
    ),
    Case("iterable-without-len", pd.UnsizedIterable, dict(batch_size=2, num_workers=1)),
    Case(
        "iterable-len-warning-single-process",
        lambda: pd.CountingIterable(10),
        dict(batch_size=None),
    ),
    Case(
        "iterable-len-warning-duplicating-workers",
        lambda: pd.CountingIterable(10),
        dict(batch_size=None, num_workers=2),
    ),
    Case(
        "iterable-len-warning-batched",
        lambda: pd.CountingIterable(3),
        dict(batch_size=2, num_workers=2),
    ),
    Case(
        "iterable-len-not-called-means-no-warning",
        lambda: pd.CountingIterable(4),
        dict(batch_size=None, num_workers=2),
        call_len=False,
    ),
]

ERROR_CASES = [
    Case(
        f"{err.__name__}-in-getitem-{w}-workers",
        lambda err=err: pd.FailingDataset(error_type=err),
        {"batch_size": 2, "num_workers": w},
        errors=(err,),
    )
    for err in (ValueError, KeyError, pd.CustomDatasetError)
    for w in (0, 2)
] + [
    Case(
        "errors-in-getitem-persistent-2-epochs",
        pd.FailingDataset,
        dict(batch_size=3, num_workers=2, persistent_workers=True),
        errors=(ValueError,),
        epochs=(None, None),
    ),
    Case(
        "errors-in-getitem-without-batching-3-workers",
        pd.FailingDataset,
        dict(batch_size=None, num_workers=3),
        errors=(ValueError,),
    ),
    Case(
        "error-in-worker-init-fn",
        A,
        dict(batch_size=10, num_workers=2, worker_init_fn=pd.failing_worker_init_fn),
        errors=(RuntimeError,),
        epochs=(1,),
    ),
    *(
        Case(
            f"error-in-iterable-iter-{w}-workers",
            pd.FailingIterable,
            {"num_workers": w},
            call_len=False,
            errors=(RuntimeError,),
            epochs=(w,),
        )
        for w in (0, 2)
    ),
]

START_METHOD_CASES = [
    Case(
        "spawn-worker-randomness-shuffled",
        lambda: pd.RandomValuesDataset(12),
        dict(
            batch_size=3,
            shuffle=True,
            num_workers=2,
            multiprocessing_context="spawn",
            worker_init_fn=pd.reseed_numpy_from_torch,
        ),
        generator=True,
    ),
    Case(
        "forkserver-iterable-custom-collate",
        lambda: pd.ShardedRangeIterable(12),
        dict(
            batch_size=3,
            num_workers=1,
            multiprocessing_context="forkserver",
            collate_fn=pd.tagged_stack_collate,
        ),
    ),
]


@pytest.mark.parametrize("case", [c.param() for c in MAP_CASES])
def test_map_style_batches_match_torch_bit_for_bit(case):
    assert_parity(case)


@pytest.mark.parametrize("case", [c.param() for c in RANDOM_CASES])
def test_samples_drawn_from_worker_rngs_match_torch(case):
    assert_parity(case)


@pytest.mark.parametrize("case", [c.param() for c in PERSISTENT_AND_PARTIAL_CASES])
def test_persistent_workers_and_partial_epochs_match_torch(case):
    assert_parity(case)


@pytest.mark.parametrize("case", [c.param() for c in UNORDERED_CASES])
def test_out_of_order_loading_yields_the_same_multiset_as_torch(case):
    assert_parity(case)


@pytest.mark.parametrize("case", [c.param() for c in ITERABLE_CASES])
def test_iterable_datasets_match_torch(case):
    assert_parity(case)


@pytest.mark.parametrize("case", [c.param() for c in ERROR_CASES])
def test_dataset_errors_are_reraised_like_torch_and_iteration_goes_on(case):
    assert_parity(case)


@pytest.mark.parametrize("case", [c.param() for c in START_METHOD_CASES])
def test_spawn_and_forkserver_workers_match_torch(case):
    assert_parity(case)


# ------------------------------------------------------------ construction and attribute rules

_MAP = pd.ArangeDataset(12)
_ITER = pd.CountingIterable(12)
_SAMPLER = SequentialSampler(_MAP)
_BATCH_SAMPLER = BatchSampler(_SAMPLER, 3, False)

INVALID_ARGUMENTS = {
    "negative-workers": (_MAP, dict(num_workers=-1)),
    "negative-timeout": (_MAP, dict(timeout=-1)),
    "prefetch-without-workers": (_MAP, dict(prefetch_factor=2)),
    "negative-prefetch": (_MAP, dict(num_workers=1, prefetch_factor=-1)),
    "persistent-without-workers": (_MAP, dict(persistent_workers=True)),
    "no-batching-with-drop-last": (_MAP, dict(batch_size=None, drop_last=True)),
    "context-without-workers": (_MAP, dict(multiprocessing_context="fork")),
    "unknown-start-method": (_MAP, dict(num_workers=1, multiprocessing_context="bad")),
    "context-of-wrong-type": (_MAP, dict(num_workers=1, multiprocessing_context=object())),
    "sampler-with-shuffle": (_MAP, dict(batch_size=11, sampler=_SAMPLER, shuffle=True)),
    "batch-sampler-sampler-and-shuffle": (
        _MAP,
        dict(batch_sampler=_BATCH_SAMPLER, sampler=_SAMPLER, shuffle=True),
    ),
    "batch-sampler-with-batch-size": (_MAP, dict(batch_size=11, batch_sampler=_BATCH_SAMPLER)),
    "batch-sampler-with-shuffle": (_MAP, dict(shuffle=True, batch_sampler=_BATCH_SAMPLER)),
    "batch-sampler-with-drop-last": (_MAP, dict(drop_last=True, batch_sampler=_BATCH_SAMPLER)),
    "iterable-with-shuffle": (_ITER, dict(shuffle=True)),
    "iterable-with-sampler": (_ITER, dict(sampler=_SAMPLER)),
    "iterable-with-batch-sampler": (_ITER, dict(batch_sampler=_BATCH_SAMPLER)),
}


def _construction_outcome(cls, dataset, kwargs):
    try:
        cls(dataset, **kwargs)
    except (ValueError, TypeError) as exc:
        return type(exc), str(exc)
    return None


@pytest.mark.parametrize("name", list(INVALID_ARGUMENTS))
def test_invalid_argument_combinations_raise_torchs_exact_error(name):
    dataset, kwargs = INVALID_ARGUMENTS[name]
    expected = _construction_outcome(TORCH_LOADER, dataset, kwargs)
    assert expected is not None, "torch accepts this combination: the case is wrong"
    assert _construction_outcome(pd.candidate_loader_class(), dataset, kwargs) == expected


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize(
    "attr", ["batch_size", "batch_sampler", "sampler", "drop_last", "dataset", "persistent_workers"]
)
def test_reassigning_a_frozen_attribute_raises_torchs_value_error(attr, num_workers):
    messages = []
    for cls in (TORCH_LOADER, pd.candidate_loader_class()):
        loader = cls(_MAP, batch_size=2, num_workers=num_workers)
        with pytest.raises(ValueError) as excinfo:
            setattr(loader, attr, {})
        messages.append(str(excinfo.value))
    assert messages[1] == messages[0]


def test_len_of_every_loader_shape_matches_torch():
    shapes = [
        (_MAP, {}),
        (_MAP, dict(batch_size=5)),
        (_MAP, dict(batch_size=5, drop_last=True)),
        (_MAP, dict(batch_size=None)),
        (_MAP, dict(batch_sampler=_BATCH_SAMPLER)),
        (_MAP, dict(sampler=range(3, 10), batch_size=2)),
        (_ITER, dict(batch_size=5)),
        (_ITER, dict(batch_size=5, drop_last=True)),
        (_ITER, dict(batch_size=None)),
        (_MAP, dict(batch_size=5, num_workers=2)),
        (_ITER, dict(batch_size=5, num_workers=2)),
        (pd.UnsizedIterable(), dict(batch_size=2)),
    ]
    for dataset, kwargs in shapes:
        expected = _length(TORCH_LOADER(dataset, **kwargs))
        assert _length(pd.candidate_loader_class()(dataset, **kwargs)) == expected, kwargs


def test_loader_class_is_generic_like_torchs():
    cls = pd.candidate_loader_class()
    alias = cls[list]
    assert typing.get_origin(alias) is cls
    assert typing.get_args(alias) == (list,)
    loader = alias(_MAP, batch_size=4)
    assert isinstance(loader, cls)
    assert isinstance(loader, TORCH_LOADER)
    assert len(loader) == 3
