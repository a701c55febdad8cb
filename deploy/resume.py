"""Taking up runs that a crashed or killed server left behind.

The state DB is the record of a run: every completed round's model version, metrics and selector
state is committed when the round ends, so a server killed mid-round (``kill -9`` of the SuperLink
and its ServerApp) loses only the round in flight. Resuming submits a new Flower run with the run's
stored config plus ``resume-run`` (the QuorumFL run) and ``node-state-key`` (the original Flower
run, under which the nodes keep their personal models, compression residuals and ε reservations);
the ServerApp records the interrupted round as aborted and redoes it from the last completed model.
"""

from __future__ import annotations

from typing import Any

from quorumfl.deploy.control import Control
from quorumfl.errors import ConfigError
from quorumfl.privacy.admin import RUN_STAMP_KEYS
from quorumfl.server.config import DEFAULTS
from quorumfl.server.resuming import last_attempt_set
from quorumfl.server.state.orm import Run
from quorumfl.server.state.repository import INTERRUPTED, Repository, RunStatus

__all__ = ["resume_interrupted", "resume_overrides", "resume_run", "who_trains_again"]


def resume_overrides(run: Run) -> dict[str, Any]:
    """The stored config for a resumed run, less its roster and its signature's stamp: the admin's
    current roster is signed into the resumed run (a key revoked meanwhile is not trusted again),
    with a fresh nonce and expiry."""
    values: dict[str, Any] = {k: v for k, v in run.config.items()
                              if k in DEFAULTS and k != "roster" and k not in RUN_STAMP_KEYS}
    values["resume-run"] = run.id
    values["node-state-key"] = str(run.config.get("node-state-key") or run.flower_run_id or "")
    return values


def resume_run(repo: Repository, control: Control, ref: int) -> int:
    """Resume one interrupted run (running in the DB but finished or unknown at the SuperLink, or
    failed); returns the new Flower run id."""
    run = repo.get_run(ref)
    if run.status not in (RunStatus.RUNNING, RunStatus.FAILED):
        raise ConfigError(f"run {run.id} is {run.status}; only an interrupted (running or failed) run can be resumed")
    if run.flower_run_id is not None:
        flower = control.list_runs(run.flower_run_id)
        if flower and flower[0].status != "finished":
            raise ConfigError(f"run {run.id} is still {flower[0].status} at the SuperLink (Flower run "
                              f"{run.flower_run_id}); stop it with 'quorumfl runs stop {run.id}' first")
    flower_run_id = control.start_run(resume_overrides(run))
    # Running again from now on (the ServerApp takes it up in a few seconds; until then `runs show`
    # would still say failed): the same record the ServerApp makes, under the new Flower run.
    repo.resume_run(run.id, flower_run_id=flower_run_id, reason=INTERRUPTED)
    return flower_run_id


def resume_interrupted(repo: Repository, control: Control) -> list[tuple[int, int]]:
    """At server start: every run the DB still shows as running whose Flower run this SuperLink knows
    is resumed; a Flower run still marked running there lost its ServerApp with the previous server
    process and is stopped first. Returns (QuorumFL run id, new Flower run id) pairs."""
    known = {r.run_id: r for r in control.list_runs()}
    resumed: list[tuple[int, int]] = []
    for run in repo.list_runs():
        if run.status != RunStatus.RUNNING or run.flower_run_id not in known:
            continue
        if known[run.flower_run_id].status != "finished":
            control.stop_run(run.flower_run_id)
        flower_run_id = control.start_run(resume_overrides(run))
        repo.resume_run(run.id, flower_run_id=flower_run_id, reason=INTERRUPTED)
        resumed.append((run.id, flower_run_id))
    return resumed


def who_trains_again(repo: Repository, online: set[int], ref: int) -> tuple[str, str]:
    """Under secure aggregation, when the run's next round trains from the model of a failed attempt:
    the departments of that attempt (the server asks them again) and those of them not ``online``
    (the node ids the SuperLink counts online); empty strings otherwise."""
    run = repo.get_run(ref)
    again = last_attempt_set(run.rounds) if run.config.get("secure-aggregation", "none") != "none" else None
    if not again:
        return "", ""
    names = {n.node_id: n.department for n in repo.list_nodes()}

    def named(nodes: list[int]) -> str:
        return ", ".join(names.get(n) or str(n) for n in nodes)

    missing = [n for n in again if n not in online]
    return named(again), named(missing) + ((" is" if len(missing) == 1 else " are") if missing else "")
