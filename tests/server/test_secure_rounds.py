"""Masked rounds through the federation loop and the real ClientApp handlers (in-process Grid).

The masked result is compared with the same run in plaintext mode: same seeds, same data, so the
only difference allowed is the fixed-point error.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flwr.app import Message

from quorumfl.client.data import prepare_partitions
from quorumfl.client.secure_wire import ADVERTISE, SHARE, UNMASK
from quorumfl.client.wire import ARRAYS
from quorumfl.server.model_store import ModelStore
from quorumfl.server.state.repository import RoundStatus, RunStatus

from .test_rounds import (  # noqa: F401  (task_identity is an autouse fixture)
    Fault,
    LoopbackGrid,
    _contexts,
    _federation,
    error_reply,
    silent,
    task_identity,
)

SECURE = {"secure-aggregation": "masking", "secagg-threshold": 0.6}


@pytest.fixture
def six_parts(tmp_path: Path) -> dict[str, Path]:
    names = ["tax-office", "urban-planning", "public-works", "housing", "transport", "libraries"]
    return prepare_partitions(tmp_path / "data", names, seed=1, method="dirichlet", alpha=0.5)


def _models(repo: object, run_id: int) -> list[dict[str, np.ndarray]]:
    return [ModelStore.load(v.path, v.sha256) for v in repo.list_model_versions(run_id=run_id)]  # type: ignore[attr-defined]


def test_masked_rounds_equal_plaintext_fedavg(tmp_path: Path, six_parts: dict[str, Path]) -> None:
    plain_fed, repo = _federation(tmp_path, LoopbackGrid(_contexts(six_parts)))
    plain_models = _models(repo, plain_fed.run())

    grid = LoopbackGrid(_contexts(six_parts))
    secure_fed, repo = _federation(tmp_path, grid, **SECURE)
    run_id = secure_fed.run()

    assert repo.get_run(run_id).status == RunStatus.COMPLETED
    for plain, masked in zip(plain_models, _models(repo, run_id), strict=True):
        for key in plain:
            np.testing.assert_allclose(masked[key], plain[key], rtol=0, atol=1e-5)
    # The server never received a plaintext update, and keys were set up once for both rounds.
    assert all(ARRAYS not in r.content.array_records for r in grid.replies if not r.has_error())
    kinds = [m.metadata.message_type for m in grid.sent]
    assert kinds.count(ADVERTISE) == 6 and kinds.count(SHARE) == 6 and kinds.count(UNMASK) == 12


def test_dropouts_up_to_n_minus_t_at_train_and_unmask_still_give_a_round(
    tmp_path: Path, six_parts: dict[str, Path]
) -> None:
    contexts = _contexts(six_parts)
    ids = list(contexts)
    # t = 4 of 6: one node silent at the masked-input stage, one failing at the unmask stage.
    grid = LoopbackGrid(contexts, fault_stages=("train", UNMASK))
    grid.faults = {ids[0]: silent}
    original = grid.send_and_receive

    def send_and_receive(messages: list[Message], *, timeout: float | None = None) -> list[Message]:
        # Node 1 answers the train message honestly and fails only at the unmask stage.
        grid.faults = {ids[1]: error_reply} if messages[0].metadata.message_type == UNMASK else {ids[0]: silent}
        return list(original(messages, timeout=timeout))

    grid.send_and_receive = send_and_receive  # type: ignore[method-assign]
    federation, repo = _federation(tmp_path, grid, **{**SECURE, "num-rounds": 1})
    run = repo.get_run(federation.run())
    [rnd] = run.rounds
    assert rnd.status == RoundStatus.COMPLETED
    assert sorted(rnd.participants) == ids[1:]  # node 1 sent its masked input; its unmask reply is not needed
    stages = {f.node_id: f.stage for f in rnd.failures}
    assert stages == {ids[0]: "train", ids[1]: "secagg-unmask"}


def test_too_many_dropouts_fail_the_round_cleanly_and_the_next_round_completes(
    tmp_path: Path, six_parts: dict[str, Path]
) -> None:
    contexts = _contexts(six_parts)
    ids = list(contexts)
    grid = LoopbackGrid(contexts)
    sent_rounds: list[int] = []
    original = grid.send_and_receive

    def send_and_receive(messages: list[Message], *, timeout: float | None = None) -> list[Message]:
        replies = list(original(messages, timeout=timeout))
        if messages and messages[0].metadata.message_type == "train":
            sent_rounds.append(len(messages))
            if len(sent_rounds) == 1:  # round 1: n − t + 1 = 3 of 6 masked inputs never arrive
                replies = [r for r in replies if r.metadata.src_node_id not in ids[:3]]
        return replies

    grid.send_and_receive = send_and_receive  # type: ignore[method-assign]
    federation, repo = _federation(tmp_path, grid, **{**SECURE, "num-rounds": 2})
    run = repo.get_run(federation.run())

    first, second = run.rounds
    assert first.status == RoundStatus.FAILED and "quorum" in (first.error or "")
    assert second.status == RoundStatus.COMPLETED and len(second.participants) == 6
    assert [v.round for v in repo.list_model_versions(run_id=run.id)] == [2]
    # Round 1 never asked anyone to unmask; round 2 asked its 6 survivors.
    assert [m.metadata.message_type for m in grid.sent].count(UNMASK) == 6
