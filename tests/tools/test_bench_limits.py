"""tools.bench's limits: the streaming limit is measured exactly where shmloader streams, and the
table shows each limit in its own row with the loaders' percentage of it."""

from __future__ import annotations

import pytest

from arena import stream
from tools import _measure
from tools._report import LoaderResult, RunSample, WorkloadResult, format_table
from tools._synthetic import make_workload


@pytest.mark.skipif(not stream.AVAILABLE, reason="arena._stream not built here")
def test_the_streaming_limit_is_measured_for_image_and_not_for_small_batches(monkeypatch):
    image = make_workload("image", seed=0, quick=True)
    assert _measure.streams(image)
    assert not _measure.streams(make_workload("tabular", seed=0, quick=True))
    assert not _measure.streams(make_workload("ragged", seed=0, quick=True))  # own collate_fn
    monkeypatch.setattr(_measure, "STREAMING", False)  # SHMLOADER_STREAMING=0
    assert not _measure.streams(image)


@pytest.mark.skipif(not stream.AVAILABLE, reason="arena._stream not built here")
def test_a_streaming_limit_process_copies_and_reports_a_rate():
    image = make_workload("image", seed=0, quick=True, batch_size=8)
    assert _measure.n_process_limit(image, 1, seconds=0.05, buffers=2, stream=True) > 0


def test_the_table_gives_each_limit_its_row_and_each_loader_its_percentages():
    wr = WorkloadResult(
        "image",
        limit_batches_per_s=100.0,
        limit_bytes_per_batch=10**9,
        nproc_limit_batches_per_s=200.0,
        nproc2_limit_batches_per_s=160.0,
        nproc_stream_limit_batches_per_s=250.0,
        nproc=2,
        bare_us_per_batch=1500,
    )
    shm = LoaderResult("shmloader", 2)
    shm.add(
        RunSample(
            batches=200,
            seconds=1.0,
            cpu_seconds=0.02,
            peak_pss_mb=300,
            bytes_per_batch=10**9,
            worker_cpu_seconds=0.5,
        )
    )
    wr.loaders = [shm]
    table = _cells(format_table([wr]))
    rows = {row["loader"]: row for row in table}
    assert list(rows) == [
        "single-copy",
        "2-process",
        "2-process x2 buffers",
        "2-process x2 streaming",
        "bare fetch+collate",
        "shmloader (2w)",
    ]
    for label, column in (
        ("single-copy", "% limit"),
        ("2-process", "% N-proc"),
        ("2-process x2 buffers", "% N-proc x2"),
        ("2-process x2 streaming", "% N-proc stream"),
    ):
        assert [k for k, v in rows[label].items() if v == "100%"] == [column]
    assert rows["2-process x2 streaming"]["batches/s"] == "250.0"
    assert rows["2-process x2 streaming"]["GB/s"] == "250.00"
    assert rows["bare fetch+collate"]["worker CPU us/batch"] == "1,500"
    shm_row = rows["shmloader (2w)"]  # 200 batches/s against limits 100 / 200 / 160 / 250
    assert [shm_row[k] for k in ("% limit", "% N-proc", "% N-proc x2", "% N-proc stream")] == [
        "200.0%",
        "100.0%",
        "125.0%",
        "80.0%",
    ]
    assert wr.summary(shm)["pct_nproc_stream_limit"] == pytest.approx(80.0)


def _cells(table: str) -> list[dict[str, str]]:
    """The table's rows as {header: cell}, cut at the dashed line's column boundaries."""
    header, dashes, *lines = table.splitlines()
    spans, at = [], 0
    for dash in dashes.split("  "):
        spans.append((at, at + len(dash)))
        at += len(dash) + 2
    names = [header[a:b].strip() for a, b in spans]
    return [
        {n: line[a:b].strip() for n, (a, b) in zip(names, spans, strict=True)} for line in lines
    ]
