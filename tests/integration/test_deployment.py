"""End to end on Flower's deployment engine: SuperLink + 3 SuperNodes on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import tomli_w

from quorumfl.deploy.processes import _below, _process_table
from quorumfl.server.services import follow_run
from quorumfl.server.state.repository import RoundStatus, RunStatus

from .conftest import DEPARTMENTS, Deployment

ROOT = Path(__file__).resolve().parents[2]


def _overrides(d: Deployment, **extra: object) -> dict[str, object]:
    # plaintext rounds: these tests read each update's stages (tests/integration/test_secure_deployment.py: masked)
    return {"state-url": d.db_url, "model-dir": str(d.home / "models"), "start-from": "fresh",
            "secure-aggregation": "none", **extra}


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
    _assert_no_defunct_app_process(d)


def _assert_no_defunct_app_process(d: Deployment) -> None:
    """Every app process Flower started (ServerApp, ClientApps) has been reaped: none is <defunct>."""
    deadline = time.monotonic() + 10
    while True:
        table = _process_table()
        tree = _below({c.process.pid for c in d.federation.group.children}, table)
        zombies = [pid for pid in tree if table[pid][1] == "Z"]
        if not zombies:
            return
        assert time.monotonic() < deadline, f"defunct app processes left after the run: {zombies}"
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


@pytest.mark.slow  # a federation of its own (~25 s): the default suite stays under its 8 minutes
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
        [sys.executable, "-m", "quorumfl.cli", "--db", d.db_url, "runs", "stop", str(flower_run_id),
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
    assert all(r.status in (RoundStatus.COMPLETED, RoundStatus.ABORTED) for r in run.rounds), [
        (r.number, r.status, r.error) for r in run.rounds]
    _assert_no_defunct_app_process(d)


@pytest.mark.slow  # a federation of its own (~35 s): the default suite stays under its 8 minutes
def test_flowers_own_flwr_cli_needs_the_admin_token_and_a_signed_app(deployment: Deployment, tmp_path: Path) -> None:
    """`flwr run APP CONNECTION` (Flower's CLI) is refused by the SuperLink without the admin's token;
    after 'certs flwr-login' an unsigned app is accepted there but refused by the nodes; after
    'certs sign-app' the same app runs."""
    d = deployment
    creds = d.federation.credentials
    assert creds is not None  # TLS, as every federation runs by default
    flwr_home = tmp_path / "flwr-cli"
    flwr_home.mkdir()
    (flwr_home / "config.toml").write_text(
        f'[superlink]\ndefault = "quorumfl"\n\n[superlink.quorumfl]\naddress = "{d.federation.address}"\n'
        f'root-certificates = "{creds.ca_cert}"\n'
    )
    app = tmp_path / "app"  # the repo's app manifest, with this run's config written into it
    app.mkdir()
    manifest = tomllib.loads((ROOT / "pyproject.toml").read_text())
    manifest["tool"]["flwr"]["app"]["config"].update({
        "num-rounds": 1, "local-epochs": 1, "start-from": "fresh", "state-url": d.db_url,
        "model-dir": str(d.home / "models")})
    (app / "pyproject.toml").write_text(tomli_w.dumps(manifest))
    env = {**os.environ, "FLWR_HOME": str(flwr_home), "FLWR_TELEMETRY_ENABLED": "0"}
    quorumfl = [str(Path(sys.executable).parent / "quorumfl"), "--home", str(d.home)]

    def flwr_run() -> dict[str, object]:
        done = subprocess.run([str(Path(sys.executable).parent / "flwr"), "run", str(app), "quorumfl", "--format", "json"],
                              env=env, capture_output=True, text=True, timeout=120, check=False)
        answer: dict[str, object] = json.loads(done.stdout[done.stdout.index("{"):])
        return answer

    refused = flwr_run()
    assert refused["success"] is False and "Authentication failed" in str(refused["error-message"]), refused
    login = subprocess.run([*quorumfl, "certs", "flwr-login", "--superlink", d.federation.address], env=env,
                           capture_output=True, text=True, timeout=60, check=False)
    assert login.returncode == 0, login.stdout + login.stderr

    unsigned = flwr_run()
    assert unsigned["success"] is True, unsigned
    run_id = int(str(unsigned["run-id"]))
    run = follow_run(d.repo, run_id, timeout=300, alive=lambda: d.federation.alive(run_id))
    assert run.status == RunStatus.FAILED
    assert all("not signed by the federation admin" in f.reason for f in run.rounds[0].failures)

    signed = subprocess.run([*quorumfl, "certs", "sign-app", str(app)], env=env, capture_output=True, text=True,
                            timeout=60, check=False)
    assert signed.returncode == 0, signed.stdout + signed.stderr
    result = flwr_run()
    assert result["success"] is True, result
    flower_run_id = int(str(result["run-id"]))
    run = follow_run(d.repo, flower_run_id, timeout=300, alive=lambda: d.federation.alive(flower_run_id))
    assert run.status == RunStatus.COMPLETED, f"{run.error}\n{d.federation.logs()}"
    assert [(r.number, len(r.participants)) for r in run.rounds] == [(1, 3)]
