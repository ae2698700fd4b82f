"""Tests of arena.segment: create, attach, close, both backends, capacity errors, no names left."""

from __future__ import annotations

import contextlib
import errno
import gc
import multiprocessing as mp
import os
import pickle
import signal
import threading
import warnings
from multiprocessing.connection import Connection

import numpy as np
import posix_ipc
import pytest

from arena import segment as segment_mod
from arena._layout import PAGE
from arena.allocator import Arena
from arena.errors import ArenaCapacityError
from arena.segment import Backend, Segment, SegmentSpec, resolve_backend

CHILD_TIMEOUT_S = 30.0
BACKENDS = ["posix", "memfd"]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def shm_names(pid: int) -> set[str]:
    """The /dev/shm entries the arena in process ``pid`` named (other jobs' entries ignored)."""
    prefix = f"{segment_mod._NAME_PREFIX.lstrip('/')}{pid}-"
    return {name for name in os.listdir(segment_mod.SHM_DIR) if name.startswith(prefix)}


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def fresh_fallback_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget that this process already warned about the memfd fallback."""
    monkeypatch.setattr(segment_mod, "_warned_fallback", threading.Event())


def test_create_maps_the_requested_bytes_with_the_requested_backend(backend):
    seg = Segment.create(3 * PAGE, backend)
    try:
        assert seg.size == 3 * PAGE
        assert len(seg.buffer) == 3 * PAGE
        assert seg.backend is Backend(backend)
        assert seg.owner_pid == os.getpid()
        assert not seg.closed
    finally:
        seg.close()


def test_create_reserves_the_bytes_before_returning(backend):
    seg = Segment.create(64 * PAGE, backend)
    try:
        assert os.fstat(seg.spec.fd).st_blocks * 512 >= 64 * PAGE
    finally:
        seg.close()


@pytest.mark.parametrize("nbytes", [0, -PAGE])
def test_create_rejects_a_non_positive_size(nbytes):
    with pytest.raises(ValueError, match="positive"):
        Segment.create(nbytes, "memfd")


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError):
        Segment.create(PAGE, "tmpfs")


def test_a_posix_segment_has_no_name_and_counts_against_dev_shm():
    before = set(os.listdir(segment_mod.SHM_DIR))
    free = segment_mod.shm_free_bytes()
    seg = Segment.create(64 * PAGE, "posix")
    try:
        assert set(os.listdir(segment_mod.SHM_DIR)) == before
        assert segment_mod.shm_free_bytes() <= free - 64 * PAGE
    finally:
        seg.close()


def test_without_o_tmpfile_the_posix_name_never_appears_after_create_returns(monkeypatch):
    def no_tmpfile() -> int:
        raise OSError(errno.EOPNOTSUPP, "O_TMPFILE not supported")

    monkeypatch.setattr(segment_mod, "_open_tmpfile", no_tmpfile)
    names: list[str] = []
    real = posix_ipc.SharedMemory

    def recording(name: str, *args: object, **kwargs: object) -> posix_ipc.SharedMemory:
        names.append(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(segment_mod.posix_ipc, "SharedMemory", recording)
    seg = Segment.create(4 * PAGE, "posix")
    try:
        assert len(names) == 1
        assert not os.path.exists(os.path.join(segment_mod.SHM_DIR, names[0].lstrip("/")))
        assert shm_names(os.getpid()) == set()
    finally:
        seg.close()


def test_close_is_idempotent(backend):
    seg = Segment.create(PAGE, backend)
    seg.close()
    seg.close()
    assert seg.closed


def test_close_releases_the_handle_and_the_mapping(backend):
    fds = open_fds()
    seg = Segment.create(PAGE, backend)
    assert open_fds() > fds
    seg.close()
    assert open_fds() == fds
    with pytest.raises(ValueError):
        seg.buffer[0]  # the exported memoryview was released


def test_close_while_a_numpy_view_is_alive_keeps_the_view_valid(backend):
    seg = Segment.create(2 * PAGE, backend)
    view = np.frombuffer(seg.buffer[PAGE:], dtype=np.uint8)
    view[:] = 7
    seg.close()
    assert seg.closed
    assert int(view.sum()) == 7 * PAGE
    view[:] = 9  # still mapped and writable
    assert int(view.sum()) == 9 * PAGE


def test_half_built_segment_closes_safely():
    seg = Segment.__new__(Segment)
    seg.close()
    assert seg.closed


def test_attach_in_the_owner_process_shares_the_bytes(backend):
    owner = Segment.create(2 * PAGE, backend)
    other = Segment.attach(owner.spec)
    try:
        owner.buffer[:5] = b"hello"
        assert bytes(other.buffer[:5]) == b"hello"
        other.buffer[PAGE : PAGE + 3] = b"abc"
        assert bytes(owner.buffer[PAGE : PAGE + 3]) == b"abc"
    finally:
        other.close()
        owner.close()


def test_attach_survives_the_owner_closing_its_handle(backend):
    owner = Segment.create(PAGE, backend)
    other = Segment.attach(owner.spec)
    owner.buffer[:3] = b"xyz"
    owner.close()
    try:
        assert bytes(other.buffer[:3]) == b"xyz"
    finally:
        other.close()


def test_spec_pickles_small_and_round_trips(backend):
    seg = Segment.create(PAGE, backend)
    try:
        data = pickle.dumps(seg.spec)
        assert len(data) < 300
        assert pickle.loads(data) == seg.spec
    finally:
        seg.close()


def test_attach_to_a_missing_descriptor_names_the_fd_and_the_process():
    spec = SegmentSpec(owner_pid=1, fd=999_999, size=PAGE, backend=Backend.MEMFD)
    with pytest.raises(OSError, match=r"fd 999999 of process 1 through /proc"):
        Segment.attach(spec)


def test_repr_shows_size_backend_and_state(backend):
    seg = Segment.create(PAGE, backend)
    assert f"size={PAGE:,}" in repr(seg)
    assert f"backend={backend}" in repr(seg)
    seg.close()
    assert "closed" in repr(seg)


def test_auto_picks_posix_when_dev_shm_has_room():
    assert resolve_backend("auto", PAGE) is Backend.POSIX


def test_explicit_backends_are_taken_as_given(monkeypatch):
    monkeypatch.setattr(segment_mod, "shm_free_bytes", lambda path="": 0)
    assert resolve_backend("posix", PAGE) is Backend.POSIX
    assert resolve_backend(Backend.MEMFD, PAGE) is Backend.MEMFD


@pytest.mark.usefixtures("fresh_fallback_warning")
def test_auto_falls_back_to_memfd_with_one_resource_warning(monkeypatch):
    monkeypatch.setattr(segment_mod, "shm_free_bytes", lambda path="": PAGE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = Segment.create(2 * PAGE, "auto")
        second = Segment.create(2 * PAGE, "auto")
    try:
        assert first.backend is Backend.MEMFD
        assert second.backend is Backend.MEMFD
        resource = [w for w in caught if issubclass(w.category, UserWarning)]
        assert len(resource) == 1
        assert f"{2 * PAGE:,} requested" in str(resource[0].message)
    finally:
        first.close()
        second.close()


def test_posix_larger_than_dev_shm_raises_capacity_error_with_the_fix(monkeypatch):
    monkeypatch.setattr(segment_mod, "shm_free_bytes", lambda path="": PAGE)
    fds = open_fds()
    with pytest.raises(ArenaCapacityError) as info:
        Segment.create(10 * PAGE, "posix")
    message = str(info.value)
    assert f"{10 * PAGE:,} bytes" in message
    assert f"/dev/shm has {PAGE:,} bytes free" in message
    assert "--shm-size" in message
    assert "memfd" in message
    assert open_fds() == fds


def test_memfd_larger_than_available_ram_raises_capacity_error(monkeypatch):
    monkeypatch.setattr(segment_mod, "mem_available_bytes", lambda: PAGE)
    with pytest.raises(ArenaCapacityError, match=f"{10 * PAGE:,} bytes.*'memfd'"):
        Segment.create(10 * PAGE, "memfd")


def test_failed_reservation_raises_capacity_error_and_closes_the_descriptor(monkeypatch, backend):
    def no_space(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(segment_mod.os, "posix_fallocate", no_space)
    fds = open_fds()
    with pytest.raises(ArenaCapacityError, match=os.strerror(errno.ENOSPC)):
        Segment.create(PAGE, backend)
    assert open_fds() == fds


def test_other_reservation_errors_propagate_unchanged(monkeypatch):
    def bad(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(segment_mod.os, "posix_fallocate", bad)
    fds = open_fds()
    with pytest.raises(OSError) as info:
        Segment.create(PAGE, "memfd")
    assert info.value.errno == errno.EIO
    assert not isinstance(info.value, ArenaCapacityError)
    assert open_fds() == fds


def _own_arena_then_wait(backend: str, conn: Connection) -> None:
    arena = Arena(backend=backend, max_bytes=64 * PAGE, slots_per_slab=2)
    refs = [arena.acquire(PAGE), arena.acquire(4 * PAGE)]
    conn.send(arena.stats().slabs if all(refs) else 0)
    conn.recv()  # the parent SIGKILLs us while we wait here


@pytest.mark.parametrize("backend", BACKENDS)
def test_owner_killed_with_sigkill_leaves_nothing_in_dev_shm(backend):
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_own_arena_then_wait, args=(backend, child))
    proc.start()
    try:
        assert parent.poll(CHILD_TIMEOUT_S), "the owner never reported its slabs"
        assert parent.recv() == 2
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(CHILD_TIMEOUT_S)
        assert proc.exitcode == -signal.SIGKILL
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(CHILD_TIMEOUT_S)
    assert shm_names(proc.pid) == set()


def test_dropped_segment_frees_its_descriptor(backend):
    fds = open_fds()
    seg = Segment.create(PAGE, backend)
    del seg
    gc.collect()
    assert open_fds() == fds


def test_create_survives_its_name_being_unlinked_by_another_process(monkeypatch):
    real = posix_ipc.SharedMemory

    def unlinked_at_once(name: str, *args: object, **kwargs: object) -> posix_ipc.SharedMemory:
        shm = real(name, *args, **kwargs)
        posix_ipc.unlink_shared_memory(name)  # what a /dev/shm cleaner in another process does
        return shm

    monkeypatch.setattr(segment_mod.posix_ipc, "SharedMemory", unlinked_at_once)
    fds = open_fds()
    seg = Segment.create(PAGE, "posix")
    seg.buffer[:2] = b"ok"
    seg.close()
    assert open_fds() == fds


def _report_spec(spec, conn):
    seg = Segment.attach(spec)
    conn.send(seg.spec)
    seg.close()


def test_an_attacher_hands_on_the_owners_spec_not_its_own_descriptor():
    import multiprocessing

    seg = Segment.create(PAGE, "memfd")
    try:
        parent, child = multiprocessing.get_context("fork").Pipe()
        proc = multiprocessing.get_context("fork").Process(
            target=_report_spec, args=(seg.spec, child)
        )
        proc.start()
        assert parent.poll(30), "the child reported no spec"
        assert parent.recv() == seg.spec
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        seg.close()


def test_privatize_keeps_the_bytes_and_parts_a_range_from_the_shared_segment(backend):
    owner = Segment.create(3 * PAGE, backend)
    other = Segment.attach(owner.spec)  # a second mapping, as another process would have
    try:
        mine = np.frombuffer(owner.buffer, np.uint8)
        theirs = np.frombuffer(other.buffer, np.uint8)
        mine[:] = 7
        segment_mod.privatize(int(theirs.ctypes.data) + PAGE, PAGE)  # the middle page only
        assert (theirs == 7).all(), "the private copy holds the bytes it replaced"
        mine[:] = 9
        assert (theirs[PAGE : 2 * PAGE] == 7).all(), "the copy no longer sees the segment"
        assert (theirs[:PAGE] == 9).all() and (theirs[2 * PAGE :] == 9).all()
        theirs[PAGE : 2 * PAGE] = 5
        assert (mine == 9).all(), "writes to the copy stay in it"
        del mine, theirs
    finally:
        other.close()
        owner.close()


def test_an_interruption_while_a_segment_is_made_never_closes_a_descriptor_twice(monkeypatch):
    # Review 11: interrupted after the segment's finalizer was registered, the error path
    # closed the descriptor, and the half-made segment's finalizer later closed the same number
    # again: by then another file's.
    import arena.segment as seg

    real, number = seg.weakref.finalize, []

    def registered_then_interrupted(obj, *args, **kwargs):
        done = real(obj, *args, **kwargs)
        if isinstance(obj, seg.Segment):
            number.append(obj._fd)
            raise KeyboardInterrupt  # as a Ctrl-C landing right after it would
        return done

    monkeypatch.setattr(seg.weakref, "finalize", registered_then_interrupted)
    with pytest.raises(KeyboardInterrupt) as caught:  # its frames keep the half-made segment
        seg.Segment.create(1 << 16, "memfd")
    monkeypatch.undo()
    opened = []
    try:
        while not opened or opened[-1] != number[0]:  # a file of ours takes that number
            opened.append(os.open(os.devnull, os.O_RDONLY))
            assert len(opened) < 100
        del caught
        gc.collect()  # the half-made segment goes, and its finalizer runs
        os.fstat(number[0])  # still ours: EBADF before the fix
    finally:
        for fd in opened:
            with contextlib.suppress(OSError):
                os.close(fd)


def _mapped(ino: int) -> bool:
    """Whether this process maps the shared file with inode number ``ino``."""
    with open("/proc/self/maps") as maps:
        return any(
            len(f) == 6 and f[4] == str(ino) and f[5].endswith("(deleted)\n")
            for f in (line.split(maxsplit=5) for line in maps)
        )


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_interruption_as_a_mapping_is_made_leaves_nothing_mapped(monkeypatch, backend):
    """A Ctrl-C (or a signal handler's exception) during the ``MAP_POPULATE`` of a slab, which
    faults in all of it and takes milliseconds, runs as the call returns: the mapping had no
    owner yet, so nothing ever unmapped it and its memory stayed until the process exited
    (review 13: 29 of 37 mappings of a SIGALRM stress, 300 MB)."""
    import arena.segment as seg

    real, inodes = seg._libc.mmap, []

    def populated_then_interrupted(addr, size, prot, flags, fd, offset):
        got = real(addr, size, prot, flags, fd, offset)
        if fd >= 0:  # the segment's own mapping
            inodes.append(os.fstat(fd).st_ino)
            raise KeyboardInterrupt
        return got

    monkeypatch.setattr(seg._libc, "mmap", populated_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        seg.Segment.create(1 << 20, backend)
    monkeypatch.undo()
    gc.collect()
    assert len(inodes) == 1
    assert not _mapped(inodes[0]), "the interrupted mapping is still there"


def test_a_mapping_whose_finalizer_an_interruption_cut_short_is_unmapped_later(monkeypatch):
    """An interruption at the first line of a mapping's unmapping finalizer (the garbage
    collector prints it; weakref never calls it again) left the mapping, and its memory,
    until the process exited; ``arena.finalizers.run_skipped`` unmaps it."""
    import weakref

    import arena.segment as seg
    from arena import finalizers

    real, cut = weakref.finalize.__call__, []

    def interrupted_first(self, _=None):
        info = self._registry.get(self)
        if not cut and info is not None and info.func is seg._libc.munmap:
            cut.append(True)
            raise KeyboardInterrupt
        return real(self, _)

    made = seg.Segment.create(1 << 20, "memfd")
    ino = made.ino
    monkeypatch.setattr(weakref.finalize, "__call__", interrupted_first)
    made.close()
    del made
    gc.collect()
    monkeypatch.undo()
    assert cut and _mapped(ino)  # skipped: still mapped
    assert finalizers.run_skipped() >= 1
    assert not _mapped(ino)
