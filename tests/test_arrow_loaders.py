"""ArrowDataset under both loaders and every start method: the same batches, in the same order."""

from __future__ import annotations

import os
import re
import traceback

import numpy as np
import pyarrow as pa
import pytest
import torch

import shmloader
from shmloader.arrow import ArrowDataset, ArrowSourceError, collate_padded
from shmloader.arrow.rows import ArrowRows
from tests.arrow_files import every_type_table, tabular_table, write_file
from tests.test_arrow import FIXED, same


def _batches(factory, ds, **kwargs):
    loader = factory(ds, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(3),
                     **kwargs)
    yield from loader


def _compare(ds, **kwargs):
    expected = list(_batches(torch.utils.data.DataLoader, ds, **kwargs))
    seen = 0
    for ours, theirs in zip(_batches(shmloader.DataLoader, ds, **kwargs), expected, strict=True):
        same(ours, theirs)
        seen += 1
    assert seen == len(expected) > 0


@pytest.fixture(scope="module")
def every_path(tmp_path_factory):
    table = every_type_table(rows=200)
    return write_file(table, tmp_path_factory.mktemp("loaders") / "every.arrow", chunk=23)


def test_fork_workers_give_torchs_batches_for_every_fixed_column(every_path):
    _compare(ArrowDataset(every_path, columns=FIXED), num_workers=2, multiprocessing_context="fork")


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_spawned_workers_remap_the_file_and_give_torchs_batches(tmp_path, context):
    ds = ArrowDataset(write_file(tabular_table(96), tmp_path / "t.arrow", chunk=10))
    _compare(ds, num_workers=1, multiprocessing_context=context)


def test_in_process_loading_gives_torchs_batches(every_path):
    _compare(ArrowDataset(every_path, columns=["vec", "name", "meta"]), num_workers=0)


def test_padded_ragged_columns_under_both_loaders(every_path):
    ds = ArrowDataset(every_path, columns=["tokens", "i8"])
    _compare(ds, num_workers=2, collate_fn=collate_padded, multiprocessing_context="fork")


def test_shards_under_workers(tmp_path):
    table = tabular_table(120)
    paths = [write_file(table.slice(0, 50), tmp_path / "a.arrow", chunk=9),
             write_file(table.slice(50), tmp_path / "b.arrow", chunk=13)]
    _compare(ArrowDataset(paths), num_workers=2, multiprocessing_context="fork")


def test_shmloader_workers_gather_columns_without_building_rows(every_path, monkeypatch):
    def refuse(self):
        raise AssertionError("a worker built per-row dicts")

    monkeypatch.setattr(ArrowRows, "_fill", refuse)  # forked workers inherit the patch
    ds = ArrowDataset(every_path, columns=["vec", "i64", "name", "flag"])
    loader = shmloader.DataLoader(ds, batch_size=32, num_workers=2, multiprocessing_context="fork")
    assert sum(len(batch["name"]) for batch in loader) == len(ds)


def _epoch(loader):
    return [int(v) for batch in loader for v in batch["y"]]


def test_spawned_workers_keep_reading_a_file_renamed_over_between_epochs(tmp_path):
    p = write_file(pa.table({"y": np.full(32, 1)}), tmp_path / "t.arrow")
    loader = shmloader.DataLoader(ArrowDataset(p), batch_size=16, num_workers=1,
                                  multiprocessing_context="spawn")
    assert _epoch(loader) == [1] * 32
    os.replace(write_file(pa.table({"y": np.full(32, 2)}), tmp_path / "new.arrow"), p)
    assert _epoch(loader) == [1] * 32  # the new workers re-open the old file, not the path


def test_a_file_changed_before_spawned_workers_reopen_it_is_an_error_naming_it(tmp_path):
    p = write_file(pa.table({"y": np.full(32, 1)}), tmp_path / "t.arrow")
    loader = shmloader.DataLoader(ArrowDataset(p), batch_size=16, num_workers=1,
                                  multiprocessing_context="spawn")
    assert _epoch(loader) == [1] * 32
    write_file(pa.table({"y": np.full(40, 2)}), p)  # rewritten in place
    with pytest.raises(ArrowSourceError, match=r"t\.arrow: the file changed since it was opened"):
        _epoch(loader)


def _one_batch(ds, workers):
    more = {"num_workers": 2, "multiprocessing_context": "fork"} if workers else {}
    return next(iter(shmloader.DataLoader(ds, batch_size=16, **more)))


@pytest.mark.parametrize("workers", [0, 2], ids=["in-process", "workers"])
def test_a_ragged_column_is_refused_naming_it_and_the_fix_with_or_without_workers(every_path,
                                                                                   workers):
    ds = ArrowDataset(every_path, columns=["i8", "tokens"])
    with pytest.raises(RuntimeError) as raised:
        _one_batch(ds, workers)
    told = "".join(traceback.format_exception(raised.value))
    assert re.search(r"'tokens' holds variable-length.*collate_ragged", told)


_TORCH_STACK_ERROR = re.compile(
    r"stack expects each tensor to be equal size[^\n]*|Trying to resize storage that is not "
    r"resizable"
)


@pytest.mark.parametrize("workers", [0, 2], ids=["in-process", "workers"])
@pytest.mark.parametrize("first", ["shortest", "longest"])
def test_a_ragged_column_raises_torchs_words_with_the_fix_in_a_note(tmp_path, workers, first):
    # Review 67: shmloader's own message replaced torch's ("stack expects each tensor to be
    # equal size, ..." or, in a worker whose first row is the longest, "Trying to resize
    # storage ..."); what shmloader knows (the column, the fix) is a note now.
    lengths = [i % 3 for i in range(16)]
    if first == "longest":
        lengths = lengths[::-1]
    table = pa.table({"t": pa.array([list(range(n)) for n in lengths], pa.list_(pa.int64()))})
    ds = ArrowDataset(write_file(table, tmp_path / "r.arrow"))
    more = {"num_workers": 2, "multiprocessing_context": "fork"} if workers else {}
    with pytest.raises(RuntimeError) as ours:
        next(iter(shmloader.DataLoader(ds, batch_size=16, **more)))
    with pytest.raises(RuntimeError) as theirs:
        next(iter(torch.utils.data.DataLoader(ds, batch_size=16, **more)))
    words = _TORCH_STACK_ERROR.search(str(theirs.value))
    assert words is not None, str(theirs.value)
    assert _TORCH_STACK_ERROR.search(str(ours.value)).group(0) == words.group(0)
    told = "".join(traceback.format_exception(ours.value))
    assert re.search(r"column 't' holds variable-length.*collate_ragged", told)


@pytest.mark.parametrize("workers", [0, 2], ids=["in-process", "workers"])
def test_a_null_first_in_a_batch_is_torchs_error_with_a_note_naming_the_column(tmp_path, workers):
    paths = [None if i % 16 == 0 else f"p{i}" for i in range(32)]
    table = pa.table({"i": pa.array(range(32)), "meta": pa.array([{"path": p} for p in paths])})
    ds = ArrowDataset(write_file(table, tmp_path / "n.arrow"))
    with pytest.raises(TypeError, match="found <class 'NoneType'>") as raised:
        _one_batch(ds, workers)
    told = "".join(traceback.format_exception(raised.value))
    assert "null in column 'meta.path'" in told
    with pytest.raises(TypeError, match="found <class 'NoneType'>") as theirs:  # torch's own
        next(iter(torch.utils.data.DataLoader(ds, batch_size=16)))
    assert "meta.path" not in "".join(traceback.format_exception(theirs.value))
