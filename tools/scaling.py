"""Scaling study: torch's DataLoader against shmloader as batches grow and as workers are added.

Run from the repository root: ``python -m tools.scaling [--quick] [--out DIR] [--img DIR]``.

Sweeps
------
- ``bytes``: one batch of 64 KiB, 128 KiB, ... 256 MiB (every power of two), 2 workers.
- ``workers``: 1, 2, 3, 4 workers at an 8 MiB batch. Each point also states the N-process limit
  (N processes each stacking the batch privately at once, N = workers: what the machine's cores
  and memory allow), the same with two buffers per process (what a loader, which fills one batch
  while another is held, can reach at most) and the main-process ceiling (1 / shmloader's main
  CPU per batch: the serial part no number of workers lifts).
- ``--quick``: 64 KiB, 1 MiB, 16 MiB; 1 and 2 workers; 1 repeat; shorter timed runs.

Data: ``BlobPoolDataset`` — ``BATCH_SIZE`` (16) flat uint8 samples of ``batch_bytes / 16`` bytes,
served from a pool of ``POOL`` distinct tensors without a copy, default collate (``torch.stack``),
``shuffle=True`` with a seeded generator. ``prefetch_factor`` is 2, and 1 for batches of
``BIG_BATCH`` (64 MiB) or more: with 2 in flight per worker, torch's fresh segments, the arena's
``prefetch_factor * workers + 1`` slots and the pool together would need several GB of RAM.

Method (as ``tools.bench``): for each point the single-copy limit is measured first
(``torch.stack(samples, out=)`` of one batch on one thread, median of several); then each repeat
runs torch, then shmloader. A run builds a fresh loader, takes one iterator, consumes
``prefetch_factor * workers + 2`` untimed warm-up batches (workers started, every arena slot used
once), then times batches until at least ``--min-batches`` (8) are done *and* ``--min-seconds``
(0.5 s) have passed; then the iterator and loader are dropped and every worker is reaped. The
dataset is long enough that no timed run reaches the end of the epoch. Each batch's first element
is read, and the batch dropped before the next is asked for. Reported per loader: medians over the
repeats of batches/s, GB/s (bytes per batch x batches/s) and main-process CPU microseconds per
batch (``time.process_time()`` over the timed loop / batches); ratios are from the same point.

Files: ``scaling.json`` (every raw repeat) and ``scaling.csv`` (one row per point and loader) in
``--out``; ``scaling_bytes.png`` and ``scaling_workers.png`` (``tools._plot_scaling``) in ``--img``
(default: ``--out``). Invariant, as in bench: no process started by a run outlives it; Ctrl-C or
SIGTERM tears the current run down and the points finished so far are still reported.
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from ._cli import prog
from ._loaders import LOADERS, LoaderFactory
from ._measure import (
    children,
    close,
    drain,
    interrupt_on_sigterm,
    n_process_limit,
    positive_int,
    reap,
    single_copy_limit,
    streams,
)
from ._report import LoaderResult, Progress, RunSample, WorkloadResult
from ._synthetic import BlobPoolDataset, Workload

KIB, MIB = 1024, 1024 * 1024
BATCH_SIZE = 16
POOL = 4  # distinct samples in the dataset's pool
BIG_BATCH = 64 * MIB  # from this batch size on, prefetch_factor = 1
SIZES = tuple(2**p for p in range(16, 29))  # 64 KiB .. 256 MiB
WORKERS = (1, 2, 3, 4)
WORKERS_BATCH = 8 * MIB
QUICK_SIZES = (64 * KIB, 1 * MIB, 16 * MIB)
QUICK_WORKERS = (1, 2)
SIZES_WORKERS = 2  # num_workers of the bytes sweep
LOADER_NAMES = ("torch", "shmloader")
# Timed batches can never outrun this many per second here (with margin); the dataset is made
# long enough for min_seconds at that rate, so no timed run reaches the end of its epoch.
MAX_RATE = 20_000


@dataclass
class Point:
    """One configuration of a sweep and what was measured at it."""

    sweep: str  # "bytes" or "workers"
    batch_bytes: int
    workers: int
    prefetch_factor: int
    batch_size: int = BATCH_SIZE
    warmup_batches: int = 0
    result: WorkloadResult = field(default_factory=lambda: WorkloadResult("blob"))

    @property
    def sample_bytes(self) -> int:
        return self.batch_bytes // self.batch_size

    def summary(self, loader: str) -> dict[str, float | None]:
        column = self.result.column(loader)
        return self.result.summary(column) if column else {}

    def as_dict(self) -> dict[str, Any]:
        res = self.result
        limit_gb = res.limit_bytes_per_batch * res.limit_batches_per_s / 1e9
        loaders = [{**asdict(lr), "summary": res.summary(lr)} for lr in res.loaders]
        return {"sweep": self.sweep, "batch_bytes": self.batch_bytes, "workers": self.workers,
                "prefetch_factor": self.prefetch_factor, "batch_size": self.batch_size,
                "sample_bytes": self.sample_bytes, "pool": POOL, "samples": res.samples,
                "warmup_batches": self.warmup_batches,
                "limit_batches_per_s": res.limit_batches_per_s, "limit_gb_per_s": limit_gb,
                "nproc_limit_batches_per_s": res.nproc_limit_batches_per_s or None,
                "nproc2_limit_batches_per_s": res.nproc2_limit_batches_per_s or None,
                "nproc_stream_limit_batches_per_s": res.nproc_stream_limit_batches_per_s or None,
                "main_ceiling_batches_per_s": self.main_ceiling(),
                "loaders": loaders}

    def main_ceiling(self) -> float | None:
        """Batches/s one main process could hand out at shmloader's measured main CPU per batch
        (1 / main CPU per batch): the serial part no worker count lifts."""
        us = self.summary("shmloader").get("cpu_us_per_batch")
        return 1e6 / us if us else None


def plan(quick: bool, sweeps: list[str], workers: tuple[int, ...] | None = None) -> list[Point]:
    points = []
    if "bytes" in sweeps:
        for size in QUICK_SIZES if quick else SIZES:
            points.append(Point("bytes", size, SIZES_WORKERS, 1 if size >= BIG_BATCH else 2))
    if "workers" in sweeps:
        for n in workers or (QUICK_WORKERS if quick else WORKERS):
            points.append(Point("workers", WORKERS_BATCH, n, 2))
    return points


def run_once(
    factory: LoaderFactory, dataset: BlobPoolDataset, point: Point, args: argparse.Namespace,
    label: str, progress: Progress,
) -> RunSample:
    """One loader's run at ``point``: warm-up, timed batches, teardown (module docstring)."""
    before = {p.pid for p in children()}
    loader = factory(dataset, batch_size=point.batch_size, shuffle=True,
                     num_workers=point.workers, prefetch_factor=point.prefetch_factor,
                     generator=torch.Generator().manual_seed(args.seed))
    batches = iter(loader)
    try:
        progress.start(f"{label} (warm-up)")
        warm, warm_bytes = drain(batches, progress, limit=point.warmup_batches, count=True)
        progress.start(label)
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        n, _ = drain(batches, progress, limit=args.min_batches, min_seconds=args.min_seconds)
        seconds = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        progress.repeat_done(n, seconds)
    except BaseException as exc:
        traceback.clear_frames(exc.__traceback__)  # its frames hold the iterator
        raise
    finally:
        del batches
        close(loader)
        del loader
        gc.collect()
        reap(before, label, progress)
    return RunSample(n, seconds, cpu, 0.0, warm_bytes / max(warm, 1))


def measure(point: Point, args: argparse.Namespace, progress: Progress) -> None:
    """Fill in ``point.result``: the limit, then the alternated runs of every loader."""
    name = f"{point.sweep} {_size(point.batch_bytes)} {point.workers}w"
    dataset = BlobPoolDataset(point.batch_size, point.sample_bytes, args.seed, POOL)
    progress.start(f"{name} | single-copy limit")
    res = point.result
    res.limit_batches_per_s, res.limit_bytes_per_batch = single_copy_limit(
        Workload("blob", dataset, point.batch_size, None, ""))
    if point.sweep == "workers":
        progress.start(f"{name} | {point.workers}-process limit")
        blob = Workload("blob", dataset, point.batch_size, None, "")
        res.nproc_limit_batches_per_s = n_process_limit(blob, point.workers)
        progress.start(f"{name} | {point.workers}-process limit, 2 buffers each")
        res.nproc2_limit_batches_per_s = n_process_limit(blob, point.workers, buffers=2)
        if streams(blob):
            progress.start(f"{name} | {point.workers}-process limit, 2 buffers, streaming")
            res.nproc_stream_limit_batches_per_s = n_process_limit(
                blob, point.workers, buffers=2, stream=True)
        res.nproc = point.workers
    point.warmup_batches = point.prefetch_factor * point.workers + 2
    rate = min(MAX_RATE, 2 * point.workers * res.limit_batches_per_s)
    timed = max(args.min_batches, math.ceil(2 * rate * args.min_seconds))
    dataset.n = point.batch_size * (point.warmup_batches + timed)  # sized once, before any run
    res.samples, res.batch_size = dataset.n, point.batch_size
    rows = {n: LoaderResult(n, point.workers) for n in LOADER_NAMES}
    res.loaders = list(rows.values())
    factories = {n: LOADERS[n].resolve() for n in LOADER_NAMES}
    for repeat in range(args.repeats):
        for loader in LOADER_NAMES:
            label = f"{name} | {loader} | repeat {repeat + 1}/{args.repeats}"
            rows[loader].add(run_once(factories[loader], dataset, point, args, label, progress))


# -- output ----------------------------------------------------------------------------------------


def _size(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes >= MIB else f"{nbytes // KIB} KiB"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else f"{value:{spec}}"


def format_tables(points: list[Point]) -> str:
    header = ("sweep", "batch", "workers", "pf", "limit GB/s", "N-proc GB/s", "N-proc x2 GB/s",
              "N-proc stream GB/s", "main ceil b/s",
              "torch b/s", "torch GB/s", "torch us/b",
              "shm b/s", "shm GB/s", "shm us/b", "x torch", "% limit", "% N-proc", "% N-proc x2",
              "% N-proc stream")
    rows: list[tuple[str, ...]] = []
    for p in points:
        t, s = p.summary("torch"), p.summary("shmloader")
        if not t or not s:
            continue
        res = p.result
        limit_gb = res.limit_bytes_per_batch * res.limit_batches_per_s / 1e9
        nproc_gb = res.limit_bytes_per_batch * res.nproc_limit_batches_per_s / 1e9
        nproc2_gb = res.limit_bytes_per_batch * res.nproc2_limit_batches_per_s / 1e9
        stream_gb = res.limit_bytes_per_batch * res.nproc_stream_limit_batches_per_s / 1e9
        ceiling = p.main_ceiling()
        rows.append((p.sweep, _size(p.batch_bytes), str(p.workers), str(p.prefetch_factor),
                     f"{limit_gb:.2f}", f"{nproc_gb:.2f}" if nproc_gb else "-",
                     f"{nproc2_gb:.2f}" if nproc2_gb else "-",
                     f"{stream_gb:.2f}" if stream_gb else "-",
                     _fmt(ceiling, ",.0f"),
                     _fmt(t["batches_per_s"], ",.1f"), _fmt(t["gb_per_s"], ".2f"),
                     _fmt(t["cpu_us_per_batch"], ",.0f"),
                     _fmt(s["batches_per_s"], ",.1f"), _fmt(s["gb_per_s"], ".2f"),
                     _fmt(s["cpu_us_per_batch"], ",.0f"),
                     _fmt(s["x_torch"], ".2f"), _fmt(s["pct_limit"], ".0f"),
                     _fmt(s["pct_nproc_limit"], ".0f"), _fmt(s["pct_nproc2_limit"], ".0f"),
                     _fmt(s["pct_nproc_stream_limit"], ".0f")))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip()
             for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_files(points: list[Point], out: Path, meta: dict[str, Any]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    entries = [p.as_dict() for p in points if p.result.loaders]
    json_path = out / "scaling.json"
    json_path.write_text(json.dumps({"meta": meta, "points": entries}, indent=2) + "\n")
    csv_path = out / "scaling.csv"
    keys = ("sweep", "batch_bytes", "workers", "prefetch_factor", "batch_size",
            "limit_batches_per_s", "limit_gb_per_s")
    with csv_path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([*keys, "loader", "repeats", "batches_per_s", "gb_per_s",
                         "cpu_us_per_batch", "x_torch", "pct_limit"])
        for e in entries:
            for lr in e["loaders"]:
                s = lr["summary"]
                writer.writerow([*(e[k] for k in keys), lr["loader"], len(lr["seconds"]),
                                 s["batches_per_s"], s["gb_per_s"], s["cpu_us_per_batch"],
                                 s["x_torch"], s["pct_limit"]])
    return [json_path, csv_path]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog(__package__, "scaling"),
                                description=__doc__.split("\n")[0])
    p.add_argument("--sweep", choices=("bytes", "workers", "both"), default="both",
                   help="batch bytes 64 KiB..256 MiB at 2 workers, workers 1..4 at 8 MiB, or both")
    p.add_argument("--quick", action="store_true",
                   help="3 sizes, 2 worker counts, 1 repeat, 0.2 s timed runs: a smoke run")
    p.add_argument("--repeats", type=positive_int, default=None, help="runs per loader (3)")
    p.add_argument("--min-seconds", type=float, default=None,
                   help="timed part of a run lasts at least this long (0.5; --quick 0.2)")
    p.add_argument("--min-batches", type=positive_int, default=8,
                   help="... and has at least this many batches (8)")
    p.add_argument("--workers", type=_worker_counts, default=None,
                   help="comma list of worker counts for the workers sweep (default 1,2,3,4; "
                   "e.g. 1,2,4,8,14 on a many-core machine)")
    p.add_argument("--seed", type=int, default=0, help="data and sampler seed (default 0)")
    p.add_argument("--out", type=Path, default=Path("bench-results/scaling"),
                   help="results directory (default bench-results/scaling)")
    p.add_argument("--img", type=Path, default=None, help="where the PNGs go (default: --out)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNGs")
    args = p.parse_args(argv)
    args.sweeps = ["bytes", "workers"] if args.sweep == "both" else [args.sweep]
    args.repeats = args.repeats or (1 if args.quick else 3)
    if args.min_seconds is None:
        args.min_seconds = 0.2 if args.quick else 0.5
    args.img = args.img or args.out
    return args


def _commit() -> str | None:
    """The checkout's git commit (with ``+dirty`` if shmloader/ or arena/ have local changes)."""
    repo = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, text=True,
                              capture_output=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "shmloader", "arena"], cwd=repo,
                               text=True, capture_output=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty.strip() else "")


def _meta(args: argparse.Namespace, interrupted: bool) -> dict[str, Any]:
    return {
        "time_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv[1:], "python": platform.python_version(), "torch": torch.__version__,
        "commit": _commit(), "platform": platform.platform(),
        "cpu_count": os.cpu_count(), "seed": args.seed, "repeats": args.repeats,
        "quick": args.quick, "min_seconds": args.min_seconds, "min_batches": args.min_batches,
        "batch_size": BATCH_SIZE, "pool": POOL, "big_batch_prefetch_1_from": BIG_BATCH,
        "interrupted": interrupted,
    }


def _worker_counts(text: str) -> tuple[int, ...]:
    """argparse type of --workers: a comma list of worker counts, each >= 1 (review 41: 0
    ended in torch's traceback, 'x' in a ValueError's)."""
    try:
        return tuple(positive_int(n) for n in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a comma list of worker counts >= 1, e.g. 1,2,4; got {text!r}"
        ) from None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    interrupt_on_sigterm()
    progress = Progress()
    workers = args.workers
    points = plan(args.quick, args.sweeps, workers)
    interrupted = False
    try:
        for point in points:
            measure(point, args, progress)
    except KeyboardInterrupt:
        interrupted = True
        progress.note("interrupted: reporting the points finished so far")
    progress.clear()
    print(format_tables(points))
    print(f"prefetch_factor (pf) is 1 for batches >= {_size(BIG_BATCH)} (RAM); "
          f"us/b = main-process CPU microseconds per batch; % limit = shmloader / single-copy; "
          f"N-proc = N processes copying at once (N = workers); main ceil = 1 / shm us/b")
    paths = write_files(points, args.out, _meta(args, interrupted))
    print(f"results written to {paths[0]} and {paths[1]}")
    if not args.no_plot:
        from ._plot_scaling import render

        for path in render(paths[0], args.img):
            print(f"plot written to {path}")
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
