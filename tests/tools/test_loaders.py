"""The bench's loader columns: an optional loader that is not installed is named once."""

import dataclasses
import io

from tools import _loaders
from tools._report import Progress


def _missing():
    raise ImportError("No module named 'spdl'")


def test_a_missing_optional_loader_is_skipped_with_one_line_saying_so(monkeypatch):
    spdl = dataclasses.replace(_loaders.LOADERS["spdl"], resolve=_missing)
    monkeypatch.setitem(_loaders.LOADERS, "spdl", spdl)
    out = io.StringIO()
    columns = _loaders.resolve_columns(["torch", "spdl"], 2, False, False, Progress(out))
    assert [c.name for c in columns] == ["torch"]
    assert out.getvalue().splitlines() == [
        "SPDL is not installed, so its column is skipped (pip install spdl to add it)"
    ]


def test_a_missing_loader_asked_for_by_name_shows_the_import_error(monkeypatch):
    spdl = dataclasses.replace(_loaders.LOADERS["spdl"], resolve=_missing)
    monkeypatch.setitem(_loaders.LOADERS, "spdl", spdl)
    out = io.StringIO()
    assert _loaders.resolve_columns(["spdl"], 2, False, True, Progress(out)) == []
    assert out.getvalue() == "skipped loader spdl: No module named 'spdl'\n"


def test_the_default_columns_include_spdl_and_tabular_adds_torch_0():
    assert "spdl" in _loaders.DEFAULT_LOADERS.split(",")
    assert _loaders.EXTRA_COLUMNS["tabular"] == ("torch-0",)
    assert _loaders.LOADERS["torch-0"].num_workers == 0
