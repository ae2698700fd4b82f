"""PNG rendering of ``tools.scaling`` results; optional (matplotlib is imported only here, lazily).

Job: read ``scaling.json`` and draw ``scaling_bytes.png`` (GB/s, batches/s and main-process CPU
per batch against batch bytes, log x) and ``scaling_workers.png`` (GB/s and CPU per batch against
workers). Each loader is a line through the medians with the per-repeat minimum and maximum as
error bars; the single-copy limit is a dashed line.

Invariants: plotting reads only the JSON the tool wrote, so a plot can be redrawn later with
``python -m tools._plot_scaling RESULTS_DIR [IMG_DIR]``; without matplotlib it prints
``plot skipped: matplotlib not installed`` and returns no paths.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from ._plot import _pyplot

MIB = 1024 * 1024
STYLE = {"torch": dict(color="tab:blue", marker="o"), "shmloader": dict(color="tab:orange",
                                                                        marker="s")}
LIMIT_STYLE = dict(color="gray", linestyle="--", marker="")


def _rates(loader: dict[str, Any], bytes_per_batch: float) -> dict[str, list[float]]:
    """Per-repeat batches/s, GB/s and CPU us per batch of one loader at one point."""
    pairs = zip(loader["batches_per_repeat"], loader["seconds"], loader["cpu_seconds"],
                strict=True)
    runs = [(n / s, c / n * 1e6) for n, s, c in pairs if n and s > 0]
    return {"batches_per_s": [r for r, _ in runs],
            "gb_per_s": [r * bytes_per_batch / 1e9 for r, _ in runs],
            "cpu_us_per_batch": [c for _, c in runs]}


def _series(points: list[dict[str, Any]], x_key: str, metric: str) -> dict[str, Any]:
    """For each loader: x values, medians (from the summaries) and min/max error bar lengths."""
    out: dict[str, Any] = {}
    for p in sorted(points, key=lambda p: p[x_key]):
        for lr in p["loaders"]:
            median = lr["summary"].get(metric)
            if median is None:
                continue
            bpb = lr["bytes_per_batch"] or p["batch_bytes"]
            runs = _rates(lr, bpb)[metric] or [median]
            xs, ys, lo, hi = out.setdefault(lr["loader"], ([], [], [], []))
            xs.append(p[x_key])
            ys.append(median)
            lo.append(max(median - min(runs), 0.0))
            hi.append(max(max(runs) - median, 0.0))
    return out


def _limit(points: list[dict[str, Any]], x_key: str, metric: str) -> tuple[list[Any], list[Any]]:
    ps = sorted(points, key=lambda p: p[x_key])
    key = {"batches_per_s": "limit_batches_per_s", "gb_per_s": "limit_gb_per_s"}[metric]
    return [p[x_key] for p in ps], [p[key] for p in ps]


def _panel(ax: Any, points: list[dict[str, Any]], x_key: str, metric: str, label: str) -> None:
    for name, (xs, ys, lo, hi) in _series(points, x_key, metric).items():
        ax.errorbar(xs, ys, yerr=[lo, hi], label=name, capsize=3, linewidth=1.5,
                    **STYLE.get(name, {}))
    if metric != "cpu_us_per_batch":
        ax.plot(*_limit(points, x_key, metric), label="single-copy limit (1 thread)",
                **LIMIT_STYLE)
    ax.set_ylabel(label)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")


def _bytes_axis(ax: Any, points: list[dict[str, Any]]) -> None:
    ax.set_xscale("log", base=2)
    sizes = sorted({p["batch_bytes"] for p in points})
    ax.set_xticks(sizes)
    ax.set_xticklabels([f"{s // MIB}M" if s >= MIB else f"{s // 1024}K" for s in sizes],
                       fontsize="small")
    ax.set_xlabel("batch bytes (16 samples per batch)")


def render(json_path: Path, img_dir: Path) -> list[Path]:
    """Draw the two PNGs of the results in ``json_path`` into ``img_dir``; returns their paths."""
    plt = _pyplot()
    if plt is None:
        return []
    data = json.loads(Path(json_path).read_text())
    img_dir.mkdir(parents=True, exist_ok=True)
    cpus = data["meta"].get("cpu_count")
    paths = []
    by_bytes = [p for p in data["points"] if p["sweep"] == "bytes"]
    if by_bytes:
        fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
        _panel(axes[0], by_bytes, "batch_bytes", "gb_per_s", "GB/s")
        axes[0].set_yscale("log")
        _panel(axes[1], by_bytes, "batch_bytes", "batches_per_s", "batches/s")
        axes[1].set_yscale("log")
        _panel(axes[2], by_bytes, "batch_bytes", "cpu_us_per_batch",
               "main-process CPU us per batch")
        axes[2].set_yscale("log")
        for ax in axes:
            _bytes_axis(ax, by_bytes)
        workers = by_bytes[0]["workers"]
        fig.suptitle(f"torch DataLoader vs shmloader as the batch grows ({workers} workers, "
                     f"{cpus} CPUs; prefetch_factor 1 from 64 MiB; medians, bars = min..max)")
        paths.append(_save(plt, fig, img_dir / "scaling_bytes.png"))
    by_workers = [p for p in data["points"] if p["sweep"] == "workers"]
    if by_workers:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
        _panel(axes[0], by_workers, "workers", "gb_per_s", "GB/s")
        ps = sorted(by_workers, key=lambda p: p["workers"])
        # Reference lines, in GB/s: a batches/s figure of each point times its bytes per batch.
        lines = (
            ("nproc_limit_batches_per_s", "N-process limit (N = workers)",
             {"color": "black", "linestyle": ":", "marker": "x"}),
            ("nproc2_limit_batches_per_s", "N-process limit, 2 buffers each",
             {"color": "black", "linestyle": "--", "marker": "+"}),
            ("nproc_stream_limit_batches_per_s", "the same, streaming stores",
             {"color": "tab:red", "linestyle": "--", "marker": "."}),
            ("main_ceiling_batches_per_s", "main-process ceiling (1 / CPU per batch)",
             {"color": "grey", "linestyle": "-."}),
        )  # fmt: skip
        for key, label, style in lines:
            xy = [(p["workers"], p[key] * p["limit_gb_per_s"] / p["limit_batches_per_s"])
                  for p in ps if p.get(key) and p["limit_batches_per_s"]]
            if xy:
                axes[0].plot(*zip(*xy, strict=True), label=label, **style)
        axes[0].legend(fontsize="small")
        _panel(axes[1], by_workers, "workers", "cpu_us_per_batch",
               "main-process CPU us per batch")
        for ax in axes:
            ax.set_xticks(sorted({p["workers"] for p in by_workers}))
            ax.set_xlabel("num_workers")
        size = by_workers[0]["batch_bytes"] // MIB
        fig.suptitle(f"torch DataLoader vs shmloader as workers are added ({size} MiB batches, "
                     f"{cpus} CPUs; medians, bars = min..max)")
        paths.append(_save(plt, fig, img_dir / "scaling_workers.png"))
    return paths


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


if __name__ == "__main__":
    results = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("bench-results/scaling")
    for done in render(results / "scaling.json", Path(sys.argv[2]) if len(sys.argv) > 2
                       else results):
        print(done)
