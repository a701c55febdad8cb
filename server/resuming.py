"""Taking up an interrupted run (``resume-run``): check that this config is the run's own, then find
where it stopped — the first round to run, the models of its last completed round, and who took part.
"""

from __future__ import annotations

import logging

import numpy as np
from numpy.typing import NDArray

from quorumfl.errors import ConfigError, FederationError
from quorumfl.privacy.admin import RUN_STAMP_KEYS
from quorumfl.server.config import RunConfig
from quorumfl.server.model_store import ModelStore
from quorumfl.server.state.orm import Round, Run
from quorumfl.server.state.repository import INTERRUPTED, Repository, RoundStatus

__all__ = ["last_attempt_set", "resume_point", "take_up"]

log = logging.getLogger(__name__)
Arrays = dict[str, NDArray[np.generic]]


def take_up(repo: Repository, config: RunConfig, run_id: int, flower_run_id: int | None) -> Run:
    """The interrupted run, checked against this config (the same run, not a look-alike)."""
    stored = repo.get_run(run_id)
    # the roster is the admin's current one, and each signature stamps its run afresh
    ignored = {"resume-run", "node-state-key", "roster", *RUN_STAMP_KEYS}
    mine = {k: v for k, v in config.resolved().items() if k not in ignored}
    theirs = {k: v for k, v in stored.config.items() if k not in ignored}
    # Keys a newer release added are absent from an older run's stored config: they keep their defaults.
    differ = sorted(k for k in theirs if mine.get(k) != theirs[k])
    if differ:
        raise ConfigError(f"resume-run {run_id}: this config differs from the run's stored config in {differ}; "
                          f"resume it with 'quorumfl runs resume {run_id}', which sends the stored config")
    run = repo.resume_run(run_id, flower_run_id=flower_run_id,
                               reason=INTERRUPTED)
    log.info("resuming run %s as Flower run %s", run_id, flower_run_id)
    return run


def resume_point(repo: Repository, store: ModelStore, run: Run, lineages: list[str], models: list[Arrays],
                 parents: list[int | None]) -> tuple[int, int, set[int]]:
    """Load the models of the last completed round into ``models``/``parents``; returns the first
    round to run, the rounds completed so far and the nodes that took part in them."""
    rounds = repo.list_rounds(run.id)
    finished = [r for r in rounds if r.status in (RoundStatus.COMPLETED, RoundStatus.FAILED)]
    done = [r for r in finished if r.status == RoundStatus.COMPLETED]
    seen = {int(n) for r in done for n in r.participants}
    if done:
        last = max(r.number for r in done)
        versions = [v for v in repo.list_model_versions(run_id=run.id) if v.round == last]
        for k, lineage in enumerate(lineages):
            matching = [v for v in versions if v.architecture == lineage]
            if not matching:
                raise FederationError(f"run {run.id}: round {last} completed but has no stored model version for "
                                      f"{lineage}; it cannot be resumed")
            version = matching[-1]
            models[k], parents[k] = store.load(version.path, version.sha256), version.id
    first = max((r.number for r in finished), default=0) + 1
    log.info("run %s resumes at round %s after %s completed round(s)", run.id, first, len(done))
    return first, len(done), seen


def last_attempt_set(rounds: list[Round]) -> list[int] | None:
    """The nodes selected by the latest attempt since the last completed round (failed or aborted):
    the next round trains from that attempt's model, and under secure aggregation each node's
    contribution ledger admits a second contribution from a model only with the same set. None when
    the last round completed (or there was none)."""
    latest = max(rounds, key=lambda r: r.id, default=None)
    if latest is None or latest.status == RoundStatus.COMPLETED:
        return None
    return sorted(int(n) for n in latest.selected) or None
