"""The task protocol: the one place that says what a federation learns.

A task reads and checks a department's files, defines the schema every department must share (as a
JSON object, compared by its digest), builds the models for that schema and names the objective (loss,
metrics, primary metric). The server, the nodes, the CLI and the benchmarks ask the task; nothing
else assumes images or accuracy.

A schema is a plain JSON object with at least ``task`` (the task's name). Two departments can train
together exactly when their schemas have the same digest; ``schema_difference`` says, in one line,
which field differs (a column, a class, a range), so a node's refusal names what to fix.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
from numpy.typing import NDArray

from quorumfl.core.tasks.objective import Objective

if TYPE_CHECKING:
    from torch import nn

__all__ = ["OPTIMIZERS", "Schema", "Task", "schema_difference", "schema_digest"]

Schema = Mapping[str, Any]
OPTIMIZERS = ("sgd", "adam")  # the local optimizers a run may name (a task's ``training_defaults`` among them)


@runtime_checkable
class Task(Protocol):
    """What a task provides. Built-in: ``image``, ``tabular``, ``text``; a plug-in is any object with
    these members, found by ``module:attribute`` or the ``quorumfl.tasks`` entry point group."""

    name: str
    version: str  # part of every schema: a node with another version of the task refuses the run
    default_model: str

    def model_names(self) -> Sequence[str]:
        """The models this task builds."""

    def check_schema(self, schema: Schema) -> None:
        """Raise ``ConfigError`` naming the field when ``schema`` is not a valid schema of this task."""

    def input_shape(self, schema: Schema) -> tuple[int, ...]:
        """The shape of one example as the model takes it."""

    def outputs(self, schema: Schema) -> int:
        """The model's output width (classes, or 1 for regression)."""

    def objective(self, schema: Schema) -> Objective:
        """Loss, metrics and the primary metric."""

    def build_model(self, model: str, schema: Schema, *, seed: int) -> nn.Module:
        """Model ``model`` for ``schema`` with deterministic initial weights for ``seed``."""

    def infer_schema(self, source: Path, options: Mapping[str, str]) -> dict[str, Any]:
        """A schema proposed from one department's file (the admin reviews and shares it)."""

    def read(self, source: Path, schema: Schema) -> tuple[NDArray[Any], NDArray[Any]]:
        """The file's examples encoded for the model, checked against ``schema`` (``DataError`` naming
        the file, row or column and the fix on anything that does not fit). A model that begins with
        ``modules.Standardize`` needs inputs in [-1, 1]: its statistics travel through the secure sum."""


def canonical(schema: Schema) -> str:
    return json.dumps(schema, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def schema_digest(schema: Schema) -> str:
    """SHA-256 of the schema's canonical JSON: equal exactly when two schemas are the same."""
    return hashlib.sha256(canonical(schema).encode()).hexdigest()


def _describe(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."


def _where(path: str) -> str:
    """A schema path as a reader finds it: ``numeric[area].high`` is column 'area' (numeric.high)."""
    list_name, bracket, rest = path.partition("[")
    if not bracket:
        return f"'{path}'"
    column, _, field = rest.partition("]")
    return f"column '{column}' ({list_name}{field})"


def _difference(path: str, mine: Any, theirs: Any) -> str | None:
    if isinstance(mine, Mapping) and isinstance(theirs, Mapping):
        for key in sorted(set(mine) | set(theirs), key=str):
            where = f"{path}.{key}" if path else str(key)
            if key not in mine:
                return f"{_where(where)} is missing here (the run's schema has {_describe(theirs[key])})"
            if key not in theirs:
                return f"{_where(where)} is not in the run's schema (here {_describe(mine[key])})"
            found = _difference(where, mine[key], theirs[key])
            if found:
                return found
        return None
    if isinstance(mine, list) and isinstance(theirs, list):
        named = all(isinstance(v, Mapping) and "name" in v for v in [*mine, *theirs])
        if named:
            ours = {v["name"]: v for v in mine}
            run = {v["name"]: v for v in theirs}
            for name in [v["name"] for v in theirs] + [v["name"] for v in mine]:
                if name not in ours:
                    return f"column '{name}' of the run's schema ('{path}') is missing here"
                if name not in run:
                    return f"column '{name}' ('{path}') is not in the run's schema"
                found = _difference(f"{path}[{name}]", ours[name], run[name])
                if found:
                    return found
        missing = [v for v in theirs if v not in mine]
        extra = [v for v in mine if v not in theirs]
        if missing:
            return f"'{path}': {_describe(missing[0])} of the run's schema is missing here"
        if extra:
            return f"'{path}': {_describe(extra[0])} here is not in the run's schema"
        if mine != theirs:
            return f"'{path}': the same entries in another order (here {_describe(mine)})"
        return None
    if mine != theirs:
        return f"{_where(path)} is {_describe(mine)} here, {_describe(theirs)} in the run's schema"
    return None


def schema_difference(mine: Schema, theirs: Schema) -> str | None:
    """None when the schemas are equal, else the first difference in one line (naming the field)."""
    return _difference("", mine, theirs)


class TestRows:
    """Which of ``count`` rows are test rows: ``round(count × test_fraction)`` of them (at least one
    when there are two or more rows), a uniformly random subset deterministic in ``seed``, told a
    range of rows at a time in memory bounded whatever ``count`` is.

    Up to ``BLOCK`` rows: the rows ``stable_split`` picks. Beyond: how many test rows each block of
    ``BLOCK`` rows holds is drawn block after block from the hypergeometric law (what is left to
    draw among the rows left), and which rows of a block they are from a generator seeded by the
    block, so a block's rows are known without drawing the others'."""

    BLOCK = 1 << 16

    def __init__(self, count: int, *, test_fraction: float, seed: int) -> None:
        self.count, self.seed = count, seed
        self.test = max(1, int(round(count * test_fraction))) if count > 1 else 0
        self.small: NDArray[np.bool_] | None = None
        self.last: tuple[int, NDArray[np.bool_]] | None = None
        if count <= self.BLOCK:
            order = np.random.default_rng(seed).permutation(count)
            self.small = np.zeros(count, dtype=bool)
            self.small[order[: self.test]] = True
            return
        rng = np.random.default_rng([seed, 1])
        left, wanted, per_block = count, self.test, []
        for start in range(0, count, self.BLOCK):
            size = min(self.BLOCK, count - start)
            take = wanted if size == left else int(rng.hypergeometric(wanted, left - wanted, size))
            per_block.append(take)
            left, wanted = left - size, wanted - take
        self.per_block = np.asarray(per_block, dtype=np.int64)

    def _block(self, j: int) -> NDArray[np.bool_]:
        if self.last is not None and self.last[0] == j:  # consecutive ranges share a block
            return self.last[1]
        size = min(self.BLOCK, self.count - j * self.BLOCK)
        mask = np.zeros(size, dtype=bool)
        mask[np.random.default_rng([self.seed, 2, j]).choice(size, int(self.per_block[j]), replace=False)] = True
        self.last = (j, mask)
        return mask

    def mask(self, start: int, stop: int) -> NDArray[np.bool_]:
        """Rows ``start`` ≤ i < ``stop``: True for a test row."""
        if self.small is not None:
            return self.small[start:stop]
        first, last = start // self.BLOCK, (max(start, stop - 1)) // self.BLOCK
        joined = np.concatenate([self._block(j) for j in range(first, last + 1)])
        return joined[start - first * self.BLOCK: stop - first * self.BLOCK]


def stable_split(count: int, *, test_fraction: float, seed: int) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """(train rows, test rows) of ``count`` rows, deterministic in ``seed``; at least one test row
    when there are two or more rows."""
    order = np.random.default_rng(seed).permutation(count)
    n_test = max(1, int(round(count * test_fraction))) if count > 1 else 0
    return np.sort(order[n_test:]), np.sort(order[:n_test])
