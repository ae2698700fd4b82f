"""Side-by-side benchmark: torch.utils.data.DataLoader against shmloader.DataLoader in one run.

Run from the repository root: ``python -m tools.bench [--workload image,tabular] [--loaders ...]``.

Method
------
- Same data, same order: every loader column gets the same workload (``tools._synthetic``):
  ``shuffle=True``, its batch size and collate, ``generator=torch.Generator().manual_seed(seed)``.
- One *run* builds a fresh loader (``persistent_workers=True`` when it has workers, unless
  ``--fresh-workers``), iterates one untimed warm-up epoch (starts the workers, faults memory in,
  measures bytes per batch), then one timed epoch (or ``--max-batches``), then drops the loader and
  reaps every worker it started. One loader is alive at a time, so no column's memory numbers
  include another's.
- Runs alternate: each repeat runs every column once, in the same order (torch, shmloader, torch,
  shmloader, ...), so drift of the machine hits all columns alike. Reported: medians over
  ``--repeats``; peak PSS is the maximum.
- The timed loop reads one element of each batch's first tensor and drops the batch before asking
  for the next one.
- Main CPU per batch = ``time.process_time()`` delta over the timed loop, minus the PSS sampler
  thread's own CPU time, divided by batches. It counts every other thread of the main process
  (pin-memory or receiver threads): the cost a training loop pays.
- Peak PSS = maximum, over samples taken every ``--pss-interval`` (50 ms) by a background thread,
  of the summed ``Pss:`` of ``/proc/<pid>/smaps_rollup`` of the main process and its children. A
  sample costs milliseconds of CPU (the kernel walks the page tables), about a tenth of a core at
  50 ms on a small machine; ``--pss-interval 0`` turns sampling off for pure throughput runs.
- Single-copy limit = ``torch.stack(samples, out=preallocated)`` of one batch in the main process
  on one thread (a zero-padded copy for ragged samples), median of several; ``% limit`` = loader
  rate / limit rate.

Invariant: no process started by a run outlives it. After the loader is dropped its new children
get ``REAP_TIMEOUT_S`` to exit, then are terminated and named on stderr. On Ctrl-C (or SIGTERM) the
current run is torn down the same way and the results so far are still printed and written.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import signal
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import psutil
import torch
import torch.utils.data

from tools._report import (
    LoaderResult,
    Progress,
    RunSample,
    WorkloadResult,
    format_table,
    write_files,
)
from tools._synthetic import WORKLOADS, Workload, WorkloadUnavailable, make_workload

REAP_TIMEOUT_S = 10.0
LIMIT_WARMUP = 2  # untimed copies before timing the single-copy limit
LIMIT_REPEATS = (5, 50)  # at least / at most this many timed copies ...
LIMIT_MIN_S = 0.5  # ... and keep copying until this much time has passed
SHM_DIR = "/dev/shm"
# Interpreter-wide helpers started by multiprocessing, not by a run: never reaped.
HELPER_PROCESSES = ("forkserver", "resource_tracker")

LoaderFactory = Callable[..., Iterable[Any]]


def _torch_loader() -> LoaderFactory:
    return torch.utils.data.DataLoader


def _shmloader_loader() -> LoaderFactory:
    import shmloader

    factory: LoaderFactory = shmloader.DataLoader
    return factory


def _spdl_loader() -> LoaderFactory:
    from spdl.dataloader import get_pytorch_dataloader

    factory: LoaderFactory = get_pytorch_dataloader
    return factory


@dataclass(frozen=True)
class LoaderSpec:
    """How to get one loader column; ``resolve`` imports lazily, ImportError = unavailable."""

    resolve: Callable[[], LoaderFactory]
    num_workers: int | None = None  # None: --workers
    persistent_ok: bool = True  # accepts persistent_workers=True
    optional: bool = False  # skipped silently when missing, unless asked for by name


LOADERS: dict[str, LoaderSpec] = {
    "torch": LoaderSpec(_torch_loader),
    "torch-0": LoaderSpec(_torch_loader, num_workers=0),
    "shmloader": LoaderSpec(_shmloader_loader),
    "spdl": LoaderSpec(_spdl_loader, persistent_ok=False, optional=True),
}
ALIASES = {"torch0": "torch-0"}
DEFAULT_LOADERS = "torch,shmloader,spdl"
# Columns a workload adds when "torch" is among the loaders: tabular's target is >= 1.5x torch-0.
EXTRA_COLUMNS: dict[str, tuple[str, ...]] = {"tabular": ("torch-0",)}


@dataclass(frozen=True)
class Column:
    name: str
    factory: LoaderFactory
    num_workers: int
    persistent: bool


def resolve_columns(
    names: list[str], workers: int, fresh_workers: bool, explicit: bool, progress: Progress
) -> list[Column]:
    columns = []
    for name in names:
        spec = LOADERS[name]
        try:
            factory = spec.resolve()
        except ImportError as exc:
            if explicit or not spec.optional:
                progress.note(f"skipped loader {name}: {exc}")
            continue
        n = workers if spec.num_workers is None else spec.num_workers
        columns.append(Column(name, factory, n, spec.persistent_ok and n > 0 and not fresh_workers))
    return columns


def _pss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1])
    except OSError:
        return 0
    return 0


class PssSampler:
    """Context manager: a thread tracking the peak summed PSS of this process and its children.

    ``__enter__`` returns once the first sample is taken; from then until the thread ends in
    ``__exit__`` it counts its own CPU time in ``cpu_seconds``, which the caller subtracts from the
    process's. (A running thread's CPU time reaches the process clock only at its next tick or
    switch, so it is read from inside the thread, and the process clock only after it has ended.)
    """

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s  # <= 0: no sampling, peak_kb stays 0
        self.peak_kb = 0
        self.cpu_seconds = 0.0
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-pss-sampler", daemon=True)

    def __enter__(self) -> PssSampler:
        if self.interval_s > 0:
            self._thread.start()
            self._ready.wait(timeout=REAP_TIMEOUT_S)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(timeout=REAP_TIMEOUT_S)

    def _sample(self, me: psutil.Process) -> None:
        pids = [me.pid, *(child.pid for child in me.children(recursive=True))]
        self.peak_kb = max(self.peak_kb, sum(_pss_kb(pid) for pid in pids))

    def _run(self) -> None:
        me = psutil.Process()
        self._sample(me)
        start = time.thread_time()
        self._ready.set()
        while not self._stop.wait(self.interval_s):
            self._sample(me)
        self.cpu_seconds = time.thread_time() - start


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors of a batch (tensor, or lists, tuples and dicts of them), depth first."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, list | tuple | dict):
        for item in obj.values() if isinstance(obj, dict) else obj:
            yield from _tensors(item)


def _touch(batch: Any) -> None:
    """Read one element, so the batch's first page is really mapped and readable."""
    tensor = next(_tensors(batch), None)
    if tensor is not None and tensor.numel():
        tensor[(0,) * tensor.dim()].item()


def _epoch(
    loader: Iterable[Any], limit: int | None, progress: Progress, count: bool
) -> tuple[int, int]:
    """Iterate one epoch (at most ``limit`` batches); returns batches and, if ``count``, bytes."""
    batches = nbytes = 0
    for batch in loader:
        if count:
            nbytes += sum(t.nbytes for t in _tensors(batch))
        _touch(batch)
        del batch
        batches += 1
        progress.tick(batches)
        if batches == limit:
            break
    return batches, nbytes


def _children() -> list[psutil.Process]:
    kids = []
    for child in psutil.Process().children(recursive=True):
        try:
            cmdline = " ".join(child.cmdline())
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            cmdline = ""
        if not any(helper in cmdline for helper in HELPER_PROCESSES):
            kids.append(child)
    return kids


def _reap(before: set[int], label: str, progress: Progress) -> None:
    """Wait for the children started since ``before`` to exit; terminate, then kill, stragglers."""
    new = [p for p in _children() if p.pid not in before]
    _, alive = psutil.wait_procs(new, timeout=REAP_TIMEOUT_S)
    if not alive:
        return
    progress.note(f"warning: {label}: {len(alive)} worker(s) still running "
                  f"{REAP_TIMEOUT_S:.0f} s after the loader was dropped: "
                  f"{[p.pid for p in alive]}; terminating them")
    for p in alive:
        p.terminate()
    _, alive = psutil.wait_procs(alive, timeout=REAP_TIMEOUT_S)
    for p in alive:
        p.kill()
    psutil.wait_procs(alive, timeout=REAP_TIMEOUT_S)


def run_once(
    column: Column, workload: Workload, args: argparse.Namespace, label: str, progress: Progress
) -> RunSample:
    """Build a loader, run the warm-up and the timed epoch, tear it down (module docstring)."""
    before = {p.pid for p in _children()}
    loader = column.factory(
        workload.dataset,
        batch_size=workload.batch_size,
        shuffle=True,
        num_workers=column.num_workers,
        collate_fn=workload.collate_fn,
        generator=torch.Generator().manual_seed(args.seed),
        persistent_workers=column.persistent,
    )
    try:
        progress.start(f"{label} (warm-up)")
        warm_batches, warm_bytes = _epoch(loader, args.max_batches, progress, count=True)
        progress.start(label)
        with PssSampler(args.pss_interval) as pss:
            cpu0 = time.process_time()
            t0 = time.perf_counter()
            batches, _ = _epoch(loader, args.max_batches, progress, count=False)
            seconds = time.perf_counter() - t0
        cpu = time.process_time() - cpu0 - pss.cpu_seconds
        progress.repeat_done(batches, seconds)
    except BaseException as exc:
        # The traceback's frames hold the loader and its iterator; free them so teardown can run.
        traceback.clear_frames(exc.__traceback__)
        raise
    finally:
        close = getattr(loader, "close", None)
        if callable(close):
            close()
        del loader
        gc.collect()
        _reap(before, label, progress)
    return RunSample(batches, seconds, cpu, pss.peak_kb / 1024, warm_bytes / max(warm_batches, 1))


def single_copy_limit(workload: Workload) -> tuple[float, int]:
    """Batches/s of copying one batch's samples into a preallocated batch, and its bytes."""
    count = min(workload.batch_size, workload.samples)
    tensors = [next(_tensors(workload.dataset[i])) for i in range(count)]
    shape = [max(t.shape[d] for t in tensors) for d in range(tensors[0].dim())]
    out = torch.zeros((len(tensors), *shape), dtype=tensors[0].dtype)
    same_shape = all(t.shape == tensors[0].shape for t in tensors)

    def copy() -> None:
        if same_shape:
            torch.stack(tensors, out=out)
            return
        for i, t in enumerate(tensors):
            out[i][tuple(slice(0, n) for n in t.shape)].copy_(t)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core, as a worker has; also immune to busy sibling cores
    try:
        for _ in range(LIMIT_WARMUP):
            copy()
        times: list[float] = []
        deadline = time.perf_counter() + LIMIT_MIN_S
        least, most = LIMIT_REPEATS
        while len(times) < least or (len(times) < most and time.perf_counter() < deadline):
            t0 = time.perf_counter()
            copy()
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return 1.0 / statistics.median(times), out.nbytes


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
    progress.start(f"{name} | single-copy limit")
    result.limit_batches_per_s, result.limit_bytes_per_batch = single_copy_limit(workload)
    rows = {c.name: LoaderResult(c.name, c.num_workers) for c in columns}
    result.loaders = list(rows.values())
    for repeat in range(args.repeats):
        for column in columns:
            label = f"{name} | {column.name} | repeat {repeat + 1}/{args.repeats}"
            rows[column.name].add(run_once(column, workload, args, label, progress))


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


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.bench", description=__doc__.split("\n")[0])
    p.add_argument("--workload", type=_names(WORKLOADS, {}), default="image,tabular",
                   help=f"comma list of {', '.join(WORKLOADS)} or 'all' (default: image,tabular)")
    p.add_argument("--loaders", type=_names(LOADERS, ALIASES), default=None,
                   help=f"comma list of loader columns (default: {DEFAULT_LOADERS})")
    p.add_argument("--workers", type=int, default=2, help="num_workers of the loaders (default 2)")
    p.add_argument("--repeats", type=_positive, default=None, help="timed epochs per loader (3)")
    p.add_argument("--max-batches", type=_positive, default=None, help="cap batches per epoch")
    p.add_argument("--batch-size", type=_positive, default=None, help="override every batch size")
    p.add_argument("--seed", type=int, default=0, help="data and sampler seed (default 0)")
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="results directory")
    p.add_argument("--quick", action="store_true", help="small sizes, 1 repeat: a smoke run")
    p.add_argument("--pss-interval", type=float, default=0.05, metavar="SECONDS",
                   help="PSS sampling period; 0 disables PSS sampling (default 0.05)")
    p.add_argument("--fresh-workers", action="store_true",
                   help="persistent_workers=False: worker start-up is part of each timed epoch")
    args = p.parse_args(argv)
    if args.workers < 0:
        p.error(f"--workers must be >= 0, got {args.workers}")
    args.explicit_loaders = args.loaders is not None
    args.loaders = args.loaders or _names(LOADERS, ALIASES)(DEFAULT_LOADERS)
    args.repeats = args.repeats or (1 if args.quick else 3)
    return args


_MAIN_PID = os.getpid()


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    """In the benchmark process, turn SIGTERM into the Ctrl-C path; forked children die as usual."""
    if os.getpid() != _MAIN_PID:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    raise KeyboardInterrupt


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
        "pss_interval_s": args.pss_interval,
        "interrupted": interrupted,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)
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
