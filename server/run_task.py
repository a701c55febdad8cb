"""The run's task as the server uses it: the model spec sent to nodes, the objective, a held-out set.

The image task's built-in datasets give the server a held-out test set recomputed from (dataset,
seed), so it evaluates every round's model itself. Tabular and text tasks train on departments' own
data the server never holds: the round's figure is then the federated evaluation, i.e. the
example-weighted mean of what the nodes measured on their own test splits (``federated_metric``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from quorumfl.core.data.datasets import Dataset, holdout_split
from quorumfl.core.tasks import ModelSpec, Objective, get_task, image_schema, read_schema
from quorumfl.errors import ConfigError
from quorumfl.server.config import RunConfig

__all__ = ["RunTask", "federated_metric", "inline_schema", "run_task"]


@dataclass(frozen=True)
class RunTask:
    spec: ModelSpec
    objective: Objective
    holdout: Dataset | None  # the server's own test set (image task); None: departments evaluate

    @property
    def primary(self) -> str:
        return self.objective.primary


def read_schema_file(path: str) -> dict[str, object]:
    """The schema of ``task-schema``: inline JSON, or the file it names on the server."""
    return read_schema(path, key="task-schema")


def inline_schema(path: Path) -> str:
    """A schema file as the compact JSON a run config carries (checked: it parses as a schema)."""
    return json.dumps(read_schema_file(str(path)), sort_keys=True, separators=(",", ":"))


def run_task(config: RunConfig) -> RunTask:
    """Resolve the run's task, schema and (image task) held-out set; refuses a schema of another task."""
    task = get_task(config.task)
    holdout: Dataset | None = None
    if config.task_schema:
        schema = read_schema_file(config.task_schema)
    elif task.name == "image":
        _, holdout = holdout_split(config.dataset, seed=config.seed, data_dir=config.data_path())
        schema = image_schema(holdout.name, holdout.input_shape, holdout.num_classes)
    else:
        raise ConfigError(f"task '{task.name}' needs task-schema (the departments' shared schema file)")
    spec = ModelSpec(config.task, config.model, json.dumps(schema, sort_keys=True))
    spec.resolve()  # the schema fits the task (and the task's version), or the run stops here
    return RunTask(spec, spec.objective(), holdout)


def federated_metric(node_metrics: Mapping[int, Mapping[str, float]], name: str) -> float:
    """The example-weighted mean of ``name`` over the nodes that reported it (NaN if none did)."""
    total, weight = 0.0, 0.0
    for metrics in node_metrics.values():
        value, count = metrics.get(name), metrics.get("num-examples", 0.0)
        if value is not None and math.isfinite(value) and count > 0:
            total += value * count
            weight += count
    return total / weight if weight else math.nan
