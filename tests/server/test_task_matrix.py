"""Every strategy × secure mode × task through the federation loop and the real ClientApp handlers.

For {FedAvg, FedProx, IFCA, FedPer, Ditto} × {image, tabular, text}: the plaintext run's first
aggregate is checked against a plain numpy weighted mean of the nodes' replies (IFCA: per cluster, by
the other tests of this suite), and the masking and CKKS runs of the same configuration against the
plaintext run (same seeds, repeatable training): only the fixed-point / CKKS error may differ. The
tabular task's first round is its statistics round, checked against the departments' own files
(which have gaps: empty cells in columns the schema marks ``"missing": true``).
FedAvg on each task runs in the default suite; the rest of the matrix is ``-m slow``.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Message

from quorumfl.core.data import prepare_partitions, read_partition
from quorumfl.core.data.departments import import_partition
from quorumfl.core.models import arrays_to_model
from quorumfl.core.tasks import ModelSpec, get_task
from quorumfl.protocol.wire import ARRAYS, METRICS, from_array_record
from quorumfl.server.model_store import ModelStore
from quorumfl.server.state.repository import RunStatus
from tests.core.city_data import (
    TOPICS,
    ZONES,
    property_rows,
    request_rows,
    write_csv,
    write_digit_folder,
    write_jsonl,
)

from .test_rounds import (
    REPRODUCIBLE,
    LoopbackGrid,
    _contexts,
    _federation,
    task_identity,  # noqa: F401  (an autouse fixture)
)

DEPARTMENTS = ["tax-office", "urban-planning", "public-works", "housing", "transport", "libraries"]
STRATEGIES: dict[str, dict[str, Any]] = {
    "fedavg": {},
    "fedprox": {"strategy": "fedprox", "proximal-mu": 0.1},
    "ifca": {"strategy": "ifca", "clusters": 2, "secagg-min-group": 2},
    "fedper": {"strategy": "fedper", "personal-layers": "head"},
    "ditto": {"strategy": "ditto", "ditto-lambda": 0.1},
}
MODES: dict[str, dict[str, Any]] = {
    "masking": {"secure-aggregation": "masking", "secagg-threshold": 0.6},
    "ckks": {"secure-aggregation": "ckks", "secagg-threshold": 0.6},
}
# round 1 exact up to the encoding error; round 2 trains on top of that error, which grows it
TOLERANCE = {"masking": (1e-5, 1e-3), "ckks": (1e-6, 1e-3)}


RARE_ZONE = "harbour"  # hashes to a bucket of its own among the four zones' (16 buckets)


def city_partitions(root: Path, task: str) -> tuple[dict[str, Path], dict[str, Any]]:
    """Six departments' partitions of a task and the run settings (task, schema file, model)."""
    if task == "image":
        return prepare_partitions(root / "image", DEPARTMENTS, seed=1, method="dirichlet", alpha=0.5), {}
    root.mkdir(parents=True, exist_ok=True)
    if task == "tabular":
        tables = [property_rows(120, seed=i, zone_bias=ZONES[i % len(ZONES)]) for i in range(len(DEPARTMENTS))]
        for row in tables[1][:3]:  # a zone that 3 of the federation's 720 sales have: under min_share, pooled
            row["zone"] = RARE_ZONE
        tables[0][5]["area"] = tables[0][6]["zone"] = tables[2][7]["area"] = tables[2][9]["zone"] = ""  # gaps
        files = [write_csv(root / f"{d}.csv", rows) for d, rows in zip(DEPARTMENTS, tables, strict=True)]
        schema = get_task("tabular").infer_schema(files[0], {"label": "sale_price", "ignore": "parcel,band"})
        model = "mlp"
    else:
        topics = list(TOPICS)
        files = [write_jsonl(root / f"{d}.jsonl", request_rows(120, seed=i, topic_bias=topics[i % len(topics)]))
                 for i, d in enumerate(DEPARTMENTS)]
        schema = get_task("text").infer_schema(files[0], {"text": "request", "label": "office", "buckets": "1024",
                                                          "dim": "16"})
        model = "fasttext"
    schema_file = root / "schema.json"
    schema_file.write_text(json.dumps(schema))
    parts = {}
    for department, file in zip(DEPARTMENTS, files, strict=True):
        parts[department] = root / "parts" / department
        import_partition(file, parts[department], department=department, schema=schema)
    return parts, {"task": task, "task-schema": str(schema_file), "model": model}


@pytest.fixture(scope="module", params=["image", "tabular", "text"])
def city(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Path], dict[str, Any]]:
    task = str(request.param)
    parts, settings = city_partitions(tmp_path_factory.mktemp(task), task)
    return task, parts, settings


def _models(repo: Any, run_id: int) -> dict[tuple[int, int], dict[str, np.ndarray]]:
    """Stored models by (round, cluster)."""
    return {(v.round, int(v.metrics.get("cluster", 0))): ModelStore.load(v.path, v.sha256)
            for v in repo.list_model_versions(run_id=run_id)}


def _round_one_train_replies(grid: LoopbackGrid) -> list[Message]:
    replies = [r for r in grid.replies if not r.has_error() and ARRAYS in r.content.array_records
               and METRICS in r.content.metric_records and "train-loss" in r.content.metric_records[METRICS]]
    return replies[: len(grid.nodes)]


def _check_weighted_mean(stored: dict[str, np.ndarray], replies: list[Message]) -> None:
    weights = np.array([r.content.metric_records[METRICS]["num-examples"] for r in replies], dtype=np.float64)
    for key, value in stored.items():
        stack = np.stack([from_array_record(r.content.array_records[ARRAYS])[key] for r in replies]).astype(np.float64)
        np.testing.assert_allclose(value, np.tensordot(weights / weights.sum(), stack, axes=1), rtol=1e-5, atol=1e-6)


def _check_statistics(stored: dict[str, np.ndarray], parts: dict[str, Path], settings: dict[str, Any]) -> None:
    """The statistics round: the model's Standardize layer holds the federation's example-weighted mean
    and second moment, computed here from the departments' files with numpy; the category slots the
    model reads are those whose share of the federation's records reaches the column's min_share (the
    rare zone's is not, though one department holds it)."""
    xs = [read_partition(p).train.x.astype(np.float64) for p in parts.values()]
    everything = np.concatenate(xs)
    np.testing.assert_allclose(stored["0.mean"], everything.mean(axis=0), rtol=0, atol=1e-6)
    np.testing.assert_allclose(stored["0.sq_mean"], (everything**2).mean(axis=0), rtol=0, atol=1e-6)
    assert float(stored["0.ready"][0]) == pytest.approx(1.0)
    schema = json.loads(Path(settings["task-schema"]).read_text())
    model = ModelSpec("tabular", "mlp", json.dumps(schema)).build(seed=0)
    arrays_to_model(model, stored)
    (zone,) = schema["categorical"]
    assert [c.get("missing", False) for c in schema["numeric"]] == [True, False] and zone["missing"]
    numeric = len(schema["numeric"]) + 1  # the area column's indicator comes before the zone's buckets
    share = everything[:, numeric : numeric + zone["buckets"]].mean(axis=0)
    kept = model[0].kept().numpy()[numeric : numeric + zone["buckets"]]
    np.testing.assert_array_equal(kept, share >= zone["min_share"])
    rare = zlib.crc32(f"zone\x1f{RARE_ZONE}".encode()) % zone["buckets"]
    assert 0 < share[rare] < zone["min_share"] and not kept[rare]


def _check_no_statistics(models: dict[tuple[int, int], dict[str, np.ndarray]]) -> None:
    """A DP run has no statistics round: raw-data means are not covered by ε, so every round trained
    (each charged ε) and no model carries departments' feature statistics."""
    for arrays in models.values():
        if "0.ready" in arrays:  # the tabular model's Standardize layer
            assert float(arrays["0.ready"][0]) == 0.0
            assert not np.any(arrays["0.mean"]) and np.all(arrays["0.sq_mean"] == 1.0)


def _matrix(strategy: str, city: tuple[str, dict[str, Path], dict[str, Any]], tmp_path: Path) -> None:
    task, parts, settings = city
    overrides = {**settings, **STRATEGIES[strategy]}
    grid = LoopbackGrid(_contexts(parts, {**REPRODUCIBLE, "state-dir": str(tmp_path / "plain")}))
    plain_fed, repo = _federation(tmp_path, grid, **overrides)
    plain_run = plain_fed.run()
    assert repo.get_run(plain_run).status == RunStatus.COMPLETED
    plain = _models(repo, plain_run)
    if strategy != "ifca":
        _check_weighted_mean(plain[(1, 0)], _round_one_train_replies(grid))
    if task == "tabular" and strategy not in ("fedper", "ifca"):  # IFCA: per cluster (and repaired clusters)
        _check_statistics(plain[(1, 0)], parts, settings)
    primary = get_task(task).objective(json.loads(Path(settings["task-schema"]).read_text())).primary \
        if settings else "accuracy"
    finals = [m for m in repo.metrics(plain_run) if m.name == f"final-{primary}" and m.node_id is not None]
    assert len(finals) == len(parts) and all(np.isfinite(m.value) for m in finals)

    for mode, extra in MODES.items():
        state = tmp_path / mode
        contexts = _contexts(parts, {**REPRODUCIBLE, "state-dir": str(state)})
        if strategy == "ifca":  # a node reveals a group below t only when the admin-signed run config allows it
            for context in contexts.values():
                context.run_config["secagg-min-group"] = 2
        grid = LoopbackGrid(contexts)
        fed, repo = _federation(tmp_path, grid, **overrides, **extra)
        run_id = fed.run()
        assert repo.get_run(run_id).status == RunStatus.COMPLETED, mode
        assert all(ARRAYS not in r.content.array_records for r in grid.replies if not r.has_error()
                   and "train-loss" in r.content.metric_records.get(METRICS, {}))
        secure = _models(repo, run_id)
        assert set(secure) == set(plain), f"{mode}: other rounds/clusters than the plaintext run"
        compared = 0
        for (number, cluster), arrays in secure.items():
            if strategy == "ifca" and not _same_group(repo, plain_run, run_id, number, cluster):
                continue  # a cluster below the group minimum sat out the secure round (checked in _same_group)
            compared += 1
            tolerance = TOLERANCE[mode][min(number, 2) - 1]
            for key, value in arrays.items():
                np.testing.assert_allclose(value, plain[(number, cluster)][key], rtol=0, atol=tolerance,
                                           err_msg=f"{task} {strategy} {mode} round {number} cluster {cluster} {key}")
        assert compared >= 2 and any(number == 1 for number, _ in secure)
        if strategy != "ifca":  # the round's federated metric, revealed as a secure weighted mean
            _check_federated_metric(repo, plain_run, run_id, primary, mode)


def _check_federated_metric(repo: Any, plain_run: int, run_id: int, primary: str, mode: str) -> None:
    """Round 1 evaluates the same initial model in both runs: the secure sum's weighted mean of the
    departments' figures equals the plaintext run's (nodes reported them in the clear there)."""
    def first(run: int) -> dict[str, float]:
        return {m.name: m.value for m in repo.metrics(run) if m.round == 1 and m.node_id is None}

    plain, secure = first(plain_run), first(run_id)
    for name in (f"federated-{primary}", "federated-loss"):
        assert name in secure, f"{mode}: round 1 has no {name}"
        assert secure[name] == pytest.approx(plain[name], rel=1e-4, abs=1e-6), f"{mode} {name}"


def _same_group(repo: Any, plain_run: int, run_id: int, number: int, cluster: int) -> bool:
    """Whether IFCA's cluster had the same members in both runs up to this round. Where it did not, the
    plaintext run had a cluster smaller than the group minimum (2), which the secure run refused to
    reveal: its node is recorded as left out ('secagg-group')."""
    def members(run: int) -> dict[int, dict[int, set[int]]]:
        out: dict[int, dict[int, set[int]]] = {}
        for m in repo.metrics(run, name="cluster"):
            if m.node_id is not None and m.round <= number:
                out.setdefault(m.round, {}).setdefault(int(m.value), set()).add(m.node_id)
        return out

    plain, secure = members(plain_run), members(run_id)
    if plain == secure:
        return True
    small = {n for groups in plain.values() for nodes in groups.values() if len(nodes) < 2 for n in nodes}
    left_out = {f.node_id for r in repo.get_run(run_id).rounds for f in r.failures if f.stage in ("secagg-group", "ckks-decrypt")}
    assert small and small <= left_out, f"cluster membership differs without a refused small group: {plain} {secure}"
    return False


def test_fedavg_on_every_task_in_every_mode(city: tuple[str, dict[str, Path], dict[str, Any]], tmp_path: Path) -> None:
    _matrix("fedavg", city, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fedprox", "ifca", "fedper", "ditto"])
def test_every_strategy_on_every_task_in_every_mode(
    strategy: str, city: tuple[str, dict[str, Path], dict[str, Any]], tmp_path: Path
) -> None:
    _matrix(strategy, city, tmp_path)


def _run(tmp_path: Path, name: str, parts: dict[str, Path], **overrides: Any) -> tuple[Any, int]:
    contexts = _contexts(parts, {**REPRODUCIBLE, "state-dir": str(tmp_path / name), "dp-budget": 200.0})
    for context in contexts.values():  # each run its own entries in the departments' privacy ledgers
        context.run_config["node-state-key"] = str(abs(hash((str(tmp_path), name))) % 10**9)
    grid = LoopbackGrid(contexts)
    fed, repo = _federation(tmp_path, grid, **overrides)
    run_id = fed.run()
    assert repo.get_run(run_id).status == RunStatus.COMPLETED, (name, repo.get_run(run_id).error)
    return repo, run_id


@pytest.mark.slow
def test_dp_compression_and_rl_selection_on_every_task(
    city: tuple[str, dict[str, Path], dict[str, Any]], tmp_path: Path
) -> None:
    """DP-SGD (Opacus) and distributed DP charge each department's ledger; random-k compression under
    masking equals the same compression in plaintext (every node sends the same coordinates); the RL
    selector picks nodes and local epochs and learns from the task's figures."""
    _, parts, settings = city
    repo, run_id = _run(tmp_path, "dp-local", parts, **settings, **{"dp": "local", "dp-noise-multiplier": 1.0, "dp-epsilon": 0.0,
                                                                    "dp-clip": 1.0})
    spent = [m.value for m in repo.metrics(run_id, name="dp-epsilon") if m.node_id is not None]
    assert len(spent) == 2 * len(parts) and all(0 < e < 100 for e in spent)
    _check_no_statistics(_models(repo, run_id))
    repo, run_id = _run(tmp_path, "dp-distributed", parts, **settings, **MODES["masking"],
                        **{"dp": "distributed", "dp-noise-multiplier": 1.0, "dp-epsilon": 0.0, "dp-clip": 1.0})
    assert all(np.all(np.isfinite(v)) for m in _models(repo, run_id).values() for v in m.values())
    _check_no_statistics(_models(repo, run_id))

    compressed = {"compression": "randk", "compression-fraction": 0.2}
    repo, plain_run = _run(tmp_path, "randk-plain", parts, **settings, **compressed)
    plain = _models(repo, plain_run)
    repo, masked_run = _run(tmp_path, "randk-masked", parts, **settings, **compressed, **MODES["masking"])
    for (number, cluster), arrays in _models(repo, masked_run).items():
        for key, value in arrays.items():
            np.testing.assert_allclose(value, plain[(number, cluster)][key], rtol=0,
                                       atol=TOLERANCE["masking"][min(number, 2) - 1])

    repo, run_id = _run(tmp_path, "rl", parts, **settings, **{"selector": "rl", "selection-epochs": "1,2",
                                                               "fraction-train": 0.5, "num-rounds": 3})
    rounds = repo.get_run(run_id).rounds
    assert all(len(r.participants) >= 2 for r in rounds)
    records = repo.selections(run_id)
    assert len(records) == 3 and all(r.reward is not None and np.isfinite(r.reward) for r in records)


def test_departments_own_image_folders_in_every_mode(tmp_path: Path) -> None:
    """Scanned forms as PNG folders (scikit-learn's digits written as images), imported by each
    department under a proposed ``folder`` schema: the server holds no test set of them."""
    from quorumfl.core.data import propose_schema

    write_digit_folder(tmp_path / "sample", range(100))
    schema = propose_schema(tmp_path / "sample", "image", {})
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    parts = {}
    for i, department in enumerate(DEPARTMENTS[:4]):
        write_digit_folder(tmp_path / "forms" / department, range(100 + 150 * i, 250 + 150 * i))
        parts[department] = tmp_path / "parts" / department
        import_partition(tmp_path / "forms" / department, parts[department], department=department, schema=schema)
    settings = {"task": "image", "task-schema": str(tmp_path / "schema.json"), "model": "mlp"}
    _matrix("fedavg", ("image", parts, settings), tmp_path / "runs")
