"""Following a run from the state DB: each finished round once, the running round's stage and nodes,
until the run's record reaches a final status (``runs start --follow``, the demo, the benchmarks)."""

from __future__ import annotations

import time
from collections.abc import Callable

from quorumfl.errors import FederationError, NotFoundError
from quorumfl.server.state.orm import Round, Run
from quorumfl.server.state.repository import Repository, RoundStatus, RunStatus

__all__ = ["follow_run", "progress_line"]


def follow_run(
    repo: Repository,
    flower_run_id: int,
    *,
    timeout: float,
    on_round: Callable[[Run, Round], None] | None = None,
    poll: float = 1.0,
    alive: Callable[[], bool] | None = None,
    on_progress: Callable[[Run, Round], None] | None = None,
) -> Run:
    """Wait for the run's record to reach a final status, reporting each finished round once and,
    with ``on_progress``, the running round at every poll (its ``progress``: stage and nodes)."""
    deadline = time.monotonic() + timeout
    reported: set[int] = set()

    def check() -> Run | None:
        try:
            run = repo.get_run(flower_run_id)
        except NotFoundError:
            return None
        for rnd in run.rounds:
            if rnd.status not in (RoundStatus.RUNNING, RoundStatus.ABORTED) and rnd.number not in reported:
                reported.add(rnd.number)
                if on_round is not None:
                    on_round(run, rnd)
        running = [r for r in run.rounds if r.status == RoundStatus.RUNNING]
        if on_progress is not None and running and run.status == RunStatus.RUNNING:
            on_progress(run, max(running, key=lambda r: r.id))
        return run if run.status != RunStatus.RUNNING else None

    while True:
        if (run := check()) is not None:
            return run
        if alive is not None and not alive():
            time.sleep(poll)  # the final status may be committed just now
            if (run := check()) is not None:
                return run
            raise FederationError(
                f"run {flower_run_id} ended at the SuperLink without a final status in the state DB "
                "(the ServerApp failed to start or was killed); see the SuperLink log"
            )
        if time.monotonic() > deadline:
            raise FederationError(f"run {flower_run_id} did not finish within {timeout:.0f}s")
        time.sleep(poll)


def progress_line(rnd: Round, *, now: float | None = None) -> str:
    """One line for a running round: "round 3 · train: 7/10 replied, 1 failed, 2 awaited (34 s left)"."""
    head = f"round {rnd.number}" + (f" (attempt {rnd.attempt})" if rnd.attempt > 1 else "")
    p = rnd.progress
    if not p:
        return f"{head}: starting"
    now = time.time() if now is None else now
    parts = [f"{p['replied']}/{p['asked']} replied"]
    if p.get("failed"):
        parts.append(f"{p['failed']} failed")
    if p.get("waiting"):
        left = float(p.get("deadline", now)) - now
        parts.append(f"{p['waiting']} awaited" + (f" ({left:.0f} s left)" if left >= 0 else f" (late by {-left:.0f} s)"))
    return f"{head} · {p['stage']}: " + ", ".join(parts)
