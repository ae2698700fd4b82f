"""tools.bench's limits: the streaming limit is measured exactly where shmloader streams, the
N-process bare ceiling runs the workload's own fetch and collate in every process, and the table
shows each limit in its own row with the loaders' percentage of it."""

from __future__ import annotations

import io
import multiprocessing

import pytest
import torch

from arena import stream
from tools import _measure
from tools._report import LoaderResult, RunSample, WorkloadResult, format_table
from tools._synthetic import Workload, make_workload


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


class _CountingDataset(torch.utils.data.Dataset):
    """Counts its samples, in every process, into one shared counter."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.count = multiprocessing.get_context("fork").Value("q", 0)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        with self.count.get_lock():
            self.count.value += 1
        return torch.full((4,), float(i)), i


def test_the_n_process_bare_ceiling_runs_the_fetch_and_collate_in_every_process():
    dataset = _CountingDataset(64)
    workload = Workload("counting", dataset, 8, None, "counted samples")
    rate = _measure.n_process_bare(workload, 2, seconds=0.05)
    # Each process collates one untimed batch, then batches for 0.05 s; the rate is their sum.
    assert rate > 0
    assert dataset.count.value >= 2 * 2 * 8
    assert dataset.count.value % 8 == 0


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
        nproc_bare_batches_per_s=300.0,
    )
    shm = LoaderResult("shmloader", 2)
    shm.add(
        RunSample(
            batches=200,
            seconds=1.0,
            cpu_seconds=0.02,
            peak_footprint_mb=300,
            bytes_per_batch=10**9,
            worker_cpu_seconds=0.5,
        )
    )
    torch0 = LoaderResult("torch-0", 0)
    torch0.add(RunSample(batches=120, seconds=1.0, cpu_seconds=0.9, peak_footprint_mb=200,
                         bytes_per_batch=10**9))
    wr.loaders = [shm, torch0]
    table = _cells(format_table([wr]))
    rows = {row["loader"]: row for row in table}
    assert list(rows) == [
        "single-copy",
        "2-process",
        "2-process x2 buffers",
        "2-process x2 streaming",
        "bare fetch+collate",
        "2-process bare",
        "shmloader (2w)",
        "torch-0 (0w)",
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
    # the bare ceiling: its rate, and against torch-0 (300 / 120) the most "x torch-0" can be
    assert rows["2-process bare"]["batches/s"] == "300.0"
    assert rows["2-process bare"]["x torch-0"] == "2.50"
    assert rows["shmloader (2w)"]["x torch-0"] == "1.67"
    shm_row = rows["shmloader (2w)"]  # 200 batches/s against limits 100 / 200 / 160 / 250
    # above a limit: marked, and said once under the table (review 60: no ceiling in that run)
    assert [shm_row[k] for k in ("% limit", "% N-proc", "% N-proc x2", "% N-proc stream")] == [
        "200.0%!",
        "100.0%",
        "125.0%!",
        "80.0%",
    ]
    assert wr.summary(shm)["pct_nproc_stream_limit"] == pytest.approx(80.0)
    notes = [line for line in format_table([wr]).splitlines() if line.startswith("! ")]
    assert len(notes) == 1 and "no ceiling in this run" in notes[0]


def test_each_n_process_limit_is_the_median_of_one_run_before_each_repeat(monkeypatch):
    """Review 60: the limit was one 1-s run before the loaders, which moved 1.7x between runs,
    and a loader reached 187 % of it."""
    from tools import bench
    from tools._report import Progress

    rates = iter([100.0, 50.0, 300.0, 70.0, 200.0, 60.0])
    monkeypatch.setattr(bench, "n_process_limit", lambda workload, n, **kw: next(rates))
    monkeypatch.setattr(bench, "streams", lambda workload: False)
    workload = make_workload("tabular", seed=0, quick=True)
    wr = WorkloadResult("tabular")
    for repeat in range(3):
        bench._n_process_limits(workload, 2, wr, f"repeat {repeat}", Progress(io.StringIO()))
    assert wr.nproc_limit_runs == [100.0, 300.0, 200.0] and wr.nproc2_limit_runs == [50.0, 70.0,
                                                                                     60.0]
    assert (wr.nproc, wr.nproc_limit_batches_per_s, wr.nproc2_limit_batches_per_s) == (2, 200.0,
                                                                                       60.0)
    assert wr.nproc_stream_limit_batches_per_s == 0.0


def _cells(table: str) -> list[dict[str, str]]:
    """The table's rows as {header: cell}, cut at the dashed line's column boundaries."""
    header, dashes, *lines = table.splitlines()
    lines = [line for line in lines if not line.startswith("! ")]  # the notes under the table
    spans, at = [], 0
    for dash in dashes.split("  "):
        spans.append((at, at + len(dash)))
        at += len(dash) + 2
    names = [header[a:b].strip() for a, b in spans]
    return [
        {n: line[a:b].strip() for n, (a, b) in zip(names, spans, strict=True)} for line in lines
    ]


def test_the_limits_pad_ragged_samples_as_a_padding_collate_does():
    """Review 41: the N-process limit 'copied' a ragged batch with out.zero_(), a memset at about
    twice the padded copy's rate; both limits now write what tools._synthetic.pad_collate
    writes."""
    from tools._synthetic import pad_collate

    gen = torch.Generator().manual_seed(0)
    samples = [torch.randint(1, 255, (3, h, w), dtype=torch.uint8, generator=gen)
               for h, w in ((5, 7), (6, 4), (3, 8))]  # fmt: skip
    out = torch.full((3, 3, 6, 8), 99, dtype=torch.uint8)  # the last batch's bytes
    _measure._padded_copy(samples, out)
    expected, _ = pad_collate([(s, 0) for s in samples])
    assert torch.equal(out, expected)


class _Batched(torch.utils.data.Dataset):
    """A dataset with a batched fetch, as ArrowDataset has: records which path was used."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        self.calls.append("item")
        return torch.zeros(2)

    def __getitems__(self, idx: list[int]) -> list[torch.Tensor]:
        self.calls.append("items")
        return [torch.zeros(2) for _ in idx]


def test_the_bare_loop_fetches_through_getitems_as_the_loaders_do():
    """Review 41: the bare loop fetched row by row where both loaders call __getitems__ (on
    ArrowDataset 20x slower), so its ceiling was far below what the loaders reached."""
    dataset = _Batched()
    indices, fetch_collate = _measure._bare_batch(Workload("batched", dataset, 4, None, ""), 0)
    fetch_collate(indices(0))
    assert dataset.calls == ["items"]
