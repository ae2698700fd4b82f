"""One profiled run's record: the rows memprof sampled, their summary, and the files written.

``Recording`` collects three time series while a job runs (``t`` in seconds since the job started):
- samples: one ``ProcSample`` per live process of the tree per tick;
- shm: ``/dev/shm`` used bytes and entries per tick, and the bytes of shared memory outside
  ``/dev/shm`` (memfds, shared anonymous mappings, SysV segments) the tree holds, each object once
  (``tools._procmem.read_anon_shmem``);
- arena: the rows the job reported from ``loader.stats()`` (shmloader only), each from one loader:
  ``(pid, loader)`` names it (``shmloader.export``; a built-in job's rows have neither: one
  loader).

Invariants:
- ``peak_total_pss`` is the largest, over ticks, of the PSS summed over the processes alive at
  that tick; it is never smaller than any single process's peak PSS.
- ``footprint`` at a tick is ``sum(pss - pss_shmem) + max(0, shm_growth) + memfd``: the private
  part of every process, plus every shared-memory byte the job holds counted once, wherever it
  lives: ``shm_growth`` is the growth of ``/dev/shm`` used bytes since the start (posix shared
  memory, mapped or not), ``memfd`` the bytes of the objects outside ``/dev/shm`` the tree holds
  at that tick. Both are counted per object, not per mapping, so shared pages no process has
  mapped (batches queued between processes) are in, and a page is never counted twice even when
  the processes were read a few milliseconds apart, which the plain PSS sum cannot promise (see
  docs/memory.md). It assumes nothing else grows ``/dev/shm`` meanwhile; shared memory the job
  only maps from elsewhere (a ``/dev/shm`` file that existed before it started, a file on
  another tmpfs) is left out.
- The arena summary is the job's, whatever the number of loaders and processes: at each row's
  time, the latest row of every loader live then (from its first row to its last) are combined,
  amounts summed (``combine``); its peaks are those of the combined rows, and ``per_loader``
  gives each loader's own. A loader stops writing rows when it is gone, so a finished loader's
  memory is not carried past its last row.
- A process's role is the one it has when the files are written (workers are named by the job
  after their first sample), so every row of one pid carries the same role.
- Files are written once, at the end, from the same rows the summary is computed from, so the
  table, summary.json and the CSVs never disagree.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import astuple, dataclass, field, fields
from pathlib import Path
from typing import Any

from ._procmem import Member, ProcessTree, ProcSample, ShmUsage, footprint

MIB = 1024 * 1024
SAMPLE_COLUMNS = tuple(f.name for f in fields(ProcSample))
SHM_COLUMNS = ("t", "used_bytes", "entries", "memfd_bytes")
# arena.csv's first columns; every other field of the rows (LoaderStats.as_row) follows them.
ARENA_COLUMNS = (
    "t", "backend", "bytes_reserved", "bytes_in_use", "high_water_bytes", "max_bytes",
    "growth_events", "slabs", "slot_sizes", "slots_total", "slots_free", "slots_writing",
    "slots_ready", "slots_lent", "bytes_free", "bytes_writing", "bytes_ready", "bytes_lent",
    "batches_held", "pinned_bytes",
)
# Bytes a loader holds beside its arena's reserved count, whose peaks the summary reports.
# (``bytes_kept`` is not one: kept slots are lent slots, inside ``bytes_reserved``.)
OUTSIDE_ARENA = ("bytes_spilled", "bytes_rng_rings", "bytes_retired")
# The fields of an arena row the summary adds up: numbers in every row that has them.
_AMOUNTS = frozenset({
    "bytes_reserved", "bytes_in_use", "high_water_bytes", "slots_total", "growth_events",
    "batches_held", "pinned_bytes", "bytes_kept", *OUTSIDE_ARENA,
})  # fmt: skip
# Fields of an arena row that name it rather than measure it: never summed across loaders.
_ROW_NAMES = ("t", "pid", "loader")


def _check(message: dict[str, Any], kind: str) -> None:
    """Raise ``ValueError`` unless ``message`` has the shape its producers give it (review 73:
    a line that merely parsed as JSON, such as a structured-log record, reached the summary and
    failed there): a finite ``t``; in an ``arena`` row, ``pid`` and ``loader`` integers, the
    amounts the summary adds up finite numbers, and every other field a number or a string; in
    a ``workers`` line, a list of integer ``pids``."""
    t = message.get("t", 0.0)
    if not (_number(t) and math.isfinite(t)):
        raise ValueError(f"not a row: t={t!r}")
    if kind == "arena":
        for name, value in message.items():
            if name in ("pid", "loader"):
                ok = type(value) is int
            elif name in _AMOUNTS:  # (the summary adds these up)
                ok = _number(value) and math.isfinite(value)
            else:
                ok = isinstance(value, str) or (_number(value) and math.isfinite(value))
            if not ok:
                raise ValueError(f"not a row: {name}={value!r}")
    elif kind == "workers":
        pids = message.get("pids", [])
        if type(pids) is not list or any(type(pid) is not int for pid in pids):
            raise ValueError(f"not a row: pids={pids!r}")


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def loader_of(row: dict[str, Any]) -> tuple[int, int]:
    """The loader an arena row is from: ``(pid, loader)`` (0, 0 for a built-in job's rows)."""
    return int(row.get("pid", 0)), int(row.get("loader", 0))


def combine(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Several loaders' rows of one moment as one: amounts summed, text fields (backend, slot
    sizes) each distinct value once, joined by `` + ``."""
    amounts: dict[str, float] = {}
    texts: dict[str, list[str]] = {}
    for row in rows:
        for key, value in row.items():
            if key in _ROW_NAMES:
                continue
            if isinstance(value, int | float) and not isinstance(value, bool):
                amounts[key] = amounts.get(key, 0) + value
            else:
                seen = texts.setdefault(key, [])
                if str(value) not in seen:
                    seen.append(str(value))
    return {**amounts, **{key: " + ".join(values) for key, values in texts.items()}}


def arena_timeline(rows: list[dict[str, Any]]) -> list[tuple[float, dict[str, Any], int]]:
    """``(t, combined row, loaders live)`` at each row's time: the latest row of every loader
    live at ``t`` (its first row at or before ``t``, its last at or after it), combined."""
    last_t: dict[tuple[int, int], float] = {}
    for row in rows:
        key = loader_of(row)
        last_t[key] = max(last_t.get(key, row["t"]), row["t"])
    latest: dict[tuple[int, int], dict[str, Any]] = {}
    out = []
    for row in sorted(rows, key=lambda r: r["t"]):
        latest[loader_of(row)] = row
        t = row["t"]
        live = [r for key, r in latest.items() if last_t[key] >= t]
        out.append((t, combine(live), len(live)))
    return out


@dataclass
class Recording:
    """The rows of one run, in arrival order."""

    tree: ProcessTree
    t0: float  # time.monotonic() when the job was started
    interval_s: float
    command: list[str]
    label: str = ""
    samples: list[ProcSample] = field(default_factory=list)
    shm: list[tuple[float, int, int, int]] = field(default_factory=list)  # SHM_COLUMNS
    arena: list[dict[str, Any]] = field(default_factory=list)
    job: dict[str, Any] | None = None
    exit_code: int | None = None
    still_running: list[int] = field(default_factory=list)
    ticks: int = 0
    sampler_cpu_s: float = 0.0  # memprof's own CPU time while sampling
    pending_roles: dict[int, str] = field(default_factory=dict)  # announced, not yet seen
    # each loader's latest arena row, kept as rows arrive: live_arena() reads it on every read
    # of the job's pipe, which a scan of every row so far made quadratic (review 68)
    latest_arena: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)
    unreadable_lines: int = 0  # lines on the report pipe that were no JSON row (skipped)

    def add_tick(self, rows: list[ProcSample], shm: ShmUsage, memfd_bytes: int = 0) -> None:
        """One tick: the processes' rows, ``/dev/shm``, and the bytes of shared memory outside
        ``/dev/shm`` the tree holds (``tools._procmem.read_anon_shmem``)."""
        self.ticks += 1
        self.samples.extend(rows)
        t = rows[0].t if rows else (self.shm[-1][0] if self.shm else 0.0)
        self.shm.append((t, shm.used_bytes, shm.entries, memfd_bytes))

    def add_report(self, message: dict[str, Any]) -> None:
        """One JSON line from the job (tools._memjob: ``workers``, ``arena``, ``done``). A line
        that is no such row raises (``ValueError``, ``TypeError``, ...) before anything is
        recorded: memprof counts it as unreadable (something else wrote into the pipe)."""
        kind = message.get("kind", "")
        t = round(float(message.get("t", self.t0)) - self.t0, 4)
        _check(message, kind)
        key = loader_of(message)
        del message["kind"]
        message["t"] = t
        if kind == "arena":
            self.arena.append(message)
            if key not in self.latest_arena or message["t"] >= self.latest_arena[key]["t"]:
                self.latest_arena[key] = message
        elif kind == "workers":
            for i, pid in enumerate(message.get("pids", [])):  # (a list of ints: _check)
                member = self.tree.members.get(pid)
                if member is not None:
                    member.role = f"worker{i}"
                else:  # not sampled yet: name it when it is first seen
                    self.pending_roles[pid] = f"worker{i}"
        elif kind == "done":
            self.job = message

    def apply_roles(self, members: list[Member]) -> None:
        for m in members:
            role = self.pending_roles.pop(m.pid, None)
            if role is not None:
                m.role = role

    def role(self, pid: int) -> str:
        member = self.tree.members.get(pid)
        return member.role if member is not None else ""

    # -- summary --------------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """Peaks of the tree, of each process, of /dev/shm and of the arena (module docstring)."""
        ticks: dict[float, list[ProcSample]] = {}
        for row in self.samples:
            ticks.setdefault(row.t, []).append(row)
        peak_t, peak_rows = max(ticks.items(), key=lambda kv: sum(r.pss for r in kv[1]),
                                default=(0.0, []))
        procs: dict[int, dict[str, Any]] = {}
        for row in self.samples:
            p = procs.get(row.pid)
            if p is None:
                p = procs[row.pid] = {
                    "pid": row.pid, "ppid": row.ppid, "role": self.role(row.pid),
                    "name": row.name, "first_t": row.t, "samples": 0,
                    "first_pss": row.pss, "first_uss": row.uss,
                    "peak_rss": 0, "peak_pss": 0, "peak_uss": 0, "peak_pss_shmem": 0,
                }
            p["last_t"] = row.t
            p["samples"] += 1
            for name in ("rss", "pss", "uss", "pss_shmem"):
                p[f"peak_{name}"] = max(p[f"peak_{name}"], getattr(row, name))
        used = [u for _, u, _, _ in self.shm]
        baseline = used[0] if used else 0
        # Shared memory held at each tick, each object once: /dev/shm's growth plus the memfds.
        shared_at = {t: max(0, u - baseline) + memfd for t, u, _, memfd in self.shm}

        fp_t, fp = max(((t, footprint(rs, shared_at.get(t, 0))) for t, rs in ticks.items()),
                       key=lambda x: x[1], default=(0.0, 0))
        return {
            "label": self.label,
            "command": self.command,
            "exit_code": self.exit_code,
            "interval_s": self.interval_s,
            "ticks": self.ticks,
            "sampler_cpu_s": round(self.sampler_cpu_s, 3),
            "job": self.job,
            "peak_total_pss": sum(r.pss for r in peak_rows),
            "peak_total_pss_t": peak_t,
            "peak_total_pss_processes": len(peak_rows),
            "peak_footprint": fp,
            "peak_footprint_t": fp_t,
            "peak_total_uss": max((sum(r.uss for r in rs) for rs in ticks.values()), default=0),
            "peak_total_rss": max((sum(r.rss for r in rs) for rs in ticks.values()), default=0),
            "processes": list(procs.values()),
            "shm": {
                "baseline_used_bytes": baseline,
                "peak_used_bytes": max(used, default=0),
                "peak_added_bytes": max(used, default=0) - baseline,
                "peak_entries": max((e for _, _, e, _ in self.shm), default=0),
                "peak_memfd_bytes": max((m for _, _, _, m in self.shm), default=0),
            },
            "arena": self._arena_summary(),
            "unreadable_report_lines": self.unreadable_lines,
            "still_running": self.still_running,
        }

    def _arena_summary(self) -> dict[str, Any] | None:
        if not self.arena:
            return None
        timeline = arena_timeline(self.arena)
        by_loader: dict[tuple[int, int], list[dict[str, Any]]] = {}
        for row in self.arena:
            by_loader.setdefault(loader_of(row), []).append(row)
        lasts = [rows[-1] for rows in by_loader.values()]

        def peak(key: str, rows: list[dict[str, Any]] | None = None) -> int:
            if rows is not None:
                return max(int(row.get(key, 0)) for row in rows)
            return max(int(row.get(key, 0)) for _, row, _ in timeline)

        per_loader = [
            {
                "pid": pid, "loader": loader, "first_t": rows[0]["t"], "last_t": rows[-1]["t"],
                "backend": rows[-1].get("backend", ""),
                "slot_sizes": rows[-1].get("slot_sizes", ""),
                "peak_bytes_reserved": peak("bytes_reserved", rows),
                "peak_bytes_in_use": peak("bytes_in_use", rows),
                "slots_total": peak("slots_total", rows),
                "growth_events": peak("growth_events", rows),
                "peak_batches_held": peak("batches_held", rows),
            }
            for (pid, loader), rows in by_loader.items()
        ]  # fmt: skip
        last = combine(lasts)
        return {
            "loaders": len(by_loader),
            "loader_processes": len({pid for pid, _ in by_loader}),
            "loaders_live_at_most": max(n for _, _, n in timeline),
            "backend": last.get("backend", ""),
            "peak_bytes_reserved": peak("bytes_reserved"),
            "peak_bytes_in_use": peak("bytes_in_use"),
            "high_water_bytes": peak("high_water_bytes"),
            "slots_total": peak("slots_total"),
            "slot_sizes": last.get("slot_sizes", ""),
            "growth_events": sum(p["growth_events"] for p in per_loader),
            "peak_batches_held": peak("batches_held"),
            "peak_pinned_bytes": peak("pinned_bytes"),
            "peak_bytes_kept": peak("bytes_kept"),
            **{f"peak_{key}": peak(key) for key in OUTSIDE_ARENA},
            "samples": len(self.arena),
            "per_loader": per_loader,
        }

    def live_arena(self, stale_s: float) -> dict[str, Any] | None:
        """The loaders' latest rows combined, of those that wrote one within ``stale_s`` of the
        newest (a loader that is gone writes no more): what ``--live`` shows."""
        latest = self.latest_arena.values()
        if not latest:
            return None
        newest = max(row["t"] for row in latest)
        return combine([row for row in latest if row["t"] >= newest - stale_s])

    # -- files ----------------------------------------------------------------------------------

    def write(self, out: Path) -> dict[str, Any]:
        """Write samples.csv, shm.csv, arena.csv and summary.json into ``out``; return the
        summary."""
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "samples.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(SAMPLE_COLUMNS)
            for row in self.samples:
                values = list(astuple(row))
                values[SAMPLE_COLUMNS.index("role")] = self.role(row.pid)
                w.writerow(values)
        with open(out / "shm.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(SHM_COLUMNS)
            w.writerows(self.shm)
        with open(out / "arena.csv", "w", newline="") as f:
            columns = list(ARENA_COLUMNS)  # and every other field the rows carry (review 37)
            seen = dict.fromkeys(k for r in self.arena for k in r)
            columns += [k for k in seen if k not in columns]
            dw = csv.DictWriter(f, columns, restval="")
            dw.writeheader()
            dw.writerows(self.arena)
        summary = self.summary()
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary


def mib(n: float) -> str:
    return f"{n / MIB:,.1f}"


def format_summary(s: dict[str, Any]) -> str:
    """The table memprof prints after a run."""
    job = s.get("job") or {}
    head = s["label"] or " ".join(s["command"])
    lines = [f"== {head}"]
    if job:
        lines.append(f"   {job.get('description', '')}: {job.get('batches', 0)} batches in "
                     f"{job.get('seconds', 0.0):.2f} s")
    lines.append(f"   exit code {s['exit_code']}, {s['ticks']} samples every "
                 f"{s['interval_s'] * 1000:.0f} ms ({s['sampler_cpu_s']:.2f} s of sampler CPU)")
    lines.append(f"   peak total PSS of the tree: {mib(s['peak_total_pss'])} MiB at "
                 f"t={s['peak_total_pss_t']:.2f} s ({s['peak_total_pss_processes']} processes); "
                 f"peak total USS {mib(s['peak_total_uss'])} MiB")
    lines.append(f"   peak footprint (PSS with shared memory counted once, unmapped included): "
                 f"{mib(s['peak_footprint'])} MiB at t={s['peak_footprint_t']:.2f} s")
    shm = s["shm"]
    lines.append(f"   /dev/shm peak: {mib(shm['peak_used_bytes'])} MiB used "
                 f"(+{mib(shm['peak_added_bytes'])} MiB over the start), "
                 f"{shm['peak_entries']} entries at most; memfd and other shared memory "
                 f"outside /dev/shm peak: {mib(shm['peak_memfd_bytes'])} MiB")
    arena = s["arena"]
    if arena:
        many = arena.get("loaders", 1) > 1
        procs = arena.get("loader_processes", 1)
        whose = (f", {arena['loaders']} loaders in {procs} process{'es' if procs > 1 else ''}, "
                 f"at most {arena['loaders_live_at_most']} at once, summed" if many else "")
        slots = (f"{arena['slots_total']} slots of {arena['slot_sizes']} B, " if not many
                 else f"{arena['slots_total']} slots, ")
        lines.append(f"   arena peak{whose}: {mib(arena['peak_bytes_reserved'])} MiB reserved "
                     f"({arena['backend']}, {slots}growth events: {arena['growth_events']}), "
                     f"{mib(arena['peak_bytes_in_use'])} MiB in use at most, "
                     f"{arena['peak_batches_held']} batches held at most, "
                     f"{mib(arena['peak_bytes_kept'])} MiB of it kept for forked workers at most")
        lines.append(f"   beside the arena, at most: {mib(arena['peak_bytes_spilled'])} MiB of "
                     f"spilled batches, {mib(arena['peak_bytes_rng_rings'])} MiB of RNG rings, "
                     f"{mib(arena['peak_bytes_retired'])} MiB held in retired arenas; "
                     f"{mib(arena['peak_pinned_bytes'])} MiB page-locked")
        for p in arena.get("per_loader", []) if many else []:
            lines.append(f"     loader {p['loader']} of pid {p['pid']} "
                         f"(t={p['first_t']:.2f}-{p['last_t']:.2f} s): "
                         f"{mib(p['peak_bytes_reserved'])} MiB reserved at most ({p['backend']}, "
                         f"{p['slots_total']} slots of {p['slot_sizes']} B), "
                         f"{p['peak_batches_held']} batches held at most")
    header = ("pid", "role", "name", "first PSS", "peak PSS", "first USS", "peak USS",
              "peak RSS", "peak shmem", "seen (s)")
    rows = [header]
    for p in s["processes"]:
        rows.append((str(p["pid"]), p["role"], p["name"], mib(p["first_pss"]), mib(p["peak_pss"]),
                     mib(p["first_uss"]), mib(p["peak_uss"]), mib(p["peak_rss"]),
                     mib(p["peak_pss_shmem"]), f"{p['first_t']:.2f}-{p['last_t']:.2f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines.append("   memory per process, MiB:")
    for r in rows:
        cells = [c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths,
                                                                                  strict=True))]
        lines.append("   " + "  ".join(cells))
    if s.get("unreadable_report_lines"):
        lines.append(f"   {s['unreadable_report_lines']} lines on the stats pipe were no JSON "
                     "row (something else wrote into it) and were skipped")
    if s["still_running"]:
        lines.append(f"   still running when sampling stopped: {s['still_running']}")
    return "\n".join(lines)
