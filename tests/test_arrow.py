"""ArrowDataset in one process: values against pyarrow's own, batches against default_collate,
formats and shards, the slot fast path, and every bad input the issue lists."""

from __future__ import annotations

import gc
import os
import pickle

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import default_collate

from shmloader.arrow import ArrowDataset, ArrowSourceError, collate_padded, collate_ragged
from shmloader.arrow.rows import ArrowRows
from shmloader.collate import SlotSession, slot_default_collate
from tests.arrow_files import (
    NUMBER_TYPES,
    ROWS,
    every_type_table,
    tabular_table,
    write_file,
    write_stream,
)

INDICES = [3, 500, 7, 999, 96, 97, 98, 0, 3]  # repeats, record-batch edges, both ends
FIXED = [*NUMBER_TYPES, "flag", "vec", "grid", "tensor", "name", "large_name", "blob",
         "large_blob", "digest", "meta"]  # every column but the variable-length lists


@pytest.fixture(scope="module")
def table():
    return every_type_table()


@pytest.fixture(scope="module")
def path(table, tmp_path_factory):
    return write_file(table, tmp_path_factory.mktemp("arrow") / "every.arrow")


@pytest.fixture(scope="module")
def ds(path):
    return ArrowDataset(path)


def plain(value):
    """An item's value as pyarrow's to_pylist gives it."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


def _bytes(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def same(a, b):
    """Batches equal in structure, type, dtype, shape and values."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(_bytes(a), _bytes(b))
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            same(x, y)
    else:
        assert a == b


# -- values ---------------------------------------------------------------------------------------


def test_every_type_equals_pyarrows_own_values(ds, table):
    assert len(ds) == ROWS == table.num_rows
    for i in INDICES:
        expected = table.slice(i, 1).to_pylist()[0]
        item = ds[i]
        assert list(item) == table.column_names
        for name, value in item.items():
            want = expected[name]
            if name == "tensor":
                assert value.shape == (2, 3, 4)
                value = value.flatten()
            assert plain(value) == want, (name, i)


@pytest.mark.parametrize("name", list(NUMBER_TYPES))
def test_number_columns_keep_their_dtype_as_0d_tensors(ds, name):
    item = ds[5][name]
    assert item.dtype is NUMBER_TYPES[name][1] and item.shape == ()


def test_item_types_per_arrow_type(ds):
    item = ds[4]
    assert item["flag"].dtype is torch.bool and item["flag"].shape == ()
    assert item["vec"].dtype is torch.float32 and item["vec"].shape == (64,)
    assert item["grid"].dtype is torch.int16 and item["grid"].shape == (2, 3)
    assert item["tensor"].dtype is torch.uint8 and item["tensor"].shape == (2, 3, 4)
    assert item["tokens"].dtype is torch.int64 and item["tokens"].dim() == 1
    assert item["big_tokens"].dtype is torch.float32 and item["big_tokens"].tolist() == [4.0] * 0
    assert isinstance(item["name"], str) and isinstance(item["blob"], bytes)
    assert item["digest"] == (4).to_bytes(4, "little")
    assert plain(item["meta"]) == {"id": 4, "tag": "t4"}


def test_negative_index_counts_from_the_end_as_a_list_does(ds):
    same(ds[-1], ds[ROWS - 1])
    assert ds[np.int64(3)]["i64"] == ds[3]["i64"]


# -- batches --------------------------------------------------------------------------------------


def test_slot_collate_equals_default_collate_of_the_items(path):
    ds = ArrowDataset(path, columns=FIXED)
    ours = slot_default_collate(ds.__getitems__(INDICES))
    same(ours, default_collate([ds[i] for i in INDICES]))


def test_torch_default_collate_of_getitems_equals_that_of_the_items(path):
    ds = ArrowDataset(path, columns=FIXED)
    same(default_collate(ds.__getitems__(INDICES)), default_collate([ds[i] for i in INDICES]))


def test_columns_selects_and_orders(path):
    ds = ArrowDataset(path, columns=["name", "i8"])
    assert list(ds[0]) == ["name", "i8"] and ds.columns == ["name", "i8"]


def test_gathered_columns_are_born_inside_the_slot(path):
    ds = ArrowDataset(path, columns=["vec", "i64", "flag", "tokens"])
    slot = memoryview(bytearray(1 << 20))
    idx = [i for i in range(0, 400, 7) if ds[i]["tokens"].numel() == 3][:8]
    with SlotSession(slot) as session:
        batch = slot_default_collate(ds.__getitems__(idx))
        for t in (batch["vec"], batch["i64"], batch["flag"], batch["tokens"]):
            assert session.holds(t.data_ptr(), t.nbytes)
        assert not session.overflowed
    same(batch, default_collate([ds[i] for i in idx]))


def test_without_a_slot_the_batch_is_planned_as_meta_tensors(path):
    ds = ArrowDataset(path, columns=["vec", "name"])
    with SlotSession(None) as session:
        batch = slot_default_collate(ds.__getitems__([1, 2]))
    assert session.planned and batch["vec"].is_meta and batch["vec"].shape == (2, 64)
    assert batch["name"] == [ds[1]["name"], ds[2]["name"]]


def test_equal_length_lists_stack_as_default_collate_does(tmp_path):
    table = pa.table({"x": pa.array([[1, 2], [3, 4], [5, 6]], pa.list_(pa.int32()))})
    ds = ArrowDataset(write_file(table, tmp_path / "eq.arrow", chunk=2))
    same(slot_default_collate(ds.__getitems__([0, 2])), default_collate([ds[0], ds[2]]))


def test_ragged_lists_refuse_default_collate_naming_the_column_and_the_fix(ds):
    idx = [i for i in range(50) if ds[i]["tokens"].numel() in (1, 5)][:2]
    with pytest.raises(RuntimeError, match=r"'tokens' holds variable-length.*collate_padded"):
        slot_default_collate(ds.__getitems__(idx))
    with pytest.raises(RuntimeError):  # torch's own default_collate refuses them too
        default_collate(ds.__getitems__(idx))


def test_collate_ragged_gives_a_list_of_1d_tensors(ds):
    batch = collate_ragged(ds.__getitems__(INDICES))
    same(batch["tokens"], [ds[i]["tokens"] for i in INDICES])
    same(batch["vec"], torch.stack([ds[i]["vec"] for i in INDICES]))


def test_collate_padded_gives_zero_padded_tensor_and_lengths(ds):
    padded, lengths = collate_padded(ds.__getitems__(INDICES))["tokens"]
    items = [ds[i]["tokens"] for i in INDICES]
    same(lengths, torch.tensor([len(t) for t in items]))
    same(padded, torch.nn.utils.rnn.pad_sequence(items, batch_first=True))


def test_collate_helpers_refuse_plain_lists(ds):
    with pytest.raises(TypeError, match=r"ArrowDataset\.__getitems__"):
        collate_ragged([ds[0]])


def test_transform_runs_per_item(path):
    ds = ArrowDataset(path, columns=["i32"], transform=lambda r: {"twice": r["i32"] * 2})
    assert ds[3]["twice"] == 2 * ArrowDataset(path)[3]["i32"]
    rows = ds.__getitems__([3, 4])
    assert type(rows) is list and len(rows) == 2


# -- the lazy list --------------------------------------------------------------------------------


def test_rows_behave_as_the_list_of_items(ds):
    rows = ds.__getitems__([2, 1])
    assert isinstance(rows, ArrowRows) and len(rows) == 2 and not rows._filled
    assert rows[0]["i64"] == ds[2]["i64"]
    assert len(rows) == 2 and rows.collate_into(torch.empty) is NotImplemented
    assert [r["name"] for r in rows] == [ds[2]["name"], ds[1]["name"]]
    named = ArrowDataset(ds._shards[0].name, columns=["name", "vec"])
    copied = pickle.loads(pickle.dumps(named.__getitems__([1])))
    assert type(copied) is list and copied[0]["name"] == ds[1]["name"]


# -- sources --------------------------------------------------------------------------------------


def test_stream_file_equals_ipc_file(table, ds, tmp_path):
    stream = ArrowDataset(write_stream(table, tmp_path / "every.stream.arrow"))
    same(stream[123], ds[123])
    same(collate_ragged(stream.__getitems__(INDICES)), collate_ragged(ds.__getitems__(INDICES)))


def test_in_memory_table_equals_the_file(table, ds):
    mem = ArrowDataset(table)
    same(mem[999], ds[999])
    copy = pickle.loads(pickle.dumps(mem))
    same(copy[5], ds[5])


def test_shards_concatenate_in_order(tmp_path):
    table = tabular_table(300)
    paths = [write_file(table.slice(a, b - a), tmp_path / f"part{k}.arrow", chunk=40)
             for k, (a, b) in enumerate([(0, 100), (100, 100), (100, 300)])]  # one is empty
    shards = ArrowDataset(paths)
    whole = ArrowDataset(write_file(table, tmp_path / "whole.arrow"))
    assert len(shards) == 300
    idx = [299, 0, 150, 99, 100, 5]
    same(slot_default_collate(shards.__getitems__(idx)),
         slot_default_collate(whole.__getitems__(idx)))
    same(shards[100], whole[100])


def test_a_file_without_rows_is_an_empty_dataset(tmp_path):
    ds = ArrowDataset(write_file(tabular_table(5).slice(0, 0), tmp_path / "empty.arrow"))
    assert len(ds) == 0 and slot_default_collate(ds.__getitems__([]))["name"] == []
    with pytest.raises(IndexError):
        ds[0]


def test_dataset_pickles_by_path_at_a_size_independent_of_the_file(tmp_path):
    small = ArrowDataset(write_file(tabular_table(10), tmp_path / "s.arrow"))
    big = ArrowDataset(write_file(tabular_table(20_000), tmp_path / "b.arrow"))
    assert len(pickle.dumps(big)) < 1000
    assert abs(len(pickle.dumps(big)) - len(pickle.dumps(small))) < 20
    same(pickle.loads(pickle.dumps(big))[19_999], big[19_999])


def test_mapped_buffers_outlive_the_memory_map_object(path):
    ds = ArrowDataset(path, columns=["vec"])
    import gc

    gc.collect()
    assert ds[7]["vec"].shape == (64,)


# -- bad input ------------------------------------------------------------------------------------


def test_missing_file_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.arrow"):
        ArrowDataset(tmp_path / "nope.arrow")


def test_non_arrow_file_names_the_file(tmp_path):
    p = tmp_path / "notes.txt"
    p.write_text("hello, world\n" * 10)
    with pytest.raises(ArrowSourceError, match=r"notes.txt: cannot read it as an Arrow IPC stream"):
        ArrowDataset(p)


def test_empty_file_is_refused(tmp_path):
    p = tmp_path / "empty.arrow"
    p.write_bytes(b"")
    with pytest.raises(ArrowSourceError, match=r"empty\.arrow: the file is empty"):
        ArrowDataset(p)


def test_parquet_file_points_to_tools_pack(tmp_path):
    p = tmp_path / "t.parquet"
    pq.write_table(tabular_table(5), p)
    with pytest.raises(ArrowSourceError, match=r"Parquet file.*python -m tools.pack"):
        ArrowDataset(p)


def test_compressed_ipc_file_is_refused_with_the_fix(tmp_path):
    p = write_file(tabular_table(50), tmp_path / "z.arrow", compression="zstd")
    with pytest.raises(ArrowSourceError, match=r"column 'features'.*compressed.*tools.pack"):
        ArrowDataset(p)


def test_a_struct_with_a_field_name_twice_is_refused_at_open(tmp_path):
    """Review 38: a struct with fields a:int64 and a:float64 gave {'s': {'a': 10.0}}, the int
    field silently gone (pyarrow's own to_pylist refuses such a table)."""
    s = pa.StructArray.from_arrays(
        [pa.array([1, 2], pa.int64()), pa.array([10.0, 20.0])], names=["a", "a"]
    )
    p = write_file(pa.table({"s": s, "id": pa.array([0, 1], pa.int64())}), tmp_path / "s.arrow")
    with pytest.raises(ArrowSourceError, match=r"struct column 's' has field 'a' more than once"):
        ArrowDataset(p)
    assert ArrowDataset(p, columns=["id"])[1] == {"id": torch.tensor(1)}


def test_a_file_this_process_has_no_address_space_for_names_itself_and_the_limit(tmp_path):
    """Review 38: a bare ``OSError [Errno 12] mmap (the address range)``, naming neither the
    file nor ``ulimit -v``. (A sparse file: it fails at the mapping, before any parsing.)"""
    import resource

    from tests.forked import ForkedChild

    p = tmp_path / "big.arrow"
    with open(p, "wb") as f:
        f.truncate(1 << 30)

    def open_it_under_a_limit() -> str:
        with open("/proc/self/status") as status:
            vm = next(int(x.split()[1]) << 10 for x in status if x.startswith("VmSize"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + (64 << 20), resource.RLIM_INFINITY))
        try:
            ArrowDataset(p)
        except ArrowSourceError as e:
            return str(e)
        return "opened"

    message = ForkedChild(open_it_under_a_limit, timeout=60).result()
    assert message.startswith(f"{p}: cannot map its 1,073,741,824 bytes: ")
    assert "`ulimit -v`, RLIMIT_AS" in message


def test_a_column_of_type_null_is_refused_as_a_type_not_as_a_null(tmp_path):
    """Review 38: it said 'has a null at row 0 ... fill or drop nulls', which cannot help."""
    p = write_file(pa.table({"n": pa.nulls(3), "id": pa.array([0, 1, 2])}), tmp_path / "n.arrow")
    with pytest.raises(ArrowSourceError, match=r"column 'n' has type null, which ArrowDataset"):
        ArrowDataset(p)


def test_truncated_file_is_refused_at_open(path, tmp_path):
    p = tmp_path / "cut.arrow"
    p.write_bytes(path.read_bytes()[: os.path.getsize(path) // 2])
    with pytest.raises(ArrowSourceError, match=r"cut\.arrow: cannot read it"):
        ArrowDataset(p)


def test_truncated_stream_is_refused_at_open(table, tmp_path):
    full = write_stream(table, tmp_path / "full.stream")
    p = tmp_path / "cut.stream"
    p.write_bytes(full.read_bytes()[:-1000])
    with pytest.raises(ArrowSourceError, match=r"cut\.stream: cannot read it as an Arrow IPC"):
        ArrowDataset(p)


def test_file_rewritten_while_mapped_fails_the_next_batch_not_with_sigbus(tmp_path):
    p = write_file(tabular_table(500), tmp_path / "t.arrow")
    ds = ArrowDataset(p)
    data = p.read_bytes()
    with open(p, "r+b") as f:  # truncate in place, as a careless rewrite would
        f.truncate(len(data) // 3)
    with pytest.raises(ArrowSourceError, match=r"t.arrow: the file changed while mapped"):
        slot_default_collate(ds.__getitems__([1, 2]))


def test_file_changed_before_a_worker_reopens_it_is_refused_at_first_use(tmp_path):
    p = write_file(tabular_table(50), tmp_path / "t.arrow")
    original = ArrowDataset(p)
    blob = pickle.dumps(original)
    write_file(tabular_table(60), p)  # rewritten in place: the same inode, other bytes
    copy = pickle.loads(blob)  # a worker unpickles before it can report an error: defer it
    for use in (len, lambda d: d[0], lambda d: d.__getitems__([0])):
        with pytest.raises(ArrowSourceError, match=r"t\.arrow: the file changed since it was "
                                                    r"opened \(re-opened through /proc/"):
            use(copy)
    assert "unusable" in repr(copy)
    with pytest.raises(ArrowSourceError, match=r"t\.arrow: the file changed"):
        pickle.loads(pickle.dumps(copy))[0]  # still pickles as the same file


def test_a_file_renamed_over_the_path_is_never_seen_by_the_open_dataset_nor_its_copies(tmp_path):
    p = write_file(pa.table({"y": np.full(30, 1)}), tmp_path / "t.arrow")
    ds = ArrowDataset(p)
    os.replace(write_file(pa.table({"y": np.full(40, 2)}), tmp_path / "new.arrow"), p)
    # the old inode is unlinked, yet it is the file still mapped and served
    assert len(ds) == 30 and int(slot_default_collate(ds.__getitems__([0, 29]))["y"][1]) == 1
    copy = pickle.loads(pickle.dumps(ds))  # as a spawned worker: the descriptor, not the path
    assert len(copy) == 30 and int(copy[29]["y"]) == 1
    assert len(ArrowDataset(p)) == 40  # opening the path again gives the new file


def test_metadata_changes_are_not_changes_of_the_file(tmp_path):
    # A chmod or a hard link (a backup tool, a permissions sweep) must not fail a running job.
    p = write_file(pa.table({"y": np.full(100, 1)}), tmp_path / "t.arrow")
    ds = ArrowDataset(p)
    os.chmod(p, 0o444)
    os.link(p, tmp_path / "link.arrow")
    assert int(ds[99]["y"]) == 1
    assert int(pickle.loads(pickle.dumps(ds))[0]["y"]) == 1


def test_a_relative_path_is_reopened_from_where_it_was_opened(tmp_path, monkeypatch):
    write_file(tabular_table(20), tmp_path / "rel.arrow")
    monkeypatch.chdir(tmp_path)
    blob = pickle.dumps(ArrowDataset("rel.arrow"))
    gc.collect()  # the opening dataset is gone: a re-open must use the path
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # e.g. Hydra's run directory
    copy = pickle.loads(blob)
    assert copy[19]["name"] == "row-19" and str(tmp_path / "rel.arrow") in repr(copy)


def test_missing_column_lists_the_available_ones(path):
    with pytest.raises(ArrowSourceError, match=r"no column 'nope'; the file has 'i8', 'i16'"):
        ArrowDataset(path, columns=["i8", "nope"])


def test_columns_as_a_string_is_a_type_error(path):
    with pytest.raises(TypeError, match="list of column names"):
        ArrowDataset(path, columns="i8")


@pytest.mark.parametrize("array", [
    pa.array([1, 2], pa.timestamp("s")),
    pa.array(["a", "b"]).dictionary_encode(),
    pa.array([[["x"]], [["y"]]]),
    pa.array([1, 2], pa.decimal128(5, 2)),
], ids=["timestamp", "dictionary", "nested-list", "decimal"])
def test_unsupported_column_type_names_file_column_and_type(tmp_path, array):
    p = write_file(pa.table({"ok": [1, 2], "bad": array}), tmp_path / "u.arrow")
    with pytest.raises(ArrowSourceError, match=r"u.arrow: column 'bad' has type .*cannot read"):
        ArrowDataset(p)
    assert ArrowDataset(p, columns=["ok"])[1]["ok"] == 2


@pytest.mark.parametrize("array, row", [
    (pa.array([1.0, 2.0, None, 4.0] * 30, pa.float32()), 2),
    (pa.FixedSizeListArray.from_arrays(pa.array([1, 2, 3, None] * 30, pa.int16()), 2), 1),
    (pa.array([[1], [2, None]] * 60, pa.list_(pa.int8())), 1),
    (pa.array([{"a": 1}, None] * 60), 1),
    (pa.array([{"a": 1}, {"a": None}] * 60), 1),
], ids=["number", "inside-fixed-list", "inside-list", "struct", "inside-struct"])
def test_nulls_are_refused_naming_file_column_and_row(tmp_path, array, row):
    table = pa.table({"x": array.slice(0, 120)})
    p = write_file(table.slice(0, 50), tmp_path / "a.arrow", chunk=7)
    p2 = write_file(table.slice(50, 70), tmp_path / "b.arrow", chunk=7)
    with pytest.raises(ArrowSourceError, match=rf"a.arrow: column 'x' has a null at row {row} "):
        ArrowDataset([p, p2])


@pytest.mark.parametrize("array", [
    pa.array(["a", None, "c"] * 40),
    pa.array([b"a", None, b"c"] * 40, pa.large_binary()),
    pa.array([b"ab", None, b"cd"] * 40, pa.binary(2)),
], ids=["string", "large-binary", "fixed-binary"])
def test_nulls_in_strings_and_binaries_are_none_as_in_pyarrow(tmp_path, array):
    table = pa.table({"x": array, "meta": pa.array([{"path": v} for v in array.to_pylist()])})
    ds = ArrowDataset(write_file(table, tmp_path / "n.arrow", chunk=7))
    assert [ds[i]["x"] for i in range(6)] == array.to_pylist()[:6]
    assert ds[1]["meta"] == {"path": None}
    same(slot_default_collate(ds.__getitems__([2, 1, 0])),
         default_collate([ds[i] for i in (2, 1, 0)]))
    for batch in (ds.__getitems__([1, 0]), [ds[1], ds[0]]):  # torch refuses a None first
        collate = slot_default_collate if isinstance(batch, ArrowRows) else default_collate
        with pytest.raises(TypeError, match="found <class 'NoneType'>"):
            collate(batch)


def test_index_out_of_range_is_an_index_error(ds):
    with pytest.raises(IndexError, match=f"index 1000 out of range for {ROWS} rows"):
        ds[ROWS]
    with pytest.raises(IndexError, match="index -1001 out of range"):
        ds[-ROWS - 1]
    with pytest.raises(IndexError):
        ds.__getitems__([0, ROWS + 5])


@pytest.mark.parametrize("index", [2**63, -(2**63) - 1, 10**30])
def test_an_index_beyond_int64_is_an_index_error_as_for_a_list(ds, index):
    with pytest.raises(IndexError, match=f"index {index} out of range"):
        ds[index]
    with pytest.raises(IndexError, match=f"index {index} out of range"):
        ds.__getitems__([1, index])


def test_duplicate_column_names_are_refused_naming_the_file_and_the_fix(tmp_path):
    table = pa.Table.from_arrays([pa.array([1]), pa.array([2]), pa.array([3])],
                                 names=["id", "score", "score"])
    p = write_file(table, tmp_path / "dup.arrow")
    for columns in (None, ["score"]):
        with pytest.raises(ArrowSourceError, match=r"dup\.arrow: column 'score' appears more than "
                                                   r"once.*rename the columns"):
            ArrowDataset(p, columns=columns)
    assert ArrowDataset(p, columns=["id"])[0]["id"] == 1
    with pytest.raises(ValueError, match="columns= lists 'id' more than once"):
        ArrowDataset(p, columns=["id", "id"])


def test_shards_with_different_types_are_refused(tmp_path):
    a = write_file(pa.table({"x": pa.array([1], pa.int32())}), tmp_path / "a.arrow")
    b = write_file(pa.table({"x": pa.array([1], pa.int64())}), tmp_path / "b.arrow")
    with pytest.raises(ArrowSourceError, match=r"b.arrow: column 'x' has type int64, but "):
        ArrowDataset([a, b])


def test_each_file_shard_holds_one_descriptor(tmp_path):
    # A shard keeps its file's descriptor (workers re-open it through /proc); mapping it with
    # mmap.mmap kept a second one, and 600 shards ran out of a 1,024 limit (review 9).
    paths = [
        write_file(pa.table({"y": np.full(3, k)}), tmp_path / f"s{k}.arrow") for k in range(20)
    ]
    before = len(os.listdir("/proc/self/fd"))
    ds = ArrowDataset(paths)
    assert len(os.listdir("/proc/self/fd")) - before == 20
    assert int(ds[59]["y"]) == 19
    del ds
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == before


# -- review 23 ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [pa.uint16(), pa.uint32(), pa.uint64(), pa.float16()])
def test_collate_padded_pads_every_number_type(tmp_path, dtype):
    # torch has no masked store for uint16/32/64: collate_padded raised NotImplementedError
    lists = pa.array([[1, 2, 3], [4], []], pa.list_(dtype))
    ds = ArrowDataset(write_file(pa.table({"t": lists}), tmp_path / "u.arrow"))
    padded, lengths = collate_padded(ds.__getitems__([0, 1, 2]))["t"]
    assert padded.dtype == ds[0]["t"].dtype and lengths.tolist() == [3, 1, 0]
    assert padded.to(torch.float64).tolist() == [[1, 2, 3], [4, 0, 0], [0, 0, 0]]


def test_a_fifo_is_refused_as_not_a_regular_file_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "pipe.arrow"
    os.mkfifo(fifo)
    with pytest.raises(ArrowSourceError, match=r"pipe\.arrow: not a regular file"):
        ArrowDataset(fifo)


def test_binary_rows_of_image_size_gather_equal_to_pyarrow(tmp_path):
    rng = np.random.default_rng(0)
    blobs = [rng.bytes(n) for n in (110_000, 0, 5, 70_001)]
    p = write_file(pa.table({"b": pa.array(blobs, pa.binary())}), tmp_path / "b.arrow", chunk=3)
    ds = ArrowDataset([p, p])  # rows from two shards in one batch too
    idx = [3, 0, 6, 1, 2, 5]
    assert slot_default_collate(ds.__getitems__(idx))["b"] == [blobs[i % 4] for i in idx]


def test_a_copy_reaches_its_own_file_after_the_original_closed_and_the_path_was_replaced(
    tmp_path,
):
    import copy

    p = write_file(pa.table({"y": np.full(30, 1)}), tmp_path / "t.arrow")
    ds = ArrowDataset(p)
    twin = copy.deepcopy(ds)  # re-opened the file through ds's descriptor
    del ds
    gc.collect()  # that descriptor is closed
    os.replace(write_file(pa.table({"y": np.full(40, 2)}), tmp_path / "new.arrow"), p)
    worker_copy = pickle.loads(pickle.dumps(twin))  # as a spawned worker gets it
    assert len(worker_copy) == 30 and int(worker_copy[29]["y"]) == 1


def test_a_table_is_serialised_with_the_selected_columns_only(tmp_path):
    table = pa.table({"x": np.arange(1000), "big": np.zeros((1000,), dtype=np.float64)})
    ds = ArrowDataset(table, columns=["x"])
    whole = ArrowDataset(table)
    assert len(pickle.dumps(ds)) < len(pickle.dumps(whole)) - 7000
    assert int(pickle.loads(pickle.dumps(ds))[999]["x"]) == 999
    with pytest.raises(ArrowSourceError, match=r"no column 'nope'"):
        ArrowDataset(table, columns=["x", "nope"])


def test_a_table_that_cannot_be_written_as_ipc_names_the_fix(tmp_path):
    chunks = [pa.array([v]).dictionary_encode() for v in ("a", "b")]  # two dictionaries
    cat = pa.chunked_array(chunks)
    table = pa.table({"cat": cat, "x": [1, 2]})
    with pytest.raises(ArrowSourceError, match=r"in-memory pyarrow\.Table.*columns=\[\.\.\.\]"):
        ArrowDataset(table)
    assert int(ArrowDataset(table, columns=["x"])[1]["x"]) == 2


def test_columns_may_be_any_iterable(path):
    ds = ArrowDataset(path, columns=(c for c in ["i32", "name"]))
    assert ds.columns == ["i32", "name"] and set(ds[0]) == {"i32", "name"}


@pytest.mark.parametrize("bad", [1.7, "3", 1.0])
def test_indices_must_be_integers_as_for_a_list(ds, bad):
    with pytest.raises(TypeError, match="cannot be interpreted as an integer"):
        ds[bad]
    with pytest.raises(TypeError, match="cannot be interpreted as an integer"):
        ds.__getitems__([0, bad])
    with pytest.raises(TypeError):
        [0, 1][bad]  # the reference


def test_integer_index_types_all_work(ds):
    want = ds[5]["i64"]
    for idx in ([5], np.array([5], np.uint64), np.array([5], np.int16), torch.tensor([5]),
                [np.int64(5)], [True, 5][1:]):
        assert slot_default_collate(ds.__getitems__(idx))["i64"].tolist() == [int(want)]
    assert int(ds[np.uint8(5)]["i64"]) == int(want)
    with pytest.raises(IndexError, match=r"index 18446744073709551615 out of range"):
        ds.__getitems__(np.array([2**64 - 1], np.uint64))
    assert len(slot_default_collate(ds.__getitems__([]))["i64"]) == 0


def test_running_out_of_descriptors_names_the_shards_and_the_limit(tmp_path, monkeypatch):
    import errno

    from shmloader.arrow import dataset as dataset_module

    paths = [write_file(pa.table({"y": [k]}), tmp_path / f"s{k}.arrow") for k in range(5)]
    real = dataset_module.Shard.from_path
    opened = []

    def short_of_descriptors(path):
        if len(opened) == 2:
            raise OSError(errno.EMFILE, "Too many open files")
        opened.append(path)
        return real(path)

    monkeypatch.setattr(dataset_module.Shard, "from_path", short_of_descriptors)
    with pytest.raises(OSError, match=r"shard 3 of 5 .*s2\.arrow.*ulimit -n: \d+.*5 shards need 5"):
        ArrowDataset(paths)


@pytest.mark.parametrize("source", [{"a": 1}, b"/tmp/x.arrow", 3, ["ok.arrow", 4]])
def test_a_source_that_is_no_path_list_or_table_is_a_type_error_naming_what_is_taken(source):
    with pytest.raises(TypeError, match=r"must be a path, a list of paths, or a pyarrow\.Table"):
        ArrowDataset(source)


def test_a_record_batch_is_taken_as_a_table():
    batch = pa.RecordBatch.from_pydict({"x": [1, 2, 3]})
    assert int(ArrowDataset(batch)[2]["x"]) == 3


def test_a_batch_checks_only_the_shards_it_reads_and_a_changed_one_when_it_reads_it(
    tmp_path, monkeypatch
):
    """Review 57: every batch checked every shard (an fstat each): 1,000 shards cost 1.2 ms a
    32-row batch whose rows sat in 4. A batch checks the shards it reads; a change to one is
    still an error at the first batch that reads it."""
    from shmloader.arrow.shard import Shard

    paths = [write_file(pa.table({"y": np.arange(10) + 10 * k}), tmp_path / f"{k}.arrow")
             for k in range(5)]  # fmt: skip
    ds = ArrowDataset(paths)
    checked: list[str] = []
    check = Shard.check_unchanged

    def counted(self: Shard) -> None:
        checked.append(os.path.basename(self.name))
        check(self)

    monkeypatch.setattr(Shard, "check_unchanged", counted)
    assert default_collate(ds.__getitems__([0, 1]))["y"].tolist() == [0, 1]
    assert checked == ["0.arrow"]
    checked.clear()
    assert default_collate(ds.__getitems__([12, 35, 13]))["y"].tolist() == [12, 35, 13]
    assert sorted(checked) == ["1.arrow", "3.arrow"]
    os.truncate(paths[4], 64)  # a change: the next batch that reads shard 4 says so
    assert default_collate(ds.__getitems__([2]))["y"].tolist() == [2]
    with pytest.raises(ArrowSourceError, match=r"4\.arrow: the file changed"):
        default_collate(ds.__getitems__([41]))


def test_a_file_a_worker_cannot_open_again_is_an_error_that_says_how_it_was_reached(tmp_path):
    """Review 57: a spawned worker opens each file anew, through the opening process's
    descriptor or else the path; when neither works (a file made unreadable with chmod, or
    here unlinked, with the opening process gone) the error named neither how nor why."""
    import dataclasses

    from shmloader.arrow.shard import _reopen

    p = write_file(pa.table({"y": np.arange(10)}), tmp_path / "t.arrow")
    ds = ArrowDataset(p)
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)  # a process that is gone: its /proc entry with it
    spec = dataclasses.replace(ds._specs[0], owner_pid=pid)
    os.remove(p)
    with pytest.raises(FileNotFoundError, match=(
        r"t\.arrow could not be opened again in this process through its path "
        rf"\(/proc/{pid}/fd/\d+ of the process that opened it: No such file or directory\)\. "
        r"A spawned or forkserver worker opens each dataset file anew"
    )):  # fmt: skip
        _reopen(spec)


@pytest.mark.parametrize("dtype", [pa.float32(), pa.int16(), pa.float16(), pa.uint64()])
def test_long_list_rows_gather_equal_to_pyarrow_from_one_shard_or_several(tmp_path, dtype):
    """Review 57: a variable-length list column was gathered element by element through
    per-element address arrays, about 6x the batch's bytes (154 MB of temporaries for a 26 MB
    batch). Rows of long lists are now copied one slice each; the values are pyarrow's, for
    stacked, ragged and padded batches, within a shard and across shards."""
    rng = np.random.default_rng(0)
    lengths = [40, 0, 100, 17, 64, 64]
    lists = [rng.integers(0, 100, n).astype(dtype.to_pandas_dtype()) for n in lengths]
    table = pa.table({"t": pa.array(lists, pa.list_(dtype))})
    p = write_file(table, tmp_path / "long.arrow", chunk=4)
    one, two = [2, 0, 3, 5, 1, 4], [8, 2, 9, 3, 6, 11, 4]
    for ds, idx in ((ArrowDataset(p), one), (ArrowDataset([p, p]), two)):
        want = [torch.from_numpy(np.asarray(lists[i % 6])) for i in idx]
        ragged = collate_ragged(ds.__getitems__(idx))["t"]
        assert [t.dtype for t in ragged] == [w.dtype for w in want]
        assert [t.tolist() for t in ragged] == [w.tolist() for w in want]
        padded, got_lengths = collate_padded(ds.__getitems__(idx))["t"]
        same(padded, torch.nn.utils.rnn.pad_sequence(want, batch_first=True))
        assert got_lengths.tolist() == [len(t) for t in want]
        equal = [i for i in idx if lengths[i % 6] == 64]
        same(slot_default_collate(ds.__getitems__(equal))["t"],
             torch.stack([torch.from_numpy(np.asarray(lists[i % 6])) for i in equal]))  # fmt: skip


def test_long_list_rows_take_no_more_than_the_batch_in_temporaries(tmp_path):
    """Review 57: 6x the batch's bytes in per-element addresses (tracemalloc sees NumPy's and
    Python's allocations, not torch's); one slice per row needs the batch's bytes once."""
    import tracemalloc

    rows, n = 64, 10_000
    lists = pa.array([np.full(n - i, i, np.float32) for i in range(rows)], pa.list_(pa.float32()))
    ds = ArrowDataset(write_file(pa.table({"t": lists}), tmp_path / "long.arrow", chunk=16))
    batch_bytes = sum(n - i for i in range(rows)) * 4
    items = ds.__getitems__(list(range(rows)))
    tracemalloc.start()
    try:
        out = collate_ragged(items)["t"]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [int(t[0]) for t in out] == list(range(rows))
    assert peak < 2 * batch_bytes, f"{peak:,} bytes of temporaries for a {batch_bytes:,}-byte batch"
