"""The ``tabular`` task: records with numeric and categorical columns (tax, property, service tables).

Schema (JSON; ``quorumfl data schema`` proposes one from a file, the admin reviews and shares it)::

    {"task": "tabular", "version": "1", "label": "Sale_Price", "objective": "regression",
     "target_range": [0, 1000000],                       # regression; classification: "classes": [...]
     "numeric": [{"name": "Lot_Area", "low": 0, "high": 1000000}, ...],
     "categorical": [{"name": "Neighborhood", "buckets": 32, "min_share": 0.01}, ...],
     "ignore": ["Parcel_ID"]}

Encoding is fixed by the schema alone, so no department's data decides it: a numeric value is scaled
by its declared range to [0, 1] (a value outside the range is refused, naming the row and column); a
categorical value is hashed into one of the column's buckets (one-hot), so no vocabulary has to be
collected from anyone. The standardisation that training needs is computed across departments: the
models begin with a ``Standardize`` layer whose mean and second moment start empty; in the first
round of a fresh run every node puts its own (count-weighted) statistics there instead of training,
and the round's secure aggregation reveals only their weighted mean over the departments, i.e. the
federation's statistics (sums and counts, nothing per department). The same round decides each
categorical column's vocabulary: a bucket's mean is the share of the federation's records whose
value hashes there, and a bucket below the column's ``min_share`` (optional; 0 keeps every bucket)
is pooled with the absent values (``Standardize.floor``). Runs with differential privacy skip that
round (statistics of raw data would not be covered by ε) and train on the range-scaled values with
every bucket.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from quorumfl.core.tasks.base import Schema
from quorumfl.core.tasks.objective import CLASSIFICATION, Objective, Regression
from quorumfl.core.tasks.table_batches import Batch, file_batches
from quorumfl.core.tasks.tables import parse_number, read_table
from quorumfl.core.tasks.tabular_encode import encode_batch, feature_count, numeric_count
from quorumfl.errors import ConfigError, DataError

if TYPE_CHECKING:
    from torch import nn

__all__ = ["TabularTask", "nice_range"]

DEFAULT_BUCKETS = 16
DEFAULT_MIN_SHARE = 0.01  # proposed for new schemas: a category held by under 1 % of the records is pooled
MAX_MIN_SHARE = 0.5
CLASSIFICATION_MAX_CLASSES = 20  # a numeric label with more distinct values is proposed as regression


def nice_range(low: float, high: float) -> tuple[float, float]:
    """A declared range around the observed [low, high]: 0 or ∓10^k bounds, so another department's
    values of the same kind fit, and the bounds reveal only an order of magnitude."""

    def bound(value: float, up: bool) -> float:
        if value == 0:
            return 0.0
        power = 10.0 ** math.ceil(math.log10(abs(value)))
        if (value > 0) == up:
            return power if value > 0 else -power
        return 0.0

    lo = 0.0 if low >= 0 else bound(low, up=False)
    hi = 0.0 if high <= 0 else bound(high, up=True)
    if hi <= lo:
        hi = lo + 1.0
    return lo, hi


def _floors(schema: Schema) -> list[float]:
    """Per feature, the share of the federation's records a slot needs to be read (−∞: always)."""
    floors = [-math.inf] * numeric_count(schema)
    for spec in schema["categorical"]:
        share = float(spec.get("min_share", 0))
        floors += [share if share > 0 else -math.inf] * int(spec["buckets"])
    return floors


def _is_numeric(cells: Sequence[str | None]) -> bool:
    try:
        return bool(cells) and all(math.isfinite(float(cell)) for cell in cells if cell is not None)
    except ValueError:
        return False


def _present(cells: Sequence[str | None]) -> list[str]:
    """A column's non-empty cells."""
    return [cell for cell in cells if cell is not None and cell.strip()]


def _names(options: Mapping[str, str], key: str) -> list[str]:
    return [n.strip() for n in options.get(key, "").split(",") if n.strip()]


class TabularTask:
    """Tables: classification or regression on numeric and hashed categorical columns."""

    name = "tabular"
    version = "1"
    default_model = "mlp"
    # Adam: one rate serves tables whose columns and targets differ by orders of magnitude (SGD's did not)
    training_defaults = ("adam", 0.003)
    needs_statistics = True  # the first round of a fresh run computes the federation's standardisation

    def model_names(self) -> Sequence[str]:
        return ("mlp", "linear")

    def check_schema(self, schema: Schema) -> None:
        def need(ok: bool, field: str, fix: str) -> None:
            if not ok:
                raise ConfigError(f"tabular schema: '{field}' {fix}")

        need(schema.get("task") == self.name, "task", "must be 'tabular'")
        need(str(schema.get("version")) == self.version, "version", f"must be '{self.version}' for this QuorumFL")
        need(isinstance(schema.get("label"), str) and bool(schema.get("label")), "label", "must name the label column")
        objective = schema.get("objective")
        need(objective in ("classification", "regression"), "objective", "must be 'classification' or 'regression'")
        if objective == "classification":
            classes = schema.get("classes")
            need(isinstance(classes, list) and len(classes) >= 2 and len(set(map(str, classes))) == len(classes),
                 "classes", "must list two or more distinct classes")
        else:
            rng = schema.get("target_range")
            need(isinstance(rng, list) and len(rng) == 2 and all(isinstance(v, (int, float)) for v in rng)
                 and rng[0] < rng[1], "target_range", "must be [low, high] with low < high")
        numeric, categorical = schema.get("numeric"), schema.get("categorical")
        need(isinstance(numeric, list) and isinstance(categorical, list) and bool(numeric or categorical),
             "numeric/categorical", "must list the feature columns")
        assert isinstance(numeric, list) and isinstance(categorical, list)
        for spec in numeric:
            need(isinstance(spec, Mapping) and isinstance(spec.get("name"), str)
                 and isinstance(spec.get("low"), (int, float)) and isinstance(spec.get("high"), (int, float))
                 and spec["low"] < spec["high"], f"numeric[{spec.get('name') if isinstance(spec, Mapping) else spec}]",
                 "needs name, low and high with low < high")
        for spec in (*numeric, *categorical):
            need(isinstance(spec.get("missing", False), bool), f"{spec['name']}.missing",
                 "must be true (empty cells allowed) or false")
        for spec in categorical:
            where = f"categorical[{spec.get('name') if isinstance(spec, Mapping) else spec}]"
            need(isinstance(spec, Mapping) and isinstance(spec.get("name"), str)
                 and isinstance(spec.get("buckets"), int) and 2 <= spec["buckets"] <= 4096,
                 where, "needs a name and buckets between 2 and 4096")
            share = spec.get("min_share", 0)
            need(isinstance(share, (int, float)) and not isinstance(share, bool) and 0 <= share <= MAX_MIN_SHARE,
                 f"{where}.min_share", f"must be a share of the records from 0 to {MAX_MIN_SHARE}")
        names = [schema["label"], *(s["name"] for s in numeric), *(s["name"] for s in categorical)]
        dup = next((n for n in names if names.count(n) > 1), None)
        need(dup is None, str(dup), "is listed twice (label, numeric and categorical columns must differ)")

    def input_shape(self, schema: Schema) -> tuple[int, ...]:
        return (feature_count(schema),)

    def outputs(self, schema: Schema) -> int:
        return len(schema["classes"]) if schema["objective"] == "classification" else 1

    def objective(self, schema: Schema) -> Objective:
        if schema["objective"] == "classification":
            return CLASSIFICATION
        low, high = schema["target_range"]
        return Regression(scale=float(high) - float(low))

    def build_model(self, model: str, schema: Schema, *, seed: int) -> nn.Module:
        import torch
        from torch import nn

        from quorumfl.core.tasks.modules import Standardize, seeded

        features, outputs = feature_count(schema), self.outputs(schema)
        floor = torch.tensor(_floors(schema), dtype=torch.float32)

        def build() -> nn.Module:
            if model == "mlp":
                return nn.Sequential(Standardize(features, floor), nn.Linear(features, 64), nn.ReLU(),
                                     nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, outputs))
            if model == "linear":
                return nn.Sequential(Standardize(features, floor), nn.Linear(features, outputs))
            raise ConfigError(f"model: the tabular task has no model '{model}'; choose one of {list(self.model_names())}")

        return seeded(build, seed)

    def infer_schema(self, source: Path, options: Mapping[str, str]) -> dict[str, Any]:
        table = read_table(source)
        label = options.get("label", "")
        if not label:
            raise ConfigError(f"--label: name the label column of {source} (columns: {', '.join(table.columns)})")
        cells = table.column(label)
        ignore = _names(options, "ignore")
        for name in ignore:
            table.column(name)
        categorical = set(_names(options, "categorical"))
        for name in categorical:
            table.column(name)
        objective = options.get("objective", "auto")
        if objective not in ("auto", "classification", "regression"):
            raise ConfigError(f"--objective must be auto, classification or regression, got {objective!r}")
        numeric_label = len(_present(cells)) == len(cells) and _is_numeric(cells)
        distinct = sorted({(c or "").strip() for c in cells})
        if objective == "auto":
            objective = "regression" if numeric_label and len(distinct) > CLASSIFICATION_MAX_CLASSES else "classification"
        schema: dict[str, Any] = {"task": self.name, "version": self.version, "label": label, "objective": objective}
        if objective == "classification":
            if len(distinct) < 2:
                raise DataError(f"{source}: label column '{label}' has only the class {distinct!r}; a classifier needs two")
            if numeric_label:
                distinct.sort(key=float)
            schema["classes"] = distinct
        else:
            target = parse_number(source, label, cells)
            schema["target_range"] = list(nice_range(min(target), max(target)))
        buckets = int(options.get("buckets", DEFAULT_BUCKETS))
        try:
            min_share = float(options.get("min_share", DEFAULT_MIN_SHARE))
        except ValueError:
            raise ConfigError(f"--min-share must be a number from 0 to {MAX_MIN_SHARE}, got {options['min_share']!r}") from None
        numeric: list[dict[str, Any]] = []
        categories: list[dict[str, Any]] = []
        for name, column in table.columns.items():
            if name == label or name in ignore:
                continue
            present = _present(column)
            missing = {"missing": True} if len(present) < len(column) else {}
            if name not in categorical and _is_numeric(present):
                values = parse_number(source, name, present)
                low, high = nice_range(min(values), max(values))
                numeric.append({"name": name, "low": low, "high": high, **missing})
            else:
                categories.append({"name": name, "buckets": buckets, "min_share": min_share, **missing})
        schema.update(numeric=numeric, categorical=categories, ignore=ignore)
        self.check_schema(schema)
        return schema

    def read(self, source: Path, schema: Schema) -> tuple[NDArray[Any], NDArray[Any]]:
        parts = list(self.read_batches(source, schema))
        return np.concatenate([x for x, _ in parts]), np.concatenate([y for _, y in parts])

    def read_batches(self, source: Path, schema: Schema, *, on_bytes: Callable[[int, int], None] | None = None
                     ) -> Iterator[tuple[NDArray[Any], NDArray[Any]]]:
        """The file's rows encoded a batch at a time (memory bounded whatever the file's size)."""
        batches: Iterator[Batch] = file_batches(source, on_bytes=on_bytes)
        for batch in batches:
            yield encode_batch(batch, schema)
