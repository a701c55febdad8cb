"""Client selection inside the federation loop (in-process Grid, real ClientApp handlers): the RL
selector with over-selection and a deadline, its records and kept state, a restart that continues
from that state, and the ``quorumfl selection`` commands on the result."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from quorumfl.core.data import prepare_partitions
from quorumfl.server.model_store import ModelStore
from quorumfl.server.state.repository import RoundStatus, RunStatus

from .test_cli import quorumfl
from .test_rounds import (  # noqa: F401 (task_identity: autouse)
    REPRODUCIBLE,
    LoopbackGrid,
    _contexts,
    _federation,
    silent,
    task_identity,
)


@pytest.fixture
def parts(tmp_path: Path) -> dict[str, Path]:
    names = ["tax-office", "urban-planning", "public-works", "housing", "transport", "silent-node"]
    return prepare_partitions(tmp_path / "data", names, seed=0, method="iid")


def test_rl_selection_with_over_selection_deadline_and_restart(tmp_path: Path, parts: dict[str, Path]) -> None:
    contexts = _contexts(parts)
    quiet = max(contexts)  # the silent node never answers a train request
    disabled = min(contexts)
    grid = LoopbackGrid(contexts, {quiet: silent})
    overrides = {"selector": "rl", "selection-epochs": "1,2", "local-epochs": 1, "fraction-train": 0.5,
                 "over-selection": 0.5, "round-deadline": 3.0, "num-rounds": 4, "min-nodes": 1}
    federation, repo = _federation(tmp_path, grid, **overrides)
    repo.touch_node(disabled)
    repo.set_enabled(str(disabled), False)

    run_id = federation.run()

    run = repo.get_run(run_id)
    assert run.status == RunStatus.COMPLETED
    records = repo.selections(run_id)
    assert [r.round for r in records] == [1, 2, 3, 4]
    for rnd, record in zip(run.rounds, records, strict=True):
        chosen = [node for node, _ in record.choices]
        # 5 enabled nodes: K = ceil(0.5 * 5) = 3, asked K + ceil(1.5) = 5; never the disabled node.
        assert len(chosen) == 5 and disabled not in chosen and sorted(chosen) == rnd.selected
        assert all(epochs in (1, 2) for _, epochs in record.choices)
        assert record.policy in ("rl", "oort")
        # The first K replies are aggregated; the rest are late, the silent node missed the deadline.
        assert rnd.status == RoundStatus.COMPLETED and len(rnd.participants) == 3
        stages = {f.node_id: f.stage for f in rnd.failures}
        assert set(stages.values()) <= {"late", "deadline"} and len(stages) == 2
        assert record.outcomes == {str(n): ("ok" if n in rnd.participants else "late") for n in chosen}
    late_rounds = [r for r in run.rounds if quiet in r.selected]
    assert late_rounds and all(next(f.stage for f in r.failures if f.node_id == quiet) in ("late", "deadline")
                               for r in late_rounds)
    state = repo.selector_state("rl:digits:mlp")
    assert state is not None and state.kind == "rl" and state.rounds == 4
    assert state.state["book"]["nodes"][str(quiet)]["late"] == len(late_rounds)

    # A restarted server (a new run under the same key) continues from the kept agent.
    again, _ = _federation(tmp_path, LoopbackGrid(contexts, {quiet: silent}), **{**overrides, "num-rounds": 1})
    again.run()
    assert repo.selector_state("rl:digits:mlp").rounds == 5  # type: ignore[union-attr]
    assert again.feedback.selector.book.rounds == 5

    url = f"sqlite:///{tmp_path / 'state.db'}"
    shown = quorumfl("selection", "show", str(run_id), "--format", "json", db=url)
    assert shown.returncode == 0, shown.stderr
    view = json.loads(shown.stdout)
    assert view["selector"] == "rl" and sum(view["policies"].values()) == 4
    assert sum(row["selected"] for row in view["nodes"]) == 20 and len(view["rounds"]) == 4
    quiet_row = next(row for row in view["nodes"] if row["node_id"] == quiet)
    assert quiet_row["late"] == len(late_rounds) and quiet_row["ok"] == 0
    table = quorumfl("selection", "show", str(run_id), db=url)
    assert table.returncode == 0 and "reward curve" in table.stdout and "silent-node" not in table.stdout
    listed = quorumfl("selection", "list", "--format", "json", db=url)
    assert [row["key"] for row in json.loads(listed.stdout)] == ["rl:digits:mlp"]
    assert quorumfl("selection", "reset", "rl:digits:mlp", db=url).returncode == 0
    missing = quorumfl("selection", "reset", "rl:digits:mlp", db=url)
    assert missing.returncode == 5 and "quorumfl selection list" in missing.stderr


def test_a_key_holding_another_selectors_state_is_refused(tmp_path: Path, parts: dict[str, Path]) -> None:
    contexts = _contexts(parts)
    federation, repo = _federation(tmp_path, LoopbackGrid(contexts), **{"selector": "oort", "num-rounds": 1,
                                                                        "selection-key": "shared"})
    federation.run()
    other, _ = _federation(tmp_path, LoopbackGrid(contexts), **{"selector": "rl", "num-rounds": 1,
                                                                "selection-key": "shared"})
    with pytest.raises(Exception, match="holds a 'oort' selector's state"):
        other.run()
    assert repo.selector_state("shared").kind == "oort"  # type: ignore[union-attr]


def test_over_selection_under_masking_counts_the_cut_nodes_as_dropouts(tmp_path: Path,
                                                                        six_parts: dict[str, Path]) -> None:
    contexts = _contexts(six_parts, REPRODUCIBLE)  # compared below with a plaintext run of the same four
    # K = ceil(0.6 · 6) = 4 aggregated of 4 + ceil(0.5 · 4) = 6 asked; t = ceil(0.6 · 6) = 4.
    secure = {"secure-aggregation": "masking", "secagg-threshold": 0.6, "fraction-train": 0.6,
              "over-selection": 0.5, "num-rounds": 1}
    federation, repo = _federation(tmp_path / "masked", LoopbackGrid(contexts), **secure)
    run = repo.get_run(federation.run())
    [rnd] = run.rounds
    assert rnd.status == RoundStatus.COMPLETED and len(rnd.selected) == 6 and len(rnd.participants) == 4
    assert {f.stage for f in rnd.failures} == {"late"} and len(rnd.failures) == 2
    [masked] = [ModelStore.load(v.path, v.sha256) for v in repo.list_model_versions(run_id=run.id)]

    # Reference: plaintext FedAvg of the same four departments alone.
    kept = {n: c for n, c in contexts.items() if n in rnd.participants}
    plain_fed, plain_repo = _federation(tmp_path / "plain", LoopbackGrid(kept), **{"num-rounds": 1})
    [plain] = [ModelStore.load(v.path, v.sha256) for v in plain_repo.list_model_versions(run_id=plain_fed.run())]
    for key in plain:
        np.testing.assert_allclose(masked[key], plain[key], rtol=0, atol=1e-5)
