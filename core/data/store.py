"""Department partition directories: what a node reads, and the tools that lay them out.

A partition directory holds ``train.npz`` and ``test.npz`` (arrays ``x``, ``y`` as the task encoded
them) and ``partition.json`` (department, dataset, the task's schema and its digest, counts). A node
reads only its own directory. ``prepare_partitions`` splits a built-in dataset among departments
(``departments.import_partition`` turns a department's own file into its partition).
"""

from __future__ import annotations

import io
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from quorumfl.core.data.datasets import Dataset, holdout_split
from quorumfl.core.data.partition import partition
from quorumfl.core.files import atomic_write
from quorumfl.core.tasks import get_task, image_schema, schema_digest
from quorumfl.core.tasks.objective import Objective
from quorumfl.errors import ConfigError, DataError, QuorumError

__all__ = ["META", "Partition", "department_slug", "prepare_partitions", "read_partition", "write_meta",
           "write_partition"]

META = "partition.json"
_SLUG = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")


@dataclass(frozen=True)
class Partition:
    department: str
    dataset: str
    train: Dataset
    test: Dataset
    schema: dict[str, Any] = field(default_factory=dict)  # empty: the built-in image dataset's own

    def resolved_schema(self) -> dict[str, Any]:
        return self.schema or image_schema(self.dataset, self.train.input_shape, self.train.num_classes)


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
    """Write the partition; ``partition.json`` goes last, so a directory without it is never read as
    a partition (an interrupted write leaves nothing a node would take)."""
    directory.mkdir(parents=True, exist_ok=True)
    _save_npz(directory / "train.npz", part.train)
    _save_npz(directory / "test.npz", part.test)
    classification = part.train.objective.name == "classification"
    write_meta(directory, department=part.department, dataset=part.dataset, schema=part.schema or None,
               input_shape=part.train.input_shape, num_classes=part.train.num_classes,
               counts=(len(part.train), len(part.test)),
               train_labels=np.bincount(part.train.y) if classification else None,
               digest_of=part.resolved_schema())


def write_meta(directory: Path, *, department: str, dataset: str, schema: dict[str, Any] | None,
               input_shape: tuple[int, ...], num_classes: int, counts: tuple[int, int],
               train_labels: Any = None, digest_of: dict[str, Any] | None = None) -> None:
    """``partition.json``: written after the arrays, it makes the directory a partition."""
    resolved = digest_of or schema or {}
    meta: dict[str, Any] = {
        "department": department,
        "dataset": dataset,
        "task": resolved["task"],
        "num_classes": num_classes,
        "input_shape": list(input_shape),
        "train_examples": counts[0],
        "test_examples": counts[1],
        "schema_digest": schema_digest(resolved),
    }
    if schema:
        meta["schema"] = schema
    if train_labels is not None:
        meta["train_label_counts"] = np.pad(np.asarray(train_labels, dtype=np.int64),
                                            (0, max(0, num_classes - len(train_labels)))).tolist()
    atomic_write(directory / META, (json.dumps(meta, indent=2) + "\n").encode())


def _load_npz(path: Path, name: str, num_classes: int, objective: Objective) -> Dataset:
    try:
        with np.load(path, allow_pickle=False) as npz:
            x, y = np.asarray(npz["x"]), np.asarray(npz["y"])
    except FileNotFoundError:
        raise DataError(f"{path} is missing; re-create the partition with 'quorumfl data split' or 'data import'") from None
    except (OSError, ValueError, KeyError) as exc:
        raise DataError(f"{path} is not a readable partition file ({exc})") from exc
    if x.shape[0] != y.shape[0] or x.ndim < 2:
        raise DataError(f"{path}: {x.shape[0]} inputs but {y.shape[0]} labels")
    if x.dtype not in (np.float32, np.int64):
        x = x.astype(np.float32)
    if objective.name == "classification":
        y = y.astype(np.int64)
        if y.size and (int(y.min()) < 0 or int(y.max()) >= num_classes):
            raise DataError(f"{path}: labels outside 0..{num_classes - 1}")
    else:
        y = y.astype(np.float32)
        if not np.all(np.isfinite(y)):
            raise DataError(f"{path}: targets that are not finite; import the data again")
    return Dataset(name, x, y, num_classes, objective)


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
        schema = meta.get("schema") or image_schema(dataset, meta["input_shape"], num_classes)
        if not isinstance(schema, dict):
            raise TypeError("'schema' is not an object")
    except FileNotFoundError:
        raise DataError(f"{directory} has no {META}; it is not a QuorumFL partition directory") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{directory / META} is corrupt ({exc})") from exc
    try:
        task = get_task(str(schema.get("task")))
        task.check_schema(schema)
        objective = task.objective(schema)
    except QuorumError as exc:
        raise DataError(f"{directory / META}: {exc}") from None
    train = _load_npz(directory / "train.npz", dataset, num_classes, objective)
    test = _load_npz(directory / "test.npz", dataset, num_classes, objective)
    if len(train) == 0:
        raise DataError(f"{directory}: the training split is empty")
    return Partition(department, dataset, train, test, schema if "schema" in meta else {})


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

