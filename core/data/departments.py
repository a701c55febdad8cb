"""A department's own file → its partition directory, under the schema all departments share.

``propose_schema`` reads a sample file and proposes a schema (the admin reviews it and gives it to
every department); ``import_partition`` reads a department's file with its task, checks every row
against the schema, splits train/test and writes the partition directory atomically (a complete new
directory replaces the old one, or nothing changes); ``check_data`` reads a file or a partition
directory and says whether it fits a schema, writing nothing. ``split_packaged`` does all three for
a packaged real dataset (Ames sales, WordNet glosses) split across departments: the tabular and
text counterpart of ``data split`` on a built-in image dataset (the demo and benchmarks use it).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from quorumfl.core.data.partition_writer import PartitionWriter
from quorumfl.core.data.store import (
    META,
    department_slug,
    read_partition,
    write_meta,
)
from quorumfl.core.tasks import check_schema_fits, get_task, schema_digest
from quorumfl.core.tasks.base import TestRows
from quorumfl.errors import ConfigError, DataError

__all__ = ["PACKAGED_OPTIONS", "Imported", "check_data", "import_partition", "propose_schema", "split_packaged"]

# how each packaged dataset's schema is proposed from its pool (the label, text and ignored columns)
PACKAGED_OPTIONS: dict[str, dict[str, str]] = {"ames": {"label": "Sale_Price"},
                                               "wordnet": {"text": "text", "label": "lexname", "ignore": "synset"}}


def propose_schema(source: Path, task_name: str, options: Mapping[str, str]) -> dict[str, Any]:
    """The schema ``task_name`` proposes from ``source`` (options: the task's, e.g. label, text). Its
    ``task`` field is ``task_name`` as given (a built-in name, ``module:attribute`` or an entry point):
    how every node finds the task again."""
    task = get_task(task_name)
    schema = task.infer_schema(source, options)
    schema["task"] = task_name
    task.check_schema(schema)
    return schema


@dataclass(frozen=True)
class Imported:
    """What ``import_partition`` wrote: the department, its example counts and the directory."""

    department: str
    train_examples: int
    test_examples: int
    directory: Path


Progress = Callable[[str, int, int], None]  # (stage, bytes read, file size)


def _batches(task: Any, source: Path, schema: dict[str, Any], stage: str,
             on_progress: Progress | None) -> Iterator[tuple[NDArray[Any], NDArray[Any]]]:
    """The file's rows encoded a batch at a time (a task that reads in batches: the tabular one), or
    in one batch (the others read the whole file)."""
    if hasattr(task, "read_batches"):
        hear = None if on_progress is None else (lambda done, size: on_progress(stage, done, size))
        yield from task.read_batches(source, schema, on_bytes=hear)
    else:
        yield task.read(source, schema)


def import_partition(source: Path, out_dir: Path, *, department: str, schema: dict[str, Any],
                     test_fraction: float = 0.2, seed: int = 0, on_progress: Progress | None = None) -> Imported:
    """Read a department's own file with its task under the shared ``schema``, split it into train
    and test, and write the partition directory. The whole file is checked first (nothing is written
    unless every row is valid), then read again and written a batch at a time; an existing partition
    directory is replaced only by a complete new one."""
    if not 0.0 < test_fraction < 1.0:
        raise ConfigError(f"--test-fraction must be between 0 and 1 (exclusive), got {test_fraction}")
    slug = department_slug(department)
    task = get_task(str(schema.get("task")))
    task.check_schema(schema)
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / META).is_file():
        raise DataError(f"{out_dir} exists and is not a partition directory; choose an empty or new folder")
    rows = sum(len(y) for _, y in _batches(task, source, schema, "checking", on_progress))
    if rows < 2:
        raise DataError(f"{source}: {rows} row(s); a department needs at least two (one to test on)")
    objective = task.objective(schema)
    y_dtype = np.int64 if objective.name == "classification" else np.float32
    staging = out_dir.with_name(f".{out_dir.name}.importing-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        writer = PartitionWriter(staging, TestRows(rows, test_fraction=test_fraction, seed=seed),
                                 tuple(task.input_shape(schema)), y_dtype)
        for x, y in _batches(task, source, schema, "importing", on_progress):
            writer.add(x, y)
        train, test = writer.finish()
        write_meta(staging, department=slug, dataset=source.stem, schema=schema, input_shape=task.input_shape(schema),
                   num_classes=task.outputs(schema), counts=(train, test),
                   train_labels=writer.train_labels if objective.name == "classification" else None)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    old = out_dir.with_name(f".{out_dir.name}.replaced-{os.getpid()}")
    if out_dir.exists():
        os.replace(out_dir, old)  # the old partition stays whole until the new one is in place
    os.replace(staging, out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return Imported(slug, train, test, out_dir)


def check_data(path: Path, schema: dict[str, Any] | None, *, on_progress: Progress | None = None) -> dict[str, Any]:
    """What ``path`` (a partition directory, or a department's file or image folder with ``schema``) holds, and whether it
    fits ``schema``: raises ``DataError`` naming the row, column or class that does not. Writes nothing; reads
    a file a batch at a time."""
    if path.is_dir() and (schema is None or (path / META).is_file()):  # else an image folder to check
        part = read_partition(path)
        mine = part.resolved_schema()
        if schema is not None:
            check_schema_fits(mine, schema, where=str(path))
        return {"path": str(path), "department": part.department, "task": mine["task"],
                "schema_digest": schema_digest(mine), "train_examples": len(part.train),
                "test_examples": len(part.test), "fits": schema is not None}
    if schema is None:
        raise ConfigError(f"--schema: checking the file {path} needs the schema it must fit")
    task = get_task(str(schema.get("task")))
    task.check_schema(schema)
    rows = sum(len(y) for _, y in _batches(task, path, schema, "checking", on_progress))
    return {"path": str(path), "task": task.name, "schema_digest": schema_digest(schema), "rows": rows, "fits": True}


def split_packaged(dataset: str, out: Path, departments: list[str], *, split: str, seed: int, alpha: float = 0.3,
                   limit: int = 0) -> tuple[dict[str, Path], dict[str, Any]]:
    """A packaged dataset (``ames``: tabular, ``wordnet``: text) as departments' partitions under one
    schema proposed from the whole pool: each department's own file under ``out/files``, its
    partition under ``out/parts/<department>``, the schema in ``out/schema.json``. ``split``:
    ``natural`` (Ames' neighbourhoods, whole), ``dirichlet`` (label skew ``alpha``) or ``iid``."""
    from quorumfl.core.data.packaged import PACKAGED, write_department_files
    from quorumfl.core.files import atomic_write

    if dataset not in PACKAGED:
        raise ConfigError(f"--dataset must be one of {sorted(PACKAGED)} for a table or text split, got {dataset!r}")
    names = [department_slug(d) for d in departments]
    if len(set(names)) != len(names) or not names:
        raise ConfigError(f"--departments must name distinct departments, got {', '.join(departments) or 'none'}")
    files, pool = write_department_files(dataset, out / "files", len(names), split=split, seed=seed, alpha=alpha,
                                         limit=limit)
    schema = propose_schema(pool, PACKAGED[dataset], PACKAGED_OPTIONS[dataset])
    parts = {}
    for name, file in zip(names, files, strict=True):
        parts[name] = out / "parts" / name
        import_partition(file, parts[name], department=name, schema=schema, seed=seed)
    atomic_write(out / "schema.json", (json.dumps(schema, indent=2) + "\n").encode())
    return parts, schema
