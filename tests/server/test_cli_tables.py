"""Tables on an 80-column terminal keep every run id, status, round number and version whole, whatever
the number of rows; long text wraps at word boundaries instead of being cut to "…"; each run says its
privacy (masked, ckks or plaintext) and what it learns."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from quorumfl.server.model_store import ModelStore
from quorumfl.server.state.database import connect
from quorumfl.server.state.repository import Repository, RoundStatus, RunStatus

STATUSES = [RunStatus.COMPLETED, RunStatus.PARTIAL, RunStatus.FAILED, RunStatus.STOPPED, RunStatus.RUNNING]
MODES = ["masking", "ckks", "none"]


def _cli(url: str, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "quorumfl.cli", "--db", url, *args], capture_output=True, text=True,
                          timeout=120, check=False, env={**os.environ, "COLUMNS": "80", "TERM": "dumb"})
    assert done.returncode == 0, done.stderr
    assert max(len(line) for line in done.stdout.splitlines()) <= 80, done.stdout
    return done.stdout


def _cells(output: str) -> list[list[str]]:
    """The table's rows as cell texts (Rich's box drawing; one physical line each)."""
    return [[c.strip() for c in re.split("[│┃]", line)[1:-1]] for line in output.splitlines() if line.startswith(("│", "┃"))]


def test_runs_list_show_and_models_list_keep_ids_and_statuses_whole_at_80_columns(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'state.db'}"
    repo = Repository(connect(url, migrate=True))
    store = ModelStore(tmp_path / "models")
    schema = '{"task": "tabular", "version": "1", "label": "sale_price", "objective": "regression"}'
    for i in range(25):
        config = {"task": "tabular", "task-schema": schema, "model": "mlp", "dataset": "digits",
                  "secure-aggregation": MODES[i % 3], "secagg-threshold": 0.6, "dp": "local" if i % 4 == 0 else "none",
                  "dp-epsilon": 3.0}
        run = repo.create_run(flower_run_id=2**63 + 1000 + i, config=config, strategy="fedprox", num_rounds=12)
        for number in range(1, 13):
            rnd = repo.start_round(run.id, number, [7, 8, 9])
            repo.finish_round(rnd.id, RoundStatus.COMPLETED, participants=[7, 8, 9],
                              timings={"train": 2.0 + number, "secagg-unmask": 0.4})
            repo.add_metrics(run.id, number, {"federated-mae": 70_000.0 - 100 * number, "federated-loss": 0.3})
        repo.add_metrics(run.id, 12, {"final-federated-mae": 68_000.0 + i})
        stored = store.save({"w": np.full(3, i, np.float32)}, f"r{i}")
        repo.add_model_version(run_id=run.id, round_number=12, parent_id=None,
                               architecture=f"tabular:mlp:{'a' if i % 2 else 'b'}" * 3, path=str(stored.path),
                               sha256=stored.sha256, size_bytes=stored.size_bytes, metrics={"mae": 68_000.0})
        if STATUSES[i % 5] is not RunStatus.RUNNING:
            repo.finish_run(run.id, STATUSES[i % 5])
    runs = {int(r[0]): r for r in _cells(_cli(url, "runs", "list")) if r and r[0].isdigit()}
    assert sorted(runs) == list(range(1, 26))
    for run_id, row in runs.items():
        assert row[1] == STATUSES[(run_id - 1) % 5].value, row  # whole, not "complet…"
        assert row[2] == {"masking": "masked", "ckks": "ckks", "none": "plaintext"}[MODES[(run_id - 1) % 3]] + (
            "+dp" if (run_id - 1) % 4 == 0 else "")
        assert "…" not in "".join(row[:3])
    shown = _cli(url, "runs", "show", "1")
    flat = " ".join(shown.split())
    assert "tabular regression of 'sale_price' (mlp)" in flat
    assert "masked: the server learns only sums of at least t = 60% of each round's nodes; DP local" in flat
    header = next(r for r in _cells(shown) if r and r[0] == "round")
    assert "…" not in "".join(header) and {"round", "status", "nodes", "failures"} <= set(header)
    assert [r[0] for r in _cells(shown) if r and r[0].isdigit()] == [str(n) for n in range(1, 13)]
    models = [r for r in _cells(_cli(url, "models", "list")) if r and r[0].isdigit()]
    assert sorted(int(r[0]) for r in models) == list(range(1, 26))
    assert "…" not in _cli(url, "models", "list")  # the architecture wraps, it is not cut
