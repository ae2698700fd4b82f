"""Frames on a worker's pipe: ``multiprocessing.connection``'s framing, read without its cost.

``Connection.send_bytes`` writes a frame as a 4-byte big-endian length (or -1 and an 8-byte
length for 2 GiB or more) followed by the bytes; ``recv_bytes`` reads it back with two ``read``
calls per frame. The readers here take whatever one ``read`` returns -- often several frames --
and cut every whole frame out of a per-pipe buffer; a partial frame waits there for the rest.

Invariant: the bytes cut are exactly the frames written, in order; nothing is lost between
reads (a partial frame stays buffered).
"""

from __future__ import annotations

import os
import select
import struct
from collections import deque
from collections.abc import Iterator
from typing import Final

READ_BYTES: Final = 1 << 16  # one read takes up to this much of a pipe
HEADER: Final = struct.Struct("!i")
_LEN: Final = HEADER
_LONG_LEN: Final = struct.Struct("!Q")


def framed(frame: bytes) -> bytes:
    """``frame`` with the header ``Connection.send_bytes`` puts in front of it."""
    if len(frame) < 0x7FFFFFFF:
        return HEADER.pack(len(frame)) + frame
    return HEADER.pack(-1) + _LONG_LEN.pack(len(frame)) + frame


def cut_frames(buf: bytearray) -> Iterator[bytes]:
    """Every complete frame at the front of ``buf``, removed from it."""
    pos, end = 0, len(buf)
    try:
        while end - pos >= _LEN.size:
            (n,) = _LEN.unpack_from(buf, pos)
            head = _LEN.size
            if n == -1:
                if end - pos < head + _LONG_LEN.size:
                    return
                (n,) = _LONG_LEN.unpack_from(buf, pos + head)
                head += _LONG_LEN.size
            if end - pos < head + n:
                return
            yield bytes(buf[pos + head : pos + head + n])
            pos += head + n
    finally:
        del buf[:pos]


class FrameReader:
    """The frames arriving on one pipe (a worker's end), read a buffer at a time."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buf = bytearray()
        self._frames: deque[bytes] = deque()
        self._poll: select.poll | None = None

    def next(self) -> bytes | None:
        """The next frame, waiting for it; None at end of file (the other end closed)."""
        while not self._frames:
            if not self._fill():
                return None
        return self._frames.popleft()

    def ready(self) -> bool:
        """Whether a frame can be had without waiting (reads what the pipe holds, if anything)."""
        while not self._frames:
            if self._poll is None:  # (not select(): descriptors past 1024 are common)
                self._poll = select.poll()
                self._poll.register(self.fd, select.POLLIN)
            if not self._poll.poll(0) or not self._fill():
                return False
        return True

    def _fill(self) -> bool:
        try:
            data = os.read(self.fd, READ_BYTES)
        except OSError:
            return False
        if not data:
            return False
        self._buf += data
        self._frames.extend(cut_frames(self._buf))
        return True
