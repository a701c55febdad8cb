"""Datasets by name: scikit-learn's digits (embedded default) and Fashion-MNIST from IDX files.

Nothing is downloaded: digits ships with scikit-learn, Fashion-MNIST is read from Debian's
``dataset-fashion-mnist`` package (``/usr/share/datasets/fashion-mnist``) or a directory given by
the caller. Images are float32 in [0, 1] with a channel axis, labels int64.
"""

from __future__ import annotations

import gzip
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from quorumfl.core.tasks.objective import CLASSIFICATION, Objective
from quorumfl.errors import ConfigError, DataError

__all__ = [
    "DATASETS",
    "FASHION_MNIST_DIR",
    "Dataset",
    "holdout_split",
    "load_dataset",
    "read_idx",
]

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")


@dataclass(frozen=True)
class Dataset:
    """Examples ``x`` (N, *input_shape) as the model takes them (float32 images or table features,
    int64 token ids) and targets ``y`` (N,): int64 class indices, or float32 for regression.
    ``objective`` says how they are learned and scored."""

    name: str
    x: NDArray[Any]
    y: NDArray[Any]
    num_classes: int
    objective: Objective = CLASSIFICATION

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.x.shape[1:])

    def subset(self, indices: NDArray[np.int64]) -> Dataset:
        return Dataset(self.name, self.x[indices], self.y[indices], self.num_classes, self.objective)

    def __len__(self) -> int:
        return int(self.y.shape[0])


def _load_digits(_data_dir: Path | None) -> tuple[Dataset, Dataset | None]:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = (np.asarray(bunch.data, dtype=np.float32) / 16.0).reshape(-1, 1, 8, 8)
    y = np.asarray(bunch.target, dtype=np.int64)
    return Dataset("digits", x, y, 10), None


def read_idx(path: Path) -> NDArray[np.uint8]:
    """Read one IDX file (optionally gzip-compressed) into a uint8 array of its declared shape."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DataError(f"cannot read IDX file {path}: {exc.strerror or exc}") from exc
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as exc:
            raise DataError(f"{path} is not a valid gzip file: {exc}") from exc
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise DataError(f"{path} is not an unsigned-byte IDX file (bad magic number)")
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{path}: truncated IDX header")
    shape = struct.unpack(f">{ndim}I", raw[4:header])
    count = int(np.prod(shape)) if shape else 0
    if len(raw) - header != count:
        raise DataError(
            f"{path}: IDX header declares {count} values but the file holds {len(raw) - header}"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)


def _find(data_dir: Path, stem: str) -> Path:
    for candidate in (data_dir / f"{stem}.gz", data_dir / stem):
        if candidate.is_file():
            return candidate
    raise DataError(
        f"Fashion-MNIST file '{stem}(.gz)' not found in {data_dir}; install Debian's "
        "'dataset-fashion-mnist' package or pass --data-dir pointing at the IDX files"
    )


def _load_fashion_mnist(data_dir: Path | None) -> tuple[Dataset, Dataset | None]:
    root = data_dir or FASHION_MNIST_DIR
    if not root.is_dir():
        raise DataError(
            f"Fashion-MNIST directory {root} does not exist; install Debian's "
            "'dataset-fashion-mnist' package or pass --data-dir"
        )

    def load(images: str, labels: str) -> Dataset:
        x = read_idx(_find(root, images))
        y = read_idx(_find(root, labels))
        if x.ndim != 3 or y.ndim != 1 or x.shape[0] != y.shape[0]:
            raise DataError(f"{root}: images {x.shape} and labels {y.shape} do not match")
        if y.size and int(y.max()) > 9:
            raise DataError(f"{root}: label {int(y.max())} outside 0..9")
        xs = x.astype(np.float32)[:, None, :, :]
        xs /= 255.0  # in place: the 60,000 training images are 188 MB as float32, and a copy would double that
        return Dataset("fashion-mnist", xs, y.astype(np.int64), 10)

    train = load("train-images-idx3-ubyte", "train-labels-idx1-ubyte")
    test = load("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
    return train, test


Loader = Callable[[Path | None], tuple[Dataset, "Dataset | None"]]

DATASETS: dict[str, Loader] = {
    "digits": _load_digits,
    "fashion-mnist": _load_fashion_mnist,
}


def load_dataset(name: str, *, data_dir: Path | None = None) -> tuple[Dataset, Dataset | None]:
    """Return ``(train_pool, official_test)``; ``official_test`` is None when the dataset has none."""
    try:
        loader = DATASETS[name]
    except KeyError:
        raise ConfigError(
            f"dataset: unknown dataset '{name}'; choose one of {sorted(DATASETS)}"
        ) from None
    return loader(data_dir)


def holdout_split(
    name: str, *, seed: int, data_dir: Path | None = None, test_fraction: float = 0.2
) -> tuple[Dataset, Dataset]:
    """Split a dataset into the pool that departments share out and the server's held-out test set.

    Deterministic in ``seed``: the server recomputes the same held-out set from (name, seed) when it
    evaluates the global model, so no test file travels. Datasets with an official test split
    (Fashion-MNIST) use it as the held-out set.
    """
    pool, test = load_dataset(name, data_dir=data_dir)
    if test is not None:
        return pool, test
    if not 0.0 < test_fraction < 1.0:
        raise ConfigError(f"test_fraction must be in (0, 1), got {test_fraction}")
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(pool))
    n_test = int(round(len(pool) * test_fraction))
    return pool.subset(np.sort(order[n_test:])), pool.subset(np.sort(order[:n_test]))
