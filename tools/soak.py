"""Soak run: many tiny batches through one persistent loader, and how its resources moved.

Run from the repository root: ``python -m tools.soak [--batches 200000] [--workers 2]``.

Method
------
- One ``shmloader.DataLoader`` with ``persistent_workers=True`` over a tiny in-memory dataset
  (``--rows`` rows of ``--width`` float32, ``--batch-size`` rows a batch, no shuffle), iterated for
  whole epochs until at least ``--batches`` batches have been read (the last epoch is finished,
  never broken off, so no task is left in flight at the end). Every batch is checked against the
  rows it must hold and dropped before the next one is asked for.
- Samples, per process (the main process and each worker, by the pids ``loader.stats()``
  reports): RSS and the open file-descriptor count, once after warm-up (``--warmup`` of the
  batches, 5% by default), once half-way and once at the end (after the last epoch and a
  ``gc.collect()``, with the workers still alive).
- Growth = ``end / warm-up - 1`` per process and for the sum.

Prints a table and the verdict; asserts nothing while running. Exit status 1 (and the reasons on
stderr) if any process's RSS grew by more than ``--max-rss-growth`` percent (5), if any process's
fd count grew, if any arena slot is not free or any batch still counted as held at the end, if a
worker was replaced, or if a batch held the wrong rows; else 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
from torch.utils.data import Dataset

import shmloader

from ._cli import prog

MB = 1 << 20


class TinyRows(Dataset[torch.Tensor]):
    """Row i: ``width`` float32 values ``i * width .. i * width + width - 1``."""

    def __init__(self, rows: int, width: int) -> None:
        self.data = torch.arange(rows * width, dtype=torch.float32).reshape(rows, width)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


@dataclass(frozen=True)
class ProcSample:
    """One process at one moment."""

    role: str  # "main" or "worker K"
    pid: int
    rss: int
    fds: int


def sample(worker_pids: tuple[int, ...]) -> list[ProcSample]:
    procs = [("main", psutil.Process())]
    procs += [(f"worker {k}", psutil.Process(pid)) for k, pid in enumerate(worker_pids)]
    return [ProcSample(role, p.pid, p.memory_info().rss, p.num_fds()) for role, p in procs]


def growth_pct(before: int, after: int) -> float:
    return 100.0 * (after - before) / before if before else 0.0


def _table(samples: dict[str, list[ProcSample]]) -> str:
    warm, mid, end = samples["warm-up"], samples["half-way"], samples["end"]
    head = (
        f"{'process':<10} {'pid':>7} | {'RSS warm-up':>12} {'half-way':>10} {'end':>10} "
        f"{'growth':>8} | {'fds warm-up':>11} {'end':>5} {'growth':>6}"
    )
    lines = [head, "-" * len(head)]
    rows = list(zip(warm, mid, end, strict=True))
    total = (
        ProcSample("total", 0, sum(s.rss for s in warm), sum(s.fds for s in warm)),
        ProcSample("total", 0, sum(s.rss for s in mid), sum(s.fds for s in mid)),
        ProcSample("total", 0, sum(s.rss for s in end), sum(s.fds for s in end)),
    )
    for w, m, e in [*rows, total]:
        pid = str(w.pid) if w.pid else ""
        lines.append(
            f"{w.role:<10} {pid:>7} | {w.rss / MB:>9.1f} MiB {m.rss / MB:>7.1f} MiB "
            f"{e.rss / MB:>7.1f} MiB {growth_pct(w.rss, e.rss):>+7.2f}% | "
            f"{w.fds:>11} {e.fds:>5} {e.fds - w.fds:>+6}"
        )
    return "\n".join(lines)


def soak(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """Runs the soak; the report and the reasons it fails (empty when it passes)."""
    data = TinyRows(args.rows, args.width)
    loader = shmloader.DataLoader(
        data, batch_size=args.batch_size, num_workers=args.workers, persistent_workers=True
    )
    per_epoch = len(loader)
    warm_at = max(1, int(args.batches * args.warmup))
    mid_at = max(warm_at, args.batches // 2)
    samples: dict[str, list[ProcSample]] = {}
    done = epochs = wrong = 0
    start = time.monotonic()
    while done < args.batches:
        for j, batch in enumerate(loader):
            first = j * args.batch_size * args.width
            if batch[0, 0].item() != first or batch[-1, -1].item() != first + batch.numel() - 1:
                wrong += 1
            del batch
            done += 1
            if done == warm_at:
                samples["warm-up"] = sample(loader.stats().worker_pids)
            if done == mid_at:
                samples["half-way"] = sample(loader.stats().worker_pids)
        epochs += 1
    seconds = time.monotonic() - start
    gc.collect()
    st = loader.stats()
    samples["end"] = sample(st.worker_pids)

    failures = []
    for w, e in zip(samples["warm-up"], samples["end"], strict=True):
        g = growth_pct(w.rss, e.rss)
        if g > args.max_rss_growth:
            failures.append(
                f"RSS of {w.role} (pid {w.pid}) grew {g:+.2f}% from {w.rss:,} to {e.rss:,} bytes "
                f"(limit {args.max_rss_growth}%)"
            )
        if e.fds > w.fds:
            failures.append(f"open fds of {w.role} (pid {w.pid}) grew from {w.fds} to {e.fds}")
        if w.pid != e.pid:
            failures.append(f"{w.role} was replaced: pid {w.pid} at warm-up, {e.pid} at the end")
    if st.slots_free != st.slots_total:
        states = {} if st.arena is None else dict(st.arena.slots_by_state)
        failures.append(
            f"{st.slots_total - st.slots_free} of {st.slots_total} arena slots not free at the "
            f"end: {states}"
        )
    if st.batches_held:
        failures.append(f"{st.batches_held} batches still counted as held at the end")
    if wrong:
        failures.append(f"{wrong} batches held the wrong rows")
    report = {
        "batches": done,
        "epochs": epochs,
        "batches_per_epoch": per_epoch,
        "seconds": seconds,
        "batches_per_s": done / seconds,
        "warm_up_at_batch": warm_at,
        "samples": {k: [asdict(s) for s in v] for k, v in samples.items()},
        "arena": None if st.arena is None else asdict(st.arena),
        "failures": failures,
    }
    print(
        f"soak: {done:,} batches of {args.batch_size}x{args.width} float32 in {epochs} epochs "
        f"({per_epoch} batches each), {args.workers} persistent workers, "
        f"{seconds:.1f} s ({done / seconds:,.0f} batches/s); samples after batch {warm_at:,} "
        f"(warm-up), {mid_at:,} and {done:,}"
    )
    print(_table(samples))
    if st.arena is not None:
        print(
            f"arena at the end: {st.slots_free} of {st.slots_total} slots free, "
            f"{st.batches_held} batches held, slots by state {dict(st.arena.slots_by_state)}, "
            f"{st.arena.bytes_reserved:,} bytes reserved in {st.arena.slabs} slab(s)"
        )
    return report, failures


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {value}")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog(__package__, "soak"),
                                description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=_positive, default=200_000, help="batches to read (200000)")
    p.add_argument("--workers", type=_positive, default=2, help="num_workers (2)")
    p.add_argument("--batch-size", type=_positive, default=16, help="rows per batch (16)")
    p.add_argument("--width", type=_positive, default=8, help="float32 values per row (8)")
    p.add_argument("--rows", type=_positive, default=4096, help="rows in the dataset (4096)")
    p.add_argument("--warmup", type=_fraction, default=0.05,
                   help="fraction of the batches read before the first sample (0.05)")
    p.add_argument("--max-rss-growth", type=float, default=5.0, metavar="PERCENT",
                   help="RSS growth of any process, warm-up to end, that fails the run (5)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH",
                   help="also write the report as JSON to PATH")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report, failures = soak(args)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    if failures:
        print("soak FAILED:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    print("soak passed: no RSS growth over the limit, no fd growth, every slot free")
    return 0


if __name__ == "__main__":
    sys.exit(main())
