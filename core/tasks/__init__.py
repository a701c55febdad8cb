"""Tasks: what a federation learns. ``get_task`` finds one by name; ``ModelSpec`` builds its model.

Built-in tasks: ``image``, ``tabular``, ``text``. Your own: any object implementing ``Task``, named
``module:attribute`` in the run config (``task = "city_tasks.invoices:TASK"``) or registered under
the ``quorumfl.tasks`` entry point group of a package installed on the server and on every node.
A task's ``version`` is part of every schema, so a node with another version of the task (another
version of its package) refuses the run, naming both.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quorumfl.core.tasks.base import (
    OPTIMIZERS,
    Schema,
    Task,
    schema_difference,
    schema_digest,
    stable_split,
)
from quorumfl.core.tasks.image import ImageTask, image_schema
from quorumfl.core.tasks.objective import CLASSIFICATION, Classification, Objective, Regression
from quorumfl.core.tasks.tabular import TabularTask
from quorumfl.core.tasks.text import TextTask
from quorumfl.errors import ConfigError, DataError

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "BUILTIN_TASKS", "CLASSIFICATION", "OPTIMIZERS", "Classification", "ModelSpec", "Objective", "Regression", "Schema", "Task",
    "check_schema_fits", "get_task", "image_schema", "parse_schema", "read_schema", "schema_difference", "schema_digest",
    "stable_split", "training_defaults",
]

BUILTIN_TASKS: dict[str, Task] = {"image": ImageTask(), "tabular": TabularTask(), "text": TextTask()}
ENTRY_POINTS = "quorumfl.tasks"


def _check(task: object, name: str) -> Task:
    if not isinstance(task, Task):
        missing = [m for m in ("name", "version", "default_model", "model_names", "check_schema", "input_shape",
                               "outputs", "objective", "build_model", "infer_schema", "read") if not hasattr(task, m)]
        raise ConfigError(f"task: '{name}' is not a QuorumFL task (it lacks {', '.join(missing)}); see 'Your own task' "
                          "in docs/tutorials/your-data.md")
    return task


DEFAULT_TRAINING = ("sgd", 0.05)  # a plug-in task that declares no ``training_defaults``


def training_defaults(task: Task) -> tuple[str, float]:
    """The task's local optimizer and learning rate (``training_defaults``; SGD at 0.05 if it names none)."""
    declared = getattr(task, "training_defaults", DEFAULT_TRAINING)
    optimizer, rate = declared
    return str(optimizer), float(rate)


def get_task(name: str) -> Task:
    """The task called ``name``: built-in, ``module:attribute``, or a ``quorumfl.tasks`` entry point."""
    if name in BUILTIN_TASKS:
        return BUILTIN_TASKS[name]
    if ":" in name:
        module_name, _, attribute = name.partition(":")
        if not all(part.isidentifier() for part in module_name.split(".")) or not attribute.isidentifier():
            raise ConfigError(f"task: '{name}' is not of the form module:attribute (e.g. city_tasks:PERMITS)")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ConfigError(f"task: cannot import '{module_name}' for task '{name}' ({exc}); install the task's "
                              "package on the server and on every node") from None
        try:
            return _check(getattr(module, attribute), name)
        except AttributeError:
            raise ConfigError(f"task: module '{module_name}' has no attribute '{attribute}'") from None
    found = [ep for ep in entry_points(group=ENTRY_POINTS) if ep.name == name]
    if found:
        try:
            return _check(found[0].load(), name)
        except ImportError as exc:
            raise ConfigError(f"task: the entry point '{name}' does not load ({exc}); reinstall its package") from None
    raise ConfigError(f"task: unknown task '{name}'; choose one of {sorted(BUILTIN_TASKS)}, a 'module:attribute', "
                      f"or install a package with a '{ENTRY_POINTS}' entry point")


def parse_schema(text: str, *, where: str) -> dict[str, Any]:
    """A schema from its JSON text; ``where`` names the source in the error."""
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: the schema is not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(schema, dict) or not isinstance(schema.get("task"), str):
        raise ConfigError(f"{where}: a schema is a JSON object with a 'task' field")
    return schema


def read_schema(value: str, *, key: str) -> dict[str, Any]:
    """The schema an option (``key``) gives: its JSON inline, or the JSON file it names."""
    if value.lstrip().startswith("{"):
        return parse_schema(value, where=key)
    file = Path(value).expanduser()
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{key}: cannot read {file} ({exc.strerror or exc}); give the schema file "
                          "'quorumfl data schema' wrote") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{key}: {file} is not UTF-8 text; give the JSON file 'quorumfl data schema' wrote") from None
    return parse_schema(text, where=f"{key} {file}")


def check_schema_fits(mine: Schema, run: Schema, *, where: str) -> None:
    """Refuse (``DataError``) when this department's data (``mine``) was prepared for another schema."""
    if schema_digest(mine) == schema_digest(run):
        return
    difference = schema_difference(mine, run) or "the schemas differ"
    raise DataError(f"{where} does not fit the run's schema: {difference}; import the data again with the run's "
                    "schema ('quorumfl data import --schema')")


@dataclass(frozen=True)
class ModelSpec:
    """A run's model: the task, the model's name and the shared schema."""

    task: str
    model: str
    schema_json: str

    @property
    def schema(self) -> dict[str, Any]:
        return parse_schema(self.schema_json, where="the run's schema")

    def resolve(self) -> Task:
        task = get_task(self.task)
        schema = self.schema
        if schema.get("task") != self.task:
            raise ConfigError(f"the run's schema is for task '{schema.get('task')}', the run's task is '{self.task}'; "
                              "give the schema made for this task")
        if str(schema.get("version")) != str(task.version):
            raise ConfigError(f"task '{task.name}' is version {task.version} here, the run's schema needs version "
                              f"{schema.get('version')}; install the same version of the task on the server and every node")
        task.check_schema(schema)
        return task

    def build(self, *, seed: int) -> nn.Module:
        return self.resolve().build_model(self.model, self.schema, seed=seed)

    def objective(self) -> Objective:
        return self.resolve().objective(self.schema)

    def architecture(self) -> str:
        """Two runs' models are interchangeable exactly when this is equal (the model store's lineage)."""
        schema = self.schema
        if schema.get("task") == "image":  # the key model versions and edge artifacts have always had
            shape = "x".join(str(d) for d in schema["input_shape"])
            return f"{self.model}:{shape}:{len(schema['classes'])}"
        return f"{self.task}:{self.model}:{schema_digest(schema)[:16]}"
