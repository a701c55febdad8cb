"""Uplink compression: bytes per node and final accuracy for none, top-k 1 %, sign, 8-bit and shared random-k.

Ten departments hold Dirichlet(0.3) label-skewed shares of Fashion-MNIST's training set; the model is
evaluated on the official test set after the last round. Every scheme gets the same seeds, rounds,
local epochs, batch size, learning rate and model (FedAvg, all departments every round). Each
department trains with ``client.node_round.train_round`` (what the ClientApp runs), encodes
``trained − received`` with error feedback (``aggregation.compression.ErrorFeedback``, as the
ClientApp does) into the reply's wire records (``protocol.wire.encode_update``); the server side decodes
them with ``protocol.wire.decode_update`` and averages with ``server.strategies.FedAvg``. Bytes are the
wire size of the update's Flower Arrays (numbers plus one ~128-byte header per Array), as the server
records them. No full-precision sync rounds here (``compression-sync-every = 0``). Top-k keeps 1 % of
the whole update (global top-k, as the product does); shared random-k keeps 10 % by default
(``--randk-fraction``): at 1 % a coordinate moves once in ~100 rounds, and after 30 rounds a 1 %
run had reached only 0.21 accuracy.

    python benchmarks/compression.py            # Fashion-MNIST, 10 departments, α = 0.3, 30 rounds
    python benchmarks/compression.py --smoke    # digits, 4 departments, 3 rounds
    python benchmarks/compression.py --json     # last line: one JSON object

``topk_warmup`` is top-k 1 % after a warm-up (``compression-warmup-rounds = 3``: 25 %, 6.25 % and
1.5625 % in rounds 1–3, as in Deep Gradient Compression); ``topk`` keeps 1 % from round 1.

Keys: none_acc, topk_acc, sign_acc, int8_acc, shared_randk_acc, topk_byte_reduction, topk_acc_loss_pts,
plus topk_warmup_acc, <scheme>_bytes_per_node_round, <scheme>_byte_reduction, <scheme>_acc_loss_pts,
goal_topk_50x_within_1pt, goal_topk_warmup_50x_within_1pt, seconds, peak RSS.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from _cli import parser, peak_rss_mb, report
from _common import department_split, fedavg_start
from quorumfl.aggregation import NodeUpdate
from quorumfl.aggregation.compression import ErrorFeedback, Scheme, warmup_fraction
from quorumfl.client.node_round import train_round
from quorumfl.core.models import arrays_to_model
from quorumfl.protocol.wire import TrainConfig, decode_update, encode_update
from quorumfl.training.local import evaluate

SCHEMES = {"none": Scheme.NONE, "topk": Scheme.TOPK, "topk_warmup": Scheme.TOPK, "sign": Scheme.SIGN,
           "int8": Scheme.INT8, "shared_randk": Scheme.RANDK}


@dataclass(frozen=True)
class Setup:
    dataset: str
    departments: int
    alpha: float
    rounds: int
    local_epochs: int
    batch_size: int
    learning_rate: float
    model: str
    fraction: float  # top-k
    randk_fraction: float  # shared random-k
    seed: int
    warmup_rounds: int = 3  # topk_warmup


def run_scheme(name: str, setup: Setup) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    started = time.perf_counter()
    depts, test = department_split(setup.dataset, setup.departments, alpha=setup.alpha, seed=setup.seed)
    strategy, model, global_arrays = fedavg_start(setup.model, test, setup.seed)
    shapes = {k: v.shape for k, v in global_arrays.items()}
    fraction = setup.randk_fraction if name == "shared_randk" else setup.fraction
    residuals: list[dict[str, np.ndarray] | None] = [None] * len(depts)
    base = TrainConfig(server_round=0, model=setup.model, local_epochs=setup.local_epochs, batch_size=setup.batch_size,
                       learning_rate=setup.learning_rate, proximal_mu=0.0, seed=setup.seed,
                       compression=SCHEMES[name].value, compression_fraction=fraction)
    sent: list[int] = []
    history: list[float] = []
    rng = np.random.default_rng(setup.seed)
    for number in range(1, setup.rounds + 1):
        warmup = setup.warmup_rounds if name == "topk_warmup" else 0
        config = replace(base, server_round=number, compression_seed=int(rng.integers(2**31)),
                         compression_fraction=warmup_fraction(fraction, number, warmup))
        feedback = ErrorFeedback(SCHEMES[name], config.compression_fraction)
        updates = []
        for i, data in enumerate(depts):
            work = train_round(config, [global_arrays], None, data, data.subset(np.arange(min(len(data), 64))))
            delta = {k: work.shared[k].astype(np.float32) - global_arrays[k].astype(np.float32) for k in global_arrays}
            encoded, residuals[i] = feedback.step(delta, residuals[i], seed=config.compression_seed)
            record, layout = encode_update(encoded, config)
            sent.append(sum(len(a.data) for a in record.values()))
            decoded = decode_update(record, layout, shapes)  # what the server gets
            arrays = {k: global_arrays[k] + decoded[k] for k in global_arrays}
            updates.append(NodeUpdate(node=str(i), arrays=arrays, weight=float(work.num_examples)))
        result = strategy.aggregate_train(global_arrays, updates)
        if result.arrays is None:
            raise RuntimeError(f"{name} round {number}: every update was rejected ({result.rejected})")
        global_arrays = result.arrays
        arrays_to_model(model, global_arrays)
        history.append(evaluate(model, test).accuracy)
    return {"scheme": name, "accuracy": history[-1], "history": history,
            "bytes_per_node_round": float(np.mean(sent)), "seconds": time.perf_counter() - started,
            "peak_rss_mb": peak_rss_mb()}


def _job(args: tuple[str, Setup]) -> dict[str, Any]:
    return run_scheme(*args)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--local-epochs", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=min(os.cpu_count() or 1, 6), help="schemes run in parallel")
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--topk-fraction", type=float, default=0.01, help="entries kept by top-k (the issue's 1 %%)")
    ap.add_argument("--topk-warmup-rounds", type=int, default=3,
                    help="topk_warmup keeps 25 %%, 6.25 %%, ... in its first rounds (compression-warmup-rounds)")
    ap.add_argument("--randk-fraction", type=float, default=0.1,
                    help="coordinates kept by shared random-k (1 %% moves each coordinate once in ~100 rounds)")
    args = ap.parse_args()
    if args.smoke:
        setup = Setup("digits", 4, 0.3, 3, 1, 32, 0.05, "mlp", 0.01, args.randk_fraction, args.seed)
    else:
        setup = Setup("fashion-mnist", 10, 0.3, 30, 1, 32, 0.05, "mlp", 0.01, args.randk_fraction, args.seed)
    setup = replace(setup, rounds=args.rounds or setup.rounds, local_epochs=args.local_epochs or setup.local_epochs,
                    fraction=args.topk_fraction, warmup_rounds=args.topk_warmup_rounds)
    names = [n for n in SCHEMES if n in args.schemes.split(",")]
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=max(1, args.workers)) as pool:
        results = {r["scheme"]: r for r in pool.map(_job, [(n, setup) for n in names])}
    print(f"setup: {setup}")
    print(f"{'scheme':<13} {'accuracy':>8} {'bytes/node/round':>17} {'reduction':>9} {'s':>6}")
    none = results.get("none")
    for n, r in results.items():
        reduction = none["bytes_per_node_round"] / r["bytes_per_node_round"] if none else float("nan")
        print(f"{n:<13} {r['accuracy']:8.4f} {r['bytes_per_node_round']:17.0f} {reduction:9.1f} {r['seconds']:6.0f}")
    for n, r in results.items():
        print(f"{n:<13} accuracy per round {[round(a, 3) for a in r['history']]}")
    figures: dict[str, Any] = {f"{n}_acc": r["accuracy"] for n, r in results.items()}
    for n, r in results.items():
        figures[f"{n}_bytes_per_node_round"] = r["bytes_per_node_round"]
        if none is not None:
            figures[f"{n}_byte_reduction"] = none["bytes_per_node_round"] / r["bytes_per_node_round"]
            figures[f"{n}_acc_loss_pts"] = 100 * (none["accuracy"] - r["accuracy"])
    for n in ("topk", "topk_warmup"):
        if f"{n}_byte_reduction" in figures:
            figures[f"goal_{n}_50x_within_1pt"] = bool(figures[f"{n}_byte_reduction"] >= 50
                                                        and figures[f"{n}_acc_loss_pts"] <= 1.0)
    figures["peak_rss_mb_max_worker"] = max(r["peak_rss_mb"] for r in results.values())
    figures["wall_seconds"] = time.perf_counter() - started
    report(figures, as_json=args.json)


if __name__ == "__main__":
    main()
