"""The worked plug-in task (examples/city_task): found by module:attribute, imported under its schema,
trained in a masked federation that equals the plaintext one; its entry point is declared; a node with
another version of it refuses."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import numpy as np
import pytest

from quorumfl.core.data import import_partition, propose_schema, read_partition
from quorumfl.core.tasks import ModelSpec, get_task
from quorumfl.errors import ConfigError, DataError
from quorumfl.server.state.repository import RunStatus
from tests.server.test_rounds import (  # noqa: F401
    REPRODUCIBLE,
    LoopbackGrid,
    _contexts,
    _federation,
    task_identity,
)
from tests.server.test_task_matrix import _models

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "city_task"
TASK = "city_tasks.permits:TASK"


@pytest.fixture
def offices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, Path], Path]:
    monkeypatch.syspath_prepend(str(EXAMPLE))
    from city_tasks.permits import example_rows, write_rows

    files = {name: write_rows(tmp_path / f"{name}.jsonl", example_rows(80, seed=i))
             for i, name in enumerate(["north", "south", "east", "west"])}
    schema = propose_schema(files["north"], TASK, {})
    assert schema["task"] == TASK and schema["kinds"] == ["extension", "new-build", "renovation"]
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(schema))
    parts = {name: import_partition(f, tmp_path / "parts" / name, department=name, schema=schema) and
             tmp_path / "parts" / name for name, f in files.items()}
    return parts, schema_file


def test_the_plug_in_task_trains_masked_as_in_plaintext(tmp_path: Path, offices: tuple[dict[str, Path], Path]) -> None:
    parts, schema_file = offices
    settings = {"task": TASK, "task-schema": str(schema_file), "model": "small", "num-rounds": 3}
    plain_fed, repo = _federation(tmp_path, LoopbackGrid(_contexts(parts, {**REPRODUCIBLE, "state-dir": str(tmp_path / "p")})),
                                  **settings)
    plain_run = plain_fed.run()
    masked_fed, repo = _federation(tmp_path, LoopbackGrid(_contexts(parts, {**REPRODUCIBLE, "state-dir": str(tmp_path / "m")})),
                                   **settings, **{"secure-aggregation": "masking", "secagg-threshold": 0.6})
    masked_run = masked_fed.run()
    assert repo.get_run(masked_run).status == RunStatus.COMPLETED
    plain, masked = _models(repo, plain_run), _models(repo, masked_run)
    for key, value in masked[(1, 0)].items():  # round 1: the statistics round, exact up to fixed point
        np.testing.assert_allclose(value, plain[(1, 0)][key], rtol=0, atol=1e-5)
    xs = np.concatenate([read_partition(p).train.x.astype(np.float64) for p in parts.values()])
    np.testing.assert_allclose(masked[(1, 0)]["0.mean"], xs.mean(axis=0), rtol=1e-5, atol=1e-4)
    finals = {m.node_id: m.value for m in repo.metrics(masked_run, name="final-mae")}
    assert len(finals) == 4 and all(0 < v < 60 for v in finals.values())  # days


def test_entry_point_refusals_and_a_node_with_another_version(
    tmp_path: Path, offices: tuple[dict[str, Path], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    parts, schema_file = offices
    declared = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]["entry-points"]["quorumfl.tasks"]
    assert declared == {"permit-days": TASK}
    task = get_task(TASK)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"application": "x", "floor_area": 10, "storeys": 1, "kind": "demolition", "days": 3}\n')
    with pytest.raises(DataError, match="row 1, column 'kind' is 'demolition'"):
        task.read(bad, json.loads(schema_file.read_text()))
    monkeypatch.setattr(type(task), "version", "1.1")  # this node's package is another version
    with pytest.raises(ConfigError, match="version 1.1 here, the run's schema needs version 1.0"):
        ModelSpec(TASK, "small", schema_file.read_text()).resolve()
