"""memprof: a loading job's memory over time — every process of its tree, /dev/shm, the arena.

    python -m tools.memprof --workload image --loader shmloader --workers 2 --out DIR
    python -m tools.memprof --workload image --compare --out DIR     # torch, then shmloader
    python -m tools.memprof --out DIR -- python train.py --epochs 1  # any command
    python -m tools.memprof --workload arrow --workers 8 --out DIR   # rows: mapped/NumPy/list
    ... --live                                   # slots by state and memory per process, live

Installed (``pip install shmloader``), the same CLI is the command ``shmloader-memprof``.

The job always runs in a child process (built-in workloads: ``python -m tools._memjob``, or
``shmloader_tools._memjob`` when installed) and this process only samples it: the profiler's own
interpreter, CSV rows and plotting stay out of the measured tree, and the sampler never competes
with the job's main loop for its GIL. Every
``--interval`` seconds it reads ``/proc/<pid>/smaps_rollup`` of each live process of the tree
(tools._procmem: definitions of RSS, PSS, USS), ``/dev/shm`` and the memfds (and other shared
memory outside ``/dev/shm``) the tree holds, each once; a built-in job also reports
``loader.stats()`` over a pipe; a user's command gets a pipe too (``SHMLOADER_STATS_FD``), over
which its shmloader loaders export their stats (shmloader/export.py).

Outputs in DIR: samples.csv, shm.csv, arena.csv, summary.json (tools._memrecord), timeline.png
(when matplotlib is installed); with ``--compare``, DIR/torch/ and DIR/shmloader/ hold one run each
and DIR/summary.json the two summaries with the ratios shmloader / torch.

``--workload arrow`` profiles the same rows (a file of just over 1 GiB, tools._memjob) held three
ways, one job each with ``--loader``: memory-mapped by ``ArrowDataset`` (arrow-file), read into
NumPy arrays (arrow-memory: an in-memory dataset of the same length) and into a Python list of
dicts (arrow-list). DIR/<job>/ holds each run, DIR/compare.png their total PSS over time and
DIR/summary.json the table: peak total PSS, its excess over arrow-memory (also as a fraction of
the file), and, just after the last batch, the tree's anonymous and file-backed PSS and the
workers' private dirty bytes (copy-on-read shows up there; a mapped file's page cache does not).
The file is written first (unmeasured) into the temp directory and removed at the end unless it
was there before or ``--keep-data`` is given.

Invariants: sampling stops when the command's process has exited and no process of its tree is
left (or ``--linger`` seconds after it exited; the survivors are listed, never killed). The exit
status is the command's (128 + signal if it was killed); 130 if memprof was interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import IO, Any

from ._cli import prog
from ._memlive import LiveView
from ._memrecord import MIB, Recording, format_summary, mib
from ._procmem import ProcessTree, ProcSample, read_anon_shmem, read_rows, read_shm

# The checkout's root, which a built-in job must import tools/ and shmloader/ from (None when
# installed: the job then imports the same installed packages as this process).
CHECKOUT = Path(__file__).resolve().parent.parent if __package__ == "tools" else None
# Built-in jobs (tools._memjob, which imports torch: never imported here, so the profiler stays
# small and starts fast).
JOB_WORKLOADS = ("image", "tabular", "cow", "cow-numpy", "arrow-file", "arrow-memory", "arrow-list")
ARROW_JOBS = ("arrow-file", "arrow-memory", "arrow-list")  # what --workload arrow runs, in order
LOADERS = ("torch", "shmloader")
# The environment shmloader reads to export loader stats (shmloader/export.py; not imported here,
# so the profiler itself never imports torch).
STATS_FD_ENV = "SHMLOADER_STATS_FD"
STATS_INTERVAL_ENV = "SHMLOADER_STATS_INTERVAL"
STATS_PIPE_ENV = "SHMLOADER_STATS_PIPE"
# --live: a loader whose latest row is older than this (intervals, plus seconds) is gone
LIVE_STALE_INTERVALS = 4
LIVE_STALE_S = 0.5
STOP_S = 10.0  # after an interrupt: how long the job gets to exit before SIGTERM, then SIGKILL


class CommandError(RuntimeError):
    """The command could not be started (not found, not executable)."""


def _job_command(args: argparse.Namespace, loader: str, report_fd: int) -> list[str]:
    cmd = [sys.executable, "-m", f"{__package__}._memjob", "--workload", args.workload,
           "--loader", loader, "--workers", str(args.workers), "--batches", str(args.batches),
           "--seed", str(args.seed), "--interval", str(args.interval), "--report-fd",
           str(report_fd), "--step-ms", str(args.step_ms)]
    return cmd + (["--quick"] if args.quick else [])


def _exit_status(code: int) -> int:
    return 128 - code if code < 0 else code


class _Reports:
    """Splits the job's report pipe into JSON lines and hands them to the recording."""

    def __init__(self, fd: int, rec: Recording) -> None:
        self.fd, self.rec, self.buf = fd, rec, b""
        self.latest_arena: dict[str, Any] | None = None
        os.set_blocking(fd, False)

    def drain(self) -> bool:
        """Read what is there; False at end of file."""
        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return True
            if not data:
                return False
            self.buf += data
            *lines, self.buf = self.buf.split(b"\n")
            for line in lines:
                try:
                    self.rec.add_report(json.loads(line))
                # not a row: bytes something else wrote into the pipe (not JSON, or JSON that
                # add_report refuses before recording anything)
                except (AttributeError, KeyError, OverflowError, TypeError, ValueError):
                    self.rec.unreadable_lines += 1
            # Every loader's latest row, summed (several loaders or processes): a loader that is
            # gone stops writing, and drops out once a few intervals have passed without a row.
            self.latest_arena = self.rec.live_arena(LIVE_STALE_INTERVALS * self.rec.interval_s
                                                    + LIVE_STALE_S)


def _stop(proc: subprocess.Popen[bytes], terminated: bool) -> None:
    """Stop the command after memprof was interrupted, each step with a bounded wait.

    A Ctrl-C reaches the whole foreground process group, so the command got its own SIGINT and
    is left to exit by itself first (a second SIGINT would break its cleanup); a SIGTERM was sent
    to memprof alone, so it is forwarded. Then SIGTERM, then SIGKILL."""
    steps = (signal.SIGTERM, signal.SIGKILL) if terminated else (None, signal.SIGTERM,
                                                                   signal.SIGKILL)
    for sig in steps:
        if proc.poll() is not None:
            return
        if sig is not None:
            proc.send_signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=STOP_S)


def _sample(tree: ProcessTree, rec: Recording, now: float, t: float) -> list[ProcSample]:
    """One tick's rows. The tree is scanned again after the reads: a process forked meanwhile
    already shares its parent's pages (and lowered the parent's PSS), so it is read too."""
    rows: list[ProcSample] = []
    seen: set[int] = set()
    for _ in range(2):
        members = [m for m in tree.refresh(now) if m.pid not in seen]
        rec.apply_roles(members)
        rows += read_rows(members, t)
        seen.update(m.pid for m in members)
    return rows


def profile(cmd: list[str], *, args: argparse.Namespace, label: str, out: Path,
            report: tuple[int, int] | None = None) -> tuple[dict[str, Any], bool]:
    """Run ``cmd`` and sample its tree until it is gone (module docstring); write the files into
    ``out``. ``report`` is the (read, write) pipe of a built-in job; a user's command gets one
    too, named by SHMLOADER_STATS_FD, over which its shmloader loaders export their stats.
    Returns the summary and whether memprof was interrupted."""
    out.mkdir(parents=True, exist_ok=True)
    view = LiveView(label) if args.live else None
    log: IO[bytes] | None = None
    if view is not None and view.tty:  # the job's output would tear the redrawn block
        log = open(out / "job.log", "wb")  # noqa: SIM115 - closed in finally
    env = dict(os.environ)
    if report is not None:  # a built-in job: it imports this package's _memjob
        if CHECKOUT is not None:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(CHECKOUT),
                                                             env.get("PYTHONPATH")]))
    else:  # a user's command: shmloader loaders in it export their stats over this pipe
        report = os.pipe()
        env[STATS_FD_ENV] = str(report[1])
        env[STATS_INTERVAL_ENV] = str(args.interval)
        # ... and which pipe it is: a process the job starts without passing the descriptor on
        # has another file under that number, which shmloader must not write to (review 69)
        pipe = os.fstat(report[1])
        env[STATS_PIPE_ENV] = f"{pipe.st_dev}:{pipe.st_ino}"
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=log,
                                pass_fds=(report[1],) if report else ())
    except OSError as exc:
        for fd in report or ():
            os.close(fd)
        if log is not None:
            log.close()
        raise CommandError(f"memprof: cannot run {cmd[0]!r}: {exc.strerror}") from exc
    tree = ProcessTree(proc.pid)
    rec = Recording(tree, t0, args.interval, cmd, label)
    reports = None
    if report is not None:
        os.close(report[1])
        reports = _Reports(report[0], rec)
    pidfd = os.pidfd_open(proc.pid)
    readers = [pidfd] + ([report[0]] if report else [])
    next_tick, exited_at, interrupted = t0, None, False
    cpu0 = time.process_time()
    try:
        while True:
            now = time.monotonic()
            if now >= next_tick:
                rows = _sample(tree, rec, now, round(now - t0, 4))
                shm, memfd = read_shm(), read_anon_shmem(r.pid for r in rows)
                rec.add_tick(rows, shm, memfd)
                if view is not None:
                    arena = None if reports is None else reports.latest_arena
                    view.update(now - t0, rows, shm, arena, force=exited_at is not None,
                                memfd_bytes=memfd)
                next_tick = max(next_tick + args.interval, now)
                if exited_at is not None and (not rows or now - exited_at >= args.linger):
                    rec.still_running = [r.pid for r in rows]
                    break
            ready, _, _ = select.select(readers, [], [], max(0.0, next_tick - time.monotonic()))
            if reports is not None and reports.fd in ready and not reports.drain():
                readers.remove(reports.fd)
            if pidfd in ready:
                proc.wait()
                exited_at = next_tick = time.monotonic()  # one more tick now, for the survivors
                readers.remove(pidfd)
    except KeyboardInterrupt as exc:
        interrupted = True
        _stop(proc, terminated=isinstance(exc, _Terminated))
    finally:
        if reports is not None:
            with contextlib.suppress(OSError):
                reports.drain()
            os.close(reports.fd)
        os.close(pidfd)
        if log is not None:
            log.close()
        if view is not None:
            view.close()
    rec.sampler_cpu_s = time.process_time() - cpu0
    rec.exit_code = _exit_status(proc.returncode) if proc.returncode is not None else None
    summary = rec.write(out)
    print(format_summary(summary), flush=True)
    if log is not None:
        print(f"   the job's output: {out / 'job.log'}")
    if not args.no_plot:
        from ._plot import render_timeline

        path = render_timeline(out, label)
        if path is not None:
            print(f"   timeline: {path}")
    return summary, interrupted


def profile_job(args: argparse.Namespace, loader: str, out: Path) -> tuple[dict[str, Any], bool]:
    r, w = os.pipe()
    label = f"{args.workload} / {loader} / {args.workers} workers"
    return profile(_job_command(args, loader, w), args=args, label=label, out=out, report=(r, w))


def compare_table(runs: dict[str, dict[str, Any]]) -> tuple[str, dict[str, float | None]]:
    """The side-by-side table of ``--compare`` and its ratios (shmloader / torch)."""
    def worker_peak(s: dict[str, Any]) -> int:
        return max((int(p["peak_pss"]) for p in s["processes"] if p["role"] != "main"), default=0)

    def main_peak(s: dict[str, Any]) -> int:
        return max((int(p["peak_pss"]) for p in s["processes"] if p["role"] == "main"), default=0)

    metrics: dict[str, Callable[[dict[str, Any]], int]] = {
        "peak total PSS": lambda s: int(s["peak_total_pss"]),
        "peak footprint": lambda s: int(s["peak_footprint"]),
        "peak total USS": lambda s: int(s["peak_total_uss"]),
        "peak PSS, main process": main_peak,
        "peak PSS, largest worker": worker_peak,
        "/dev/shm peak over start": lambda s: int(s["shm"]["peak_added_bytes"]),
    }
    torch_s, shm_s = runs["torch"], runs["shmloader"]
    lines = [f"{'MiB':<28}{'torch':>12}{'shmloader':>12}{'shmloader/torch':>17}"]
    ratios: dict[str, float | None] = {}
    for name, get in metrics.items():
        a, b = get(torch_s), get(shm_s)
        ratio = b / a if a >= MIB else None  # a ratio of near-zeros says nothing
        ratios[name] = ratio
        lines.append(f"{name:<28}{mib(a):>12}{mib(b):>12}"
                     f"{'n/a' if ratio is None else f'{ratio:.2f}':>17}")
    return "\n".join(lines), ratios


def run_compare(args: argparse.Namespace, out: Path) -> int:
    runs: dict[str, dict[str, Any]] = {}
    status = 0
    for loader in LOADERS:  # torch first, then shmloader, back to back
        summary, interrupted = profile_job(args, loader, out / loader)
        runs[loader] = summary
        status = status or summary["exit_code"] or 0
        if interrupted:
            return 130
    table, ratios = compare_table(runs)
    head = f"== compare: {args.workload}, {args.workers} workers"
    print(f"\n{head}\n{table}")
    print(f"peak total PSS ratio (shmloader / torch): {ratios['peak total PSS'] or 0:.2f}")
    result = {"workload": args.workload, "workers": args.workers, "quick": args.quick,
              "ratio_peak_total_pss": ratios["peak total PSS"], "ratios": ratios, "runs": runs}
    _write_summary(out, result, runs, head[3:], args.no_plot)
    return status


def arrow_table(runs: dict[str, dict[str, Any]], file_bytes: int) -> tuple[str, dict[str, Any]]:
    """The side-by-side table of ``--workload arrow`` and its numbers (module docstring)."""
    base = int(runs["arrow-memory"]["peak_total_pss"]) if "arrow-memory" in runs else 0
    lines = [f"{'MiB':<14}{'peak total PSS':>16}{'over memory':>13}{'/ file':>8}"
             f"{'|  at the end: anon':>20}{'file':>9}{'workers dirty':>15}"]
    table: dict[str, Any] = {"file_bytes": file_bytes}
    for name, s in runs.items():
        at_end = (s.get("job") or {}).get("at_end") or {}
        main, workers = at_end.get("main", {}), at_end.get("workers", {})
        anon = sum(int(d.get("Pss_Anon", 0)) for d in (main, workers))
        cached = sum(int(d.get("Pss_File", 0)) for d in (main, workers))
        dirty = int(workers.get("Private_Dirty", 0))
        total = int(s["peak_total_pss"])
        over = total - base
        table[name] = {"peak_total_pss": total, "over_memory": over,
                       "over_memory_per_file": over / file_bytes if file_bytes else None,
                       "end_pss_anon": anon, "end_pss_file": cached,
                       "end_workers_private_dirty": dirty, "at_end": at_end}
        lines.append(f"{name:<14}{mib(total):>16}{mib(over):>13}{over / file_bytes:>8.2f}"
                     f"{mib(anon):>20}{mib(cached):>9}{mib(dirty):>15}")
    return "\n".join(lines), table


def run_arrow(args: argparse.Namespace, out: Path) -> int:
    """``--workload arrow``: the ARROW_JOBS one after another, then the table and the plot."""
    prepare = [sys.executable, "-m", f"{__package__}._memjob", "--prepare", "--seed",
               str(args.seed)]
    env = dict(os.environ)
    if CHECKOUT is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(CHECKOUT), env.get("PYTHONPATH")]))
    created, path = subprocess.run(prepare + (["--quick"] if args.quick else []), env=env,
                                   check=True, capture_output=True, text=True).stdout.split(" ", 1)
    path = path.strip()
    runs: dict[str, dict[str, Any]] = {}
    status = 0
    try:
        file_bytes = os.path.getsize(path)
        for job in ARROW_JOBS:
            args.workload = job
            summary, interrupted = profile_job(args, args.loader, out / job)
            runs[job] = summary
            status = status or summary["exit_code"] or 0
            if interrupted:
                return 130
    finally:
        args.workload = "arrow"
        if created == "1" and not args.keep_data:
            with contextlib.suppress(OSError):
                os.unlink(path)
    table, numbers = arrow_table(runs, file_bytes)
    head = f"== arrow: the same rows three ways, {args.loader}, {args.workers} workers"
    print(f"\n{head}\n   file: {path}, {mib(file_bytes)} MiB\n{table}")
    result = {"workload": "arrow", "loader": args.loader, "workers": args.workers,
              "quick": args.quick, "file": path, **numbers, "runs": runs}
    _write_summary(out, result, runs, head[3:], args.no_plot)
    return status


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Options, and the command after ``--`` (empty for a built-in workload)."""
    command: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1 :]
    name = prog(__package__, "memprof")
    p = argparse.ArgumentParser(prog=name,
                                description="Profile a loading job's memory over time.",
                                epilog=f"usage with a command: {name} [OPTIONS] "
                                       "-- python train.py ...")
    p.add_argument("--workload", choices=(*JOB_WORKLOADS, "arrow"),
                   help="built-in job (cow: a Python list read by index under fork, "
                        "cow-numpy: the same records in NumPy arrays; arrow: the same rows "
                        "memory-mapped, in NumPy and in a Python list, side by side)")
    p.add_argument("--loader", choices=LOADERS, default="shmloader")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batches", type=int, default=0, help="batches to load (default: one epoch)")
    p.add_argument("--quick", action="store_true", help="small dataset sizes, for a smoke run")
    p.add_argument("--step-ms", type=float, default=0.0, metavar="MS",
                   help="simulated training step after each batch (a GPU-bound job's main "
                   "process is busy elsewhere; the loader's prefetch then fills up)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare", action="store_true",
                   help="run torch then shmloader on the workload; print the ratios")
    p.add_argument("--live", action="store_true", help="show memory and arena slots while running")
    p.add_argument("--interval", type=_positive_float, default=0.05, metavar="SECONDS",
                   help="sampling period (default 0.05)")
    p.add_argument("--linger", type=float, default=5.0, metavar="SECONDS",
                   help="after the command exits, follow its leftover processes this long")
    p.add_argument("--out", type=Path, default=Path("memprof-results"))
    p.add_argument("--no-plot", action="store_true", help="do not render PNG plots")
    p.add_argument("--keep-data", action="store_true",
                   help="--workload arrow: keep the data file it wrote in the temp directory")
    args = p.parse_args(argv)
    if bool(command) == bool(args.workload):
        p.error("give either --workload or a command after --, not both")
    if args.compare and not args.workload:
        p.error("--compare needs --workload")
    if args.compare and args.workload == "arrow":
        p.error("--workload arrow compares datasets under one --loader; drop --compare")
    if args.workers < 0:
        p.error(f"--workers must be >= 0, got {args.workers}")
    return args, command


class _Terminated(KeyboardInterrupt):
    """memprof got SIGTERM: stop the job (forwarding it) and write what was sampled."""


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise _Terminated


def main(argv: list[str] | None = None) -> int:
    args, command = parse_args(sys.argv[1:] if argv is None else argv)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        if args.compare:
            return run_compare(args, args.out)
        if args.workload == "arrow":
            return run_arrow(args, args.out)
        if command:
            summary, interrupted = profile(command, args=args, label=" ".join(command)[:60],
                                           out=args.out)
        else:
            summary, interrupted = profile_job(args, args.loader, args.out)
    except CommandError as exc:
        print(exc, file=sys.stderr)
        return 127
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 130 if interrupted else int(summary["exit_code"] or 0)


def _write_summary(
    out: Path, result: dict[str, Any], runs: dict[str, Any], labels: Any, no_plot: bool
) -> None:
    """``summary.json`` in ``out``, and the comparison plot of ``runs`` unless ``no_plot``."""
    (out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    if not no_plot:
        from ._plot import render_compare

        plot = render_compare(out, {k: out / k for k in runs}, labels)
        if plot is not None:
            print(f"comparison plot: {plot}")


if __name__ == "__main__":
    sys.exit(main())
