"""shmloader: a drop-in ``torch.utils.data.DataLoader`` whose workers collate into shared memory.

Change one import::

    from shmloader import DataLoader

Public names: :class:`DataLoader`, :func:`get_worker_info` (torch's own), :func:`empty` (allocate
a custom collate's outputs inside the batch's slot), :func:`release` (return a batch's slot
before its views die), :class:`LoaderStats`, :class:`DevicePrefetcher` (copy batches to the GPU
on a side stream, one step ahead, releasing each slot only after its copy completed).
"""

from typing import Any

from torch.utils.data import get_worker_info

from shmloader.collate import empty
from shmloader.loader import DataLoader
from shmloader.prefetch import DevicePrefetcher
from shmloader.stats import LoaderStats


def release(batch: Any, loader: DataLoader[Any]) -> int:
    """Return the arena slots of ``batch`` to ``loader`` now, before its views die.

    For power users who know no view of the batch will be read again (e.g. after copying it to
    the GPU): the slot is reused at once, so reading a view afterwards shows a later batch's
    bytes. Returns the number of slots released (0 if the batch holds none).
    """
    host = loader._host
    return 0 if host is None or not host.here else host.leases.release_early(batch)


__all__ = ["DataLoader", "DevicePrefetcher", "LoaderStats", "empty", "get_worker_info", "release"]
