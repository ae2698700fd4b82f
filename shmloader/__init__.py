"""shmloader: a drop-in ``torch.utils.data.DataLoader`` whose workers collate into shared memory.

Change one import::

    from shmloader import DataLoader

Public names: :class:`DataLoader`, :func:`get_worker_info` (torch's own), :func:`empty` (allocate
a custom collate's outputs inside the batch's slot), :func:`release` (return a batch's slot
before its views die), :class:`LoaderStats`, :class:`DevicePrefetcher` (copy batches to the GPU
on a side stream, one step ahead, releasing each slot only after its copy completed).

Errors a user can catch, all subclasses of ``RuntimeError`` (defined in :mod:`arena.errors`,
re-exported here so no one needs to know that): :class:`ArenaError` (the base),
:class:`ArenaCapacityError` (a batch or slab cannot get the bytes), :class:`ArenaExhaustedError`
(every slot is held and the arena is at its cap), :class:`ArenaDescriptorError` (a process, the
main one or a worker, has no file descriptor to spare for a slab or the RNG-state ring: ``ulimit
-n``), :class:`StaleSlotError` (a slot released twice), :class:`InheritedArenaError` (an
arena's books used in a process that inherited them through ``fork()``).
"""

import os
from typing import Any

import torch.utils.data
from torch.utils.data import get_worker_info

from arena import userwarn
from arena.errors import (
    ArenaCapacityError,
    ArenaDescriptorError,
    ArenaError,
    ArenaExhaustedError,
    InheritedArenaError,
    StaleSlotError,
)
from shmloader.collate import empty
from shmloader.loader import DataLoader
from shmloader.prefetch import DevicePrefetcher
from shmloader.stats import LoaderStats

# Our warnings name the user's line: skip this package's frames and those of torch's DataLoader
# machinery (the ``__next__`` and ``__iter__`` a loop goes through).
userwarn.internal(os.path.dirname(os.path.abspath(__file__)))
userwarn.internal(os.path.dirname(os.path.abspath(torch.utils.data.__file__)))


def release(batch: Any, loader: DataLoader[Any]) -> int:
    """Return the arena slots of ``batch`` to ``loader`` now, before its views die.

    For power users who know no view of the batch will be read again (e.g. after copying it to
    the GPU): the slot is reused at once, so reading a view afterwards shows a later batch's
    bytes. With ``pin_memory=True`` on a GPU, "at once" means once the GPU has passed the copies
    queued on the current stream so far (:mod:`shmloader.fence`). Returns the number of slots
    released: 0 if the batch holds none — always with ``num_workers=0``, whose batches are
    ordinary tensors owning their memory (torch's own path; they are freed when you drop them),
    and for a batch already released.

    Raises ``TypeError`` unless ``loader`` is the :class:`shmloader.DataLoader` that yielded the
    batch (a ``torch.utils.data.DataLoader``'s batches own their memory; nothing to release).
    """
    _check_release_arguments(batch, loader)
    host = loader._host
    if host is None or not host.here:
        return 0
    for lender in host.lenders():  # an iterator of a retired arena may still yield batches
        released: int = lender.leases.release_early(batch)
        if released:
            return released
    return 0


def _check_release_arguments(batch: Any, loader: Any) -> None:
    if isinstance(loader, DataLoader):
        return
    if isinstance(batch, torch.utils.data.DataLoader):
        raise TypeError(
            "release(batch, loader) takes the batch first and the loader second; got a "
            f"{type(batch).__name__} as the batch and a {type(loader).__name__} as the loader"
        )
    if isinstance(loader, torch.utils.data.DataLoader):
        raise TypeError(
            "release() needs the shmloader.DataLoader that yielded the batch, got a "
            f"{type(loader).__module__}.{type(loader).__name__}: its batches own their memory, "
            "so there is nothing to release; drop your references to the batch instead"
        )
    raise TypeError(
        "release() needs the shmloader.DataLoader that yielded the batch as its second "
        f"argument, got {type(loader).__name__}"
    )


__all__ = [
    "ArenaCapacityError",
    "ArenaDescriptorError",
    "ArenaError",
    "ArenaExhaustedError",
    "DataLoader",
    "DevicePrefetcher",
    "InheritedArenaError",
    "LoaderStats",
    "StaleSlotError",
    "empty",
    "get_worker_info",
    "release",
]
