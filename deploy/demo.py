"""The demo federation: a real SuperLink and one SuperNode per department as separate processes on
127.0.0.1 (Flower's deployment engine), a FedProx run submitted through the Control API and followed
in the state DB. Updates are combined by masking secure aggregation unless told otherwise.

The data: digits split Dirichlet(α) across named departments (``image``, the default), or real city
data from Debian packages (``./setup.sh --city-data``) written as each department's own file and
imported through the product's path (schema, checks, encoding): Ames property sales by neighbourhood
groups (``tabular``: the sale price, MAE in dollars) or WordNet noun glosses split Dirichlet(α) over
their 26 classes (``text``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quorumfl.core.data import prepare_partitions
from quorumfl.core.data.departments import split_packaged
from quorumfl.deploy.local import local_federation
from quorumfl.errors import ConfigError, FederationError, NotFoundError
from quorumfl.server.services import follow_run
from quorumfl.server.state.orm import Round, Run
from quorumfl.server.state.repository import Repository, RunStatus

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
    db_url: str
    departments: int = 4
    rounds: int = 5
    alpha: float = 0.5
    seed: int = 0
    strategy: str = ""  # "": the run config's default (FedAvg with server momentum)
    proximal_mu: float | None = None  # None: the run config's default
    secure_aggregation: str = "masking"
    timeout: float = 900.0
    task: str = "image"  # image (digits), tabular (Ames sales), text (WordNet glosses)


TEXT_DEMO_GLOSSES = 6000  # a seeded subset of the 82,115 noun glosses: a few seconds per round


def _city_partitions(settings: DemoSettings, names: list[str], on_status: Callable[[str], None]) -> tuple[dict[str, Path], dict[str, Any]]:
    """Departments' own files of the tabular/text demo, imported under a schema proposed from the pool."""
    dataset = "ames" if settings.task == "tabular" else "wordnet"
    root = settings.home / "demo" / settings.task
    split = "natural" if dataset == "ames" else "dirichlet"
    on_status(f"writing {dataset} as {len(names)} departments' own files ({split} split)")
    parts, schema = split_packaged(dataset, root, names, split=split, seed=settings.seed, alpha=settings.alpha,
                                   limit=0 if dataset == "ames" else TEXT_DEMO_GLOSSES)
    model = "mlp" if dataset == "ames" else "fasttext"
    # the training recipe is the run config's defaults (the task's optimizer and rate), as a city's first run's
    return parts, {"task": settings.task, "task-schema": json.dumps(schema, sort_keys=True), "model": model}


def run_demo(
    settings: DemoSettings,
    repo: Repository,
    *,
    on_status: Callable[[str], None] = lambda _msg: None,
    on_round: Callable[[Run, Round], None] | None = None,
    on_progress: Callable[[Run, Round], None] | None = None,
) -> Run:
    """Run the whole demo, recording into ``repo`` (the state DB at ``settings.db_url``, migrated);
    every child process is stopped before this returns or raises."""
    if not 1 <= settings.departments <= len(DEPARTMENTS):
        raise FederationError(f"--departments must be 1..{len(DEPARTMENTS)}, got {settings.departments}")
    home = settings.home
    names = DEPARTMENTS[: settings.departments]
    task_settings: dict[str, Any] = {}
    if settings.task == "image":
        on_status(f"splitting digits across {len(names)} departments (Dirichlet α={settings.alpha})")
        parts = prepare_partitions(home / "demo" / "data", names, dataset="digits", alpha=settings.alpha,
                                   seed=settings.seed)
    elif settings.task in ("tabular", "text"):
        parts, task_settings = _city_partitions(settings, names, on_status)
    else:
        raise ConfigError(f"--task must be image, tabular or text, got {settings.task!r}")
    db_url = settings.db_url
    with local_federation(home / "demo", parts, db_url=db_url) as federation:
        on_status(f"SuperLink on {federation.address}; {len(names)} SuperNodes online: {', '.join(names)}")
        chosen: dict[str, Any] = {"strategy": settings.strategy} if settings.strategy else {}
        if settings.proximal_mu is not None:
            chosen["proximal-mu"] = settings.proximal_mu
        overrides: dict[str, Any] = {
            **chosen,
            "secure-aggregation": settings.secure_aggregation,
            "num-rounds": settings.rounds,
            "seed": settings.seed,
            "start-from": "fresh",
            "min-nodes": min(2, len(names)),
            "state-url": db_url,
            "model-dir": str(home / "models"),
            **task_settings,
        }
        flower_run_id = federation.control.start_run(overrides)
        how = {
            "masking": "masking secure aggregation: the server sees only the sum of the departments' updates",
            "ckks": "threshold CKKS: the server adds ciphertexts; a quorum of departments decrypts the sum",
        }.get(settings.secure_aggregation, "plaintext aggregation")
        on_status(f"run submitted (Flower run {flower_run_id}); {how}")
        try:
            run = follow_run(
                repo, flower_run_id, timeout=settings.timeout, on_round=on_round,
                alive=lambda: federation.alive(flower_run_id), on_progress=on_progress,
            )
        except KeyboardInterrupt:  # the demo's federation goes with it: nothing can resume this run
            _record_stopped(repo, flower_run_id)
            raise
    return run


def _record_stopped(repo: Repository, flower_run_id: int) -> None:
    try:
        run = repo.get_run(flower_run_id)
    except NotFoundError:
        return  # the ServerApp had not recorded the run yet
    if run.status == RunStatus.RUNNING:
        repo.abort_running_rounds(run.id, "the demo was interrupted")
        repo.finish_run(run.id, RunStatus.STOPPED, error="the demo was interrupted")
