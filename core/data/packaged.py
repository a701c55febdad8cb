"""Real tables and texts shipped by Debian packages, written out as departments' own files.

- **Ames housing** (Debian ``r-cran-modeldata``; De Cock, 2011): 2,930 property sales recorded by the
  Ames, Iowa city assessor, 73 numeric and categorical columns, the sale price as target. Departments
  are assessor districts: groups of whole neighbourhoods (the natural split), or an IID split.
- **WordNet noun glosses** (Debian ``wordnet-base``): each noun synset's words and definition,
  labelled with its lexicographer file (``noun.artifact``, ``noun.person`` … 26 classes).

``./setup.sh --city-data`` fetches both packages' files into the environment's
``share/quorumfl/datasets`` (``.venv/share/…``; ``apt-get download`` and ``dpkg-deb -x``: no R, no
root; ``$QUORUMFL_DATASETS`` points elsewhere) and installs PyPI ``rdata``; nothing is downloaded at
run time.
modeldata keeps its data frames in R's lazy-load database (``Rdata.rdx`` index, ``Rdata.rdb``
blobs, raw LZMA2 with a 5-byte header); ``rdata`` parses the serialized frame once unpacked here.
"""

from __future__ import annotations

import bz2
import csv
import json
import lzma
import os
import struct
import sys
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from quorumfl.core.data.partition import partition_dirichlet, partition_iid
from quorumfl.errors import ConfigError, DataError

__all__ = ["PACKAGED", "ames_rows", "datasets_dir", "modeldata_rows", "natural_groups", "wordnet_rows", "write_department_files"]

SETUP_HINT = ("run './setup.sh --city-data' (unpacks Debian's r-cran-modeldata and wordnet-base into "
              ".venv/share/quorumfl/datasets)")
DATASETS_ENV = "QUORUMFL_DATASETS"


def datasets_dir() -> Path:
    """Where the unpacked Debian packages are: ``$QUORUMFL_DATASETS``, else the environment's share folder."""
    return Path(os.environ.get(DATASETS_ENV) or Path(sys.prefix) / "share" / "quorumfl" / "datasets")


def _lazyload(base: Path, name: str) -> Any:
    try:
        import rdata
    except ImportError:
        raise DataError(f"reading R data needs the PyPI package 'rdata'; {SETUP_HINT}") from None
    try:
        index = rdata.conversion.convert(rdata.parser.parse_file(base.with_suffix(".rdx"), extension="rds"))
        offset, length = (int(v) for v in index["variables"][name])
        with open(base.with_suffix(".rdb"), "rb") as fh:
            fh.seek(offset)
            blob = fh.read(length)
    except FileNotFoundError:
        raise DataError(f"{base}.rdx/.rdb not found; {SETUP_HINT}") from None
    except KeyError:
        raise DataError(f"{base}.rdx has no data set '{name}'") from None
    size = struct.unpack(">I", blob[:4])[0]
    compressed = int(np.asarray(index["compressed"]).ravel()[0])
    kind, body = (blob[4:5], blob[5:]) if compressed == 3 else ({2: b"2"}.get(compressed, b"1"), blob[4:])
    if kind == b"Z":  # R's xz: a raw LZMA2 stream at preset 9e
        raw = lzma.decompress(body, format=lzma.FORMAT_RAW,
                              filters=[{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}])
    elif kind == b"2":
        raw = bz2.decompress(body)
    elif kind == b"1":
        raw = zlib.decompress(body)
    elif kind == b"0":
        raw = body
    else:
        raise DataError(f"{base}.rdb: compression {kind!r} of '{name}' is not one R writes")
    if len(raw) != size:
        raise DataError(f"{base}.rdb: '{name}' unpacks to {len(raw)} bytes, its header says {size}")
    return rdata.conversion.convert(rdata.parser.parse_data(raw))


def modeldata_rows(name: str, root: Path | None = None) -> list[dict[str, Any]]:
    """A data frame of r-cran-modeldata as records (column → value, missing values as None), in the
    package's order: ``ames`` (property sales), ``stackoverflow`` (developer survey: salary, country),
    ``credit_data`` (credit applications: status, housing), ``training_data`` and ``testing_data``
    (Amazon fine-food reviews: product, review, score), and the package's other frames."""
    base = (root or datasets_dir()) / "usr/lib/R/site-library/modeldata/data/Rdata"
    frame = _lazyload(base, name)
    records: list[dict[str, Any]] = frame.to_dict(orient="records")
    return [{str(k): _plain(v) for k, v in r.items()} for r in records]


def _plain(value: Any) -> Any:
    value = value.item() if hasattr(value, "item") else value
    return None if isinstance(value, float) and value != value else value  # NaN: missing


def ames_rows(root: Path | None = None) -> list[dict[str, Any]]:
    """The Ames sales as records (column → value), in the package's order."""
    return modeldata_rows("ames", root)


# WordNet's lexicographer files of nouns by number (lexnames(5WN); fixed since WordNet 1.5)
NOUN_FILES = {3: "noun.Tops", 4: "noun.act", 5: "noun.animal", 6: "noun.artifact", 7: "noun.attribute", 8: "noun.body", 9: "noun.cognition", 10: "noun.communication", 11: "noun.event", 12: "noun.feeling", 13: "noun.food", 14: "noun.group", 15: "noun.location", 16: "noun.motive", 17: "noun.object", 18: "noun.person", 19: "noun.phenomenon", 20: "noun.plant", 21: "noun.possession", 22: "noun.process", 23: "noun.quantity", 24: "noun.relation", 25: "noun.shape", 26: "noun.state", 27: "noun.substance", 28: "noun.time"}


def wordnet_rows(root: Path | None = None) -> list[dict[str, str]]:
    """Noun synsets: ``text`` (its words and gloss), ``lexname`` (the label) and ``synset``."""
    folder = root or (datasets_dir() / "usr/share/wordnet")
    try:
        lines = (folder / "data.noun").read_text(encoding="utf-8", errors="strict").splitlines()
    except FileNotFoundError:
        raise DataError(f"WordNet files not found in {folder}; {SETUP_HINT}") from None
    rows = []
    for line in lines:
        if line.startswith("  ") or "|" not in line:
            continue  # the licence header
        head, gloss = line.split("|", 1)
        fields = head.split()
        count = int(fields[3], 16)
        words = [fields[4 + 2 * i].replace("_", " ") for i in range(count)]
        rows.append({"synset": fields[0], "text": "; ".join(words) + ": " + gloss.strip(),
                     "lexname": NOUN_FILES[int(fields[1])]})
    return rows


PACKAGED = {"ames": "tabular", "wordnet": "text"}


def natural_groups(keys: list[str], departments: int) -> list[np.ndarray]:
    """Whole groups (neighbourhoods) to departments, largest first to the least loaded: balanced sizes,
    deterministic."""
    values, counts = np.unique(np.asarray(keys), return_counts=True)
    load = [0] * departments
    owner: dict[str, int] = {}
    for value, count in sorted(zip(values.tolist(), counts.tolist(), strict=True), key=lambda vc: (-vc[1], vc[0])):
        target = int(np.argmin(load))
        owner[value] = target
        load[target] += count
    assignment = np.array([owner[k] for k in keys])
    return [np.flatnonzero(assignment == d) for d in range(departments)]


def write_department_files(dataset: str, out: Path, departments: int, *, split: str, seed: int,
                           alpha: float = 0.3, limit: int = 0, root: Path | None = None) -> tuple[list[Path], Path]:
    """Write each department's own file of a packaged dataset (CSV for Ames, JSONL for WordNet) and the
    whole pool (for proposing the schema); ``split``: ``natural`` (Ames: neighbourhoods), ``dirichlet``
    (label skew α) or ``iid``. ``limit`` keeps a seeded subset of that many rows (0: all)."""
    if dataset not in PACKAGED:
        raise ConfigError(f"dataset must be one of {sorted(PACKAGED)}, got {dataset!r}")
    rows: list[dict[str, Any]] = list(ames_rows(root) if dataset == "ames" else wordnet_rows(root))
    rng = np.random.default_rng(seed)
    if limit and limit < len(rows):
        rows = [rows[i] for i in np.sort(rng.choice(len(rows), size=limit, replace=False))]
    label = "Sale_Price" if dataset == "ames" else "lexname"
    if split == "natural":
        if dataset != "ames":
            raise ConfigError("split 'natural' is Ames' neighbourhoods; use 'dirichlet' or 'iid' for wordnet")
        parts = natural_groups([str(r["Neighborhood"]) for r in rows], departments)
    elif split == "dirichlet":
        labels = np.unique([str(r[label]) for r in rows], return_inverse=True)[1] if dataset == "wordnet" else \
            np.digitize([float(r[label]) for r in rows], np.quantile([float(r[label]) for r in rows], [0.25, 0.5, 0.75]))
        parts = partition_dirichlet(np.asarray(labels), departments, alpha=alpha, seed=seed, min_size=20)
    elif split == "iid":
        parts = partition_iid(np.zeros(len(rows), dtype=np.int64), departments, seed=seed)
    else:
        raise ConfigError(f"split must be natural, dirichlet or iid, got {split!r}")
    out.mkdir(parents=True, exist_ok=True)
    suffix = ".csv" if dataset == "ames" else ".jsonl"

    def write(path: Path, chosen: list[dict[str, Any]]) -> Path:
        if suffix == ".csv":
            with path.open("w", newline="", encoding="utf-8") as fh:
                writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
                writer.writeheader()
                writer.writerows(chosen)
        else:
            path.write_text("".join(json.dumps(r) + "\n" for r in chosen), encoding="utf-8")
        return path

    files = [write(out / f"department-{d + 1}{suffix}", [rows[i] for i in np.sort(part)]) for d, part in enumerate(parts)]
    return files, write(out / f"pool{suffix}", rows)
