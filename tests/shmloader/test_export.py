import json
import os

import pytest

from shmloader.export import ENV_FD, StatsExport
from shmloader.stats import no_arena

EMPTY = no_arena(0)


def test_export_is_off_unless_the_environment_names_a_descriptor(monkeypatch):
    monkeypatch.delenv(ENV_FD, raising=False)
    assert StatsExport.from_environment() is None
    monkeypatch.setenv(ENV_FD, "7")
    exp = StatsExport.from_environment()
    assert exp is not None and exp.fd == 7 and exp.interval == 0.1


def test_rows_are_json_lines_written_at_most_once_per_interval():
    r, w = os.pipe()
    try:
        exp = StatsExport(w, interval=3600)
        exp.tick(lambda: EMPTY)
        exp.tick(lambda: EMPTY)  # within the interval: nothing written
        os.close(w)
        lines = os.read(r, 1 << 16).decode().splitlines()
    finally:
        os.close(r)
    assert len(lines) == 1
    row = json.loads(lines[0])
    assert row["kind"] == "arena" and row["pid"] == os.getpid()


def test_a_reader_that_went_away_turns_the_export_off_with_one_warning():
    r, w = os.pipe()
    os.close(r)
    exp = StatsExport(w, interval=0)
    try:
        with pytest.warns(RuntimeWarning, match="stops exporting statistics"):
            exp.tick(lambda: EMPTY)
        exp.tick(lambda: EMPTY)  # off: no second write, no second warning
    finally:
        os.close(w)
