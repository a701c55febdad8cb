"""``quorumfl simulate`` against a deployment: the same run config on Flower's simulation engine and on
real SuperNodes gives the same models (up to the fixed-point error of masking), and the simulated
run is in the state DB for the same commands; at 1,000 departments with dropouts at every masking
stage the round is the numpy sum of the departments it counted."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from quorumfl.aggregation.secagg import flatten
from quorumfl.aggregation.secagg.payload import HEADER
from quorumfl.client.virtual import PAYLOAD_LOG_KEY
from quorumfl.core.data import prepare_partitions
from quorumfl.deploy.local import local_federation
from quorumfl.deploy.simulation import SimulationSettings, simulate
from quorumfl.server.model_store import ModelStore
from quorumfl.server.services import follow_run
from quorumfl.server.state.database import connect
from quorumfl.server.state.repository import Repository, RunStatus

DEPARTMENTS = ["tax-office", "parks", "housing", "transit"]


def _models(repo: Repository, run_id: int) -> dict[int, dict[str, np.ndarray]]:
    return {v.round: ModelStore.load(v.path, v.sha256) for v in repo.list_model_versions(run_id=run_id)}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quorumfl_simulate_gives_the_deployed_runs_models(tmp_path: Path) -> None:
    """One run config, masked, on 4 SuperNodes and then with ``quorumfl simulate`` on the same 4
    partition folders: the same participants, and each round's model equal up to masking's
    fixed-point error; the simulated run is in the state DB for ``runs show``."""
    home = tmp_path / "home"
    db_url = f"sqlite:///{home / 'quorumfl.db'}"
    repo = Repository(connect(db_url, migrate=True))
    parts = prepare_partitions(tmp_path / "parts", DEPARTMENTS, seed=0, method="dirichlet", alpha=0.5)
    config = {"strategy": "fedavg", "num-rounds": 2, "local-epochs": 1, "min-nodes": 4, "start-from": "fresh",
              "secure-aggregation": "masking", "secagg-threshold": 0.75, "seed": 3}
    with local_federation(home, parts, db_url=db_url, node_config={"reproducible-training": True}) as federation:
        flower_run_id = federation.control.start_run(
            {**config, "state-url": db_url, "model-dir": str(home / "models")})
        deployed = follow_run(repo, flower_run_id, timeout=600, alive=lambda: federation.alive(flower_run_id))
    assert deployed.status == RunStatus.COMPLETED, deployed.error

    toml = tmp_path / "run.toml"
    toml.write_text("[run]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in config.items()))
    ray_tmp = Path(tempfile.mkdtemp(prefix="qr-", dir="/tmp"))  # short: Ray's sockets go below it
    try:
        done = subprocess.run([sys.executable, "-m", "quorumfl.cli", "--home", str(home), "simulate", str(toml),
                               "--departments", "4", "--data", str(tmp_path / "parts"), "--reproducible"],
                              capture_output=True, text=True, timeout=600, check=False,
                              env={**os.environ, "RAY_TMPDIR": str(ray_tmp)})
        assert done.returncode == 0, done.stdout + done.stderr
        assert list(ray_tmp.iterdir()) == []  # Ray's session (logs, sockets) went with the run
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    [simulated] = [r for r in repo.list_runs() if r.id != deployed.id]
    assert f"Run {simulated.id} (simulated)" in done.stdout and "transit" in done.stdout, done.stdout
    assert list((home / "simulations").iterdir()) == []  # the simulation folder went with the run
    shown = subprocess.run([sys.executable, "-m", "quorumfl.cli", "--home", str(home), "runs", "show",
                            str(simulated.id), "--format", "json"], capture_output=True, text=True, timeout=120,
                           check=False)
    view = json.loads(shown.stdout)
    assert view["status"] == "completed" and view["config"]["secure-aggregation"] == "masking"
    assert sorted(d["department"] for d in view["departments"]) == sorted(DEPARTMENTS)

    names = {n.node_id: n.department for n in repo.list_nodes()}
    for run in (deployed, repo.get_run(simulated.id)):
        assert [len(r.participants) for r in run.rounds] == [4, 4]
        assert sorted(names[n] or "" for n in run.rounds[-1].participants) == sorted(DEPARTMENTS)
    ours, theirs = _models(repo, simulated.id), _models(repo, deployed.id)
    assert sorted(ours) == sorted(theirs) == [1, 2]
    for number in (1, 2):
        for key, value in theirs[number].items():
            # Masking encodes each update in fixed point with stochastic rounding; a second round
            # trains from models that differ by that much.
            np.testing.assert_allclose(ours[number][key], value, rtol=0, atol=5e-5 if number == 1 else 1e-4,
                                       err_msg=f"round {number} {key}")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_virtual_department_slowed_by_speeds_is_the_straggler_the_round_stops_waiting_for(tmp_path: Path) -> None:
    """``simulate --speeds``: of three departments handling the same amount of work at the same
    time, one a fifth as fast as this machine replies last, about five times later than the others,
    however loaded the machine is. With K = 2 of 3 asked (``over-selection``), the round aggregates the
    first two replies and records the slow department late (stage 'late'). (A fixed deadline would
    depend on how fast this machine is at the moment: Ray's workers start within the first round.)"""
    home = tmp_path / "home"
    speeds = tmp_path / "speeds.json"
    speeds.write_text(json.dumps({"dept-0002": 0.2}))
    toml = tmp_path / "run.toml"
    config = {"strategy": "fedavg", "model": "mlp-wide", "num-rounds": 1, "local-epochs": 1, "min-nodes": 2,
              "fraction-train": 0.6, "over-selection": 0.5, "start-from": "fresh", "seed": 1}
    toml.write_text("[run]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in config.items()))
    done = subprocess.run([sys.executable, "-m", "quorumfl.cli", "--home", str(home), "simulate", str(toml),
                           "--departments", "3", "--cpus", "3", "--speeds", str(speeds)],
                          capture_output=True, text=True, timeout=800, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    repo = Repository(connect(f"sqlite:///{home / 'quorumfl.db'}", migrate=False))
    [listed] = repo.list_runs()
    run = repo.get_run(listed.id)
    names = {n.node_id: n.department for n in repo.list_nodes()}
    assert run.status == RunStatus.COMPLETED and len(run.rounds) == 1
    [rnd] = run.rounds
    assert len(rnd.selected) == 3, rnd.selected
    assert sorted(names[n] or "" for n in rnd.participants) == ["dept-0000", "dept-0001"], rnd.timings
    # dept-0002's reply came after the cut, so the server knows it by node id only
    [late] = rnd.failures
    assert late.stage == "late" and late.node_id in rnd.selected and late.node_id not in rnd.participants


SCALE_EXAMPLES = int(os.environ.get("QUORUMFL_SCALE_EXAMPLES", "1"))
MASKING_STAGES = ("secagg-advertise", "secagg-share", "train", "secagg-unmask")


@pytest.mark.slow
@pytest.mark.timeout(1800)
@settings(max_examples=SCALE_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
          phases=[Phase.explicit, Phase.reuse, Phase.generate])  # no shrinking: an example takes minutes
@given(seed=st.integers(0, 2**16 - 1))
def test_ten_percent_dropouts_at_every_masking_stage_of_1000_simulated_departments_give_the_survivors_numpy_sum(
    tmp_path: Path, seed: int
) -> None:
    """``quorumfl simulate`` with 1,000 virtual departments, masking and ``--dropout 0.1``: about a
    tenth of the departments still in the round drop out at each stage (key advertisement, share
    exchange, masked input, unmasking), and the round's model is the numpy sum of what the departments
    it counted fed the secure sum (``virtual-payload-log``), applied to the model they received. The
    run config's seed (hypothesis) draws the dropouts, the partitions' order and the initial model.
    One example takes about 3 minutes on two cores (``QUORUMFL_SCALE_EXAMPLES`` runs more)."""
    with tempfile.TemporaryDirectory(dir=tmp_path) as tmp:
        home = Path(tmp)
        db_url = f"sqlite:///{home / 'state.db'}"
        repo = Repository(connect(db_url, migrate=True))
        max_weight = 4.0  # digits split 1,000 ways: one or two examples each, so each weight is about 1/3
        config = {"dataset": "digits", "model": "mlp", "strategy": "fedavg", "num-rounds": 1, "local-epochs": 1,
                  "seed": seed, "start-from": "fresh", "min-nodes": 2, "state-url": db_url,
                  "model-dir": str(home / "models"), "round-timeout": 1200.0, "node-wait-timeout": 600.0,
                  "secagg-stage-timeout": 1200.0, "secure-aggregation": "masking", "secagg-modulus-bits": 64,
                  "secagg-max-weight": max_weight}
        log = home / "payloads"
        run = simulate(config, SimulationSettings(departments=1000, root=home / "sim", dropout=0.1,
                                                  node_config={PAYLOAD_LOG_KEY: str(log)}), repo)
        assert run.status == RunStatus.COMPLETED, run.error
        [rnd] = run.rounds
        dropped = Counter(f.stage for f in rnd.failures)
        assert set(dropped) <= {*MASKING_STAGES, "evaluate"}, dropped  # and the run's closing evaluation
        still = 1000
        for stage in MASKING_STAGES:  # a department that dropped out is not asked at the later stages
            assert 0.05 * still <= dropped[stage] <= 0.15 * still, (stage, dropped, still)
            still -= dropped[stage]

        # Who fed the sum: every department that handled its train message, and no other, is counted;
        # those that dropped out of the unmasking still count (their masks come from the others' shares).
        logged = {int(p.stem.rsplit("-", 1)[1]): p for p in log.glob("round-0001-node-*.npz")}
        assert sorted(logged) == sorted(rnd.participants)
        unmask_dropouts = {f.node_id for f in rnd.failures if f.stage == "secagg-unmask"}
        assert unmask_dropouts and unmask_dropouts <= set(logged)

        total: np.ndarray | None = None
        received: np.ndarray | None = None
        for path in logged.values():
            with np.load(path) as saved:
                total = saved["payload"].copy() if total is None else total + saved["payload"]
                if received is None:
                    received = saved["received"].copy()
                else:
                    assert np.array_equal(saved["received"], received)  # everyone trained from one model
        assert total is not None and received is not None
        [examples] = repo.metrics(run.id, name="examples")
        assert examples.value == pytest.approx(total[0] * max_weight, rel=1e-9)
        [train_loss] = repo.metrics(run.id, name="train-loss")
        assert train_loss.value == pytest.approx(total[1] / total[0], rel=1e-9)
        [version] = repo.list_model_versions(run_id=run.id)
        model = flatten(ModelStore.load(version.path, version.sha256))
        expected = received + total[HEADER:] / total[0]
        # 64-bit masking's fixed-point error is ~1e-12 here; the stored model is float32, so it may sit
        # one float32 step from the float64 reference
        assert np.all(np.abs(model - expected) <= 2.0**-23 * np.abs(expected) + 1e-10)
