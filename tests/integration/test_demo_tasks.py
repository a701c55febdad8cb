"""`quorumfl demo --task tabular|text` end to end: real Debian-packaged data (Ames sales, WordNet
glosses) split across departments, a real local federation with masking, and the per-department
table in the task's metric. Needs `./setup.sh --city-data` (README command 2 runs it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from quorumfl.server.state.database import connect
from quorumfl.server.state.repository import Repository, RunStatus

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("task", "metric"), [("tabular", "mae"), ("text", "accuracy")])
def test_the_city_data_demo_trains_a_masked_federation_and_reports_each_department(
    tmp_path: Path, task: str, metric: str
) -> None:
    home = tmp_path / "home"
    demo = subprocess.run([sys.executable, "-m", "quorumfl.cli", "--home", str(home), "demo", "--task", task,
                           "--departments", "3", "--rounds", "2"], capture_output=True, text=True, timeout=300)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert "Final model per department" in demo.stdout and metric in demo.stdout
    repo = Repository(connect(f"sqlite:///{home / 'quorumfl.db'}", migrate=False))
    (run,) = repo.list_runs()
    assert run.status == RunStatus.COMPLETED and json.loads(json.dumps(run.config))["secure-aggregation"] == "masking"
    finals = {m.node_id: m.value for m in repo.metrics(run.id) if m.name == f"final-{metric}" and m.node_id is not None}
    assert len(finals) == 3
    if task == "tabular":  # trained: far below the untrained model's error (about 280k dollars on Ames)
        assert all(0 < v < 100_000 for v in finals.values()), finals
    else:  # 26 classes: well above chance after two rounds
        assert all(v > 1.5 / 26 for v in finals.values()), finals
