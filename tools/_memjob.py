"""The loading job memprof profiles: build a workload's loader, iterate it, report its stats.

Run as ``python -m tools._memjob`` in a child process of memprof, so the profiler's own memory and
CPU stay out of the measured tree. It iterates one epoch (or ``--batches`` batches, starting new
epochs as needed), reading every page of every batch (as a training step copying it to a device
would), and writes JSON lines to the file descriptor ``--report-fd``:

- ``{"kind": "workers", "t", "pids": [...]}``   once per epoch, the worker pids in worker order
- ``{"kind": "arena", "t", <ArenaStats fields, flattened>, "batches_held", "pinned_bytes"}``
                                                 every ``--interval`` seconds (shmloader only)
- ``{"kind": "done", "t", "batches", "seconds", "description", "at_end"}``   once, at the end;
  ``at_end`` splits the memory of the main process and of the workers, read just after the last
  batch (workers still alive), into ``Pss_Anon``, ``Pss_File``, ``Pss_Shmem`` and
  ``Private_Dirty`` bytes: the page cache of a mapped file (``Pss_File``, clean and reclaimable)
  apart from copied-on-read Python objects (``Pss_Anon``, ``Private_Dirty``)

``t`` is ``time.monotonic()``, a system-wide clock, so memprof can line the rows up with its own.
Each line is written with one ``os.write`` of under ``PIPE_BUF`` bytes, so lines never interleave.

Workloads: ``image`` and ``tabular`` come from ``tools._synthetic``; ``cow`` and ``cow-numpy`` are
defined here: the same records (alternating Python ints and strings) held as one Python list, whose
every read writes a refcount and so copies pages into each forked worker (pytorch#13246), or held
as NumPy arrays, which reads never write.

The ``arrow-*`` workloads hold the same rows (``tools._synthetic`` ``pixels``: 3x32x32 uint8,
int64 label, string name; ``ARROW_ROWS`` of them, a file of just over 1 GiB) three ways, all
loaded under fork: ``arrow-file`` memory-maps the file (``ArrowDataset``), ``arrow-memory`` reads
it into NumPy arrays first (an in-memory dataset of the same length), ``arrow-list`` into a Python
list of dicts. ``--prepare`` writes the file (into the temp directory, reused while it exists),
prints ``1 PATH`` (written now) or ``0 PATH`` (reused) and exits, so writing it is never part of
a measured job.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.utils.data
from torch.utils.data import Dataset

from ._cli import prog
from ._measure import tensors
from ._synthetic import make_workload

PAGE = 4096
# cow workloads: (records, samples, batch size) for a full run and a --quick run
COW_SIZES = {False: (4_000_000, 2048, 64), True: (200_000, 256, 32)}
INT_BASE = 1_000_003  # record ints start above CPython's cached small ints
# arrow-* workloads: rows of the pixels table (about 3.1 KB each) for a full run and a --quick run
ARROW_ROWS = {False: 360_000, True: 20_000}
ARROW_BATCH = 256
ARROW_WORKLOADS = ("arrow-file", "arrow-memory", "arrow-list")


class CowListDataset(Dataset[tuple[torch.Tensor, int]]):
    """Records as one Python list; sample ``i`` reads records ``i, i + n, i + 2n, ...``.

    Reading a list item increments the item's refcount, a write to the page the object lives on,
    so a forked worker copies every page of records it reads: its USS grows toward the list's size.
    """

    def __init__(self, records: int, samples: int) -> None:
        self.samples = samples
        self.records: list[int | str] = [
            INT_BASE + i if i % 2 == 0 else f"record-{i:09d}" for i in range(records)
        ]

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        acc = 0
        for j in range(index, len(self.records), self.samples):
            item = self.records[j]
            acc += item if isinstance(item, int) else len(item)
        return torch.tensor([acc], dtype=torch.int64), index


class CowNumpyDataset(Dataset[tuple[torch.Tensor, int]]):
    """The same records as ``CowListDataset``, held as NumPy arrays: ints in one int64 array, the
    strings' lengths in another (strings as one bytes blob would read the same way). Reads write
    nothing, so forked workers keep sharing every page."""

    def __init__(self, records: int, samples: int) -> None:
        self.samples = samples
        index = np.arange(records, dtype=np.int64)
        self.ints = np.where(index % 2 == 0, INT_BASE + index, 0)
        self.lengths = np.where(index % 2 == 1, len("record-") + 9, 0)

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        every = slice(index, None, self.samples)
        acc = int(self.ints[every].sum() + self.lengths[every].sum())
        return torch.tensor([acc], dtype=torch.int64), index


class PixelsInMemory(Dataset[dict[str, Any]]):
    """The rows of a ``pixels`` Arrow file read into NumPy arrays (reads write nothing, so forked
    workers share every page); items equal ``ArrowDataset``'s for the same file."""

    def __init__(self, path: str) -> None:
        import pyarrow as pa

        # read, not mapped, through malloc (which gives freed batches back): only the copy stays
        malloc = pa.system_memory_pool()
        reader = pa.ipc.open_file(pa.OSFile(path, memory_pool=malloc), memory_pool=malloc)
        shape = reader.schema.field("pixels").type.shape
        rows = sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
        self.pixels = np.empty((rows, *shape), dtype=np.uint8)  # filled batch by batch: one copy
        self.labels = np.empty(rows, dtype=np.int64)
        names: list[str] = []
        start = 0
        for i in range(reader.num_record_batches):
            batch = reader.get_batch(i)
            stop = start + batch.num_rows
            pixels = batch.column("pixels").storage.flatten().to_numpy()
            self.pixels[start:stop] = pixels.reshape(-1, *shape)
            self.labels[start:stop] = batch.column("label").to_numpy()
            names += batch.column("name").to_pylist()
            start = stop
        self.names = np.array(names, dtype=np.bytes_)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"pixels": torch.from_numpy(self.pixels[index].copy()),
                "label": torch.tensor(self.labels[index]), "name": self.names[index].decode()}


def arrow_path(quick: bool, seed: int) -> tuple[str, bool]:
    """The arrow-* workloads' file, and whether this call wrote it."""
    from ._synthetic import arrow_file, arrow_file_path

    existed = os.path.exists(arrow_file_path("pixels", ARROW_ROWS[quick], seed))
    return arrow_file("pixels", ARROW_ROWS[quick], seed), not existed


@dataclass(frozen=True)
class JobWorkload:
    """What the job iterates: a dataset and how to batch it."""

    dataset: Dataset[Any]
    batch_size: int
    collate_fn: Callable[[list[Any]], Any] | None
    context: str | None  # multiprocessing start method; None = the loader's default
    description: str


def build(name: str, *, quick: bool, seed: int) -> JobWorkload:
    """The named workload at full or ``--quick`` size."""
    if name in ("cow", "cow-numpy"):
        records, samples, batch = COW_SIZES[quick]
        cls = CowListDataset if name == "cow" else CowNumpyDataset
        storage = "one Python list" if name == "cow" else "NumPy arrays"
        desc = f"{records:,} int/str records in {storage}, {samples} samples, fork"
        return JobWorkload(cls(records, samples), batch, None, "fork", desc)
    if name in ARROW_WORKLOADS:
        path, _ = arrow_path(quick, seed)
        mib = os.path.getsize(path) / 2**20
        if name == "arrow-file":
            from shmloader.arrow import ArrowDataset

            dataset: Dataset[Any] = ArrowDataset(path)
            storage = "ArrowDataset (memory-mapped)"
        elif name == "arrow-memory":
            dataset, storage = PixelsInMemory(path), "NumPy arrays (in memory)"
        else:
            from ._synthetic import PyRowsDataset

            dataset, storage = PyRowsDataset.from_arrow(path), "a Python list of dicts"
        rows = len(dataset)  # type: ignore[arg-type]
        desc = f"{rows:,} rows (3x32x32 uint8, int64, str) of a {mib:,.0f} MiB file in {storage}"
        return JobWorkload(dataset, ARROW_BATCH, None, "fork", f"{desc}, fork")
    w = make_workload(name, seed=seed, quick=quick)
    return JobWorkload(w.dataset, w.batch_size, w.collate_fn, None, w.description)


def make_loader(kind: str, work: JobWorkload, workers: int, seed: int) -> Any:
    """A torch or shmloader DataLoader over ``work`` with a seeded shuffle."""
    factory: Callable[..., Any] = torch.utils.data.DataLoader
    if kind == "shmloader":
        import shmloader

        factory = shmloader.DataLoader
    return factory(
        work.dataset,
        batch_size=work.batch_size,
        shuffle=True,
        num_workers=workers,
        collate_fn=work.collate_fn,
        multiprocessing_context=work.context if workers else None,
        generator=torch.Generator().manual_seed(seed),
    )


def consume(batch: Any) -> int:
    """Read one element per page of every tensor (so every page is mapped, as a copy to a device
    would map it); returns the batch's bytes."""
    nbytes = 0
    for t in tensors(batch):
        nbytes += t.nbytes
        if t.numel():
            step = max(1, PAGE // t.element_size())
            t.reshape(-1)[::step].sum()
    return nbytes


class Reporter:
    """Writes the JSON lines of the module docstring to one file descriptor."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._lock = threading.Lock()

    def send(self, kind: str, **fields: Any) -> None:
        line = json.dumps({"kind": kind, "t": time.monotonic(), **fields}) + "\n"
        with self._lock:
            os.write(self.fd, line.encode())


def arena_fields(loader: Any) -> dict[str, Any] | None:
    """``loader.stats()`` flattened to one row, or None while the loader has no slab (before
    its first multi-worker iteration, and always with ``num_workers=0``)."""
    stats = loader.stats()
    return stats.as_row() if stats.slabs else None


def _stats_loop(loader: Any, report: Reporter, interval: float, stop: threading.Event) -> None:
    while not stop.wait(interval):
        row = arena_fields(loader)
        if row is not None:
            report.send("arena", **row)


def worker_pids(loader: Any, it: Any) -> list[int]:
    """The worker pids of ``it``: shmloader's ``stats()``, or torch's private ``_workers``."""
    if hasattr(loader, "stats"):
        return list(loader.stats().worker_pids)
    return [p.pid for p in getattr(it, "_workers", [])]


ROLLUP_FIELDS = ("Pss_Anon", "Pss_File", "Pss_Shmem", "Private_Dirty")


def memory_split(main_pid: int, worker_pids: list[int]) -> dict[str, dict[str, int]]:
    """``{"main": {field: bytes}, "workers": {field: summed bytes}}`` for ``ROLLUP_FIELDS``."""
    out: dict[str, dict[str, int]] = {}
    for role, pids in (("main", [main_pid]), ("workers", worker_pids)):
        sums = dict.fromkeys(ROLLUP_FIELDS, 0)
        for pid in pids:
            try:
                with open(f"/proc/{pid}/smaps_rollup") as f:
                    for line in f:
                        name, _, rest = line.partition(":")
                        if name in sums:
                            sums[name] += int(rest.split()[0]) * 1024
            except OSError:  # the worker is gone
                continue
        out[role] = sums
    return out


def run(args: argparse.Namespace) -> None:
    work = build(args.workload, quick=args.quick, seed=args.seed)
    report = Reporter(args.report_fd)
    loader = make_loader(args.loader, work, args.workers, args.seed)
    target = args.batches or len(loader)
    stop = threading.Event()
    sampler = None
    if args.loader == "shmloader":
        sampler = threading.Thread(target=_stats_loop, args=(loader, report, args.interval, stop),
                                   name="memjob-stats", daemon=True)
        sampler.start()
    batches = 0
    at_end: dict[str, dict[str, int]] = {}
    t0 = time.perf_counter()
    try:
        while batches < target:
            it = iter(loader)
            report.send("workers", pids=worker_pids(loader, it))
            for batch in it:
                consume(batch)
                del batch
                if args.step_ms:  # a training step that keeps the main process busy elsewhere
                    stop.wait(args.step_ms / 1000)
                batches += 1
                if batches == target:
                    at_end = memory_split(os.getpid(), worker_pids(loader, it))
                    break
            del it
    finally:
        seconds = time.perf_counter() - t0
        stop.set()
        if sampler is not None:
            sampler.join(timeout=5.0)
            row = arena_fields(loader)
            if row is not None:
                report.send("arena", **row)
        del loader
        report.send("done", batches=batches, seconds=seconds, description=work.description,
                    at_end=at_end)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog(__package__, "_memjob"),
                                description=__doc__.split("\n")[0])
    p.add_argument("--prepare", action="store_true",
                   help="write the arrow-* workloads' file, print its path, exit")
    p.add_argument("--workload")  # memprof validated both names
    p.add_argument("--loader", choices=("torch", "shmloader"))
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batches", type=int, default=0, help="0: one epoch")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--interval", type=float, default=0.05)
    p.add_argument("--report-fd", type=int)
    p.add_argument("--step-ms", type=float, default=0.0)
    args = p.parse_args(argv)
    if not args.prepare and None in (args.workload, args.loader, args.report_fd):
        p.error("--workload, --loader and --report-fd are required (or --prepare)")
    return args


if __name__ == "__main__":
    args = parse_args()
    if args.prepare:
        path, created = arrow_path(args.quick, args.seed)
        print(f"{int(created)} {path}")
    else:
        run(args)
