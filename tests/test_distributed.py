"""Two ranks under torch's own launcher (torchrun, gloo on CPU), each loader with 2 workers."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed_job import BATCH, SAVE_AT, N

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("ranks")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master_port={port}", "-m", "tests.distributed_job", str(out)]
    done = subprocess.run(cmd, cwd=REPO, env=env, text=True, capture_output=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_two_ranks_cover_the_dataset_exactly_once_per_epoch(ranks):
    for epoch in range(2):
        both = ranks[0]["epochs"][epoch] + ranks[1]["epochs"][epoch]
        assert sorted(both) == list(range(N))
        assert len(ranks[0]["epochs"][epoch]) == len(ranks[1]["epochs"][epoch]) == N // 2


def test_set_epoch_reshuffles_each_ranks_share(ranks):
    for r in ranks:
        assert r["epochs"][0] != r["epochs"][1]


def test_a_rank_resumes_from_its_own_state_bit_for_bit(ranks):
    for r in ranks:
        assert r["resumed"] == r["epochs"][1][SAVE_AT * BATCH :]


def test_each_rank_has_its_own_arena_and_workers(ranks):
    # Every sample was checked against its id on arrival in its rank (no bytes of another rank's
    # batches), and the ranks' workers are distinct processes.
    assert not set(ranks[0]["pids"]) & set(ranks[1]["pids"])
    assert [r["stats_rank"] for r in ranks] == [0, 1]
    assert all(r["world"] == 2 for r in ranks)
