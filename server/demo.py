"""The demo federation: a real SuperLink and one SuperNode per department as separate processes on
127.0.0.1 (Flower's deployment engine), digits split Dirichlet(α) across named departments, a FedProx
run submitted through the Control API and followed in the state DB.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quorumfl.aggregation.errors import FederationError
from quorumfl.client.data import prepare_partitions

from .control import Control
from .processes import ProcessGroup, flower_env, free_port, superlink_command, supernode_command, wait_for_port
from .services import follow_run
from .state.database import connect, default_url
from .state.orm import Round, Run
from .state.repository import Repository

__all__ = ["DEPARTMENTS", "DemoSettings", "run_demo"]

DEPARTMENTS = [
    "tax-office",
    "urban-planning",
    "public-works",
    "social-services",
    "parks-and-recreation",
    "transport",
    "housing",
    "public-health",
]


@dataclass(frozen=True)
class DemoSettings:
    home: Path
    departments: int = 4
    rounds: int = 5
    alpha: float = 0.5
    seed: int = 0
    strategy: str = "fedprox"
    proximal_mu: float = 0.1
    timeout: float = 900.0
    db_url: str | None = None


def run_demo(
    settings: DemoSettings,
    *,
    on_status: Callable[[str], None] = lambda _msg: None,
    on_round: Callable[[Run, Round], None] | None = None,
) -> tuple[Repository, Run]:
    """Run the whole demo; every child process is stopped before this returns or raises."""
    if not 1 <= settings.departments <= len(DEPARTMENTS):
        raise FederationError(f"--departments must be 1..{len(DEPARTMENTS)}, got {settings.departments}")
    home = settings.home
    names = DEPARTMENTS[: settings.departments]
    on_status(f"splitting digits across {len(names)} departments (Dirichlet α={settings.alpha})")
    parts = prepare_partitions(home / "demo" / "data", names, dataset="digits", alpha=settings.alpha, seed=settings.seed)
    db_url = settings.db_url or default_url(home)
    repo = Repository(connect(db_url, migrate=True))
    link_db = home / "demo" / "superlink.db"
    for stale in link_db.parent.glob("superlink.db*"):
        stale.unlink()
    port = free_port()
    address = f"127.0.0.1:{port}"
    with ProcessGroup(home / "demo" / "logs", flower_env(home, db_url=db_url)) as group:
        link = group.start("superlink", superlink_command(port=port, database=link_db))
        try:
            wait_for_port("127.0.0.1", port, timeout=60, process=link.process)
        except FederationError as exc:
            raise FederationError(f"{exc}\n{group.tail(link)}") from exc
        on_status(f"SuperLink listening on {address}")
        for name in names:
            group.start(name, supernode_command(superlink=address, port=free_port(), data_path=parts[name], department=name))
        control = Control(address)
        deadline = time.monotonic() + 120
        while len(control.online_nodes()) < len(names):
            if time.monotonic() > deadline:
                raise FederationError(f"only {len(control.online_nodes())} of {len(names)} SuperNodes connected; see {group.log_dir}")
            time.sleep(0.5)
        on_status(f"{len(names)} SuperNodes online: {', '.join(names)}")
        overrides: dict[str, Any] = {
            "strategy": settings.strategy,
            "proximal-mu": settings.proximal_mu,
            "num-rounds": settings.rounds,
            "seed": settings.seed,
            "start-from": "fresh",
            "min-nodes": min(2, len(names)),
            "state-url": db_url,
            "model-dir": str(home / "models"),
        }
        flower_run_id = control.start_run(overrides)
        on_status(f"run submitted (Flower run {flower_run_id})")
        run = follow_run(
            repo,
            flower_run_id,
            timeout=settings.timeout,
            on_round=on_round,
            alive=lambda: link.process.poll() is None and not control.run_finished(flower_run_id),
        )
    return repo, run
