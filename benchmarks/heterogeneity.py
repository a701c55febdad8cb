"""Non-IID departments: FedAvg, FedProx, IFCA, FedPer, Ditto, FedAvg + fine-tuning and local-only training,
same data and schedule.

Each department holds its own label-skewed share of Fashion-MNIST (Dirichlet(α) over a random
subset) and splits it into its own train and test parts, so every accuracy below is a department's
model on test data from its own distribution. Every method gets the same seeds, rounds, local
epochs, batch size, learning rate and model; all departments take part in every round.

The loop is in-process (no SuperLink): each department runs ``client.node_round`` — the function the
ClientApp's train and evaluate handlers call — and the server side is ``server.strategies`` (the
weighted mean, IFCA's per-cluster means and repairs) followed by the server's step over rounds
(``aggregation.momentum``, the run config's default ``server-momentum`` and ``server-lr``, as
``server.rounds`` applies it). What runs over Flower is the same code plus transport, which this
benchmark does not measure. The plain-torch FedAvg reference takes the same server step.

``fedavg_finetune`` is the product's default deliverable to a department: FedAvg's final model
fine-tuned on the department's own train split for the default ``finetune-epochs``, by the node's own
code (``client.tuned.tune``), measured by the FedAvg run. Local-only training is measured with and
without the same extra epochs, and the personalised methods are held to the better of the two.

Each seed draws its own data split, model initialisations and training order; the full comparison
runs seeds 0, 1 and 2 (the split dominates the spread: with Dirichlet(0.1) one draw can leave a
department with too little data to learn alone) and reports the average over seeds, the per-seed
figures beside it. Per method: mean and worst per-department test accuracy after the last round (the department's model
is the global one for FedAvg/FedProx, its cluster's for IFCA, shared + personal layers for FedPer,
its personal model for Ditto, its own for local-only), the first round whose mean reaches 80%, and
bytes sent (server → nodes plus nodes → server, float32 arrays). Cluster purity: IFCA with K = the
number of planted groups on departments whose labels are permuted per group (IID split), the share
of departments whose cluster's majority group is their own.

    python benchmarks/heterogeneity.py            # Fashion-MNIST, 20 departments, α = 0.1, 20 rounds, 3 seeds
    python benchmarks/heterogeneity.py --smoke    # digits, 6 departments, 3 rounds, MLP
    python benchmarks/heterogeneity.py --json     # last line: one JSON object

Keys: fedavg_mean_acc, fedprox_mean_acc, ifca_mean_acc, fedper_mean_acc, ditto_mean_acc,
local_only_mean_acc, fedavg_worst_acc, best_worst_acc, best_minus_fedavg_pts, planted_purity, plus
best_method, per-method worst accuracy, rounds to 80% and bytes, seconds and peak RSS, per-seed lists.
Accuracies are averages over the seeds; ``planted_purity`` is the worst seed's.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from _cli import parser, peak_rss_mb, report
from quorumfl.aggregation import NodeUpdate
from quorumfl.aggregation.clustering import cluster_purity
from quorumfl.aggregation.momentum import ServerMomentum
from quorumfl.client.node_round import evaluate_round, train_round
from quorumfl.core.data.datasets import Dataset, load_dataset
from quorumfl.core.data.partition import partition_dirichlet, partition_iid
from quorumfl.core.data.planted import plant_label_permutations
from quorumfl.core.models import build_model, model_to_arrays
from quorumfl.protocol.wire import TrainConfig
from quorumfl.server.config import RunConfig
from quorumfl.server.strategies import ClusteredFedAvg, FedAvg, build_strategy

METHODS = ("fedavg", "fedprox", "ifca", "fedper", "ditto", "local_only")
PERSONALISED = ("ifca", "fedper", "ditto", "fedavg_finetune")
FINETUNE_EPOCHS = int(RunConfig.defaults()["finetune-epochs"])  # the product's default: each department's own model
PLAIN = "fedavg_plain_torch"  # the reference FedAvg (``plain_fedavg``), not a method of the product


@dataclass(frozen=True)
class Setup:
    dataset: str
    departments: int
    per_department: int
    alpha: float
    rounds: int
    local_epochs: int
    batch_size: int
    learning_rate: float
    model: str
    mu: float
    ditto_lambda: float
    personal_layers: str
    clusters: int
    planted_groups: int
    seed: int


Depts = list[tuple[Dataset, Dataset]]


def _split_own(part: Dataset, rng: np.random.Generator, test_fraction: float = 0.2) -> tuple[Dataset, Dataset]:
    order = rng.permutation(len(part))
    n_test = max(1, int(round(len(part) * test_fraction)))
    return part.subset(np.sort(order[n_test:])), part.subset(np.sort(order[:n_test]))


def departments(setup: Setup, *, planted: bool) -> tuple[Depts, list[int]]:
    """Each department's (train, test); with ``planted``, an IID split relabelled per planted group."""
    pool, test = load_dataset(setup.dataset)
    if test is not None:  # one pool: departments draw from train and test images alike
        pool = Dataset(pool.name, np.concatenate([pool.x, test.x]), np.concatenate([pool.y, test.y]), pool.num_classes)
    rng = np.random.default_rng([setup.seed, int(planted)])
    total = min(len(pool), setup.departments * setup.per_department)
    subset = pool.subset(np.sort(rng.choice(len(pool), size=total, replace=False)))
    if planted:
        parts = partition_iid(subset.y, setup.departments, seed=setup.seed)
    else:
        parts = partition_dirichlet(subset.y, setup.departments, alpha=setup.alpha, seed=setup.seed,
                                    min_size=max(10, setup.per_department // 10))
    datasets = [subset.subset(p) for p in parts]
    groups = [0] * len(datasets)
    if planted:
        datasets, groups, _ = plant_label_permutations(datasets, setup.planted_groups, seed=setup.seed)
    return [_split_own(d, rng) for d in datasets], groups


def _base(setup: Setup) -> TrainConfig:
    return TrainConfig(server_round=0, model=setup.model, local_epochs=setup.local_epochs, batch_size=setup.batch_size,
                       learning_rate=setup.learning_rate, proximal_mu=0.0, seed=setup.seed)


def _strategy(method: str, setup: Setup, clusters: int) -> tuple[FedAvg, RunConfig]:
    """The product's strategy for ``method`` and its run config, built as a real run builds them (so IFCA's
    repair settings and the server's momentum are the run-config defaults); FedProx alone uses μ."""
    config = RunConfig.from_mapping({
        "strategy": method, "proximal-mu": setup.mu if method == "fedprox" else 0.0, "fraction-train": 1.0,
        "min-nodes": 1, "secure-aggregation": "none", "seed": setup.seed, "clusters": clusters,
        "personal-layers": setup.personal_layers,
        "ditto-lambda": setup.ditto_lambda,
    })
    return build_strategy(config), config


def _tuned(setup: Setup, config: TrainConfig, arrays: dict[str, Any], dept: tuple[Dataset, Dataset]) -> float:
    """The department's accuracy after the product's end-of-run fine-tuning (``client.tuned.tune``, the
    default ``finetune-epochs``) of ``arrays`` on its own train split, measured on its test split."""
    from quorumfl.client.personal_store import PersonalStore
    from quorumfl.client.tuned import tune
    from quorumfl.core.models import arrays_to_model

    train, test = dept
    model = build_model(setup.model, train.input_shape, train.num_classes, seed=setup.seed)
    arrays_to_model(model, arrays)
    with tempfile.TemporaryDirectory(prefix="quorumfl-tuned-") as folder:
        store = PersonalStore(Path(folder), kind="tuned")
        metrics = tune(model, store, "benchmark", config, FINETUNE_EPOCHS, train, test)
    return float(metrics["tuned-accuracy"])


def _with_tuned(out: dict[str, Any], tuned: list[float]) -> dict[str, Any]:
    return {**out, "tuned_mean": float(np.mean(tuned)), "tuned_worst": float(np.min(tuned))}


def _nbytes(arrays: dict[str, Any]) -> int:
    return sum(int(np.asarray(v).nbytes) for v in arrays.values())


def run_method(method: str, setup: Setup, *, planted: bool = False) -> dict[str, Any]:
    """One method's federation, in-process; per-round mean accuracy, final per-department accuracy."""
    import torch

    torch.set_num_threads(1)
    started = time.perf_counter()
    depts, groups = departments(setup, planted=planted)
    sample = depts[0][0]
    clusters = setup.planted_groups if planted else setup.clusters
    full = [model_to_arrays(build_model(setup.model, sample.input_shape, sample.num_classes, seed=setup.seed + k))
            for k in range(clusters if method == "ifca" else 1)]
    base = _base(setup)
    personal: list[dict[str, Any] | None] = [None] * len(depts)
    history: list[float] = []
    sent = 0
    nodes = list(range(len(depts)))
    if method == "local_only":
        own = [model_to_arrays(build_model(setup.model, sample.input_shape, sample.num_classes, seed=setup.seed))
               for _ in depts]
        for number in range(1, setup.rounds + 1):
            cfg = replace(base, server_round=number)
            own = [dict(train_round(cfg, [own[i]], None, *depts[i]).shared) for i in nodes]
            history.append(float(np.mean([evaluate_round(cfg, [own[i]], None, *depts[i]).metrics["accuracy"]
                                          for i in nodes])))
        last = replace(base, server_round=setup.rounds)
        final = [evaluate_round(last, [own[i]], None, *depts[i]).metrics for i in nodes]
        tuned = [_tuned(setup, last, own[i], depts[i]) for i in nodes]  # the same extra epochs as fedavg_finetune
        return _with_tuned(_summary(method, final, history, sent, started, groups=None), tuned)

    strategy, config = _strategy(method, setup, clusters)
    momentum, step = config.server_step()  # the server's step over rounds, as ``server.rounds`` takes it
    server = ServerMomentum(momentum=momentum, learning_rate=step,
                            names=[n for n, _ in build_model(setup.model, sample.input_shape, sample.num_classes,
                                                             seed=setup.seed).named_parameters()])
    models = [strategy.server_arrays(m) for m in full]
    assigned: list[int] = [0] * len(depts)
    final: list[dict[str, float]] = []
    for number in range(1, setup.rounds + 1):
        configs = strategy.configure_train(number, nodes, base)
        updates: list[tuple[int, NodeUpdate]] = []
        for i in nodes:
            work = train_round(configs[i], models, personal[i], *depts[i])
            personal[i] = work.personal
            assigned[i] = work.cluster or 0
            sent += sum(_nbytes(m) for m in models) + _nbytes(work.shared)
            updates.append((assigned[i], NodeUpdate(node=str(i), arrays=work.shared, weight=float(work.num_examples))))
        if isinstance(strategy, ClusteredFedAvg):
            models = strategy.aggregate_clusters(number, models, updates).models
        else:
            result = strategy.aggregate_train(models[0], (u for _, u in updates))
            if result.arrays is None:
                raise RuntimeError(f"{method} round {number}: every update was rejected ({result.rejected})")
            models = [server.step(models[0], result.arrays)]
        final = [evaluate_round(configs[i], models, personal[i], *depts[i]).metrics for i in nodes]
        history.append(float(np.mean([_accuracy(m) for m in final])))
    picks = [int(m.get("cluster", 0)) for m in final]
    out = _summary(method, final, history, sent, started, groups=(picks, groups) if method == "ifca" else None)
    if method == "fedavg":  # FedAvg plus the product's default fine-tuning: each department's own final model
        out = _with_tuned(out, [_tuned(setup, configs[i], models[0], depts[i]) for i in nodes])
    return out


def plain_fedavg(setup: Setup) -> dict[str, Any]:
    """FedAvg written out in plain torch on the same departments, model and initial weights, as the
    reference the product's FedAvg is checked against: each round every department trains a copy of
    the global model for the local epochs (SGD at the same rate with momentum 0.9, started afresh,
    cross-entropy; the mini-batches a node draws: a permutation per epoch from a generator seeded with
    the run's seed plus the round, so both sides compute the same federation and a difference is the
    implementation's, not another draw's), the server takes the example-weighted mean of the weights and
    moves the model's parameters by the run config's default server momentum β and rate η on the mean
    change (``m ← β·m + Δ``, ``w ← w + η·m``; buffers take the mean), and each department measures the
    new global model on its own test split."""
    import torch

    torch.set_num_threads(1)
    started = time.perf_counter()
    depts, _ = departments(setup, planted=False)
    sample = depts[0][0]
    model = build_model(setup.model, sample.input_shape, sample.num_classes, seed=setup.seed)
    beta, eta = RunConfig.defaults()["server-momentum"], RunConfig.defaults()["server-lr"]
    moving = {name for name, _ in model.named_parameters()}
    velocity: dict[str, Any] = {}
    history: list[float] = []
    accs: list[float] = []
    for number in range(1, setup.rounds + 1):
        start = {k: v.detach().clone() for k, v in model.state_dict().items()}
        total = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in start.items()}
        weight = 0
        for train, _test in depts:
            model.load_state_dict(start)
            model.train()
            opt = torch.optim.SGD(model.parameters(), lr=setup.learning_rate, momentum=0.9)
            generator = torch.Generator().manual_seed(setup.seed + number)
            x, y = torch.as_tensor(train.x, dtype=torch.float32), torch.as_tensor(train.y, dtype=torch.long)
            for _epoch in range(setup.local_epochs):
                order = torch.randperm(len(y), generator=generator)
                for at in range(0, len(y), setup.batch_size):
                    batch = order[at:at + setup.batch_size]
                    opt.zero_grad()
                    torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
                    opt.step()
            for k, v in model.state_dict().items():
                total[k] += v.double() * len(y)
            weight += len(y)
        mean = {k: v / weight for k, v in total.items()}
        for k in moving:
            change = mean[k] - start[k].double()
            velocity[k] = change if k not in velocity else beta * velocity[k] + change
            mean[k] = start[k].double() + eta * velocity[k]
        model.load_state_dict({k: v.to(start[k].dtype) for k, v in mean.items()})
        model.eval()
        with torch.no_grad():
            accs = [float((model(torch.as_tensor(test.x, dtype=torch.float32)).argmax(1).numpy() == test.y).mean())
                    for _train, test in depts]
        history.append(float(np.mean(accs)))
    return {"method": "fedavg_plain_torch", "mean": float(np.mean(accs)), "worst": float(np.min(accs)),
            "history": history, "seconds": time.perf_counter() - started, "peak_rss_mb": peak_rss_mb()}


def _accuracy(metrics: dict[str, float]) -> float:
    """The department's own model: its personal one where it has one, else the federation's for it."""
    return metrics.get("personal-accuracy", metrics["accuracy"])


def _summary(method: str, final: list[dict[str, float]], history: list[float], sent: int, started: float,
             *, groups: tuple[list[int], list[int]] | None) -> dict[str, Any]:
    accs = [_accuracy(m) for m in final]
    reach = next((r + 1 for r, acc in enumerate(history) if acc >= 0.8), None)
    out: dict[str, Any] = {
        "method": method, "mean": float(np.mean(accs)), "worst": float(np.min(accs)), "history": history,
        "rounds_to_80": reach, "bytes": sent, "seconds": time.perf_counter() - started, "peak_rss_mb": peak_rss_mb(),
    }
    if groups is not None:
        out["assigned"], out["planted"] = groups
        out["purity"] = cluster_purity(*groups)
    return out


def _job(args: tuple[str, Setup, bool]) -> dict[str, Any]:
    method, setup, planted = args
    if method == PLAIN:
        return plain_fedavg(setup)
    return run_method(method, setup, planted=planted)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--local-epochs", type=int, default=None)
    ap.add_argument("--workers", type=int, default=min(os.cpu_count() or 1, 8), help="methods run in parallel")
    ap.add_argument("--seed", type=int, default=0, help="the seed of a sweep (--methods)")
    ap.add_argument("--seeds", default=None, help="comma-separated seeds of the full comparison; figures are "
                                                  "averaged over them (default 0,1,2; 0 with --smoke)")
    ap.add_argument("--ditto-lambda", type=float, default=None)
    ap.add_argument("--personal-layers", default=None, help="FedPer's personal layers (prefixes or 'head')")
    ap.add_argument("--methods", default=",".join(METHODS),
                    help=f"a subset to run (a sweep; '{PLAIN}' adds the reference); the goal keys need all of them "
                         "and the planted run")
    args = ap.parse_args()
    if args.smoke:
        setup = Setup(dataset="digits", departments=6, per_department=250, alpha=0.1, rounds=3, local_epochs=1,
                      batch_size=32, learning_rate=0.05, model="mlp", mu=0.1, ditto_lambda=0.1,
                      personal_layers="head", clusters=2, planted_groups=2, seed=args.seed)
    else:
        setup = Setup(dataset="fashion-mnist", departments=20, per_department=1250, alpha=0.1, rounds=20,
                      local_epochs=1, batch_size=32, learning_rate=0.05, model="cnn", mu=0.1, ditto_lambda=0.1,
                      personal_layers="head", clusters=3, planted_groups=2, seed=args.seed)
    setup = replace(setup, rounds=args.rounds or setup.rounds, local_epochs=args.local_epochs or setup.local_epochs,
                    ditto_lambda=setup.ditto_lambda if args.ditto_lambda is None else args.ditto_lambda,
                    personal_layers=args.personal_layers or setup.personal_layers)
    methods = [m for m in (*METHODS, PLAIN) if m in args.methods.split(",")]
    if len(methods) < len(METHODS) or PLAIN in methods:  # a sweep: print each method's figures, no goal keys
        with ProcessPoolExecutor(max_workers=max(1, args.workers)) as pool:
            for r in pool.map(_job, [(m, setup, False) for m in methods]):
                print(json.dumps({k: v for k, v in r.items() if k not in ("assigned", "planted")}))
        return
    seeds = [int(x) for x in (args.seeds or ("0" if args.smoke else "0,1,2")).split(",")]
    runs = [replace(setup, seed=seed) for seed in seeds]
    jobs = ([(m, run, False) for run in runs for m in (*METHODS, PLAIN)]
            + [("ifca", run, True) for run in runs])
    jobs.sort(key=lambda j: j[0] != "ditto")  # the longest first
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=max(1, args.workers)) as pool:
        results = list(pool.map(_job, jobs))
    wall = time.perf_counter() - started
    by = {(j[0], j[1].seed, j[2]): r for j, r in zip(jobs, results, strict=True)}
    print(f"setup: {replace(setup, seed=-1)}, seeds {seeds}")
    print(f"{'seed':>4} {'method':<11} {'mean':>6} {'worst':>6} {'to 80%':>6} {'MB sent':>8} {'s':>6}")
    for seed in seeds:
        for m in METHODS:
            r = by[(m, seed, False)]
            print(f"{seed:>4} {m:<11} {r['mean']:6.3f} {r['worst']:6.3f} {str(r['rounds_to_80']):>6} "
                  f"{r['bytes'] / 1e6:8.1f} {r['seconds']:6.0f}")
        planted = by[("ifca", seed, True)]
        print(f"{seed:>4} planted ifca: purity {planted['purity']:.3f}, assigned {planted['assigned']}, "
              f"planted {planted['planted']}")

    for seed in seeds:  # FedAvg's and local-only's runs also measured each department's fine-tuned model
        fedavg, alone = by[("fedavg", seed, False)], by[("local_only", seed, False)]
        by[("fedavg_finetune", seed, False)] = {**fedavg, "mean": fedavg["tuned_mean"], "worst": fedavg["tuned_worst"]}
        print(f"{seed:>4} fedavg + fine-tuning {fedavg['tuned_mean']:.3f} / {fedavg['tuned_worst']:.3f}; local-only "
              f"with the same extra epochs {alone['tuned_mean']:.3f} / {alone['tuned_worst']:.3f}")

    def avg(method: str, key: str) -> float:
        return float(np.mean([by[(method, seed, False)][key] for seed in seeds]))

    def alone(seed: int) -> float:  # the bar: local-only, with or without the extra epochs, whichever is better
        return max(by[("local_only", seed, False)]["mean"], by[("local_only", seed, False)]["tuned_mean"])

    best = max(PERSONALISED, key=lambda m: avg(m, "mean"))
    figures: dict[str, Any] = {f"{m}_mean_acc": avg(m, "mean") for m in (*METHODS, "fedavg_finetune")}
    figures.update({
        "fedavg_worst_acc": avg("fedavg", "worst"),
        "best_method": best,
        "best_worst_acc": avg(best, "worst"),
        "best_minus_fedavg_pts": 100 * (avg(best, "mean") - avg("fedavg", "mean")),
        "best_minus_local_only_pts": 100 * (avg(best, "mean") - float(np.mean([alone(seed) for seed in seeds]))),
        "best_worst_minus_fedavg_worst_pts": 100 * (avg(best, "worst") - avg("fedavg", "worst")),
        "planted_purity": min(by[("ifca", seed, True)]["purity"] for seed in seeds),  # the worst seed
        # the product's FedAvg against the plain-torch reference on the same departments, per seed
        "fedavg_minus_plain_torch_pts_per_seed": [100 * (by[("fedavg", seed, False)]["mean"]
                                                         - by[(PLAIN, seed, False)]["mean"]) for seed in seeds],
        "best_minus_local_only_pts_per_seed": [100 * (max(by[(m, seed, False)]["mean"] for m in PERSONALISED)
                                                      - alone(seed)) for seed in seeds],
        "fedavg_finetune_minus_local_only_pts_per_seed": [
            100 * (by[("fedavg_finetune", seed, False)]["mean"] - alone(seed)) for seed in seeds],
        "local_only_extra_epochs_mean_acc_per_seed": [by[("local_only", seed, False)]["tuned_mean"] for seed in seeds],
        "seeds": seeds,
    })
    for m in (*METHODS, "fedavg_finetune"):
        figures[f"{m}_worst_acc"] = avg(m, "worst")
        figures[f"{m}_mean_acc_per_seed"] = [by[(m, seed, False)]["mean"] for seed in seeds]
        figures[f"{m}_worst_acc_per_seed"] = [by[(m, seed, False)]["worst"] for seed in seeds]
        figures[f"{m}_rounds_to_80_per_seed"] = [by[(m, seed, False)]["rounds_to_80"] for seed in seeds]
        figures[f"{m}_mb_sent"] = avg(m, "bytes") / 1e6
        figures[f"{m}_seconds"] = avg(m, "seconds")
    figures["planted_purity_per_seed"] = [by[("ifca", seed, True)]["purity"] for seed in seeds]
    figures["fedavg_plain_torch_mean_acc_per_seed"] = [by[(PLAIN, seed, False)]["mean"] for seed in seeds]
    figures["goal_personalised_over_local_only_every_seed"] = all(
        d >= 1.0 for d in figures["best_minus_local_only_pts_per_seed"])
    figures["goal_fedavg_matches_plain_torch_every_seed"] = all(
        abs(d) <= 1.0 for d in figures["fedavg_minus_plain_torch_pts_per_seed"])
    figures["peak_rss_mb_max_worker"] = max(r["peak_rss_mb"] for r in results)
    figures["wall_seconds"] = wall
    report(figures, as_json=args.json)

if __name__ == "__main__":
    main()
