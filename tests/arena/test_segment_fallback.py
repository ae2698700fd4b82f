"""What a segment does when a resource runs out: ``auto`` falls back to memfd when ``/dev/shm``
space goes between the check and the reservation; descriptors, address space and memory run out
as shmloader errors that name the resource, the numbers and the fix, in the owner and in an
attacher.

Review 10b (t15): with ``arena_backend="auto"``, 5 of 25 loaders raised ``ArenaCapacityError``
("backend 'posix': No space left on device ... or use arena_backend='memfd' (or 'auto')") when
another process took ``/dev/shm`` space between the free-space check and ``posix_fallocate``.
Here that race is made deterministic by patching what ``arena.segment`` sees.
"""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import resource
import threading
import warnings
from collections.abc import Iterator
from multiprocessing.connection import Connection

import pytest

from arena import segment as segment_mod
from arena._layout import PAGE
from arena.allocator import Arena
from arena.errors import ArenaCapacityError, ArenaDescriptorError
from arena.segment import Backend, Segment

CHILD_TIMEOUT_S = 30.0


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture(autouse=True)
def fresh_fallback_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget that this process already warned about the memfd fallback."""
    monkeypatch.setattr(segment_mod, "_warned_fallback", threading.Event())


@pytest.fixture
def dev_shm_taken_before_the_reservation(monkeypatch: pytest.MonkeyPatch) -> None:
    """``/dev/shm`` looks roomy to every check, but reserving a POSIX segment there fails with
    ``ENOSPC``, as when another process takes the space in between. memfd still reserves."""
    real = os.posix_fallocate

    def full_on_dev_shm(fd: int, offset: int, length: int) -> None:
        if not os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, offset, length)

    monkeypatch.setattr(segment_mod, "shm_free_bytes", lambda path="": 1 << 40)
    monkeypatch.setattr(segment_mod.os, "posix_fallocate", full_on_dev_shm)


def _fallback_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "falls back to anonymous memfd" in str(w.message)]


@pytest.mark.usefixtures("dev_shm_taken_before_the_reservation")
def test_auto_falls_back_to_memfd_when_the_posix_reservation_finds_dev_shm_full():
    fds = open_fds()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = Segment.create(2 * PAGE, "auto")
        second = Segment.create(2 * PAGE, "auto")
    try:
        assert first.backend is Backend.MEMFD and second.backend is Backend.MEMFD
        first.buffer[:5] = b"hello"  # reserved and mapped as any memfd segment
        assert bytes(first.buffer[:5]) == b"hello"
        said = _fallback_warnings(caught)
        assert len(said) == 1, said  # once per process, as resolve_backend's fallback
        assert f"reserving {2 * PAGE:,} bytes" in said[0]
        assert "arena_backend='memfd'" in said[0]
    finally:
        first.close()
        second.close()
    assert open_fds() == fds  # the POSIX descriptor that found no room was closed


@pytest.mark.usefixtures("dev_shm_taken_before_the_reservation")
def test_explicit_posix_still_fails_at_once_with_the_numbers_and_the_fixes():
    fds = open_fds()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ArenaCapacityError) as raised:
            Segment.create(2 * PAGE, "posix")
    message = str(raised.value)
    assert f"cannot reserve {2 * PAGE:,} bytes" in message
    assert "backend 'posix'" in message and os.strerror(errno.ENOSPC) in message
    assert "--shm-size" in message and "arena_backend='memfd'" in message
    assert not _fallback_warnings(caught)
    assert open_fds() == fds


def test_auto_falls_back_when_the_space_goes_between_resolving_and_creating(monkeypatch):
    # The free-space check that chose posix saw room; the one just before reserving does not.
    looks = iter([1 << 40])
    monkeypatch.setattr(segment_mod, "shm_free_bytes", lambda path="": next(looks, 0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seg = Segment.create(2 * PAGE, "auto")
    try:
        assert seg.backend is Backend.MEMFD
        assert len(_fallback_warnings(caught)) == 1
    finally:
        seg.close()


@pytest.mark.usefixtures("dev_shm_taken_before_the_reservation")
def test_an_auto_arena_grows_with_memfd_when_dev_shm_fills_under_it():
    arena = Arena(backend="auto", max_bytes=64 * PAGE, slots_per_slab=2)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = arena.acquire(PAGE)
        assert ref is not None
        assert arena.stats().backend == "memfd"
    finally:
        arena.close()


# --- descriptors -------------------------------------------------------------------------------


def lowest_free_fd() -> int:
    fd = os.dup(0)
    os.close(fd)
    return fd


@pytest.fixture
def no_descriptor_to_spare() -> Iterator[None]:
    """Lower ``ulimit -n`` to the lowest free descriptor number: the next open fails (EMFILE)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free_fd(), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_an_attacher_out_of_descriptors_raises_a_descriptor_error_with_the_numbers():
    seg = Segment.create(4 * PAGE, "memfd")
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        limit = lowest_free_fd()
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))  # a real EMFILE, from the kernel
        try:
            with pytest.raises(ArenaDescriptorError) as raised:
                Segment.attach(seg.spec)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    finally:
        seg.close()
    message = str(raised.value)
    assert f"slab of {4 * PAGE:,} bytes" in message
    assert "Too many open files" in message
    assert f"`ulimit -n` = {limit}" in message and "descriptors open" in message
    assert "worker_init_fn" in message and "RLIMIT_NOFILE" in message
    assert "num_workers" in message
    assert "owner may have exited" not in message  # not the wording for a gone owner


def test_an_attacher_facing_a_full_system_file_table_says_so(monkeypatch):
    def enfile(owner_pid: int, fd: int, flags: int) -> int:
        raise OSError(errno.ENFILE, os.strerror(errno.ENFILE))

    seg = Segment.create(PAGE, "memfd")
    monkeypatch.setattr(segment_mod, "reopen_descriptor", enfile)
    try:
        with pytest.raises(ArenaDescriptorError, match=r"fs\.file-max"):
            Segment.attach(seg.spec)
    finally:
        seg.close()


@pytest.mark.parametrize("err", [errno.ENOENT, errno.ESRCH])
def test_an_owner_that_is_gone_keeps_its_wording(monkeypatch, err):
    def gone(owner_pid: int, fd: int, flags: int) -> int:
        raise OSError(err, os.strerror(err))

    seg = Segment.create(PAGE, "memfd")
    monkeypatch.setattr(segment_mod, "reopen_descriptor", gone)
    try:
        with pytest.raises(OSError) as raised:
            Segment.attach(seg.spec)
    finally:
        seg.close()
    assert raised.value.errno == err
    assert not isinstance(raised.value, ArenaDescriptorError)
    assert "the owner may have exited" in str(raised.value)


def test_an_attacher_refuses_a_descriptor_number_that_now_names_another_segment():
    gone = Segment.create(PAGE, "memfd")
    spec = gone.spec
    gone.close()
    other = Segment.create(PAGE, "memfd")  # the lowest free number: the one just closed
    try:
        assert other.owner_fd == spec.fd and other.size == spec.size
        with pytest.raises(OSError, match="now names another file; the owner gave the segment"):
            Segment.attach(spec)
    finally:
        other.close()


@pytest.mark.usefixtures("no_descriptor_to_spare")
def test_the_descriptor_error_names_what_the_segment_is_for():
    with pytest.raises(ArenaDescriptorError) as raised:
        Segment.create(PAGE, "memfd", purpose="the frobnicator's ring")
    message = str(raised.value)
    assert "for the frobnicator's ring" in message and "`ulimit -n` = " in message
    assert "batches you hold" not in message
    with pytest.raises(ArenaDescriptorError, match="batches you hold"):
        Segment.create(PAGE, "memfd")  # an arena slab: the default


# --- address space -----------------------------------------------------------------------------


def _vm_size() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


def _map_under_address_space_limit(spec: segment_mod.SegmentSpec | None, conn: Connection) -> None:
    """In a child: cap the address space just above what it maps now, then attach ``spec`` (or,
    without one, create a segment); send back the error's type and text."""
    limit = _vm_size() + (1 << 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
    try:
        if spec is None:
            Segment.create(64 << 20, "memfd")
        else:
            Segment.attach(spec, populate=False)
    except Exception as e:  # noqa: BLE001 - reported to the parent
        conn.send((type(e).__name__, str(e), limit))
    else:
        conn.send(("no error", "", limit))
    conn.close()


def _in_child(spec: segment_mod.SegmentSpec | None) -> tuple[str, str, int]:
    parent, child = mp.get_context("fork").Pipe(duplex=False)
    p = mp.get_context("fork").Process(target=_map_under_address_space_limit, args=(spec, child))
    p.start()
    child.close()
    try:
        assert parent.poll(CHILD_TIMEOUT_S), "the child did not report"
        got: tuple[str, str, int] = parent.recv()
    finally:
        p.join(CHILD_TIMEOUT_S)
        parent.close()
    return got


@pytest.mark.parametrize("side", ["attacher", "owner"])
def test_a_mapping_over_the_address_space_limit_is_a_capacity_error_with_the_numbers(side):
    seg = Segment.create(64 << 20, "memfd") if side == "attacher" else None
    try:
        kind, message, limit = _in_child(None if seg is None else seg.spec)
    finally:
        if seg is not None:
            seg.close()
    assert kind == "ArenaCapacityError", (kind, message)
    assert f"slab of {64 << 20:,} bytes" in message
    assert f"RLIMIT_AS) is {limit:,} bytes" in message and "`ulimit -v`" in message
    assert "worker_init_fn" in message and "arena_slots_per_slab" in message


def test_a_mapping_refused_without_an_address_space_limit_says_there_is_none(monkeypatch):
    def refused(fd: int, size: int, populate: bool = True, prot: int = 0) -> object:
        raise OSError(errno.ENOMEM, "mmap failed")

    monkeypatch.setattr(segment_mod, "_map", refused)
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    fds = open_fds()
    with pytest.raises(ArenaCapacityError) as raised:
        Segment.create(PAGE, "memfd")
    assert open_fds() == fds
    if soft == resource.RLIM_INFINITY:
        assert "no address-space limit" in str(raised.value)
    assert f"slab of {PAGE:,} bytes" in str(raised.value)
