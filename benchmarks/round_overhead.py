"""Where a plaintext round's time goes on Flower's deployment engine (real processes, loopback).

A SuperLink and N SuperNodes run as processes on 127.0.0.1; a run of the QuorumFL app trains a
~1.1M-parameter MLP (``mlp-wide`` on digits, IID split). Per round, from the timings the ServerApp
records in the state DB:

- ``round_s``: send → replies → aggregate → evaluate → store, wall clock
- ``train_s``: local training, the slowest node (each node times its own training)
- ``transport_s``: the train phase minus ``train_s`` — messaging, Flower's polling, the fresh
  ClientApp process per message (imports, reading the partition), (de)serialisation
- ``aggregate_s``: validating and averaging the updates on the server

Figures are means over the rounds after the first (the first also pays one-off start-up costs).

    python benchmarks/round_overhead.py              # 10 nodes, 3 rounds, ~1.1M params
    python benchmarks/round_overhead.py --smoke      # 2 nodes, 2 rounds, small MLP
    python benchmarks/round_overhead.py --json       # last line: one JSON object
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from _common import parser as make_parser
from _common import peak_rss_mb, report
from quorumfl.client.data import prepare_partitions
from quorumfl.client.models import build_model
from quorumfl.server.local import local_federation
from quorumfl.server.services import follow_run
from quorumfl.server.state.database import connect
from quorumfl.server.state.repository import Repository, RoundStatus


def main() -> None:
    parser = make_parser(__doc__ or "")
    parser.add_argument("--nodes", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="mlp-wide")
    args = parser.parse_args()
    nodes, rounds, model = (2, 2, "mlp") if args.smoke else (args.nodes, args.rounds, args.model)
    params = sum(p.numel() for p in build_model(model, (1, 8, 8), 10).parameters())

    with tempfile.TemporaryDirectory(prefix="quorumfl-bench-") as tmp:
        home = Path(tmp)
        db_url = f"sqlite:///{home / 'state.db'}"
        repo = Repository(connect(db_url, migrate=True))
        names = [f"dept-{i:02d}" for i in range(nodes)]
        parts = prepare_partitions(home / "data", names, method="iid", seed=0)
        started = time.perf_counter()
        with local_federation(home, parts, db_url=db_url) as federation:
            up_s = time.perf_counter() - started
            flower_run_id = federation.control.start_run(
                {"model": model, "num-rounds": rounds, "local-epochs": 1, "min-nodes": 2,
                 "strategy": "fedavg", "start-from": "fresh", "state-url": db_url,
                 "model-dir": str(home / "models"), "round-timeout": 600.0}
            )
            run = follow_run(repo, flower_run_id, timeout=1800, alive=lambda: federation.alive(flower_run_id))
        if run.status != "completed":
            raise SystemExit(f"run ended {run.status}: {run.error}")
        done = [r for r in run.rounds if r.status == RoundStatus.COMPLETED]
        measured = done[1:] or done
        rss = [m.value for m in repo.metrics(run.id, name="server-peak-rss-mb")]

        def mean(key: str) -> float:
            return statistics.fmean(r.timings.get(key, 0.0) for r in measured)

        round_s = statistics.fmean(sum(v for k, v in r.timings.items() if k != "local_train_max") for r in measured)
        report(
            {
                "nodes": nodes,
                "rounds": rounds,
                "model": model,
                "params": params,
                "round_s": round_s,
                "train_s": mean("local_train_max"),
                "transport_s": mean("train") - mean("local_train_max"),
                "aggregate_s": mean("aggregate"),
                "evaluate_s": mean("evaluate"),
                "store_s": mean("store"),
                "node_failures": sum(len(r.failures) for r in run.rounds),
                "rounds_completed": len(done),
                "first_round_s": sum(v for k, v in done[0].timings.items() if k != "local_train_max"),
                "federation_start_s": up_s,
                "server_peak_rss_mb": max(rss) if rss else -1.0,
                "bench_peak_rss_mb": peak_rss_mb(),
            },
            as_json=args.json,
        )


if __name__ == "__main__":
    main()
