"""A department's SuperNode killed with SIGKILL comes back under its own key.

With SuperNode authentication the SuperLink knows a node by its key, and it counts the killed
SuperNode as online until its heartbeats lapse (two of QuorumFL's 5 s beats): a new SuperNode with
the same key is refused until then. ``LocalFederation.add_node`` keeps starting it until the SuperLink activates it;
the department then has the same Flower node id as before.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from quorumfl.core.data import prepare_partitions
from quorumfl.deploy.liveness import heartbeat_interval, offline_after
from quorumfl.deploy.local import local_federation
from quorumfl.deploy.processes import REJOIN_GRACE_S, activated, activation_refused


@pytest.mark.slow  # it waits out the heartbeat window (two of QuorumFL's 5 s beats)
@pytest.mark.timeout(300)
def test_killed_node_rejoins_under_its_own_key(tmp_path: Path) -> None:
    home = tmp_path / "home"
    parts = prepare_partitions(tmp_path / "data", ["tax-office", "parks"], seed=0, method="iid")
    with local_federation(home, parts, db_url=f"sqlite:///{home / 'quorumfl.db'}") as federation:
        before = {n.name: n.node_id for n in federation.control.nodes()}
        first = federation.nodes["parks"]
        federation.group.kill(first, signal.SIGKILL, group=True)
        killed = time.monotonic()
        federation.add_node("parks", parts["parks"])
        deadline = time.monotonic() + REJOIN_GRACE_S + 30
        while not activated(federation.nodes["parks"]):
            assert time.monotonic() < deadline, federation.logs()
            time.sleep(0.5)
        latest = federation.nodes["parks"]
        assert latest is not first and latest.process.poll() is None
        # Any SuperNode started while the killed one still counted as online was refused; within
        # QuorumFL's heartbeat window (10 s) and a start, the department is back.
        refused = [c for c in federation.group.children if c.name == "parks" and c not in (first, latest)]
        assert all(activation_refused(c) for c in refused)
        assert time.monotonic() - killed < offline_after(heartbeat_interval()) + 45, federation.logs()
        online = {n.name: n.node_id for n in federation.control.nodes() if n.status == "online"}
        assert online == before
