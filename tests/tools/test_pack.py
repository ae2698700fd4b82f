"""tools.pack: every source kind becomes an uncompressed IPC file ArrowDataset reads back."""

from __future__ import annotations

import datetime
import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest
import torch

from shmloader.arrow import ArrowDataset, ArrowSourceError, DecodeImage
from tests.arrow_files import tabular_table, write_file, write_stream
from tools import pack


def test_parquet_sources_concatenate_in_record_batches_of_at_most_batch_rows(tmp_path, capsys):
    table = tabular_table(250)
    for k, part in enumerate([table.slice(0, 100), table.slice(100)]):
        pq.write_table(part, tmp_path / f"p{k}.parquet")
    out = tmp_path / "out.arrow"
    assert pack.main([str(tmp_path / "p0.parquet"), str(tmp_path / "p1.parquet"), "-o", str(out),
                      "--batch-rows", "64"]) == 0
    printed = capsys.readouterr().out
    assert "250 rows" in printed and "features: fixed_size_list<element: float>[64]" in printed
    reader = pa.ipc.open_file(str(out))
    assert max(reader.get_batch(i).num_rows for i in range(reader.num_record_batches)) <= 64
    assert reader.read_all().equals(table)
    assert ArrowDataset(out)[249]["name"] == "row-249"


def test_csv_types_are_inferred(tmp_path):
    src = tmp_path / "rows.csv"
    src.write_text("x,y,name\n1,2.5,a\n3,4.5,b\n")
    pack.pack([src], tmp_path / "rows.arrow")
    item = ArrowDataset(tmp_path / "rows.arrow")[1]
    assert item["x"].dtype is torch.int64 and item["y"].item() == 4.5 and item["name"] == "b"


def test_npy_rows_become_lists_and_tensors(tmp_path):
    np.save(tmp_path / "label.npy", np.arange(10, dtype=np.int32))
    np.save(tmp_path / "vec.npy", np.arange(30, dtype=np.float32).reshape(10, 3))
    np.save(tmp_path / "img.npy", np.arange(10 * 24, dtype=np.uint8).reshape(10, 2, 3, 4))
    out = tmp_path / "arrays.arrow"
    rows, _, schema = pack.pack([tmp_path / n for n in ("label.npy", "vec.npy", "img.npy")], out,
                                rows=4)
    assert rows == 10 and isinstance(schema.field("img").type, pa.FixedShapeTensorType)
    item = ArrowDataset(out)[7]
    assert item["label"].item() == 7 and item["vec"].tolist() == [21.0, 22.0, 23.0]
    assert torch.equal(item["img"], torch.arange(7 * 24, 8 * 24, dtype=torch.uint8).view(2, 3, 4))


def test_npz_gives_one_column_per_array_of_equal_length(tmp_path):
    np.savez(tmp_path / "a.npz", x=np.ones(4), y=np.zeros(4, dtype=np.int8))
    pack.pack([tmp_path / "a.npz"], tmp_path / "a.arrow")
    assert ArrowDataset(tmp_path / "a.arrow").columns == ["x", "y"]
    np.savez(tmp_path / "b.npz", x=np.ones(4), y=np.zeros(5))
    with pytest.raises(pack.PackError, match="differ in length"):
        pack.pack([tmp_path / "b.npz"], tmp_path / "b.arrow")
    assert not (tmp_path / "b.arrow").exists()


def test_image_folder_keeps_encoded_bytes_and_labels_decoded_by_transform(tmp_path):
    image = pytest.importorskip("PIL.Image")
    for c, colour in (("cat", (255, 0, 0)), ("dog", (0, 0, 255))):
        (tmp_path / "imgs" / c).mkdir(parents=True)
        for k in range(2):
            image.new("RGB", (5, 4), colour).save(tmp_path / "imgs" / c / f"{k}.png")
    out = tmp_path / "imgs.arrow"
    pack.pack([tmp_path / "imgs"], out)
    meta = pa.ipc.open_file(str(out)).schema.metadata
    assert json.loads(meta[b"classes"]) == ["cat", "dog"]
    raw = ArrowDataset(out)
    assert raw[2]["label"].item() == 1 and raw[2]["path"] == "dog/0.png"
    assert image.open(io.BytesIO(raw[2]["image"])).size == (5, 4)
    decoded = ArrowDataset(out, transform=DecodeImage())[2]["image"]
    assert decoded.shape == (3, 4, 5) and decoded[:, 0, 0].tolist() == [0, 0, 255]


def test_compressed_file_and_stream_are_rewritten_mappable(tmp_path):
    table = tabular_table(40)
    z = write_file(table, tmp_path / "z.arrow", compression="zstd")
    s = write_stream(table, tmp_path / "s.stream")
    for src in (z, s):
        out = tmp_path / f"{src.stem}-plain.arrow"
        pack.pack([src], out)
        assert ArrowDataset(out)[39]["name"] == "row-39"


def test_missing_source_is_an_error_and_writes_nothing(tmp_path, capsys):
    assert pack.main([str(tmp_path / "nope.parquet"), "-o", str(tmp_path / "o.arrow")]) == 1
    assert "no such file" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_dictionary_and_temporal_columns_are_made_readable_as_the_dataset_advises(tmp_path,
                                                                                   capsys):
    days = pa.array([datetime.date(1970, 1, 2), datetime.date(2024, 1, 1)])
    table = pa.table({
        "label": pa.array(["cat", "dog"]).dictionary_encode(),
        "day": days,
        "at": pa.array([1_000, 2_000], pa.timestamp("ms", tz="UTC")),
        "took": pa.array([3, 4], pa.duration("us")),
        "clock": pa.array([5, 6], pa.time32("s")),
    })
    src = write_file(table, tmp_path / "cat.arrow")
    with pytest.raises(ArrowSourceError, match=r"column 'label' has type dictionary.*Repack it: "
                                               r"`python -m tools.pack .*cat\.arrow -o OUT"):
        ArrowDataset(src)
    out = tmp_path / "plain.arrow"
    assert pack.main([str(src), "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert "column 'day' (date32[day]) is stored as int64: days since 1970-01-01" in err
    assert "column 'at' (timestamp[ms, tz=UTC]) is stored as int64: milliseconds since" in err
    item = ArrowDataset(out)[1]
    assert item["label"] == "dog" and item["day"].dtype is torch.int64
    assert [item[k].item() for k in ("day", "at", "took", "clock")] == [19723, 2000, 4, 6]


def test_dictionaries_and_dates_inside_other_types_are_refused_naming_the_column(tmp_path):
    nested = pa.array([[datetime.date(2024, 1, 1)]])
    src = write_file(pa.table({"ok": [1], "days": nested}), tmp_path / "n.arrow")
    with pytest.raises(pack.PackError, match=r"column 'days' has type list<item: date32.*before "
                                             r"packing"):
        pack.pack([src], tmp_path / "n-out.arrow")
    with pytest.raises(ArrowSourceError, match=r"column 'days' .*Cast it to a supported type"):
        ArrowDataset(src)


def test_npy_files_with_one_stem_are_refused_naming_both(tmp_path):
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        np.save(tmp_path / d / "v.npy", np.arange(3))
    with pytest.raises(pack.PackError, match=r"a/v\.npy and .*b/v\.npy would both be column 'v'"):
        pack.pack([tmp_path / "a" / "v.npy", tmp_path / "b" / "v.npy"], tmp_path / "o.arrow")


def test_a_0d_array_is_a_clear_error(tmp_path, capsys):
    np.savez(tmp_path / "z.npz", a=np.float32(1.0))
    assert pack.main([str(tmp_path / "z.npz"), "-o", str(tmp_path / "z.arrow")]) == 1
    assert "array 'a' of " in capsys.readouterr().err
    assert not (tmp_path / "z.arrow").exists()


def test_big_endian_npy_is_byte_swapped(tmp_path):
    with open(tmp_path / "be.NPY", "wb") as f:  # np.save would append ".npy"
        np.save(f, np.arange(4, dtype=">i4"))
    pack.pack([tmp_path / "be.NPY"], tmp_path / "be.arrow")
    assert [ArrowDataset(tmp_path / "be.arrow")[i]["be"].item() for i in range(4)] == [0, 1, 2, 3]


@pytest.mark.filterwarnings("ignore:Feather V1:DeprecationWarning")
def test_upper_case_csv_and_feather_v1_are_read(tmp_path):
    (tmp_path / "UP.CSV").write_text("a\n1\n2\n")
    feather.write_feather(pa.table({"a": [3, 4]}), tmp_path / "v1.feather", version=1)
    with pytest.raises(ArrowSourceError, match=r"Feather v1.*python -m tools.pack"):
        ArrowDataset(tmp_path / "v1.feather")
    pack.pack([tmp_path / "UP.CSV", tmp_path / "v1.feather"], tmp_path / "o.arrow")
    assert pa.ipc.open_file(str(tmp_path / "o.arrow")).read_all()["a"].to_pylist() == [1, 2, 3, 4]


def test_sources_differing_only_in_nullability_are_unified(tmp_path):
    strict = pa.schema([pa.field("x", pa.int64(), nullable=False)])
    pq.write_table(pa.table({"x": [1, 2]}), tmp_path / "p1.parquet")
    pq.write_table(pa.table({"x": [3]}, schema=strict), tmp_path / "p2.parquet")
    pq.write_table(pa.table({"x": [4]}, schema=strict), tmp_path / "p3.parquet")
    _, _, schema = pack.pack([tmp_path / f"p{k}.parquet" for k in (2, 1)], tmp_path / "a.arrow")
    assert schema.field("x").nullable
    _, _, schema = pack.pack([tmp_path / f"p{k}.parquet" for k in (2, 3)], tmp_path / "b.arrow")
    assert not schema.field("x").nullable
    assert pa.ipc.open_file(str(tmp_path / "a.arrow")).read_all()["x"].to_pylist() == [3, 1, 2]


def test_duplicate_column_names_are_refused_at_pack_time(tmp_path):
    (tmp_path / "dup.csv").write_text("id,score,score\n1,2,3\n")
    with pytest.raises(pack.PackError, match=r"dup\.csv: column 'score' appears more than once"):
        pack.pack([tmp_path / "dup.csv"], tmp_path / "dup.arrow")
