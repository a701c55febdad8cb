"""``permit-days``: how many days a building-permit decision takes, learned across district offices.

A worked example of a QuorumFL task written from scratch (``quorumfl.core.tasks.Task``): each district
office exports its decided applications as JSONL, one object per line::

    {"application": "B-2026-0412", "floor_area": 140.0, "storeys": 2, "kind": "extension", "days": 38}

The schema lists the kinds of application every office uses and the longest decision time the
federation expects; the model is a small MLP on (floor area, storeys, one-hot kind); the objective is
regression on days (scaled by ``max_days`` for training, reported in days). Use it as
``task = "city_tasks.permits:TASK"`` or, with this package installed, ``task = "permit-days"``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray
from torch import nn

from quorumfl.core.tasks import Objective, Regression
from quorumfl.core.tasks.modules import Standardize, seeded
from quorumfl.core.tasks.tables import parse_number, read_table
from quorumfl.errors import ConfigError, DataError

__all__ = ["TASK", "PermitDays"]

FIELDS = ("floor_area", "storeys", "kind", "days")


class PermitDays:
    name = "permit-days"
    version = "1.0"
    default_model = "small"
    needs_statistics = True  # its model starts with Standardize: the first round computes the statistics

    def model_names(self) -> Sequence[str]:
        return ("small",)

    def check_schema(self, schema: Mapping[str, Any]) -> None:
        kinds = schema.get("kinds")
        if schema.get("version") != self.version:  # 'task' is how the run names this task: checked by QuorumFL
            raise ConfigError(f"permit-days schema: 'version' must be '{self.version}'")
        if not (isinstance(kinds, list) and kinds and all(isinstance(k, str) for k in kinds)):
            raise ConfigError("permit-days schema: 'kinds' must list the kinds of application")
        for field in ("max_days", "max_floor_area", "max_storeys"):
            value = schema.get(field)
            if not (isinstance(value, (int, float)) and value > 0):
                raise ConfigError(f"permit-days schema: '{field}' must be a positive number")

    def input_shape(self, schema: Mapping[str, Any]) -> tuple[int, ...]:
        return (2 + len(schema["kinds"]),)

    def outputs(self, schema: Mapping[str, Any]) -> int:
        return 1

    def objective(self, schema: Mapping[str, Any]) -> Objective:
        return Regression(scale=float(schema["max_days"]))

    def build_model(self, model: str, schema: Mapping[str, Any], *, seed: int) -> nn.Module:
        if model != "small":
            raise ConfigError(f"model: permit-days has the model 'small', not '{model}'")
        width = self.input_shape(schema)[0]
        return seeded(lambda: nn.Sequential(Standardize(width), nn.Linear(width, 16), nn.ReLU(), nn.Linear(16, 1)), seed)

    def infer_schema(self, source: Path, options: Mapping[str, str]) -> dict[str, Any]:
        table = read_table(source)
        kinds = sorted({(k or "").strip() for k in table.column("kind")})
        return {"task": self.name, "version": self.version, "kinds": kinds,
                "max_days": float(options.get("max-days", 365)), "max_floor_area": 10_000.0, "max_storeys": 100.0}

    def read(self, source: Path, schema: Mapping[str, Any]) -> tuple[NDArray[Any], NDArray[Any]]:
        table = read_table(source)
        table.check_columns(FIELDS, ignored=["application"])
        kinds = {k: i for i, k in enumerate(schema["kinds"])}
        area = np.asarray(parse_number(source, "floor_area", table.column("floor_area")), dtype=np.float32)
        storeys = np.asarray(parse_number(source, "storeys", table.column("storeys")), dtype=np.float32)
        days = np.asarray(parse_number(source, "days", table.column("days")), dtype=np.float64)
        x = np.zeros((table.rows, 2 + len(kinds)), dtype=np.float32)
        for column, values, top in (("floor_area", area, schema["max_floor_area"]), ("storeys", storeys, schema["max_storeys"])):
            over = np.flatnonzero((values < 0) | (values > float(top)))
            if over.size:
                raise DataError(f"{source}: row {int(over[0]) + 1}, column '{column}' is {values[over[0]]:g}, outside 0 to "
                                f"{top:g}; fix it or raise max_{column} in the schema")
        # inputs in [0, 1]: the model's Standardize layer gets its statistics through the secure sum
        x[:, 0], x[:, 1] = area / float(schema["max_floor_area"]), storeys / float(schema["max_storeys"])
        for row, kind in enumerate(table.column("kind")):
            if (kind or "").strip() not in kinds:
                raise DataError(f"{source}: row {row + 1}, column 'kind' is {kind!r}, not one of the schema's kinds "
                                f"{schema['kinds']}; fix the value or add the kind to the schema")
            x[row, 2 + kinds[(kind or "").strip()]] = 1.0
        late = np.flatnonzero((days < 0) | (days > float(schema["max_days"])))
        if late.size:
            raise DataError(f"{source}: row {int(late[0]) + 1}, column 'days' is {days[late[0]]:g}, outside 0 to "
                            f"max_days {schema['max_days']:g}; fix it or raise max_days in the schema")
        return x, (days / float(schema["max_days"])).astype(np.float32)


TASK = PermitDays()


def example_rows(rows: int, *, seed: int) -> list[dict[str, Any]]:
    """Synthetic decided applications with a known rule (for the example's test and a first try)."""
    rng = np.random.default_rng(seed)
    kinds = ["extension", "new-build", "renovation"]
    out = []
    for i in range(rows):
        kind = kinds[int(rng.integers(len(kinds)))]
        area, storeys = float(rng.uniform(20, 400)), int(rng.integers(1, 5))
        days = 10 + 0.1 * area + 6 * storeys + {"extension": 5, "new-build": 40, "renovation": 0}[kind]
        out.append({"application": f"B-{seed}-{i:04d}", "floor_area": round(area, 1), "storeys": storeys,
                    "kind": kind, "days": round(float(days + rng.normal(0, 3)), 1)})
    return out


def write_rows(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path
