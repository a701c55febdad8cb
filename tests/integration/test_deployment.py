"""End to end on Flower's deployment engine: SuperLink + 3 SuperNodes on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from quorumfl.server.services import follow_run
from quorumfl.server.state.repository import RoundStatus, RunStatus

from .conftest import DEPARTMENTS, Deployment

ROOT = Path(__file__).resolve().parents[2]


def _overrides(d: Deployment, **extra: object) -> dict[str, object]:
    return {"state-url": d.db_url, "model-dir": str(d.home / "models"), "start-from": "fresh", **extra}


def test_two_rounds_recorded_in_the_state_db(deployment: Deployment) -> None:
    d = deployment
    flower_run_id = d.federation.control.start_run(_overrides(d, **{"num-rounds": 2, "local-epochs": 2}))
    run = follow_run(d.repo, flower_run_id, timeout=300, alive=lambda: d.federation.alive(flower_run_id))

    assert run.status == RunStatus.COMPLETED, f"{run.error}\n{d.federation.logs()}"
    assert [(r.number, r.status, len(r.participants)) for r in run.rounds] == [
        (1, RoundStatus.COMPLETED, 3), (2, RoundStatus.COMPLETED, 3)
    ]
    assert all(r.timings["train"] > 0 and "aggregate" in r.timings for r in run.rounds)
    assert sorted(n.department or "" for n in d.repo.list_nodes()) == sorted(DEPARTMENTS)
    versions = d.repo.list_model_versions(run_id=run.id)
    assert [v.round for v in versions] == [1, 2] and versions[1].parent_id == versions[0].id
    accuracy = {m.round: m.value for m in d.repo.metrics(run.id, name="accuracy") if m.node_id is None}
    assert set(accuracy) == {1, 2} and accuracy[2] > 0.3
    finals = [m for m in d.repo.metrics(run.id, name="final-accuracy")]
    assert len(finals) == 3
    assert run.config["num-rounds"] == 2 and run.flower_run_id == flower_run_id
    # Flower itself marks the run finished once the ServerApp process has exited.
    deadline = time.monotonic() + 60
    while not d.federation.control.run_finished(flower_run_id):
        assert time.monotonic() < deadline, "Flower never marked the run finished"
        time.sleep(0.5)


@pytest.mark.slow
def test_killed_node_mid_round_is_recorded_and_the_round_completes(deployment: Deployment) -> None:
    d = deployment
    flower_run_id = d.federation.control.start_run(
        _overrides(d, **{"num-rounds": 2, "local-epochs": 40, "round-timeout": 150.0, "min-nodes": 2})
    )
    victim = d.federation.nodes["public-works"]
    deadline = time.monotonic() + 120
    while True:  # wait until round 1 is in flight, then kill one department's whole node
        runs = d.repo.list_runs()
        if runs and runs[-1].rounds and runs[-1].rounds[0].status == RoundStatus.RUNNING:
            break
        assert time.monotonic() < deadline, d.federation.logs()
        time.sleep(0.2)
    time.sleep(1.0)
    d.federation.group.kill(victim, signal.SIGKILL, group=True)

    run = follow_run(d.repo, flower_run_id, timeout=420, alive=lambda: d.federation.alive(flower_run_id))
    assert run.status == RunStatus.COMPLETED, f"{run.error}\n{d.federation.logs()}"
    first = run.rounds[0]
    assert first.status == RoundStatus.COMPLETED and len(first.participants) == 2
    [failure] = first.failures
    assert failure.stage == "train" and failure.reason
    assert failure.node_id in first.selected and failure.node_id not in first.participants
    # The killed node never replied, so its department is unknown; the others are named.
    departments = {n.node_id: n.department for n in d.repo.list_nodes()}
    assert departments[failure.node_id] is None
    assert sorted(departments[n] or "" for n in first.participants) == ["tax-office", "urban-planning"]
    assert run.rounds[1].status == RoundStatus.COMPLETED and len(run.rounds[1].participants) == 2


def test_runs_stop_through_the_cli(deployment: Deployment) -> None:
    d = deployment
    flower_run_id = d.federation.control.start_run(_overrides(d, **{"num-rounds": 50, "local-epochs": 1}))
    deadline = time.monotonic() + 180
    while True:  # let round 1 finish
        runs = d.repo.list_runs()
        if runs and any(r.status == RoundStatus.COMPLETED for r in runs[-1].rounds):
            break
        assert time.monotonic() < deadline, d.federation.logs()
        time.sleep(0.5)
    result = subprocess.run(
        [sys.executable, "-m", "quorumfl.server.cli", "--db", d.db_url, "runs", "stop", str(flower_run_id),
         "--superlink", d.federation.address],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    deadline = time.monotonic() + 60
    while not d.federation.control.run_finished(flower_run_id):
        assert time.monotonic() < deadline, "Flower did not stop the run"
        time.sleep(0.5)
    time.sleep(2)
    run = d.repo.get_run(flower_run_id)
    assert run.status == RunStatus.STOPPED
    assert len([r for r in run.rounds if r.status == RoundStatus.COMPLETED]) < 50
    assert all(r.status in (RoundStatus.COMPLETED, RoundStatus.ABORTED) for r in run.rounds)


def test_flowers_own_flwr_run_drives_the_app(deployment: Deployment, tmp_path: Path) -> None:
    """`flwr run . CONNECTION` (Flower's CLI, the repo's pyproject as the app) runs the same app."""
    d = deployment
    flwr_home = tmp_path / "flwr-cli"
    flwr_home.mkdir()
    assert d.federation.credentials is not None  # TLS, as every federation runs by default
    (flwr_home / "config.toml").write_text(
        f'[superlink]\ndefault = "quorumfl"\n\n[superlink.quorumfl]\naddress = "{d.federation.address}"\n'
        f'root-certificates = "{d.federation.credentials.ca_cert}"\n'
    )
    overrides = f"num-rounds=1 local-epochs=1 start-from='fresh' state-url='{d.db_url}' model-dir='{d.home / 'models'}'"
    result = subprocess.run(
        [str(Path(sys.executable).parent / "flwr"), "run", str(ROOT), "quorumfl", "--format", "json", "-c", overrides],
        env={**os.environ, "FLWR_HOME": str(flwr_home), "FLWR_TELEMETRY_ENABLED": "0"},
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    flower_run_id = int(json.loads(result.stdout[result.stdout.index("{"):])["run-id"])
    run = follow_run(d.repo, flower_run_id, timeout=300, alive=lambda: d.federation.alive(flower_run_id))
    assert run.status == RunStatus.COMPLETED, f"{run.error}\n{d.federation.logs()}"
    assert [(r.number, len(r.participants)) for r in run.rounds] == [(1, 3)]
    assert not (ROOT / "pyproject.toml").read_text().count("[tool.flwr.federations]")  # flwr left it alone
