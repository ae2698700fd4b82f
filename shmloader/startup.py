"""Starting a multi-process iterator's workers: the RNG ring they publish into, the record of
their progress (:mod:`shmloader.progress`), one :class:`WorkerConfig` per worker built from the
loader's settings the way torch's ``_MultiProcessingDataLoaderIter`` builds its worker arguments,
and the :class:`Supervisor` that runs them.

Invariants: every worker gets the same dataset, collate function and base seed; worker ``i`` gets
its own RNG-ring row and what a resumed run restores into it (:mod:`shmloader.progress`); torch's
``default_collate`` is swapped for :func:`slot_default_collate`, which writes the same batch into
an arena slot; DataPipes get torch's sharding ``worker_init_fn`` wrapper.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from arena import Backend
from arena.finalizers import on_death
from shmloader._torch_compat import (
    ITERABLE_KIND,
    IterDataPipe,
    MapDataPipe,
    _BaseDataLoaderIter,
    _sharding_worker_init_fn,
)
from shmloader.collate import slot_default_collate
from shmloader.host import ArenaHost
from shmloader.progress import WorkerProgress
from shmloader.rngstate import RngRing
from shmloader.supervisor import Supervisor
from shmloader.worker import WorkerConfig


def start_workers(
    it: _BaseDataLoaderIter,
    loader: torch.utils.data.DataLoader[Any],
    plan: dict[str, Any] | None,
    host: ArenaHost,
) -> tuple[Supervisor, WorkerProgress]:
    """Start ``it``'s workers, with what a loaded state ``plan`` gives them back (see
    :mod:`shmloader.state`); the RNG ring they publish into lives as long as ``it``. Forked
    workers share the slots of the batches every loader lends now: those are kept from reuse
    until the workers are gone (:class:`~shmloader.supervisor.Supervisor`)."""
    nw: int = it._num_workers
    # memfd: a few pages per worker that never count against /dev/shm or the arena's cap
    # Deep enough for the snapshot a state needs: after the last consumed task, with up to
    # prefetch_factor tasks answered past it, and the batches a DevicePrefetcher holds unseen.
    holds = getattr(loader, "_consumer_holds", 1)
    rng_ring = RngRing.create(nw, (loader.prefetch_factor or 2) + 3 + holds, Backend.MEMFD)
    on_death(it, rng_ring.close)
    host.rng_rings.add(rng_ring)  # counted by stats() while it lives
    resumed = plan is not None and plan["base_seed"] is not None
    mid_epoch = resumed and plan["in_epoch"]  # type: ignore[index]
    iterable = it._dataset_kind == ITERABLE_KIND
    progress = WorkerProgress(
        nw,
        rng_ring,
        iterable,
        rng_carry=list(plan["workers"]) if resumed and plan["workers"] else None,  # type: ignore[index]
        replicas=plan.get("replicas") if mid_epoch else None,  # type: ignore[union-attr]
        mid_epoch=mid_epoch,
    )
    # An IterableDataset's sampler is torch's infinite constant one: any draw is the index
    # of one batch ([None] * batch_size, or None), what a resumed replica fast-forwards with.
    one_index = next(iter(it._index_sampler)) if iterable and mid_epoch else None
    ctx = loader.multiprocessing_context or torch.multiprocessing.get_context()
    init_fn = loader.worker_init_fn
    if isinstance(it._dataset, IterDataPipe | MapDataPipe):
        init_fn = functools.partial(
            _sharding_worker_init_fn,
            init_fn,
            it._world_size,
            it._rank,
        )
    collate_fn = it._collate_fn
    if collate_fn is torch.utils.data.default_collate:
        collate_fn = slot_default_collate
    configs = [
        WorkerConfig(
            worker_id=i,
            num_workers=nw,
            dataset_kind=it._dataset_kind,
            dataset=it._dataset,
            auto_collation=it._auto_collation,
            collate_fn=collate_fn,
            drop_last=it._drop_last,
            base_seed=int(it._base_seed),
            init_fn=init_fn,
            main_pid=host.pid,
            shared_seed=it._shared_seed,
            rng_ring=rng_ring.slab.spec,
            rng_depth=rng_ring.depth,
            # Mid-epoch: the epoch's start, then after the last consumed batch; between epochs,
            # where the next epoch's iter() starts (shmloader.worker.WorkerConfig).
            rng_epoch_start=progress.epoch_rng[i] if mid_epoch else progress.rng_carry[i],
            rng_restore=progress.rng_carry[i] if mid_epoch else None,
            replica_restore=progress.restore_for(i, one_index),
        )
        for i in range(nw)
    ]
    sup = Supervisor(ctx, configs)  # (it keeps the slots lent from reuse while its workers live)
    host.worker_pids = tuple(sup.pids)
    if host.export is not None:
        host.export.write({"kind": "workers", "pids": list(sup.pids)})
    return sup, progress
