"""Tests of arena.stream: streaming copies give exactly the bytes memcpy gives, and nothing else
is touched; the extension is built wherever it can be."""

from __future__ import annotations

import platform
import shutil
import sysconfig

import numpy as np
import pytest

from arena import stream

needs_stream = pytest.mark.skipif(
    not stream.AVAILABLE, reason="arena._stream not built here (no C compiler, or not x86-64)"
)
GUARD = 64  # bytes checked on each side of the destination


def _compiler() -> str | None:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(cc)


@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or _compiler() is None,
    reason="streaming stores are built for x86-64 with a C compiler only",
)
def test_the_extension_is_built_where_a_compiler_and_sse2_exist():
    # optional=True lets an install without a compiler succeed; this catches a build that
    # failed silently where it should not have.
    assert stream.AVAILABLE


def _gather_into(buf: np.ndarray, at: int, size: int, sources: list[np.ndarray]) -> None:
    stream.gather(int(buf.ctypes.data) + at, size, [int(s.ctypes.data) for s in sources])


@needs_stream
@pytest.mark.parametrize("size", [0, 1, 15, 16, 17, 63, 64, 65, 127, 1000, 4097, (1 << 20) + 3])
@pytest.mark.parametrize("dst_shift", [0, 1, 8, 15])
def test_gather_writes_each_block_at_its_place_and_nothing_around_it(size, dst_shift):
    rng = np.random.default_rng(size * 31 + dst_shift)
    count = 5
    # sources at every misalignment: block i starts i bytes into its own buffer
    backing = [rng.integers(0, 256, size + 16, dtype=np.uint8) for _ in range(count)]
    sources = [b[i : i + size] for i, b in enumerate(backing)]
    buf = np.full(GUARD + dst_shift + count * size + GUARD, 0xA5, dtype=np.uint8)
    _gather_into(buf, GUARD + dst_shift, size, sources)
    start = GUARD + dst_shift
    np.testing.assert_array_equal(buf[start : start + count * size], np.concatenate(sources))
    assert (buf[:start] == 0xA5).all()
    assert (buf[start + count * size :] == 0xA5).all()


@needs_stream
def test_gather_of_more_blocks_than_its_stack_array_holds():
    rng = np.random.default_rng(0)
    sources = [rng.integers(0, 256, 100, dtype=np.uint8) for _ in range(200)]
    buf = np.zeros(200 * 100, dtype=np.uint8)
    _gather_into(buf, 0, 100, sources)
    np.testing.assert_array_equal(buf, np.concatenate(sources))


@needs_stream
def test_gather_of_no_blocks_writes_nothing():
    buf = np.full(GUARD, 7, dtype=np.uint8)
    _gather_into(buf, 0, 4096, [])
    assert (buf == 7).all()


@needs_stream
@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((0, -1, []), ValueError, "size must be >= 0, got -1"),
        ((0, 8, 5), TypeError, "srcs must be a sequence of addresses"),
        ((0, 8, ["x"]), TypeError, "an integer is required"),
        ((0, 8, [-1]), OverflowError, "negative"),
        (("0", 8, []), TypeError, "argument 1 must be int"),
        ((-64, 8, []), OverflowError, "negative"),
    ],
)
def test_gather_rejects_bad_arguments_before_copying(args, error, match):
    with pytest.raises(error, match=match):
        stream.gather(*args)


def test_gather_without_the_extension_says_to_check_available(monkeypatch):
    monkeypatch.setattr(stream, "_ext", None)
    with pytest.raises(RuntimeError, match=r"check arena\.stream\.AVAILABLE first"):
        stream.gather(0, 0, [])
