"""Measurement helpers shared by the benchmarks: timed loops, copy limits, memory, child reaping.

- ``drain`` consumes batches from a loader (or an iterator over one) and counts them; ``touch``
  and ``to_device`` are the two ways a batch is consumed.
- ``n_process_limit`` runs N copiers at once (the memory limit); ``n_process_bare`` runs N bare
  fetch + collate loops at once (the CPU ceiling of N workers with no loader cost).
- ``single_copy_limit`` times ``torch.stack(samples, out=preallocated)`` of one batch on one
  thread; ``h2d_limit`` times the host-to-device copy of one pinned batch. Both report batches/s
  from the median of at least ``LIMIT_REPEATS[0]`` timed copies after ``LIMIT_WARMUP`` untimed ones.
- ``FootprintSampler`` tracks the peak memory footprint of this process and its children in a
  thread (memprof's footprint: private PSS plus shared memory counted once, unmapped included);
  the bench runs it in a pass of its own after the timed one, so its CPU is in no timed figure.
- ``workers_cpu_seconds`` reads the CPU of the children a run started, live or reaped.
- The bare loops fetch as the loaders' workers do (``__getitems__`` where the dataset has one)
  and freeze what they inherit, as shmloader's workers do; ragged samples are copied with their
  padding zeroed, as a padding collate writes them.
- ``reap`` makes sure no process a run started outlives it; ``interrupt_on_sigterm`` makes
  SIGTERM take the Ctrl-C path, so a killed benchmark still tears down and reports.

Invariant: every helper leaves torch's thread count, and the set of this process's children
(apart from ``HELPER_PROCESSES``), as it found them.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from types import FrameType, TracebackType
from typing import Any

import torch

from arena.stream import gather
from shmloader.stacking import STREAM_MIN_BYTES, STREAMING, streamable

try:
    import psutil
except ModuleNotFoundError as exc:  # the one package the tools add to shmloader's requirements
    raise ModuleNotFoundError(
        "the benchmark needs psutil, which the tools extra installs: "
        "pip install 'shmloader[tools]' (or pip install psutil)",
        name="psutil",
    ) from exc

from ._procmem import footprint, read_anon_shmem, read_mem, read_shm
from ._report import Progress
from ._synthetic import Workload

REAP_TIMEOUT_S = 10.0
LIMIT_WARMUP = 2  # untimed copies before timing a limit
LIMIT_REPEATS = (5, 50)  # at least / at most this many timed copies ...
LIMIT_MIN_S = 0.5  # ... and keep copying until this much time has passed
# Interpreter-wide helpers started by multiprocessing, not by a run: never reaped.
# Matched as the modules they run (``-c 'from multiprocessing.forkserver import main ...'``):
# a bare word would also match a worker whose inherited argv names it (an --out path).
HELPER_PROCESSES = ("multiprocessing.forkserver", "multiprocessing.resource_tracker")


# -- consuming batches ---------------------------------------------------------------------------


def tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors of a batch (tensor, or lists, tuples and dicts of them), depth first."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, list | tuple | dict):
        for item in obj.values() if isinstance(obj, dict) else obj:
            yield from tensors(item)


def touch(batch: Any) -> None:
    """Read one element, so the batch's first page is really mapped and readable."""
    tensor = next(tensors(batch), None)
    if tensor is not None and tensor.numel():
        tensor[(0,) * tensor.dim()].item()


def to_device(device: str) -> Callable[[Any], None]:
    """A consumer that copies every tensor of a batch to ``device`` (``non_blocking=True``) and
    then waits with ``torch.cuda.synchronize()``; tensors already there are not copied again."""

    def consume(batch: Any) -> None:
        moved = [t.to(device, non_blocking=True) for t in tensors(batch)]
        torch.cuda.synchronize()
        del moved

    return consume


def drain(
    batches: Iterable[Any],
    progress: Progress,
    *,
    consume: Callable[[Any], None] = touch,
    limit: int | None = None,
    min_seconds: float = 0.0,
    count: bool = False,
) -> tuple[int, int]:
    """Consume ``batches`` until they end, or until ``limit`` batches are done *and*
    ``min_seconds`` have passed. Returns the batches and, if ``count``, their summed bytes.
    Each batch is dropped before the next one is asked for."""
    done = nbytes = 0
    deadline = time.perf_counter() + min_seconds
    for batch in batches:
        if count:
            nbytes += sum(t.nbytes for t in tensors(batch))
        consume(batch)
        del batch
        done += 1
        progress.tick(done)
        if limit is not None and done >= limit and time.perf_counter() >= deadline:
            break
    return done, nbytes


# -- limits --------------------------------------------------------------------------------------


def _median_rate(copy: Callable[[], None]) -> float:
    """Batches/s of ``copy`` on one thread: 1 / median of its timed repeats."""
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
    return 1.0 / statistics.median(times)


def _batch_samples(workload: Workload) -> list[torch.Tensor]:
    count = min(workload.batch_size, workload.samples)
    return [next(tensors(workload.dataset[i])) for i in range(count)]


def single_copy_limit(workload: Workload) -> tuple[float, int]:
    """Batches/s of copying one batch's samples into a preallocated batch, and its bytes."""
    samples = _batch_samples(workload)
    shape = [max(t.shape[d] for t in samples) for d in range(samples[0].dim())]
    out = torch.zeros((len(samples), *shape), dtype=samples[0].dtype)
    same_shape = all(t.shape == samples[0].shape for t in samples)

    def copy() -> None:
        if same_shape:
            torch.stack(samples, out=out)
        else:
            _padded_copy(samples, out)

    return _median_rate(copy), out.nbytes


def _padded_copy(samples: list[torch.Tensor], out: torch.Tensor) -> None:
    """Copy ragged ``samples`` into ``out``, each into the corner of its row, and zero the
    padding beside it (what a padding collate writes, ``tools._synthetic.pad_collate``)."""
    for i, t in enumerate(samples):
        row = out[i]
        row[tuple(slice(0, n) for n in t.shape)].copy_(t)
        for d, n in enumerate(t.shape):
            if n < row.shape[d]:  # the band past the sample along d, within it before d
                band = [slice(0, t.shape[k]) for k in range(d)] + [slice(n, None)]
                row[tuple(band)].zero_()


def _stack_for(seconds: float, workload: Workload, buffers: int, stream: bool, start: Any,
               out_q: Any) -> None:
    """One process of :func:`n_process_limit`: stack batches into ``buffers`` private buffers in
    turn for ``seconds`` (with streaming stores if ``stream``)."""
    torch.set_num_threads(1)
    samples = _batch_samples(workload)
    shape = [max(t.shape[d] for t in samples) for d in range(samples[0].dim())]
    outs = [torch.zeros((len(samples), *shape), dtype=samples[0].dtype) for _ in range(buffers)]
    same = all(t.shape == samples[0].shape for t in samples)
    held = [t.contiguous() for t in samples]  # alive for as long as their addresses are used
    size, srcs = samples[0].nbytes, [t.data_ptr() for t in held]

    def copy(out: torch.Tensor) -> None:
        if same and stream:
            gather(out.data_ptr(), size, srcs)
        elif same:
            torch.stack(samples, out=out)
        else:  # the single-copy limit's padded copy (review 41: a memset was timed here)
            _padded_copy(samples, out)

    for out in outs:
        copy(out)
    start.wait()
    n, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds:
        copy(outs[n % buffers])
        n += 1
    out_q.put(n / elapsed)


def streams(workload: Workload) -> bool:
    """Whether shmloader's default collate may stream this workload's batch: its stack is at
    least ``STREAM_MIN_BYTES`` and ``shmloader.stacking.streamable`` admits its samples, on an
    install with streaming stores that are not turned off."""
    if not STREAMING or workload.collate_fn is not None:
        return False
    samples = _batch_samples(workload)
    if sum(t.nbytes for t in samples) < STREAM_MIN_BYTES:
        return False
    return streamable(samples, samples[0], torch.empty(0, dtype=samples[0].dtype))


def n_process_limit(
    workload: Workload, processes: int, seconds: float = 1.0, buffers: int = 1,
    stream: bool = False,
) -> float:
    """Aggregate batches/s of ``processes`` processes each stacking the workload's batch into
    private buffers at once: what the machine's cores and memory allow that many copiers.

    ``buffers=1`` reuses one buffer (the issue's definition of the limit); ``buffers=2``
    alternates between two, as any loader must (a worker fills one batch while the consumer
    holds another). Where ``processes`` buffers fit the last-level cache and twice as many do not
    (14 x 25 MB against a 300 MB L3, say) the first is a cache rate, the second a memory rate.
    ``stream=True`` copies with streaming stores (``arena.stream.gather``), as shmloader's
    collate does for a batch where :func:`streams` holds; ``torch.stack`` otherwise."""
    return _together(processes, seconds, _stack_for, (workload, buffers, stream))


def _together(processes: int, seconds: float, target: Callable[..., None],
              args: tuple[Any, ...]) -> float:
    """Start ``processes`` forked copies of ``target(seconds, *args, start, out_q)``, release
    them at once, and sum the rates they put on ``out_q``."""
    if processes < 1:
        return 0.0
    ctx = torch.multiprocessing.get_context("fork")
    start, out_q = ctx.Barrier(processes + 1), ctx.Queue()
    procs = [
        ctx.Process(target=target, args=(seconds, *args, start, out_q), daemon=True)
        for _ in range(processes)
    ]
    for p in procs:
        p.start()
    try:
        start.wait(timeout=60)
        rates = [out_q.get(timeout=seconds + 60) for _ in procs]
    finally:
        for p in procs:
            p.join(5)
            if p.exitcode is None:
                p.kill()
                p.join(5)
    return float(sum(rates))


def bare_fetch_collate_us(workload: Workload, batches: int = 50, seed: int = 0) -> float:
    """Microseconds per batch of ``collate([dataset[i] for i in indices])`` in this process: what
    a worker does for a batch besides the loader's own work (median of ``batches``). The indices
    come in shuffled order, as the loaders get them (``shuffle=True``): on ``tabular``, whose
    table is far larger than the caches, rows in order cost about a sixth less."""
    indices, fetch_collate = _bare_batch(workload, seed)
    times = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one intra-op thread, as in a worker of either loader
    try:
        for b in range(batches):
            idx = indices(b)
            t0 = time.process_time()
            fetch_collate(idx)
            times.append(time.process_time() - t0)
    finally:
        torch.set_num_threads(threads)
    return statistics.median(times) * 1e6


def _bare_batch(
    workload: Workload, seed: int
) -> tuple[Callable[[int], list[int]], Callable[[list[int]], None]]:
    """``(indices, fetch_collate)``: the ``b``-th batch's indices in a shuffled order, and
    ``collate([dataset[i] for i in indices])`` -- what a worker of either loader does for a
    batch given its indices, and nothing else."""
    collate = workload.collate_fn or torch.utils.data.default_collate
    dataset, size = workload.dataset, workload.batch_size
    n = len(dataset)  # type: ignore[arg-type]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()

    def indices(b: int) -> list[int]:
        return [order[(b * size + j) % n] for j in range(size)]

    getitems = getattr(dataset, "__getitems__", None)

    def fetch_collate(idx: list[int]) -> None:
        # As torch's fetcher (and both loaders' workers) fetch: __getitems__ where the dataset
        # has one (review 41: ArrowDataset's per-row path cost 20x its batched one).
        collate(getitems(idx) if getitems else [dataset[i] for i in idx])

    return indices, fetch_collate


def _bare_for(seconds: float, workload: Workload, seed: int, start: Any, out_q: Any) -> None:
    """One process of :func:`n_process_bare`: bare batches for ``seconds``; puts batches/s."""
    torch.set_num_threads(1)
    gc.freeze()  # what the fork inherited, as a shmloader worker does (review 41)
    indices, fetch_collate = _bare_batch(workload, seed)
    # One epoch of index lists, made before the clock starts (a worker is handed its indices).
    per_epoch = len(workload.dataset) // workload.batch_size  # type: ignore[arg-type]
    batches = [indices(b) for b in range(max(1, per_epoch))]
    first = os.getpid() % len(batches)  # each process its own place in the epoch, as workers
    fetch_collate(batches[first])
    start.wait()
    n, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds:
        fetch_collate(batches[(first + n) % len(batches)])
        n += 1
    out_q.put(n / elapsed)


def n_process_bare(workload: Workload, processes: int, seconds: float = 1.0,
                   seed: int = 0) -> float:
    """Aggregate batches/s of ``processes`` processes each running the bare fetch + collate loop
    (:func:`bare_fetch_collate_us`'s) at once: the most N workers could deliver with no loader
    cost at all -- no main process, no IPC, no slot bookkeeping. Divided by ``torch-0``'s rate it
    is the ceiling of ``x torch-0`` on this machine, for a CPU-bound workload."""
    return _together(processes, seconds, _bare_for, (workload, seed))


def workers_cpu_seconds(before: set[int]) -> float:
    """CPU seconds used so far by the children started since ``before`` (the pids then): those
    alive, plus every child this process has reaped (``RUSAGE_CHILDREN``). A difference of two
    readings covers workers that started, or exited and were joined, in between (a loader
    without persistent workers starts new ones every epoch: review 41 read 0 for them)."""
    reaped = os.times()
    live = [p for p in children() if p.pid not in before]
    return cpu_seconds(live) + reaped.children_user + reaped.children_system


def cpu_seconds(procs: list[psutil.Process]) -> float:
    """User + system CPU seconds used so far by ``procs`` (exited ones count as 0)."""
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


def h2d_limit(workload: Workload, device: str) -> tuple[float, int]:
    """Batches/s of ``copy_(non_blocking=True)`` + ``synchronize()`` of one pinned batch of the
    workload's first tensor to ``device``, and its bytes."""
    host = torch.stack(_batch_samples(workload)).pin_memory()
    dev = torch.empty_like(host, device=device)

    def copy() -> None:
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()

    return _median_rate(copy), host.nbytes


# -- memory --------------------------------------------------------------------------------------


class FootprintSampler:
    """Context manager: a thread tracking the peak footprint of this process and its children,
    as ``tools.memprof`` defines it (``tools._memrecord``): each process's private PSS (``Pss -
    Pss_Shmem``), plus the shared memory the tree holds counted once, mapped or not: the growth
    of ``/dev/shm`` since ``shm_baseline`` (read before the loader was made) and the memfds and
    other shared memory outside it (``tools._procmem.read_anon_shmem``). A plain PSS sum counts
    shared memory only where a process maps it: torch's queued batches, ``/dev/shm`` files no
    process has mapped yet, were left out, while shmloader's arena, mapped in every process,
    counted whole (review 66: 1.19x torch's PSS for a 1.01x footprint). Like memprof's, it
    assumes nothing else grows ``/dev/shm`` meanwhile. ``__enter__`` returns once the first
    sample is taken."""

    def __init__(self, interval_s: float, shm_baseline: int) -> None:
        self.interval_s = interval_s  # <= 0: no sampling, peak_bytes stays 0
        self.shm_baseline = shm_baseline
        self.peak_bytes = 0
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-memory-sampler",
                                        daemon=True)

    def __enter__(self) -> FootprintSampler:
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
        # (a process that exited since the list was made holds nothing: read_mem gives None)
        mems = [m for m in map(read_mem, pids) if m is not None]
        shared = max(0, read_shm().used_bytes - self.shm_baseline) + read_anon_shmem(pids)
        self.peak_bytes = max(self.peak_bytes, footprint(mems, shared))

    def _run(self) -> None:
        me = psutil.Process()
        self._sample(me)
        self._ready.set()
        while not self._stop.wait(self.interval_s):
            self._sample(me)


# -- processes -----------------------------------------------------------------------------------


def children() -> list[psutil.Process]:
    """This process's descendants, without the multiprocessing helpers."""
    kids = []
    for child in psutil.Process().children(recursive=True):
        try:
            cmdline = " ".join(child.cmdline())
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            cmdline = ""
        if not any(helper in cmdline for helper in HELPER_PROCESSES):
            kids.append(child)
    return kids


def close(loader: Any) -> None:
    """Call the loader's ``close()`` if it has one (torch's DataLoader has none)."""
    closer = getattr(loader, "close", None)
    if callable(closer):
        closer()


def reap(before: set[int], label: str, progress: Progress) -> None:
    """Wait for the children started since ``before`` to exit; terminate, then kill, stragglers."""
    new = [p for p in children() if p.pid not in before]
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


def interrupt_on_sigterm() -> None:
    """From now on SIGTERM raises KeyboardInterrupt in this process; forked children that inherit
    the handler die of the signal as usual."""
    main_pid = os.getpid()

    def handler(signum: int, frame: FrameType | None) -> None:
        if os.getpid() != main_pid:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value
