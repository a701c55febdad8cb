"""Datasets (digits, Fashion-MNIST IDX) and department partition directories."""

from __future__ import annotations

import gzip
import json
import struct
from pathlib import Path

import numpy as np
import pytest

from quorumfl.core.data import holdout_split, load_dataset, prepare_partitions, read_partition
from quorumfl.core.data.datasets import read_idx
from quorumfl.errors import ConfigError, DataError


def _write_idx(path: Path, array: np.ndarray, *, compress: bool) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + array.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(payload) if compress else payload)


@pytest.fixture
def fashion_dir(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    root = tmp_path / "fmnist"
    root.mkdir()
    for prefix, n, compress in (("train", 60, True), ("t10k", 20, False)):
        suffix = ".gz" if compress else ""
        _write_idx(root / f"{prefix}-images-idx3-ubyte{suffix}", rng.integers(0, 256, (n, 28, 28)), compress=compress)
        _write_idx(root / f"{prefix}-labels-idx1-ubyte{suffix}", rng.integers(0, 10, n), compress=compress)
    return root


def test_digits_shape_and_range() -> None:
    train, test = load_dataset("digits")
    assert test is None
    assert train.x.shape == (1797, 1, 8, 8) and train.x.dtype == np.float32
    assert 0.0 <= train.x.min() and train.x.max() <= 1.0
    assert set(np.unique(train.y)) == set(range(10))


def test_fashion_mnist_from_idx(fashion_dir: Path) -> None:
    train, test = load_dataset("fashion-mnist", data_dir=fashion_dir)
    assert train.x.shape == (60, 1, 28, 28) and test is not None and test.x.shape == (20, 1, 28, 28)
    raw = read_idx(fashion_dir / "train-images-idx3-ubyte.gz")
    np.testing.assert_allclose(train.x[:, 0], raw / 255.0)


def test_truncated_idx_is_refused(fashion_dir: Path) -> None:
    path = fashion_dir / "t10k-labels-idx1-ubyte"
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(DataError, match="declares 20 values"):
        load_dataset("fashion-mnist", data_dir=fashion_dir)


def test_missing_fashion_dir_says_how_to_fix(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="dataset-fashion-mnist"):
        load_dataset("fashion-mnist", data_dir=tmp_path / "nope")


def test_unknown_dataset() -> None:
    with pytest.raises(ConfigError, match="unknown dataset 'mnist3d'"):
        load_dataset("mnist3d")


def test_holdout_is_deterministic_and_disjoint() -> None:
    pool_a, test_a = holdout_split("digits", seed=3)
    pool_b, test_b = holdout_split("digits", seed=3)
    np.testing.assert_array_equal(test_a.y, test_b.y)
    assert len(pool_a) + len(test_a) == 1797
    pool_rows = {r.tobytes() for r in pool_a.x}
    assert sum(r.tobytes() in pool_rows for r in test_a.x) < 5  # digits has a few duplicate images


def test_partitions_round_trip(tmp_path: Path) -> None:
    paths = prepare_partitions(tmp_path, ["tax-office", "Urban Planning"], seed=1)
    assert set(paths) == {"tax-office", "urban-planning"}
    part = read_partition(paths["urban-planning"])
    assert part.department == "urban-planning" and part.dataset == "digits"
    assert len(part.train) > 0 and len(part.test) > 0
    total = sum(len(read_partition(p).train) + len(read_partition(p).test) for p in paths.values())
    pool, _ = holdout_split("digits", seed=1)
    assert total == len(pool)


def test_partition_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        read_partition(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="not a QuorumFL partition"):
        read_partition(tmp_path / "empty")
    paths = prepare_partitions(tmp_path / "p", ["a", "b"], seed=0)
    (paths["a"] / "train.npz").write_bytes(b"garbage")
    with pytest.raises(DataError, match="not a readable partition file"):
        read_partition(paths["a"])
    meta = paths["b"] / "partition.json"
    meta.write_text(json.dumps({"department": "b"}))
    with pytest.raises(DataError, match="corrupt"):
        read_partition(paths["b"])
    with pytest.raises(ConfigError, match="unique"):
        prepare_partitions(tmp_path / "q", ["a", "A"], seed=0)
    with pytest.raises(ConfigError, match="department name"):
        prepare_partitions(tmp_path / "r", ["../etc"], seed=0)
