"""Client selection: virtual time to a target accuracy for Random, Oort and the RL selector.

A virtual-clock simulation of a federation whose departments differ in speed and availability, with
real local training. Each department holds a Dirichlet(α) label-skewed share of Fashion-MNIST's
training set (digits for ``--smoke``). Per department: a speed drawn log-normal (σ = 1), a network
latency (log-normal around 2 s), and an availability cycle (offline for a quarter of a period of
200–600 virtual seconds, at a random phase); each selected department drops out with probability
``--dropout``. A department's round takes latency + epochs × samples × 2 ms / speed.

Each round the selector (``quorumfl.server.selection``, as the server uses it) chooses
K·(1 + β) of the departments online at that moment (over-selection), with local epochs each
(Random and Oort: ``--epochs``; RL: one of ``--epoch-choices``). The first K to finish within the
round deadline are trained for real (``training.local.train``: SGD, what a node runs) and averaged
(``aggregation.WeightedMean``); the round ends when the K-th arrives, or at the deadline. The
deadline is ``--deadline-factor`` × the median department's duration at ``--epochs``. A department
that did not make the cut is reported late, censored at the time the round stopped waiting; a
dropout is reported failed. The global model is evaluated on the official test set after every
round; time to target is the virtual time at the first round that reaches ``--target``.

    python benchmarks/selection.py            # Fashion-MNIST, 40 departments, K = 8, 40 rounds, seeds 0-4
    python benchmarks/selection.py --smoke    # digits, 8 departments, K = 3, 8 rounds, one seed
    python benchmarks/selection.py --json     # last line: one JSON object

Keys: random_time_to_target, oort_time_to_target, rl_time_to_target (mean over seeds of virtual
seconds; a seed that never reaches the target counts as its whole run), rl_speedup_vs_random
(random / rl), rl_over_oort (rl / oort), <selector>_final_acc, per-seed lists, goal flags,
seconds, peak RSS.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from _cli import parser, peak_rss_mb, report
from _common import department_split
from quorumfl.aggregation import NodeUpdate, WeightedMean
from quorumfl.core.models import arrays_to_model, build_model, model_to_arrays
from quorumfl.server.selection import NodeResult, Outcome, RoundFeedback, build_selector
from quorumfl.training.local import evaluate, train

SELECTORS = ("random", "oort", "rl")


@dataclass(frozen=True)
class Setup:
    dataset: str
    departments: int
    alpha: float
    per_department: int  # at most this many training examples each
    k: int
    beta: float
    rounds: int
    epochs: int
    epoch_choices: tuple[int, ...]
    deadline_factor: float
    dropout: float
    target: float
    batch_size: int
    learning_rate: float
    model: str


@dataclass(frozen=True)
class World:
    """The simulated departments: speed, latency, availability cycle and data size."""

    speed: np.ndarray
    latency: np.ndarray
    period: np.ndarray
    phase: np.ndarray
    samples: np.ndarray

    def online(self, now: float) -> np.ndarray:
        return ((now + self.phase) % self.period) >= 0.25 * self.period

    def seconds(self, node: int, epochs: int) -> float:
        return float(self.latency[node] + epochs * self.samples[node] * 0.002 / self.speed[node])


def make_world(samples: list[int], seed: int) -> World:
    rng = np.random.default_rng([seed, 99])
    n = len(samples)
    period = rng.uniform(200.0, 600.0, n)
    return World(speed=rng.lognormal(0.0, 1.0, n), latency=rng.lognormal(math.log(2.0), 0.3, n), period=period,
                 phase=rng.uniform(0.0, 1.0, n) * period, samples=np.array(samples, dtype=np.float64))


def simulate(setup: Setup, name: str, seed: int, parts: list[Any], test: Any) -> dict[str, Any]:
    world = make_world([len(p) for p in parts], seed)
    typical = float(np.median([world.seconds(i, setup.epochs) for i in range(len(parts))]))
    deadline = setup.deadline_factor * typical
    selector = build_selector(name, seed=seed, epochs=setup.epochs, epoch_choices=setup.epoch_choices)
    model = build_model(setup.model, test.input_shape, test.num_classes, seed=seed)
    arrays = model_to_arrays(model)
    result = evaluate(model, test)
    accuracy, loss = result.accuracy, result.loss
    rng = np.random.default_rng([seed, 7])
    now, reached, curve, policies = 0.0, None, [], []
    for number in range(1, setup.rounds + 1):
        available = [int(i) for i in np.flatnonzero(world.online(now))]
        while not available:  # nobody online: wait
            now += 10.0
            available = [int(i) for i in np.flatnonzero(world.online(now))]
        count = min(len(available), math.ceil(setup.k * (1 + setup.beta)))
        selection = selector.select(number, available, count)
        policies.append(selection.policy)
        finish = {n: world.seconds(n, selection.epochs[n]) for n in selection.nodes}
        dropped = {n for n in selection.nodes if rng.random() < setup.dropout}
        arrivals = sorted((t, n) for n, t in finish.items() if n not in dropped and t <= deadline)
        accepted = [n for _, n in arrivals[: setup.k]]
        end = arrivals[setup.k - 1][0] if len(arrivals) >= setup.k else deadline
        results: dict[int, NodeResult] = {}
        mean = WeightedMean(arrays)
        for n in selection.nodes:
            if n in dropped:
                results[n] = NodeResult(Outcome.FAILED, selection.epochs[n])
            elif n not in accepted:
                results[n] = NodeResult(Outcome.LATE, selection.epochs[n], seconds=end)
        for n in accepted:
            arrays_to_model(model, arrays)
            local = train(model, parts[n], epochs=selection.epochs[n], batch_size=setup.batch_size,
                          learning_rate=setup.learning_rate, seed=seed * 1000 + number)
            mean.add(NodeUpdate(node=str(n), arrays=model_to_arrays(model), weight=float(len(parts[n]))))
            results[n] = NodeResult(Outcome.OK, selection.epochs[n], seconds=finish[n], loss=local.loss,
                                    samples=float(len(parts[n])))
        before, loss_before = accuracy, loss
        if accepted:
            arrays = mean.result()
            arrays_to_model(model, arrays)
            result = evaluate(model, test)
            accuracy, loss = result.accuracy, result.loss
        seconds = end + 1.0  # plus the server's own second per round
        now += seconds
        selector.observe(RoundFeedback(number, results, seconds, before, accuracy, deadline=deadline,
                                       loss_before=loss_before, loss_after=loss))
        curve.append((now, accuracy))
        if reached is None and accuracy >= setup.target:
            reached = now
    return {"time_to_target": reached if reached is not None else now, "reached": reached is not None,
            "final_acc": accuracy, "virtual_seconds": now, "rl_rounds": policies.count("rl"), "curve": curve}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--departments", type=int, default=40)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--beta", type=float, default=0.25)
    p.add_argument("--target", type=float, default=0.80)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--epoch-choices", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--deadline-factor", type=float, default=3.0)
    p.add_argument("--dropout", type=float, default=0.05)
    p.add_argument("--alpha", type=float, default=0.3)
    p.add_argument("--selectors", nargs="+", default=list(SELECTORS), choices=SELECTORS,
                   help="run only these (the ratios need all three)")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.smoke:
        setup = Setup("digits", 8, 0.5, 300, 3, 0.34, 8, 2, (1, 2, 4), 3.0, 0.05, 0.5, 32, 0.05, "mlp")
        seeds = [0]
    else:
        setup = Setup("fashion-mnist", args.departments, args.alpha, 1500, args.k, args.beta, args.rounds, args.epochs,
                      tuple(args.epoch_choices), args.deadline_factor, args.dropout, args.target, 32, 0.05, "mlp")
        seeds = args.seeds
    started = time.perf_counter()
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in SELECTORS}
    for seed in seeds:
        parts, test = department_split(setup.dataset, setup.departments, alpha=setup.alpha, seed=seed)
        rng = np.random.default_rng([seed, 5])
        parts = [p.subset(np.sort(rng.permutation(len(p))[: setup.per_department])) for p in parts]
        for name in args.selectors:
            run = simulate(setup, name, seed, parts, test)
            runs[name].append(run)
            print(f"seed {seed} {name:<6} time to {setup.target:.2f}: {run['time_to_target']:8.0f} s"
                  f"{'' if run['reached'] else ' (not reached)'}  final acc {run['final_acc']:.4f}"
                  f"  virtual {run['virtual_seconds']:.0f} s  rl-chosen rounds {run['rl_rounds']}", flush=True)
    figures: dict[str, Any] = {"dataset": setup.dataset, "departments": setup.departments, "k": setup.k,
                               "beta": setup.beta, "rounds": setup.rounds, "target": setup.target, "seeds": seeds}
    for name in args.selectors:
        figures[f"{name}_time_to_target"] = float(np.mean([r["time_to_target"] for r in runs[name]]))
        figures[f"{name}_final_acc"] = float(np.mean([r["final_acc"] for r in runs[name]]))
        figures[f"{name}_time_to_target_per_seed"] = [round(r["time_to_target"], 1) for r in runs[name]]
        figures[f"{name}_reached_per_seed"] = [r["reached"] for r in runs[name]]
    if len(args.selectors) == len(SELECTORS):
        figures["rl_speedup_vs_random"] = figures["random_time_to_target"] / figures["rl_time_to_target"]
        figures["rl_over_oort"] = figures["rl_time_to_target"] / figures["oort_time_to_target"]
        figures["goal_rl_1_5x_random"] = figures["rl_speedup_vs_random"] >= 1.5
        figures["goal_rl_within_10pct_of_oort"] = figures["rl_over_oort"] <= 1.10
    figures["seconds"] = time.perf_counter() - started
    figures["peak_rss_mb"] = peak_rss_mb()
    report(figures, as_json=args.json)


if __name__ == "__main__":
    main()
