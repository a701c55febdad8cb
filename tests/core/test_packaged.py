"""The real city data of the tabular/text demos and benchmark, read from Debian's packages as
``./setup.sh --city-data`` unpacks them (the README's test command installs them)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from quorumfl.core.data.packaged import ames_rows, wordnet_rows, write_department_files
from quorumfl.errors import ConfigError, DataError


def test_ames_is_the_assessors_2930_sales_with_74_columns() -> None:
    rows = ames_rows()
    assert len(rows) == 2930 and len(rows[0]) == 74
    prices = [float(r["Sale_Price"]) for r in rows]
    assert min(prices) == 12789 and max(prices) == 755000  # De Cock (2011)'s documented range
    assert len({r["Neighborhood"] for r in rows}) == 28


def test_wordnet_noun_glosses_carry_their_lexicographer_file() -> None:
    rows = wordnet_rows()
    assert len(rows) == 82115 and len({r["lexname"] for r in rows}) == 26
    entity = next(r for r in rows if r["synset"] == "00001740")
    assert entity["lexname"] == "noun.Tops" and entity["text"].startswith("entity: that which is perceived")


def test_the_natural_split_gives_each_neighbourhood_to_one_department(tmp_path: Path) -> None:
    files, pool = write_department_files("ames", tmp_path, 5, split="natural", seed=0)
    seen: dict[str, int] = {}
    sizes = []
    for d, file in enumerate(files):
        with file.open(newline="") as fh:
            rows = list(csv.DictReader(fh))
        sizes.append(len(rows))
        for row in rows:
            assert seen.setdefault(row["Neighborhood"], d) == d
    assert sum(sizes) == 2930 and max(sizes) - min(sizes) < 150 and len(seen) == 28
    with pytest.raises(ConfigError, match="split 'natural' is Ames' neighbourhoods"):
        write_department_files("wordnet", tmp_path, 3, split="natural", seed=0)


def test_missing_packaged_files_say_how_to_fetch_them(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"run './setup.sh --city-data'"):
        wordnet_rows(tmp_path)
    with pytest.raises(DataError, match=r"run './setup.sh --city-data'"):
        ames_rows(tmp_path)


@pytest.mark.parametrize(("dataset", "method", "task"), [("ames", "natural", "tabular"), ("wordnet", "iid", "text")])
def test_data_split_gives_each_department_a_partition_of_a_packaged_dataset(
    tmp_path: Path, dataset: str, method: str, task: str
) -> None:
    """`quorumfl data split` on a table or text dataset: each department's own file, its partition
    under one schema proposed from the pool, and the schema file for `runs start --schema`; the
    partitions together hold every row exactly once."""
    import json

    from quorumfl.core.data import read_partition
    from quorumfl.core.tasks import schema_digest
    from tests.server.test_cli import quorumfl

    out = tmp_path / "split"
    result = quorumfl("data", "split", "--out", str(out), "--departments", "north,south,east", "--dataset", dataset,
                      "--method", method)
    assert result.returncode == 0, result.stderr
    schema = json.loads((out / "schema.json").read_text())
    assert schema["task"] == task and f"schema: {out / 'schema.json'}" in result.stdout
    parts = [read_partition(out / "parts" / name) for name in ("north", "south", "east")]
    assert all(schema_digest(p.resolved_schema()) == schema_digest(schema) for p in parts)
    total = sum(len(p.train) + len(p.test) for p in parts)
    assert total == (2930 if dataset == "ames" else 82115)
    refused = quorumfl("data", "split", "--out", str(tmp_path / "x"), "--departments", "a", "--dataset", "wordnet",
                       "--method", "natural")
    assert refused.returncode != 0 and "split 'natural' is Ames' neighbourhoods" in refused.stderr
