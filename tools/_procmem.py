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
- Shared memory outside ``/dev/shm`` (memfds, shared anonymous mappings, SysV segments: files of
  the kernel's internal shmem mount, which no ``statvfs`` shows) is read per object by
  ``read_anon_shmem``: the objects any process of the tree has open (``/proc/<pid>/fd``) or
  mapped (``/proc/<pid>/maps``), each counted once by ``(device, inode)`` however many
  processes hold it. An object open as a descriptor counts its allocated bytes (``st_blocks``:
  exact, mapped or not); one that is only mapped counts the largest ``Rss`` a process has of it
  (``/proc/<pid>/smaps``, read only for such processes).

Invariants of ``ProcessTree``:
- A process is identified by ``(pid, start time)``, so a recycled pid is never taken for the old
  process.
- Once seen, a process stays a member until it exits, even when its parent dies first and it is
  re-parented (to init or a subreaper); its descendants are members too.
- Zombies (state Z or X) are not members: they hold no memory.
- ``depth`` (0 for the root) is fixed when a process is first seen.
"""

from __future__ import annotations

import functools
import os
from collections import defaultdict
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Protocol

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


ShmemKey = tuple[int, int]  # (st_dev, st_ino) of a shared-memory object
MEMFD_PREFIX = "/memfd:"  # how maps and fd links name a memfd ("/memfd:NAME (deleted)")


@functools.cache
def internal_shmem_dev() -> int | None:
    """The device of the kernel's internal shmem mount, where memfds, shared anonymous mappings
    and SysV segments live (learnt from a memfd of our own); None where memfds do not exist."""
    try:
        fd = os.memfd_create("memprof-probe", os.MFD_CLOEXEC)
    except (AttributeError, OSError):
        return None
    try:
        return os.fstat(fd).st_dev
    finally:
        os.close(fd)


def parse_maps_shmem(text: str, dev: int | None) -> set[ShmemKey]:
    """The ``(dev, inode)`` of every mapping in a ``/proc/<pid>/maps`` or ``smaps`` text that is
    a memfd or lies on the internal shmem mount ``dev``."""
    mark = None if dev is None else f"{os.major(dev):02x}:{os.minor(dev):02x}"
    if MEMFD_PREFIX not in text and (mark is None or mark not in text):
        return set()  # the common case, decided without splitting a line
    keys: set[ShmemKey] = set()
    for line in text.splitlines():
        key = _shmem_mapping(line, mark)
        if key is not None:
            keys.add(key)
    return keys


def _shmem_mapping(line: str, mark: str | None) -> ShmemKey | None:
    """The key of one maps line (``lo-hi perms offset MM:mm inode path``) if it maps a memfd or
    the internal shmem mount; None for any other line."""
    parts = line.split(None, 5)
    if len(parts) < 6 or parts[4] == "0" or not (parts[3] == mark or
                                                  parts[5].startswith(MEMFD_PREFIX)):
        return None
    major, _, minor = parts[3].partition(":")
    try:
        return os.makedev(int(major, 16), int(minor, 16)), int(parts[4])
    except ValueError:
        return None


def read_mapped_shmem(pid: int, dev: int | None) -> set[ShmemKey]:
    """The anonymous shared-memory objects ``pid`` maps (``/proc/<pid>/maps``: no page walk)."""
    try:
        with open(f"{PROC}/{pid}/maps", encoding="utf-8", errors="replace") as f:
            return parse_maps_shmem(f.read(), dev)
    except OSError:
        return set()


def read_open_memfds(pid: int) -> dict[ShmemKey, int]:
    """The memfds ``pid`` has open as descriptors, with their allocated bytes (``st_blocks``)."""
    base = f"{PROC}/{pid}/fd"
    found: dict[ShmemKey, int] = {}
    try:
        fds = os.listdir(base)
    except OSError:
        return found
    for fd in fds:
        try:
            if not os.readlink(f"{base}/{fd}").startswith(MEMFD_PREFIX):
                continue
            st = os.stat(f"{base}/{fd}")  # follows the link to the memfd itself
        except OSError:  # closed meanwhile, or not ours to read
            continue
        found[(st.st_dev, st.st_ino)] = st.st_blocks * 512
    return found


def parse_smaps_rss(text: str, keys: Collection[ShmemKey], dev: int | None) -> dict[ShmemKey, int]:
    """Summed ``Rss`` bytes of the mappings of each object in ``keys``, from a smaps text."""
    mark = None if dev is None else f"{os.major(dev):02x}:{os.minor(dev):02x}"
    rss: dict[ShmemKey, int] = {}
    current: ShmemKey | None = None
    for line in text.splitlines():
        if line and line[0] in "0123456789abcdef":  # a mapping's header (fields: upper case)
            key = _shmem_mapping(line, mark)
            current = key if key in keys else None
        elif current is not None and line.startswith("Rss:"):
            parts = line.split()
            if len(parts) == 3 and parts[1].isdigit():
                rss[current] = rss.get(current, 0) + int(parts[1]) * _KB
            current = None
    return rss


def read_mapped_rss(pid: int, keys: Collection[ShmemKey], dev: int | None) -> dict[ShmemKey, int]:
    try:
        with open(f"{PROC}/{pid}/smaps", encoding="utf-8", errors="replace") as f:
            return parse_smaps_rss(f.read(), keys, dev)
    except OSError:
        return {}


def read_anon_shmem(pids: Iterable[int]) -> int:
    """Bytes of shared memory outside ``/dev/shm`` that ``pids`` hold, each object counted once
    (module docstring). smaps, which walks every page table, is read only from processes that
    map an object no process of ``pids`` has open."""
    dev = internal_shmem_dev()
    allocated: dict[ShmemKey, int] = {}
    mapped: dict[int, set[ShmemKey]] = {}
    for pid in pids:
        allocated.update(read_open_memfds(pid))
        mapped[pid] = read_mapped_shmem(pid, dev)
    resident: dict[ShmemKey, int] = {}
    for pid, keys in mapped.items():
        only_mapped = keys - allocated.keys()
        if only_mapped:
            for key, n in read_mapped_rss(pid, only_mapped, dev).items():
                resident[key] = max(resident.get(key, 0), n)
    return sum(allocated.values()) + sum(resident.values())


class _Pss(Protocol):
    @property
    def pss(self) -> int: ...

    @property
    def pss_shmem(self) -> int: ...


def footprint(processes: Iterable[_Pss], shared_bytes: int) -> int:
    """A job's memory, every byte once: each process's private part (``pss - pss_shmem``) plus
    ``shared_bytes``, the shared memory the job holds counted per object, mapped or not (its
    ``/dev/shm`` growth and its memfds: ``tools._memrecord``). memprof's footprint and the
    bench's are this one sum."""
    return sum(p.pss - p.pss_shmem for p in processes) + shared_bytes


def total(rows: Iterable[ProcSample], field: str) -> int:
    return sum(int(getattr(r, field)) for r in rows)
