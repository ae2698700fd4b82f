"""The default collate as users extend and feed it, against torch's with the same workers:
types registered in ``default_collate_fn_map`` (torch's documented extension point), before or
after shmloader is imported, and samples that torch's collate changes as it copies them
(review 17)."""

from __future__ import annotations

import collections
import collections.abc
import gc
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset
from torch.utils.data._utils.collate import default_collate_fn_map

import shmloader
from tests.lifetime_checks import frees_its_loaders_on_failure

TIMEOUT = 60


@pytest.fixture
def registry() -> Iterator[dict[Any, Any]]:
    """torch's default_collate_fn_map, as it was again after the test."""
    saved = dict(default_collate_fn_map)
    try:
        yield default_collate_fn_map
    finally:
        default_collate_fn_map.clear()
        default_collate_fn_map.update(saved)


def _both(dataset: Dataset[Any], **kw: Any) -> tuple[list[Any], list[Any]]:
    """Every batch from torch's loader and from shmloader's, 2 workers each."""
    out = []
    for kind in (torch.utils.data.DataLoader, shmloader.DataLoader):
        loader = kind(dataset, num_workers=2, timeout=TIMEOUT, **kw)
        out.append(list(loader))
    return out[0], out[1]


class Point:
    def __init__(self, x: float) -> None:
        self.x = x


def collate_points(batch: list[Point], *, collate_fn_map: Any = None) -> torch.Tensor:
    return torch.tensor([p.x for p in batch]) * 10


class Points(Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> tuple[Point, torch.Tensor]:
        return Point(float(i)), torch.ones(i % 3 + 1)


def pad(batch: list[torch.Tensor], *, collate_fn_map: Any = None) -> torch.Tensor:
    n = max(t.shape[0] for t in batch)
    return torch.stack([torch.nn.functional.pad(t, (0, n - t.shape[0])) for t in batch])


def int32(batch: list[int], *, collate_fn_map: Any = None) -> torch.Tensor:
    return torch.tensor(batch, dtype=torch.int32)


class Ragged(Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.ones(i + 1), i


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, collections.abc.Mapping):
        return type(a) is type(b) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def test_a_type_registered_after_import_is_collated_as_torch_does(
    registry: dict[Any, Any],
) -> None:
    """Review 17 F3: the workers' map was a copy taken when shmloader was imported: a type
    registered later failed ("default_collate: batch must contain tensors, ... found Point")."""
    registry[Point] = collate_points
    registry[torch.Tensor] = pad  # these samples are ragged
    theirs, ours = _both(Points(), batch_size=4)
    assert _same(theirs, ours) and theirs[0][0].tolist() == [0.0, 10.0, 20.0, 30.0]


def test_the_tensor_and_int_entries_a_user_registers_win(registry: dict[Any, Any]) -> None:
    """Review 17 F3: the slot versions of the tensor and int entries replaced the user's (torch's
    own docstring example registers a tensor collate), so ragged samples failed to stack and int
    labels came out int64."""
    registry[torch.Tensor] = pad
    registry[int] = int32
    theirs, ours = _both(Ragged(), batch_size=4)
    assert _same(theirs, ours)
    assert ours[0][0].shape == (4, 4) and ours[0][1].dtype == torch.int32


class Wrapped(collections.abc.MutableMapping):  # type: ignore[type-arg]
    """A mapping around an inner dict: ``copy.copy`` shares that dict (as for any plain class),
    so torch's collate, filling a copy of the first sample, fills that sample too."""

    def __init__(self, **kw: Any) -> None:
        self._d = dict(kw)

    def __getitem__(self, k: str) -> Any:
        return self._d[k]

    def __setitem__(self, k: str, v: Any) -> None:
        self._d[k] = v

    def __delitem__(self, k: str) -> None:
        del self._d[k]

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)


class WrappedSamples(Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> Wrapped:
        return Wrapped(x=torch.full((3,), float(i)), y=i)


@pytest.mark.parametrize("batch_size", [4, 1])
def test_samples_that_torchs_collate_changes_are_collated_once(batch_size: int) -> None:
    """Review 17 F2: a batch that did not fit its slot was collated twice, the second time over
    samples the first pass had filled with placeholders: "stack expects each tensor to be equal
    size" (4), "Cannot copy out of meta tensor" (1)."""
    theirs, ours = _both(WrappedSamples(), batch_size=batch_size)
    assert len(ours) == 16 // batch_size
    for a, b in zip(theirs, ours, strict=True):
        assert type(a) is type(b) is Wrapped
        assert torch.equal(a["x"], b["x"]) and torch.equal(a["y"], b["y"])


class Pair(tuple):  # type: ignore[type-arg]
    """A tuple subclass (not a named tuple): torch's collate rebuilds it as a list of fields."""


class NestedSamples(Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> Pair:
        return Pair((Wrapped(x=torch.full((3,), float(i))), torch.full((2,), float(i))))


@pytest.mark.parametrize("batch_size", [4, 1])
def test_a_changeable_sample_inside_another_container_is_collated_once(batch_size: int) -> None:
    """Review 20 F1: the check for samples torch's collate changes looked only inside plain
    containers; inside a tuple subclass the mapping was planned and collated twice: placeholder
    (meta) tensors handed out (1), or "stack expects each tensor to be equal size" (4)."""
    theirs, ours = _both(NestedSamples(), batch_size=batch_size)
    assert len(ours) == 16 // batch_size
    for a, b in zip(theirs, ours, strict=True):
        assert type(a) is type(b)
        assert not b[0]["x"].is_meta and torch.equal(a[0]["x"], b[0]["x"])
        assert torch.equal(a[1], b[1])


class Jitter:
    def __init__(self, i: int) -> None:
        self.i = i


def collate_jitter(batch: list[Jitter], *, collate_fn_map: Any = None) -> torch.Tensor:
    """A collate-time augmentation: it draws from the worker's torch RNG."""
    return torch.tensor([j.i for j in batch], dtype=torch.float32) + torch.rand(len(batch))


class Jittered(Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> tuple[torch.Tensor, Jitter]:
        return torch.full((4,), float(i)), Jitter(i)


def test_a_registered_collate_that_draws_random_numbers_runs_once_per_batch(
    registry: dict[Any, Any],
) -> None:
    """Review 20 F2: planning ran the whole collate twice, a user's entry included: each
    worker's first batch drew its random numbers twice, and every later batch differed from
    torch's."""
    registry[Jitter] = collate_jitter
    runs = [
        list(kind(Jittered(), batch_size=4, num_workers=2, timeout=TIMEOUT,
                  generator=torch.Generator().manual_seed(0)))  # the same worker seeds
        for kind in (torch.utils.data.DataLoader, shmloader.DataLoader)
    ]  # fmt: skip
    assert _same(runs[0], runs[1])


class Checked(collections.namedtuple("Checked", "x y")):
    """A named tuple subclass whose ``__new__`` checks its fields, as validation often does."""

    __slots__ = ()

    def __new__(cls, x: Any, y: Any) -> Checked:
        if isinstance(x, torch.Tensor) and bool((x < 0).any()):
            raise ValueError("negative coordinates")
        return super().__new__(cls, x, y)


class CheckedSamples(Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> Checked:
        return Checked(torch.full((64,), float(i)), i)


def test_a_named_tuple_subclass_with_its_own_new_is_collated_once() -> None:
    """Review 21: any tuple with ``_fields`` was planned, so a subclass's ``__new__`` ran on the
    meta placeholders: "Tensor.item() cannot be called on meta tensors"."""
    theirs, ours = _both(CheckedSamples(), batch_size=4)
    assert _same(theirs, ours) and type(ours[0]) is Checked


class KeepsItsOutputs:
    """A collate_fn that stacks into ``shmloader.empty`` and keeps something of what it returns
    (a pool of earlier batches, for mixup): the tensor, its ``numpy()`` or ``detach()``, a
    ``clone()``, the last batch alone (``last``: a one-deep cache), or nothing but a reference
    cycle through the batch (``cycle``: it dies at the next collection), or that for 6 batches
    and then the tensor (``old``: each cycle moved to the oldest generation while alive).
    Each batch reports how many kept ones changed since."""

    def __init__(self, keep: str) -> None:
        self.keep = keep
        self.pool: list[tuple[Any, torch.Tensor]] = []
        self.calls = 0

    def __call__(self, samples: list[torch.Tensor]) -> Any:
        out = shmloader.empty((len(samples), *samples[0].shape), dtype=samples[0].dtype)
        torch.stack(samples, out=out)
        changed = sum(not torch.equal(torch.as_tensor(kept), copy) for kept, copy in self.pool)
        self.calls += 1
        if self.keep == "cycle" or (self.keep.endswith("cycles, then tensor") and self.calls <= 6):
            box: dict[str, Any] = {"x": out}
            box["self"] = box
            if self.keep.startswith("old"):
                gc.collect(1)  # the cycle, alive, moves to the oldest generation (as after work)
            return out, changed
        kept = {"tensor": out, "numpy()": out.numpy(), "detach()": out.detach(),
                "clone()": out.clone(), "last": out,
                "cycles, then tensor": out, "old cycles, then tensor": out}[self.keep]  # fmt: skip
        if self.keep == "last":
            self.pool.clear()
        self.pool.append((kept, out.clone()))
        return out, changed


class MadeInAGenerator(torch.utils.data.IterableDataset[torch.Tensor]):
    """Whole batches (``batch_size=None``) made in ``shmloader.empty`` by a generator, which
    still names the last one until it is resumed; it keeps none."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        for i in range(20):
            out = shmloader.empty((2, 1024), dtype=torch.float32)
            out.fill_(float(i))
            yield out


WARNED = "shmloader.empty() allocated in a batch's slot are still alive after that batch"


KEEPS = ["tensor", "numpy()", "detach()", "last", "cycles, then tensor",
         "old cycles, then tensor", "clone()", "cycle", "generator"]  # fmt: skip


@pytest.mark.parametrize("keep", KEEPS)
@frees_its_loaders_on_failure
def test_memory_of_shmloader_empty_kept_past_its_batch_is_warned_once(
    keep: str, capfd: pytest.CaptureFixture[str]
) -> None:
    """Review 50: ``shmloader.empty`` is the batch's slot, reused once the batch is consumed: a
    collate_fn that keeps it past its call (under torch, its own memory) saw later batches in
    it, silently. The worker now says so, once; the README says to keep a copy. Review 52: a
    kept ``numpy()`` or ``detach()`` went unseen, and a batch that dies only at a collection,
    or a generator's last batch, was warned of. (A spawned worker: a forked one inherits
    pytest's warning capture, which records the warning unseen.) Review 53: looked at only
    after the next fetch, a one-deep cache (``last``) had let go of what it read by then.
    Review 55: cycles in the first batches used up the look-out's collections, and a keep that
    began after them went unseen. Review 61: so did cycles old enough that only a full
    collection frees them."""
    if keep == "generator":
        dataset: Any = MadeInAGenerator()
        kw: dict[str, Any] = {"batch_size": None}
    else:
        dataset = [torch.full((1024,), float(i)) for i in range(40)]
        kw = {"batch_size": 2, "collate_fn": KeepsItsOutputs(keep)}
    loader = shmloader.DataLoader(dataset, num_workers=1, prefetch_factor=1, timeout=TIMEOUT,
                                  multiprocessing_context="spawn", **kw)  # fmt: skip
    batches = list(loader)
    err = capfd.readouterr().err
    assert len(batches) == 20
    if keep in ("tensor", "numpy()", "detach()", "last", "cycles, then tensor",
                "old cycles, then tensor"):
        assert err.count(WARNED) == 1, err
    else:
        assert "shmloader.empty() allocated" not in err, err  # no warning of this kind at all
    if keep in ("clone()", "cycle"):
        assert [changed for _, changed in batches] == [0] * 20


class WarningsAsErrors:
    """A ``worker_init_fn`` that turns warnings into errors in the worker (``-W error``)."""

    def __call__(self, worker_id: int) -> None:
        import warnings

        warnings.simplefilter("error")


@frees_its_loaders_on_failure
def test_with_warnings_as_errors_the_kept_memory_fails_a_batch_not_the_worker() -> None:
    """Review 52: under ``-W error`` the warning killed the worker ("exited unexpectedly", the
    details lost); raised from the batch being fetched, it reaches the user at that batch's
    turn, and the loader goes on, as after a dataset's error."""
    data = [torch.full((1024,), float(i)) for i in range(40)]
    loader = shmloader.DataLoader(data, batch_size=2, num_workers=1, prefetch_factor=1,
                                  collate_fn=KeepsItsOutputs("tensor"), timeout=TIMEOUT,
                                  worker_init_fn=WarningsAsErrors())  # fmt: skip
    it = iter(loader)
    got, errors = 0, []
    while True:
        try:
            next(it)
            got += 1
        except StopIteration:
            break
        except UserWarning as e:
            errors.append(str(e))
    assert len(errors) == 1 and WARNED in errors[0]
    assert got == 19


class Interleaved(torch.utils.data.IterableDataset[int]):
    """Ints ``0 .. n-1``, worker ``w`` of ``k`` yielding ``w, w + k, ...``; no ``state_dict``
    (a resume fast-forwards it)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        info = torch.utils.data.get_worker_info()
        assert info is not None
        yield from range(info.id, self.n, info.num_workers)


class LastOnly:
    """A collate_fn that collates into ``shmloader.empty`` and keeps the last batch."""

    def __init__(self) -> None:
        self.prev: torch.Tensor | None = None

    def __call__(self, samples: list[int]) -> torch.Tensor:
        out = shmloader.empty((len(samples),), dtype=torch.int64)
        out.copy_(torch.tensor(samples))
        self.prev = out
        return out


@frees_its_loaders_on_failure
def test_a_batch_failed_by_the_warning_as_an_error_resumes_without_losing_samples() -> None:
    """Review 54: raised before the batch's fetch, the warning failed a batch whose replica did
    not advance, while the batch counted as consumed: a resume past it fast-forwarded one batch
    too many per worker and lost 8 samples. Raised after the fetch, as a dataset's error."""

    def make() -> shmloader.DataLoader[Any]:
        return shmloader.DataLoader(Interleaved(48), batch_size=4, num_workers=2,
                                    collate_fn=LastOnly(), worker_init_fn=WarningsAsErrors(),
                                    timeout=TIMEOUT)  # fmt: skip

    def drain(loader: shmloader.DataLoader[Any]) -> tuple[list[Any], list[dict[str, Any]]]:
        out: list[Any] = []
        states: list[dict[str, Any]] = []
        it = iter(loader)
        while True:
            try:
                out.append(next(it).tolist())
            except StopIteration:
                return out, states
            except UserWarning as e:
                assert WARNED in str(e)
                out.append(None)
            states.append(loader.state_dict())

    out, states = drain(make())
    failed = [i for i, b in enumerate(out) if b is None]
    assert len(failed) == 2  # once per worker
    cut = failed[-1] + 1
    resumed = make()
    resumed.load_state_dict(states[cut - 1])
    rest, _ = drain(resumed)
    assert sorted(x for b in rest if b is not None for x in b) == sorted(
        x for b in out[cut:] if b is not None for x in b
    )
