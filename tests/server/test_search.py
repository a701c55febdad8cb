"""Federated hyper-parameter search (``server.search``): trials are real federated runs through the
federation loop and the real ClientApp handlers (in-process Grid), masked and with DP-SGD.

The search's privacy plan is attacked as a department would want it checked: the ε the search spends
lands in each department's own ledger, and a search that would pass the budget runs nothing at all.
The search space refuses keys a search must not vary and values a run would refuse.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
from flwr.app import Context, RecordDict
from hypothesis import given
from hypothesis import strategies as st
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from quorumfl.core.data import prepare_partitions
from quorumfl.errors import ConfigError, PrivacyBudgetError
from quorumfl.privacy.accounting import epsilon
from quorumfl.privacy.ledger import Ledger
from quorumfl.server.config import RunConfig
from quorumfl.server.model_store import ModelStore
from quorumfl.server.rounds import Federation
from quorumfl.server.search import SearchPlan, TrialHooks, TrialRunner, best_trial, run_search
from quorumfl.server.search_space import SearchSpace
from quorumfl.server.search_view import render_search, search_view
from quorumfl.server.state.database import connect
from quorumfl.server.state.repository import Repository, RunStatus

from .test_rounds import LoopbackGrid, task_identity  # noqa: F401  (an autouse fixture)

MASKED_DP = {"num-rounds": 2, "local-epochs": 1, "min-nodes": 3, "start-from": "fresh", "strategy": "fedavg",
             "secure-aggregation": "masking", "secagg-threshold": 0.6, "dp": "local", "dp-epsilon": 2.0,
             "local-baseline": False, "finetune-epochs": 0}
SPACE = {"learning-rate": {"low": 0.01, "high": 0.3, "log": True}, "local-epochs": {"low": 1, "high": 2}}


def _loopback(tmp_path: Path, repo: Repository, parts: dict[str, Path], runs: list[int]) -> TrialRunner:
    """Each trial a run of the federation loop over the departments' own partitions (their ledgers
    persist across trials, as a department's does), under a new Flower run id."""
    ids = itertools.count(700)

    def run(values: dict[str, Any], hooks: TrialHooks) -> int:
        flower_run_id = next(ids)
        contexts = {1000 + i: Context(run_id=flower_run_id, node_id=1000 + i,
                                      node_config={"data-path": str(p), "department": name, "dp-budget": 10.0},
                                      state=RecordDict(), run_config={})
                    for i, (name, p) in enumerate(parts.items())}
        federation = Federation(LoopbackGrid(contexts), RunConfig.from_mapping(values), repo,
                                ModelStore(tmp_path / "models"), flower_run_id=flower_run_id)
        hooks.started(flower_run_id)
        runs.append(federation.run(on_round=lambda *_: hooks.round_ended()))
        return flower_run_id

    return run


@pytest.fixture
def three_parts(tmp_path: Path) -> dict[str, Path]:
    return prepare_partitions(tmp_path / "data", ["tax-office", "housing", "transport"], seed=0, method="iid")


def test_a_masked_dp_search_charges_its_trials_to_every_ledger_and_records_them(
        tmp_path: Path, three_parts: dict[str, Path]) -> None:
    repo = Repository(connect(f"sqlite:///{tmp_path / 'state.db'}", migrate=True))
    runs: list[int] = []
    # the city's model before the search: a plaintext run's, the head its next run would continue from
    plain = {k: v for k, v in MASKED_DP.items() if not k.startswith(("dp", "secagg"))}
    runner = _loopback(tmp_path, repo, three_parts, runs)
    runner({**plain, "secure-aggregation": "none"}, TrialHooks(started=lambda _: None, round_ended=lambda: None))
    heads = repo.heads()
    runs.clear()
    assert heads
    base = {k: v for k, v in MASKED_DP.items() if k != "start-from"}  # trials start fresh whatever the default
    plan = SearchPlan(study="digits-lr", base=base, space=SearchSpace.parse(SPACE, base), trials=4,
                      min_rounds=1, dp_budget=10.0)
    trials = run_search(repo, plan, runner, poll=0.05)
    assert repo.heads() == heads  # the trials' models did not become the city's model

    assert [t.number for t in trials] == [0, 1, 2, 3] and len(runs) == 4
    for trial, run_id in zip(trials, runs, strict=True):
        assert trial.run_id == run_id
        assert trial.state in ("complete", "pruned")
        assert 0.01 <= trial.params["learning-rate"] <= 0.3 and trial.params["local-epochs"] in (1, 2)
        run = repo.get_run(run_id)
        assert run.config["learning-rate"] == trial.params["learning-rate"]  # the run trained what the trial drew
        assert run.config["secure-aggregation"] == "masking" and run.config["dp"] == "local"
        assert run.config["start-from"] == "fresh"
        assert trial.figures and set(trial.figures) <= {"1", "2"}
        if trial.state == "pruned":  # stopped before the round after the pruner's decision
            assert run.status == RunStatus.STOPPED and "pruned" in (run.error or "")
            assert len(run.rounds) == len(trial.figures) == 1 and "after round 1" in (run.error or "")
        else:
            assert run.status == RunStatus.COMPLETED and trial.value is not None
    # the pruner's notes (the rung each trial reached, with its figure) are kept for a continued study
    assert all("completed_rung_0" in t.notes for t in trials)
    best = best_trial(trials)
    assert best is not None and best.value == max(t.value for t in trials if t.value is not None)

    # Each department's own ledger holds every trial it trained in, and the whole search's ε: what
    # Opacus' accountant gives for all of it, within the plan (4 trials × dp-epsilon 2).
    for folder in three_parts.values():
        ledger = Ledger.open(folder)
        assert {r.run for r in ledger.by_run(1e-5)} == {str(701 + i) for i in range(4)}
        schedule = [(s.noise_multiplier, s.sample_rate, s.steps) for s in ledger.spends()]
        assert ledger.spent(1e-5) == pytest.approx(epsilon(schedule, 1e-5))
        assert 2.0 < ledger.spent(1e-5) <= 4 * 2.0 * 1.001

    view = search_view(repo, "digits-lr")
    assert [r["run"] for r in view["trials"]] == runs and view["best"]["trial"] == best.number
    assert "<img" in render_search(view)

    # The study goes on from its records: one more trial is numbered after the first four, and is
    # admitted against what the ledgers hold now (at most 8 of 10, plus 2).
    spent = max(Ledger.open(folder).spent(1e-5) for folder in three_parts.values())
    more = run_search(repo, SearchPlan(study="digits-lr", base=base, space=plan.space, trials=1, min_rounds=1,
                                       dp_budget=10.0),
                      runner, spent=spent, poll=0.05)
    assert [t.number for t in more] == [0, 1, 2, 3, 4]


def test_a_budget_of_rounds_ends_the_search(tmp_path: Path, three_parts: dict[str, Path]) -> None:
    repo = Repository(connect(f"sqlite:///{tmp_path / 'state.db'}", migrate=True))
    runs: list[int] = []
    base = {"num-rounds": 2, "local-epochs": 1, "min-nodes": 3, "secure-aggregation": "none"}
    plan = SearchPlan(study="short", base=base, space=SearchSpace.parse(SPACE, base), trials=5, prune=False,
                      max_rounds=3)
    trials = run_search(repo, plan, _loopback(tmp_path, repo, three_parts, runs), poll=0.05)
    assert len(trials) == len(runs) == 2 and [len(t.figures) for t in trials] == [2, 2]  # 2 + 2 ≥ 3: no third


def test_a_search_past_the_budget_runs_nothing(tmp_path: Path, three_parts: dict[str, Path]) -> None:
    repo = Repository(connect(f"sqlite:///{tmp_path / 'state.db'}", migrate=True))
    called: list[int] = []

    def runner(values: dict[str, Any], hooks: TrialHooks) -> int:
        called.append(1)
        raise AssertionError("no trial may start")

    space = SearchSpace.parse(SPACE, MASKED_DP)
    # 6 trials × ε 2 = 12 > 10: refused whole, though the first five would fit
    with pytest.raises(PrivacyBudgetError, match=r"up to ε = 12 .* past the budget ε = 10; run fewer trials"):
        run_search(repo, SearchPlan(study="s", base=MASKED_DP, space=space, trials=6, dp_budget=10.0), runner)
    # 4 × 2 = 8 fits an empty ledger, not one that holds 3 already
    with pytest.raises(PrivacyBudgetError, match="on top of ε = 3 already spent"):
        run_search(repo, SearchPlan(study="s", base=MASKED_DP, space=space, trials=4, dp_budget=10.0), runner,
                   spent=3.0)
    assert not called and repo.trials("s") == [] and repo.list_runs() == []
    for folder in three_parts.values():
        assert Ledger.open(folder).spends() == []

    # a DP search with a fixed noise multiplier has no ε to plan with: refused too
    fixed = {**MASKED_DP, "dp-epsilon": 0.0, "dp-noise-multiplier": 1.0}
    with pytest.raises(ConfigError, match="needs each trial's target ε"):
        run_search(repo, SearchPlan(study="s", base=fixed, space=space, trials=1), runner)
    # trials that went on from the city's head model (which each trial moves) would not compare
    with pytest.raises(ConfigError, match="remove start-from"):
        SearchPlan(study="s", base={**MASKED_DP, "start-from": "head"}, space=space, trials=1)


def test_the_space_refuses_what_a_search_must_not_vary_and_values_a_run_would_refuse() -> None:
    cases = {
        "dp-epsilon": ({"low": 1.0, "high": 8.0}, "cannot be searched"),
        "secure-aggregation": (["none", "masking"], "cannot be searched"),
        "num-rounds": ({"low": 2, "high": 9}, "cannot be searched"),
        "no-such-key": ([1, 2], "not a run-config key"),
        "learning-rate": ({"low": 0.1, "high": 0.01}, "low < high"),
        "local-epochs": ({"low": 1.5, "high": 3}, "whole-number"),
        "batch-size": ({"low": 0, "high": 64}, "would make an invalid run"),
        "strategy": (["fedavg", "fedsgd"], "would make an invalid run"),
        "optimizer": ({"low": 1, "high": 2}, "a list of choices"),
        "proximal-mu": ({"low": 0.0, "high": 1.0, "log": True}, "low > 0 with log"),
    }
    for name, (spec, message) in cases.items():
        with pytest.raises(ConfigError, match=message) as caught:
            SearchSpace.parse({name: spec}, {})
        assert f"[search] {name}" in str(caught.value)
    with pytest.raises(ConfigError, match="empty"):
        SearchSpace.parse({}, {})
    # every problem at once, each naming its key
    with pytest.raises(ConfigError) as caught:
        SearchSpace.parse({"dp": ["local"], "learning-rate": {"low": 1, "high": 0}}, {})
    assert "[search] dp" in str(caught.value) and "[search] learning-rate" in str(caught.value)


@given(low=st.floats(1e-5, 1.0), span=st.floats(1.01, 1e3), log=st.booleans(), epochs=st.integers(1, 50))
def test_a_valid_space_keeps_its_ranges_and_round_trips_through_the_record(low: float, span: float, log: bool,
                                                                            epochs: int) -> None:
    table = {"learning-rate": {"low": low, "high": low * span, "log": log},
             "local-epochs": {"low": 1, "high": epochs + 1}, "strategy": ["fedavg", "fedprox"]}
    space = SearchSpace.parse(table, {})
    assert space.dimensions["learning-rate"] == FloatDistribution(low, low * span, log=log)
    assert space.dimensions["local-epochs"] == IntDistribution(1, epochs + 1)
    assert space.dimensions["strategy"] == CategoricalDistribution(["fedavg", "fedprox"])
    assert SearchSpace.from_record(space.to_record()) == space
