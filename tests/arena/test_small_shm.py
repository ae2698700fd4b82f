"""The arena under Docker's default 64 MB ``/dev/shm``, reproduced in a private mount namespace.

A child runs in ``unshare -m`` with a fresh 64 MB tmpfs on ``/dev/shm`` (the host's mount is not
touched), does its checks and reports them as one JSON line; the assertions run here. Skipped, with
the reason, where creating a mount namespace or mounting is not permitted.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from typing import Any

import pytest

SHM_MB = 64
MB = 1 << 20
TIMEOUT_S = 120
MOUNT = f"mount -t tmpfs -o size={SHM_MB}m tmpfs /dev/shm"

CHILD = """
import json, os, warnings
import numpy as np
from arena import ArenaCapacityError, Backend, Segment, Slab, shm_free_bytes
from arena import segment as segment_mod

MB = 1 << 20
out = {"free": shm_free_bytes(), "entries_before": os.listdir("/dev/shm")}

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    big = Slab.create(0, 200 * MB, 1, "auto")
    again = Slab.create(1, 100 * MB, 1, "auto")
out["backends"] = [big.backend.value, again.backend.value]
out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]

words = np.frombuffer(big.slot_buffer(0), dtype=np.uint64)
words[:] = np.arange(words.size, dtype=np.uint64)
out["bytes_checked"] = int(words.nbytes)
out["read_back"] = bool((words == np.arange(words.size, dtype=np.uint64)).all())
out["free_after_write"] = shm_free_bytes()
del words
again.close()
big.close()

try:
    Slab.create(2, 200 * MB, 1, "posix")
except ArenaCapacityError as e:
    out["posix_error"] = str(e)

# Let the size check pass so the reservation itself meets the full tmpfs (ENOSPC): it must be a
# capacity error at creation, with the descriptor closed, never a SIGBUS at first write.
segment_mod.shm_free_bytes = lambda path=segment_mod.SHM_DIR: 1 << 40
fds = len(os.listdir("/proc/self/fd"))
try:
    Segment.create(200 * MB, Backend.POSIX)
except ArenaCapacityError as e:
    out["reserve_error"] = str(e)
out["fds_leaked"] = len(os.listdir("/proc/self/fd")) - fds
out["entries_after"] = os.listdir("/dev/shm")
st = os.statvfs("/dev/shm")
out["free_at_end"] = st.f_bavail * st.f_frsize
print(json.dumps(out))
"""


def _namespace_refusal() -> str | None:
    """Why this machine cannot give a child its own small /dev/shm, or None if it can."""
    if shutil.which("unshare") is None:
        return "unshare(1) is not installed"
    try:
        probe = subprocess.run(
            ["unshare", "-m", "sh", "-c", MOUNT],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    except OSError as e:
        return f"cannot run unshare: {e}"
    if probe.returncode != 0:
        return f"unshare -m / mount tmpfs not permitted: {probe.stderr.strip()}"
    return None


@pytest.fixture(scope="module")
def small_shm_report() -> dict[str, Any]:
    refusal = _namespace_refusal()
    if refusal is not None:
        pytest.skip(f"needs a private mount namespace for a {SHM_MB} MB /dev/shm; {refusal}")
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", f'{MOUNT} && exec "$0" -c "$1"', sys.executable, CHILD],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


def test_child_sees_a_fresh_64_mb_dev_shm(small_shm_report):
    assert small_shm_report["entries_before"] == []
    assert small_shm_report["free"] == SHM_MB * MB


def test_auto_falls_back_to_memfd_for_a_slab_larger_than_dev_shm(small_shm_report):
    assert small_shm_report["backends"] == ["memfd", "memfd"]


def test_fallback_warns_exactly_once(small_shm_report):
    (message,) = small_shm_report["warnings"]
    assert f"{200 * MB:,} requested" in message
    assert "memfd" in message


def test_fallback_slab_is_usable_end_to_end(small_shm_report):
    assert small_shm_report["bytes_checked"] == 200 * MB
    assert small_shm_report["read_back"] is True


def test_memfd_bytes_do_not_count_against_dev_shm(small_shm_report):
    assert small_shm_report["free_after_write"] == SHM_MB * MB


def test_explicit_posix_raises_capacity_error_naming_sizes_and_fixes(small_shm_report):
    message = small_shm_report["posix_error"]
    assert f"{200 * MB:,} bytes" in message
    assert f"/dev/shm has {SHM_MB * MB:,} bytes free" in message
    assert "--shm-size" in message
    assert "memfd" in message


def test_full_tmpfs_at_reservation_is_a_capacity_error_without_leaks(small_shm_report):
    assert "No space left on device" in small_shm_report["reserve_error"]
    assert small_shm_report["fds_leaked"] == 0


def test_nothing_is_left_in_the_small_tmpfs(small_shm_report):
    assert small_shm_report["entries_after"] == []
    assert small_shm_report["free_at_end"] == SHM_MB * MB
