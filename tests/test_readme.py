"""README.md says what is true: its snippets run as written, its lists match the code."""

import configparser
import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shmloader
from arena import ArenaStats

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
SNIPPETS = re.findall(r"```python\n(.*?)```", README, flags=re.DOTALL)


def _needs_gpu(code: str) -> bool:
    return '"cuda"' in code


@pytest.mark.parametrize(
    "code",
    [pytest.param(c, marks=[pytest.mark.gpu] if _needs_gpu(c) else []) for c in SNIPPETS],
    ids=[f"snippet-{i}" for i in range(len(SNIPPETS))],
)
def test_every_python_snippet_runs_as_written(code, tmp_path):
    if _needs_gpu(code) and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if "train.arrow" in code:  # the file the README's `tools.pack` command writes just before
        import pyarrow as pa
        import pyarrow.feather as feather

        table = pa.table({"x": pa.array([[float(i)] * 4 for i in range(64)],
                                        pa.list_(pa.float32(), 4)),
                          "label": pa.array(range(64), pa.int64())})
        feather.write_feather(table, str(tmp_path / "train.arrow"), compression="uncompressed")
    # The repo first, then whatever the caller's PYTHONPATH already held (dependencies installed
    # with --target, say): replacing it would hide them from the snippet.
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    cmd = [sys.executable, "-c", code]
    if "# torchrun --nproc_per_node=2" in code:  # the distributed example: 2 ranks, run twice
        (tmp_path / "train.py").write_text(code)  # (the second run resumes from checkpoints)
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
               f"--master_port={port}", "train.py"]
        first = subprocess.run(cmd, cwd=tmp_path, env=env, text=True, capture_output=True,
                               timeout=120)
        assert first.returncode == 0, first.stderr
    done = subprocess.run(cmd, cwd=tmp_path, env=env, text=True,
                          capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_two_commands_come_first():
    assert re.findall(r"^## (.*)$", README, flags=re.MULTILINE)[0] == "Two commands"
    assert "./run.sh bench" in README and "./run.sh test" in README


def test_the_supported_torch_range_is_stated_once_and_is_setup_cfgs():
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    (spec,) = [r.strip() for r in cfg["options"]["install_requires"].splitlines()
               if r.strip().startswith("torch")]
    assert README.count(spec) == 1
    assert not re.search(r"torch\s*(>=|<=|<|>|~=)\s*\d", README.replace(spec, ""))  # pins: ok
    assert "torch 2.x" not in README


@pytest.mark.parametrize("name", [n for n in shmloader.__all__ if n.endswith("Error")])
def test_every_exported_error_is_listed(name):
    assert f"`shmloader.{name}`" in README


@pytest.mark.parametrize(
    "field",
    [*(f.name for f in dataclasses.fields(ArenaStats)), "slots_free", "bytes_in_use",
     "batches_held", "pinned_bytes", "worker_pids", "rank", "world_size", "slots_kept",
     "bytes_kept", "batches_spilled", "bytes_spilled", "bytes_rng_rings", "batches_retired",
     "bytes_retired"],
)
def test_every_stats_field_is_documented(field):
    assert f"`{field}`" in README


def test_the_installed_commands_and_the_torch_override_are_documented():
    for words in ("shmloader-memprof", "shmloader-bench", "-- python train.py",
                  "SHMLOADER_TORCH", "torch-0"):
        assert words in README
