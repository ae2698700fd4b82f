"""Reading a process tree's memory from ``/proc``: smaps_rollup, the tree itself, ``/dev/shm``.

Job: at each tick, find every live process of one tree (the root and all its descendants) and read
each one's memory from ``/proc/<pid>/smaps_rollup``. Pure Linux ``/proc`` reading; no psutil.

Definitions (bytes; the kernel reports kB and they are multiplied by 1024):
- ``rss = Rss``; ``pss = Pss`` (it already includes ``Pss_Shmem``: shared-memory pages divided
  among the processes mapping them); ``uss = Private_Clean + Private_Dirty``;
  ``pss_shmem = Pss_Shmem`` (0 on kernels older than 5.14, which lack the field).
- Summing ``pss`` over processes counts every resident page once, so the tree's total PSS is the
  memory the job costs the machine, *except* shared-memory pages no process has mapped (a batch
  queued between two processes): those show only in ``/dev/shm`` (``ShmUsage``).

Invariants of ``ProcessTree``:
- A process is identified by ``(pid, start time)``, so a recycled pid is never taken for the old
  process.
- Once seen, a process stays a member until it exits, even when its parent dies first and it is
  re-parented (to init or a subreaper); its descendants are members too.
- Zombies (state Z or X) are not members: they hold no memory.
- ``depth`` (0 for the root) is fixed when a process is first seen.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

PROC = "/proc"
SHM_DIR = "/dev/shm"
_KB = 1024
_GONE_STATES = frozenset("ZX")


@dataclass(frozen=True, slots=True)
class ProcMem:
    """One process's memory at one moment, in bytes (module docstring: definitions)."""

    rss: int
    pss: int
    uss: int
    pss_shmem: int


def parse_smaps_rollup(text: str) -> dict[str, int]:
    """``{field: bytes}`` for every ``Name:  N kB`` line of a smaps_rollup text (header skipped)."""
    fields: dict[str, int] = {}
    for line in text.splitlines():
        name, sep, rest = line.partition(":")
        parts = rest.split()
        if not sep or len(parts) != 2 or parts[1] != "kB" or not parts[0].isdigit():
            continue  # the "addr-addr ---p ... [rollup]" header, or a line we do not know
        fields[name.strip()] = int(parts[0]) * _KB
    return fields


def mem_from_rollup(fields: dict[str, int]) -> ProcMem:
    """The four numbers memprof records, from parsed smaps_rollup fields."""
    return ProcMem(
        rss=fields.get("Rss", 0),
        pss=fields.get("Pss", 0),
        uss=fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0),
        pss_shmem=fields.get("Pss_Shmem", 0),
    )


def read_mem(pid: int) -> ProcMem | None:
    """``pid``'s memory, or None when it has exited (or is a zombie, whose rollup is empty)."""
    try:
        with open(f"{PROC}/{pid}/smaps_rollup", encoding="ascii", errors="replace") as f:
            text = f.read()
    except OSError:  # ENOENT/ESRCH: gone; EACCES: not ours to read
        return None
    fields = parse_smaps_rollup(text)
    return mem_from_rollup(fields) if fields else None


@dataclass(frozen=True, slots=True)
class ProcStat:
    """The fields of ``/proc/<pid>/stat`` the tree needs."""

    pid: int
    comm: str
    state: str
    ppid: int
    start_ticks: int  # field 22: start time in clock ticks since boot; (pid, this) is unique


def parse_stat(text: str) -> ProcStat:
    """Parse one ``/proc/<pid>/stat`` line; ``comm`` may hold spaces and parentheses."""
    head, _, tail = text.rpartition(")")
    pid_text, _, comm = head.partition(" (")
    rest = tail.split()
    # rest[0] is field 3 (state); field n is rest[n - 3]
    return ProcStat(int(pid_text), comm, rest[0], int(rest[1]), int(rest[19]))


def read_stat(pid: int) -> ProcStat | None:
    try:
        with open(f"{PROC}/{pid}/stat", encoding="utf-8", errors="replace") as f:
            return parse_stat(f.read())
    except (OSError, ValueError, IndexError):
        return None


def scan_stats() -> dict[int, ProcStat]:
    """Every process on the machine (that ``/proc`` shows us), by pid."""
    table: dict[int, ProcStat] = {}
    for entry in os.listdir(PROC):
        if entry.isdigit():
            stat = read_stat(int(entry))
            if stat is not None:
                table[stat.pid] = stat
    return table


@dataclass
class Member:
    """A process of the tree: who it is, where it sits, when it was seen."""

    pid: int
    start_ticks: int
    ppid: int
    depth: int
    name: str
    first_seen: float
    last_seen: float
    role: str = ""


def default_role(depth: int) -> str:
    return {0: "main", 1: "child", 2: "grandchild"}.get(depth, f"depth{depth}")


class ProcessTree:
    """The live processes of the tree rooted at ``root`` (module docstring: invariants)."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.members: dict[int, Member] = {}  # every process ever seen, by pid; never shrinks
        stat = read_stat(root)
        self._root_ticks = None if stat is None else stat.start_ticks

    def refresh(self, now: float, table: dict[int, ProcStat] | None = None) -> list[Member]:
        """Scan ``/proc`` (or use ``table``) and return the members alive now, root first."""
        table = scan_stats() if table is None else table
        children: defaultdict[int, list[int]] = defaultdict(list)
        for stat in table.values():
            children[stat.ppid].append(stat.pid)
        # (pid, depth, known): ``known`` marks a process we saw before, reached through our own
        # record rather than through a live parent; it must still have the start time we saw.
        stack: list[tuple[int, int, bool]] = [
            (m.pid, m.depth, True) for m in self.members.values() if m.pid != self.root
        ]
        if self._root_ticks is not None:
            stack.append((self.root, 0, True))
        alive: dict[int, Member] = {}
        while stack:
            pid, depth, known = stack.pop()
            current = table.get(pid)
            if pid in alive or current is None or current.state in _GONE_STATES:
                continue
            member = self.members.get(pid)
            expected = self._root_ticks if pid == self.root else None
            if member is not None and pid != self.root:
                expected = member.start_ticks
            if known and current.start_ticks != expected:
                continue  # our record's process exited and the pid was recycled
            if member is None or member.start_ticks != current.start_ticks:
                member = Member(pid, current.start_ticks, current.ppid, depth, current.comm, now,
                                now, default_role(depth))
                self.members[pid] = member
            member.last_seen = now
            alive[pid] = member
            stack.extend((child, member.depth + 1, False) for child in children.get(pid, ()))
        return sorted(alive.values(), key=lambda m: (m.depth, m.first_seen, m.pid))


@dataclass(frozen=True, slots=True)
class ShmUsage:
    """``/dev/shm`` as ``df`` and ``ls`` see it: bytes used on the mount and visible entries.

    ``used_bytes`` also counts unlinked files that are still open or mapped (shmloader's arena,
    torch's in-flight batches), which ``entries`` cannot show.
    """

    used_bytes: int
    entries: int


def read_shm(path: str = SHM_DIR) -> ShmUsage:
    try:
        st = os.statvfs(path)
        entries = len(os.listdir(path))
    except OSError:
        return ShmUsage(0, 0)
    return ShmUsage((st.f_blocks - st.f_bfree) * st.f_frsize, entries)


@dataclass(frozen=True, slots=True)
class ProcSample:
    """One row of samples.csv: one process at one tick."""

    t: float
    pid: int
    ppid: int
    role: str
    name: str
    rss: int
    pss: int
    uss: int
    pss_shmem: int


def read_rows(members: Iterable[Member], t: float) -> list[ProcSample]:
    """Read every member's memory as rows at time ``t``; members that vanish mid-read are left
    out."""
    rows: list[ProcSample] = []
    for m in members:
        mem = read_mem(m.pid)
        if mem is not None:
            rows.append(ProcSample(t, m.pid, m.ppid, m.role, m.name, mem.rss, mem.pss, mem.uss,
                                   mem.pss_shmem))
    return rows


def sample_tree(tree: ProcessTree, now: float, t: float) -> list[ProcSample]:
    """Refresh ``tree`` (``now``: the monotonic clock) and read its live members at time ``t``."""
    return read_rows(tree.refresh(now), t)


def total(rows: Iterable[ProcSample], field: str) -> int:
    return sum(int(getattr(r, field)) for r in rows)
