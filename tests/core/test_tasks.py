"""Tasks: schemas, readers and their refusals, objectives against numpy, plug-in resolution."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quorumfl.core.data import check_data, import_partition, read_partition
from quorumfl.core.tasks import (
    ModelSpec,
    Regression,
    check_schema_fits,
    get_task,
    schema_difference,
    schema_digest,
)
from quorumfl.core.tasks.tabular import nice_range
from quorumfl.core.tasks.text import token_ids
from quorumfl.errors import ConfigError, DataError

from .city_data import property_rows, request_rows, write_csv, write_jsonl


@pytest.fixture
def sales(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    file = write_csv(tmp_path / "sales.csv", property_rows(60, seed=1))
    schema = get_task("tabular").infer_schema(file, {"label": "sale_price", "ignore": "parcel,band"})
    return file, schema


def test_a_proposed_tabular_schema_encodes_by_its_declared_ranges_and_hashes(sales: tuple[Path, dict[str, Any]]) -> None:
    file, schema = sales
    assert schema["objective"] == "regression" and schema["target_range"] == [0.0, 1_000_000.0]
    assert [c["name"] for c in schema["numeric"]] == ["area", "year_built"]
    assert [c["name"] for c in schema["categorical"]] == ["zone"]
    x, y = get_task("tabular").read(file, schema)
    rows = property_rows(60, seed=1)
    np.testing.assert_allclose(x[:, 0], [r["area"] / 1000.0 for r in rows], rtol=1e-6)  # (value − 0) / (1000 − 0)
    np.testing.assert_allclose(y, [r["sale_price"] / 1e6 for r in rows], rtol=1e-6)
    onehot = x[:, 2:]
    assert onehot.shape == (60, 16) and np.all(onehot.sum(axis=1) == 1.0)
    zones = {r["zone"] for r in rows}
    assert len({int(np.argmax(onehot[i])) for i in range(60)}) <= len(zones)


def test_columns_with_empty_cells_are_marked_and_encoded_with_an_indicator(tmp_path: Path) -> None:
    """A department's export with gaps: the proposed schema marks the columns that have empty cells;
    an empty numeric cell reads as the middle of its range with an indicator set, an empty category
    as the value "" (pandas reference); a column without the mark refuses its empty cell."""
    import pandas as pd

    from quorumfl.core.tasks.tabular_encode import bucket

    rows = property_rows(50, seed=7)
    for i in (3, 17, 40):
        rows[i]["area"] = ""
    for i in (5, 17):
        rows[i]["zone"] = " "
    file = write_csv(tmp_path / "gaps.csv", rows)
    task = get_task("tabular")
    schema = task.infer_schema(file, {"label": "sale_price", "ignore": "parcel,band"})
    assert {c["name"]: c.get("missing", False) for c in schema["numeric"] + schema["categorical"]} == {
        "area": True, "year_built": False, "zone": True}
    x, _ = task.read(file, schema)
    frame = pd.read_csv(file, keep_default_na=False)
    area = pd.to_numeric(frame["area"].str.strip().replace("", np.nan) if frame["area"].dtype == object
                         else frame["area"])
    low, high = schema["numeric"][0]["low"], schema["numeric"][0]["high"]
    np.testing.assert_allclose(x[:, 0], ((area - low) / (high - low)).fillna(0.5), rtol=1e-6)
    np.testing.assert_array_equal(x[:, 2], area.isna().astype(np.float32))  # the indicator, after the numeric columns
    buckets = schema["categorical"][0]["buckets"]
    assert x.shape == (50, 3 + buckets)
    slots = [bucket("zone", str(z).strip(), buckets) for z in frame["zone"]]
    np.testing.assert_array_equal(np.argmax(x[:, 3:], axis=1), slots)
    unmarked = {**schema, "numeric": [{k: v for k, v in c.items() if k != "missing"} for c in schema["numeric"]]}
    with pytest.raises(DataError, match=r"row 4, column 'area' is empty; .* mark the column \"missing\": true"):
        task.read(file, unmarked)
    with pytest.raises(ConfigError, match="area.missing' must be true"):
        task.check_schema({**schema, "numeric": [{**schema["numeric"][0], "missing": "yes"}]})


def test_a_rare_category_is_pooled_once_the_statistics_are_in(sales: tuple[Path, dict[str, Any]]) -> None:
    """min_share: a zone under 1 % of the (federation's) records is read as absent; the others are
    standardised as numpy does. Before the statistics round every slot is read."""
    file, schema = sales
    assert schema["categorical"][0]["min_share"] == 0.01  # proposed for new schemas
    task = get_task("tabular")
    x, _ = task.read(file, schema)
    x = np.concatenate([x, x[:1]])
    x[-1, 2:] = 0.0
    rare = 2 + next(b for b in range(16) if not x[:, 2 + b].any())  # an empty bucket: one record gets it
    x[-1, rare] = 1.0  # 1 of 61 records: 1.6 %, kept at 0.01, pooled at 0.02
    for share, pooled in ((0.01, False), (0.02, True)):
        schema["categorical"][0]["min_share"] = share
        model = task.build_model("mlp", schema, seed=0)
        stats = model[0]
        assert bool(stats.kept().all())  # nothing decided before the statistics round
        stats.set_statistics(torch.from_numpy(x))
        mean, var = x.astype(np.float64).mean(0), np.maximum(x.astype(np.float64).var(0), 1e-3)
        expected = (x - mean) / np.sqrt(var)
        expected[:, 2:][:, mean[2:] < share] = 0.0
        with torch.no_grad():
            np.testing.assert_allclose(stats(torch.from_numpy(x)).numpy(), expected, rtol=1e-4, atol=1e-4)
        assert (not bool(stats.kept()[rare])) == pooled
    schema["categorical"][0]["min_share"] = 0.6
    with pytest.raises(ConfigError, match=r"categorical\[zone\].min_share' must be a share of the records from 0 to 0.5"):
        task.check_schema(schema)


@given(st.floats(-1e9, 1e9, allow_nan=False), st.floats(-1e9, 1e9, allow_nan=False))
@settings(max_examples=200, deadline=None)
def test_nice_ranges_contain_what_was_seen(a: float, b: float) -> None:
    low, high = sorted((a, b))
    lo, hi = nice_range(low, high)
    assert lo <= low and high <= hi and lo < hi


@pytest.mark.parametrize(("content", "message"), [
    ("", "is empty"),
    ("area,year_built,zone,sale_price\n", "no data rows"),
    ("area,year_built,zone\n1,2000,mixed\n", "no column 'sale_price'"),
    ("area,year_built,zone,sale_price,owner\n1,2000,mixed,5,x\n", "column 'owner' is not in the schema"),
    ("area,year_built,zone,sale_price\n1,2000,mixed,nan\n", "row 1, column 'sale_price' is nan"),
    ("area,year_built,zone,sale_price\n1,2000,mixed,5\n2,inf,mixed,5\n", "row 2, column 'year_built' is inf"),
    ("area,year_built,zone,sale_price\n1,2000,mixed,5\nbig,2000,mixed,5\n", "row 2, column 'area': 'big' is not a number"),
    ("area,year_built,zone,sale_price\n1,,mixed,5\n", "row 1, column 'year_built' is empty"),
    ("area,year_built,zone,sale_price\n1,2000,mixed,5\n5000,2000,mixed,5\n", r"outside the schema's range \[0, 1000\]"),
    ("area,year_built,zone,sale_price\n1,2000,mixed\n", "line 2 has 3 fields"),
    ("area,year_built,zone,sale_price\n1,2000,,5\n", "column 'zone' is empty"),
])
def test_bad_tables_are_refused_in_one_line_naming_the_place_and_the_fix(
    tmp_path: Path, sales: tuple[Path, dict[str, Any]], content: str, message: str
) -> None:
    _, schema = sales
    bad = tmp_path / "bad.csv"
    bad.write_text(content)
    with pytest.raises(DataError, match=message) as caught:
        get_task("tabular").read(bad, {**schema, "ignore": []})
    assert "\n" not in str(caught.value) and str(bad) in str(caught.value)


def test_non_utf8_and_unknown_formats_are_refused(tmp_path: Path, sales: tuple[Path, dict[str, Any]]) -> None:
    _, schema = sales
    latin = tmp_path / "latin.csv"
    latin.write_bytes("area,year_built,zone,sale_price\n1,2000,Käse,5\n".encode("latin-1"))
    with pytest.raises(DataError, match="line 2 is not UTF-8; re-save the file as UTF-8"):
        get_task("tabular").read(latin, schema)
    with pytest.raises(DataError, match="unknown format '.xlsx'"):
        get_task("tabular").read(tmp_path / "sales.xlsx", schema)


def test_a_file_that_changes_while_read_is_refused(tmp_path: Path, sales: tuple[Path, dict[str, Any]]) -> None:
    file, schema = sales

    def another_program_appends(_done: int, _size: int) -> None:  # while the department's export is read
        with file.open("a") as fh:
            fh.write("1,2000,mixed,5\n")

    with pytest.raises(DataError, match="changed while it was read"):
        list(get_task("tabular").read_batches(file, schema, on_bytes=another_program_appends))  # type: ignore[attr-defined]


def test_classification_refuses_an_unknown_class_and_text_refuses_an_empty_document(tmp_path: Path) -> None:
    file = write_csv(tmp_path / "bands.csv", property_rows(40, seed=2))
    schema = get_task("tabular").infer_schema(file, {"label": "band", "ignore": "parcel,sale_price"})
    assert schema["objective"] == "classification" and schema["classes"] == ["high", "low"]
    bad = write_csv(tmp_path / "bad.csv", [{**property_rows(1, seed=3)[0], "band": "medium"}])
    with pytest.raises(DataError, match="row 1, label column 'band' has class 'medium'"):
        get_task("tabular").read(bad, schema)
    requests = write_jsonl(tmp_path / "requests.jsonl", request_rows(30, seed=1))
    text_schema = get_task("text").infer_schema(requests, {"text": "request", "label": "office"})
    blank = write_jsonl(tmp_path / "blank.jsonl", [{"id": "1", "request": " ... ", "office": "roads"}])
    with pytest.raises(DataError, match="row 1, column 'request' has no words"):
        get_task("text").read(blank, text_schema)
    other_keys = tmp_path / "keys.jsonl"
    other_keys.write_text('{"id": "1", "request": "a pothole", "office": "roads"}\n{"id": "2", "request": "bin"}\n')
    with pytest.raises(DataError, match="line 2 has other keys than line 1"):
        get_task("text").read(other_keys, text_schema)


def test_token_ids_are_stable_bounded_and_padded(tmp_path: Path) -> None:
    schema = {"buckets": 64, "max_tokens": 12, "word_ngrams": 2, "char_ngrams": 3}
    ids = token_ids("Pothole on Main Street", schema)
    assert ids == token_ids("pothole ON main street", schema)  # case does not matter
    assert len(ids) == 12 and all(1 <= i < 64 for i in ids)
    requests = write_jsonl(tmp_path / "r.jsonl", request_rows(10, seed=4))
    text_schema = get_task("text").infer_schema(requests, {"text": "request", "label": "office", "max-tokens": "80"})
    x, _ = get_task("text").read(requests, text_schema)
    assert x.shape == (10, 80) and x.dtype == np.int64 and np.all(x[:, -1] == 0)  # short requests are padded


def test_a_node_refuses_data_of_another_schema_naming_the_difference(sales: tuple[Path, dict[str, Any]]) -> None:
    _, schema = sales
    widened = json.loads(json.dumps(schema))
    widened["numeric"][0]["high"] = 10_000.0
    assert schema_digest(widened) != schema_digest(schema)
    assert "column 'area' (numeric.high) is" in (schema_difference(schema, widened) or "")
    with pytest.raises(DataError, match=r"column 'area' \(numeric.high\) is 1000.0 here, 10000.0 in the run's schema"):
        check_schema_fits(schema, widened, where="department tax-office's data")
    fewer = {**schema, "categorical": []}
    assert "column 'zone' ('categorical') is not in the run's schema" in (schema_difference(schema, fewer) or "")
    relabelled = {**schema, "label": "band"}
    assert "'label' is \"sale_price\" here" in (schema_difference(schema, relabelled) or "")
    check_schema_fits(schema, json.loads(json.dumps(schema)), where="x")  # equal: no refusal


def test_import_is_all_or_nothing_and_check_writes_nothing(tmp_path: Path, sales: tuple[Path, dict[str, Any]]) -> None:
    file, schema = sales
    out = tmp_path / "tax"
    first = import_partition(file, out, department="tax-office", schema=schema)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    bad = tmp_path / "bad.csv"
    bad.write_text(file.read_text().replace("\n1", "\nx", 1) + "1,2000,mixed,not-a-price\n")
    with pytest.raises(DataError):
        import_partition(bad, out, department="tax-office", schema=schema)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the old partition is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.csv", "sales.csv", "tax"]  # no staging left
    part = read_partition(out)
    assert len(part.train) == first.train_examples == 48 and len(part.test) == 12 and part.schema == schema
    listing = sorted(p.name for p in tmp_path.rglob("*"))
    assert check_data(out, schema)["fits"] and check_data(file, schema)["rows"] == 60
    assert sorted(p.name for p in tmp_path.rglob("*")) == listing


def test_regression_metrics_equal_numpy_in_the_target_unit() -> None:
    rng = np.random.default_rng(0)
    outputs, targets = rng.random((50, 1)).astype(np.float32), rng.random(50).astype(np.float32)
    objective = Regression(scale=1_000_000.0)
    sums = objective.sums(torch.from_numpy(outputs), torch.from_numpy(targets))
    metrics = objective.finish(sums, 50)
    error = outputs[:, 0].astype(np.float64) - targets
    assert metrics["mae"] == pytest.approx(np.abs(error).mean() * 1e6, rel=1e-9)
    assert metrics["rmse"] == pytest.approx(math.sqrt((error**2).mean()) * 1e6, rel=1e-9)
    assert objective.score(metrics["mae"]) == -metrics["mae"]  # lower is better


def test_own_tasks_by_module_attribute_and_clear_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "city_tasks.py").write_text(
        "from quorumfl.core.tasks.tabular import TabularTask\n"
        "class Invoices(TabularTask):\n    name = 'city_tasks:INVOICES'\n    version = '2.1'\n"
        "    def check_schema(self, schema):\n        super().check_schema({**schema, 'task': 'tabular', 'version': '1'})\n"
        "INVOICES = Invoices()\nNOT_A_TASK = object()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "city_tasks", raising=False)  # the examples' package of that name may be imported
    task = get_task("city_tasks:INVOICES")
    assert task.version == "2.1"
    with pytest.raises(ConfigError, match="cannot import 'missing_pkg' for task 'missing_pkg:T'.*install the task's package"):
        get_task("missing_pkg:T")
    with pytest.raises(ConfigError, match="is not a QuorumFL task"):
        get_task("city_tasks:NOT_A_TASK")
    with pytest.raises(ConfigError, match="unknown task 'pictures'"):
        get_task("pictures")
    schema = {"task": "city_tasks:INVOICES", "version": "2.0", "label": "y", "objective": "regression",
              "target_range": [0, 1], "numeric": [{"name": "a", "low": 0, "high": 1}], "categorical": []}
    with pytest.raises(ConfigError, match="version 2.1 here, the run's schema needs version 2.0"):
        ModelSpec("city_tasks:INVOICES", "mlp", json.dumps(schema)).resolve()
    sys.modules.pop("city_tasks", None)  # this test's module; monkeypatch puts back one imported before


@pytest.mark.parametrize("name", [":", "city_tasks:", ":PERMITS", "a..b:X", "city tasks:X", "m:1x"])
def test_a_malformed_module_attribute_task_is_refused_in_one_line(name: str) -> None:
    with pytest.raises(ConfigError, match="is not of the form module:attribute"):
        get_task(name)
