"""A real Flower deployment on free loopback ports: one SuperLink and N SuperNodes as processes."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from quorumfl.client.data import prepare_partitions
from quorumfl.server.control import Control
from quorumfl.server.processes import (
    Child,
    ProcessGroup,
    flower_env,
    free_port,
    superlink_command,
    supernode_command,
    wait_for_port,
)
from quorumfl.server.state.database import connect
from quorumfl.server.state.repository import Repository

DEPARTMENTS = ["tax-office", "urban-planning", "public-works"]


@dataclass
class Deployment:
    home: Path
    db_url: str
    control: Control
    repo: Repository
    group: ProcessGroup
    link: Child
    nodes: dict[str, Child]

    def logs(self) -> str:
        return "\n".join(f"--- {c.name}\n{self.group.tail(c, 30)}" for c in self.group.children)


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Deployment]:
    home = tmp_path / "home"
    db_url = f"sqlite:///{home / 'quorumfl.db'}"
    repo = Repository(connect(db_url, migrate=True))
    parts = prepare_partitions(tmp_path / "data", DEPARTMENTS, seed=0, alpha=0.5)
    port = free_port()
    with ProcessGroup(home / "logs", flower_env(home, db_url=db_url)) as group:
        link = group.start("superlink", superlink_command(port=port, database=home / "superlink.db"))
        wait_for_port("127.0.0.1", port, timeout=60, process=link.process)
        address = f"127.0.0.1:{port}"
        nodes = {
            name: group.start(name, supernode_command(superlink=address, port=free_port(), data_path=path, department=name))
            for name, path in parts.items()
        }
        control = Control(address)
        deadline = time.monotonic() + 60
        while len(control.online_nodes()) < len(DEPARTMENTS):
            assert time.monotonic() < deadline, "SuperNodes did not connect"
            time.sleep(0.5)
        yield Deployment(home, db_url, control, repo, group, link, nodes)
    # ProcessGroup.__exit__ has stopped every process group; nothing may be left running.
    for child in [link, *nodes.values()]:
        assert child.process.poll() is not None
