"""A faulty department: is it flagged, and do the robust rules keep the model where the weighted mean does not?

One department of ten starts sending updates scaled ×50 (its model plus 50× the change it trained)
from round ``--attack-from`` on. Every run has the same seeds, IID split, model and schedule:

- ``clean``: FedAvg, nobody attacks;
- ``attacked_fedavg``: FedAvg with the faulty department;
- ``attacked_<rule>``: the same, combined by ``robust-aggregation`` = norm-bound, trimmed-mean,
  median or krum.

The loop is in-process (no SuperLink): each department runs ``client.node_round.train_round`` (what
the ClientApp calls) and the server side is ``server.replies.combine_updates`` (the strategy's
validation and mean, the robust rule, the update monitoring a real round runs). Accuracy is the
global model's on a held-out test set no department holds. ``flagged_round``: the first round in
which the faulty department was flagged in the attacked FedAvg run (the goal: ``--attack-from``);
``false_flags``: flags on honest departments over the clean and the attacked FedAvg runs.

    python benchmarks/robustness.py            # Fashion-MNIST (apt install dataset-fashion-mnist; else digits), 10 departments, 12 rounds
    python benchmarks/robustness.py --smoke    # digits, 6 departments, 4 rounds
    python benchmarks/robustness.py --json     # last line: one JSON object

Keys: clean_acc, attacked_fedavg_acc, attacked_norm_bound_acc, attacked_trimmed_mean_acc,
attacked_median_acc, attacked_krum_acc, flagged_round, false_flags, attack_from, per-run accuracy
per round, seconds, peak_rss_mb.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Any

import numpy as np

from _cli import parser, peak_rss_mb, report
from quorumfl.aggregation import NodeUpdate
from quorumfl.aggregation.monitor import RobustRule
from quorumfl.client.node_round import train_round
from quorumfl.core.data.datasets import Dataset, load_dataset
from quorumfl.core.data.partition import partition_iid
from quorumfl.core.models import build_model, model_to_arrays
from quorumfl.protocol.wire import TrainConfig
from quorumfl.server.config import RunConfig
from quorumfl.server.replies import Robust, combine_updates
from quorumfl.server.strategies import build_strategy
from quorumfl.training.local import evaluate as evaluate_model

SCALE = 50.0
RULES = ("norm-bound", "trimmed-mean", "median", "krum")


def _data(dataset: str, departments: int, per_department: int, seed: int) -> tuple[list[Dataset], Dataset]:
    pool, test = load_dataset(dataset)
    rng = np.random.default_rng(seed)
    if test is None:  # digits: hold a fifth out for the server's test set
        order = rng.permutation(len(pool))
        cut = len(pool) // 5
        pool, test = pool.subset(np.sort(order[cut:])), pool.subset(np.sort(order[:cut]))
    total = min(len(pool), departments * per_department)
    subset = pool.subset(np.sort(rng.choice(len(pool), size=total, replace=False)))
    return [subset.subset(p) for p in partition_iid(subset.y, departments, seed=seed)], test


def run(rule: str, *, attacked: bool, dataset: str, departments: int, per_department: int, rounds: int,
        local_epochs: int, attack_from: int, model: str, seed: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    parts, test = _data(dataset, departments, per_department, seed)
    config = RunConfig.from_mapping({"strategy": "fedavg", "fraction-train": 1.0, "min-nodes": 1, "secure-aggregation": "none", "seed": seed,
                                     "robust-aggregation": rule})
    strategy = build_strategy(config)
    robust = Robust(config.robust_aggregation, config.robust_fraction, config.norm_bound_factor)
    net = build_model(model, parts[0].input_shape, parts[0].num_classes, seed=seed)
    arrays = model_to_arrays(net)
    base = TrainConfig(server_round=0, model=model, local_epochs=local_epochs, batch_size=32, learning_rate=0.05,
                       proximal_mu=0.0, seed=seed)
    faulty = departments // 2
    accuracy, flags = [], []
    for number in range(1, rounds + 1):
        cfg = replace(base, server_round=number)
        updates, losses = [], {}
        for i, part in enumerate(parts):
            work = train_round(cfg, [arrays], None, part, part)
            shared = dict(work.shared)
            if attacked and i == faulty and number >= attack_from:
                shared = {k: (arrays[k] + SCALE * (v - arrays[k])).astype(v.dtype) for k, v in shared.items()}
            updates.append(NodeUpdate(node=str(i), arrays=shared, weight=float(work.num_examples)))
            losses[i] = float(work.metrics.get("train-loss", math.nan))
        result, stats = combine_updates(strategy, arrays, updates, losses, robust)
        if result.arrays is None:
            raise RuntimeError(f"{rule} round {number}: every update was rejected ({result.rejected})")
        arrays = result.arrays
        for key, tensor in net.state_dict().items():
            tensor.copy_(torch.from_numpy(np.asarray(arrays[key])))
        accuracy.append(float(evaluate_model(net, test).metrics["accuracy"]))
        flags.append(sorted(n for n, s in stats.items() if s.flagged))
    return {"accuracy": accuracy, "flags": flags, "faulty": faulty}


def main() -> None:
    args_parser = parser(__doc__ or "")
    args_parser.add_argument("--attack-from", type=int, default=3)
    args_parser.add_argument("--seed", type=int, default=0)
    args = args_parser.parse_args()
    if args.smoke:
        setup = {"dataset": "digits", "departments": 6, "per_department": 200, "rounds": 4, "local_epochs": 2,
                 "model": "mlp"}
    else:
        try:
            load_dataset("fashion-mnist")
            setup = {"dataset": "fashion-mnist", "departments": 10, "per_department": 600, "rounds": 12,
                     "local_epochs": 1, "model": "cnn"}
        except Exception:  # noqa: BLE001 - the Debian package is optional; digits is embedded
            setup = {"dataset": "digits", "departments": 10, "per_department": 140, "rounds": 12,
                     "local_epochs": 5, "model": "mlp"}
    attack_from = min(args.attack_from, setup["rounds"])
    common = {**setup, "attack_from": attack_from, "seed": args.seed}
    started = time.perf_counter()
    clean = run(RobustRule.NONE.value, attacked=False, **common)
    fedavg = run(RobustRule.NONE.value, attacked=True, **common)
    robust = {rule: run(rule, attacked=True, **common) for rule in RULES}
    faulty = fedavg["faulty"]
    flagged_round = next((r + 1 for r, nodes in enumerate(fedavg["flags"]) if faulty in nodes), None)
    false_flags = sum(len(nodes) for nodes in clean["flags"]) + sum(
        len([n for n in nodes if n != faulty]) for nodes in fedavg["flags"])
    figures: dict[str, Any] = {
        **setup, "attack_from": attack_from, "scale": SCALE, "faulty_department": faulty,
        "clean_acc": clean["accuracy"][-1], "attacked_fedavg_acc": fedavg["accuracy"][-1],
        **{f"attacked_{rule.replace('-', '_')}_acc": robust[rule]["accuracy"][-1] for rule in RULES},
        "flagged_round": flagged_round, "false_flags": false_flags,
        "clean_per_round": clean["accuracy"], "attacked_fedavg_per_round": fedavg["accuracy"],
        **{f"attacked_{rule.replace('-', '_')}_per_round": robust[rule]["accuracy"] for rule in RULES},
        "seconds": time.perf_counter() - started, "peak_rss_mb": peak_rss_mb(),
    }
    report(figures, as_json=bool(args.json))


if __name__ == "__main__":
    main()
