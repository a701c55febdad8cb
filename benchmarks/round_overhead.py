"""What a round costs beyond local training: a bare Flower app against QuorumFL's plaintext, masking and CKKS rounds.

One invocation, one federation: a SuperLink and N SuperNodes as processes on 127.0.0.1 (TLS, node
authentication and admin-signed apps on, as ``quorumfl demo`` deploys them; warm ClientApps), a
~1.1M-parameter MLP (``mlp-wide`` on digits, IID split, one local epoch). Four runs one after the
other on the same nodes:

1. a bare Flower Message-API app written as Flower's own examples are (``flower_fedavg_app.py``:
   ``flwr.serverapp.strategy.FedAvg`` and ``strategy.start``, torch imported at module level, no
   evaluation, nothing stored), training the same model with the same local training;
2. QuorumFL, plaintext FedAvg (validation, central evaluation, state DB, model store);
3. QuorumFL, ``secure-aggregation = "masking"`` (t = 0.6·N; key set-up in round 1);
4. QuorumFL, ``secure-aggregation = "ckks"`` (t = 0.6·N; key ceremony in round 1).

Per mode: the round time (median over rounds; with ≥ 3 rounds, a round without the set-up), the
slowest node's local training as each node timed it, and the overhead = round − slowest training.
QuorumFL's rounds include evaluation and storing; Flower's are configure → aggregate.

    python benchmarks/round_overhead.py --json            # 10 nodes, 3 rounds per run, ~1.1M params
    python benchmarks/round_overhead.py --smoke --json    # 3 nodes, 1 round, small MLP

Keys: flower_round_s, flower_train_s, flower_overhead_s; plain_round_s, plain_train_s,
plain_overhead_s; masked_round_s, masked_overhead_s; ckks_round_s, ckks_overhead_s;
quorumfl_over_flower (plain / Flower round), masked_over_plain, ckks_over_plain; plain_aggregate_s,
plain_evaluate_s, plain_store_s (the server's own steps); per-round lists; server peak RSS.
"""

from __future__ import annotations

import json
import statistics
from typing import Any

from _common import (
    baseline_fab,
    baseline_rounds,
    bench_federation,
    peak_rss_mb,
    quorumfl_rounds,
    report,
    round_seconds,
    sizes,
)
from _common import parser as make_parser


def _quorumfl(name: str, rounds: list[dict[str, float]]) -> dict[str, Any]:
    seconds = [round_seconds(t) for t in rounds]
    train = [t.get("local_train_max", 0.0) for t in rounds]
    median = statistics.median(seconds)
    slowest = statistics.median(train)
    return {f"{name}_round_s": median, f"{name}_train_s": slowest, f"{name}_overhead_s": median - slowest,
            f"{name}_rounds_s": [round(s, 2) for s in seconds]}


def main() -> None:
    parser = make_parser(__doc__ or "")
    size = sizes(parser, rounds=3)
    figures: dict[str, Any] = {"nodes": size.nodes, "rounds": size.rounds, "model": size.model, "params": size.params,
                               "tls": True}
    with bench_federation(size) as bench:
        timings = bench.home / "flower-fedavg.jsonl"
        fab = baseline_fab("flower-fedavg-baseline", "flower_fedavg_app", ["flower_fedavg_app.py"],
                           {**size.common, "num-nodes": size.nodes, "round-timeout": 900.0,
                            "timings-file": str(timings)})
        baseline_rounds(bench.federation, fab, timings, size.rounds)
        flower = [json.loads(line) for line in timings.read_text().splitlines()]
        plain = quorumfl_rounds(bench.federation, bench.repo, {**bench.ours, "secure-aggregation": "none"})
        masked = quorumfl_rounds(bench.federation, bench.repo, {**bench.ours, "secure-aggregation": "masking",
                                                                "secagg-threshold": 0.6})
        ckks = quorumfl_rounds(bench.federation, bench.repo, {**bench.ours, "secure-aggregation": "ckks",
                                                              "secagg-threshold": 0.6, "secagg-stage-timeout": 900.0})
        rss = [m.value for run in bench.repo.list_runs() for m in bench.repo.metrics(run.id, name="server-peak-rss-mb")]

    flower_s = statistics.median(r["round_s"] for r in flower)
    flower_train = statistics.median(r["train_s"] for r in flower)
    figures.update({"flower_round_s": flower_s, "flower_train_s": flower_train, "flower_overhead_s": flower_s - flower_train,
                    "flower_rounds_s": [round(r["round_s"], 2) for r in flower]})
    figures.update(_quorumfl("plain", plain))
    figures.update(_quorumfl("masked", masked))
    figures.update(_quorumfl("ckks", ckks))
    figures.update({
        "quorumfl_over_flower": figures["plain_round_s"] / flower_s,
        "masked_over_plain": figures["masked_round_s"] / figures["plain_round_s"],
        "ckks_over_plain": figures["ckks_round_s"] / figures["plain_round_s"],
        "plain_aggregate_s": statistics.median(t.get("aggregate", 0.0) for t in plain),
        "plain_evaluate_s": statistics.median(t.get("evaluate", 0.0) for t in plain),
        "plain_store_s": statistics.median(t.get("store", 0.0) for t in plain),
        "server_peak_rss_mb": max(rss) if rss else -1.0,
        "bench_peak_rss_mb": peak_rss_mb(),
    })
    report(figures, as_json=size.as_json)


if __name__ == "__main__":
    main()
