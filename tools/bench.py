"""Side-by-side benchmark: torch.utils.data.DataLoader against shmloader.DataLoader in one run.

Run from the repository root: ``python -m tools.bench [--workload image,tabular] [--loaders ...]``.
Installed (``pip install shmloader``), the same CLI is the command ``shmloader-bench``.

Method
------
- Same data, same order: every loader column gets the same workload (``tools._synthetic``):
  ``shuffle=True``, its batch size and collate, ``generator=torch.Generator().manual_seed(seed)``.
- One *run* builds a fresh loader (``persistent_workers=True`` when it has workers, unless
  ``--fresh-workers``), iterates one untimed warm-up epoch (starts the workers, faults memory in,
  measures bytes per batch), then timed epochs until ``--min-seconds`` (2 s) have passed (or one
  epoch of ``--max-batches``, whose ``iter()`` is made before the clock starts: the capped
  warm-up leaves batches in flight, which that ``iter()`` waits for and drops), then drops the
  loader and
  reaps every worker it started. One loader is alive at a time, so no column's memory numbers
  include another's.
- Runs alternate: each repeat runs every column once, in the same order (torch, shmloader, torch,
  shmloader, ...), so drift of the machine hits all columns alike. Reported: medians over
  ``--repeats``; peak footprint is the maximum.
- The timed loop reads one element of each batch's first tensor and drops the batch before asking
  for the next one.
- ``pinned`` (CUDA only; without CUDA it prints ``pinned: skipped: no CUDA`` and the other
  workloads run): the image dataset with ``pin_memory=True`` for every loader; the timed loop copies
  each batch with ``.to("cuda", non_blocking=True)`` and calls ``torch.cuda.synchronize()`` after
  every batch, so GB/s is host-to-device bytes. Its extra column ``shmloader+prefetch`` iterates
  ``shmloader.DevicePrefetcher(loader, "cuda")`` (copy on a side stream one batch ahead) and
  synchronizes after every batch the same way. An ``h2d-copy`` row gives the limit of that copy:
  ``copy_(non_blocking=True)`` + ``synchronize()`` of one pinned batch, median of several.
- Main CPU per batch = ``time.process_time()`` delta over the timed loop, divided by batches. It
  counts every other thread of the main process (pin-memory or receiver threads): the cost a
  training loop pays.
- Peak footprint = maximum, over samples taken every ``--pss-interval`` (50 ms) by a background
  thread, of the job's memory as ``tools.memprof`` counts its footprint: the private PSS
  (``Pss - Pss_Shmem`` of ``/proc/<pid>/smaps_rollup``) of the main process and its children,
  plus the shared memory they hold counted once, mapped or not (``/dev/shm``'s growth since
  before the loader was made, and memfds). A plain PSS sum would count shared memory only where
  a process maps it: torch's queued batches sit in ``/dev/shm`` unmapped, while shmloader's arena
  is mapped in every process, so the sum read 1.19x torch for a 1.01x footprint (review 66). It
  assumes no other job grows ``/dev/shm`` meanwhile. Sampled during a *memory pass* of its own:
  the same loader, right after the timed loop, whole epochs for at least 0.5 s, untimed. A
  sample costs milliseconds of kernel CPU (the kernel walks the page tables: about 10 ms for a
  main process and two workers here), so sampling during the timed loop took 10-15 % off a
  multi-process loader's rate on 2 cores (tabular, 2 workers, 3 alternated pairs: 3,725-3,889
  against 4,409-4,519 batches/s) and 2-4 % off ``torch-0``'s, whose single process leaves the
  sampler a core of its own. ``--pss-interval 0`` skips the memory pass (the peak footprint
  cells are then empty).
- Single-copy limit = ``torch.stack(samples, out=preallocated)`` of one batch in the main process
  on one thread (a zero-padded copy for ragged samples), median of several; ``% limit`` = loader
  rate / limit rate. The N-process limit (N = ``--workers``) is the aggregate rate of N forked
  processes each doing that copy into a private buffer at the same time for 1 s: what the
  machine's cores and memory bandwidth allow N copiers; ``% N-proc`` = loader rate / that rate.
  Each N-process limit runs once before each repeat's loader runs (alternated with them, as they
  are with each other) and is reported as the median of those runs; a loader above a limit is
  marked ``!`` (the limit met a busier machine than the loader: no ceiling in that run).
  ``N-process x2 buffers`` is the same with each process alternating between two buffers, as a
  loader must (one batch filled while the consumer holds another); where N buffers fit the
  last-level cache and 2N do not, the one-buffer limit is a cache rate no loader can reach, and
  ``% N-proc x2`` is the honest ceiling for ``torch.stack``'s copy. Where shmloader streams the
  batch (``shmloader.stacking.STREAM_MIN_BYTES`` or more, same-shape samples) an ``N-process x2
  streaming`` row gives the same with streaming stores, the copy shmloader's workers make where
  they measure it faster: ``% N-proc stream`` is then its ceiling (``SHMLOADER_STREAMING=0``
  turns streaming off, ``1`` always on).
- Worker CPU per batch = CPU seconds of the loader's worker processes over the timed loop,
  divided by batches: those alive, and those started and joined within it (``--fresh-workers``
  starts new ones every epoch; the kernel's count of reaped children covers them). It is read
  from ``/proc`` in clock ticks (10 ms), so runs shorter than the default 2 s read coarsely.
  ``bare`` is ``collate(dataset.__getitems__(indices))`` (``[dataset[i] for i in indices]``
  without it, as torch's fetcher does) in the main process
  (median of 50 batches, indices in shuffled order as the loaders get them): the part of a
  worker's time that is the dataset's and the collate's, so ``worker - bare`` is the loader's
  own overhead per batch (the ``null`` workload shows it alone). ``bare`` copies with
  ``torch.stack``; where shmloader's workers stream a large batch instead, their copy is the
  cheaper one, so ``worker - bare`` understates the overhead there and can be negative.
- ``N-process bare`` = the aggregate batches/s of N forked processes each running that bare loop
  at the same time for 1 s (each over one shuffled epoch of index lists made beforehand): what N
  workers could deliver if the loader cost nothing (no main process, no IPC, no bookkeeping).
  Its ``x torch-0`` cell (rate / ``torch-0``'s) is the ceiling of ``x torch-0`` for any N-worker
  loader on this machine; a CPU-bound workload (``tabular``, ``null``) is judged against it.

Columns are defined in ``tools._loaders``; timing loops, limits and reaping live in
``tools._measure``; workloads in ``tools._synthetic``; tables and files in ``tools._report``.

Invariant: no process started by a run outlives it. After the loader is dropped its new children
get ``REAP_TIMEOUT_S`` to exit, then are terminated and named on stderr. On Ctrl-C (or SIGTERM) the
current run is torn down the same way and the results so far are still printed and written.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from ._cli import prog
from ._loaders import (
    ALIASES,
    DEFAULT_LOADERS,
    EXTRA_COLUMNS,
    LOADERS,
    Column,
    resolve_columns,
)
from ._measure import (
    FootprintSampler,
    bare_fetch_collate_us,
    children,
    close,
    drain,
    h2d_limit,
    interrupt_on_sigterm,
    n_process_bare,
    n_process_limit,
    positive_int,
    reap,
    single_copy_limit,
    streams,
    to_device,
    touch,
    workers_cpu_seconds,
)
from ._procmem import read_shm
from ._report import (
    LoaderResult,
    Progress,
    RunSample,
    WorkloadResult,
    format_table,
    write_files,
)
from ._synthetic import WORKLOADS, Workload, WorkloadUnavailable, make_workload

SHM_DIR = "/dev/shm"


MIB = 1024 * 1024
MIN_TIMED_S = 2.0  # a timed run spans whole epochs until at least this long
PSS_PASS_S = 0.5  # the memory pass after it, whole epochs until at least this long


def run_once(
    column: Column, workload: Workload, args: argparse.Namespace, label: str, progress: Progress
) -> RunSample:
    """Build a loader, run the warm-up and the timed epoch, tear it down (module docstring)."""
    before = {p.pid for p in children()}
    shm_baseline = read_shm().used_bytes  # the footprint counts /dev/shm's growth from here
    extra: dict[str, Any] = {"pin_memory": True} if workload.pin_memory else {}
    if args.prefetch_factor is not None and column.num_workers:
        extra["prefetch_factor"] = args.prefetch_factor  # else: unchanged call, torch's default
    loader = column.factory(
        workload.dataset,
        batch_size=workload.batch_size,
        shuffle=True,
        num_workers=column.num_workers,
        collate_fn=workload.collate_fn,
        generator=torch.Generator().manual_seed(args.seed),
        persistent_workers=column.persistent,
        **extra,
    )
    source: Iterable[Any] = loader
    if column.device_prefetch and workload.device:
        from shmloader import DevicePrefetcher

        source = DevicePrefetcher(loader, workload.device)
    consume = to_device(workload.device) if workload.device else touch
    timed: Iterable[Any] | None = None
    try:
        progress.start(f"{label} (warm-up)")
        warm_batches, warm_bytes = drain(source, progress, consume=consume,
                                         limit=args.max_batches, count=True)
        progress.start(label)
        timed = source
        if args.max_batches:
            # The warm-up stopped mid-epoch: the next iter() waits for the batches still in
            # flight and drops them (torch's _reset: 80-190 ms on image, review 60), which no
            # whole-epoch run pays. It runs before the clock starts, for every loader.
            timed = iter(source)
        # Workers' CPU first: its scan of /proc is the bench's own work, not the main process's
        # (review 60: it was counted in main CPU per batch).
        wcpu0 = workers_cpu_seconds(before)
        cpu0 = time.process_time()
        batches, seconds = _drain_for(timed, progress, consume, args.max_batches, args.min_seconds)
        cpu = time.process_time() - cpu0
        worker_cpu = workers_cpu_seconds(before) - wcpu0
        progress.repeat_done(batches, seconds)
        # Peak footprint from a pass of its own, after the timed one: a sample costs
        # milliseconds of kernel CPU, which the timed loop's workers would lose (module
        # docstring).
        peak_bytes = 0
        if args.pss_interval > 0:
            progress.start(f"{label} (memory)")
            with FootprintSampler(args.pss_interval, shm_baseline) as memory:
                _drain_for(source, progress, consume, args.max_batches, PSS_PASS_S)
            peak_bytes = memory.peak_bytes
    except BaseException as exc:
        # The traceback's frames hold the loader and its iterator; free them so teardown can run.
        traceback.clear_frames(exc.__traceback__)
        raise
    finally:
        close(loader)
        del loader, source, timed  # (review 62: timed kept the loader alive through the reap)
        gc.collect()
        reap(before, label, progress)
    return RunSample(
        batches, seconds, cpu, peak_bytes / MIB, warm_bytes / max(warm_batches, 1), worker_cpu
    )


def _drain_for(
    source: Iterable[Any], progress: Progress, consume: Callable[[Any], None],
    max_batches: int | None, min_seconds: float,
) -> tuple[int, float]:
    """Whole epochs of ``source`` until ``min_seconds`` have passed (one epoch of
    ``max_batches`` with a cap): the batches and the seconds they took."""
    t0 = time.perf_counter()
    batches = 0
    while True:
        done, _ = drain(source, progress, consume=consume, limit=max_batches)
        batches += done
        if max_batches or time.perf_counter() - t0 >= min_seconds or not done:
            return batches, time.perf_counter() - t0


def bench_workload(
    name: str, columns: list[Column], args: argparse.Namespace, progress: Progress,
    results: list[WorkloadResult],
) -> None:
    """Append ``name``'s result to ``results``, then fill it in: Ctrl-C keeps what was done."""
    result = WorkloadResult(name)
    results.append(result)
    try:
        workload = make_workload(name, seed=args.seed, quick=args.quick, batch_size=args.batch_size)
    except WorkloadUnavailable as exc:
        result.skipped = str(exc)
        progress.note(f"{name}: skipped: {exc}")
        return
    result.description, result.samples = workload.description, workload.samples
    result.batch_size = workload.batch_size
    if any(c.name == "torch" for c in columns):
        extra = [n for n in EXTRA_COLUMNS.get(name, ()) if all(c.name != n for c in columns)]
        columns = columns + resolve_columns(extra, args.workers, args.fresh_workers, True, progress)
    columns = [c for c in columns if workload.device or not c.device_prefetch]
    progress.start(f"{name} | single-copy limit")
    result.limit_batches_per_s, result.limit_bytes_per_batch = single_copy_limit(workload)
    progress.start(f"{name} | bare fetch+collate")
    result.bare_us_per_batch = bare_fetch_collate_us(workload, seed=args.seed)
    if args.workers > 1 and not workload.device:
        progress.start(f"{name} | {args.workers}-process bare fetch+collate")
        result.nproc_bare_batches_per_s = n_process_bare(workload, args.workers, seed=args.seed)
    if workload.device:
        progress.start(f"{name} | H2D limit")
        result.h2d_limit_batches_per_s, _ = h2d_limit(workload, workload.device)
    rows = {c.name: LoaderResult(c.name, c.num_workers) for c in columns}
    result.loaders = list(rows.values())
    for repeat in range(args.repeats):
        if args.workers > 1 and not workload.device:
            _n_process_limits(workload, args.workers, result, f"{name} | repeat {repeat + 1}",
                              progress)  # fmt: skip
        for column in columns:
            label = f"{name} | {column.name} | repeat {repeat + 1}/{args.repeats}"
            rows[column.name].add(run_once(column, workload, args, label, progress))


def _n_process_limits(workload: Workload, n: int, result: WorkloadResult, label: str,
                      progress: Progress) -> None:
    """One run of each N-process limit, alternated with the loaders' runs like theirs; the
    result's limits are the medians of the runs so far (a Ctrl-C keeps what was done)."""
    result.nproc = n
    kinds = [("", result.nproc_limit_runs, {}),
             (", 2 buffers each", result.nproc2_limit_runs, {"buffers": 2})]
    if streams(workload):
        kinds.append((", 2 buffers, streaming", result.nproc_stream_limit_runs,
                      {"buffers": 2, "stream": True}))
    for what, runs, kw in kinds:
        progress.start(f"{label} | {n}-process limit{what}")
        runs.append(n_process_limit(workload, n, **kw))  # type: ignore[arg-type]
    result.nproc_limit_batches_per_s = statistics.median(result.nproc_limit_runs)
    result.nproc2_limit_batches_per_s = statistics.median(result.nproc2_limit_runs)
    if result.nproc_stream_limit_runs:
        result.nproc_stream_limit_batches_per_s = statistics.median(
            result.nproc_stream_limit_runs)


def _names(choices: Iterable[str], aliases: dict[str, str]) -> Callable[[str], list[str]]:
    allowed = set(choices)

    def parse(text: str) -> list[str]:
        names = [aliases.get(n.strip(), n.strip()) for n in text.split(",") if n.strip()]
        if "all" in names:
            return sorted(allowed, key=list(choices).index)
        unknown = [n for n in names if n not in allowed]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {', '.join(choices)}")
        return list(dict.fromkeys(names))

    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog(__package__, "bench"),
                                description=__doc__.split("\n")[0])
    p.add_argument("--workload", type=_names(WORKLOADS, {}), default="image,tabular",
                   help=f"comma list of {', '.join(WORKLOADS)} or 'all' (default: image,tabular);"
                   " pinned needs CUDA: pin_memory=True, each batch .to('cuda') + synchronize,"
                   " GB/s = H2D, plus a shmloader+prefetch (DevicePrefetcher) column")
    p.add_argument("--loaders", type=_names(LOADERS, ALIASES), default=None,
                   help=f"comma list of loader columns (default: {DEFAULT_LOADERS})")
    p.add_argument("--workers", type=int, default=2, help="num_workers of the loaders (default 2)")
    p.add_argument("--repeats", type=positive_int, default=None, help="timed epochs per loader (3)")
    p.add_argument("--max-batches", type=positive_int, default=None,
                   help="cap batches per epoch; each timed run is then one such epoch "
                        "(--min-seconds does not apply); as the warm-up ends mid-epoch, the "
                        "timed epoch's iter() is then made before the clock starts")
    p.add_argument("--batch-size", type=positive_int, default=None,
                   help="override every batch size")
    p.add_argument("--seed", type=int, default=0, help="data and sampler seed (default 0)")
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="results directory")
    p.add_argument("--quick", action="store_true", help="small sizes, 1 repeat: a smoke run")
    p.add_argument("--min-seconds", type=float, default=None,
                   help="time each run over whole epochs until this many seconds have passed "
                   "(default 2; 0 with --quick)")
    p.add_argument("--pss-interval", type=float, default=0.05, metavar="SECONDS",
                   help="memory (footprint) sampling period; 0 skips the memory pass "
                   "(default 0.05)")
    p.add_argument("--prefetch-factor", type=positive_int, default=None,
                   help="prefetch_factor of every loader with workers (default: torch's, 2)")
    p.add_argument("--fresh-workers", action="store_true",
                   help="persistent_workers=False: worker start-up is part of each timed epoch")
    args = p.parse_args(argv)
    if args.workers < 0:
        p.error(f"--workers must be >= 0, got {args.workers}")
    args.explicit_loaders = args.loaders is not None
    args.loaders = args.loaders or _names(LOADERS, ALIASES)(DEFAULT_LOADERS)
    args.repeats = args.repeats or (1 if args.quick else 3)
    if args.min_seconds is None:
        args.min_seconds = 0.0 if args.quick else MIN_TIMED_S
    return args


def _shm_entries() -> set[str]:
    try:
        return set(os.listdir(SHM_DIR))
    except FileNotFoundError:
        return set()


def _meta(args: argparse.Namespace, columns: list[Column], interrupted: bool) -> dict[str, Any]:
    versions = {c.name: getattr(sys.modules.get(c.factory.__module__.partition(".")[0]),
                                "__version__", None) for c in columns}
    return {
        "time_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv[1:], "python": platform.python_version(), "torch": torch.__version__,
        "platform": platform.platform(), "cpu_count": os.cpu_count(), "loader_versions": versions,
        "seed": args.seed, "workers": args.workers, "repeats": args.repeats, "quick": args.quick,
        "max_batches": args.max_batches, "fresh_workers": args.fresh_workers,
        "pss_interval_s": args.pss_interval, "pss_pass_s": PSS_PASS_S,
        "prefetch_factor": args.prefetch_factor,
        "interrupted": interrupted,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    interrupt_on_sigterm()
    progress = Progress()
    columns = resolve_columns(args.loaders, args.workers, args.fresh_workers,
                              args.explicit_loaders, progress)
    if not columns:
        progress.note("no loader available to benchmark")
        return 2
    shm_before = _shm_entries()
    results: list[WorkloadResult] = []
    interrupted = False
    try:
        for name in args.workload:
            bench_workload(name, columns, args, progress, results)
    except KeyboardInterrupt:
        interrupted = True
        progress.note("interrupted: reporting the repeats finished so far")
    progress.clear()
    print(format_table(results))
    paths = write_files(results, args.out, _meta(args, columns, interrupted))
    print(f"results written to {paths[0]} and {paths[1]}")
    left = sorted(_shm_entries() - shm_before)
    if left:
        progress.note(f"warning: {len(left)} {SHM_DIR} entries appeared during the run and are "
                      f"still there (they may belong to other processes): {left[:10]}")
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
