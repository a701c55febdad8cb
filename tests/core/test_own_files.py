"""Departments' own files beyond CSV/JSONL: Parquet tables and image folders (PNG/JPEG per class).

References: the same rows as CSV/JSONL must give the same schema and arrays from Parquet; images
written from scikit-learn's digits must read back as exactly the pixels written. Refusals are one
line naming the file (and row, column or class) and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from sklearn.datasets import load_digits

from quorumfl.core.data import check_data, import_partition, propose_schema, read_partition
from quorumfl.core.tasks import get_task
from quorumfl.errors import DataError

from .city_data import (
    property_rows,
    request_rows,
    write_csv,
    write_digit_folder,
    write_jsonl,
    write_parquet,
)


def test_parquet_reads_as_the_same_table_as_csv(tmp_path: Path) -> None:
    rows = property_rows(80, seed=3)
    csv_file, parquet_file = write_csv(tmp_path / "s.csv", rows), write_parquet(tmp_path / "s.parquet", rows)
    options = {"label": "sale_price", "ignore": "parcel,band"}
    schema = propose_schema(csv_file, "tabular", options)
    assert propose_schema(parquet_file, "tabular", options) == schema
    task = get_task("tabular")
    for a, b in zip(task.read(csv_file, schema), task.read(parquet_file, schema), strict=True):
        np.testing.assert_array_equal(a, b)


def test_parquet_text_reads_as_the_same_table_as_jsonl(tmp_path: Path) -> None:
    rows = request_rows(50, seed=4)
    jsonl, parquet_file = write_jsonl(tmp_path / "r.jsonl", rows), write_parquet(tmp_path / "r.parquet", rows)
    schema = propose_schema(jsonl, "text", {"text": "request", "label": "office"})
    task = get_task("text")
    for a, b in zip(task.read(jsonl, schema), task.read(parquet_file, schema), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(("table", "message"), [
    (pa.table({"area": [1.0, float("nan")], "year_built": [2000, 2001], "zone": ["mixed", "mixed"],
               "sale_price": [5.0, 6.0]}), "row 2, column 'area' is NaN"),
    (pa.table({"area": [1.0], "year_built": [2000], "zone": ["mixed"], "sale_price": [5.0], "tags": [[1, 2]]}),
     "column 'tags' has Parquet type list<"),
    (pa.table({"area": [1.0], "year_built": [2000], "zone": ["mixed"], "sale_price": [5.0], "owner": ["x"]}),
     "column 'owner' is not in the schema"),
    (pa.table({"area": pa.array([], pa.float64()), "year_built": pa.array([], pa.int64()),
               "zone": pa.array([], pa.string()), "sale_price": pa.array([], pa.float64())}), "no data rows"),
    (pa.table({"area": ["big"], "year_built": [2000], "zone": ["mixed"], "sale_price": [5.0]}),
     "row 1, column 'area': 'big' is not a number"),
])
def test_bad_parquet_is_refused_in_one_line(tmp_path: Path, table: pa.Table, message: str) -> None:
    schema = propose_schema(write_csv(tmp_path / "s.csv", property_rows(20, seed=1)), "tabular",
                            {"label": "sale_price", "ignore": "parcel,band"})
    bad = tmp_path / "bad.parquet"
    pq.write_table(table, bad)
    with pytest.raises(DataError, match=message) as caught:
        get_task("tabular").read(bad, {**schema, "ignore": []})
    assert "\n" not in str(caught.value) and str(bad) in str(caught.value)


def test_a_file_that_is_not_parquet_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "export.parquet"
    bad.write_bytes(b"area,year\n1,2\n")
    with pytest.raises(DataError, match="is not a readable Parquet file"):
        get_task("tabular").infer_schema(bad, {"label": "year"})


# ---- image folders ----------------------------------------------------------------------------------------

def test_an_image_folder_reads_back_the_pixels_written(tmp_path: Path) -> None:
    pixels = write_digit_folder(tmp_path / "forms", range(120))
    schema = propose_schema(tmp_path / "forms", "image", {})
    assert schema["dataset"] == "folder" and schema["input_shape"] == [1, 8, 8]
    assert schema["classes"] == [str(c) for c in range(10)]
    x, y = get_task("image").read(tmp_path / "forms", schema)
    labels = load_digits().target[:120]
    assert x.shape == (120, 1, 8, 8) and x.dtype == np.float32 and sorted(y.tolist()) == sorted(labels.tolist())
    # files are read class by class, in name order: compare as sets of (label, pixels)
    written = sorted((int(lab), p.tobytes()) for lab, p in zip(labels, pixels, strict=True))
    read = sorted((int(lab), np.round(img[0] * 255.0).astype(np.uint8).tobytes()) for lab, img in zip(y, x, strict=True))
    assert written == read


def test_colour_images_are_channels_first(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(6, 5, 7, 3), dtype=np.uint8)  # height 5, width 7
    for n, image in enumerate(images):
        (tmp_path / "f" / ("a" if n < 3 else "b")).mkdir(parents=True, exist_ok=True)
        Image.fromarray(image, mode="RGB").save(tmp_path / "f" / ("a" if n < 3 else "b") / f"{n}.png")
    schema = propose_schema(tmp_path / "f", "image", {})
    assert schema["input_shape"] == [3, 5, 7]
    x, y = get_task("image").read(tmp_path / "f", schema)
    np.testing.assert_array_equal(np.round(x * 255).astype(np.uint8), images.transpose(0, 3, 1, 2))
    assert y.tolist() == [0, 0, 0, 1, 1, 1]


def test_a_department_imports_and_checks_its_image_folder(tmp_path: Path) -> None:
    write_digit_folder(tmp_path / "all", range(200))
    schema = propose_schema(tmp_path / "all", "image", {})
    write_digit_folder(tmp_path / "tax-office", range(200, 260), fmt="JPEG")
    view = check_data(tmp_path / "tax-office", schema)
    assert view["rows"] == 60 and view["fits"]
    assert not (tmp_path / "part").exists()
    import_partition(tmp_path / "tax-office", tmp_path / "part", department="tax-office", schema=schema)
    part = read_partition(tmp_path / "part")
    assert len(part.train) + len(part.test) == 60 and part.train.x.shape[1:] == (1, 8, 8)
    assert json.loads(json.dumps(part.resolved_schema())) == schema


def _refusal(tmp_path: Path, plant: Any, message: str) -> None:
    write_digit_folder(tmp_path / "forms", range(30))
    schema = propose_schema(tmp_path / "forms", "image", {})
    plant(tmp_path / "forms")
    with pytest.raises(DataError, match=message) as caught:
        import_partition(tmp_path / "forms", tmp_path / "part", department="x", schema=schema)
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "part").exists()


@pytest.mark.parametrize(("plant", "message"), [
    (lambda d: Image.new("L", (9, 8)).save(d / "3" / "big.png"), r"big.png is 9x8, the schema's images are 8x8; resize"),
    (lambda d: Image.new("RGB", (8, 8)).save(d / "3" / "colour.png"), "colour.png has mode RGB.*convert it to greyscale"),
    (lambda d: (d / "stamps").mkdir() or Image.new("L", (8, 8)).save(d / "stamps" / "s.png"),
     "class 'stamps' is not in the schema's classes"),
    (lambda d: (d / "3" / "notes.txt").write_text("x"), r"notes.txt is not a .png, .jpg or .jpeg file"),
    (lambda d: (d / "3" / "torn.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 20), "torn.png is not a readable PNG"),
    (lambda d: Image.new("L", (8, 8)).save(d / "3" / "anim.png", format="GIF"), "anim.png is a GIF image"),
    (lambda d: (d / "index.csv").write_text("x"), "the image folder holds only class sub-folders"),
])
def test_bad_image_folders_are_refused_naming_the_file(tmp_path: Path, plant: Any, message: str) -> None:
    _refusal(tmp_path, plant, message)


def test_an_empty_or_missing_folder_is_refused(tmp_path: Path) -> None:
    write_digit_folder(tmp_path / "forms", range(20))
    schema = propose_schema(tmp_path / "forms", "image", {})
    (tmp_path / "empty" / "3").mkdir(parents=True)
    with pytest.raises(DataError, match="holds no images"):
        get_task("image").read(tmp_path / "empty", schema)
    with pytest.raises(DataError, match="is not a folder"):
        get_task("image").read(tmp_path / "nowhere", schema)
    with pytest.raises(DataError, match="partitions come from 'quorumfl data split'"):
        get_task("image").read(tmp_path / "forms", {**schema, "dataset": "digits"})
