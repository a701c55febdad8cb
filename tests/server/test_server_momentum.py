"""FedAvgM in the federation loop with the real ClientApp handlers, against a numpy reference.

Each round's stored model must be ``w + η·m`` with ``m ← β·m + (mean − w)``, where ``mean`` is the
example-weighted mean of that round's replies computed here with numpy; the tabular task's
statistics round (round 1) must leave the momentum at zero and set the statistics as they are. Under
masking the server applies the same step to the mean it reveals, so the secure run matches the
plaintext one up to the fixed-point error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Message

from quorumfl.protocol.wire import ARRAYS, METRICS, from_array_record
from quorumfl.server.model_store import ModelStore
from quorumfl.server.state.repository import RunStatus

from .test_rounds import REPRODUCIBLE, LoopbackGrid, _contexts, _federation, task_identity  # noqa: F401
from .test_task_matrix import city_partitions

BETA = 0.9
ROUNDS = 3
SETTINGS = {"server-momentum": BETA, "num-rounds": ROUNDS, "fraction-train": 1.0, "min-nodes": 2}


def _train_replies(grid: LoopbackGrid) -> list[list[Message]]:
    replies = [r for r in grid.replies if not r.has_error() and ARRAYS in r.content.array_records
               and "train-loss" in r.content.metric_records.get(METRICS, {})]
    n = len(grid.nodes)
    assert len(replies) == ROUNDS * n
    return [replies[i * n:(i + 1) * n] for i in range(ROUNDS)]


def _mean(replies: list[Message]) -> dict[str, np.ndarray]:
    weights = np.array([r.content.metric_records[METRICS]["num-examples"] for r in replies], dtype=np.float64)
    arrays = [from_array_record(r.content.array_records[ARRAYS]) for r in replies]
    return {k: np.tensordot(weights / weights.sum(), np.stack([a[k].astype(np.float64) for a in arrays]), axes=1)
            for k in arrays[0]}


def _stored(repo: Any, run_id: int) -> list[dict[str, np.ndarray]]:
    versions = sorted(repo.list_model_versions(run_id=run_id), key=lambda v: v.round)
    return [ModelStore.load(v.path, v.sha256) for v in versions]


@pytest.mark.parametrize("task", ["tabular", "text"])
def test_each_round_is_the_momentum_step_on_the_round_mean(task: str, tmp_path: Path) -> None:
    parts, settings = city_partitions(tmp_path / "data", task)
    grid = LoopbackGrid(_contexts(parts, REPRODUCIBLE))
    fed, repo = _federation(tmp_path, grid, **settings, **SETTINGS)
    run_id = fed.run()
    assert repo.get_run(run_id).status == RunStatus.COMPLETED
    stored = _stored(repo, run_id)
    means = [_mean(r) for r in _train_replies(grid)]
    trainable = {name for name, _ in fed.task.spec.build(seed=0).named_parameters()}
    # round 1 with η = 1: w1 = w0 + (mean1 − w0) = mean1, whatever w0 was
    model = {k: v.astype(np.float64) for k, v in means[0].items()}
    buffer = {k: np.zeros_like(v) for k, v in model.items()}
    if task == "tabular":  # the statistics round trained nothing: the momentum starts at zero after it
        assert float(stored[0]["0.ready"][0]) == pytest.approx(1.0)
    else:
        buffer = {k: means[0][k] - fed.task.spec.build(seed=fed.config.seed).state_dict()[k].numpy() for k in model}
    for number in range(ROUNDS):
        if number:
            for k in model:
                if k in trainable:
                    buffer[k] = BETA * buffer[k] + (means[number][k] - model[k])
                    model[k] = model[k] + buffer[k]
                else:
                    model[k] = means[number][k]
        for k, value in stored[number].items():
            np.testing.assert_allclose(value, model[k], rtol=1e-5, atol=1e-5, err_msg=f"{task} round {number + 1} {k}")
    # the momentum moved the model beyond plain averaging
    assert any(not np.allclose(stored[-1][k], means[-1][k], atol=1e-4) for k in trainable)


def test_masked_rounds_take_the_same_step(tmp_path: Path) -> None:
    parts, settings = city_partitions(tmp_path / "data", "tabular")
    runs = []
    for name, extra in {"plain": {}, "masking": {"secure-aggregation": "masking", "secagg-threshold": 0.6}}.items():
        grid = LoopbackGrid(_contexts(parts, {**REPRODUCIBLE, "state-dir": str(tmp_path / name)}))
        fed, repo = _federation(tmp_path, grid, **settings, **SETTINGS, **extra)
        run_id = fed.run()
        assert repo.get_run(run_id).status == RunStatus.COMPLETED, name
        runs.append(_stored(repo, run_id))
    plain, masked = runs
    for number, (a, b) in enumerate(zip(plain, masked, strict=True), start=1):
        for k in a:
            np.testing.assert_allclose(b[k], a[k], rtol=0, atol=1e-5 if number == 1 else 1e-3, err_msg=f"round {number} {k}")
