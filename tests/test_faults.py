"""Fault injection: dead workers, a dead or interrupted main process, timeouts, a small /dev/shm,
batches that outgrow their slot or the arena, and a soak smoke run.

How the tests stay deterministic without sleeps: the worker that loads a gated index waits at a
:class:`~tests.fault_datasets.Gate` and says so; the test then kills or releases it from a helper
thread while the main thread is blocked in ``next()``. Every wait is bounded (``WAIT_S``, the
gate's own bound, pytest-timeout). The only timing assertions are the issue's deadlines: a worker
death is raised within :data:`DEADLINE_S` of the kill, and a killed main process's workers are gone
within :data:`DEADLINE_S`.

The suite-wide guard (tests/conftest.py) fails any test that leaves a child process or a
/dev/shm entry behind. Tests that kill a process whose children outlive it use the ``reaper``
fixture, which makes this process their subreaper so orphaned workers can be waited for (a zombie
would otherwise still "exist").
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import itertools
import json
import multiprocessing
import multiprocessing.resource_tracker
import os
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

import shmloader
from arena import ArenaCapacityError
from shmloader import supervisor
from shmloader.nextbatch import WAIT_SLICE_S
from tests.fault_datasets import (
    ClosesItsDescriptors,
    ForksAHelperThenGated,
    Gate,
    Gated,
    Ramp,
    SizedByBatch,
    TwoGates,
    Values,
    hold_loader_until_killed,
    outcomes,
    shm_left_by,
    shm_view,
)

REPO = Path(__file__).resolve().parent.parent
DEADLINE_S = 1.0  # the deadline: death -> exception, and main killed -> workers gone
WAIT_S = 30.0  # bound on every other wait; never reached when the code under test is right
FORK = multiprocessing.get_context("fork")
PR_SET_CHILD_SUBREAPER = 36


# --------------------------------------------------------------------------------- helpers


@pytest.fixture
def reaper() -> Iterator[None]:
    """Makes this process the subreaper of its descendants for the test, so the workers of a
    killed child are re-parented here and reaped when they exit."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        pytest.skip(f"prctl(PR_SET_CHILD_SUBREAPER) failed: {os.strerror(ctypes.get_errno())}")
    try:
        yield
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


def next_during(it: Iterator[Any], fault: Callable[[], float]) -> tuple[Exception, float]:
    """Calls ``next(it)`` in this thread while ``fault`` runs in a helper thread (it waits for its
    moment, strikes, and returns the ``time.monotonic()`` of the strike). Returns the exception
    ``next()`` raised (frames cleared, so it keeps no iterator alive) and the seconds from the
    strike to the raise."""
    struck: list[float] = []
    broke: list[BaseException] = []

    def helper() -> None:
        try:
            struck.append(fault())
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread below
            broke.append(e)

    thread = threading.Thread(target=helper, name="fault", daemon=True)
    thread.start()
    try:
        next(it)
    except Exception as e:  # noqa: BLE001 - the test inspects whatever was raised
        raised_at = time.monotonic()
        error = e
    else:
        thread.join(WAIT_S)
        pytest.fail(f"next() returned a batch although the fault struck ({broke or struck})")
    thread.join(WAIT_S)
    if broke:
        raise broke[0]
    traceback.clear_frames(error.__traceback__)
    return error, raised_at - struck[0]


def gone_within(pids: list[int], timeout: float) -> list[int]:
    """The pids still running after ``timeout`` seconds (psutil.wait_procs, a bounded wait)."""
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            procs.append(psutil.Process(pid))
    _, alive = psutil.wait_procs(procs, timeout=max(0.0, timeout))
    return [p.pid for p in alive]


def first_line(proc: subprocess.Popen[str], timeout: float = WAIT_S) -> dict[str, Any]:
    """The JSON line a child scenario prints once it is in place."""
    assert proc.stdout is not None and proc.stderr is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    if not line:
        proc.kill()
        _, err = proc.communicate(timeout=WAIT_S)
        pytest.fail(f"child printed no report (exit code {proc.returncode}): {err[-3000:]}")
    report: dict[str, Any] = json.loads(line)
    return report


def start_scenario(*args: str, new_group: bool = False) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.fault_datasets", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        process_group=0 if new_group else None,
    )


def slot_states(loader: shmloader.DataLoader[Any]) -> dict[str, int]:
    st = loader.stats()
    assert st.arena is not None
    return dict(st.arena.slots_by_state)


# ------------------------------------------------------------------ 1. a worker dies


def _oom_kill(pid: int) -> None:
    """What the kernel's OOM killer does to the process it picks: SIGKILL (the score bump only
    mirrors how it is picked, and needs root)."""
    with contextlib.suppress(OSError), open(f"/proc/{pid}/oom_score_adj", "w") as f:
        f.write("1000")
    os.kill(pid, signal.SIGKILL)


# name: (how the test strikes the worker at the gate, torch's wording of its death)
DEATHS: dict[str, tuple[Callable[[Gate, int], None], str]] = {
    "SIGKILL": (
        lambda gate, pid: os.kill(pid, signal.SIGKILL),
        r"DataLoader worker \(pid {pid}\) is killed by signal: Killed\.",
    ),
    "SIGSEGV": (
        lambda gate, pid: os.kill(pid, signal.SIGSEGV),
        r"DataLoader worker \(pid {pid}\) is killed by signal: Segmentation fault\.",
    ),
    "os._exit(3)": (
        lambda gate, pid: gate.exit_worker(),
        r"DataLoader worker \(pid {pid}\) exited unexpectedly with exit code 3\. Details are "
        r"lost due to multiprocessing\. Rerunning with num_workers=0 may give better error "
        r"trace\.",
    ),
    "OOM-kill": (
        lambda gate, pid: _oom_kill(pid),
        r"DataLoader worker \(pid {pid}\) is killed by signal: Killed\.",
    ),
}
N = 16
GATED = 5  # batch 5 at batch size 1 goes to worker 5 % 2 = 1


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh-workers", "persistent-workers"])
@pytest.mark.parametrize("death", list(DEATHS))
def test_a_dead_worker_is_raised_within_a_second_naming_it_and_the_loader_recovers(
    death, persistent
):
    strike, wording = DEATHS[death]
    gate = Gate()
    ballast = 64 << 20 if death == "OOM-kill" else 0
    loader = shmloader.DataLoader(
        Gated(N, GATED, gate, ballast_bytes=ballast),
        batch_size=1,
        num_workers=2,
        persistent_workers=persistent,
    )
    it = iter(loader)
    assert [int(next(it)[0, 0]) for _ in range(GATED)] == list(range(GATED))
    old_pids = list(loader.stats().worker_pids)
    victim = old_pids[GATED % 2]

    def fault() -> float:
        assert gate.wait_reached() == victim  # the main process now waits for that batch
        at = time.monotonic()
        strike(gate, victim)
        return at

    error, seconds = next_during(it, fault)
    print(
        f"\n[detection] {death:12} {'persistent' if persistent else 'fresh':10} "
        f"{seconds * 1000:7.1f} ms"
    )
    assert isinstance(error, RuntimeError)
    assert re.search(wording.format(pid=victim), str(error)), str(error)
    assert "shmloader worker 1 of 2" in str(error)
    assert seconds < DEADLINE_S

    states = slot_states(loader)
    assert states["writing"] == 0, states
    assert states["free"] == sum(states.values()), states
    assert gone_within(old_pids, WAIT_S) == []

    gate.open()
    assert [int(b[0, 0]) for b in loader] == list(range(N))
    assert set(loader.stats().worker_pids).isdisjoint(old_pids)
    assert slot_states(loader)["writing"] == 0


def _reap_every_child(signum: int, frame: Any) -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


@pytest.mark.parametrize(
    "sigchld", [signal.SIG_IGN, _reap_every_child], ids=["SIG_IGN", "a-handler-that-reaps"]
)
def test_a_worker_reaped_by_someone_else_is_still_raised_within_a_second(sigchld):
    # With SIGCHLD ignored (also inherited through exec from a parent that ignores it) or a
    # handler that reaps every child, multiprocessing never learns a worker's exit code; the
    # loader must still see the death instead of spinning on the exited worker's sentinel.
    gate = Gate()
    loader = shmloader.DataLoader(Gated(N, GATED, gate), batch_size=1, num_workers=2)
    before = signal.signal(signal.SIGCHLD, sigchld)
    try:
        it = iter(loader)
        assert [int(next(it)[0, 0]) for _ in range(GATED)] == list(range(GATED))
        pids = list(loader.stats().worker_pids)
        victim = pids[GATED % 2]

        def fault() -> float:
            assert gate.wait_reached() == victim
            at = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            return at

        error, seconds = next_during(it, fault)
        assert isinstance(error, RuntimeError)
        reaped_elsewhere = (
            rf"DataLoader worker \(pid\(s\) {victim}\) exited unexpectedly; its exit code is "
            r"unknown because something else reaped it \(SIGCHLD is set to SIG_IGN"
        )
        if sigchld is not signal.SIG_IGN:
            # A handler runs at the main thread's next bytecode after the worker became a
            # zombie; the loader's own wait can come first, and then it knows the signal.
            reaped_elsewhere += rf"|DataLoader worker \(pid {victim}\) is killed by signal: Killed"
        assert re.search(reaped_elsewhere, str(error)), str(error)
        assert seconds < DEADLINE_S
        gate.open()
        assert [int(b[0, 0]) for b in loader] == list(range(N))  # fresh workers, same setting
    finally:
        signal.signal(signal.SIGCHLD, before)
    assert gone_within(pids, WAIT_S) == []


def test_teardown_never_signals_the_pid_of_a_worker_the_kernel_reaped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review 52: with SIGCHLD ignored the kernel reaps a dead worker and multiprocessing never
    learns it, so the teardown after the death sent SIGKILL to its pid, by then free for any
    new process of the machine. Workers are signalled through their pidfds."""
    gate = Gate()
    loader = shmloader.DataLoader(Gated(N, GATED, gate), batch_size=1, num_workers=2)
    sent: list[int] = []
    kill = os.kill

    def recorded(pid: int, sig: int) -> None:
        sent.append(pid)
        kill(pid, sig)

    before = signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    try:
        it = iter(loader)
        assert [int(next(it)[0, 0]) for _ in range(GATED)] == list(range(GATED))
        victim = loader.stats().worker_pids[GATED % 2]
        monkeypatch.setattr(os, "kill", recorded)

        def fault() -> float:
            assert gate.wait_reached() == victim
            at = time.monotonic()
            os.kill(victim, signal.SIGKILL)  # the test's own, recorded too
            return at

        error, _ = next_during(it, fault)
        assert isinstance(error, RuntimeError)
        assert sent.count(victim) == 1, "the teardown signalled the reaped worker's pid"
        monkeypatch.undo()
        gate.open()
        assert [int(b[0, 0]) for b in loader] == list(range(N))
    finally:
        signal.signal(signal.SIGCHLD, before)


@pytest.mark.parametrize(
    "sigchld", [signal.SIG_IGN, _reap_every_child], ids=["SIG_IGN", "a-handler-that-reaps"]
)
def test_workers_reaped_by_someone_else_leave_no_process_object_or_descriptor_behind(sigchld):
    # Review 46: multiprocessing never gets such a worker's exit code, so it kept each one's
    # process object in its list of children for good, with two descriptors: 4 an epoch of 2
    # workers, until the process ran out of descriptors.
    fds = len(os.listdir("/proc/self/fd"))
    children = set(multiprocessing.process._children)  # type: ignore[attr-defined]
    before = signal.signal(signal.SIGCHLD, sigchld)
    try:
        loader = shmloader.DataLoader(Ramp(8), batch_size=2, num_workers=2)
        for _ in range(5):
            assert [int(b[0, 0]) for b in loader] == [0, 2, 4, 6]
        pids = set(loader.stats().worker_pids)
        del loader
        gc.collect()
    finally:
        signal.signal(signal.SIGCHLD, before)
    left = set(multiprocessing.process._children) - children  # type: ignore[attr-defined]
    assert not left, f"process objects of ended workers kept: {[p.pid for p in left]} ({pids})"
    assert len(os.listdir("/proc/self/fd")) == fds


def _init_raises(worker_id: int) -> None:
    raise ValueError(f"worker_init_fn of worker {worker_id} fails")


@pytest.mark.parametrize(
    ("end", "context"),
    [("epoch", "fork"), ("break", "fork"), ("persistent", "fork"), ("init-raises", "fork"),
     ("epoch", "spawn")],
)  # fmt: skip
def test_ended_workers_leave_no_process_object_or_descriptor_behind(end, context):
    # Review 67: the workers were waited for on pidfds, never joined, so multiprocessing's list
    # of children kept each process object, and its two pipe descriptors, after the loader was
    # gone (until the next Process.start()): 4 descriptors for 2 workers, whatever the end.
    if context == "spawn":  # its first use starts multiprocessing's resource tracker, for good
        multiprocessing.resource_tracker.ensure_running()  # type: ignore[attr-defined]
    fds = len(os.listdir("/proc/self/fd"))
    children = set(multiprocessing.process._children)  # type: ignore[attr-defined]
    loader = shmloader.DataLoader(
        Ramp(8), batch_size=2, num_workers=2, multiprocessing_context=context,
        persistent_workers=end == "persistent",
        worker_init_fn=_init_raises if end == "init-raises" else None,
    )  # fmt: skip
    if end == "init-raises":
        with pytest.raises(ValueError, match="worker_init_fn of worker"):
            list(loader)
    elif end == "break":
        it = iter(loader)
        assert int(next(it)[0, 0]) == 0
        del it
    else:
        for _ in range(2):
            assert [int(b[0, 0]) for b in loader] == [0, 2, 4, 6]
    del loader
    gc.collect()
    left = set(multiprocessing.process._children) - children  # type: ignore[attr-defined]
    assert not left, f"process objects of ended workers kept: {[p.pid for p in left]}"
    assert len(os.listdir("/proc/self/fd")) == fds


@pytest.mark.parametrize("pidfds", [True, False], ids=["pidfds", "no-pidfds"])
def test_a_worker_killed_while_processes_the_workers_forked_run_on_is_raised(
    reaper, monkeypatch, pidfds
):
    # Review 46: the victim's helper holds its pipe and the write end of its sentinel, so
    # neither told its death; the loader waited out its timeout (or, without one, for good).
    # Review 47: the other worker's helper holds that worker's sentinel, and ending it waited
    # 2 s in Process.join; without pidfds (Linux before 5.3) the death was looked for only
    # once the whole timeout had passed.
    if not pidfds:
        monkeypatch.setattr(supervisor, "_open_pidfd", lambda pid: None)
    gate = Gate()
    data = ForksAHelperThenGated(N, GATED, gate, fork_at=(GATED - 1, GATED))
    loader = shmloader.DataLoader(data, batch_size=1, num_workers=2, timeout=WAIT_S)
    it = iter(loader)
    assert [int(next(it)[0, 0]) for _ in range(GATED)] == list(range(GATED))
    victim = loader.stats().worker_pids[GATED % 2]
    helpers: list[int] = []

    def fault() -> float:
        helpers.extend(data.helper_pid() for _ in range(2))
        assert gate.wait_reached() == victim
        at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        return at

    try:
        error, seconds = next_during(it, fault)
    finally:
        data.release()  # (both helpers: the byte stays readable)
    assert re.search(rf"DataLoader worker \(pid {victim}\) is killed by signal: Killed", str(error))
    # without pidfds, a wait slice with nothing read looks for it: WAIT_SLICE_S at most
    assert seconds < (DEADLINE_S if pidfds else WAIT_SLICE_S + DEADLINE_S)
    del it, loader
    assert gone_within(helpers, WAIT_S) == []  # (this process reaps them: the reaper fixture)


def test_a_worker_that_closes_its_descriptors_and_runs_on_times_out_as_set():
    # Review 46: at the EOF of its pipe the loader reaped it with Process.join, whose blocking
    # waitpid (its sentinel was readable: the worker closed it) waited for the worker's exit,
    # past the loader's timeout; its teardown waited so too.
    loader = shmloader.DataLoader(
        ClosesItsDescriptors(N, GATED), batch_size=1, num_workers=2, timeout=2
    )
    it = iter(loader)
    assert [int(next(it)[0, 0]) for _ in range(GATED)] == list(range(GATED))
    pids = list(loader.stats().worker_pids)
    with pytest.raises(RuntimeError) as err:
        next(it)
    assert str(err.value) == "DataLoader timed out after 2 seconds"
    del it, err
    gc.collect()
    assert gone_within(pids, WAIT_S) == []  # the teardown ended the deaf worker


def test_a_dead_worker_is_raised_within_a_second_while_another_worker_is_busy():
    busy, victim_gate = Gate(), Gate()
    loader = shmloader.DataLoader(
        TwoGates(N, {4: victim_gate, 5: busy}), batch_size=1, num_workers=2
    )
    it = iter(loader)
    assert [int(next(it)[0, 0]) for _ in range(4)] == [0, 1, 2, 3]
    pids = loader.stats().worker_pids

    def fault() -> float:
        assert victim_gate.wait_reached() == pids[0]
        assert busy.wait_reached() == pids[1]  # worker 1 is inside a slow __getitem__
        at = time.monotonic()
        os.kill(pids[0], signal.SIGKILL)
        return at

    try:
        error, seconds = next_during(it, fault)
    finally:
        busy.open()
    print(f"\n[detection] SIGKILL with the other worker busy: {seconds * 1000:7.1f} ms")
    assert f"DataLoader worker (pid {pids[0]}) is killed by signal: Killed." in str(error)
    assert seconds < DEADLINE_S


def test_a_worker_death_after_a_broken_off_epoch_leaves_no_slot_writing():
    gate = Gate()
    loader = shmloader.DataLoader(
        Gated(N, GATED, gate), batch_size=1, num_workers=2, persistent_workers=True
    )
    it = iter(loader)
    assert [int(next(it)[0, 0]) for _ in range(GATED)] == list(range(GATED))
    victim = gate.wait_reached()  # worker 1 is writing batch 5 of epoch 0 ...
    assert victim == loader.stats().worker_pids[GATED % 2]
    it = iter(loader)  # ... when the user starts epoch 1: that task becomes an orphan
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=rf"\(pid {victim}\) is killed by signal: Killed"):
        list(it)
    gate.open()
    assert slot_states(loader)["writing"] == 0


# ---------------------------------------------------------- 2. the main process dies or exits


@pytest.mark.parametrize("seed", range(10))
def test_killing_the_main_process_at_a_random_point_stops_every_worker_within_a_second(
    seed, reaper
):
    rng = random.Random(seed)
    batches, persistent, block = rng.randrange(8), rng.random() < 0.5, rng.random() < 0.5
    gate = Gate()
    own_fds = shm_view()["shm_fds"]
    ours, theirs = FORK.Pipe()
    child = FORK.Process(
        target=hold_loader_until_killed, args=(theirs, gate, batches, persistent, block)
    )
    child.start()
    theirs.close()
    try:
        assert ours.poll(WAIT_S), "the child never reported its workers"
        report = ours.recv()
        workers = report["worker_pids"]
        assert len(workers) == 2
        if batches:
            assert report["shm_fds"], "the child holds no shared-memory descriptor"
        gate.wait_reached()  # a worker is inside __getitem__ (and the main blocked, if block)
    finally:
        killed_at = time.monotonic()
        os.kill(child.pid, signal.SIGKILL)
        child.join(WAIT_S)  # reaped: its orphaned workers are now this process's children
    assert child.exitcode == -signal.SIGKILL
    assert gone_within(workers, DEADLINE_S - (time.monotonic() - killed_at)) == []
    assert shm_left_by([child.pid, *workers], report["shm_segments"]) == []
    assert shm_view()["shm_fds"] == own_fds


def test_a_sigkilled_main_interpreter_leaves_no_worker_and_nothing_in_dev_shm(reaper):
    own_fds = shm_view()["shm_fds"]
    proc = start_scenario("block-in-next")
    try:
        report = first_line(proc)
    finally:
        killed_at = time.monotonic()
        proc.kill()
        proc.communicate(timeout=WAIT_S)
    assert proc.returncode == -signal.SIGKILL
    assert gone_within(report["worker_pids"], DEADLINE_S - (time.monotonic() - killed_at)) == []
    assert report["shm_fds"], "the child held no shared-memory descriptor"
    assert shm_left_by([proc.pid, *report["worker_pids"]], report["shm_segments"]) == []
    assert shm_view()["shm_fds"] == own_fds


def test_ctrl_c_mid_epoch_exits_cleanly_with_no_worker_traceback_and_no_leftover(reaper):
    own_fds = shm_view()["shm_fds"]
    proc = start_scenario("block-in-next", new_group=True)
    try:
        report = first_line(proc)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole group
        _, err = proc.communicate(timeout=WAIT_S)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode in (-signal.SIGINT, 130, 1), err
    assert err.rstrip().endswith("KeyboardInterrupt"), err
    assert err.count("Traceback") == 1, err  # the main process's own, nothing from workers
    assert "shmloader-worker" not in err and "DataLoader worker" not in err, err
    assert gone_within(report["worker_pids"], DEADLINE_S) == []
    assert report["shm_fds"], "the child held no shared-memory descriptor"
    assert shm_left_by([proc.pid, *report["worker_pids"]], report["shm_segments"]) == []
    assert shm_view()["shm_fds"] == own_fds


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh-workers", "persistent-workers"])
def test_the_interpreter_exits_cleanly_after_breaking_out_of_a_loop(persistent, reaper):
    own_fds = shm_view()["shm_fds"]
    args = ["break", "--persistent"] if persistent else ["break"]
    proc = start_scenario(*args)
    out, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 0, err
    assert err == ""
    report = json.loads(out)
    assert report["last"][0] == [12.0] * 4
    assert gone_within(report["worker_pids"], DEADLINE_S) == []
    assert report["shm_fds"], "the child held no shared-memory descriptor"
    assert shm_left_by([proc.pid, *report["worker_pids"]], report["shm_segments"]) == []
    assert shm_view()["shm_fds"] == own_fds


@pytest.mark.parametrize(
    "persistent",
    [
        pytest.param(False),
        True,
    ],
    ids=["fresh-workers", "persistent-workers"],
)
def test_breaking_out_of_many_epochs_leaks_no_arena_slot(persistent):
    loader = shmloader.DataLoader(
        Ramp(64), batch_size=4, num_workers=2, persistent_workers=persistent
    )
    for _ in range(10):
        for i, _batch in enumerate(loader):
            if i == 1:
                break
    del _batch
    assert len(list(loader)) == 16  # one whole epoch: a persistent iterator settles its last
    gc.collect()
    states = slot_states(loader)
    assert states["writing"] == states["ready"] == states["lent"] == 0, states


# ------------------------------------------------------------------------------ 3. timeout


def test_timeout_raises_torchs_error_and_the_late_batch_still_comes():
    def timed_out(loader_cls: type) -> tuple[str, list[int]]:
        gate = Gate()
        loader = loader_cls(Gated(8, 2, gate), batch_size=1, num_workers=2, timeout=0.5)
        it = iter(loader)
        assert [int(next(it)[0, 0]) for _ in range(2)] == [0, 1]
        try:
            with pytest.raises(RuntimeError) as err:
                next(it)
        finally:
            gate.open()
        rest = [int(b[0, 0]) for b in it]
        return str(err.value), rest

    torch_message, torch_rest = timed_out(torch.utils.data.DataLoader)
    message, rest = timed_out(shmloader.DataLoader)
    assert message == torch_message == "DataLoader timed out after 0.5 seconds"
    assert rest == torch_rest == [2, 3, 4, 5, 6, 7]


# ------------------------------------------------------------------------ 4. a small /dev/shm

SMALL_SHM_MB = 64
MOUNT_SMALL = f"mount -t tmpfs -o size={SMALL_SHM_MB}m tmpfs /dev/shm"


@pytest.fixture(scope="module")
def small_shm_report() -> dict[str, Any]:
    """The ``small-shm`` scenario's report, run in a private mount namespace with a 64 MB
    /dev/shm (Docker's default); skipped where that is not permitted."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) for a private 64 MB /dev/shm")
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", MOUNT_SMALL], capture_output=True, text=True, timeout=WAIT_S
    )
    if probe.returncode != 0:
        pytest.skip(f"unshare -m / mount tmpfs not permitted: {probe.stderr.strip()}")
    done = subprocess.run(
        [
            "unshare",
            "-m",
            "sh",
            "-c",
            f'{MOUNT_SMALL} && exec "$@"',
            "sh",
            sys.executable,
            "-m",
            "tests.fault_datasets",
            "small-shm",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"\n[small /dev/shm] torch's DataLoader raised: {report['torch']}")
    return report


def test_the_default_backend_completes_an_epoch_of_25_mb_batches_in_a_64_mb_dev_shm(
    small_shm_report,
):
    assert small_shm_report["dev_shm_free_at_start"] == SMALL_SHM_MB << 20
    default = small_shm_report["default"]
    assert default["batch_bytes"] == 32 * 3 * 512 * 512
    assert default["batches"] == 8
    assert default["checks_passed"] == 16
    assert default["backend"] == "memfd"
    (warning,) = default["warnings"]
    assert "memfd" in warning


def test_an_explicit_posix_backend_runs_an_epoch_on_the_slots_dev_shm_has_room_for(
    small_shm_report,
):
    """Review 38: the first slab asked /dev/shm for five 25 MB slots and the loader failed at
    its first batch, though two fit and a loop that drops its batches needs no more."""
    assert small_shm_report["posix"] == {"batches": 8, "checks_passed": 8, "slots": 2}
    held = small_shm_report["posix_held"]  # a loop that keeps them: as many as fit, then why
    assert held["raised"] == "ArenaCapacityError" and held["held"] == 2, held
    assert re.search(r"the user holds 2 batches .*cannot grow below its cap.*Growing failed: "
                     r"cannot reserve [\d,]+ bytes .*/dev/shm", held["message"]), held["message"]


def test_an_explicit_posix_backend_gives_back_a_smaller_slab_for_batches_that_grow(
    small_shm_report,
):
    """Review 42: a batch of a new, bigger size was refused at once when /dev/shm had no room,
    though the arena's own idle slab of the smaller size held the room it needed."""
    assert small_shm_report["posix_growing"] == {"batches": 8, "right": 8}


def test_a_batch_larger_than_the_whole_dev_shm_is_refused_once_and_the_epoch_goes_on(
    small_shm_report,
):
    """Review 43: such a batch waited for room that could never come, and every next() raised
    its error again; the epoch's later batches were lost."""
    assert small_shm_report["posix_never"] == {"got": [0, 1, 2, 3, 5, 6, 7, 8], "errors": [True]}


def test_an_explicit_posix_backend_fails_at_first_batch_with_the_numbers_and_the_fixes(
    small_shm_report,
):
    posix = small_shm_report["posix_too_big"]  # a 75 MB batch: no slot fits in 64 MB
    assert posix["raised"] == "ArenaCapacityError"
    message = posix["message"]
    assert re.search(r"cannot reserve [\d,]+ bytes", message), message
    assert f"/dev/shm has {SMALL_SHM_MB << 20:,} bytes free" in message
    assert "--shm-size" in message and "memfd" in message


def test_torchs_own_loader_fails_on_the_same_data_in_a_64_mb_dev_shm(small_shm_report):
    torch_result = small_shm_report["torch"]
    assert torch_result["raised"] is not None, torch_result
    assert re.search(r"shared memory|shm|Bus error|No space left", torch_result["message"])


def test_nothing_is_left_in_the_small_dev_shm_by_shmloader(small_shm_report):
    ours = [n for n in small_shm_report["dev_shm_entries_at_end"] if n.startswith("shmloader")]
    assert ours == []


# ---------------------------------------------------------------------- 5. oversized batches


def test_a_batch_larger_than_every_slot_arrives_whole_in_a_class_at_least_twice_as_big():
    lengths = [1000, 1000, 1000, 40_000, 1000, 200_000, 1000]
    loader = shmloader.DataLoader(SizedByBatch(lengths, 4), batch_size=4, num_workers=2)
    for b, batch in enumerate(loader):
        assert batch.shape == (4, lengths[b])
        expect = (torch.arange(4 * b, 4 * b + 4) % 251).to(torch.uint8)
        assert torch.equal(batch, expect[:, None].expand(4, lengths[b]))
    sizes = loader.stats().arena.slot_sizes
    assert len(sizes) >= 2 and sizes[-1] >= 4 * 200_000
    assert all(b >= 2 * a for a, b in itertools.pairwise(sizes)), sizes


def test_a_batch_whose_pickled_part_outgrows_its_slot_arrives_whole():
    words = [("w" * (300_000 if i // 4 == 2 else 8), i) for i in range(16)]
    loader = shmloader.DataLoader(Values(words), batch_size=4, num_workers=2)
    for b, (texts, ids) in enumerate(loader):
        assert list(texts) == [w for w, _ in words[4 * b : 4 * b + 4]]
        assert ids.tolist() == list(range(4 * b, 4 * b + 4))


def test_a_batch_beyond_arena_max_bytes_raises_a_capacity_error_with_the_numbers():
    cap = 256 << 10
    loader = shmloader.DataLoader(
        SizedByBatch([1000, 1000, 200_000, 1000], 4),
        batch_size=4,
        num_workers=2,
        arena_max_bytes=cap,
    )
    with pytest.raises(ArenaCapacityError) as err:
        for _ in loader:
            pass
    message = str(err.value)
    needed = int(re.search(r"a batch of ([\d,]+) bytes", message).group(1).replace(",", ""))
    assert needed >= 4 * 200_000
    assert f"max_bytes={cap:,}" in message and "arena_max_bytes" in message


def test_a_batch_beyond_the_cap_fails_at_its_turn_and_loading_goes_on():
    loader = shmloader.DataLoader(
        SizedByBatch([1000, 1000, 200_000, 1000, 1000], 4),
        batch_size=4,
        num_workers=2,
        arena_max_bytes=256 << 10,
    )
    assert outcomes(loader, 6, detail=False) == [
        "batch (4, 1000)",
        "batch (4, 1000)",
        "ArenaCapacityError",
        "batch (4, 1000)",
        "batch (4, 1000)",
        "end",
    ]


def test_holding_every_slot_while_another_worker_is_slow_does_not_stall_the_next_batch():
    gate = Gate()
    loader = shmloader.DataLoader(Gated(N, 6, gate), batch_size=1, num_workers=2, timeout=3)
    try:
        held = outcomes_holding(loader, 6)
    finally:
        gate.open()
    assert held == [0, 1, 2, 3, 4, 5]


def outcomes_holding(loader: shmloader.DataLoader[Any], count: int) -> list[int | str]:
    """Reads ``count`` batches and holds them all; the first value of each, or the error that
    ended the reading (the iterator and the batches die with this call)."""
    it = iter(loader)
    held: list[torch.Tensor] = []
    try:
        for _ in range(count):
            held.append(next(it))
    except RuntimeError as e:
        traceback.clear_frames(e.__traceback__)
        return [int(b[0, 0]) for b in held] + [str(e)]
    return [int(b[0, 0]) for b in held]


# ---------------------------------------------------------------- 7. the soak tool stays working


def test_the_soak_tool_passes_a_short_run():
    done = subprocess.run(
        [sys.executable, "-m", "tools.soak", "--batches", "2000"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "soak passed" in done.stdout


# ------------------------------------------------ 8. random worker deaths at random points


SIGNALS = {"SIGKILL": signal.SIGKILL, "SIGSEGV": signal.SIGSEGV, "SIGTERM": signal.SIGTERM}


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
@pytest.mark.parametrize("seed", range(20))
def test_killing_a_random_worker_at_a_random_point_raises_and_the_loader_recovers(seed):
    rng = random.Random(1000 + seed)
    nw, bs, persistent = rng.choice([2, 3]), rng.choice([1, 2, 3]), rng.random() < 0.5
    n = 24
    gate_index = rng.randrange(n)
    gated_worker = (gate_index // bs) % nw
    victim = rng.randrange(nw)
    how = rng.choice([*SIGNALS, *(["os._exit(3)"] if victim == gated_worker else [])])
    gate = Gate()
    loader = shmloader.DataLoader(
        Gated(n, gate_index, gate), batch_size=bs, num_workers=nw, persistent_workers=persistent
    )
    batches = [list(range(i, min(i + bs, n))) for i in range(0, n, bs)]
    pids: list[int] = []

    def fault() -> float:
        at_gate = gate.wait_reached()
        pids.extend(loader.stats().worker_pids)
        assert at_gate == pids[gated_worker]
        pidfd = os.pidfd_open(pids[victim])
        try:
            at = time.monotonic()
            if how == "os._exit(3)":
                gate.exit_worker()
            else:
                os.kill(pids[victim], SIGNALS[how])
            assert select.select([pidfd], [], [], WAIT_S)[0], "the victim did not die"
        finally:
            os.close(pidfd)
        gate.open()  # the victim is dead: no answer can now come before its death is seen
        return at

    it = iter(loader)
    got: list[list[int]] = []

    def read_all() -> None:
        for batch in it:
            got.append([int(v) for v in batch[:, 0]])

    error, _ = next_during(_Drain(read_all), fault)
    assert isinstance(error, RuntimeError), repr(error)
    message = str(error)
    if how == "os._exit(3)":
        assert f"(pid {pids[victim]}) exited unexpectedly with exit code 3. Details" in message
    else:
        name = signal.strsignal(SIGNALS[how])
        assert f"DataLoader worker (pid {pids[victim]}) is killed by signal: {name}." in message
    assert f"shmloader worker {victim} of {nw}" in message
    assert got == batches[: len(got)]
    assert len(got) <= gate_index // bs
    states = slot_states(loader)
    assert states["writing"] == 0 and states["free"] == sum(states.values()), states
    assert [[int(v) for v in b[:, 0]] for b in loader] == batches
    assert set(loader.stats().worker_pids).isdisjoint(pids)


class _Drain:
    """An iterator whose one ``next()`` runs ``body`` (the test's whole read loop), so
    :func:`next_during` can run a fault beside a loop that reads many batches."""

    def __init__(self, body: Callable[[], None]) -> None:
        self.body = body

    def __iter__(self) -> _Drain:
        return self

    def __next__(self) -> None:
        self.body()
        raise AssertionError("the epoch ended although a worker was killed")


def _ignore_sigterm(worker_id: int) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def test_teardown_signals_every_deaf_worker_before_it_waits_for_any(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review 51: teardown sent SIGTERM to a worker that ignored STOP and waited KILL_S for it
    before it signalled the next, so N deaf workers took N times as long to end (two workers
    stuck in their dataset and ignoring SIGTERM: 5.5 s at exit). Now each step goes to every
    worker left, then one bound covers them all."""
    gates = {0: Gate(), 1: Gate()}
    loader = shmloader.DataLoader(TwoGates(8, gates), batch_size=1, num_workers=2,
                                  worker_init_fn=_ignore_sigterm, timeout=WAIT_S)  # fmt: skip
    it = iter(loader)
    pids = {gates[0].wait_reached(), gates[1].wait_reached()}  # both stuck in __getitem__
    sup = it._sup
    assert {p.pid for p in sup.procs} == pids
    log: list[tuple[str, int]] = []
    wait = supervisor._wait_exit

    def logged_wait(p: Any, pidfd: int | None, own: bool, timeout: float) -> None:
        log.append(("wait", sup.procs.index(p)))
        wait(p, pidfd, own, timeout)

    monkeypatch.setattr(supervisor, "_wait_exit", logged_wait)
    send = supervisor._send
    names = {signal.SIGTERM: "terminate", signal.SIGKILL: "kill"}

    def logged_send(p: Any, pidfd: int | None, sig: int) -> None:
        log.append((names[sig], sup.procs.index(p)))
        send(p, pidfd, sig)

    monkeypatch.setattr(supervisor, "_send", logged_send)
    it._shutdown_workers()
    assert all(p.exitcode == -signal.SIGKILL for p in sup.procs)
    after_stop = log[log.index(("terminate", 0)) :]
    assert after_stop == [
        ("terminate", 0), ("terminate", 1), ("wait", 0), ("wait", 1),
        ("kill", 0), ("kill", 1), ("wait", 0), ("wait", 1),
    ]  # fmt: skip
