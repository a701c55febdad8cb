"""DP-SGD rounds through the federation loop and the real ClientApp handlers (in-process Grid):
each department's ledger is charged what Opacus accounts, a department over its budget refuses and
the server records the refusal, and ``quorumfl node budget`` reads the ledger back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from flwr.app import Context, RecordDict

from quorumfl.core.data import prepare_partitions
from quorumfl.errors import ConfigError
from quorumfl.privacy.accounting import epsilon
from quorumfl.privacy.ledger import Ledger
from quorumfl.server.config import RunConfig
from quorumfl.server.department_record import department_record
from quorumfl.server.report import report_data
from quorumfl.server.state.repository import RunStatus

from .test_rounds import LoopbackGrid, _federation, task_identity  # noqa: F401  (an autouse fixture)

DP = {"num-rounds": 2, "dp": "local", "dp-epsilon": 3.0, "strategy": "fedavg", "min-nodes": 2}


def _contexts(tmp_path: Path, budgets: dict[str, float]) -> dict[int, Context]:
    parts = prepare_partitions(tmp_path / "data", list(budgets), seed=0, method="iid")
    return {
        1000 + i: Context(run_id=99, node_id=1000 + i,
                          node_config={"data-path": str(p), "department": name, "dp-budget": budgets[name]},
                          state=RecordDict(), run_config={})
        for i, (name, p) in enumerate(parts.items())
    }


def test_dp_rounds_charge_the_ledgers_and_a_node_over_budget_refuses(tmp_path: Path) -> None:
    contexts = _contexts(tmp_path, {"tax-office": 10.0, "urban-planning": 10.0, "housing": 0.5})
    grid = LoopbackGrid(contexts)
    federation, repo = _federation(tmp_path, grid, **DP)
    run_id = federation.run()

    run = repo.get_run(run_id)
    assert run.status == RunStatus.COMPLETED
    housing = 1002
    for rnd in run.rounds:
        assert sorted(rnd.participants) == [1000, 1001]
        failures = {f.node_id: (f.stage, f.reason) for f in rnd.failures}
        assert failures[housing][0] == "dp-budget" and "over its budget of 0.5" in failures[housing][1]

    # The two departments that trained: their ledger holds both rounds, and its ε is Opacus' for that schedule.
    for node in (1000, 1001):
        ledger = Ledger.open(Path(str(contexts[node].node_config["data-path"])))
        spends = ledger.spends()
        assert [(s.run, s.round) for s in spends] == [("99", 1), ("99", 2)]
        schedule = [(s.noise_multiplier, s.sample_rate, s.steps) for s in spends]
        assert ledger.spent(1e-5) == pytest.approx(epsilon(schedule, 1e-5))
        assert 2.9 < ledger.spent(1e-5) <= 3.0 * 1.001  # the run's target, spread over its 2 rounds
        reported = {m.round: m.value for m in repo.metrics(run_id, name="dp-epsilon") if m.node_id == node}
        assert reported[2] == pytest.approx(spends[-1].epsilon_total)
    refused = Ledger.open(Path(str(contexts[housing].node_config["data-path"])))
    assert refused.spends() == [] and [r.round for r in refused.refusals()] == [1, 2]

    # The run report and the department records show each ledger's ε against its budget.
    privacy = {p["department"]: p for p in report_data(repo, run_id)["privacy"]}
    record = department_record(repo, "tax-office")
    tax = Ledger.open(Path(str(contexts[1000].node_config["data-path"]))).spends()[-1].epsilon_total
    assert privacy["tax-office"]["epsilon"] == pytest.approx(tax) == record["epsilon_spent"]
    assert privacy["tax-office"]["budget"] == 10.0 == record["budget"]
    assert "housing" not in privacy
    housing_rounds = department_record(repo, str(housing))["runs"][0]["rounds"]  # named only once it trains
    assert [(r["took_part"], [f["state"] for f in r["failures"]]) for r in housing_rounds] == [(False, ["refused"])] * 2

    # The admin's view of one department's ledger.
    out = subprocess.run([sys.executable, "-m", "quorumfl.cli", "node", "budget", "--data",
                          str(contexts[1000].node_config["data-path"]), "--budget", "10", "--format", "json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    view = json.loads(out.stdout)
    assert view["runs"] == [{"run": "99", "rounds": 2, "epsilon": pytest.approx(view["total"])}]
    assert view["left"] == pytest.approx(10 - view["total"])


def test_a_node_that_requires_dp_refuses_a_plain_run(tmp_path: Path) -> None:
    contexts = _contexts(tmp_path, {"tax-office": 10.0, "urban-planning": 10.0, "housing": 10.0})
    contexts[1002].node_config["require-dp"] = True
    grid = LoopbackGrid(contexts)
    federation, repo = _federation(tmp_path, grid, **{"num-rounds": 1, "min-nodes": 2})
    run = repo.get_run(federation.run())
    failures = {f.node_id: (f.stage, f.reason) for f in run.rounds[0].failures}
    assert failures[1002][0] == "dp-budget" and "only with differential privacy" in failures[1002][1]


def test_dp_config_needs_one_noise_source() -> None:
    with pytest.raises(ConfigError, match="exactly one of dp-epsilon"):
        RunConfig.from_mapping({"dp": "local", "dp-epsilon": 0.0})
    with pytest.raises(ConfigError, match="exactly one of dp-epsilon"):
        RunConfig.from_mapping({"dp": "local", "dp-noise-multiplier": 1.0})
