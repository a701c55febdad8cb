"""Federated hyper-parameter search: TPE with pruning against random search and the defaults, at the
same budget of rounds, on Flower's simulation engine.

Two real data sets the defaults were not tuned on, split by a natural key over 4 departments (the
``own_data`` benchmark's): ``credit`` (tabular classification of credit applications, departments by
housing) and ``reviews`` (text classification of food reviews, departments by product). Per data
set and seed, masked, through ``quorumfl tune``'s own path (``server.search`` with the simulation
runner of ``deploy.tuning``):

- ``default``: one run of the defaults (the task's optimizer and rate, server momentum 0.5);
- ``random``: ``--trials`` trials drawn at random, no pruning: its budget is the rounds they ran;
- ``tpe``: Optuna's TPE sampler with successive-halving pruning, trial after trial until it has run
  the same number of rounds (``--rounds-budget``; pruned trials cost the rounds they ran).

The figure of a trial is its final model's federated accuracy (the departments' example-weighted
evaluation on their own test rows), as ``tune show`` reports it. Reported, as means over the seeds:
``tpe_over_default_pt`` and ``tpe_over_random_pt`` (accuracy points of the best trial), and
``rounds_to_best_fraction``: the share of the budget TPE had used when its best first reached random
search's best (1.0 or more: not within the budget). Goals: TPE ≥ 1 point over random at equal
rounds, and random's best reached in ≤ 0.65 of the rounds.

    python benchmarks/tuning.py              # seeds 0, 1, 2; 8 random trials of 5 rounds
    python benchmarks/tuning.py --smoke      # one seed, credit only, 2 + 2 trials of 2 rounds
    python benchmarks/tuning.py --json       # last line: one JSON object
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from own_data import partitions  # noqa: E402

from _cli import parser, peak_rss_mb, report  # noqa: E402
from quorumfl.deploy.simulation import SimulationSettings  # noqa: E402
from quorumfl.deploy.tuning import prepared_simulation  # noqa: E402
from quorumfl.server.config import RunConfig  # noqa: E402
from quorumfl.server.search import SearchPlan, TrialHooks, best_trial, run_search  # noqa: E402
from quorumfl.server.search_space import SearchSpace  # noqa: E402
from quorumfl.server.services import run_summary  # noqa: E402
from quorumfl.server.state.database import connect  # noqa: E402
from quorumfl.server.state.orm import SearchTrial  # noqa: E402
from quorumfl.server.state.repository import Repository  # noqa: E402

DATASETS = ("credit", "reviews")
SPACE = {"learning-rate": {"low": 0.0001, "high": 0.1, "log": True}, "local-epochs": {"low": 1, "high": 4},
         "server-momentum": {"low": 0.0, "high": 0.9}}


def _search(repo: Repository, runner: Any, base: dict[str, Any], *, study: str, sampler: str, trials: int,
            prune: bool, seed: int, startup: int, max_rounds: int = 0) -> list[SearchTrial]:
    plan = SearchPlan(study=study, base=base, space=SearchSpace.parse(SPACE, base), trials=trials, sampler=sampler,
                      prune=prune, min_rounds=2, seed=seed, startup_trials=startup, max_rounds=max_rounds)
    return run_search(repo, plan, runner, poll=0.2)


def _best_curve(trials: list[SearchTrial]) -> list[tuple[int, float]]:
    """(rounds used so far, best final figure so far) after each trial."""
    used, best, curve = 0, -np.inf, []
    for t in trials:
        used += len(t.figures)
        if t.value is not None:
            best = max(best, t.value)
        curve.append((used, best))
    return curve


def one(name: str, seed: int, *, rounds: int, trials: int, limit: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"quorumfl-tuning-{name}-") as tmp:
        root = Path(tmp)
        os.environ["QUORUMFL_HOME"] = str(root / "home")
        parts, settings = partitions(name, root / "data", seed=seed, limit=limit)
        base = {**settings, "secure-aggregation": "masking", "num-rounds": rounds, "seed": seed, "min-nodes": len(parts),
                "local-baseline": False, "finetune-epochs": 0, "state-url": f"sqlite:///{root / 'state.db'}",
                "model-dir": str(root / "models")}
        repo = Repository(connect(base["state-url"], migrate=True))
        sim = SimulationSettings(departments=len(parts), root=root / "sim", data=root / "data" / "parts", cpus=2)
        runner, _ = prepared_simulation(repo, sim, RunConfig.from_mapping(base), root / "study", budget=10.0)
        began = time.perf_counter()
        flower_run_id = runner(base, TrialHooks(started=lambda _: None, round_ended=lambda: None))
        default_value = run_summary(repo, repo.get_run(flower_run_id))["final_metric"]
        randoms = _search(repo, runner, base, study="random", sampler="random", trials=trials, prune=False, seed=seed,
                          startup=0)
        budget = sum(len(t.figures) for t in randoms)
        tpe = _search(repo, runner, base, study="tpe", sampler="tpe", trials=10 * budget, prune=True, seed=seed,
                      startup=max(2, trials // 3), max_rounds=budget)
        random_best, tpe_best = best_trial(randoms), best_trial(tpe)
        assert random_best is not None and tpe_best is not None and default_value is not None
        reached = next((used for used, best in _best_curve(tpe) if best >= random_best.value), None)
        tpe_used = sum(len(t.figures) for t in tpe)
        return {"default": default_value, "random": random_best.value, "tpe": tpe_best.value,
                "budget_rounds": budget, "tpe_rounds": tpe_used, "tpe_trials": len(tpe), "random_trials": len(randoms),
                "tpe_pruned": sum(t.state == "pruned" for t in tpe),
                "rounds_to_best_fraction": (reached if reached is not None else tpe_used) / budget,
                "reached_random_best": reached is not None, "seconds": time.perf_counter() - began,
                "tpe_best_params": tpe_best.params, "random_best_params": random_best.params}


def summarise(name: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    mean = {k: float(np.mean([r[k] for r in runs])) for k in ("default", "random", "tpe", "rounds_to_best_fraction",
                                                              "seconds")}
    return {"name": name, **mean, "tpe_over_default_pt": 100 * (mean["tpe"] - mean["default"]),
            "tpe_over_random_pt": 100 * (mean["tpe"] - mean["random"]), "per_seed": runs}


def main() -> None:
    ap = parser(__doc__ or "")
    ap.add_argument("--datasets", default=",".join(DATASETS))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--trials", type=int, default=8, help="random search's trials (its budget of rounds)")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    seeds = [0] if args.smoke else [int(s) for s in args.seeds.split(",")]
    names = ["credit"] if args.smoke else args.datasets.split(",")
    trials, rounds, limit = (2, 2, 600) if args.smoke else (args.trials, args.rounds, 0)
    began = time.perf_counter()
    datasets = [summarise(name, [one(name, seed, rounds=rounds, trials=trials, limit=limit) for seed in seeds])
                for name in names]
    tpe_over_random = float(np.mean([d["tpe_over_random_pt"] for d in datasets]))
    fraction = float(np.mean([d["rounds_to_best_fraction"] for d in datasets]))
    report({"tpe_over_default_pt": float(np.mean([d["tpe_over_default_pt"] for d in datasets])),
            "tpe_over_random_pt": tpe_over_random, "rounds_to_best_fraction": fraction,
            "goals_met": tpe_over_random >= 1.0 and fraction <= 0.65, "datasets": json.loads(json.dumps(datasets)),
            "seeds": seeds, "random_trials": trials, "rounds": rounds, "engine": "flower-simulation",
            "seconds": time.perf_counter() - began, "peak_rss_mb": peak_rss_mb()}, as_json=args.json)


if __name__ == "__main__":
    main()
