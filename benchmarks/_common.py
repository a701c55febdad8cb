"""Helpers shared by the benchmark scripts: peak RSS, JSON-as-last-line output, a small table, and
running QuorumFL or a baseline Flower app (its own FAB) on a local federation."""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w

from quorumfl.core.data import prepare_partitions
from quorumfl.core.models import build_model
from quorumfl.deploy.local import LocalFederation, local_federation
from quorumfl.server.services import follow_run
from quorumfl.server.state.database import connect
from quorumfl.server.state.repository import Repository, RoundStatus

HERE = Path(__file__).resolve().parent


def baseline_fab(name: str, module: str, files: list[str], config: dict[str, Any]) -> dict[str, bytes]:
    """The files of a Flower app bundle of benchmark files (not the QuorumFL package) with
    ``module:server/client``; the federation's Control client builds (and signs) the bundle."""
    manifest = {
        "build-system": {"requires": ["setuptools"], "build-backend": "setuptools.build_meta"},
        "project": {"name": name, "version": "1.0.0", "dependencies": []},
        "tool": {"flwr": {"app": {
            "publisher": "quorumfl",
            "components": {"serverapp": f"{module}:server", "clientapp": f"{module}:client"},
            "config": config,
        }}},
    }
    return {"pyproject.toml": tomli_w.dumps(manifest).encode(), **{f: (HERE / f).read_bytes() for f in files}}


def quorumfl_rounds(federation: LocalFederation, repo: Repository, overrides: dict[str, Any]) -> list[dict[str, float]]:
    """Run the QuorumFL app; each round's recorded phase timings. Exits if any round failed."""
    flower_run_id = federation.control.start_run(overrides)
    run = follow_run(repo, flower_run_id, timeout=3600, alive=lambda: federation.alive(flower_run_id))
    if run.status != "completed" or any(r.status != RoundStatus.COMPLETED for r in run.rounds):
        raise SystemExit(f"run ended {run.status}: {run.error}; rounds {[(r.number, r.status, r.error) for r in run.rounds]}")
    return [dict(r.timings) for r in run.rounds]


def baseline_rounds(federation: LocalFederation, fab: dict[str, bytes], timings: Path, rounds: int) -> list[float]:
    """Run a baseline app that appends ``{"round_s": …}`` lines to ``timings``; its round times."""
    flower_run_id = federation.control.start_run({}, files=fab)
    deadline = time.monotonic() + 3600
    while not federation.control.run_finished(flower_run_id):
        if time.monotonic() > deadline:
            raise SystemExit("the baseline run did not finish within an hour")
        time.sleep(1.0)
    got = [json.loads(line)["round_s"] for line in timings.read_text().splitlines()] if timings.exists() else []
    if len(got) != rounds:
        raise SystemExit(f"the baseline run finished {len(got)} of {rounds} rounds\n{federation.logs(60)}")
    return got


def round_seconds(timings: dict[str, float]) -> float:
    """A QuorumFL round's wall time: its recorded phases (local training runs inside 'train')."""
    return sum(v for k, v in timings.items() if k != "local_train_max")


@dataclass(frozen=True)
class Sizes:
    nodes: int
    rounds: int
    model: str
    params: int
    common: dict[str, Any]  # run config shared by QuorumFL and the baselines: model, rounds, local training
    as_json: bool


def sizes(parser: argparse.ArgumentParser, *, rounds: int = 5) -> Sizes:
    """Parse --nodes/--rounds/--model (10, ``rounds``, mlp-wide; --smoke: 3, 1, mlp) and --json. One local epoch per
    round. The smoke runs one round: it checks that every run of the benchmark completes and reports its keys
    (its figures mean nothing at that size), and each further round cost CI seconds for nothing more."""
    parser.add_argument("--nodes", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--model", default="mlp-wide")
    args = parser.parse_args()
    nodes, rounds, model = (3, 1, "mlp") if args.smoke else (args.nodes, args.rounds, args.model)
    params = sum(p.numel() for p in build_model(model, (1, 8, 8), 10).parameters())
    common = {"model": model, "num-rounds": rounds, "local-epochs": 1, "batch-size": 32, "learning-rate": 0.05,
              "seed": 0}
    return Sizes(nodes, rounds, model, params, common, bool(args.json))


@dataclass(frozen=True)
class Bench:
    home: Path
    repo: Repository
    federation: LocalFederation
    ours: dict[str, Any]  # QuorumFL run config: the shared sizes plus FedAvg, fresh start, this bench's DB


@contextmanager
def bench_federation(size: Sizes) -> Iterator[Bench]:
    """A throw-away home, state DB and IID digits split, and a local federation of ``size.nodes`` SuperNodes."""
    with tempfile.TemporaryDirectory(prefix="quorumfl-bench-") as tmp:
        home = Path(tmp)
        db_url = f"sqlite:///{home / 'state.db'}"
        repo = Repository(connect(db_url, migrate=True))
        parts = prepare_partitions(home / "data", [f"dept-{i:02d}" for i in range(size.nodes)], method="iid", seed=0)
        ours = {**size.common, "strategy": "fedavg", "min-nodes": 2, "start-from": "fresh", "state-url": db_url,
                "model-dir": str(home / "models"), "round-timeout": 900.0}
        with local_federation(home, parts, db_url=db_url) as federation:
            yield Bench(home, repo, federation, ours)


STOCK_POLL_S = 3.0  # Flower's own SuperNode waits 3 s between requests for new messages


@contextmanager
def stock_federation(size: Sizes) -> Iterator[tuple[Path, LocalFederation]]:
    """(a throw-away home, a local federation) on the same departments' data as ``bench_federation``,
    with SuperNodes as Flower runs them out of the box: each message a fresh ``flwr-clientapp`` process
    (no warm ClientApps) and Flower's 3 s poll. TLS and node authentication stay on. For a baseline
    Flower app only."""
    with tempfile.TemporaryDirectory(prefix="quorumfl-bench-stock-") as tmp:
        home = Path(tmp)
        db_url = f"sqlite:///{home / 'state.db'}"
        connect(db_url, migrate=True)
        parts = prepare_partitions(home / "data", [f"dept-{i:02d}" for i in range(size.nodes)], method="iid", seed=0)
        with local_federation(home, parts, db_url=db_url, warm_clientapps=False, node_poll_s=STOCK_POLL_S) as federation:
            yield home, federation


def department_split(dataset: str, departments: int, *, alpha: float, seed: int) -> tuple[list[Any], Any]:
    """(each department's data, the global test set): the official test set where the dataset has one
    (else a held-out fifth), the rest split Dirichlet(α) — or IID for α = 0 — over the departments."""
    import numpy as np

    from quorumfl.core.data.datasets import load_dataset
    from quorumfl.core.data.partition import partition_dirichlet, partition_iid

    pool, test = load_dataset(dataset)
    if test is None:
        order = np.random.default_rng(seed).permutation(len(pool))
        cut = len(pool) // 5
        pool, test = pool.subset(np.sort(order[cut:])), pool.subset(np.sort(order[:cut]))
    if alpha > 0:
        parts = partition_dirichlet(pool.y, departments, alpha=alpha, seed=seed, min_size=50)
    else:
        parts = partition_iid(pool.y, departments, seed=seed)
    return [pool.subset(p) for p in parts], test


def fedavg_start(model_name: str, test: Any, seed: int) -> tuple[Any, Any, dict[str, Any]]:
    """The product's FedAvg strategy (built from a run config, as a run does), a model and its initial arrays."""
    from quorumfl.core.models import model_to_arrays
    from quorumfl.server.config import RunConfig
    from quorumfl.server.strategies import build_strategy

    strategy = build_strategy(RunConfig.from_mapping({"strategy": "fedavg", "fraction-train": 1.0, "min-nodes": 1, "secure-aggregation": "none",
                                                      "seed": seed}))
    model = build_model(model_name, test.input_shape, test.num_classes, seed=seed)
    return strategy, model, model_to_arrays(model)


def signed_checks_cost(nodes: int, *, repeats: int = 200) -> dict[str, Any]:
    """What the node-side checks against the admin's signature add, measured on this machine with the
    code the nodes run: the served-runs ledger admitting a task of a run it already serves (every
    ClientApp task: train, a secure stage, evaluate), the masking announcement's parameter check
    (once per key epoch, counted per round here), and the bytes they put on the wire: nothing per
    round (the parameters and the CKKS length and level are signed, not sent), the run stamp once per
    run in the signed bundle, the call claim once per Control call in the admin token."""
    import statistics

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from quorumfl.aggregation.secagg import MaskingParams, resolve_threshold
    from quorumfl.client.signed_config import check_masking_params
    from quorumfl.deploy.control import app_pyproject
    from quorumfl.privacy.admin import call_digest, issue_token, run_stamp
    from quorumfl.privacy.served_runs import ServedRuns, SignedRun
    from quorumfl.server.config import DEFAULTS

    run = {**DEFAULTS, "secure-aggregation": "masking", "secagg-threshold": 0.6, "roster": ""}
    params = MaskingParams(threshold=resolve_threshold(0.6, nodes), slots=min(int(DEFAULTS["secagg-epoch-rounds"]),
                                                                              int(DEFAULTS["num-rounds"])))
    stamp = run_stamp(now=time.time(), roster_version=nodes)
    with tempfile.TemporaryDirectory() as directory:
        ledger, signed = ServedRuns(Path(directory)), SignedRun(stamp)
        ledger.admit(signed, run_id=1, now=time.time())  # the run's first task; the rest take the common path
        admit, check = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            ledger.admit(signed, run_id=1, now=time.time())
            admit.append(time.perf_counter() - start)
            start = time.perf_counter()
            check_masking_params(run, params, nodes, node="bench")
            check.append(time.perf_counter() - start)
    key = Ed25519PrivateKey.generate()
    plain_token = issue_token(key, audience="f" * 64, now=time.time())
    bound_token = issue_token(key, audience="f" * 64, now=time.time(), call=call_digest("POST", "/v1/control/x", b""))
    admit_s, check_s = statistics.median(admit), statistics.median(check)
    return {
        "signed_admit_s_per_task": admit_s,
        "signed_params_check_s_per_epoch": check_s,
        "signed_checks_s_per_round": 3 * admit_s + check_s,  # per node: train, one secure stage, evaluate
        "signed_bytes_per_round": 0,
        "signed_stamp_bytes_per_run": len(app_pyproject({**DEFAULTS, **stamp})) - len(app_pyproject(DEFAULTS)),
        "signed_token_bytes_per_call": len(bound_token) - len(plain_token),
    }
