"""Department partition directories: what a node reads, and the tool that lays them out.

A partition directory holds ``train.npz`` and ``test.npz`` (arrays ``x``, ``y``) and
``partition.json`` (department, dataset, classes, counts). A node reads only its own directory.
"""

from __future__ import annotations

import io
import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from quorumfl.core.data.datasets import Dataset, holdout_split
from quorumfl.core.data.partition import partition
from quorumfl.core.files import atomic_write
from quorumfl.errors import ConfigError, DataError

__all__ = ["Partition", "department_slug", "prepare_partitions", "read_partition", "write_partition"]

META = "partition.json"
_SLUG = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")


@dataclass(frozen=True)
class Partition:
    department: str
    dataset: str
    train: Dataset
    test: Dataset


def department_slug(name: str) -> str:
    """Validate a department name (used as directory name and node label)."""
    slug = name.strip().lower().replace(" ", "-")
    if not _SLUG.match(slug):
        raise ConfigError(
            f"department name '{name}' must be 1-63 characters of letters, digits, '-' or '_'"
        )
    return slug


def _save_npz(path: Path, data: Dataset) -> None:
    buffer = io.BytesIO()
    np.savez(buffer, x=data.x, y=data.y)
    atomic_write(path, buffer.getvalue())


def write_partition(directory: Path, part: Partition) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    _save_npz(directory / "train.npz", part.train)
    _save_npz(directory / "test.npz", part.test)
    meta = {
        "department": part.department,
        "dataset": part.dataset,
        "num_classes": part.train.num_classes,
        "input_shape": list(part.train.input_shape),
        "train_examples": len(part.train),
        "test_examples": len(part.test),
        "train_label_counts": np.bincount(part.train.y, minlength=part.train.num_classes).tolist(),
    }
    (directory / META).write_text(json.dumps(meta, indent=2) + "\n")


def _load_npz(path: Path, name: str, num_classes: int) -> Dataset:
    try:
        with np.load(path, allow_pickle=False) as npz:
            x = np.asarray(npz["x"], dtype=np.float32)
            y = np.asarray(npz["y"], dtype=np.int64)
    except FileNotFoundError:
        raise DataError(f"{path} is missing; re-create the partition with 'quorumfl data split'") from None
    except (OSError, ValueError, KeyError) as exc:
        raise DataError(f"{path} is not a readable partition file ({exc})") from exc
    if x.shape[0] != y.shape[0] or x.ndim < 2:
        raise DataError(f"{path}: {x.shape[0]} inputs but {y.shape[0]} labels")
    if y.size and (int(y.min()) < 0 or int(y.max()) >= num_classes):
        raise DataError(f"{path}: labels outside 0..{num_classes - 1}")
    return Dataset(name, x, y, num_classes)


def read_partition(directory: Path) -> Partition:
    """Read a department's partition directory, with errors that say what to fix."""
    if not directory.is_dir():
        raise DataError(
            f"partition directory {directory} does not exist; pass the node's own data directory "
            "(node config 'data-path', or --data for 'quorumfl node start')"
        )
    try:
        meta = json.loads((directory / META).read_text())
        department = str(meta["department"])
        dataset = str(meta["dataset"])
        num_classes = int(meta["num_classes"])
    except FileNotFoundError:
        raise DataError(f"{directory} has no {META}; it is not a QuorumFL partition directory") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{directory / META} is corrupt ({exc})") from exc
    train = _load_npz(directory / "train.npz", dataset, num_classes)
    test = _load_npz(directory / "test.npz", dataset, num_classes)
    if len(train) == 0:
        raise DataError(f"{directory}: the training split is empty")
    return Partition(department, dataset, train, test)


def prepare_partitions(
    out_dir: Path,
    departments: list[str],
    *,
    dataset: str = "digits",
    method: str = "dirichlet",
    alpha: float = 0.5,
    labels_per_node: int = 2,
    seed: int = 0,
    test_fraction: float = 0.2,
    data_dir: Path | None = None,
) -> dict[str, Path]:
    """Lay out one partition directory per department under ``out_dir``.

    The pool excludes the server's held-out test set (see ``holdout_split``); each department's share
    is split again into its own train/test so it can report accuracy on its own distribution.
    """
    slugs = [department_slug(d) for d in departments]
    if len(set(slugs)) != len(slugs):
        raise ConfigError(f"department names must be unique, got {departments}")
    pool, _ = holdout_split(dataset, seed=seed, data_dir=data_dir)
    shares = partition(
        pool.y, len(slugs), method=method, seed=seed, alpha=alpha, labels_per_node=labels_per_node
    )
    rng = np.random.default_rng(seed + 1)
    paths: dict[str, Path] = {}
    for slug, idx in zip(slugs, shares, strict=True):
        idx = rng.permutation(idx)
        n_test = max(1, int(round(len(idx) * test_fraction))) if len(idx) > 1 else 0
        part = Partition(
            slug,
            dataset,
            pool.subset(np.sort(idx[n_test:])),
            pool.subset(np.sort(idx[:n_test])),
        )
        write_partition(out_dir / slug, part)
        paths[slug] = out_dir / slug
    return paths
