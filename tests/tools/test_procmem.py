"""tools._procmem: the smaps_rollup parser, the process-tree follower and the /dev/shm reader."""

import mmap
import os
import select
import subprocess
import sys

import pytest

from tools._procmem import (
    SHM_DIR,
    ProcessTree,
    ProcStat,
    internal_shmem_dev,
    mem_from_rollup,
    parse_maps_shmem,
    parse_smaps_rollup,
    parse_stat,
    read_anon_shmem,
    read_mem,
    read_rows,
    read_shm,
    read_stat,
)

WAIT_S = 30.0  # upper bound on any wait for a helper process; never reached when all is well

ROLLUP = """\
55d0c0a00000-7ffd5b9f1000 ---p 00000000 00:00 0                          [rollup]
Rss:              204800 kB
Pss:              150000 kB
Pss_Dirty:         90000 kB
Pss_Anon:          80000 kB
Pss_File:          30000 kB
Pss_Shmem:         40000 kB
Shared_Clean:      50000 kB
Shared_Dirty:      20000 kB
Private_Clean:     10000 kB
Private_Dirty:    124800 kB
Referenced:       204800 kB
Anonymous:         80000 kB
KSM:                   0 kB
LazyFree:              0 kB
AnonHugePages:      2048 kB
Swap:                  0 kB
SwapPss:               0 kB
Locked:                0 kB
THPeligible:           1
"""


def test_parse_smaps_rollup_reads_every_kb_field_in_bytes_and_skips_the_header():
    fields = parse_smaps_rollup(ROLLUP)
    assert fields["Rss"] == 204800 * 1024
    assert fields["Pss_Shmem"] == 40000 * 1024
    assert fields["AnonHugePages"] == 2048 * 1024
    assert "THPeligible" not in fields  # not a kB field
    assert not any("rollup" in name or "-" in name for name in fields)


def test_uss_is_private_clean_plus_private_dirty_and_pss_keeps_its_shmem_share():
    mem = mem_from_rollup(parse_smaps_rollup(ROLLUP))
    assert mem.rss == 204800 * 1024
    assert mem.pss == 150000 * 1024  # Pss already includes Pss_Shmem: not added again
    assert mem.uss == (10000 + 124800) * 1024
    assert mem.pss_shmem == 40000 * 1024


def test_a_kernel_without_pss_shmem_reads_as_zero_shmem():
    text = "\n".join(line for line in ROLLUP.splitlines() if not line.startswith("Pss_Shmem"))
    assert mem_from_rollup(parse_smaps_rollup(text)).pss_shmem == 0


def test_parse_stat_survives_spaces_and_parentheses_in_the_command_name():
    fields = " ".join(str(n) for n in range(4, 23))  # fields 4 (ppid) .. 22 (start time)
    stat = parse_stat(f"4242 (my (odd) name) S {fields}\n")
    assert (stat.pid, stat.comm, stat.state, stat.ppid, stat.start_ticks) == (
        4242,
        "my (odd) name",
        "S",
        4,
        22,
    )


def test_read_mem_of_this_process_is_positive_and_of_a_missing_pid_is_none():
    mem = read_mem(os.getpid())
    assert mem is not None
    assert 0 < mem.uss <= mem.rss
    assert 0 < mem.pss <= mem.rss
    assert read_mem(2**22 + 1) is None  # above pid_max's hard limit: never a live pid


def _read_exactly(fd: int, n: int) -> bytes:
    data = b""
    while len(data) < n:
        ready, _, _ = select.select([fd], [], [], WAIT_S)
        assert ready, f"helper processes did not report within {WAIT_S} s"
        chunk = os.read(fd, n - len(data))
        assert chunk, "helper processes exited before reporting"
        data += chunk
    return data


# argv: block fd, ready fd, child-go fd. Spawns a grandchild blocked on ``block``; reports "c"
# then waits on ``child-go`` (EOF or a byte), then exits without waiting for the grandchild.
CHILD = """
import os, subprocess, sys
block, ready, go = (int(a) for a in sys.argv[1:4])
grandchild = ("import os, sys; os.write(int(sys.argv[2]), b'g'); "
              "os.read(int(sys.argv[1]), 1)")
subprocess.Popen([sys.executable, "-c", grandchild, str(block), str(ready)],
                 pass_fds=(block, ready))
os.write(ready, b"c")
os.read(go, 1)
"""


class Family:
    """A child that spawned a grandchild; both block until the test lets them go."""

    def __init__(self) -> None:
        block_r, self.block_w = os.pipe()
        self.ready_r, ready_w = os.pipe()
        go_r, self.go_w = os.pipe()
        self.child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(block_r), str(ready_w), str(go_r)],
            pass_fds=(block_r, ready_w, go_r),
        )
        for fd in (block_r, ready_w, go_r):
            os.close(fd)
        self._open = {self.block_w, self.ready_r, self.go_w}
        assert sorted(_read_exactly(self.ready_r, 2)) == sorted(b"cg")

    def _close(self, fd: int) -> None:
        if fd in self._open:
            self._open.discard(fd)
            os.close(fd)

    def release_child(self) -> None:
        self._close(self.go_w)  # EOF: the child exits
        self.child.wait(timeout=WAIT_S)

    def release_grandchild(self) -> None:
        self._close(self.block_w)  # EOF: the grandchild exits

    def close(self) -> None:
        for fd in list(self._open):
            self._close(fd)
        self.child.wait(timeout=WAIT_S)


@pytest.fixture
def family():
    f = Family()
    yield f
    f.close()


def _wait_exit(pid: int) -> None:
    """Wait for a process that is not our child to exit (its pidfd becomes readable)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        ready, _, _ = select.select([fd], [], [], WAIT_S)
        assert ready, f"pid {pid} still running after {WAIT_S} s"
    finally:
        os.close(fd)


def test_tree_sees_child_and_grandchild_and_drops_them_when_they_exit(family):
    tree = ProcessTree(family.child.pid)
    alive = tree.refresh(now=1.0)
    assert [m.depth for m in alive] == [0, 1]
    root, grandchild = alive
    assert root.pid == family.child.pid and root.role == "main"
    assert grandchild.ppid == family.child.pid and grandchild.role == "child"
    rows = read_rows(alive, t=0.0)
    assert [r.pid for r in rows] == [root.pid, grandchild.pid]
    assert all(r.pss > 0 and r.uss > 0 for r in rows)

    family.release_grandchild()
    _wait_exit(grandchild.pid)
    family.release_child()
    assert tree.refresh(now=2.0) == []
    assert set(tree.members) == {root.pid, grandchild.pid}  # the history stays


def test_an_orphaned_grandchild_stays_a_member_until_it_exits(family):
    tree = ProcessTree(family.child.pid)
    _, grandchild = tree.refresh(now=1.0)
    family.release_child()  # the grandchild is re-parented
    assert [m.pid for m in tree.refresh(now=2.0)] == [grandchild.pid]
    family.release_grandchild()
    _wait_exit(grandchild.pid)
    assert tree.refresh(now=3.0) == []


def _me() -> ProcStat:
    stat = read_stat(os.getpid())
    assert stat is not None
    return stat


def test_a_recycled_pid_is_not_taken_for_the_process_that_had_it():
    me = _me()
    tree = ProcessTree(me.pid)
    kid = ProcStat(99_991, "kid", "S", me.pid, 5)
    assert [m.pid for m in tree.refresh(1.0, {me.pid: me, kid.pid: kid})] == [me.pid, kid.pid]
    stranger = ProcStat(99_991, "other", "S", 1, 6)  # same pid, later start, not our descendant
    assert [m.pid for m in tree.refresh(2.0, {me.pid: me, stranger.pid: stranger})] == [me.pid]
    newborn = ProcStat(99_991, "new", "S", me.pid, 7)  # same pid again, now really our child
    alive = tree.refresh(3.0, {me.pid: me, newborn.pid: newborn})
    assert [(m.pid, m.name) for m in alive] == [(me.pid, me.comm), (99_991, "new")]


def test_zombies_are_not_members():
    me = _me()
    tree = ProcessTree(me.pid)
    zombie = ProcStat(99_992, "z", "Z", me.pid, 5)
    assert [m.pid for m in tree.refresh(1.0, {me.pid: me, zombie.pid: zombie})] == [me.pid]


def test_read_shm_counts_a_new_file_in_used_bytes_and_entries():
    before = read_shm()
    path = os.path.join(SHM_DIR, f"shmloader-test-procmem-{os.getpid()}")
    try:
        with open(path, "wb") as f:
            f.write(b"\1" * (4 << 20))
        after = read_shm()
    finally:
        os.unlink(path)
    assert after.entries == before.entries + 1
    assert after.used_bytes - before.used_bytes >= 4 << 20


MIB = 1 << 20
MAPS = """\
55d0c0a00000-55d0c0a21000 r--p 00000000 fe:00 1234                       /usr/bin/python3.11
7f0000000000-7f0000800000 rw-s 00000000 00:01 500    /memfd:shmloader-slab (deleted)
7f0000800000-7f0001000000 rw-s 00000000 00:01 500    /memfd:shmloader-slab (deleted)
7f0001000000-7f0001100000 rw-s 00000000 00:01 501                        /dev/zero (deleted)
7f0001100000-7f0001200000 rw-s 00000000 00:1b 77                         /dev/shm/#77 (deleted)
7f0001200000-7f0001300000 rw-p 00000000 00:00 0                          [heap]
"""


def test_maps_shmem_are_the_memfds_and_the_internal_mount_once_each_not_dev_shm_files():
    one = os.makedev(0, 1)
    assert parse_maps_shmem(MAPS, one) == {(one, 500), (one, 501)}
    assert parse_maps_shmem(MAPS.replace("00:01", "00:02"), one) == {(os.makedev(0, 2), 500)}
    assert parse_maps_shmem(MAPS.splitlines()[0], one) == set()


# argv: memfd path to open ("" for a new one, written with argv[2] MiB), ready fd, go fd. Maps
# the memfd, closes its descriptor (only the mapping holds it then), reports "m", waits for go.
MAPPER = """
import mmap, os, sys
path, mib, ready, go = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
fd = os.open(path, os.O_RDWR) if path else os.memfd_create("memprof-test")
if not path:
    os.ftruncate(fd, 8 << 20)
m = mmap.mmap(fd, 8 << 20)
os.close(fd)
m[: mib << 20] = b"x" * (mib << 20)
os.write(ready, b"m")
os.read(go, 1)
"""


class Mapper:
    """A child that maps a memfd (this process's, or one of its own) and holds only the mapping
    until it is let go."""

    def __init__(self, path: str, mib: int) -> None:
        self.ready_r, ready_w = os.pipe()
        go_r, self.go_w = os.pipe()
        self.child = subprocess.Popen(
            [sys.executable, "-c", MAPPER, path, str(mib), str(ready_w), str(go_r)],
            pass_fds=(ready_w, go_r),
        )
        os.close(ready_w)
        os.close(go_r)
        assert _read_exactly(self.ready_r, 1) == b"m"

    def close(self) -> None:
        os.close(self.go_w)  # EOF: the child exits
        os.close(self.ready_r)
        self.child.wait(timeout=WAIT_S)


def test_a_memfd_open_here_and_mapped_in_a_child_counts_once_with_its_allocated_bytes():
    assert internal_shmem_dev() is not None
    fd = os.memfd_create("memprof-test")
    try:
        os.ftruncate(fd, 8 << 20)
        with mmap.mmap(fd, 8 << 20) as m:
            m[: 3 * MIB] = b"y" * (3 * MIB)  # 3 of its 8 MiB allocated
            before = read_anon_shmem([os.getpid()])
            mapper = Mapper(f"/proc/{os.getpid()}/fd/{fd}", 3)  # writes the same 3 MiB
            try:
                both = read_anon_shmem([os.getpid(), mapper.child.pid])
                child_only = read_anon_shmem([mapper.child.pid])
            finally:
                mapper.close()
    finally:
        os.close(fd)
    assert both == before
    # This process's other shared memory (none, usually) plus the memfd's 3 MiB, not 6 or 11
    assert 3 * MIB <= both < 4 * MIB
    assert child_only == 3 * MIB  # no descriptor there: its mapping's resident pages


def test_a_memfd_only_mapped_counts_its_resident_bytes():
    mapper = Mapper("", 2)
    try:
        assert read_anon_shmem([mapper.child.pid]) == 2 * MIB
    finally:
        mapper.close()
