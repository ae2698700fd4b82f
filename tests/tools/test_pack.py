"""tools.pack: every source kind becomes an uncompressed IPC file ArrowDataset reads back."""

from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from shmloader.arrow import ArrowDataset, DecodeImage
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
