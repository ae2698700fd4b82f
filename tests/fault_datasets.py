"""Top-level (picklable) datasets, collates, init functions and child-process scenarios for the
fault-injection and bad-input tests (tests/test_faults.py, tests/test_bad_input.py).

Synchronisation with workers goes through :class:`Gate`: the worker that loads the gated index
says so (``reached``) and waits, bounded, for ``go``; the test then acts (kills a process, sends a
signal) knowing exactly where everyone is. No sleeps stand in for synchronisation.

Run as a script, this module is the *child process* whose death, Ctrl-C or exit the tests
observe (it prints one JSON line describing its loader on stdout)::

    python -m tests.fault_datasets block-in-next [--persistent]   # blocks in next() on a gate
    python -m tests.fault_datasets break [--persistent]           # iterates, breaks, exits
    python -m tests.fault_datasets small-shm                      # run inside a 64 MB /dev/shm
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import select
import signal
import struct
import sys
import threading
import traceback
import warnings
import weakref
from multiprocessing.connection import Connection
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset

GATE_WAIT_S = 60.0  # longest a gated worker waits for ``go``: a bound, never reached in a pass


class Gate:
    """A handshake with the worker that loads one index, over pipes.

    Pipes, not ``multiprocessing.Event``: an Event's ``set()`` waits for every sleeper to wake,
    so it would hang forever once a sleeping worker has been killed — exactly what these tests do.

    The worker that loads the gated index writes its pid to ``reached``, then waits up to
    :data:`GATE_WAIT_S` until the test either opens the gate (:meth:`open`; ``go`` stays readable
    for good, so later loads pass straight through) or tells it to exit (:meth:`exit_worker`; the
    worker consumes that byte and calls ``os._exit(exit_code)``). Made before the loader, the
    pipes reach the workers by fork.
    """

    def __init__(self, exit_code: int = 3) -> None:
        self.exit_code = exit_code
        self._reached_r, self._reached_w = os.pipe()
        self._go_r, self._go_w = os.pipe()
        self._die_r, self._die_w = os.pipe()
        fds = (self._reached_r, self._reached_w, self._go_r, self._go_w, self._die_r, self._die_w)
        weakref.finalize(self, _close_all, fds)

    def arrive(self) -> None:
        """Called by the worker loading the gated index."""
        os.write(self._reached_w, struct.pack("<i", os.getpid()))
        ready, _, _ = select.select([self._go_r, self._die_r], [], [], GATE_WAIT_S)
        if not ready:
            raise TimeoutError(f"gate not opened within {GATE_WAIT_S} s")
        if self._die_r in ready and self._go_r not in ready:
            os.read(self._die_r, 1)
            os._exit(self.exit_code)

    def wait_reached(self, timeout: float = 30.0) -> int:
        """The pid of the next worker to reach the gate, once one is there."""
        return _read_pid(self._reached_r, timeout, "no worker reached the gate")

    def open(self) -> None:
        """Let the waiting worker (and every later one) through."""
        os.write(self._go_w, b"g")

    def exit_worker(self) -> None:
        """Make the waiting worker exit with ``exit_code``."""
        os.write(self._die_w, b"x")


def _read_pid(fd: int, timeout: float, none: str) -> int:
    """A pid another process writes to pipe ``fd``, waited for up to ``timeout`` seconds."""
    ready, _, _ = select.select([fd], [], [], timeout)
    if not ready:
        raise TimeoutError(f"{none} within {timeout} s")
    (pid,) = struct.unpack("<i", os.read(fd, 4))
    return int(pid)


def _close_all(fds: tuple[int, ...]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class Ramp(Dataset):
    """Sample i: a float32 vector of ``width`` values i."""

    def __init__(self, n: int, width: int = 4) -> None:
        self.n = n
        self.width = width

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((self.width,), float(i))


class Gated(Dataset):
    """Sample i: a float32 vector of ``width`` values i. Loading ``gate_index`` goes through
    ``gate`` (see :class:`Gate`), holding ``ballast_bytes`` of private memory while it waits
    (a memory-hungry sample, the kind the OOM killer picks); every other index loads at once."""

    def __init__(
        self, n: int, gate_index: int, gate: Gate, width: int = 4, ballast_bytes: int = 0
    ) -> None:
        self.n = n
        self.gate_index = gate_index
        self.gate = gate
        self.width = width
        self.ballast_bytes = ballast_bytes

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.gate_index:
            ballast = torch.ones(self.ballast_bytes, dtype=torch.uint8)
            self.gate.arrive()
            del ballast
        return torch.full((self.width,), float(i))


class TwoGates(Dataset):
    """Like :class:`Gated` with two gated indices, so two workers can be held at once."""

    def __init__(self, n: int, gates: dict[int, Gate]) -> None:
        self.n = n
        self.gates = gates

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i in self.gates:
            self.gates[i].arrive()
        return torch.full((4,), float(i))


class ForksAHelperThenGated(Gated):
    """:class:`Gated`, whose workers fork a helper process at the indices ``fork_at`` (the
    gated one by default), as a library that forks without exec does. A helper keeps every
    descriptor it inherited (the worker's pipe to the main process, the write end of its process
    sentinel), writes its pid to ``helper``, and exits once ``release`` is readable (or after
    :data:`GATE_WAIT_S`)."""

    def __init__(
        self, n: int, gate_index: int, gate: Gate, fork_at: tuple[int, ...] | None = None
    ) -> None:
        super().__init__(n, gate_index, gate)
        self.fork_at = (gate_index,) if fork_at is None else fork_at
        self.helper_r, self.helper_w = os.pipe()
        self.release_r, self.release_w = os.pipe()
        fds = (self.helper_r, self.helper_w, self.release_r, self.release_w)
        weakref.finalize(self, _close_all, fds)

    def __getitem__(self, i: int) -> torch.Tensor:
        if i in self.fork_at and os.fork() == 0:
            try:
                os.write(self.helper_w, struct.pack("<i", os.getpid()))
                select.select([self.release_r], [], [], GATE_WAIT_S)
            finally:
                os._exit(0)
        return super().__getitem__(i)

    def helper_pid(self, timeout: float = 30.0) -> int:
        return _read_pid(self.helper_r, timeout, "no helper started")

    def release(self) -> None:
        os.write(self.release_w, b"r")


class ClosesItsDescriptors(Dataset):
    """Sample i: a float32 vector of four values i. The worker loading ``index`` closes every
    descriptor past stderr (its pipe to the main process, its process sentinel's write end)
    and runs on without answering, for up to :data:`GATE_WAIT_S` (the loader's teardown ends
    it first)."""

    def __init__(self, n: int, index: int) -> None:
        self.n = n
        self.index = index

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.index:
            os.closerange(3, 4096)
            threading.Event().wait(GATE_WAIT_S)  # a worker that hangs, deaf to its pipe
        return torch.full((4,), float(i))


class Images(Dataset):
    """Sample i: a 3x512x512 uint8 image filled with i % 251 (a 25 MB batch at batch size 32)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((3, 512, 512), i % 251, dtype=torch.uint8)


class SizedByBatch(Dataset):
    """Sample i: a uint8 vector of ``lengths[i // batch_size]`` values i % 251, so every sample of
    a batch has one shape and batches differ in size as ``lengths`` says."""

    def __init__(self, lengths: list[int], batch_size: int) -> None:
        self.lengths = lengths
        self.batch_size = batch_size

    def __len__(self) -> int:
        return len(self.lengths) * self.batch_size

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((self.lengths[i // self.batch_size],), i % 251, dtype=torch.uint8)


class Values(Dataset):
    """Sample i is ``values[i]``, whatever it is (ragged tensors, None, odd objects)."""

    def __init__(self, values: list[Any]) -> None:
        self.values = values

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, i: int) -> Any:
        return self.values[i]


class Opaque:
    """An object default_collate has no rule for."""

    def __init__(self, i: int) -> None:
        self.i = i


class Unpicklable:
    """An object whose pickling raises: a batch holding one cannot be written to a slot."""

    def __reduce__(self) -> Any:
        raise ValueError("Unpicklable refuses to be pickled")


class TaggedTensor(torch.Tensor):
    """A tensor subclass, which shmloader carries in the pickled payload, not as a slot array."""


def tagged_collate(samples: list[torch.Tensor]) -> TaggedTensor:
    return torch.stack(samples).as_subclass(TaggedTensor)


def unpicklable_collate_on_batch_1(samples: list[torch.Tensor]) -> Any:
    """Collates normally, except the batch holding sample 4 (batch 1 at batch size 4) becomes
    an object that cannot be pickled."""
    batch = torch.stack(samples)
    if int(batch[0, 0]) == 4:
        return {"x": batch, "bad": Unpicklable()}
    return batch


def generator_collate(samples: list[torch.Tensor]) -> Any:
    return (s for s in samples)


def init_fails_in_worker_1(worker_id: int) -> None:
    if worker_id == 1:
        raise ValueError(f"worker_init_fn refused worker {worker_id}")


class IterRaises(IterableDataset):
    """``__iter__`` raises in every worker."""

    def __iter__(self) -> Any:
        raise OSError("shard file missing: /data/shard-0007.arrow")


class HoldsALock(Dataset):
    """A dataset that cannot be pickled (it holds a thread lock)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return i


# ------------------------------------------------------------------------- test helpers


def outcomes(loader: Any, calls: int, detail: bool = True) -> list[str]:
    """What each of up to ``calls`` calls of ``next()`` on a fresh iterator of ``loader`` gave:
    ``"batch <shape>"``, ``"end"``, or the exception's type — with ``detail``, followed by the
    first and last lines of its message (for a worker error: where it was caught, and the
    original error). The iterator and every exception's frames die with this call, so a failing
    assertion on the result keeps no worker alive."""
    out = []
    it = iter(loader)
    for _ in range(calls):
        try:
            batch = next(it)
        except StopIteration:
            out.append("end")
            break
        except Exception as e:  # noqa: BLE001 - the outcome is whatever was raised
            traceback.clear_frames(e.__traceback__)
            lines = str(e).strip().splitlines() or [""]
            name = type(e).__name__
            out.append(f"{name}: {lines[0]} | {lines[-1]}" if detail else name)
        else:
            shape = tuple(batch.shape) if isinstance(batch, torch.Tensor) else type(batch).__name__
            out.append(f"batch {shape}")
            del batch
    del it
    return out


# --------------------------------------------------------------------------- child scenarios


def shm_view() -> dict[str, Any]:
    """What this process holds of shared memory: the descriptors it has open on /dev/shm files
    or memfds (``shm_fds``, their link targets; ``shm_segments``, their ``[st_dev, st_ino]``, which
    name a segment even after it is unlinked), and, for the scenarios that run in a private
    /dev/shm, the mount's entries and free bytes. Tests that share /dev/shm with other jobs check
    only the segments and names their own processes made (:func:`shm_left_by`)."""
    fds, segments = [], []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
            st = os.stat(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(("/dev/shm/", "/memfd:")):
            fds.append(target)
            segments.append([st.st_dev, st.st_ino])
    st = os.statvfs("/dev/shm")
    return {
        "dev_shm_entries": sorted(os.listdir("/dev/shm")),
        "dev_shm_free": st.f_bavail * st.f_frsize,
        "shm_fds": sorted(fds),
        "shm_segments": sorted(segments),
    }


def _holders(pid: str, wanted: set[tuple[int, int]]) -> list[str]:
    """How process ``pid`` still holds any segment of ``wanted`` (open descriptor or mapping)."""
    found = []
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                st = os.stat(f"/proc/{pid}/fd/{fd}")
                if (st.st_dev, st.st_ino) in wanted:
                    found.append(f"process {pid} has fd {fd} open on segment {st.st_ino}")
    with contextlib.suppress(OSError), open(f"/proc/{pid}/maps", encoding="ascii") as maps:
        for line in maps:
            parts = line.split()
            if len(parts) < 6 or parts[4] == "0":
                continue
            major, minor = (int(x, 16) for x in parts[3].split(":"))
            if (os.makedev(major, minor), int(parts[4])) in wanted:
                found.append(f"process {pid} maps segment {parts[4]} ({parts[5]})")
                break
    return found


def shm_left_by(pids: list[int], segments: list[list[int]]) -> list[str]:
    """What is left of the shared memory that the processes ``pids`` made: /dev/shm entries
    named by any of them (segment names start ``shmloader-<owner pid>-``), and any live process
    on the machine still holding one of ``segments`` (``[st_dev, st_ino]`` as :func:`shm_view`
    reports them) — its bytes would still be in use. Other jobs' /dev/shm use does not count."""
    prefixes = tuple(f"shmloader-{pid}-" for pid in pids)
    left = [f"/dev/shm/{name}" for name in os.listdir("/dev/shm") if name.startswith(prefixes)]
    wanted = {(dev, ino) for dev, ino in segments}
    if wanted:
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                left += _holders(pid, wanted)
    return left


def _report(loader: Any, **extra: Any) -> None:
    st = loader.stats()
    line = {"worker_pids": list(st.worker_pids), "backend": st.arena.backend, **shm_view(), **extra}
    print(json.dumps(line), flush=True)


def hold_loader_until_killed(
    conn: Connection, gate: Gate, batches: int, persistent: bool, block: bool
) -> None:
    """Body of a forked child standing in for a training process: builds a 2-worker loader over
    :class:`Gated` (batch size 1, gated index ``batches``), reads ``batches`` batches (holding the
    latest), sends its worker pids and shared-memory view on ``conn``, then waits to be killed:
    blocked in ``next()`` on the gate if ``block``, else idle (either wait is bounded)."""
    import shmloader

    loader = shmloader.DataLoader(
        Gated(32, batches, gate), batch_size=1, num_workers=2, persistent_workers=persistent
    )
    it = iter(loader)
    held = None
    for _ in range(batches):
        held = next(it)  # the user holds the latest batch: a lent slot when the process dies
    conn.send({"worker_pids": list(loader.stats().worker_pids), **shm_view()})
    if block:
        next(it)
    else:
        conn.poll(GATE_WAIT_S)
    del held


HANG_DUMP_S = 25.0  # below the tests' 30 s wait for the scenario to end


def _block_in_next(persistent: bool) -> None:
    import shmloader

    # As in a terminal: Python's own Ctrl-C handler. A process started from a background job of
    # a non-interactive shell (some CI runners) inherits SIGINT ignored, and Python then leaves
    # it ignored, so the Ctrl-C test would wait for nothing.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    gate = Gate()
    loader = shmloader.DataLoader(
        Gated(32, 5, gate), batch_size=1, num_workers=2, persistent_workers=persistent
    )
    it = iter(loader)
    first = [next(it) for _ in range(5)]

    def report_when_blocked() -> None:
        gate.wait_reached()
        _report(loader, batches_read=len(first))

    threading.Thread(target=report_when_blocked, daemon=True).start()
    # If neither SIGKILL nor SIGINT ends this process within HANG_DUMP_S, print every thread's
    # stack and exit: the test then fails showing where the process hung (not just a timeout).
    faulthandler.dump_traceback_later(HANG_DUMP_S, exit=True)
    next(it)  # blocks on the gate until SIGKILL / SIGINT (or the gate's bound)


def _break(persistent: bool) -> None:
    import shmloader

    loader = shmloader.DataLoader(
        Ramp(64), batch_size=4, num_workers=2, persistent_workers=persistent
    )
    last: list[Any] = []
    for _epoch in range(2 if persistent else 1):
        for i, batch in enumerate(loader):
            last = batch.tolist()
            if i == 3:
                break
    _report(loader, last=last)


def _small_shm() -> None:
    """Inside a 64 MB /dev/shm: shmloader's default backend, explicit POSIX, torch's loader."""
    import shmloader
    from arena import ArenaCapacityError, ArenaExhaustedError

    out: dict[str, Any] = {"dev_shm_free_at_start": shm_view()["dev_shm_free"]}
    data = Images(256)  # 8 batches of 32 x 3x512x512 uint8 = 25,165,824 bytes each
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = shmloader.DataLoader(data, batch_size=32, num_workers=2)
        ok = 0
        for i, batch in enumerate(loader):
            expect = torch.arange(32 * i, 32 * i + 32) % 251
            ok += bool(torch.equal(batch[:, 0, 0, 0].long(), expect))
            ok += bool(torch.equal(batch[:, 2, 511, 511].long(), expect))
        out["default"] = {
            "batches": i + 1,
            "checks_passed": ok,
            "batch_bytes": batch.numel(),
            "backend": loader.stats().arena.backend,
            "warnings": [str(w.message) for w in caught if issubclass(w.category, UserWarning)],
        }
    del batch, loader

    # Explicit POSIX: the slots /dev/shm has room for (two of 25 MB), then a batch no slot of
    # /dev/shm can hold (96 images, 75 MB) at once.
    loader = shmloader.DataLoader(data, batch_size=32, num_workers=2, arena_backend="posix")
    ok = 0
    for i, batch in enumerate(loader):
        ok += bool(torch.equal(batch[:, 0, 0, 0].long(), torch.arange(32 * i, 32 * i + 32) % 251))
    out["posix"] = {"batches": i + 1, "checks_passed": ok, "slots": loader.stats().slots_total}
    del batch, loader
    loader = shmloader.DataLoader(data, batch_size=32, num_workers=2, arena_backend="posix")
    held = []
    try:
        held.extend(loader)
        out["posix_held"] = {"raised": None}
    except (ArenaCapacityError, ArenaExhaustedError) as e:
        out["posix_held"] = {"raised": type(e).__name__, "held": len(held), "message": str(e)}
    del held, loader
    # Batches that double mid-epoch (10 MB, then 20 MB): the store has no room for the bigger
    # slab until the arena gives back the smaller one's (review 42: refused at once).
    mb = 1 << 20
    growing = SizedByBatch([10 * mb] * 4 + [20 * mb] * 4, 1)
    loader = shmloader.DataLoader(growing, batch_size=1, num_workers=2, arena_backend="posix")
    right = [int(b.numel()) == growing.lengths[i] and int(b[0, -1]) == i for i, b in
             enumerate(loader)]  # fmt: skip
    out["posix_growing"] = {"batches": len(right), "right": sum(right)}
    del loader
    # One batch larger than the whole of /dev/shm among small ones: denied once, the epoch goes
    # on (review 43: it waited for room that cannot come, raising at every call).
    never = SizedByBatch([10 * mb] * 4 + [80 * mb] + [10 * mb] * 4, 1)
    loader = shmloader.DataLoader(never, batch_size=1, num_workers=2, arena_backend="posix")
    it, got, errors = iter(loader), [], []
    while len(errors) < 3:
        try:
            got.append(int(next(it)[0, -1]))
        except StopIteration:
            break
        except ArenaCapacityError as e:
            errors.append(e.never)
    out["posix_never"] = {"got": got, "errors": errors}
    del it, loader
    loader = shmloader.DataLoader(data, batch_size=96, num_workers=2, arena_backend="posix")
    try:
        next(iter(loader))
        out["posix_too_big"] = {"raised": None}
    except ArenaCapacityError as e:
        out["posix_too_big"] = {"raised": type(e).__name__, "message": str(e)}
    del loader

    torch_loader = torch.utils.data.DataLoader(data, batch_size=32, num_workers=2, timeout=60)
    try:
        n = sum(1 for _ in torch_loader)
        out["torch"] = {"raised": None, "batches": n}
    except Exception as e:  # noqa: BLE001 - whatever torch raises is what we record
        message = str(e).strip().splitlines()
        out["torch"] = {"raised": type(e).__name__, "message": message[-1] if message else ""}
    del torch_loader
    out["dev_shm_entries_at_end"] = sorted(os.listdir("/dev/shm"))
    print(json.dumps(out), flush=True)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.fault_datasets")
    parser.add_argument("scenario", choices=["block-in-next", "break", "small-shm"])
    parser.add_argument("--persistent", action="store_true")
    args = parser.parse_args(argv)
    if args.scenario == "block-in-next":
        _block_in_next(args.persistent)
    elif args.scenario == "break":
        _break(args.persistent)
    else:
        _small_shm()


if __name__ == "__main__":
    # Re-import under the module's real name so the classes pickle as tests.fault_datasets.*.
    from tests import fault_datasets

    fault_datasets.main(sys.argv[1:])
