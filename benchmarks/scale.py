"""A federation of many departments on Flower's simulation engine: rounds, stages and server memory.

``quorumfl simulate``'s service (``deploy/simulation.py``) runs the same ServerApp and ClientApp on N
virtual departments: Fashion-MNIST (Debian ``dataset-fashion-mnist``) split IID, the ``mlp`` model
(109,386 parameters), one local epoch, FedAvg. One invocation runs, one after the other, plaintext
and masking at N departments (default 1,000) and CKKS at a tenth of them (default 100). Each run
starts its own Ray instance; the first round of a run holds Ray's start and the masking key set-up
(or the CKKS key ceremony), so the per-round figures are the median of the rounds after it.

    python benchmarks/scale.py --json                 # 1,000 departments (CKKS: 100), 3 rounds each
    python benchmarks/scale.py --smoke --json         # 6 departments on digits (CKKS: 4), 2 rounds

Keys: departments, ckks_departments, params, plain_round_s, masked_round_s, masked_over_plain,
ckks_round_s, ckks_over_plain (CKKS at its own N against plaintext at N), stage_seconds (per mode: the
median seconds of each recorded stage), first_round_s (per mode), server_peak_rss_mb (the largest
the ServerApp's process reported: the driver, whose Ray client and the ServerApp share it, and in
which Flower's simulation engine keeps every virtual node's state; each mode runs in a fresh
process of its own, so server_peak_rss_mb_by_mode is each mode's own peak),
memory_goal_mb (4 × the model's float64 bytes + 1 GB), masked_goal_met, memory_goal_met,
errors (per mode, why a run's rounds failed: its figures are then null), elapsed_s.
"""

from __future__ import annotations

import multiprocessing
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from _cli import parser as make_parser
from _cli import report
from quorumfl.core.models import build_model
from quorumfl.deploy.simulation import SimulationSettings, simulate
from quorumfl.errors import QuorumError
from quorumfl.server.state.database import connect
from quorumfl.server.state.repository import Repository, RoundStatus


def _mode(db_url: str, home: Path, departments: int, config: dict[str, Any], name: str) -> dict[str, Any]:
    """One simulated run's figures, or ``{"error": why}`` when a round of it failed (reported, not hidden)."""
    root = home / f"sim-{name}"
    repo = Repository(connect(db_url, migrate=False))
    try:
        run = simulate(config, SimulationSettings(departments=departments, root=root), repo)
    except QuorumError as exc:
        return {"error": str(exc)}
    if run.status != "completed" or any(r.status != RoundStatus.COMPLETED for r in run.rounds):
        return {"error": f"run ended {run.status}: {run.error}; rounds "
                         f"{[(r.number, r.status, r.error) for r in run.rounds]}"}
    seconds = [sum(v for k, v in r.timings.items() if k != "local_train_max") for r in run.rounds]
    later = run.rounds[1:] or run.rounds
    stages = sorted({k for r in later for k in r.timings if k != "local_train_max"})
    rss = [m.value for m in repo.metrics(run.id, name="server-peak-rss-mb")]
    return {
        "round_s": statistics.median(seconds[1:] or seconds),
        "first_round_s": seconds[0],
        "rounds_s": [round(s, 2) for s in seconds],
        "stage_seconds": {k: round(statistics.median(r.timings.get(k, 0.0) for r in later), 3) for k in stages},
        "participants": [len(r.participants) for r in run.rounds],
        "server_peak_rss_mb": max(rss) if rss else -1.0,
    }


def _fresh(db_url: str, home: Path, departments: int, config: dict[str, Any], name: str) -> dict[str, Any]:
    """``_mode`` in a new process (spawned, not forked): its peak RSS is that mode's alone, not the
    high-water mark of the modes before it."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_mode, db_url, home, departments, config, name).result()


def main() -> None:
    parser = make_parser(__doc__ or "")
    parser.add_argument("--departments", type=int, default=1000)
    parser.add_argument("--ckks-departments", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.smoke:
        departments, ckks_departments, rounds, dataset = 6, 4, 2, "digits"
    else:
        departments, ckks_departments, rounds, dataset = args.departments, args.ckks_departments, args.rounds, "fashion-mnist"
    shape = (1, 8, 8) if dataset == "digits" else (1, 28, 28)
    params = sum(p.numel() for p in build_model("mlp", shape, 10).parameters())
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="quorumfl-scale-") as tmp:
        home = Path(tmp)
        db_url = f"sqlite:///{home / 'state.db'}"
        Repository(connect(db_url, migrate=True))  # the schema, once; each mode's process connects anew
        base = {"dataset": dataset, "model": "mlp", "strategy": "fedavg", "num-rounds": rounds, "local-epochs": 1,
                "batch-size": 32, "learning-rate": 0.05, "seed": 0, "start-from": "fresh", "min-nodes": 2,
                "state-url": db_url, "model-dir": str(home / "models"), "round-timeout": 3600.0,
                "node-wait-timeout": 600.0, "secagg-stage-timeout": 3600.0}
        plain = _fresh(db_url, home, departments, {**base, "secure-aggregation": "none"}, "plain")
        masked = _fresh(db_url, home, departments, {**base, "secure-aggregation": "masking"}, "masked")
        small_plain = plain if ckks_departments == departments else _fresh(
            db_url, home, ckks_departments, {**base, "secure-aggregation": "none"}, "plain-ckks-size")
        ckks = _fresh(db_url, home, ckks_departments, {**base, "secure-aggregation": "ckks", "secagg-threshold": 0.6},
                      "ckks")
    memory_goal = 4 * params * 8 / 2**20 + 1024
    modes = {"plain": plain, "masked": masked, "ckks": ckks}
    figures: dict[str, Any] = {
        "departments": departments, "ckks_departments": ckks_departments, "params": params, "rounds": rounds,
        "dataset": dataset, "memory_goal_mb": memory_goal, "elapsed_s": time.monotonic() - began,
        "errors": {k: m["error"] for k, m in {**modes, "plain_small": small_plain}.items() if "error" in m},
    }
    for key, mode in (("plain", plain), ("masked", masked), ("plain_small", small_plain), ("ckks", ckks)):
        figures[f"{key}_round_s"] = mode.get("round_s")
    for key in ("stage_seconds", "first_round_s", "rounds_s", "participants"):
        figures[key] = {name: mode.get(key) for name, mode in modes.items()}
    if "round_s" in plain and "round_s" in masked:
        figures["masked_over_plain"] = masked["round_s"] / plain["round_s"]
        figures["masked_goal_met"] = masked["round_s"] <= 2 * plain["round_s"]
    if "round_s" in small_plain and "round_s" in ckks:
        figures["ckks_over_plain"] = ckks["round_s"] / small_plain["round_s"]
    peaks = [m["server_peak_rss_mb"] for m in (plain, masked, small_plain, ckks) if "server_peak_rss_mb" in m]
    figures["server_peak_rss_mb"] = max(peaks) if peaks else None
    figures["server_peak_rss_mb_by_mode"] = {name: mode.get("server_peak_rss_mb") for name, mode in modes.items()}
    figures["memory_goal_met"] = bool(peaks) and max(peaks) <= memory_goal
    report(figures, as_json=args.json)


if __name__ == "__main__":
    main()
