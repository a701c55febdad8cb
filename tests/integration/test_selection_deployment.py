"""The RL selector on Flower's deployment engine with a round deadline and one slow department:
a SuperNode whose uplink to the SuperLink passes 2 KB/s, so its update (~70 KB) arrives long after
the deadline. The rounds must not wait for it, it must be recorded late each time it is chosen,
and what the selector learned must be in the state DB."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from quorumfl.core.data import prepare_partitions
from quorumfl.deploy.local import local_federation
from quorumfl.server.services import follow_run
from quorumfl.server.state.database import connect
from quorumfl.server.state.repository import Repository, RoundStatus, RunStatus

from .slow_link import slow_link

DEADLINE = 25.0


# Slow suite: four rounds, each as long as its 25 s deadline when the slow department is chosen (44 s
# on a 2-core machine that ran the default suite in 305 s). The in-memory counterpart
# (tests/server/test_selection_rounds.py) stays in the default suite.
@pytest.mark.slow
def test_rl_selector_with_a_deadline_and_a_slow_department(tmp_path: Path) -> None:
    home = tmp_path / "home"
    db_url = f"sqlite:///{home / 'quorumfl.db'}"
    repo = Repository(connect(db_url, migrate=True))
    parts = prepare_partitions(tmp_path / "data", ["tax-office", "urban-planning", "public-works"], seed=0, alpha=0.5)
    fast = {k: v for k, v in parts.items() if k != "public-works"}
    with local_federation(home, fast, db_url=db_url) as federation:
        fast_ids = set(federation.control.online_nodes())
        with slow_link(federation.address, bytes_per_second=2000) as relay:
            federation.add_node("public-works", parts["public-works"], superlink=relay)
            deadline = time.monotonic() + 120
            while len(federation.control.online_nodes()) < 3:
                assert time.monotonic() < deadline, federation.logs()
                time.sleep(0.5)
            [slow_id] = set(federation.control.online_nodes()) - fast_ids
            flower_run_id = federation.control.start_run({
                "state-url": db_url, "model-dir": str(home / "models"), "start-from": "fresh",
                "selector": "rl", "selection-epochs": "1,2", "local-epochs": 1, "round-deadline": DEADLINE,
                "fraction-train": 0.6, "min-nodes": 1, "num-rounds": 4, "secure-aggregation": "none",
            })
            run = follow_run(repo, flower_run_id, timeout=600, alive=lambda: federation.alive(flower_run_id))

    assert run.status == RunStatus.COMPLETED, f"{run.error}\n{federation.logs()}"
    assert [r.status for r in run.rounds] == [RoundStatus.COMPLETED] * 4
    chosen_slow = [r for r in run.rounds if slow_id in r.selected]
    assert chosen_slow, "the slow department was never chosen; the selector must explore every node"
    for rnd in chosen_slow:
        [failure] = [f for f in rnd.failures if f.node_id == slow_id]
        assert failure.stage == "deadline" and slow_id not in rnd.participants
    for rnd in run.rounds:  # no round waited for the slow uplink
        assert rnd.timings["train"] < DEADLINE + 10, rnd.timings
        assert set(rnd.participants) <= fast_ids and rnd.participants
    records = repo.selections(run.id)
    assert [r.round for r in records] == [1, 2, 3, 4] and {r.policy for r in records} <= {"rl", "oort"}
    assert all(r.outcomes[str(slow_id)] == "late" for r in records if str(slow_id) in r.outcomes)
    state = repo.selector_state("rl:digits:mlp")
    assert state is not None and state.rounds == 4
    stats = state.state["book"]["nodes"][str(slow_id)]
    assert stats["late"] == len(chosen_slow) and stats["seconds_per_epoch"] >= DEADLINE / 2
