import multiprocessing
import os
import struct

from shmloader.frames import FrameReader, cut_frames, framed


def _frame(payload: bytes) -> bytes:
    return struct.pack("!i", len(payload)) + payload


def test_whole_frames_are_cut_in_order_and_a_partial_one_waits_for_the_rest():
    stream = _frame(b"one") + _frame(b"") + _frame(b"three") + _frame(b"four")[:5]
    buf = bytearray(stream)
    assert list(cut_frames(buf)) == [b"one", b"", b"three"]
    assert bytes(buf) == _frame(b"four")[:5]
    buf += _frame(b"four")[5:]
    assert list(cut_frames(buf)) == [b"four"] and not buf


def test_the_long_header_of_multiprocessing_is_understood():
    buf = bytearray(struct.pack("!i", -1) + struct.pack("!Q", 3) + b"abc" + _frame(b"x"))
    assert list(cut_frames(buf)) == [b"abc", b"x"]


def test_a_reader_gets_what_a_connection_sends_and_none_at_end_of_file():
    a, b = multiprocessing.Pipe(duplex=True)
    reader = FrameReader(b.fileno())
    assert not reader.ready()
    big = os.urandom(100_000)  # sent as two writes by multiprocessing
    for payload in (b"first", big, b"last"):
        a.send_bytes(payload)
    assert reader.ready()
    assert [reader.next(), reader.next(), reader.next()] == [b"first", big, b"last"]
    a.close()
    assert reader.next() is None
    b.close()


def test_framed_bytes_are_cut_back_into_the_same_frames():
    buf = bytearray(framed(b"abc") + framed(b"") + framed(bytes(70_000)))
    assert list(cut_frames(buf)) == [b"abc", b"", bytes(70_000)]
    assert buf == bytearray()
