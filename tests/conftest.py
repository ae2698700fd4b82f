"""Suite-wide guards: every test must leave no /dev/shm entry, no arena memory and no child
process behind.

The guard is autouse, so it applies to every test in the suite. After the test body it collects
garbage (a dropped loader shuts down through its finalizer), then gives children a bounded grace
period to exit (``psutil.wait_procs`` with a timeout — a wait on an event, not a sleep), and fails
the test naming whatever is left. It then kills the leftover children so one leak does not
cascade, and unlinks the leftover ``/dev/shm`` entries. Only entries that carry shmloader's prefix
count (every segment name the arena makes has it): a run beside other jobs must neither fail
because of their entries nor delete their semaphores.

Arena segments have no name (``O_TMPFILE`` on ``/dev/shm``, or a memfd), so a leaked arena
leaves no entry: the guard also fails a test after which this process still has an arena
segment open or mapped that it did not have before (``/proc/self/fd`` and ``/proc/self/maps``;
its memory is not freed while either holds it). Such a segment cannot be taken back from here,
so it stays counted as "before" for the tests after.

The guard's full collection after every test would scan every object the interpreter holds
(torch, pytest, hypothesis: about 180,000 objects, 0.25 s a test, half the suite's time). Once
collection has finished, everything alive is moved to the collector's permanent generation
(``gc.freeze``): those objects were made by imports and test collection, before any test ran, so
no loader, iterator or batch is among them, and the per-test collection scans only what the tests
made since. (One test thaws the heap for its own run and freezes it again after a full collection
once its loader is gone: ``test_workers_freeze_what_they_inherit...``; a loader still alive then
would have failed the guard of the test that left it.) A frozen cycle is never collected, so
freezing can make the guard fail where it passed, never pass where it failed.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
from collections.abc import Iterator

import psutil
import pytest

SHM_DIR = "/dev/shm"
OUR_PREFIX = "shmloader-"
CHILD_GRACE_S = 5.0


def _shm_entries() -> set[str]:
    """Our entries only: other programs' /dev/shm use (a job beside the suite) is not a leak."""
    try:
        return {name for name in os.listdir(SHM_DIR) if name.startswith(OUR_PREFIX)}
    except FileNotFoundError:
        return set()


# How an arena segment shows in /proc/self/fd and /proc/self/maps: an unnamed /dev/shm file
# (O_TMPFILE), a named one unlinked at once (the fallback without O_TMPFILE), or a memfd.
_SEGMENT = re.compile(r"^(/dev/shm/#\d+|/dev/shm/shmloader-\S+|/memfd:shmloader-slab) \(deleted\)$")


def _segments() -> set[int]:
    """Inode numbers of the arena segments this process has open or mapped."""
    held = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # (the listing's own descriptor is gone by now)
            if _SEGMENT.match(os.readlink(f"/proc/self/fd/{fd}")):
                held.add(os.stat(f"/proc/self/fd/{fd}").st_ino)
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and _SEGMENT.match(fields[5].strip()):
                held.add(int(fields[4]))
    return held


def _children() -> dict[int, psutil.Process]:
    # Children still starting up under fork/spawn are real children, so count them. The
    # multiprocessing forkserver and resource tracker are long-lived helpers started once per
    # interpreter by the standard library, not by a test; they are excluded.
    out: dict[int, psutil.Process] = {}
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
        if "forkserver" in cmd or "resource_tracker" in cmd:
            continue
        out[p.pid] = p
    return out


def pytest_collection_finish(session: pytest.Session) -> None:
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    shm_before = _shm_entries()
    segments_before = _segments()
    kids_before = set(_children())
    yield
    gc.collect()
    new_kids = [p for pid, p in _children().items() if pid not in kids_before]
    _, alive = psutil.wait_procs(new_kids, timeout=CHILD_GRACE_S)
    leaked_shm = sorted(_shm_entries() - shm_before)
    leaked_segments = sorted(_segments() - segments_before)
    problems = []
    if alive:
        problems.append(
            "child processes still running after the test: "
            + ", ".join(f"{p.pid} ({' '.join(p.cmdline())[:80]})" for p in alive)
        )
        for p in alive:
            p.kill()
        psutil.wait_procs(alive, timeout=CHILD_GRACE_S)
    if leaked_shm:
        problems.append(f"/dev/shm entries left behind: {leaked_shm}")
        for name in leaked_shm:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(SHM_DIR, name))
    if leaked_segments:
        problems.append(
            f"{len(leaked_segments)} arena segments still open or mapped after the test "
            f"(inodes {leaked_segments[:8]}): a loader, iterator or batch outlived it"
        )
    if problems:
        pytest.fail("; ".join(problems))
