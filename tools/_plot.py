"""PNG rendering of memprof's CSV files; optional (matplotlib is imported only here, lazily).

Job: read a run directory's ``samples.csv``, ``shm.csv`` and ``arena.csv`` and draw
``timeline.png``: per-process PSS and the tree's total PSS, ``/dev/shm`` used bytes (and the
memfd bytes the tree holds), and the arena's bytes by slot state (every loader's together); or,
for ``--compare``, the total PSS of several runs on one axis.

Invariants: plotting reads only the files memprof wrote, so a plot can be redrawn later with
``python -m tools._plot DIR``; without matplotlib every function prints
``plot skipped: matplotlib not installed`` and returns None, and nothing else changes.
"""

from __future__ import annotations

import csv
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from ._memrecord import arena_timeline

MIB = 1024 * 1024
SKIPPED = "plot skipped: matplotlib not installed"
STATES = ("lent", "ready", "writing", "free")


def _pyplot() -> Any | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(SKIPPED)
        return None
    return plt


def _read(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _totals(samples: list[dict[str, str]]) -> tuple[list[float], list[float]]:
    by_t: defaultdict[float, int] = defaultdict(int)
    for row in samples:
        by_t[float(row["t"])] += int(row["pss"])
    ts = sorted(by_t)
    return ts, [by_t[t] / MIB for t in ts]


def arena_layers(arena: list[dict[str, str]]) -> tuple[list[float], list[list[float]]]:
    """The arena panel's data from ``arena.csv``'s rows: times, and MiB per slot state
    (``STATES``), every loader's together as the summary counts them (review 68: the raw rows of
    two loaders alternated between them, a sawtooth that never showed their sum)."""
    timeline = arena_timeline([
        {"t": float(r["t"]), "pid": int(r.get("pid") or 0), "loader": int(r.get("loader") or 0),
         **{f"bytes_{s}": int(r.get(f"bytes_{s}") or 0) for s in STATES}}
        for r in arena
    ])  # fmt: skip
    ts = [t for t, _, _ in timeline]
    return ts, [[row[f"bytes_{s}"] / MIB for _, row, _ in timeline] for s in STATES]


def render_timeline(run_dir: Path, title: str = "") -> Path | None:
    """Draw ``run_dir/timeline.png`` from the run's CSV files; returns its path."""
    plt = _pyplot()
    if plt is None:
        return None
    samples = _read(run_dir / "samples.csv")
    shm = _read(run_dir / "shm.csv")
    arena = _read(run_dir / "arena.csv")
    panels = 3 if arena else 2
    fig, axes = plt.subplots(panels, 1, figsize=(10, 2.6 * panels + 1), sharex=True)
    ax = axes[0]
    per_pid: defaultdict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for row in samples:
        ts, ys = per_pid[f"{row['pid']} {row['role']}"]
        ts.append(float(row["t"]))
        ys.append(int(row["pss"]) / MIB)
    for name, (ts, ys) in per_pid.items():
        ax.plot(ts, ys, linewidth=1, label=name)
    ax.plot(*_totals(samples), color="black", linewidth=2, label="total")
    ax.set_ylabel("PSS (MiB)")
    ax.legend(fontsize="small", ncol=3, loc="upper left")
    ax.set_title(title or run_dir.name)
    ax = axes[1]
    shm_t = [float(r["t"]) for r in shm]
    ax.plot(shm_t, [int(r["used_bytes"]) / MIB for r in shm], label="/dev/shm used")
    if any(int(r.get("memfd_bytes") or 0) for r in shm):  # older runs lack the column
        ax.plot(shm_t, [int(r.get("memfd_bytes") or 0) / MIB for r in shm], label="memfd")
        ax.legend(fontsize="small", loc="upper left")
    ax.set_ylabel("shared memory (MiB)")
    if arena:
        ax = axes[2]
        ax.stackplot(*arena_layers(arena), labels=STATES)
        ax.set_ylabel("arena (MiB)")
        ax.legend(fontsize="small", loc="upper left")
    axes[-1].set_xlabel("seconds since the job started")
    fig.tight_layout()
    path = run_dir / "timeline.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def render_compare(out: Path, runs: dict[str, Path], title: str = "") -> Path | None:
    """Draw ``out/compare.png``: the total PSS over time of each run in ``runs`` (label: dir)."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(10, 4))
    for label, run_dir in runs.items():
        ax.plot(*_totals(_read(run_dir / "samples.csv")), label=label)
    ax.set_xlabel("seconds since the job started")
    ax.set_ylabel("total PSS of the tree (MiB)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    path = out / "compare.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        done = render_timeline(Path(arg))
        if done is not None:
            print(done)
