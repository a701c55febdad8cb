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
