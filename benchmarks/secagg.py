"""What secure aggregation costs per round: plaintext vs QuorumFL masking vs Flower's SecAgg+.

One invocation, one federation (SuperLink + N SuperNodes as processes on 127.0.0.1, Flower's
deployment engine), one model (``mlp-wide``, ~1.1M parameters, on digits, IID split), one local
epoch per round, then four runs one after the other on the same nodes:

1. QuorumFL, plaintext FedAvg;
2. QuorumFL, ``secure-aggregation = "masking"`` (t = 0.6·N; key setup once, in round 1);
3. Flower's ``SecAggPlusWorkflow`` on the legacy API (``flower_secaggplus_app.py``), complete graph,
   reconstruction threshold 0.6·N, the same model, data and local training, with torch imported only
   for training (as QuorumFL's ClientApp does) — the strongest baseline;
4. the same Flower app written the usual way, torch imported at module load
   (``flower_secaggplus_eager.py``), so each of its stage messages pays for the import.

Per-round wall time is the median over rounds. For QuorumFL it is the round's recorded phases
(key setup if any, train round trip, unmask round trip, aggregation, evaluation, storing); for Flower
it is the fit workflow (its four stages plus aggregation). The key setup of QuorumFL's first round is
reported on its own (``masked_setup_s``); with ≥ 3 rounds the median is a round without it.

    python benchmarks/secagg.py                 # 10 nodes, 5 rounds each, ~1.1M params
    python benchmarks/secagg.py --smoke         # 3 nodes, 1 round each, small MLP
    python benchmarks/secagg.py --json          # last line: one JSON object

Keys: plain_round_s, masked_round_s, flower_secaggplus_round_s (run 3), masked_over_plain,
overhead_ratio = (flower − plain) / (masked − plain), null when masked ≤ plain (the overhead is then
below the run's noise; masked_minus_plain_s and flower_minus_plain_s give the differences);
overhead_goal_met: Flower's overhead is positive and ours is at most a fifth of it
(masked − plain ≤ (flower − plain) / 5, the goal stated without dividing by a difference that noise can
make zero or negative); masked_secure_stages_s: the masking-only round trips measured inside the masked
rounds (unmask + consistency, medians), and overhead_ratio_stages = (flower − plain) / that; flower_secaggplus_eager_round_s and
overhead_ratio_eager for run 4; masked_setup_s, masked_unmask_s, masked_confirm_s (the consistency
round trip of a signed epoch, which local federations are since they run with node keys; a round
with no dropout on the complete graph skips it, so this is 0 unless a node dropped), signed_bytes
(what signing adds per node when the consistency stage runs), per-round lists, peak RSS, and what
the node-side checks against the admin's signature add per round and per run
(``_common.signed_checks_cost``: signed_checks_s_per_round, signed_bytes_per_round, …).
"""

from __future__ import annotations

import statistics

from _cli import parser as make_parser
from _cli import peak_rss_mb, report
from _common import (
    baseline_fab,
    baseline_rounds,
    bench_federation,
    quorumfl_rounds,
    round_seconds,
    signed_checks_cost,
    sizes,
)

FILES = ["flower_secaggplus_app.py", "flower_secaggplus_eager.py"]


def signed_step_bytes(n: int, department: str = "department-00") -> dict[str, int]:
    """Bytes the signed protocol adds per node, from the wire fields and a real P-384 signature:
    per key set-up the advertisement's signature and name (up) and every peer's (down, complete
    graph); per round the consistency stage (the view down, a signature up) and the n signatures
    the unmask request then carries."""
    from cryptography.hazmat.primitives.asymmetric import ec

    from quorumfl.aggregation.secagg.identity import sign

    signature = len(sign(ec.generate_private_key(ec.SECP384R1()), b"x" * 64))  # DER, 102-104 bytes
    ids, name = 8 * n, len(department.encode())
    return {
        "setup_up": signature + name,
        "setup_down": n * (signature + name),
        "confirm_down": 16 + 4 + ids + 16,  # epoch, slot, the view's ids, its two sizes
        "confirm_up": signature,
        "unmask_down_extra": n * (8 + signature),
    }


def main() -> None:
    parser = make_parser(__doc__ or "")
    size = sizes(parser)
    nodes, rounds = size.nodes, size.rounds
    with bench_federation(size) as bench:
        plain = quorumfl_rounds(bench.federation, bench.repo, {**bench.ours, "secure-aggregation": "none"})
        masked = quorumfl_rounds(bench.federation, bench.repo, {**bench.ours, "secure-aggregation": "masking",
                                                                "secagg-threshold": 0.6})
        baseline = {**size.common, "num-nodes": nodes, "threshold": 0.6, "stage-timeout": 900.0}
        runs = []
        for module, timings in (("flower_secaggplus_app", bench.home / "flower-lazy.jsonl"),
                                ("flower_secaggplus_eager", bench.home / "flower-eager.jsonl")):
            fab = baseline_fab("flower-secaggplus-baseline", module, FILES, {**baseline, "timings-file": str(timings)})
            runs.append(baseline_rounds(bench.federation, fab, timings, rounds))
        flower, eager = runs

    plain_s = statistics.median(round_seconds(t) for t in plain)
    masked_s = statistics.median(round_seconds(t) for t in masked)
    flower_s = statistics.median(flower)
    eager_s = statistics.median(eager)
    stages_s = (statistics.median(t.get("secagg-unmask", 0.0) for t in masked)
                + statistics.median(t.get("secagg-confirm", 0.0) for t in masked))
    report(
        {
            "nodes": nodes,
            "rounds": rounds,
            "model": size.model,
            "params": size.params,
            "plain_round_s": plain_s,
            "masked_round_s": masked_s,
            "flower_secaggplus_round_s": flower_s,
            "masked_over_plain": masked_s / plain_s,
            # None when the masked median is not above the plaintext one: the overhead is then below
            # this run's round-to-round noise and a ratio says nothing (JSON has no infinity).
            "overhead_ratio": (flower_s - plain_s) / (masked_s - plain_s) if masked_s > plain_s else None,
            "masked_minus_plain_s": masked_s - plain_s,
            "flower_minus_plain_s": flower_s - plain_s,
            "overhead_goal_met": flower_s > plain_s and masked_s - plain_s <= (flower_s - plain_s) / 5,
            "masked_secure_stages_s": stages_s,
            "overhead_ratio_stages": (flower_s - plain_s) / stages_s if stages_s > 0 else None,
            "flower_secaggplus_eager_round_s": eager_s,
            "overhead_ratio_eager": (eager_s - plain_s) / (masked_s - plain_s) if masked_s > plain_s else None,
            "masked_setup_s": masked[0].get("secagg-setup", 0.0),
            "masked_unmask_s": statistics.median(t.get("secagg-unmask", 0.0) for t in masked),
            "masked_confirm_s": statistics.median(t.get("secagg-confirm", 0.0) for t in masked),
            "signed_bytes": signed_step_bytes(nodes),
            "plain_rounds_s": [round(round_seconds(t), 2) for t in plain],
            "masked_rounds_s": [round(round_seconds(t), 2) for t in masked],
            "flower_rounds_s": [round(s, 2) for s in flower],
            "flower_eager_rounds_s": [round(s, 2) for s in eager],
            "bench_peak_rss_mb": peak_rss_mb(),
            **signed_checks_cost(nodes),
        },
        as_json=size.as_json,
    )


if __name__ == "__main__":
    main()
