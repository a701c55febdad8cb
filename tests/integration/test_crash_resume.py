"""A ClientApp killed mid-training is asked again within the round and resumes from its checkpoint.

Real processes: a SuperLink and three SuperNodes on 127.0.0.1. Once every department has written a
training checkpoint, every ClientApp process is SIGKILLed; Flower reports each as crashed (error 8)
when its task heartbeat expires, the server sends the same request again (``train-retries``), and the
new ClientApp resumes the same job from the checkpoint instead of starting over.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from quorumfl.core.data import prepare_partitions
from quorumfl.deploy.local import local_federation
from quorumfl.server.services import follow_run
from quorumfl.server.state.database import connect
from quorumfl.server.state.repository import Repository, RoundStatus, RunStatus

from .conftest import DEPARTMENTS


def _clientapps(supernodes: set[int]) -> list[int]:
    """ClientApp task processes below the given SuperNodes, via /proc: warm tasks (SuperNode →
    SuperExec → warm server → a forked child named ``flwr-clientapp``) and cold ones (a
    ``flwr-clientapp`` process, which runs as ``python -m quorumfl.deploy.app_guard`` behind the
    admin-signature check)."""
    parents: dict[int, int] = {}
    cmdlines: dict[int, bytes] = {}
    names: dict[int, str] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdlines[int(entry.name)] = (entry / "cmdline").read_bytes()
            names[int(entry.name)] = (entry / "comm").read_text().strip()
        except (OSError, ValueError, IndexError):
            continue
    below, frontier = set(), set(supernodes)
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier and pid not in below}
        below |= frontier
    marks = (b"flwr-clientapp", b"quorumfl.deploy.app_guard")
    return sorted(pid for pid in below
                  if names.get(pid) == "flwr-clientapp" or any(m in cmdlines.get(pid, b"") for m in marks))


@pytest.mark.slow
def test_killed_clientapps_resume_from_their_checkpoints(tmp_path: Path) -> None:
    home = tmp_path / "home"
    db_url = f"sqlite:///{home / 'quorumfl.db'}"
    repo = Repository(connect(db_url, migrate=True))
    parts = prepare_partitions(tmp_path / "data", DEPARTMENTS, seed=0, alpha=0.5)
    with local_federation(home, parts, db_url=db_url, node_config={"checkpoint-every": 5}) as federation:
        flower_run_id = federation.control.start_run({
            "state-url": db_url, "model-dir": str(home / "models"), "start-from": "fresh", "num-rounds": 1,
            "secure-aggregation": "none",  # each node's retry and resumed step are read per node below
            "local-epochs": 60, "batch-size": 8, "round-timeout": 400.0, "train-retries": 1, "min-nodes": 3,
        })
        supernodes = {child.process.pid for child in federation.nodes.values()}
        deadline = time.monotonic() + 180
        while (len(list(home.glob("node-state/*/checkpoints/train-*.pt"))) < len(DEPARTMENTS)
               or len(victims := _clientapps(supernodes)) < len(DEPARTMENTS)):
            assert time.monotonic() < deadline, f"no checkpoints appeared\n{federation.logs()}"
            time.sleep(0.1)
        for pid in victims:
            os.kill(pid, signal.SIGKILL)

        run = follow_run(repo, flower_run_id, timeout=600, alive=lambda: federation.alive(flower_run_id))

    assert run.status == RunStatus.COMPLETED, f"{run.error}\n{federation.logs()}"
    [first] = run.rounds
    assert first.status == RoundStatus.COMPLETED and len(first.participants) == 3 and first.failures == []
    metrics = repo.metrics(run.id)
    retries = {m.node_id: m.value for m in metrics if m.name == "train-retries"}
    resumed = {m.node_id: m.value for m in metrics if m.name == "resumed-from-step" and m.round == 1}
    assert retries == {n: 1.0 for n in first.participants}
    assert all(resumed[n] >= 5 for n in first.participants), resumed
    assert list(home.glob("node-state/*/checkpoints/train-*.pt")) == []  # removed once each job finished
