"""Tables and texts: federated FedAvg and personalised FL against centralised and local-only training.

Real data shipped by Debian packages (``./setup.sh --city-data``; ``quorumfl.core.data.packaged``):
Ames housing sales (the city assessor's records; regression of the sale price, metric MAE in dollars,
lower is better) and WordNet noun glosses (text classification into 26 lexicographer files, metric
accuracy). Each department's file goes through the product's own path: a schema proposed from the
pooled file, ``import_partition`` (checks, encoding, the department's own train/test split), the
task's model. Splits: IID, and a skewed one — Ames' natural split (whole neighbourhoods per
department, as assessor districts) and WordNet's Dirichlet(0.3) label skew.

Methods, with the same model, seed, batch size, learning rate and total epochs:
- ``fedavg``: FedAvg over all departments with the server's momentum 0.9 over rounds (FedAvgM, run
  config ``server-momentum = 0.9``: averaging K departments' local SGD acts as one large batch, and
  the server's momentum gives back the steps that averaging takes away); ``fedavg_plain``: the same
  without it (``server-momentum = 0``). The tabular task's first round is its statistics round;
- ``best``: the better of FedPer (personal head) and Ditto (personal model), by the task's metric,
  both with the same server momentum;
- ``central``: one model on all departments' training rows pooled (what FL approximates);
- ``local``: each department alone on its own rows.
Each figure is the mean over departments of the department's metric on its own test rows (its
personal model for FedPer/Ditto). The loop is in-process: departments run ``client.node_round``
(the code the ClientApp runs) and the server side is ``server.strategies``.

    python benchmarks/tasks.py              # Ames (2,930 sales) and 6,000 WordNet glosses, 5 departments
    python benchmarks/tasks.py --smoke      # 600 sales / 1,500 glosses, 3 departments, few rounds
    python benchmarks/tasks.py --json       # last line: one JSON object

Keys: ``<dataset>_<split>_{fedavg,best,central,local,fedavg_plain}_<metric>`` (e.g. ``ames_natural_fedavg_mae``,
``wordnet_dirichlet_best_accuracy``), ``<dataset>_<split>_best_method``, goals
``<dataset>_iid_fedavg_vs_central_ok`` (accuracy within 2 points, MAE within 5 %) and
``<dataset>_<skewed>_best_ok`` (best ≥ local and ≥ FedAvg), ``seed``, ``seconds``, ``peak_rss_mb``.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from _cli import parser, peak_rss_mb, report
from quorumfl.aggregation import NodeUpdate
from quorumfl.aggregation.momentum import ServerMomentum
from quorumfl.client.node_round import evaluate_round, train_round
from quorumfl.core.data import import_partition, propose_schema, read_partition
from quorumfl.core.data.datasets import Dataset
from quorumfl.core.data.packaged import write_department_files
from quorumfl.core.models import arrays_to_model, model_to_arrays
from quorumfl.core.tasks import ModelSpec
from quorumfl.core.tasks.modules import find_statistics
from quorumfl.protocol.wire import TrainConfig
from quorumfl.server.config import RunConfig
from quorumfl.server.strategies import build_strategy
from quorumfl.training.local import evaluate, train

# Per dataset: task options, model, learning rate, batch, schedule (rounds × local epochs; centralised
# and local-only get the same number of epochs), rows and the server's momentum; the schedules were
# chosen on the IID split with plain FedAvg (Ames: 15 × 2 left it 20 % behind; WordNet: 10 × 3 and
# 20 × 3 on 6,000 glosses left it 6.8 and 3.1 points behind), then fixed for both splits.
SETTINGS: dict[str, dict[str, Any]] = {
    "ames": {"task": "tabular", "options": {"label": "Sale_Price"}, "model": "mlp", "lr": 0.02, "batch": 32,
             "skewed": "natural", "metric": "mae", "rounds": 60, "epochs": 2, "limit": 0, "server_momentum": 0.9},
    "wordnet": {"task": "text", "options": {"text": "text", "label": "lexname", "ignore": "synset"},
                "model": "fasttext", "lr": 0.5, "batch": 32, "skewed": "dirichlet", "metric": "accuracy",
                "rounds": 40, "epochs": 3, "limit": 6000, "server_momentum": 0.9},
}
SMOKE = {"ames": (3, 1, 600), "wordnet": (3, 1, 1500)}  # rounds, epochs, rows


def departments(dataset: str, split: str, root: Path, *, count: int, seed: int, limit: int) -> tuple[list[tuple[Dataset, Dataset]], str]:
    """Each department's (train, test) through the product's import path, and the schema's JSON."""
    files, pool = write_department_files(dataset, root / "files", count, split=split, seed=seed, limit=limit)
    schema = propose_schema(pool, SETTINGS[dataset]["task"], SETTINGS[dataset]["options"])
    parts = [read_partition(import_partition(f, root / "parts" / f.stem, department=f.stem, schema=schema,
                                             seed=seed).directory) for f in files]
    return [(p.train, p.test) for p in parts], json.dumps(schema)


def _primary(metrics: dict[str, float], name: str) -> float:
    return metrics.get(f"personal-{name}", metrics[name])


def federate(method: str, depts: list[tuple[Dataset, Dataset]], base: TrainConfig, spec: ModelSpec, rounds: int,
             schema_file: Path, momentum: float) -> list[dict[str, float]]:
    config = RunConfig.from_mapping({"strategy": method, "personal-layers": "head", "ditto-lambda": 0.1, "proximal-mu": 0.0,
                                     "fraction-train": 1.0, "min-nodes": 1, "secure-aggregation": "none", "seed": base.seed, "task": spec.task,
                                     "task-schema": str(schema_file), "model": spec.model, "server-momentum": momentum})
    strategy = build_strategy(config)
    server = ServerMomentum(momentum=config.server_momentum, learning_rate=config.server_lr,
                            names=[name for name, _ in spec.build(seed=0).named_parameters()])
    models = [strategy.server_arrays(model_to_arrays(spec.build(seed=base.seed)))]
    statistics = find_statistics(spec.build(seed=0)) is not None
    personal: list[dict[str, Any] | None] = [None] * len(depts)
    nodes = list(range(len(depts)))
    configs: dict[int, TrainConfig] = {}
    for number in range(1, rounds + 1 + int(statistics)):  # + the statistics round
        configs = strategy.configure_train(number, nodes, replace(base, server_round=number))
        updates = []
        for i in nodes:
            work = train_round(configs[i], models, personal[i], *depts[i])
            personal[i] = work.personal if work.personal is not None else personal[i]
            updates.append(NodeUpdate(node=str(i), arrays=work.shared, weight=float(work.num_examples)))
        result = strategy.aggregate_train(models[0], iter(updates))
        assert result.arrays is not None, result.rejected
        models = [server.step(models[0], result.arrays)]  # what the server's round loop does (FedAvgM)
    return [evaluate_round(configs[i], models, personal[i], *depts[i]).metrics for i in nodes]


def alone(data: Dataset, tests: list[Dataset], spec: ModelSpec, base: TrainConfig, epochs: int) -> list[dict[str, float]]:
    """One model trained on ``data`` (all departments pooled, or one department's own rows)."""
    model = spec.build(seed=base.seed)
    stats = find_statistics(model)
    if stats is not None:  # the same standardisation the federation computes, from these rows
        stats.set_statistics(torch.from_numpy(np.asarray(data.x, dtype=np.float32)))
    train(model, data, epochs=epochs, batch_size=base.batch_size, learning_rate=base.learning_rate, seed=base.seed)
    arrays = model_to_arrays(model)
    out = []
    for test in tests:
        arrays_to_model(model, arrays)
        out.append(dict(evaluate(model, test).metrics))
    return out


def _pool(parts: list[Dataset]) -> Dataset:
    first = parts[0]
    return Dataset("pool", np.concatenate([p.x for p in parts]), np.concatenate([p.y for p in parts]),
                   first.num_classes, first.objective)


def compare(dataset: str, split: str, *, count: int, seed: int, limit: int, rounds: int, epochs: int) -> dict[str, Any]:
    settings = SETTINGS[dataset]
    metric = settings["metric"]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        depts, schema_json = departments(dataset, split, root, count=count, seed=seed, limit=limit)
        schema_file = root / "schema.json"
        schema_file.write_text(schema_json)
        spec = ModelSpec(settings["task"], settings["model"], schema_json)
        base = TrainConfig(server_round=0, model=settings["model"], local_epochs=epochs, batch_size=settings["batch"],
                           learning_rate=settings["lr"], proximal_mu=0.0, seed=seed, task=settings["task"],
                           schema=schema_json)
        tests = [test for _, test in depts]
        momentum = settings["server_momentum"]
        results = {
            "fedavg": federate("fedavg", depts, base, spec, rounds, schema_file, momentum),
            "fedper": federate("fedper", depts, base, spec, rounds, schema_file, momentum),
            "ditto": federate("ditto", depts, base, spec, rounds, schema_file, momentum),
            "central": alone(_pool([train_ for train_, _ in depts]), tests, spec, base, rounds * epochs),
            "local": [alone(train_, [test], spec, base, rounds * epochs)[0] for train_, test in depts],
        }
        if momentum:  # what plain FedAvg (no server momentum) reaches with the same schedule
            results["fedavg_plain"] = federate("fedavg", depts, base, spec, rounds, schema_file, 0.0)
    means = {m: float(np.mean([_primary(r, metric) for r in rows])) for m, rows in results.items()}
    better = max if metric == "accuracy" else min
    best = better(("fedper", "ditto"), key=lambda m: means[m])
    prefix = f"{dataset}_{split}"
    return {f"{prefix}_fedavg_{metric}": means["fedavg"], f"{prefix}_best_{metric}": means[best],
            f"{prefix}_central_{metric}": means["central"], f"{prefix}_local_{metric}": means["local"],
            f"{prefix}_best_method": best, f"{prefix}_fedper_{metric}": means["fedper"],
            f"{prefix}_ditto_{metric}": means["ditto"],
            **({f"{prefix}_fedavg_plain_{metric}": means["fedavg_plain"]} if "fedavg_plain" in means else {}),
            f"{prefix}_departments_test_rows": [len(t) for t in tests]}


def _job(job: tuple[str, str, int, int, int, int, int]) -> dict[str, Any]:
    dataset, split, count, seed, limit, rounds, epochs = job
    torch.set_num_threads(1)
    return compare(dataset, split, count=count, seed=seed, limit=limit, rounds=rounds, epochs=epochs)


def main() -> None:
    args = parser(__doc__).parse_args()
    seed, started = 0, time.perf_counter()
    count = 3 if args.smoke else 5
    figures: dict[str, Any] = {"seed": seed, "departments": count}
    jobs = []
    for dataset, settings in SETTINGS.items():
        rounds, epochs, limit = SMOKE[dataset] if args.smoke else (settings["rounds"], settings["epochs"], settings["limit"])
        figures.update({f"{dataset}_rounds": rounds, f"{dataset}_local_epochs": epochs, f"{dataset}_rows": limit or "all"})
        jobs += [(dataset, split, count, seed, limit, rounds, epochs) for split in ("iid", settings["skewed"])]
    with ProcessPoolExecutor(max_workers=min(2, os.cpu_count() or 1)) as pool:  # one job per core
        for result in pool.map(_job, jobs):
            figures.update(result)
    for dataset, settings in SETTINGS.items():
        metric, skewed = settings["metric"], settings["skewed"]
        fed, central = figures[f"{dataset}_iid_fedavg_{metric}"], figures[f"{dataset}_iid_central_{metric}"]
        figures[f"{dataset}_iid_fedavg_vs_central_ok"] = bool(
            central - fed <= 0.02 if metric == "accuracy" else fed <= 1.05 * central)
        best, local, fedavg = (figures[f"{dataset}_{skewed}_{m}_{metric}"] for m in ("best", "local", "fedavg"))
        figures[f"{dataset}_{skewed}_best_ok"] = bool(
            best >= local and best >= fedavg if metric == "accuracy" else best <= local and best <= fedavg)
    figures["seconds"] = time.perf_counter() - started
    figures["peak_rss_mb"] = peak_rss_mb()
    report(figures, as_json=args.json)


if __name__ == "__main__":
    main()
