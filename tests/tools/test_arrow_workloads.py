"""The arrow workloads of the bench and memprof: same rows three ways, and memprof's arrow table."""

from __future__ import annotations

import os

import torch
from torch.utils.data import default_collate

from shmloader.arrow import ArrowDataset
from tests.test_arrow import same
from tools import memprof
from tools._memjob import PixelsInMemory, memory_split
from tools._synthetic import ARROW_CHUNK_ROWS, PyRowsDataset, arrow_file


def test_python_list_rows_give_the_arrow_datasets_batches(tmp_path):
    path = arrow_file("tabular", 300, 1, str(tmp_path))
    assert arrow_file("tabular", 300, 1, str(tmp_path)) == path  # reused, not rewritten
    arrow, rows = ArrowDataset(path), PyRowsDataset.from_arrow(path)
    idx = [299, 0, 17]
    same(default_collate([rows[i] for i in idx]), default_collate([arrow[i] for i in idx]))
    assert type(rows.rows[0]["features"]) is list  # Python objects, as Table.to_pylist gives


def test_pixels_rows_agree_in_file_memory_and_list(tmp_path):
    rows = ARROW_CHUNK_ROWS + 5  # two record batches
    path = arrow_file("pixels", rows, 0, str(tmp_path))
    arrow, memory, listed = (ArrowDataset(path), PixelsInMemory(path),
                             PyRowsDataset.from_arrow(path))
    for i in (0, rows - 1):
        same(memory[i], arrow[i])
        same(default_collate([listed[i]]), default_collate([arrow[i]]))  # label: int vs tensor
    assert arrow[rows - 1]["pixels"].shape == (3, 32, 32)
    assert arrow[rows - 1]["pixels"].dtype is torch.uint8


def test_memory_split_reads_anonymous_and_file_bytes():
    split = memory_split(os.getpid(), [])
    assert split["main"]["Pss_Anon"] > 0 and split["main"]["Pss_File"] > 0
    assert split["workers"] == dict.fromkeys(split["workers"], 0)


def _summary(total, anon, cached, dirty):
    return {"peak_total_pss": total, "processes": [],
            "job": {"at_end": {"main": {"Pss_Anon": anon, "Pss_File": cached},
                               "workers": {"Pss_Anon": 0, "Pss_File": 0,
                                           "Private_Dirty": dirty}}}}


def test_arrow_table_measures_against_the_in_memory_run():
    mib = 1 << 20
    runs = {"arrow-file": _summary(900 * mib, 100 * mib, 800 * mib, 5 * mib),
            "arrow-memory": _summary(1000 * mib, 900 * mib, 100 * mib, 5 * mib),
            "arrow-list": _summary(3000 * mib, 2900 * mib, 100 * mib, 1500 * mib)}
    text, numbers = memprof.arrow_table(runs, 1000 * mib)
    assert numbers["arrow-file"]["over_memory"] == -100 * mib
    assert numbers["arrow-list"]["over_memory_per_file"] == 2.0
    assert numbers["arrow-list"]["end_workers_private_dirty"] == 1500 * mib
    assert "arrow-list" in text.splitlines()[-1]
