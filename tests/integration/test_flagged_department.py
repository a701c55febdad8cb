"""Update monitoring on Flower's deployment engine: four departments as real SuperNodes, one of them
with a broken export (its images scaled ×50, as when pixels arrive as 0–255 instead of 0–1). Its
updates stand out from the first round and it is flagged there and in every later round, no honest
department is flagged, and the report shows it. Under masking the server sees no single update: the
secure sum's norm histogram counts one department far above the others in each round."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from quorumfl.core.data import prepare_partitions
from quorumfl.core.data.store import read_partition, write_partition
from quorumfl.deploy.local import local_federation
from quorumfl.server.report import report_data
from quorumfl.server.services import follow_run
from quorumfl.server.state.database import connect
from quorumfl.server.state.repository import Repository, RunStatus

DEPARTMENTS = ["tax-office", "urban-planning", "public-works", "parks"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["none", "masking"])
def test_a_broken_department_is_flagged_in_real_rounds(tmp_path: Path, mode: str) -> None:
    home = tmp_path / "home"
    db_url = f"sqlite:///{home / 'quorumfl.db'}"
    repo = Repository(connect(db_url, migrate=True))
    parts = prepare_partitions(tmp_path / "data", DEPARTMENTS, seed=0, method="iid")
    broken = read_partition(parts["parks"])
    write_partition(parts["parks"], replace(broken, train=replace(broken.train, x=broken.train.x * 50),
                                            test=replace(broken.test, x=broken.test.x * 50)))
    with local_federation(home, parts, db_url=db_url) as federation:
        flower_run_id = federation.control.start_run({
            "state-url": db_url, "model-dir": str(home / "models"), "start-from": "fresh", "num-rounds": 2,
            "local-epochs": 1, "strategy": "fedavg", "secure-aggregation": mode, "secagg-threshold": 0.6})
        run = follow_run(repo, flower_run_id, timeout=300, alive=lambda: federation.alive(flower_run_id))
        assert run.status == RunStatus.COMPLETED, f"{run.error}\n{federation.logs()}"
    data = report_data(repo, run.id)
    assert [r["metrics"]["flagged-nodes"] for r in data["rounds"]] == [1.0, 1.0]
    if mode == "none":
        flagged = {(m["round"], m["department"]) for m in data["monitoring"] if m["flagged"]}
        assert flagged == {(1, "parks"), (2, "parks")}, data["monitoring"]
    else:  # no single update, no department named: only the histograms
        assert data["monitoring"] == []
        assert [(h["round"], h["flagged"], sum(h["norm"].values())) for h in data["histograms"]] == [(1, 1, 4), (2, 1, 4)]
