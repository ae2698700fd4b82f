"""Lightning rebuilds a user's DataLoader to inject a DistributedSampler: shmloader's own keyword
arguments must survive its rebuild (Lightning's own helper, not a copy of its logic)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

import shmloader

lightning_data = pytest.importorskip("lightning.pytorch.utilities.data")


def test_lightnings_rebuild_keeps_the_arena_arguments_and_loads_the_ranks_share():
    data = TensorDataset(torch.arange(40.0))
    loader = shmloader.DataLoader(data, batch_size=4, num_workers=2, arena_max_bytes=123 << 20,
                                  arena_slots_per_slab=7, arena_backend="memfd")
    sampler = DistributedSampler(data, num_replicas=2, rank=1, shuffle=False)
    rebuilt = lightning_data._update_dataloader(loader, sampler)
    assert type(rebuilt) is shmloader.DataLoader and rebuilt.sampler is sampler
    assert (rebuilt.arena_max_bytes, rebuilt.arena_slots_per_slab) == (123 << 20, 7)
    assert rebuilt.arena_backend == "memfd"
    got = [x.tolist() for (x,) in rebuilt]
    assert got == [[float(i) for i in range(1 + 8 * k, 9 + 8 * k, 2)] for k in range(5)]
    st = rebuilt.stats()
    assert (st.max_bytes, st.backend) == (123 << 20, "memfd")
    assert st.slots_total % 7 == 0
