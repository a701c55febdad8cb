"""A real Flower deployment on free loopback ports: one SuperLink and 3 SuperNodes as processes."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from quorumfl.core.data import prepare_partitions
from quorumfl.deploy.local import LocalFederation, local_federation
from quorumfl.server.state.database import connect
from quorumfl.server.state.repository import Repository

DEPARTMENTS = ["tax-office", "urban-planning", "public-works"]


@dataclass
class Deployment:
    home: Path
    db_url: str
    repo: Repository
    federation: LocalFederation


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Deployment]:
    home = tmp_path / "home"
    db_url = f"sqlite:///{home / 'quorumfl.db'}"
    repo = Repository(connect(db_url, migrate=True))
    parts = prepare_partitions(tmp_path / "data", DEPARTMENTS, seed=0, alpha=0.5)
    with local_federation(home, parts, db_url=db_url) as federation:
        yield Deployment(home, db_url, repo, federation)
    # Leaving local_federation stopped every process group: nothing may be left running.
    for child in [federation.link, *federation.nodes.values()]:
        assert child.process.poll() is not None
