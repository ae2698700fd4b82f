"""The loader columns a benchmark can compare, and how each is resolved into a factory.

A *column* is one loader configuration: a factory with the ``torch.utils.data.DataLoader``
signature, its ``num_workers``, whether it keeps its workers between epochs, and whether the
batches are moved to the device by ``shmloader.DevicePrefetcher`` instead of by the timed loop.

Invariants:
- Factories are resolved lazily; an ``ImportError`` means the column is unavailable here.
  Optional columns (``spdl``) are then skipped with one line saying so (their ``missing`` text),
  or with the import error when asked for by name.
- A ``device_prefetch`` column runs only on workloads that name a device (``pinned``); the bench
  drops it from every other workload.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.data

from ._report import Progress

LoaderFactory = Callable[..., Iterable[Any]]


def _torch_loader() -> LoaderFactory:
    return torch.utils.data.DataLoader


def _shmloader_loader() -> LoaderFactory:
    import shmloader

    factory: LoaderFactory = shmloader.DataLoader
    return factory


def _spdl_loader() -> LoaderFactory:
    from spdl.dataloader import get_pytorch_dataloader

    factory: LoaderFactory = get_pytorch_dataloader
    return factory


@dataclass(frozen=True)
class LoaderSpec:
    """How to get one loader column; ``resolve`` imports lazily, ImportError = unavailable."""

    resolve: Callable[[], LoaderFactory]
    num_workers: int | None = None  # None: --workers
    persistent_ok: bool = True  # accepts persistent_workers=True
    optional: bool = False  # skipped with one note when missing, unless asked for by name
    missing: str = ""  # that note: what is not installed and how to get it
    device_prefetch: bool = False  # wrap in shmloader.DevicePrefetcher (device workloads only)


LOADERS: dict[str, LoaderSpec] = {
    "torch": LoaderSpec(_torch_loader),
    "torch-0": LoaderSpec(_torch_loader, num_workers=0),
    "shmloader": LoaderSpec(_shmloader_loader),
    "shmloader+prefetch": LoaderSpec(_shmloader_loader, device_prefetch=True),
    "spdl": LoaderSpec(
        _spdl_loader,
        persistent_ok=False,
        optional=True,
        missing="SPDL is not installed, so its column is skipped (pip install spdl to add it)",
    ),
}
ALIASES = {"torch0": "torch-0", "prefetch": "shmloader+prefetch"}
DEFAULT_LOADERS = "torch,shmloader,spdl"
# Columns a workload adds when "torch" is among the loaders: tabular's target is >= 1.5x torch-0;
# pinned also shows shmloader behind DevicePrefetcher (the copy overlapped on a side stream).
EXTRA_COLUMNS: dict[str, tuple[str, ...]] = {
    "tabular": ("torch-0",),
    "null": ("torch-0",),
    "pinned": ("shmloader+prefetch",),
}


@dataclass(frozen=True)
class Column:
    name: str
    factory: LoaderFactory
    num_workers: int
    persistent: bool
    device_prefetch: bool = False


def resolve_columns(
    names: list[str], workers: int, fresh_workers: bool, explicit: bool, progress: Progress
) -> list[Column]:
    """The available columns among ``names``; notes the unavailable ones (see module docstring)."""
    columns = []
    for name in names:
        spec = LOADERS[name]
        try:
            factory = spec.resolve()
        except ImportError as exc:
            if explicit or not spec.optional:
                progress.note(f"skipped loader {name}: {exc}")
            else:
                progress.note(spec.missing or f"skipped optional loader {name}: {exc}")
            continue
        n = workers if spec.num_workers is None else spec.num_workers
        persistent = spec.persistent_ok and n > 0 and not fresh_workers
        columns.append(Column(name, factory, n, persistent, spec.device_prefetch))
    return columns
