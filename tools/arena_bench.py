"""Arena micro-benchmark: what a slot costs to get, to fill, and to fill compared with torch's way.

Run as ``python -m tools.arena_bench [--batch-bytes N] [--json PATH]``. Three measurements, each on
warm memory after a warm-up, with the garbage collector off while timing (as ``timeit`` does):

(a) **round trip** — ``ref = arena.acquire(batch_bytes); arena.release(ref)`` on an arena whose
    slab already exists. Each iteration is timed on its own with ``perf_counter_ns``; the table
    shows the median and the 99th percentile. Target: median <= 20 us.
(b) **write bandwidth** — one batch (``--batch-bytes``, default 32x3x512x512 = 25,165,824 bytes of
    random ``uint8``) copied with ``np.copyto`` into ``np.frombuffer(slot)`` versus into private
    memory of the same size that was already touched. Runs alternate between the two
    destinations (and which goes first), ``--runs`` of each; GB/s is ``batch_bytes / median``
    (1 GB = 1e9 bytes). Target: slot / private >= 0.9.
(c) **fresh mapping versus warm slot** — what torch's shared-memory collation pays per batch:
    ``shm_open`` + ``ftruncate`` + ``mmap`` *without* populate + ``shm_unlink``, the copy (which
    now page-faults and zero-fills every page), ``munmap``; versus ``acquire`` + the copy into a
    warm slot + ``release``. Alternated, ``--runs`` of each, medians in ms and their ratio. Only
    the writer's side is counted (torch's reader also maps and unmaps; this undercounts torch).

Results print as a table; ``--json PATH`` also writes every raw sample and the summary.
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import platform
import secrets
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import posix_ipc

from arena import Arena, Backend, SlotRef

from ._cli import prog

DEFAULT_BATCH_BYTES = 32 * 3 * 512 * 512  # one uint8 batch of 32 RGB 512x512 images
ROUND_TRIP_TARGET_US = 20.0
BANDWIDTH_TARGET_RATIO = 0.9


@dataclass(frozen=True)
class RoundTrip:
    """(a) acquire + release on a warm arena, in microseconds."""

    iterations: int
    median_us: float
    p99_us: float


@dataclass(frozen=True)
class Bandwidth:
    """(b) one batch copied into a warm slot versus warm private memory."""

    batch_bytes: int
    slot_s: list[float]
    private_s: list[float]

    @property
    def slot_gb_per_s(self) -> float:
        return self.batch_bytes / statistics.median(self.slot_s) / 1e9

    @property
    def private_gb_per_s(self) -> float:
        return self.batch_bytes / statistics.median(self.private_s) / 1e9

    @property
    def ratio(self) -> float:
        return self.slot_gb_per_s / self.private_gb_per_s


@dataclass(frozen=True)
class FreshVersusWarm:
    """(c) one batch written into a brand-new mapping versus into a warm slot."""

    fresh_s: list[float]
    warm_s: list[float]

    @property
    def fresh_ms(self) -> float:
        return statistics.median(self.fresh_s) * 1e3

    @property
    def warm_ms(self) -> float:
        return statistics.median(self.warm_s) * 1e3

    @property
    def ratio(self) -> float:
        return self.fresh_ms / self.warm_ms


@contextmanager
def gc_off() -> Iterator[None]:
    """Keep the cyclic collector out of the timed region, as ``timeit`` does."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def time_once(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def take(arena: Arena, nbytes: int) -> SlotRef:
    """A slot of ``nbytes`` from an arena sized for it; running dry is a bug in this tool."""
    ref = arena.acquire(nbytes)
    if ref is None:
        raise RuntimeError(f"arena {arena!r} has no free slot of {nbytes:,} bytes")
    return ref


def measure_round_trip(arena: Arena, nbytes: int, iterations: int, warmup: int) -> RoundTrip:
    """(a): per-iteration timings of acquire + release on a warm arena."""
    acquire, release, clock = arena.acquire, arena.release, time.perf_counter_ns
    samples = [0] * iterations
    for _ in range(warmup):
        release(take(arena, nbytes))
    with gc_off():
        for i in range(iterations):
            start = clock()
            ref = acquire(nbytes)
            if ref is not None:
                release(ref)
            samples[i] = clock() - start
            if ref is None:
                raise RuntimeError(f"arena {arena!r} ran dry during the round-trip loop")
    samples.sort()
    return RoundTrip(
        iterations=iterations,
        median_us=statistics.median(samples) / 1e3,
        p99_us=samples[min(iterations - 1, int(iterations * 0.99))] / 1e3,
    )


def measure_bandwidth(arena: Arena, src: np.ndarray, runs: int) -> Bandwidth:
    """(b): alternate copies of ``src`` into a warm slot and into warm private memory."""
    nbytes = src.nbytes
    ref = take(arena, nbytes)
    try:
        slot = np.frombuffer(arena.slot_buffer(ref), dtype=np.uint8, count=nbytes)
        private = np.empty(nbytes, dtype=np.uint8)
        private.fill(0)  # touch every page so both destinations start warm

        def into_slot() -> None:
            np.copyto(slot, src)

        def into_private() -> None:
            np.copyto(private, src)

        into_slot()
        into_private()
        slot_s: list[float] = []
        private_s: list[float] = []
        with gc_off():
            for run in range(runs):
                order = (into_slot, into_private) if run % 2 == 0 else (into_private, into_slot)
                for fn in order:
                    (slot_s if fn is into_slot else private_s).append(time_once(fn))
        if not np.array_equal(slot, src):
            raise RuntimeError("the slot does not hold the batch that was copied into it")
    finally:
        arena.release(ref)
    return Bandwidth(batch_bytes=nbytes, slot_s=slot_s, private_s=private_s)


def write_into_fresh_mapping(src: np.ndarray) -> None:
    """Torch's per-batch path (its ``file_descriptor`` sharing strategy): ``shm_open`` +
    ``ftruncate``, ``mmap`` without populate, ``shm_unlink`` at once (the name lives only while the
    segment is set up, as in torch's ``MapAllocator``), write, unmap."""
    name = f"/shmloader-bench-{os.getpid()}-{secrets.token_hex(4)}"
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=src.nbytes)
    try:
        mapping = mmap.mmap(shm.fd, src.nbytes)  # MAP_SHARED, no MAP_POPULATE
    finally:
        shm.unlink()
        shm.close_fd()
    dst = np.frombuffer(mapping, dtype=np.uint8)
    np.copyto(dst, src)  # every page faults in here and is zero-filled first
    del dst
    mapping.close()


def write_into_warm_slot(arena: Arena, src: np.ndarray) -> None:
    """The arena's per-batch path: take a warm slot, write, give it back."""
    ref = take(arena, src.nbytes)
    try:
        np.copyto(np.frombuffer(arena.slot_buffer(ref), dtype=np.uint8, count=src.nbytes), src)
    finally:
        arena.release(ref)


def measure_fresh_versus_warm(arena: Arena, src: np.ndarray, runs: int) -> FreshVersusWarm:
    """(c): alternate batches written into fresh mappings and into warm slots."""

    def fresh() -> None:
        write_into_fresh_mapping(src)

    def warm() -> None:
        write_into_warm_slot(arena, src)

    fresh()
    warm()
    fresh_s: list[float] = []
    warm_s: list[float] = []
    with gc_off():
        for run in range(runs):
            order = (fresh, warm) if run % 2 == 0 else (warm, fresh)
            for fn in order:
                (fresh_s if fn is fresh else warm_s).append(time_once(fn))
    return FreshVersusWarm(fresh_s=fresh_s, warm_s=warm_s)


def table(batch_bytes: int, backend: str, rt: RoundTrip, bw: Bandwidth, fw: FreshVersusWarm) -> str:
    rows = [
        ("acquire + release, median", f"{rt.median_us:.2f} us", f"<= {ROUND_TRIP_TARGET_US:g} us"),
        ("acquire + release, p99", f"{rt.p99_us:.2f} us", ""),
        ("copy into warm slot", f"{bw.slot_gb_per_s:.2f} GB/s", ""),
        ("copy into warm private memory", f"{bw.private_gb_per_s:.2f} GB/s", ""),
        ("slot / private", f"{bw.ratio:.3f}", f">= {BANDWIDTH_TARGET_RATIO:g}"),
        ("batch into fresh mapping (torch)", f"{fw.fresh_ms:.2f} ms", ""),
        ("batch into warm slot (arena)", f"{fw.warm_ms:.2f} ms", ""),
        ("fresh / warm", f"{fw.ratio:.2f}x", ""),
    ]
    width = max(len(r[0]) for r in rows)
    head = (
        f"arena micro-benchmark: batch {batch_bytes:,} bytes, backend {backend}, "
        f"{rt.iterations:,} round trips, {len(bw.slot_s)} runs per copy"
    )
    lines = [head, f"{'measure':<{width}}  {'value':>12}  target"]
    lines += [f"{name:<{width}}  {value:>12}  {target}" for name, value, target in rows]
    return "\n".join(lines)


def report(
    args: argparse.Namespace, backend: str, rt: RoundTrip, bw: Bandwidth, fw: FreshVersusWarm
) -> dict[str, Any]:
    """Everything measured, raw samples included, as one JSON-able dict."""
    return {
        "batch_bytes": args.batch_bytes,
        "backend": backend,
        "host": {
            "python": sys.version.split()[0],
            "numpy": np.__version__,
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
        },
        "round_trip": asdict(rt),
        "write": {
            "slot_gb_per_s": bw.slot_gb_per_s,
            "private_gb_per_s": bw.private_gb_per_s,
            "ratio": bw.ratio,
            "slot_s": bw.slot_s,
            "private_s": bw.private_s,
        },
        "fresh_vs_warm": {
            "fresh_ms": fw.fresh_ms,
            "warm_ms": fw.warm_ms,
            "ratio": fw.ratio,
            "fresh_s": fw.fresh_s,
            "warm_s": fw.warm_s,
        },
        "targets": {
            "round_trip_median_us_max": ROUND_TRIP_TARGET_US,
            "write_ratio_min": BANDWIDTH_TARGET_RATIO,
            "round_trip_met": rt.median_us <= ROUND_TRIP_TARGET_US,
            "write_ratio_met": bw.ratio >= BANDWIDTH_TARGET_RATIO,
        },
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=prog(__package__, "arena_bench"), description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--batch-bytes", type=int, default=DEFAULT_BATCH_BYTES, help="bytes per batch")
    p.add_argument("--iterations", type=int, default=100_000, help="timed round trips for (a)")
    p.add_argument("--warmup", type=int, default=10_000, help="untimed round trips before (a)")
    p.add_argument("--runs", type=int, default=15, help="timed copies per destination, (b), (c)")
    p.add_argument("--backend", choices=[b.value for b in Backend], default=Backend.AUTO.value)
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the results here")
    args = p.parse_args(argv)
    if args.batch_bytes <= 0:
        p.error(f"--batch-bytes must be positive, got {args.batch_bytes}")
    if args.iterations < 1 or args.warmup < 0:
        p.error("--iterations must be >= 1 and --warmup >= 0")
    if args.runs < 5:
        p.error(f"--runs must be >= 5 for a meaningful median, got {args.runs}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    src = np.random.default_rng(0).integers(0, 256, args.batch_bytes, dtype=np.uint8)
    # Room for the two slots (b) and (c) may hold at once, plus page rounding.
    cap = 4 * args.batch_bytes + 4 * mmap.PAGESIZE
    with closing(Arena(backend=args.backend, max_bytes=cap, slots_per_slab=2)) as arena:
        write_into_warm_slot(arena, src)  # creates the slab: everything after runs warm
        rt = measure_round_trip(arena, args.batch_bytes, args.iterations, args.warmup)
        bw = measure_bandwidth(arena, src, args.runs)
        fw = measure_fresh_versus_warm(arena, src, args.runs)
        backend = arena.stats().backend
    print(table(args.batch_bytes, backend, rt, bw, fw))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report(args, backend, rt, bw, fw), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
