"""IFCA, FedPer and Ditto through the federation loop and the real ClientApp handlers (in-process Grid).

References: per-cluster aggregation is compared with a numpy weighted mean of each cluster's
replies; IFCA with masking with the same run in plaintext; FedPer's personal layers are looked for in
every message in both directions.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flwr.app import Context, RecordDict

from quorumfl.aggregation.personal import personal_names
from quorumfl.aggregation.secagg import HEADER
from quorumfl.client.personal_store import PersonalStore
from quorumfl.core.data import prepare_partitions
from quorumfl.core.data.planted import plant_partitions
from quorumfl.core.models import build_model, model_to_arrays
from quorumfl.protocol.secure_wire import MASKED
from quorumfl.protocol.wire import ARRAYS, METRICS, from_array_record
from quorumfl.server.model_store import ModelStore
from quorumfl.server.modes import IFCA_PICK
from quorumfl.server.state.repository import RoundStatus, RunStatus

from .test_rounds import (
    REPRODUCIBLE,
    LoopbackGrid,
    _federation,
    task_identity,  # noqa: F401  (an autouse fixture)
)

IFCA = {"strategy": "ifca", "clusters": 2, "proximal-mu": 0.0, "local-epochs": 5}


def _contexts(parts: dict[str, Path], state: Path, run_config: dict[str, int] | None = None) -> dict[int, Context]:
    """Nodes that train repeatably (``REPRODUCIBLE``): the tests compare masked with plaintext runs.
    ``run_config``: what Flower hands the nodes of the run config (the admin-signed one)."""
    return {
        1000 + i: Context(run_id=99, node_id=1000 + i,
                          node_config={"data-path": str(p), "department": name, "state-dir": str(state / name),
                                       **REPRODUCIBLE},
                          state=RecordDict(), run_config=dict(run_config or {}))
        for i, (name, p) in enumerate(parts.items())
    }


@pytest.fixture
def planted(tmp_path: Path) -> tuple[dict[str, Path], dict[str, int]]:
    """Six departments (IID digits) in two planted groups: labels permuted per group."""
    names = ["tax-office", "urban-planning", "public-works", "housing", "transport", "libraries"]
    parts = prepare_partitions(tmp_path / "planted", names, seed=1, method="iid")
    return parts, plant_partitions(parts, 2, seed=3)


def _versions(repo: object, run_id: int, number: int) -> dict[int, dict[str, np.ndarray]]:
    versions = [v for v in repo.list_model_versions(run_id=run_id) if v.round == number]  # type: ignore[attr-defined]
    return {int(v.metrics["cluster"]): ModelStore.load(v.path, v.sha256) for v in versions}


def _assert_same_clusters_and_models(repo: object, plain_run: int, run_id: int,
                                     tolerances: tuple[tuple[int, float], ...]) -> None:
    """Per round: every cluster model within ``tolerance`` of the plaintext run's, and the same picks."""
    for number, tolerance in tolerances:
        reference = _versions(repo, plain_run, number)
        for cluster, arrays in _versions(repo, run_id, number).items():
            for key, value in arrays.items():
                np.testing.assert_allclose(value, reference[cluster][key], rtol=0, atol=tolerance)
        picks = [sorted((m.node_id, m.value) for m in repo.metrics(r, name="cluster") if m.round == number)  # type: ignore[attr-defined]
                 for r in (plain_run, run_id)]
        assert picks[0] == picks[1]


def test_ifca_averages_each_cluster_over_its_own_nodes(tmp_path: Path, planted: tuple[dict[str, Path], dict[str, int]]) -> None:
    parts, groups = planted
    contexts = _contexts(parts, tmp_path / "state")
    grid = LoopbackGrid(contexts)
    federation, repo = _federation(tmp_path, grid, **IFCA, **{"num-rounds": 4})

    run_id = federation.run()

    assert repo.get_run(run_id).status == RunStatus.COMPLETED
    # The last round: each cluster model is the example-weighted numpy mean of the replies that named it.
    train_replies = [r for r in grid.replies if ARRAYS in r.content.array_records]
    last = train_replies[-len(contexts):]
    by_cluster: dict[int, list] = {}
    for reply in last:
        cluster = int(reply.content.metric_records[METRICS]["cluster"])
        by_cluster.setdefault(cluster, []).append(reply)
    stored = _versions(repo, run_id, 4)
    assert sorted(stored) == [0, 1]
    rounds = repo.get_run(run_id).rounds
    for cluster, replies in by_cluster.items():
        weights = np.array([r.content.metric_records[METRICS]["num-examples"] for r in replies], dtype=np.float64)
        for key, value in stored[cluster].items():
            stack = np.stack([from_array_record(r.content.array_records[ARRAYS])[key] for r in replies]).astype(np.float64)
            np.testing.assert_allclose(value, np.tensordot(weights / weights.sum(), stack, axes=1), rtol=1e-5, atol=1e-6)
    # Assignments are stored per round and per node; by round 4 they follow the planted groups.
    assignment = {m.node_id: int(m.value) for m in repo.metrics(run_id, name="cluster") if m.round == 4}
    names = {n.node_id: n.department for n in repo.list_nodes()}
    assert len(assignment) == 6 and rounds[-1].status == RoundStatus.COMPLETED
    pairs = {(groups[str(names[n])], c) for n, c in assignment.items()}
    assert len(pairs) == 2 and len({g for g, _ in pairs}) == 2, f"clusters {pairs} do not follow the planted groups"


def test_ifca_with_masking_equals_plaintext_ifca(tmp_path: Path, planted: tuple[dict[str, Path], dict[str, int]]) -> None:
    parts, _ = planted
    plain, repo = _federation(tmp_path, LoopbackGrid(_contexts(parts, tmp_path / "plain")), **IFCA)
    plain_run = plain.run()

    grid = LoopbackGrid(_contexts(parts, tmp_path / "masked"))
    masked, repo = _federation(tmp_path, grid, **IFCA, **{"secure-aggregation": "masking", "secagg-min-group": 2})
    run_id = masked.run()

    assert repo.get_run(run_id).status == RunStatus.COMPLETED
    # Round 1: the masked per-cluster means equal the plaintext ones up to the fixed-point error.
    # Round 2 trains five epochs on top of that error, which grows it, so only a looser match holds.
    # The fixed-point rounding is stochastic (the node's own entropy, fixedpoint.encode), so round 1's
    # error and what five epochs make of it vary from run to run: one CI run saw 2.1e-3 on one of 64
    # values where the bound was 1e-3.
    _assert_same_clusters_and_models(repo, plain_run, run_id, ((1, 1e-5), (2, 5e-3)))
    # The server saw cluster choices and masked vectors, never a plaintext update.
    kinds = [m.metadata.message_type for m in grid.sent]
    assert kinds.count(IFCA_PICK) == 12
    train = [r for r in grid.replies if not r.has_error() and MASKED in r.content.array_records]
    assert len(train) == 12 and all(ARRAYS not in r.content.array_records for r in grid.replies if not r.has_error())


def test_ifca_with_ckks_equals_plaintext_ifca(tmp_path: Path, planted: tuple[dict[str, Path], dict[str, int]]) -> None:
    """Each cluster is one CKKS group: encrypted, summed and decrypted on its own (t = 4 of 6 holders
    decrypt; a cluster of 3 is revealed because the signed run config's secagg-min-group is 3)."""
    parts, _ = planted
    plain, repo = _federation(tmp_path, LoopbackGrid(_contexts(parts, tmp_path / "plain")), **IFCA)
    plain_run = plain.run()

    grid = LoopbackGrid(_contexts(parts, tmp_path / "ckks", {"secagg-min-group": 3}))
    ckks = {"secure-aggregation": "ckks", "secagg-threshold": 0.6, "secagg-min-group": 3}
    encrypted, repo = _federation(tmp_path, grid, **IFCA, **ckks)
    run_id = encrypted.run()

    assert repo.get_run(run_id).status == RunStatus.COMPLETED, repo.get_run(run_id).error
    # Round 1: each cluster's decrypted mean equals the plaintext one up to the CKKS error (~1e-8);
    # round 2 trains five epochs on top of it.
    _assert_same_clusters_and_models(repo, plain_run, run_id, ((1, 1e-6), (2, 1e-3)))
    # One decryption per cluster and round, of exactly that cluster's nodes, by t = 4 key holders.
    decryptions = repo.decryptions(run_id)
    split = 0
    for number in (1, 2):
        picks = {m.node_id: int(m.value) for m in repo.metrics(run_id, name="cluster") if m.round == number}
        clusters = sorted(sorted(n for n, c in picks.items() if c == k) for k in set(picks.values()))
        assert sorted(sorted(d.contributors) for n, d in decryptions if n == number) == clusters
        assert all(len(d.decryptors) == 4 and d.status == "complete" for n, d in decryptions if n == number)
        split += len(clusters) == 2
    assert split  # (round 2 here: every node of the first round picked one model, then they split 3 / 3)
    # The server saw cluster choices and ciphertexts, never a plaintext update.
    assert [m.metadata.message_type for m in grid.sent].count(IFCA_PICK) == 12
    assert all(ARRAYS not in r.content.array_records for r in grid.replies if not r.has_error())


def test_ifca_with_ckks_leaves_out_a_cluster_below_the_group_minimum(
    tmp_path: Path, planted: tuple[dict[str, Path], dict[str, int]]
) -> None:
    """Without a group minimum below t (4 of 6), a cluster of 3 is never decrypted: it sits the round out
    (same data and seeds as above: round 1 is one cluster of 6, round 2 two of 3)."""
    parts, _ = planted
    grid = LoopbackGrid(_contexts(parts, tmp_path / "ckks"))
    encrypted, repo = _federation(tmp_path, grid, **IFCA, **{"secure-aggregation": "ckks", "secagg-threshold": 0.6,
                                                             "num-rounds": 2})
    run_id = encrypted.run()

    first, second = repo.get_run(run_id).rounds
    assert first.status == RoundStatus.COMPLETED and second.status == RoundStatus.FAILED
    assert {f.stage for f in second.failures} == {"secagg-group"} and len(second.failures) == 6
    assert "below the group minimum 4" in second.failures[0].reason
    assert [(n, len(d.contributors)) for n, d in repo.decryptions(run_id)] == [(1, 6)]  # nothing of round 2


def test_fedper_personal_layers_never_leave_the_node(tmp_path: Path, six_parts: dict[str, Path]) -> None:
    grid = LoopbackGrid(_contexts(six_parts, tmp_path / "state"))
    federation, repo = _federation(tmp_path, grid, strategy="fedper", **{"personal-layers": "head"})

    run_id = federation.run()

    assert repo.get_run(run_id).status == RunStatus.COMPLETED
    full = model_to_arrays(build_model("mlp", (1, 8, 8), 10))
    personal = personal_names(list(full), "head")
    assert personal == {"5.weight", "5.bias"}
    for message in [*grid.sent, *grid.replies]:
        for record in message.content.array_records.values():
            assert not set(record) & personal, f"{message.metadata.message_type} carried a personal layer"
    # Each department kept its own head, trained, on its own disk; the server's versions have none.
    heads = [PersonalStore(tmp_path / "state" / name).load("99") for name in six_parts]
    assert all(h is not None and set(h) == personal for h in heads)
    assert not np.allclose(heads[0]["5.weight"], heads[1]["5.weight"])
    version = repo.list_model_versions(run_id=run_id)[-1]
    assert not set(ModelStore.load(version.path, version.sha256)) & personal
    finals = {m.name for m in repo.metrics(run_id) if m.node_id is not None}
    assert {"final-accuracy", "final-personal-accuracy"} <= finals


def test_fedper_with_masking_sends_only_shared_layers(tmp_path: Path, six_parts: dict[str, Path]) -> None:
    grid = LoopbackGrid(_contexts(six_parts, tmp_path / "state"))
    federation, repo = _federation(tmp_path, grid, strategy="fedper", **{"secure-aggregation": "masking",
                                                                          "num-rounds": 1})
    run_id = federation.run()

    assert repo.get_run(run_id).status == RunStatus.COMPLETED
    full = model_to_arrays(build_model("mlp", (1, 8, 8), 10))
    shared_size = sum(v.size for k, v in full.items() if not k.startswith("5."))
    masked = [r.content.array_records[MASKED] for r in grid.replies if not r.has_error() and MASKED in r.content.array_records]
    assert masked and all(sum(a.numpy().size for a in rec.values()) == HEADER + shared_size for rec in masked)


def test_ditto_keeps_a_personal_model_and_reports_both_accuracies(tmp_path: Path, six_parts: dict[str, Path]) -> None:
    grid = LoopbackGrid(_contexts(six_parts, tmp_path / "state"))
    federation, repo = _federation(tmp_path, grid, strategy="ditto", **{"ditto-lambda": 0.1, "num-rounds": 2})

    run_id = federation.run()

    assert repo.get_run(run_id).status == RunStatus.COMPLETED
    final = {}
    for m in repo.metrics(run_id):
        if m.node_id is not None and m.name in ("final-accuracy", "final-personal-accuracy"):
            final.setdefault(m.node_id, {})[m.name] = m.value
    assert len(final) == 6 and all(len(v) == 2 for v in final.values())
    # On label-skewed departments the personal models fit their own test splits better on average.
    assert np.mean([v["final-personal-accuracy"] for v in final.values()]) > np.mean([v["final-accuracy"] for v in final.values()])
    stored = PersonalStore(tmp_path / "state" / next(iter(six_parts))).load("99")
    assert stored is not None and set(stored) == set(model_to_arrays(build_model("mlp", (1, 8, 8), 10)))


def test_fedper_with_ckks_encrypts_only_shared_layers(tmp_path: Path, six_parts: dict[str, Path]) -> None:
    grid = LoopbackGrid(_contexts(six_parts, tmp_path / "state"))
    federation, repo = _federation(tmp_path, grid, strategy="fedper", **{"secure-aggregation": "ckks",
                                                                          "secagg-threshold": 0.6, "num-rounds": 1})
    run_id = federation.run()

    assert repo.get_run(run_id).status == RunStatus.COMPLETED, repo.get_run(run_id).error
    personal = {"5.weight", "5.bias"}
    for message in [*grid.sent, *grid.replies]:
        for record in message.content.array_records.values():
            assert not set(record) & personal
    version = repo.list_model_versions(run_id=run_id)[-1]
    assert not set(ModelStore.load(version.path, version.sha256)) & personal
