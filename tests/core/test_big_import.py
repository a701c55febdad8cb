"""A department's 2 GB table is checked and imported with `quorumfl data` in bounded memory: peak RSS
of the command at most 500 MB, every row counted, the split as asked, the partition readable."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from tests.core.city_data import write_sales_csv


def peak_rss_mb(*argv: str) -> tuple[float, subprocess.CompletedProcess[str]]:
    """Run ``quorumfl`` as the only child of a fresh interpreter; that child's peak RSS in MB."""
    probe = ("import resource, subprocess, sys; done = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
             "sys.stdout.write(done.stdout); sys.stderr.write(done.stderr); "
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024); sys.exit(done.returncode)")
    done = subprocess.run([sys.executable, "-c", probe, sys.executable, "-m", "quorumfl.cli", *argv],
                          capture_output=True, text=True, timeout=1200, check=False)
    *output, rss = done.stdout.strip().splitlines()
    return float(rss), subprocess.CompletedProcess(done.args, done.returncode, "\n".join(output), done.stderr)


@pytest.mark.slow  # a 2 GB file, read three times: a few minutes
@pytest.mark.timeout(1800)
def test_a_2_gb_table_is_checked_and_imported_in_under_500_mb(tmp_path: Path) -> None:
    source = tmp_path / "sales.csv"
    rows = write_sales_csv(source, 2 * 10**9)
    assert source.stat().st_size >= 1.9e9
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({
        "task": "tabular", "version": "1", "label": "sale_price", "objective": "regression",
        "target_range": [0, 1_000_000], "numeric": [{"name": "area", "low": 0, "high": 1000},
                                                    {"name": "year_built", "low": 0, "high": 10000}],
        "categorical": [{"name": "zone", "buckets": 16}, {"name": "district", "buckets": 16}], "ignore": ["parcel"]}))
    checked_mb, checked = peak_rss_mb("data", "check", str(source), "--schema", str(schema), "--format", "json")
    assert checked.returncode == 0, checked.stderr
    assert json.loads(checked.stdout)["rows"] == rows
    imported_mb, imported = peak_rss_mb("data", "import", str(source), "--schema", str(schema), "--department", "tax",
                                        "--out", str(tmp_path / "part"))
    assert imported.returncode == 0, imported.stderr
    assert checked_mb <= 500 and imported_mb <= 500, (checked_mb, imported_mb)
    meta = json.loads((tmp_path / "part" / "partition.json").read_text())
    assert meta["train_examples"] + meta["test_examples"] == rows and meta["test_examples"] == round(rows * 0.2)
    size = sum(p.stat().st_size for p in (tmp_path / "part").iterdir())
    assert size < source.stat().st_size  # deflated one-hot slots: not four bytes a slot
    with zipfile.ZipFile(tmp_path / "part" / "train.npz") as archive, archive.open("x.npy") as member:
        version = np.lib.format.read_magic(member)
        read_header = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
        shape, _, dtype = read_header[version](member)  # the header, not gigabytes of rows
        head = np.frombuffer(member.read(1000 * 34 * 4), dtype=dtype).reshape(1000, 34)
    assert shape == (meta["train_examples"], 34) and (head[:, 2:].sum(axis=1) == 2).all()  # one slot per column
    assert ((head[:, :2] >= 0) & (head[:, :2] <= 1)).all()
