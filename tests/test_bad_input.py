"""Bad input: each mistake a user can make gets a clear error saying what was wrong, where, and
what to change — torch's own error (same type, same words) wherever torch has one.

Where torch has an answer, the test runs the same loader under torch.utils.data.DataLoader and
compares what each ``next()`` gave (see :func:`tests.fault_datasets.outcomes`): the batch shapes,
the exception types, where the error was caught ("Caught ValueError in DataLoader worker process
1.") and the original error line.
"""

from __future__ import annotations

import pickle
import traceback
from typing import Any

import pytest
import torch
from torch.utils.data import IterableDataset

import shmloader
from tests.fault_datasets import (
    HoldsALock,
    IterRaises,
    Opaque,
    Ramp,
    TaggedTensor,
    Values,
    generator_collate,
    init_fails_in_worker_1,
    outcomes,
    tagged_collate,
    unpicklable_collate_on_batch_1,
)

LOADERS = {"torch": torch.utils.data.DataLoader, "shmloader": shmloader.DataLoader}


def both(dataset: Any, calls: int = 6, **kwargs: Any) -> dict[str, list[str]]:
    """The outcomes of ``calls`` ``next()`` calls under torch's loader and under shmloader's."""
    return {name: outcomes(cls(dataset, **kwargs), calls) for name, cls in LOADERS.items()}


def raised(fn: Any, *args: Any, **kwargs: Any) -> Exception:
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the test inspects whatever was raised
        traceback.clear_frames(e.__traceback__)
        return e
    pytest.fail("nothing was raised")


# ------------------------------------------------------------------- samples default_collate


def test_ragged_tensor_shapes_raise_torchs_stack_error_naming_the_worker():
    samples = [torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.zeros(4)]
    got = both(Values(samples), batch_size=2, num_workers=2)
    assert got["shmloader"] == got["torch"]
    assert got["torch"][1].startswith(
        "RuntimeError: Caught RuntimeError in DataLoader worker "
        "process 1. | RuntimeError: stack expects each tensor"
    )


def test_ragged_shapes_short_of_the_first_sample_raise_torchs_resize_error():
    # torch's workers size the batch's storage by the samples' total numel first: when a later
    # sample is smaller than the first, the resize fails before stack can (review 8a).
    samples = [torch.zeros(4), torch.zeros(3), torch.zeros(3), torch.zeros(3)]
    got = both(Values(samples), batch_size=2, num_workers=2)
    assert got["shmloader"] == got["torch"]
    assert got["torch"][0] == (
        "RuntimeError: Caught RuntimeError in DataLoader worker process 0. "
        "| RuntimeError: Trying to resize storage that is not resizable"
    )


def test_a_string_among_tensors_raises_torchs_error_without_ours_chained_to_it():
    loader = shmloader.DataLoader(Values([torch.zeros(2), "x"]), batch_size=2, num_workers=1)
    e = raised(next, iter(loader))
    assert type(e) is AttributeError
    assert "'str' object has no attribute 'numel'" in str(e)
    assert "During handling of the above exception" not in str(e), str(e)


def test_a_sample_type_default_collate_cannot_batch_raises_torchs_type_error():
    got = both(Values([Opaque(i) for i in range(4)]), batch_size=2, num_workers=2)
    assert got["shmloader"] == got["torch"]
    assert "default_collate: batch must contain tensors" in got["torch"][0]
    assert "Opaque" in got["torch"][0]


@pytest.mark.parametrize(
    "samples",
    [
        pytest.param([None] * 4, id="always-none"),
        pytest.param(
            [torch.zeros(2), None, torch.zeros(2), torch.zeros(2)], id="none-after-a-tensor"
        ),
    ],
)
def test_a_dataset_returning_none_raises_what_torch_raises_naming_the_worker(samples):
    got = both(Values(samples), batch_size=2, num_workers=2)
    assert got["shmloader"] == got["torch"]
    assert "Caught" in got["torch"][0] and "in DataLoader worker process 0." in got["torch"][0]
    assert "NoneType" in got["torch"][0]


def test_an_out_of_range_index_from_the_sampler_raises_index_error_naming_the_worker():
    got = both(Values(list(range(8))), sampler=[0, 1, 2, 100, 4, 5], batch_size=2, num_workers=2)
    assert got["shmloader"] == got["torch"]
    assert got["torch"][1] == (
        "IndexError: Caught IndexError in DataLoader worker process 1. "
        "| IndexError: list index out of range"
    )


# -------------------------------------------------------------------------- worker start-up


def test_worker_init_fn_raising_is_raised_in_the_main_process_naming_the_worker():
    got = both(Ramp(16), batch_size=2, num_workers=2, worker_init_fn=init_fails_in_worker_1)
    # What later tasks of the failed worker raise is an accident in both (torch: an
    # UnboundLocalError on 'fetcher'); compared up to the init error itself.
    assert got["shmloader"][:2] == got["torch"][:2]
    assert got["torch"][1] == (
        "ValueError: Caught ValueError in DataLoader worker process 1. "
        "| ValueError: worker_init_fn refused worker 1"
    )


def test_an_iterable_dataset_whose_iter_raises_is_raised_like_torch_naming_the_worker():
    got = both(IterRaises(), calls=4, batch_size=2, num_workers=2)
    assert got["shmloader"][:2] == got["torch"][:2]  # each worker's error, as torch
    assert got["torch"][0] == (
        "OSError: Caught OSError in DataLoader worker process 0. "
        "| OSError: shard file missing: /data/shard-0007.arrow"
    )


def _spawned(loader_cls: type, collate_fn: Any = None, dataset: Any = None) -> Exception:
    loader = loader_cls(
        Ramp(8) if dataset is None else dataset,
        batch_size=2,
        num_workers=2,
        collate_fn=collate_fn,
        multiprocessing_context="spawn",
    )
    return raised(lambda: next(iter(loader)))


def _told(error: BaseException) -> str:
    """The error as a traceback prints it: its message, then its notes."""
    return "".join(traceback.format_exception(error))


_PICKLE_WARNING = "Got pickle error when attempting to start a worker"


# Review 67: shmloader rebuilt these errors as type(e)(torch's words + advice), which changed
# their text, dropped their attributes and, for a subclass with another constructor, raised a
# TypeError about that constructor; and torch's warning was missing. Now: torch's warning, and
# torch's error as it is, with the advice as a note (tracebacks print it after the message).
def test_a_lambda_collate_fn_under_spawn_is_torchs_error_with_torchs_warning_and_a_note():
    collate = lambda batch: batch  # noqa: E731 - the mistake under test
    with pytest.warns(UserWarning, match=_PICKLE_WARNING):
        theirs = _spawned(torch.utils.data.DataLoader, collate_fn=collate)
    with pytest.warns(UserWarning, match=_PICKLE_WARNING):
        ours = _spawned(shmloader.DataLoader, collate_fn=collate)
    assert type(ours) is type(theirs) and str(ours) == str(theirs)
    assert "<lambda>" in str(ours)
    told = _told(ours)
    assert "multiprocessing_context='fork'" in told and "top level" in told


@pytest.mark.filterwarnings(f"ignore:{_PICKLE_WARNING}")
def test_a_local_function_collate_fn_under_spawn_names_it():
    def local_collate(batch: Any) -> Any:
        return batch

    error = _spawned(shmloader.DataLoader, collate_fn=local_collate)
    assert isinstance(error, AttributeError | pickle.PicklingError), repr(error)
    assert "local_collate" in str(error) and "top level" in _told(error)


@pytest.mark.filterwarnings(f"ignore:{_PICKLE_WARNING}")
def test_an_unpicklable_dataset_under_spawn_names_the_dataset_class():
    error = _spawned(shmloader.DataLoader, dataset=HoldsALock())
    assert isinstance(error, TypeError), repr(error)
    assert "cannot pickle '_thread.lock' object" in str(error)
    told = _told(error)
    assert "HoldsALock" in told and "multiprocessing_context='fork'" in told


class _CodedError(TypeError):
    """A pickling error whose constructor takes two arguments (review 67)."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(f"code {code}: {detail}")
        self.code = code


class _RefusesToPickle(Ramp):
    def __reduce__(self) -> Any:
        raise _CodedError(7, "cannot ship me")


@pytest.mark.filterwarnings(f"ignore:{_PICKLE_WARNING}")
def test_a_pickling_error_with_its_own_constructor_reaches_the_user_as_it_was_raised():
    theirs = _spawned(torch.utils.data.DataLoader, dataset=_RefusesToPickle(8))
    ours = _spawned(shmloader.DataLoader, dataset=_RefusesToPickle(8))
    assert type(ours) is type(theirs) is _CodedError
    assert str(ours) == str(theirs) == "code 7: cannot ship me" and ours.code == 7
    assert "_RefusesToPickle" in _told(ours)


# ------------------------------------------------------------------------ constructor checks


class _Stream(IterableDataset):
    def __iter__(self) -> Any:
        return iter(range(4))


TORCH_ARGUMENT_ERRORS = {
    "num_workers=-1": (Ramp(4), dict(num_workers=-1)),
    "timeout=-1": (Ramp(4), dict(timeout=-1)),
    "prefetch_factor without workers": (Ramp(4), dict(prefetch_factor=2)),
    "negative prefetch_factor": (Ramp(4), dict(num_workers=2, prefetch_factor=-1)),
    "persistent_workers without workers": (Ramp(4), dict(persistent_workers=True)),
    "batch_sampler with batch_size": (Ramp(4), dict(batch_sampler=[[0, 1]], batch_size=2)),
    "sampler with shuffle": (Ramp(4), dict(sampler=[0, 1], shuffle=True)),
    "batch_size=None with drop_last": (Ramp(4), dict(batch_size=None, drop_last=True)),
    "shuffle with an IterableDataset": (_Stream(), dict(shuffle=True)),
    "unknown multiprocessing_context": (Ramp(4), dict(num_workers=2, multiprocessing_context="x")),
}


@pytest.mark.parametrize("case", list(TORCH_ARGUMENT_ERRORS))
def test_an_invalid_argument_raises_torchs_exact_error(case):
    dataset, kwargs = TORCH_ARGUMENT_ERRORS[case]
    theirs = raised(torch.utils.data.DataLoader, dataset, **kwargs)
    ours = raised(shmloader.DataLoader, dataset, **kwargs)
    assert type(ours) is type(theirs)
    assert str(ours) == str(theirs)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (
            dict(arena_backend="bogus"),
            "arena_backend must be one of ['auto', 'posix', 'memfd'], got 'bogus'",
        ),
        (dict(arena_max_bytes=0), "arena_max_bytes must be positive, got 0"),
        (dict(arena_max_bytes=-4096), "arena_max_bytes must be positive, got -4096"),
        (dict(arena_slots_per_slab=0), "arena_slots_per_slab must be >= 1, got 0"),
    ],
    ids=["unknown-backend", "zero-cap", "negative-cap", "zero-slots-per-slab"],
)
def test_an_invalid_arena_argument_is_rejected_at_construction_naming_it(kwargs, words):
    error = raised(shmloader.DataLoader, Ramp(4), num_workers=2, **kwargs)
    assert isinstance(error, ValueError)
    assert str(error) == words


def test_a_non_integer_arena_max_bytes_is_rejected_naming_the_argument():
    error = raised(shmloader.DataLoader, Ramp(4), num_workers=2, arena_max_bytes="1GB")
    assert isinstance(error, TypeError | ValueError)
    assert "arena_max_bytes" in str(error)


# ------------------------------------------------------------- batches that cannot be written


def test_a_batch_that_cannot_be_pickled_is_raised_with_the_worker_traceback_never_dropped():
    got = outcomes(
        shmloader.DataLoader(
            Ramp(16), batch_size=4, num_workers=2, collate_fn=unpicklable_collate_on_batch_1
        ),
        calls=6,
    )
    assert got == [
        "batch (4, 4)",
        "ValueError: Caught ValueError in DataLoader worker process 1. "
        "| ValueError: Unpicklable refuses to be pickled",
        "batch (4, 4)",
        "batch (4, 4)",
        "end",
    ]


def test_the_worker_traceback_of_an_unwritable_batch_shows_where_it_failed():
    loader = shmloader.DataLoader(
        Ramp(8), batch_size=4, num_workers=2, collate_fn=unpicklable_collate_on_batch_1
    )
    it = iter(loader)
    next(it)
    error = raised(next, it)
    message = str(error)
    assert "Original Traceback (most recent call last):" in message
    assert "in __reduce__" in message and "fault_datasets.py" in message


def test_a_collate_returning_a_generator_is_raised_naming_the_worker():
    got = outcomes(
        shmloader.DataLoader(Ramp(8), batch_size=4, num_workers=2, collate_fn=generator_collate),
        calls=3,
    )
    assert got[0] == (
        "TypeError: Caught TypeError in DataLoader worker process 0. "
        "| TypeError: cannot pickle 'generator' object"
    )
    assert got[1].startswith("TypeError: Caught TypeError in DataLoader worker process 1.")
    assert got[2] == "end"


def test_a_tensor_subclass_from_a_custom_collate_arrives_intact_as_that_subclass():
    loader = shmloader.DataLoader(Ramp(8), batch_size=4, num_workers=2, collate_fn=tagged_collate)
    batches = list(loader)
    assert [type(b) for b in batches] == [TaggedTensor, TaggedTensor]
    assert torch.equal(
        torch.cat([b.as_subclass(torch.Tensor) for b in batches])[:, 0], torch.arange(8.0)
    )
