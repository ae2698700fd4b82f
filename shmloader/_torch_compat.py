"""Every use of a private ``torch.utils.data`` name, in one place.

shmloader keeps torch's contract by reusing torch's own front end (argument validation, samplers,
``len``, the base iterator that draws the worker base seed, fetchers, collate dispatch, worker
seeding). Those live under private names; if a torch release moves one, this is the only file to
change. Tested against the torch version pinned in ``run.sh``.
"""

from __future__ import annotations

import torch
from torch._utils import ExceptionWrapper
from torch.utils.data import _utils as torch_data_utils
from torch.utils.data._utils.collate import (
    collate,
    collate_float_fn,
    collate_int_fn,
    collate_numpy_array_fn,
    collate_numpy_scalar_fn,
    collate_str_fn,
    collate_tensor_fn,
    default_collate_fn_map,
)
from torch.utils.data._utils.worker import WorkerInfo, _generate_state
from torch.utils.data.dataloader import (
    _BaseDataLoaderIter,
    _DatasetKind,
    _sharding_worker_init_fn,
)
from torch.utils.data.datapipes.datapipe import IterDataPipe, MapDataPipe


def profiler_enabled() -> bool:
    """Whether a torch profiler is recording (torch's __next__ opens a range per batch then)."""
    return bool(torch.autograd._profiler_enabled())  # type: ignore[attr-defined]


def torch_function_mode_active() -> bool:
    """Whether a torch function mode is on (``torch.set_default_device``, ``with
    torch.device(...)``, or a user's mode): one may redirect what ``torch.tensor`` makes."""
    return bool(torch._C._len_torch_function_stack())


def set_worker_info(info: WorkerInfo | None) -> None:
    """Make ``torch.utils.data.get_worker_info()`` return ``info`` in this process."""
    torch_data_utils.worker._worker_info = info


def create_fetcher(
    kind: int, dataset: object, auto_collation: bool, collate_fn: object, drop_last: bool
) -> object:
    """torch's fetcher for ``kind`` (map-style or iterable), with torch's fetch semantics."""
    return _DatasetKind.create_fetcher(  # type: ignore[no-untyped-call]
        kind, dataset, auto_collation, collate_fn, drop_last
    )


def wrap_current_exception(where: str) -> ExceptionWrapper:
    """torch's picklable record of the exception being handled, re-raised in the main process."""
    return ExceptionWrapper(where=where)  # type: ignore[no-untyped-call]


def numpy_seed(base_seed: int, worker_id: int) -> list[int]:
    """The NumPy seed torch gives worker ``worker_id``."""
    return _generate_state(base_seed, worker_id)  # type: ignore[no-untyped-call, no-any-return]


def pin_memory(data: object, device: str | None) -> object:
    """torch's pinning copy of a batch (honours custom types' ``pin_memory()``)."""
    from torch.utils.data._utils.pin_memory import pin_memory as _pin

    return _pin(data, device)  # type: ignore[no-untyped-call]


ITERABLE_KIND: int = _DatasetKind.Iterable

__all__ = [
    "ITERABLE_KIND",
    "ExceptionWrapper",
    "IterDataPipe",
    "MapDataPipe",
    "WorkerInfo",
    "_BaseDataLoaderIter",
    "_sharding_worker_init_fn",
    "collate",
    "collate_float_fn",
    "collate_int_fn",
    "collate_numpy_array_fn",
    "collate_numpy_scalar_fn",
    "collate_str_fn",
    "collate_tensor_fn",
    "create_fetcher",
    "numpy_seed",
    "pin_memory",
    "profiler_enabled",
    "default_collate_fn_map",
    "set_worker_info",
    "torch_function_mode_active",
    "wrap_current_exception",
]
