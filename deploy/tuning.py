"""Where a search's trials run (``quorumfl tune``): Flower's simulation engine, to rehearse, or the
deployed federation, to confirm; and what the departments have spent of privacy before it starts.

On the simulation engine every trial runs on the same virtual departments' partitions, made once
for the study (or the admin's ``--data``), so each department's ε ledger (kept in its partition
folder, as on a real node) adds up the whole search: ``quorumfl node budget --data FOLDER`` shows it.
Each trial's node state (checkpoints, personal models) is its own and removed after the trial.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from quorumfl.deploy.simulation import RunHooks, SimulationSettings, partitions_of, simulate
from quorumfl.errors import FederationError
from quorumfl.privacy.ledger import Ledger
from quorumfl.server.config import DpMode, RunConfig
from quorumfl.server.following import follow_run
from quorumfl.server.search import TrialHooks, TrialRunner
from quorumfl.server.state.repository import Repository

__all__ = ["federation_runner", "ledgers_spent", "prepared_simulation", "simulation_runner", "study_partitions"]


def study_partitions(settings: SimulationSettings, config: RunConfig, folder: Path) -> SimulationSettings:
    """``settings`` with the study's partitions: the admin's ``--data``, else the built-in dataset
    split once into ``folder`` (kept, so a continued study and its ledgers go on from them)."""
    if settings.data is not None:
        return settings
    if not (folder / "parts").is_dir():
        partitions_of(replace(settings, root=folder), config)
    return replace(settings, data=folder / "parts")


def ledgers_spent(settings: SimulationSettings, config: RunConfig) -> float:
    """The most ε any of the study's departments has spent already (their ledgers, at the run's δ)."""
    return max((Ledger.open(path).spent(config.dp_delta) for _, path in partitions_of(settings, config)),
               default=0.0)


def simulation_runner(repo: Repository, settings: SimulationSettings, scratch: Path) -> TrialRunner:
    """Each trial a simulation on ``settings`` (its partitions fixed by ``study_partitions``), its
    node state in a folder of ``scratch`` removed afterwards."""

    def run(values: dict[str, Any], hooks: TrialHooks) -> int:
        scratch.mkdir(parents=True, exist_ok=True)
        root = Path(tempfile.mkdtemp(prefix="trial-", dir=scratch))
        told = RunHooks(on_start=hooks.started, on_round=lambda *_: hooks.round_ended())
        try:
            recorded = simulate(values, replace(settings, root=root, keep=False), repo, hooks=told)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        if recorded.flower_run_id is None:  # every run the ServerApp records carries its Flower id
            raise FederationError(f"run {recorded.id} was recorded without its Flower run id")
        return int(recorded.flower_run_id)

    return run


def federation_runner(repo: Repository, control: Any, *, timeout: float) -> TrialRunner:
    """Each trial a run submitted to the deployed federation's SuperLink (``control``, as ``runs
    start`` uses) and followed in the state DB until it ends."""

    def run(values: dict[str, Any], hooks: TrialHooks) -> int:
        flower_run_id = int(control.start_run(values))
        hooks.started(flower_run_id)
        follow_run(repo, flower_run_id, timeout=timeout, alive=lambda: not control.run_finished(flower_run_id))
        return flower_run_id

    return run



def prepared_simulation(repo: Repository, settings: SimulationSettings, config: RunConfig, folder: Path, *,
                        budget: float) -> tuple[TrialRunner, float]:
    """The simulation runner of a study kept in ``folder`` (its partitions made once; the virtual
    departments' budget ``budget``) and the most ε any of its departments has spent already."""
    settings = study_partitions(replace(settings, node_config={**settings.node_config, "dp-budget": budget}),
                                config, folder)
    spent = ledgers_spent(settings, config) if config.dp is not DpMode.NONE else 0.0
    return simulation_runner(repo, settings, folder / "trials"), spent
