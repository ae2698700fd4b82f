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
    assert (
        pack.main(
            [
                str(tmp_path / "p0.parquet"),
                str(tmp_path / "p1.parquet"),
                "-o",
                str(out),
                "--batch-rows",
                "64",
            ]
        )
        == 0
    )
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
    rows, _, schema = pack.pack(
        [tmp_path / n for n in ("label.npy", "vec.npy", "img.npy")], out, rows=4
    )
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


def test_dictionary_and_temporal_columns_are_made_readable_as_the_dataset_advises(tmp_path, capsys):
    days = pa.array([datetime.date(1970, 1, 2), datetime.date(2024, 1, 1)])
    table = pa.table(
        {
            "label": pa.array(["cat", "dog"]).dictionary_encode(),
            "day": days,
            "at": pa.array([1_000, 2_000], pa.timestamp("ms", tz="UTC")),
            "took": pa.array([3, 4], pa.duration("us")),
            "clock": pa.array([5, 6], pa.time32("s")),
        }
    )
    src = write_file(table, tmp_path / "cat.arrow")
    with pytest.raises(
        ArrowSourceError,
        match=r"column 'label' has type dictionary.*Repack it: "
        r"`python -m tools.pack .*cat\.arrow -o OUT",
    ):
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
    with pytest.raises(
        pack.PackError,
        match=r"column 'days' has type list<item: date32.*before "
        r"packing",
    ):
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


def test_sources_differing_in_a_columns_original_type_are_refused_naming_both(tmp_path, capsys):
    when = [datetime.datetime(2020, 1, 1, 12)]
    a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    pq.write_table(pa.table({"t": pa.array(when, pa.timestamp("ms"))}), a)
    pq.write_table(pa.table({"t": pa.array(when, pa.timestamp("us"))}), b)
    assert pack.main([str(a), str(b), "-o", str(tmp_path / "t.arrow")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("pack: sources differ in schema")
    assert f"column 't' is timestamp[ms] in {a} but timestamp[us] in {b}" in err
    assert "cast" in err
    day = [datetime.date(2020, 1, 1)]
    d32 = write_file(pa.table({"d": pa.array(day, pa.date32())}), tmp_path / "d32.arrow")
    d64 = write_file(pa.table({"d": pa.array(day, pa.date64())}), tmp_path / "d64.arrow")
    with pytest.raises(
        pack.PackError,
        match=r"column 'd' is date32\[day\] in .*d32\.arrow but "
        r"date64\[ms\] in .*d64\.arrow",
    ):
        pack.pack([d32, d64], tmp_path / "d.arrow")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "a.parquet",
        "b.parquet",
        "d32.arrow",
        "d64.arrow",
    ]
    # CSV types are known only as the rows are read; the advised --csv-types settles them
    (tmp_path / "i.csv").write_text("x\n1\n")
    (tmp_path / "f.csv").write_text("x\n1.5\n")
    csvs = [tmp_path / "i.csv", tmp_path / "f.csv"]
    with pytest.raises(
        pack.PackError,
        match=r"column 'x' is int64 in .*i\.csv but double in "
        r".*f\.csv.*--csv-types x=int64",
    ):
        pack.pack(csvs, tmp_path / "x.arrow")
    assert not (tmp_path / "x.arrow").exists()
    pack.pack(csvs, tmp_path / "x.arrow", csv_types={"x": pa.float64()})
    assert [ArrowDataset(tmp_path / "x.arrow")[i]["x"].item() for i in range(2)] == [1.0, 1.5]
    # only the dictionary encoding differs: the decoded values are the same type
    small = pa.array(["x", "y"]).dictionary_encode().cast(pa.dictionary(pa.int8(), pa.string()))
    e1 = write_file(pa.table({"s": small}), tmp_path / "e1.arrow")
    e2 = write_file(pa.table({"s": pa.array(["z"])}), tmp_path / "e2.arrow")
    pack.pack([e1, e2], tmp_path / "e.arrow")
    assert [ArrowDataset(tmp_path / "e.arrow")[i]["s"] for i in range(3)] == ["x", "y", "z"]


def _images(folder, sizes):
    (folder / "cls").mkdir(parents=True)
    for k, size in enumerate(sizes):
        (folder / "cls" / f"{k}.jpg").write_bytes(bytes([k]) * size)  # never decoded by pack


def test_image_batches_are_cut_by_batch_mib_while_reading(tmp_path, monkeypatch):
    _images(tmp_path / "imgs", [40] * 6 + [90])
    read: list[int] = []  # image bytes per record batch pack reads from the folder
    rechunk = pack._rechunk

    def spy(batches, rows, max_bytes):
        def seen():
            for batch in batches:
                read.append(sum(len(v) for v in batch["image"].to_pylist()))
                yield batch

        return rechunk(seen(), rows, max_bytes)

    monkeypatch.setattr(pack, "_rechunk", spy)
    out = tmp_path / "imgs.arrow"
    pack.pack([tmp_path / "imgs"], out, max_mib=100 / 2**20)  # 100 bytes a batch
    assert read == [80, 80, 80, 90]  # at least one image a batch, even the 90-byte one
    ds = ArrowDataset(out)
    assert [len(ds[i]["image"]) for i in range(7)] == [40] * 6 + [90]
    assert ds[6]["image"] == bytes([6]) * 90


def test_an_image_over_the_binary_limit_is_refused_naming_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(pack, "MAX_BINARY_BYTES", 100)  # stands for 2 GiB - 1
    _images(tmp_path / "imgs", [60, 60, 101])
    out = tmp_path / "imgs.arrow"
    assert pack.main([str(tmp_path / "imgs"), "-o", str(out), "--batch-mib", "4096"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"pack: {tmp_path / 'imgs' / 'cls' / '2.jpg'}: 101 bytes" in err and "100" in err
    assert not out.exists() and not list(tmp_path.glob(".imgs.arrow*"))
    (tmp_path / "imgs" / "cls" / "2.jpg").unlink()
    pack.pack([tmp_path / "imgs"], out, max_mib=4096)  # the cap holds under a big --batch-mib
    assert pa.ipc.open_file(str(out)).num_record_batches == 2


def test_npy_bool_rows_are_stored_as_uint8_with_a_note(tmp_path, capsys):
    mask = np.arange(4 * 6).reshape(4, 2, 3) % 3 == 0
    np.save(tmp_path / "mask.npy", mask)
    np.save(tmp_path / "pair.npy", mask[:, 0, :2])
    np.save(tmp_path / "flag.npy", mask[:, 0, 0])
    out = tmp_path / "m.arrow"
    names = ["mask.npy", "pair.npy", "flag.npy"]
    assert pack.main([str(tmp_path / n) for n in names] + ["-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert "column 'mask' (bool rows of shape (2, 3)) is stored as uint8 (0/1)" in err
    assert "column 'pair' (bool rows of shape (2,)) is stored as uint8 (0/1)" in err
    assert "'flag'" not in err
    ds = ArrowDataset(out)
    for i in range(4):
        assert torch.equal(ds[i]["mask"], torch.from_numpy(mask[i].astype(np.uint8)))
        assert ds[i]["pair"].tolist() == mask[i, 0, :2].astype(np.uint8).tolist()
        assert ds[i]["flag"].dtype is torch.bool and ds[i]["flag"].item() == mask[i, 0, 0]


def test_a_csv_whose_type_changes_after_the_first_block_names_the_file_column_and_fix(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(pack, "CSV_BLOCK_BYTES", 64)
    src = tmp_path / "late.csv"
    src.write_text("a,b\n" + "1,2\n" * 100 + "x,3\n")
    out = tmp_path / "late.arrow"
    assert pack.main([str(src), "-o", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"pack: {src}: column 'a'")
    assert "invalid value 'x'" in err and "first block" in err and "--csv-types a=string" in err
    assert not out.exists()
    assert pack.main([str(src), "-o", str(out), "--csv-types", "a=string,b=int8"]) == 0
    ds = ArrowDataset(out)
    assert ds[100]["a"] == "x" and ds[0]["a"] == "1" and ds[100]["b"].dtype is torch.int8
    with pytest.raises(SystemExit):
        pack.main([str(src), "-o", str(out), "--csv-types", "a=text"])
    assert "--csv-types" in capsys.readouterr().err
    assert pack.main([str(src), "-o", str(out), "--csv-types", "c=string"]) == 1
    assert "--csv-types names column 'c'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("name", "array", "words"),
    [
        ("z.npy", np.ones(3, np.complex64), "dtype complex64"),
        ("rec.npy", np.zeros(3, dtype=[("a", "i4"), ("b", "f4")]), "dtype [('a', '<i4'), ('b'"),
        ("empty_rows.npy", np.zeros((5, 0), np.float32), "rows of shape (0,)"),
        ("obj.npy", np.array([1, "a"], dtype=object), "dtype object"),
        ("words.npy", np.array([["a", "b"]]), "dtype <U1 of shape (1, 2)"),
        ("hours.npy", np.array(["2020-01-01T01"], "datetime64[h]"), "dtype datetime64[h]"),
    ],
)
def test_npy_arrays_pack_cannot_store_are_refused_naming_the_file_and_dtype(
    tmp_path, capsys, name, array, words
):
    np.save(tmp_path / name, array, allow_pickle=True)
    assert pack.main([str(tmp_path / name), "-o", str(tmp_path / "o.arrow")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"pack: {tmp_path / name}: ")
    assert words in err and "pack reads" in err
    assert not (tmp_path / "o.arrow").exists()


@pytest.mark.parametrize("name", ["rows.txt", "rows.jsonl", "rows"])
def test_an_unknown_suffix_is_refused_naming_the_suffixes_pack_reads(tmp_path, capsys, name):
    (tmp_path / name).write_text("a,b\n1,2\n")
    assert pack.main([str(tmp_path / name), "-o", str(tmp_path / "o.arrow")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"pack: {tmp_path / name}: ")
    assert ".parquet" in err and ".csv" in err and ".arrow" in err and ".npy" in err
    assert not (tmp_path / "o.arrow").exists()


def test_a_parquet_or_npy_file_under_another_suffix_is_read_by_its_magic(tmp_path):
    # ArrowDataset advises `python -m tools.pack NAME -o OUT.arrow` for these, whatever NAME
    pq.write_table(pa.table({"x": [1, 2]}), tmp_path / "data.bin")
    pack.pack([tmp_path / "data.bin"], tmp_path / "p.arrow")
    assert ArrowDataset(tmp_path / "p.arrow")[1]["x"].item() == 2
    with open(tmp_path / "vals.dat", "wb") as f:
        np.save(f, np.arange(3, dtype=np.int16))
    pack.pack([tmp_path / "vals.dat"], tmp_path / "n.arrow")
    assert ArrowDataset(tmp_path / "n.arrow")[2]["vals"].item() == 2
