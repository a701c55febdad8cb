"""What a run's record says is what happened: a run that lost a round ends ``partial`` (exit 12, not
``completed``), and "final" is the final model's metric: the server's held-out figure of the last
model where the server holds data, else the departments' example-weighted evaluation of the final
model (not the figure of the model the last round started from)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Message, MessageType

from quorumfl.cli.errors import exit_code
from quorumfl.errors import RoundsLostError
from quorumfl.server.services import run_outcome_error, run_summaries, run_summary
from quorumfl.server.state.repository import RoundStatus, RunStatus

from .test_rounds import LoopbackGrid, _contexts, _federation, federation_parts, task_identity  # noqa: F401
from .test_task_matrix import city_partitions


def silent_in_train_round(lost: int) -> Any:
    """A node that replies to every message but its ``lost``-th train request."""
    trains = Counter[int]()

    def fault(request: Message, reply: Message) -> Message | None:
        if request.metadata.message_type == MessageType.TRAIN:
            trains[request.metadata.dst_node_id] += 1
            if trains[request.metadata.dst_node_id] == lost:
                return None
        return reply

    return fault


def test_a_run_that_lost_a_round_is_partial_and_its_final_is_the_last_models(
        tmp_path: Path, federation_parts: dict[str, Path]) -> None:  # noqa: F811
    contexts = _contexts(dict(list(federation_parts.items())[:3]))
    lose = silent_in_train_round(2)
    grid = LoopbackGrid(contexts, {n: lose for n in list(contexts)[1:]})  # round 2: 1 update, min-nodes 2
    federation, repo = _federation(tmp_path, grid, **{"num-rounds": 3, "round-timeout": 1.0})
    run_id = federation.run()
    run = repo.get_run(run_id)
    assert [r.status for r in run.rounds] == [RoundStatus.COMPLETED, RoundStatus.FAILED, RoundStatus.COMPLETED]
    assert run.status == RunStatus.PARTIAL and run.error == "1 of 3 round(s) failed; 'quorumfl rounds list' shows why"
    failure = run_outcome_error(run)
    assert isinstance(failure, RoundsLostError) and exit_code(failure) == 12
    summary = run_summary(repo, run)
    last = repo.list_model_versions(run_id=run_id)[-1]
    assert summary["round_metric"] == "accuracy" and last.round == 3
    assert summary["final_metric"] == last.metrics["accuracy"]  # the held-out figure of the final model
    assert summary["secure_aggregation"] == "plaintext" and summary["privacy_label"] == "plaintext"
    assert run_summaries(repo.engine) == [summary]  # the run list, read for all runs at once, says the same


def test_with_no_data_on_the_server_final_is_the_departments_evaluation_of_the_final_model(tmp_path: Path) -> None:
    parts, settings = city_partitions(tmp_path / "city", "tabular")
    contexts = _contexts(dict(list(parts.items())[:3]))
    grid = LoopbackGrid(contexts)
    federation, repo = _federation(tmp_path, grid, **{"num-rounds": 2, **settings})
    run_id = federation.run()
    run = repo.get_run(run_id)
    summary = run_summary(repo, run)
    primary = summary["primary_metric"]
    assert run.status == RunStatus.COMPLETED and summary["round_metric"] == f"federated-{primary}"
    finals = {m.node_id: m.value for m in repo.metrics(run_id, name=f"final-{primary}") if m.node_id is not None}
    counts = {m.node_id: m.value for m in repo.metrics(run_id, name="final-num-examples") if m.node_id is not None}
    assert len(finals) == 3 and set(counts) == set(finals)
    nodes = sorted(finals)
    expected = np.average([finals[n] for n in nodes], weights=[counts[n] for n in nodes])  # numpy reference
    assert summary["final_metric"] == pytest.approx(float(expected), rel=1e-9)
    last_round = {m.round: m.value for m in repo.metrics(run_id, name=f"federated-{primary}") if m.node_id is None}[2]
    assert summary["final_metric"] != pytest.approx(last_round)  # that figure is of the model round 2 started from
    assert summary["task"] == "tabular regression of 'sale_price' (mlp)"
    assert run_summaries(repo.engine) == [summary]  # the run list, read for all runs at once, says the same
