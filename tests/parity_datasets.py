"""Shared objects for the torch-parity suite: the loader under test, datasets, samplers, collates.

Everything a worker may need is a top-level object here, so spawn and forkserver workers can
import it by name (``tests.parity_datasets.X``). Datasets have a fixed ``__repr__`` because torch's
IterableDataset length warning embeds the dataset's repr, and the suite compares warning texts.

The loader under test is ``candidate_loader_class()``: ``shmloader.DataLoader``, or torch's own
``DataLoader`` when ``SHMLOADER_PARITY_SELFTEST=1``. Running the suite in self-test mode compares
torch with itself, which proves the tests (not shmloader) right.

The second half holds the comparison helpers:
- ``seed_all`` seeds torch, ``random`` and NumPy together;
- ``rng_snapshot`` / ``assert_same_rng`` capture and compare every main-process RNG;
- ``assert_same_batch`` compares two batches by type, structure, dtype, shape and bytes;
- ``canonical`` turns a batch into a hashable value so unordered runs compare as multisets.
"""

from __future__ import annotations

import collections
import math
import os
import random
from collections.abc import Mapping

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, Sampler, get_worker_info

SELFTEST_ENV = "SHMLOADER_PARITY_SELFTEST"


def selftest_mode():
    return os.environ.get(SELFTEST_ENV) == "1"


def candidate_loader_class():
    """The DataLoader class under test (torch's own in self-test mode)."""
    if selftest_mode():
        return torch.utils.data.DataLoader
    import shmloader

    return shmloader.DataLoader


def candidate_get_worker_info():
    """``get_worker_info`` as exported by the package under test."""
    if selftest_mode():
        return torch.utils.data.get_worker_info()
    import shmloader

    return shmloader.get_worker_info()


# --------------------------------------------------------------------------- map-style datasets


class ArangeDataset(Dataset):
    """Sample i is (float32 (3, 4) tensor holding 12*i .. 12*i+11, the int i)."""

    def __init__(self, n=50):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.arange(12, dtype=torch.float32).reshape(3, 4) + 12 * i, i

    def __repr__(self):
        return f"ArangeDataset(n={self.n})"


Point = collections.namedtuple("Point", ["x", "y", "label"])


class NestedDataset(Dataset):
    """Samples nesting dicts, tuples, lists, a namedtuple, NumPy arrays and scalars, and strings."""

    def __init__(self, n=24):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {
            "image": torch.full((2, 3), i, dtype=torch.uint8),
            "meta": {"id": i, "name": f"sample-{i}", "weight": i / 8, "flag": i % 3 == 0},
            "pair": (np.arange(4, dtype=np.int16) * i, np.float32(i) / 3),
            "point": Point(x=i, y=torch.tensor([i, -i], dtype=torch.int32), label=str(i)),
            "scalars": [np.float64(i) * 0.1, np.int32(i), np.bool_(i % 2), np.uint8(i)],
            "half": torch.tensor(i / 7, dtype=torch.float16),
        }

    def __repr__(self):
        return f"NestedDataset(n={self.n})"


class RandomValuesDataset(Dataset):
    """Samples drawn from the fetching process's torch, ``random`` and NumPy RNGs."""

    def __init__(self, n=40):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {
            "id": i,
            "torch": torch.rand(3),
            "randint": torch.randint(0, 1_000_000, (2,)),
            "python": random.random(),
            "numpy": np.random.rand(2),
        }

    def __repr__(self):
        return f"RandomValuesDataset(n={self.n})"


class CustomDatasetError(Exception):
    """A user-defined exception type raised from a dataset."""


class FailingDataset(Dataset):
    """ArangeDataset whose samples in ``bad`` raise ``error_type``."""

    def __init__(self, n=30, bad=(5, 6, 17), error_type=ValueError):
        self.n = n
        self.bad = frozenset(bad)
        self.error_type = error_type

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i in self.bad:
            raise self.error_type(f"sample {i} is cursed")
        return torch.full((2,), i, dtype=torch.int64)

    def __repr__(self):
        return f"FailingDataset(n={self.n})"


class NotImplementedDataset(Dataset):
    """A map-style dataset without ``__getitem__``: every fetch raises NotImplementedError."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n


class NumpyTypesDataset(Dataset):
    """Sample i: NumPy scalars of every common dtype, then a float64 (2, 3) array."""

    SCALAR_TYPES = (
        np.float64,
        np.float32,
        np.float16,
        np.int64,
        np.int32,
        np.int16,
        np.int8,
        np.uint8,
        np.bool_,
    )

    def __init__(self, n=6):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return [t(i % 2 if t is np.bool_ else i) for t in self.SCALAR_TYPES] + [np.ones((2, 3)) * i]


class BulkDataset(Dataset):
    """Fetched with a whole list of indices at once (batch_size=None with a list sampler)."""

    def __init__(self, n=35):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, indices):
        if not isinstance(indices, (list, tuple)):
            raise TypeError(f"BulkDataset expects a list of indices, got {indices!r}")
        return torch.as_tensor(indices)


class SeedReportingDataset(Dataset):
    """Sample i is (worker id, torch.initial_seed(), WorkerInfo.seed) of the fetching worker."""

    def __init__(self, n=6):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        info = get_worker_info()
        return info.id, torch.initial_seed(), info.seed


class WorkerInfoProbeDataset(Dataset):
    """Reports what ``get_worker_info`` says inside a worker; pairs with ``mark_worker_init_fn``."""

    def __init__(self, n=8):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        info = get_worker_info()
        exported = candidate_get_worker_info()
        try:
            info.id = 99
            read_only = False
        except (RuntimeError, AttributeError):  # torch 2.13: a frozen dataclass
            read_only = info.id != 99
        return {
            "id": info.id,
            "num_workers": info.num_workers,
            "seed": info.seed,
            "initial_seed": torch.initial_seed(),
            "pid": os.getpid(),
            "marker": getattr(self, "marker", -1),
            "dataset_is_fetching_copy": info.dataset is self,
            "read_only": read_only,
            "repr_names_fields": all(f"{k}=" in repr(info) for k in ("id", "num_workers", "seed")),
            "exported_matches": (exported.id, exported.num_workers, exported.seed)
            == (info.id, info.num_workers, info.seed),
        }


class ModeDataset(Dataset):
    """Returns its ``mode`` attribute; persistent workers keep the value they started with."""

    def __init__(self, n=6):
        self.n = n
        self.mode = 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.mode


class WorkerQueueDataset(Dataset):
    """Sample i is (id of the worker that fetched it, i); ``remember_worker`` is the init fn."""

    def __init__(self, n=32):
        self.n = n
        self.worker_id = -1

    def remember_worker(self, worker_id):
        self.worker_id = worker_id

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.worker_id, i


# ------------------------------------------------------------------------- iterable datasets


class ShardedRangeIterable(IterableDataset):
    """Yields (payload, id) for ids 0..n-1; each worker takes ids ``worker_id::num_workers``.

    ``random_payload`` makes the payload come from the worker's torch RNG instead of the id.
    """

    def __init__(self, n=50, random_payload=False):
        self.n = n
        self.random_payload = random_payload

    def __len__(self):
        return self.n

    def __iter__(self):
        info = get_worker_info()
        first, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(first, self.n, step):
            payload = torch.rand(2) if self.random_payload else torch.full((2,), float(i))
            yield payload, i

    def __repr__(self):
        return f"ShardedRangeIterable(n={self.n})"


class UnsizedIterable(IterableDataset):
    """An IterableDataset without ``__len__``."""

    def __iter__(self):
        return iter(range(5))

    def __repr__(self):
        return "UnsizedIterable()"


class CountingIterable(IterableDataset):
    """Yields 0..n-1 in every worker (not sharded) and claims a length of n."""

    def __init__(self, n=10):
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        return iter(range(self.n))

    def __repr__(self):
        return f"CountingIterable(n={self.n})"


class WorkerSpecificIterable(IterableDataset):
    """Worker k yields range(sizes[k]); needs workers."""

    def __init__(self, sizes=(0, 4, 20)):
        self.sizes = tuple(sizes)

    def __len__(self):
        return sum(self.sizes)

    def __iter__(self):
        return iter(range(self.sizes[get_worker_info().id]))

    def __repr__(self):
        return f"WorkerSpecificIterable(sizes={self.sizes})"


class WorkerIdIterable(IterableDataset):
    """Each worker yields its own id length // num_workers times."""

    def __init__(self, length=20):
        self.length = length

    def __len__(self):
        return self.length

    def __iter__(self):
        info = get_worker_info()
        return iter([info.id] * (self.length // info.num_workers))


class FailingIterable(IterableDataset):
    def __iter__(self):
        raise RuntimeError("Error in __iter__")


# ---------------------------------------------------------------------------------- samplers


class FixedOrderSampler(Sampler):
    """Yields a fixed list of indices."""

    def __init__(self, order):
        self.order = list(order)

    def __iter__(self):
        return iter(self.order)

    def __len__(self):
        return len(self.order)


class GlobalRNGSampler(Sampler):
    """Draws every index lazily from the global torch RNG, so the main-process RNG state after an
    epoch counts exactly how many indices the loader pulled from its sampler."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        for _ in range(self.n):
            yield int(torch.randint(self.n, ()).item())

    def __len__(self):
        return self.n


class VariableBatchSampler(Sampler):
    """Batches of sizes 1, 2, 3, 1, 2, 3, ... over 0..n-1, as lists."""

    def __init__(self, n):
        self.n = n

    def _sizes(self):
        start, k = 0, 0
        while start < self.n:
            size = min(k % 3 + 1, self.n - start)
            yield start, size
            start, k = start + size, k + 1

    def __iter__(self):
        for start, size in self._sizes():
            yield list(range(start, start + size))

    def __len__(self):
        return sum(1 for _ in self._sizes())


class BulkIndexSampler(Sampler):
    """Yields lists of indices from a global-RNG permutation (a sampler of whole batches)."""

    def __init__(self, n, batch_size):
        self.n = n
        self.batch_size = batch_size

    def __iter__(self):
        for chunk in torch.randperm(self.n).split(self.batch_size):
            yield chunk.tolist()

    def __len__(self):
        return math.ceil(self.n / self.batch_size)


# ----------------------------------------------------------------- collate and worker_init fns


def tagged_stack_collate(batch):
    """Custom collate over (tensor, id) samples: a dict with a stacked tensor and plain lists."""
    tensors, ids = zip(*batch, strict=True)
    return {"x": torch.stack(tensors).double() * 2, "ids": list(ids), "count": len(ids)}


def reseed_torch_12345(worker_id):
    torch.manual_seed(12345)


def reseed_numpy_from_torch(worker_id):
    """The common user recipe: derive NumPy's seed from the worker's torch seed."""
    np.random.seed((torch.initial_seed() + worker_id) % 2**32)


def mark_worker_init_fn(worker_id):
    """Marks the worker's dataset copy; the main process's dataset must stay unmarked."""
    info = get_worker_info()
    if info.id != worker_id:
        raise RuntimeError(f"worker_init_fn got id {worker_id}, WorkerInfo says {info.id}")
    info.dataset.marker = 100 + worker_id


def failing_worker_init_fn(worker_id):
    raise RuntimeError("Error in worker_init_fn")


# ------------------------------------------------------------------------- comparison helpers


def seed_all(seed):
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def rng_snapshot(generator=None):
    """Every RNG state of the main process, plus the loader's generator when there is one."""
    return {
        "torch": torch.get_rng_state(),
        "generator": None if generator is None else generator.get_state(),
        "random": random.getstate(),
        "numpy": np.random.get_state(),
    }


def assert_same_rng(expected, actual, where):
    assert torch.equal(actual["torch"], expected["torch"]), f"{where}: global torch RNG differs"
    if expected["generator"] is not None:
        assert torch.equal(actual["generator"], expected["generator"]), (
            f"{where}: generator state differs"
        )
    assert actual["random"] == expected["random"], f"{where}: Python random state differs"
    for a, e in zip(actual["numpy"], expected["numpy"], strict=True):
        assert np.array_equal(a, e), f"{where}: NumPy global RNG state differs"


def _bytes_of(t):
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def assert_same_batch(expected, actual, path="batch"):
    """Same type at every level, same keys/fields in the same order, same dtype, shape and bytes."""
    assert type(actual) is type(expected), f"{path}: {type(actual)} != {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{path}: shape {actual.shape} != {expected.shape}"
        assert torch.equal(_bytes_of(actual), _bytes_of(expected)), f"{path}: values differ"
    elif isinstance(expected, np.ndarray):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, path
        assert actual.tobytes() == expected.tobytes(), f"{path}: values differ"
    elif isinstance(expected, Mapping):
        assert list(actual) == list(expected), f"{path}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            assert_same_batch(expected[key], actual[key], f"{path}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{path}: length {len(actual)} != {len(expected)}"
        for k, (e, a) in enumerate(zip(expected, actual, strict=True)):
            assert_same_batch(e, a, f"{path}[{k}]")
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def canonical(batch):
    """A hashable image of a batch that keeps types, dtypes, shapes and exact bytes."""
    kind = type(batch).__name__
    if isinstance(batch, torch.Tensor):
        return kind, str(batch.dtype), tuple(batch.shape), bytes(_bytes_of(batch).numpy())
    if isinstance(batch, np.ndarray):
        return kind, str(batch.dtype), batch.shape, batch.tobytes()
    if isinstance(batch, Mapping):
        return kind, tuple((k, canonical(v)) for k, v in batch.items())
    if isinstance(batch, (list, tuple)):
        return kind, tuple(canonical(v) for v in batch)
    return kind, repr(batch)
