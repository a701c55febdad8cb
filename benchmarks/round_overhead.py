"""What a round costs beyond local training: a bare Flower app against QuorumFL's plaintext, masking and CKKS rounds.

One invocation: SuperLinks and N SuperNodes as processes on 127.0.0.1 (TLS, node authentication and
admin-signed apps on, as ``quorumfl demo`` deploys them), a ~1.1M-parameter MLP (``mlp-wide`` on
digits, IID split, one local epoch). Six runs one after the other:

1. a bare Flower Message-API app written as Flower's own examples are (``flower_fedavg_app.py``:
   ``flwr.serverapp.strategy.FedAvg`` and ``strategy.start``, torch imported at module level, no
   evaluation, nothing stored), training the same model with the same local training, on SuperNodes
   as Flower runs them out of the box (``stock_federation``: a fresh ``flwr-clientapp`` process per
   message, Flower's 3 s poll; the same departments' data). This is the baseline of
   ``quorumfl_over_flower``: what a Flower user's round costs;
2. the same Flower app on QuorumFL's nodes (``bench_federation``: warm ClientApps, 0.5 s poll), the
   baseline of ``quorumfl_over_flower_warm``: what is left once both have the same nodes. Runs 2–5
   share these nodes;
3. QuorumFL, plaintext FedAvg (validation, central evaluation, state DB, model store);
4. QuorumFL, ``secure-aggregation = "masking"`` (t = 0.6·N; key set-up in round 1);
5. QuorumFL, ``secure-aggregation = "ckks"`` (t = 0.6·N; key ceremony in round 1);
6. QuorumFL, plaintext again. The plaintext figures are over the rounds of runs 3 and 6, which
   bracket the secure runs: a VM whose speed drifts during the invocation (these do, by a third
   within minutes) then shifts the denominator of ``masked_over_plain`` and ``ckks_over_plain`` by
   about what it shifted the secure runs, instead of leaving the plaintext run at the start alone.
   ``plain_before_round_s`` and ``plain_after_round_s`` show the drift.

Per mode: the round time (median over rounds; with ≥ 3 rounds, a round without the set-up), the
slowest node's local training as each node timed it, and the overhead = round − slowest training.
QuorumFL's rounds include evaluation and storing; Flower's are configure → aggregate.

    python benchmarks/round_overhead.py --json            # 10 nodes, 3 rounds per run, ~1.1M params
    python benchmarks/round_overhead.py --smoke --json    # 3 nodes, 1 round, small MLP

Keys: flower_round_s, flower_train_s, flower_overhead_s (stock nodes); flower_warm_round_s,
flower_warm_train_s, flower_warm_overhead_s (QuorumFL's nodes); plain_round_s, plain_train_s,
plain_overhead_s (over runs 3 and 6), plain_before_round_s, plain_after_round_s; masked_round_s,
masked_overhead_s; ckks_round_s, ckks_overhead_s;
quorumfl_over_flower (plain / Flower round on stock nodes), quorumfl_over_flower_warm (plain / Flower
round on QuorumFL's nodes), masked_over_plain, ckks_over_plain; plain_aggregate_s, plain_evaluate_s,
plain_store_s (the server's own steps); per-round lists, and each round's recorded stages
(``plain_stages_s``, ``masked_stages_s``, ``ckks_stages_s``: train, the secure stages, evaluate, store,
the slowest node's training), so a slow round shows where its time went; server peak RSS; and what
the node-side checks against the admin's signature add (``_common.signed_checks_cost``:
signed_admit_s_per_task, signed_params_check_s_per_epoch, signed_checks_s_per_round,
signed_bytes_per_round, signed_stamp_bytes_per_run, signed_token_bytes_per_call).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from _cli import parser as make_parser
from _cli import peak_rss_mb, report
from _common import (
    Sizes,
    baseline_fab,
    baseline_rounds,
    bench_federation,
    quorumfl_rounds,
    round_seconds,
    signed_checks_cost,
    sizes,
    stock_federation,
)
from quorumfl.deploy.local import LocalFederation


def _quorumfl(name: str, rounds: list[dict[str, float]]) -> dict[str, Any]:
    seconds = [round_seconds(t) for t in rounds]
    train = [t.get("local_train_max", 0.0) for t in rounds]
    median = statistics.median(seconds)
    slowest = statistics.median(train)
    return {f"{name}_round_s": median, f"{name}_train_s": slowest, f"{name}_overhead_s": median - slowest,
            f"{name}_rounds_s": [round(s, 2) for s in seconds],
            f"{name}_stages_s": [{k: round(v, 2) for k, v in t.items()} for t in rounds]}


def _flower_rounds(home: Path, federation: LocalFederation, size: Sizes) -> list[dict[str, float]]:
    """The bare Flower app's rounds (``round_s``, ``train_s``) on ``federation``'s nodes."""
    timings = home / "flower-fedavg.jsonl"
    timings.unlink(missing_ok=True)
    fab = baseline_fab("flower-fedavg-baseline", "flower_fedavg_app", ["flower_fedavg_app.py"],
                       {**size.common, "num-nodes": size.nodes, "round-timeout": 900.0, "timings-file": str(timings)})
    baseline_rounds(federation, fab, timings, size.rounds)
    return [json.loads(line) for line in timings.read_text().splitlines()]


def main() -> None:
    parser = make_parser(__doc__ or "")
    size = sizes(parser, rounds=3)
    figures: dict[str, Any] = {"nodes": size.nodes, "rounds": size.rounds, "model": size.model, "params": size.params,
                               "tls": True}
    with stock_federation(size) as (stock_home, stock):
        flower = _flower_rounds(stock_home, stock, size)
    with bench_federation(size) as bench:
        flower_warm = _flower_rounds(bench.home, bench.federation, size)
        plain = quorumfl_rounds(bench.federation, bench.repo, {**bench.ours, "secure-aggregation": "none"})
        masked = quorumfl_rounds(bench.federation, bench.repo, {**bench.ours, "secure-aggregation": "masking",
                                                                "secagg-threshold": 0.6})
        ckks = quorumfl_rounds(bench.federation, bench.repo, {**bench.ours, "secure-aggregation": "ckks",
                                                              "secagg-threshold": 0.6, "secagg-stage-timeout": 900.0})
        plain_after = quorumfl_rounds(bench.federation, bench.repo, {**bench.ours, "secure-aggregation": "none"})
        rss = [m.value for run in bench.repo.list_runs() for m in bench.repo.metrics(run.id, name="server-peak-rss-mb")]

    for name, rounds in (("flower", flower), ("flower_warm", flower_warm)):
        round_s = statistics.median(r["round_s"] for r in rounds)
        train_s = statistics.median(r["train_s"] for r in rounds)
        figures.update({f"{name}_round_s": round_s, f"{name}_train_s": train_s, f"{name}_overhead_s": round_s - train_s,
                        f"{name}_rounds_s": [round(r["round_s"], 2) for r in rounds]})
    figures.update(_quorumfl("plain", plain + plain_after))
    figures.update({"plain_before_round_s": statistics.median(round_seconds(t) for t in plain),
                    "plain_after_round_s": statistics.median(round_seconds(t) for t in plain_after)})
    figures.update(_quorumfl("masked", masked))
    figures.update(_quorumfl("ckks", ckks))
    figures.update({
        "quorumfl_over_flower": figures["plain_round_s"] / figures["flower_round_s"],
        "quorumfl_over_flower_warm": figures["plain_round_s"] / figures["flower_warm_round_s"],
        "masked_over_plain": figures["masked_round_s"] / figures["plain_round_s"],
        "ckks_over_plain": figures["ckks_round_s"] / figures["plain_round_s"],
        "plain_aggregate_s": statistics.median(t.get("aggregate", 0.0) for t in plain),
        "plain_evaluate_s": statistics.median(t.get("evaluate", 0.0) for t in plain),
        "plain_store_s": statistics.median(t.get("store", 0.0) for t in plain),
        "server_peak_rss_mb": max(rss) if rss else -1.0,
        "bench_peak_rss_mb": peak_rss_mb(),
    })
    figures.update(signed_checks_cost(size.nodes))
    report(figures, as_json=size.as_json)


if __name__ == "__main__":
    main()
