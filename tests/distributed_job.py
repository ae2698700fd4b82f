"""One rank of tests/test_distributed.py, started by torch's own launcher (torchrun).

Each rank loads a DistributedSampler's share with 2 workers, for 2 epochs (set_epoch between),
saves its loader's state after ``SAVE_AT`` batches of epoch 1 and goes on; then a fresh loader
loads that state and yields the rest of epoch 1. The rank writes what it saw as JSON to
``<out>/rank<r>.json``: every epoch's sample ids in order, the resumed tail, its worker pids and
its stats' rank. Each sample is checked against its id on arrival (a collision between ranks'
arenas would show another sample's bytes).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler

import shmloader

N, BATCH, SAVE_AT = 96, 4, 5


class Rows(Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((256,), float(i)), i


def ids(batch: tuple[torch.Tensor, torch.Tensor]) -> list[int]:
    x, y = batch
    assert torch.equal(x[:, 0], y.to(x.dtype)) and bool((x == x[:, :1]).all()), "corrupt batch"
    return y.tolist()


def make(sampler: DistributedSampler) -> shmloader.DataLoader:
    return shmloader.DataLoader(Rows(), batch_size=BATCH, sampler=sampler, num_workers=2,
                                arena_max_bytes=64 << 20, timeout=60)


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    sampler = DistributedSampler(Rows(), shuffle=True, seed=7)
    loader = make(sampler)
    epochs, state, pids = [], None, set()
    for epoch in range(2):
        sampler.set_epoch(epoch)
        seen = []
        for k, batch in enumerate(loader):
            seen += ids(batch)
            if epoch == 1 and k + 1 == SAVE_AT:
                state = loader.state_dict()
            pids |= set(loader.stats().worker_pids)
        epochs.append(seen)
    rank_of_stats = loader.stats().rank
    # A fresh loader (and sampler) resumes epoch 1 from the state saved after SAVE_AT batches.
    sampler2 = DistributedSampler(Rows(), shuffle=True, seed=7)
    sampler2.set_epoch(1)
    resumed_loader = make(sampler2)
    resumed_loader.load_state_dict(state)
    resumed = [i for batch in resumed_loader for i in ids(batch)]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"epochs": epochs, "resumed": resumed, "pids": sorted(pids),
                   "stats_rank": rank_of_stats, "world": dist.get_world_size()}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
