"""A department's table read in batches encodes exactly as a plain Python reading of the whole file:
the same features and targets in one batch or in many, from CSV, JSON lines or Parquet, and a bad
cell in a late batch is refused naming its row in the file."""

from __future__ import annotations

import csv
import math
import re
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quorumfl.core.tasks import get_task, table_batches
from quorumfl.errors import DataError
from tests.core.city_data import property_rows, write_csv, write_jsonl, write_parquet


def _reference(path: Path, schema: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """The encoding, cell by cell with Python's csv module and float: the obviously-correct version."""
    with path.open(newline="", encoding="utf-8-sig") as fh:
        rows = [r for r in csv.DictReader(fh)]
    width = len(schema["numeric"]) + sum(c["buckets"] for c in schema["categorical"])
    x = np.zeros((len(rows), width), dtype=np.float32)
    for i, row in enumerate(rows):
        for j, spec in enumerate(schema["numeric"]):
            x[i, j] = (float(row[spec["name"]]) - spec["low"]) / (spec["high"] - spec["low"])
        offset = len(schema["numeric"])
        for spec in schema["categorical"]:
            value = row[spec["name"]].strip()
            x[i, offset + zlib.crc32(f"{spec['name']}\x1f{value}".encode()) % spec["buckets"]] = 1.0
            offset += spec["buckets"]
    low, high = schema["target_range"]
    y = np.array([(float(r[schema["label"]]) - low) / (high - low) for r in rows], dtype=np.float32)
    return x, y


@pytest.fixture
def sales(tmp_path: Path) -> tuple[Path, dict[str, Any], list[dict[str, object]]]:
    rows = property_rows(600, seed=4)
    for i, row in enumerate(rows):
        if i % 7 == 0:
            row["zone"] = f"  {row['zone']}, north\nside "  # quoted: a comma, a line break, blanks around
        if i % 11 == 0:
            row["area"] = f" {row['area']} "
    file = write_csv(tmp_path / "sales.csv", rows, columns=["parcel", "area", "year_built", "zone", "sale_price"])
    schema = get_task("tabular").infer_schema(file, {"label": "sale_price", "ignore": "parcel"})
    return file, schema, rows


def test_batches_encode_as_the_whole_file_and_as_a_plain_python_reading(
        sales: tuple[Path, dict[str, Any], list[dict[str, object]]], monkeypatch: pytest.MonkeyPatch) -> None:
    file, schema, rows = sales
    expected_x, expected_y = _reference(file, schema)
    task = get_task("tabular")
    whole_x, whole_y = task.read(file, schema)
    monkeypatch.setattr(table_batches, "BATCH_BYTES", 512)  # dozens of batches, a row split across blocks
    parts = list(task.read_batches(file, schema))  # type: ignore[attr-defined]
    assert len(parts) > 20
    np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), whole_x)
    np.testing.assert_array_equal(np.concatenate([p[1] for p in parts]), whole_y)
    np.testing.assert_allclose(whole_x, expected_x, rtol=0, atol=1e-7)
    np.testing.assert_allclose(whole_y, expected_y, rtol=0, atol=1e-7)
    # The same rows as JSON lines and as Parquet (numbers as numbers) encode the same.
    keep = ("parcel", "area", "year_built", "zone", "sale_price")
    plain = [{k: (v.strip() if isinstance(v, str) and k == "area" else v) for k, v in r.items() if k in keep}
             for r in rows]
    jsonl = write_jsonl(file.with_suffix(".jsonl"), [{**r, "area": float(r["area"])} for r in plain])  # type: ignore[arg-type]
    parquet = write_parquet(file.with_suffix(".parquet"), [{**r, "area": float(str(r["area"]))} for r in plain])
    for other in (jsonl, parquet):
        x, y = task.read(other, schema)
        np.testing.assert_allclose(x, expected_x, rtol=0, atol=1e-7)
        np.testing.assert_allclose(y, expected_y, rtol=0, atol=1e-7)


@pytest.mark.parametrize(("row", "value", "message"), [
    (433, "", "row 433, column 'area' is empty"),
    (434, "many", "row 434, column 'area': 'many' is not a number"),
    (435, "nan", "row 435, column 'area' is nan"),
    (436, "1e9", "row 436, column 'area' is 1e+09, outside the schema's range"),
])
def test_a_bad_cell_in_a_late_batch_names_its_row_in_the_file(
        sales: tuple[Path, dict[str, Any], list[dict[str, object]]], monkeypatch: pytest.MonkeyPatch,
        row: int, value: str, message: str) -> None:
    file, schema, rows = sales
    rows[row - 1]["area"] = value
    write_csv(file, rows, columns=["parcel", "area", "year_built", "zone", "sale_price"])
    monkeypatch.setattr(table_batches, "BATCH_BYTES", 1024)
    with pytest.raises(DataError, match=re.escape(message)):
        get_task("tabular").read(file, schema)


@settings(max_examples=25, deadline=None)
@given(cells=st.lists(st.one_of(st.floats(min_value=-1e6, max_value=1e6, allow_nan=False),
                                st.text(alphabet="0123456789.e+-_ x", min_size=1, max_size=8)), min_size=1,
                      max_size=30))
def test_numeric_cells_are_read_as_pythons_float_reads_them(tmp_path_factory: pytest.TempPathFactory,
                                                           cells: list[object]) -> None:
    """Accepted exactly when float() accepts the cell and it is finite and in range; same value."""
    folder = tmp_path_factory.mktemp("cells")
    rows = [{"area": str(c), "zone": "a", "sale_price": 1.0} for c in cells]
    file = write_csv(folder / "cells.csv", rows)
    schema = {"task": "tabular", "version": "1", "label": "sale_price", "objective": "regression",
              "target_range": [0, 10], "numeric": [{"name": "area", "low": -1e7, "high": 1e7}],
              "categorical": [{"name": "zone", "buckets": 4}]}
    expected: list[float] | None = []
    for cell in cells:
        try:
            value = float(str(cell))
        except ValueError:
            expected = None
            break
        if not math.isfinite(value) or str(cell).strip() == "":
            expected = None
            break
        assert expected is not None
        expected.append(value)
    if expected is None or any(abs(v) > 1e7 for v in expected):
        with pytest.raises(DataError, match="row "):
            get_task("tabular").read(file, schema)
        return
    x, _ = get_task("tabular").read(file, schema)
    np.testing.assert_allclose(x[:, 0], ((np.array(expected) + 1e7) / 2e7).astype(np.float32), rtol=0, atol=0)


@settings(max_examples=30, deadline=None)
@given(count=st.integers(min_value=0, max_value=200_000), seed=st.integers(min_value=0, max_value=2**31),
       fraction=st.floats(min_value=0.01, max_value=0.99), cut=st.integers(min_value=997, max_value=100_000))
def test_test_rows_are_the_same_however_they_are_asked_for(count: int, seed: int, fraction: float, cut: int) -> None:
    from quorumfl.core.tasks.base import TestRows, stable_split

    rows = TestRows(count, test_fraction=fraction, seed=seed)
    whole = rows.mask(0, count)
    pieces = [rows.mask(a, min(a + cut, count)) for a in range(0, count, cut)]
    assert (np.concatenate(pieces) if pieces else np.zeros(0, bool)).tolist() == whole.tolist()
    assert int(whole.sum()) == (max(1, round(count * fraction)) if count > 1 else 0)
    if count <= TestRows.BLOCK:  # a department's usual file: the split stable_split makes
        assert np.flatnonzero(whole).tolist() == stable_split(count, test_fraction=fraction, seed=seed)[1].tolist()
