"""Benchmark results and how they are shown: progress line, stdout table, JSON and CSV files.

A ``LoaderResult`` holds one loader's per-repeat measurements on one workload and derives its
summary from them, so the table, the JSON and the CSV can never disagree:

- ``batches_per_s``  median over repeats of ``batches / wall seconds``
- ``gb_per_s``       ``bytes_per_batch * batches_per_s / 1e9``
- ``cpu_us``         median over repeats of main-process CPU seconds per batch, in microseconds
- ``worker_us``      the same for the loader's worker processes together; minus the workload's
                     ``bare_us_per_batch`` (fetch + collate in one process) it is the loader's
                     own worker overhead (a mean over the timed window minus a median of 50
                     batches: it also carries the fetch's spread above its median, alike for
                     every loader)
- ``pct_nproc_limit`` against the N-process limit (N copiers at once, N = workers, one buffer
                     each; median of one run before each repeat's loader runs);
                     ``pct_nproc2_limit`` against the same with two buffers each, the
                     most a loader (which must fill one batch while another is held) can reach
                     with torch.stack's copy; ``pct_nproc_stream_limit`` against the same with
                     streaming stores, the copy shmloader's workers use where they measure it faster
- ``nproc_bare_batches_per_s`` N processes each running the bare fetch + collate loop at once:
                     what N workers could deliver with no loader cost; its ``x torch-0`` cell
                     is the most any N-worker loader can reach against ``torch-0`` here
- ``peak_footprint_mb`` maximum over repeats of the peak footprint of the main process and its
                     children (private PSS plus shared memory counted once, mapped or not:
                     ``tools._measure.FootprintSampler``), in MiB (2**20 bytes)
- ratios             ``batches_per_s / other.batches_per_s``, a ratio of the two medians (not
                     a median of per-repeat ratios); ``pct_limit`` is against the single-copy
                     limit. A loader above a limit (over 100 %) is marked ``!`` in the table:
                     that limit's runs met a busier machine than the loader's, and it is no
                     ceiling in that run
"""

from __future__ import annotations

import csv
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

PROGRESS_INTERVAL_S = 0.1  # at most this often the TTY progress line is redrawn
SUMMARY_KEYS = ("batches_per_s", "gb_per_s", "x_torch", "x_torch0", "pct_limit",
                "pct_nproc_limit", "pct_nproc2_limit", "pct_nproc_stream_limit",
                "cpu_us_per_batch", "worker_us_per_batch", "worker_overhead_us",
                "peak_footprint_mb")


@dataclass(frozen=True)
class RunSample:
    """One timed epoch of one loader: what ``LoaderResult`` collects per repeat."""

    batches: int
    seconds: float
    cpu_seconds: float
    peak_footprint_mb: float
    bytes_per_batch: float
    worker_cpu_seconds: float = 0.0


@dataclass
class LoaderResult:
    """One loader column on one workload: configuration, raw per-repeat numbers, derived summary."""

    loader: str
    num_workers: int
    batches_per_repeat: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    cpu_seconds: list[float] = field(default_factory=list)
    peak_footprint_mb: list[float] = field(default_factory=list)
    worker_cpu_seconds: list[float] = field(default_factory=list)
    bytes_per_batch: float = 0.0

    def add(self, run: RunSample) -> None:
        self.worker_cpu_seconds.append(run.worker_cpu_seconds)
        self.batches_per_repeat.append(run.batches)
        self.seconds.append(run.seconds)
        self.cpu_seconds.append(run.cpu_seconds)
        self.peak_footprint_mb.append(run.peak_footprint_mb)
        self.bytes_per_batch = run.bytes_per_batch

    @property
    def batches_per_s(self) -> float:
        rates = [n / s for n, s in zip(self.batches_per_repeat, self.seconds, strict=True) if s > 0]
        return statistics.median(rates) if rates else 0.0

    @property
    def gb_per_s(self) -> float:
        return self.bytes_per_batch * self.batches_per_s / 1e9

    @property
    def cpu_us(self) -> float:
        per_batch = [
            c / n * 1e6 for n, c in zip(self.batches_per_repeat, self.cpu_seconds, strict=True) if n
        ]
        return statistics.median(per_batch) if per_batch else 0.0

    @property
    def worker_us(self) -> float:
        per_batch = [
            c / n * 1e6
            for n, c in zip(self.batches_per_repeat, self.worker_cpu_seconds, strict=True)
            if n
        ]
        return statistics.median(per_batch) if per_batch else 0.0

    @property
    def peak_footprint(self) -> float:
        return max(self.peak_footprint_mb, default=0.0)


@dataclass
class WorkloadResult:
    """All loader columns of one workload, plus the single-copy limit measured in the same run."""

    workload: str
    description: str = ""
    samples: int = 0
    batch_size: int = 0
    limit_batches_per_s: float = 0.0
    limit_bytes_per_batch: int = 0
    h2d_limit_batches_per_s: float = 0.0  # device workloads: pinned batch copy_ + synchronize
    nproc_limit_batches_per_s: float = 0.0  # N processes stacking privately at once
    nproc2_limit_batches_per_s: float = 0.0  # the same, each alternating between 2 buffers
    # the same as nproc2 with streaming stores (only where shmloader streams the batch)
    nproc_stream_limit_batches_per_s: float = 0.0
    nproc: int = 0
    # each N-process limit's runs, one before each repeat's loader runs; the rates above are
    # their medians (review 60: one 1-s run, taken before the loaders, moved 1.7x between runs)
    nproc_limit_runs: list[float] = field(default_factory=list)
    nproc2_limit_runs: list[float] = field(default_factory=list)
    nproc_stream_limit_runs: list[float] = field(default_factory=list)
    bare_us_per_batch: float = 0.0  # collate([ds[i] ...]) in one process
    nproc_bare_batches_per_s: float = 0.0  # N processes doing only that, at once
    loaders: list[LoaderResult] = field(default_factory=list)
    skipped: str = ""

    def column(self, name: str) -> LoaderResult | None:
        return next((r for r in self.loaders if r.loader == name and r.seconds), None)

    def summary(self, result: LoaderResult) -> dict[str, float | None]:
        def ratio(other: LoaderResult | None) -> float | None:
            if other is None or other.batches_per_s == 0:
                return None
            return result.batches_per_s / other.batches_per_s

        limit, nproc = self.limit_batches_per_s, self.nproc_limit_batches_per_s
        nproc2, nstream = self.nproc2_limit_batches_per_s, self.nproc_stream_limit_batches_per_s
        if not result.seconds:  # interrupted before its first repeat finished
            return dict.fromkeys(SUMMARY_KEYS)
        return {
            "batches_per_s": result.batches_per_s,
            "gb_per_s": result.gb_per_s,
            "x_torch": ratio(self.column("torch")),
            "x_torch0": ratio(self.column("torch-0")),
            "pct_limit": 100 * result.batches_per_s / limit if limit else None,
            "pct_nproc_limit": 100 * result.batches_per_s / nproc if nproc else None,
            "pct_nproc2_limit": 100 * result.batches_per_s / nproc2 if nproc2 else None,
            "pct_nproc_stream_limit": 100 * result.batches_per_s / nstream if nstream else None,
            "cpu_us_per_batch": result.cpu_us,
            "worker_us_per_batch": result.worker_us if result.num_workers else None,
            "worker_overhead_us": (
                result.worker_us - self.bare_us_per_batch if result.num_workers else None
            ),
            "peak_footprint_mb": result.peak_footprint or None,
        }


class Progress:
    """Progress on stderr: a redrawn ``\\r`` line on a TTY, else one line per timed repeat."""

    def __init__(self, stream: TextIO = sys.stderr) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.label = ""
        self.next_draw = 0.0

    def start(self, label: str) -> None:
        self.label = label
        self.next_draw = 0.0
        if self.tty:
            self.stream.write(f"\r\x1b[K{label} ...")
            self.stream.flush()

    def tick(self, batches: int) -> None:
        if not self.tty:
            return
        now = time.perf_counter()
        if now >= self.next_draw:
            self.next_draw = now + PROGRESS_INTERVAL_S
            self.stream.write(f"\r\x1b[K{self.label}: {batches} batches")
            self.stream.flush()

    def repeat_done(self, batches: int, seconds: float) -> None:
        rate = batches / seconds if seconds > 0 else 0.0
        line = f"{self.label}: {batches} batches in {seconds:.2f} s ({rate:,.1f} batches/s)"
        if self.tty:
            self.stream.write(f"\r\x1b[K{line}")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def note(self, message: str) -> None:
        """A line that stays: clears the progress line first on a TTY."""
        self.clear()
        self.stream.write(message + "\n")
        self.stream.flush()

    def clear(self) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _pct(value: float | None) -> str:
    """A percent-of-limit cell; ``!`` past 100 % (that limit is no ceiling in this run)."""
    return _fmt(value, ".1f", "%!" if value is not None and value > 100 else "%")


def format_table(results: list[WorkloadResult]) -> str:
    """The human table: one block per workload, the single-copy limit first, then each loader."""
    header = ("workload", "loader", "batches/s", "GB/s", "x torch", "x torch-0", "% limit",
              "% N-proc", "% N-proc x2", "% N-proc stream", "main CPU us/batch",
              "worker CPU us/batch", "peak footprint MiB")
    rows: list[tuple[str, ...]] = []
    notes: list[str] = []
    notes_above: list[str] = []

    def fixed(wr: WorkloadResult, label: str, rate: float, at: str | None = None,
              extra: dict[str, str] | None = None) -> tuple[str, ...]:
        """A limit's row: its rate and GB/s, 100% in its own column ``at``, and ``extra``
        cells by column name."""
        cells = dict.fromkeys(header, "")
        gb = f"{wr.limit_bytes_per_batch * rate / 1e9:.2f}" if rate else ""
        cells.update({"workload": wr.workload, "loader": label, "GB/s": gb,
                      "batches/s": f"{rate:,.1f}" if rate else ""})
        if at:
            cells[at] = "100%"
        cells.update(extra or {})
        return tuple(cells.values())

    for wr in results:
        if wr.skipped:
            notes.append(f"{wr.workload}: skipped: {wr.skipped}")
            continue
        n = wr.nproc
        rows.append(fixed(wr, "single-copy", wr.limit_batches_per_s, "% limit"))
        for label, rate, at in (
            (f"{n}-process", wr.nproc_limit_batches_per_s, "% N-proc"),
            (f"{n}-process x2 buffers", wr.nproc2_limit_batches_per_s, "% N-proc x2"),
            (f"{n}-process x2 streaming", wr.nproc_stream_limit_batches_per_s, "% N-proc stream"),
        ):
            if rate:
                rows.append(fixed(wr, label, rate, at))
        if wr.bare_us_per_batch:
            rows.append(fixed(wr, "bare fetch+collate", 0.0,
                              extra={"worker CPU us/batch": f"{wr.bare_us_per_batch:,.0f}"}))
        if wr.nproc_bare_batches_per_s:
            torch0 = wr.column("torch-0")
            ceiling = {}  # against torch-0: the most "x torch-0" can be
            if torch0 is not None and torch0.batches_per_s:
                ceiling["x torch-0"] = f"{wr.nproc_bare_batches_per_s / torch0.batches_per_s:.2f}"
            rows.append(fixed(wr, f"{n}-process bare", wr.nproc_bare_batches_per_s, extra=ceiling))
        if wr.h2d_limit_batches_per_s:
            rows.append(fixed(wr, "h2d-copy", wr.h2d_limit_batches_per_s))
        for lr in wr.loaders:
            s = wr.summary(lr)
            pcts = [_pct(s[k]) for k in ("pct_limit", "pct_nproc_limit", "pct_nproc2_limit",
                                         "pct_nproc_stream_limit")]  # fmt: skip
            if any(p.endswith("!") for p in pcts) and not notes_above:
                notes_above.append(
                    "! a loader above a limit measured in the same run: the limit's runs met a "
                    "busier machine than the loader's; it is no ceiling in this run"
                )
            rows.append((wr.workload, f"{lr.loader} ({lr.num_workers}w)",
                         _fmt(s["batches_per_s"], ",.1f"), _fmt(s["gb_per_s"], ".2f"),
                         _fmt(s["x_torch"], ".2f"), _fmt(s["x_torch0"], ".2f"), *pcts,
                         _fmt(s["cpu_us_per_batch"], ",.0f"),
                         _fmt(s["worker_us_per_batch"], ",.0f"),
                         _fmt(s["peak_footprint_mb"], ",.0f")))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = []
    for r in [header, *rows]:
        pairs = enumerate(zip(r, widths, strict=True))
        cells = [c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in pairs]
        lines.append("  ".join(cells).rstrip())
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines + notes_above + notes)


def write_files(results: list[WorkloadResult], out_dir: Path, meta: dict[str, Any]) -> list[Path]:
    """Write ``results.json`` (everything, raw repeats included) and ``results.csv`` (summaries)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    workloads = []
    csv_rows: list[dict[str, Any]] = []
    for wr in results:
        entry = asdict(wr)
        for raw, lr in zip(entry["loaders"], wr.loaders, strict=True):
            raw["summary"] = wr.summary(lr)
            csv_rows.append({"workload": wr.workload, "loader": lr.loader,
                             "num_workers": lr.num_workers, "batch_size": wr.batch_size,
                             "samples": wr.samples, "repeats": len(lr.seconds),
                             "bytes_per_batch": round(lr.bytes_per_batch),
                             "limit_batches_per_s": wr.limit_batches_per_s,
                             "h2d_limit_batches_per_s": wr.h2d_limit_batches_per_s or None,
                             **raw["summary"]})
        workloads.append(entry)
    json_path = out_dir / "results.json"
    json_path.write_text(json.dumps({"meta": meta, "workloads": workloads}, indent=2) + "\n")
    csv_path = out_dir / "results.csv"
    with csv_path.open("w", newline="") as f:
        fields = list(csv_rows[0]) if csv_rows else ["workload", "loader"]
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(csv_rows)
    return [json_path, csv_path]
