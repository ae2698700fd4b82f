"""Shared-memory segments: create (owner), attach (any process), close. The only module that
touches shared-memory names and segment file descriptors.

Backends:
- ``posix``: a file on the ``/dev/shm`` tmpfs, bounded by that mount's size: unnamed
  (``O_TMPFILE``) where the kernel allows, else ``shm_open`` through ``posix_ipc``.
- ``memfd``: ``memfd_create``; anonymous, bounded only by RAM (and the memory cgroup), not by
  the ``/dev/shm`` mount — so it works inside Docker's default 64 MB ``/dev/shm``.
- ``auto`` (default): ``posix`` when the request fits in ``/dev/shm``'s free space, else ``memfd``
  with a one-time warning. The space is checked and then reserved; if another process takes it
  in between (the reservation fails with ``ENOSPC``), ``auto`` still falls back to ``memfd``
  (same warning). Only an explicit ``posix`` fails for want of ``/dev/shm`` space.

Invariants:
- A POSIX segment has no name at all (``O_TMPFILE``); where that is unavailable its name exists
  only inside :meth:`Segment.create`: it is unlinked before ``create`` returns.
  Attachers never need it, because they reopen the owner's descriptor through
  ``/proc/<owner_pid>/fd/<fd>``. So a SIGKILLed owner can leave nothing in ``/dev/shm``.
- The bytes are physically reserved (``posix_fallocate``) before ``create`` returns: running out of
  shared memory is an :class:`ArenaCapacityError` at creation, never a SIGBUS at first write.
- Every mapping is pre-faulted (``MAP_POPULATE``), in the owner and in each attacher, so steady
  state takes no page faults.
- ``close()`` unmaps and closes this process's handle; it is idempotent. If views still export the
  mapping, the mapping is left to die with the last view (it is never pulled out from under them),
  and at interpreter exit it is left to the kernel: a view may be read until the process ends.
- Only the owner keeps a descriptor (attachers reopen it through ``/proc``); an attacher closes
  its own as soon as the segment is mapped, so a process needs one descriptor per slab only where
  the arena lives.
- Running out of a resource is an :class:`ArenaError` that names it, the numbers and the fix, in
  the owner and in an attacher alike: descriptors (``EMFILE``/``ENFILE``, ``ulimit -n``) are an
  :class:`ArenaDescriptorError`; address space or memory for the mapping (``mmap`` ``ENOMEM``,
  ``ulimit -v``) and shared-memory space are an :class:`ArenaCapacityError`. An attach that fails
  because the owner's descriptor is gone (``ENOENT``/``ESRCH``: the owner exited, or gave the
  segment back) stays an ``OSError`` saying so. Each error takes one string argument, so torch's
  ``ExceptionWrapper`` re-raises it in another process with its type and text.
- Ownership: the creating process is the owner; the memory is freed by the kernel when the last
  descriptor and mapping in any process are gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import errno
import itertools
import mmap
import os
import resource
import secrets
import threading
import weakref
from dataclasses import dataclass

import posix_ipc

from arena import userwarn
from arena.errors import ArenaCapacityError, ArenaDescriptorError, ArenaError
from arena.finalizers import on_death

SHM_DIR = "/dev/shm"
_NAME_PREFIX = "/shmloader-"
_counter = itertools.count()
_warned_fallback = threading.Event()


class Backend(str, enum.Enum):
    """Where a segment's bytes live."""

    AUTO = "auto"
    POSIX = "posix"
    MEMFD = "memfd"


@dataclass(frozen=True)
class SegmentSpec:
    """Everything another process needs to attach: pickles as five small fields, never bytes.
    ``ino`` is the segment's inode number (0: not checked): an attacher that reopens the owner's
    ``fd`` after the owner closed it, and the number now names another file, refuses to map it."""

    owner_pid: int
    fd: int
    size: int
    backend: Backend
    ino: int = 0


def shm_free_bytes(path: str = SHM_DIR) -> int:
    """Bytes an unprivileged process may still allocate on the tmpfs at ``path`` (0 if absent)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def mem_available_bytes() -> int:
    """``MemAvailable`` from ``/proc/meminfo``: what memfd segments can still take."""
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0  # pragma: no cover - every Linux since 3.14 has MemAvailable


def store_bytes(backend: Backend) -> int:
    """The whole size of the store a segment of ``backend`` takes its memory from: the
    ``/dev/shm`` mount (POSIX) or the machine's RAM (memfd)."""
    if backend is Backend.POSIX:
        try:
            st = os.statvfs(SHM_DIR)
        except OSError:
            return 0
        return st.f_blocks * st.f_frsize
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _capacity_error(nbytes: int, backend: Backend, cause: str) -> ArenaCapacityError:
    error = ArenaCapacityError(
        f"cannot reserve {nbytes:,} bytes of shared memory with backend {backend.value!r}: "
        f"{cause}. "
        f"/dev/shm has {shm_free_bytes():,} bytes free; RAM has {mem_available_bytes():,} bytes "
        "available. Fixes: give the container more shared memory (docker run --shm-size=8g), "
        "keep fewer batches in flight (lower prefetch_factor or num_workers, or arena_max_bytes), "
        "or use arena_backend='memfd' (or 'auto'), which is not bounded by the /dev/shm mount."
    )
    error.never = nbytes > store_bytes(backend)
    return error


DESCRIPTOR_HEADROOM = 8  # descriptors left free for the rest of the process when making a slab


def _open_descriptors() -> int:
    """How many descriptors this process has open (its limit when not one is left to count
    them with; -1 when ``/proc`` cannot tell)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # minus the one listdir itself holds
    except OSError as e:
        if e.errno == errno.EMFILE:
            return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return -1


def _check_descriptor_room(purpose: str | None = None) -> None:
    """Raise the descriptor error before making a segment would leave the process none to spare
    (``purpose``: see :func:`_descriptor_error`)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and _open_descriptors() + DESCRIPTOR_HEADROOM >= soft:
        raise _descriptor_error(purpose)


_RAISE_NOFILE = "raise the limit (`ulimit -n 65536`, or resource.setrlimit(RLIMIT_NOFILE))"


def _descriptor_error(purpose: str | None = None) -> ArenaDescriptorError:
    """The owner ran out of descriptors making a segment. ``purpose`` (a phrase after "for")
    says what the segment is for; ``None`` means another slab of an arena that grows because the
    batches the user holds fill the slabs it has, and adds the fixes for that."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    open_fds = _open_descriptors()
    if purpose is not None:
        return ArenaDescriptorError(
            f"Too many open files: this process has {open_fds} descriptors open, too close to "
            f"its limit `ulimit -n` = {soft} for {purpose}. Fixes: {_RAISE_NOFILE}, or close "
            "descriptors the program keeps open."
        )
    return ArenaDescriptorError(
        f"Too many open files: this process has {open_fds} descriptors open, too close to its "
        f"limit `ulimit -n` = {soft} for another arena slab; the shmloader arena holds one "
        "descriptor per slab here (its workers hold none), and it needs another slab because the "
        f"batches you hold fill the ones it has. Fixes: {_RAISE_NOFILE}, hold fewer batches (drop "
        "references, .clone() what you keep, shmloader.release(batch, loader)), or make each "
        "slab hold more batches (arena_slots_per_slab)."
    )


def _attach_descriptor_error(spec: SegmentSpec, err: int) -> ArenaDescriptorError:
    """An attacher could not open the one descriptor it needs for a moment to map a segment."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = "unlimited" if soft == resource.RLIM_INFINITY else str(soft)
    if err == errno.ENFILE:
        cause = (
            "the system's table of open files is full (`/proc/sys/fs/file-max`, "
            f"`sysctl fs.file-max`); this process has {_open_descriptors()} descriptors open, "
            f"its limit `ulimit -n` = {limit}"
        )
    else:
        cause = (
            f"this process (pid {os.getpid()}) has {_open_descriptors()} descriptors open, as "
            f"many as its limit `ulimit -n` = {limit} allows"
        )
    return ArenaDescriptorError(
        f"cannot attach a shared-memory slab of {spec.size:,} bytes (fd {spec.fd} of process "
        f"{spec.owner_pid}): {os.strerror(err)}: {cause}. Mapping a slab takes one descriptor "
        "for a moment (it is closed once the slab is mapped). Fixes: raise the limit in this "
        "process (in a DataLoader worker: resource.setrlimit(RLIMIT_NOFILE, ...) from "
        "worker_init_fn, or `ulimit -n 65536` before starting Python), close descriptors the "
        "dataset keeps open, or use fewer workers (num_workers)."
    )


def _vm_size() -> int:
    """This process's mapped address space in bytes (``VmSize``), or -1 if unreadable."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return -1


def _map_capacity_error(size: int, err: int) -> ArenaCapacityError:
    """``mmap`` of a segment failed with ``ENOMEM``: the address space or memory it needs is not
    there. Names the address-space limit when one is set, since that is the usual cause."""
    cause, fixes = no_address_space()
    return ArenaCapacityError(
        f"cannot map a shared-memory slab of {size:,} bytes: {os.strerror(err)}: {cause}. "
        f"Fixes: {fixes}, or make slabs smaller: smaller batches (batch_size) or fewer slots "
        "per slab (arena_slots_per_slab)."
    )


def no_address_space() -> tuple[str, str]:
    """Why a mapping of this process failed with ``ENOMEM``, and how to fix it: the
    address-space limit when one is set (the usual cause), else the kernel's refusal."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    vm = _vm_size()
    mapped = f"{vm:,} bytes" if vm >= 0 else "an unknown number of bytes"
    if soft != resource.RLIM_INFINITY:
        cause = (
            f"this process (pid {os.getpid()}) maps {mapped} already and its address-space "
            f"limit (`ulimit -v`, RLIMIT_AS) is {soft:,} bytes"
        )
        fixes = (
            "raise or lift that limit (resource.setrlimit(RLIMIT_AS, ...); in a DataLoader "
            "worker, from worker_init_fn, or `ulimit -v` before starting Python)"
        )
    else:
        cause = (
            f"this process (pid {os.getpid()}) maps {mapped} already; it has no address-space "
            "limit (`ulimit -v` unlimited), so the kernel refused the mapping itself (memory "
            "overcommit, vm.max_map_count, or the memory cgroup)"
        )
        fixes = "give the process more memory"
    return cause, fixes


def _attach_error(spec: SegmentSpec, err: int) -> ArenaError | OSError:
    """Why reopening the owner's descriptor of ``spec`` failed, as the error to raise."""
    if err in (errno.EMFILE, errno.ENFILE):
        return _attach_descriptor_error(spec, err)
    where = (
        f"cannot attach shared-memory segment fd {spec.fd} of process {spec.owner_pid} "
        f"through /proc: {os.strerror(err)}"
    )
    if err in (errno.ENOENT, errno.ESRCH):
        return OSError(
            err,
            f"{where}; the owner may have exited (or given the segment back), or /proc is not "
            "readable in this container",
        )
    if err in (errno.EACCES, errno.EPERM):
        return OSError(
            err,
            f"{where}; this process may not open the owner's descriptors (ptrace restrictions, "
            "e.g. kernel.yama.ptrace_scope, or a different user)",
        )
    return OSError(err, where)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED = 0x10  # Linux; the mmap module does not export it
_MADV_POPULATE_WRITE = 23  # Linux 5.14
_MAP_NORESERVE = 0x4000  # Linux
_PROT_NONE = 0


def _mmap(addr: int | None, size: int, prot: int, flags: int, fd: int, what: str) -> int:
    """libc ``mmap``; its failure is an ``OSError`` with its errno, saying ``what`` was mapped."""
    got = _libc.mmap(addr, size, prot, flags, fd, 0)
    if got is None or got == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap {what} of {size:,} bytes failed: {os.strerror(err)}")
    return int(got)


def _map(
    fd: int, size: int, populate: bool = True, prot: int = mmap.PROT_READ | mmap.PROT_WRITE
) -> ctypes.Array[ctypes.c_char]:
    """Map ``size`` bytes of ``fd`` shared (pre-faulted with ``populate``), as a ctypes array
    that unmaps itself when the last object referring to it (every view made from it does) is
    gone.

    Python's ``mmap.mmap`` keeps a duplicate of the descriptor for the mapping's life (until
    Python 3.13's ``trackfd``): one descriptor per slab in every process. The kernel needs none
    once the mapping exists, so this maps through libc instead.

    An interruption (Ctrl-C, a signal handler's exception) that arrives during the mapping call
    runs as it returns: with ``MAP_POPULATE`` that call faults the whole segment in, milliseconds
    for a large slab, and a mapping returned to nobody would hold its memory until the process
    exits. So the address range is reserved first (inaccessible, no memory: a fast call) and
    handed to the array and its unmapping finalizer; the segment is then mapped over it
    (``MAP_FIXED``). An interruption after the reservation unmaps whatever the range holds
    with the array; one in the reservation's own few steps can leave only address space."""
    reserve = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
    addr = _mmap(None, size, _PROT_NONE, reserve, -1, "(the address range)")
    array = (ctypes.c_char * size).from_address(addr)
    # Not at interpreter exit: weakref's exit hook would run this while views still live, and
    # code that runs after it (an atexit handler registered earlier, a ``__del__``, logging's
    # flush of buffered records, a daemon thread) would read unmapped memory. The kernel unmaps
    # everything when the process ends.
    on_death(array, _libc.munmap, addr, size, atexit=False)
    flags = mmap.MAP_SHARED | _MAP_FIXED | (mmap.MAP_POPULATE if populate else 0)
    _mmap(addr, size, prot, flags, fd, "(the segment)")
    return array


def map_readonly(fd: int, size: int) -> memoryview:
    """Map ``size`` bytes of the file ``fd`` read-only and shared, as a byte memoryview that
    unmaps itself when the last object referring to it is gone. Unlike ``mmap.mmap`` (before
    Python 3.13), it keeps no duplicate of ``fd``: a caller that keeps ``fd`` holds one
    descriptor per file, not two."""
    return memoryview(_map(fd, size, populate=False, prot=mmap.PROT_READ)).cast("B")


def reopen_descriptor(owner_pid: int, fd: int, flags: int) -> int:
    """A new descriptor of the file that process ``owner_pid``'s descriptor ``fd`` names (a
    ``dup`` in that process itself; else through ``/proc/<owner_pid>/fd/<fd>``), close-on-exec.
    Raises ``OSError`` when it cannot be reached."""
    if owner_pid == os.getpid():
        return os.dup(fd)  # (not inheritable)
    return os.open(f"/proc/{owner_pid}/fd/{fd}", flags | os.O_CLOEXEC)


def privatize(addr: int, nbytes: int) -> None:
    """Replace ``[addr, addr + nbytes)`` of a shared mapping, in this process only, by private
    anonymous pages holding the same bytes (``addr`` and ``nbytes`` whole pages). Afterwards
    writes through other processes' mappings of the segment no longer show here, nor this
    process's there; unmapping the whole mapping later unmaps these pages too."""
    saved = ctypes.string_at(addr, nbytes)
    private = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED
    _mmap(addr, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, private, -1, "(a private copy)")
    ctypes.memmove(addr, saved, nbytes)


def forsake(addr: int, nbytes: int) -> None:
    """Replace ``[addr, addr + nbytes)`` of a shared mapping, in this process only, by private
    zero pages that take no memory until written (``addr`` and ``nbytes`` whole pages). For a
    forked child that will never read those bytes: it no longer keeps the segment's memory
    alive once every other process lets it go. The address range stays reserved, so unmapping
    the whole mapping later cannot hit a mapping made there since."""
    zeros = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED | _MAP_NORESERVE
    _mmap(addr, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, zeros, -1, "(zero pages over shared)")


def resolve_backend(backend: Backend | str, nbytes: int) -> Backend:
    """The concrete backend ``auto`` picks for a request of ``nbytes`` (by the free space now;
    :meth:`Segment.create` also falls back when the space goes before it is reserved)."""
    backend = Backend(backend)
    if backend is not Backend.AUTO:
        return backend
    if nbytes <= shm_free_bytes():
        return Backend.POSIX
    _warn_fallback(
        f"/dev/shm has {shm_free_bytes():,} bytes free, fewer than the {nbytes:,} requested"
    )
    return Backend.MEMFD


def _warn_fallback(why: str) -> None:
    """Warn, once per process, that ``auto`` moved to memfd because of ``why``."""
    if not _warned_fallback.is_set():
        _warned_fallback.set()
        userwarn.warn(
            f"{why}; shmloader falls back to anonymous memfd shared memory, which is bounded by "
            "RAM, not by the /dev/shm mount. Pass arena_backend='memfd' to silence this warning.",
            UserWarning,
        )


class _NoRoomInShm(Exception):  # internal: never leaves Segment.create
    """``/dev/shm`` has no room for a POSIX segment: ``auto`` falls back, ``posix`` fails."""

    def __init__(self, cause: str) -> None:
        super().__init__(cause)
        self.cause = cause


def _open_tmpfile() -> int:
    """An unnamed file on the /dev/shm tmpfs (``O_TMPFILE``): it counts against that mount like
    a POSIX segment but never has a name, so no crash at any moment can leave one behind."""
    return os.open(SHM_DIR, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)


def _open_posix(nbytes: int) -> int:
    try:
        return _open_tmpfile()
    except OSError as e:
        if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOSPC):
            raise  # out of descriptors or space: a named segment would be too
    # No O_TMPFILE there (an old kernel, another filesystem): a named POSIX segment, unlinked
    # at once; only a crash inside this window can leave its name behind.
    name = f"{_NAME_PREFIX}{os.getpid()}-{next(_counter)}-{secrets.token_hex(4)}"
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600)
    try:
        fd = os.dup(shm.fd)
    finally:
        shm.close_fd()
        # The name never outlives create(); attachers use /proc/<pid>/fd. If something else
        # removed it already, that is the outcome we want.
        with contextlib.suppress(posix_ipc.ExistentialError):
            shm.unlink()
    return fd


def _reserve(fd: int, nbytes: int, backend: Backend) -> None:
    """Size ``fd`` and reserve its bytes now. ``/dev/shm`` full is :class:`_NoRoomInShm` (for
    POSIX; :meth:`Segment.create` decides), RAM full an :class:`ArenaCapacityError`."""
    os.ftruncate(fd, nbytes)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno == errno.ENOSPC and backend is Backend.POSIX:
            raise _NoRoomInShm(os.strerror(e.errno)) from None
        if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise _capacity_error(nbytes, backend, os.strerror(e.errno)) from None
        raise


class Mapping:
    """Where a segment is mapped in this process, for as long as it is: also after the segment
    closed, while views of it keep the mapping (weak: it keeps nothing alive itself)."""

    __slots__ = ("_alive", "address", "size")

    def __init__(self, array: ctypes.Array[ctypes.c_char], size: int) -> None:
        self.address = ctypes.addressof(array)
        self.size = size
        self._alive = weakref.ref(array)  # its finalizer unmaps the range

    def held(self) -> ctypes.Array[ctypes.c_char] | None:
        """The mapping's array (holding it keeps the range mapped), or None once unmapped."""
        return self._alive()

    def alive(self) -> bool:
        """Whether the range is still mapped here (some view of it lives)."""
        return self._alive() is not None

    def let_go_after_fork(self, keep: list[tuple[int, int]]) -> None:
        """In a forked child: replace the mapping, but for the ``(address, bytes)`` ranges in
        ``keep``, by empty private pages (:func:`forsake`); nothing when it is gone. The range
        stays reserved for the mapping's own finalizer to unmap."""
        array = self.held()  # held for the call: the range cannot be unmapped under it
        if array is None:
            return
        at, end = self.address, self.address + self.size
        for lo, n in sorted(r for r in keep if self.address <= r[0] < end):
            if lo > at:
                forsake(at, lo - at)
            at = max(at, lo + n)
        if at < end:
            forsake(at, end - at)


class _Fd:
    """A descriptor that is closed at most once, by whichever of its holders gets there first
    (the segment's finalizer, or the error path of the code that made the segment: an
    interruption between the two must not close a number that another file has taken since)."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


class Segment:
    """One shared-memory segment mapped into this process.

    Create with :meth:`create` (owner) or :meth:`attach` (any process, from a :class:`SegmentSpec`).
    """

    # Class-level defaults make close() safe on a half-built object.
    _fd: int = -1
    _fd_closer: weakref.finalize | None = None  # type: ignore[type-arg]
    _mapping: ctypes.Array[ctypes.c_char] | None = None
    ino: int = 0  # the inode number (in the owner, and in an attacher from its spec)

    def __init__(
        self,
        fd: _Fd,
        size: int,
        backend: Backend,
        owner_pid: int,
        owner_fd: int | None = None,
        populate: bool = True,
        ino: int | None = None,
    ) -> None:
        try:
            self._mapping = _map(fd.fd, size, populate)
        except OSError as e:
            if e.errno == errno.ENOMEM:
                raise _map_capacity_error(size, e.errno) from None
            raise
        # The owner's descriptor number: what any process reopens through /proc (an attacher's
        # own descriptor number means nothing in the owner's fd table).
        self.owner_fd = fd.fd if owner_fd is None else owner_fd
        if owner_fd is None:
            self._fd = fd.fd
            self.ino = os.fstat(fd.fd).st_ino
            # A segment dropped without close() still gives its descriptor back.
            self._fd_closer = on_death(self, fd.close)
        else:
            self.ino = 0 if ino is None else ino
            # An attacher needs no descriptor once mapped: one per slab per process would run
            # into `ulimit -n` when a user holds many batches.
            fd.close()
        self.size = size
        self.backend = backend
        self.owner_pid = owner_pid
        self.buffer: memoryview = memoryview(self._mapping).cast("B")
        # Where it is mapped in this process, while it is (its finalizer unmaps it), closed or
        # not: what a child forked after the close lets go of (Mapping.let_go_after_fork).
        self.mapping = Mapping(self._mapping, size)
        self.address = self.mapping.address

    @classmethod
    def create(
        cls, nbytes: int, backend: Backend | str = Backend.AUTO, purpose: str | None = None
    ) -> Segment:
        """Create, reserve and pre-fault ``nbytes`` of shared memory owned by this process.

        With ``auto``, a POSIX segment that finds ``/dev/shm`` full when it reserves (the space
        was free when :func:`resolve_backend` looked, and another process took it) is made with
        memfd instead, with the one-time fallback warning; an explicit ``posix`` raises
        :class:`ArenaCapacityError`. ``purpose`` names what the segment is for in the
        descriptor error (:func:`_descriptor_error`; default: another arena slab)."""
        if nbytes <= 0:
            raise ValueError(f"segment size must be positive, got {nbytes}")
        requested = Backend(backend)
        chosen = resolve_backend(requested, nbytes)
        if chosen is Backend.POSIX:
            try:
                return cls._create(nbytes, Backend.POSIX, purpose)
            except _NoRoomInShm as full:
                if requested is not Backend.AUTO:
                    raise _capacity_error(nbytes, Backend.POSIX, full.cause) from None
            _warn_fallback(
                f"/dev/shm ran out of space reserving {nbytes:,} bytes "
                f"({shm_free_bytes():,} bytes free now)"
            )
        return cls._create(nbytes, Backend.MEMFD, purpose)

    @classmethod
    def _create(cls, nbytes: int, backend: Backend, purpose: str | None) -> Segment:
        """:meth:`create` with a concrete backend. Raises :class:`_NoRoomInShm` when a POSIX
        segment finds ``/dev/shm`` too small, before or while reserving."""
        _check_descriptor_room(purpose)  # first: the checks below open files too
        if backend is Backend.POSIX and nbytes > shm_free_bytes():
            raise _NoRoomInShm("/dev/shm is too small")
        if backend is Backend.MEMFD and nbytes > mem_available_bytes():
            raise _capacity_error(nbytes, backend, "not enough available RAM")
        try:
            if backend is Backend.POSIX:
                fd = _open_posix(nbytes)
            else:
                fd = os.memfd_create("shmloader-slab", os.MFD_CLOEXEC)
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE):
                raise _descriptor_error(purpose) from e
            if e.errno == errno.ENOSPC and backend is Backend.POSIX:
                raise _NoRoomInShm(os.strerror(e.errno)) from None
            raise
        box = _Fd(fd)
        try:
            _reserve(fd, nbytes, backend)
            return cls(box, nbytes, backend, os.getpid())
        except BaseException:
            box.close()
            raise

    @classmethod
    def attach(cls, spec: SegmentSpec, populate: bool = True) -> Segment:
        """Map the owner's segment into this process (any start method, any time). Without
        ``populate`` nothing is faulted in now (:meth:`populate` does it range by range):
        faulting in a range the owner hollowed would fill it again.

        Raises :class:`ArenaDescriptorError` when this process has no descriptor to spare
        (``EMFILE``/``ENFILE``), :class:`ArenaCapacityError` when it cannot map the bytes
        (``ENOMEM``, e.g. under ``ulimit -v``), and ``OSError`` when the owner's descriptor
        cannot be reached (the owner exited or closed it, or ``/proc`` is not readable)."""
        try:
            fd = reopen_descriptor(spec.owner_pid, spec.fd, os.O_RDWR)
        except OSError as e:
            raise _attach_error(spec, e.errno or 0) from None
        box = _Fd(fd)
        try:
            st = os.fstat(fd)
            if st.st_size != spec.size or (spec.ino and st.st_ino != spec.ino):
                # The owner closed the segment and its descriptor number now names another file:
                # mapping that would map the wrong memory (or past its end).
                raise OSError(
                    errno.ENOENT,
                    f"cannot attach shared-memory segment fd {spec.fd} of process "
                    f"{spec.owner_pid}: that descriptor now names another file; the owner gave "
                    "the segment back (closed it)",
                )
            return cls(box, spec.size, spec.backend, spec.owner_pid, spec.fd, populate, st.st_ino)
        except BaseException:
            box.close()
            raise

    def let_go_after_fork(self, keep: list[tuple[int, int]]) -> None:
        """In a forked child: stop sharing this segment, but for the ``(address, bytes)`` ranges
        in ``keep``. The rest of the mapping becomes empty private pages (:func:`forsake`) and
        the inherited descriptor is closed, so once the owner lets the memory go, this child
        does not keep it alive. Later, this object closes nothing more in the child. A segment
        closed in the parent whose mapping views still keep is let go of too (review 22)."""
        self.mapping.let_go_after_fork(keep)
        gone = self._fd_closer.detach() if self._fd_closer is not None else None
        if gone is not None:
            gone[1]()  # close the inherited copy: the owner keeps its own
        self._fd = -1

    def punch(self, offset: int, nbytes: int) -> bool:
        """Give the memory of ``[offset, offset + nbytes)`` (whole pages) back to the system:
        the bytes read as zeros afterwards, in every process that maps the segment, and take no
        memory (or /dev/shm space) until written again. Works after :meth:`close` while views
        still keep the mapping. False when it cannot (the mapping is gone, or the kernel
        refuses ``MADV_REMOVE``); then nothing changed."""
        mapping = self.mapping.held()  # held for the call: the range cannot be unmapped under it
        if mapping is None:
            return False
        return bool(_libc.madvise(self.address + offset, nbytes, mmap.MADV_REMOVE) == 0)

    def populate(self, offset: int, nbytes: int) -> None:
        """Fault ``[offset, offset + nbytes)`` in for writing now, as a populated mapping would
        have been (``MADV_POPULATE_WRITE``; where the kernel lacks it, pages fault on first
        write instead)."""
        mapping = self.mapping.held()
        if mapping is not None:
            _libc.madvise(self.address + offset, nbytes, _MADV_POPULATE_WRITE)

    def recommit(self, offset: int, nbytes: int) -> bool:
        """Reserve the memory of a punched range again (owner only), so that writing it cannot
        fail for want of room later (a write into a full tmpfs is a SIGBUS). False when there
        is no room, or this process holds no descriptor of the segment."""
        if self._fd < 0:
            return False
        try:
            os.posix_fallocate(self._fd, offset, nbytes)
        except OSError:
            return False
        return True

    @property
    def spec(self) -> SegmentSpec:
        """What another process needs to attach this segment."""
        return SegmentSpec(self.owner_pid, self.owner_fd, self.size, self.backend, self.ino)

    @property
    def closed(self) -> bool:
        return self._mapping is None

    def close(self) -> None:
        """Close this process's handle. Idempotent. The mapping itself goes when the last view
        of it does (never from under a live view)."""
        if self._mapping is not None:
            with contextlib.suppress(BufferError):  # views still export it: they keep it
                self.buffer.release()
        self._mapping = None
        self._fd = -1
        if self._fd_closer is not None:
            self._fd_closer()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"fd={self._fd}"
        return f"Segment(size={self.size:,}, backend={self.backend.value}, {state})"
