"""State records, one aggregate: Rounds of a run: start (refused once the run was stopped), progress, finish or abort, failures per node.

Part of ``Repository`` (``repository.py``); every method is one transaction (``access.write``/``read``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from quorumfl.errors import NotFoundError, RunStoppedError
from quorumfl.server.state.access import (
    STOPPED_BY_ADMIN,
    RoundStatus,
    RunStatus,
    utcnow,
)
from quorumfl.server.state.orm import (
    Round,
    RoundFailure,
    Run,
)
from quorumfl.server.state.runs import RunRecords

__all__ = ["RoundRecords"]


def _cut_short(reason: str, failure: str | None) -> str:
    """The reason of a round a stop made fail: the stop's reason, then the failure it caused."""
    return f"{reason}; the round had failed: {failure}"


class RoundRecords(RunRecords):
    def start_round(self, run_id: int, number: int, selected: Iterable[int]) -> Round:
        """Record round ``number`` as running; ``RunStoppedError`` (nothing written) when the run is no
        longer running, e.g. an admin's ``runs stop`` landed while the ServerApp was between rounds."""

        def op(s: Session) -> Round:
            run = s.get(Run, run_id)
            if run is None:
                raise NotFoundError(f"run {run_id} does not exist")
            if run.status != RunStatus.RUNNING:
                raise RunStoppedError(f"run {run_id} is {run.status}; round {number} is not started")
            # Earlier attempts of this round (a crashed or stopped server) stay recorded as aborted.
            earlier = list(s.scalars(select(Round).where(Round.run_id == run_id, Round.number == number)))
            for old in earlier:
                if old.status == RoundStatus.RUNNING:
                    old.status = RoundStatus.ABORTED
                    old.error = old.error or "interrupted; the round was started again"
                    old.finished_at = utcnow()
            rnd = Round(
                run_id=run_id,
                number=number,
                attempt=len(earlier) + 1,
                status=RoundStatus.RUNNING,
                selected=list(selected),
                participants=[],
                started_at=utcnow(),
                timings={},
            )
            s.add(rnd)
            s.flush()
            return rnd

        return self._write(op)

    def finish_round(
        self,
        round_id: int,
        status: RoundStatus,
        *,
        participants: Iterable[int],
        timings: Mapping[str, float],
        error: str | None = None,
    ) -> None:
        """Record how a round ended. A round that fails in a run that was stopped (an admin's ``runs
        stop``, an interrupted demo) is recorded as aborted, with the run's reason and its failure: the
        stop ended its nodes' tasks, so the failure says nothing about the nodes."""

        def op(s: Session) -> None:
            rnd = s.get(Round, round_id)
            if rnd is None:
                raise NotFoundError(f"round {round_id} does not exist")
            run = s.get(Run, rnd.run_id)
            if status == RoundStatus.FAILED and run is not None and run.status == RunStatus.STOPPED:
                rnd.status, rnd.error = RoundStatus.ABORTED, _cut_short(run.error or STOPPED_BY_ADMIN, error)
            else:
                rnd.status, rnd.error = status, error
            rnd.participants = list(participants)
            rnd.timings = {k: round(float(v), 4) for k, v in timings.items()}
            rnd.finished_at = utcnow()

        self._write(op)

    def set_round_progress(self, round_id: int, progress: Mapping[str, Any]) -> None:
        """Record the stage a running round is in (``stage``, ``asked``, ``replied``, ``failed``,
        ``waiting``, ``started``: UNIX seconds); ignored once the round has finished."""

        def op(s: Session) -> None:
            rnd = s.get(Round, round_id)
            if rnd is not None and rnd.status == RoundStatus.RUNNING:
                rnd.progress = dict(progress)

        self._write(op)

    def abort_running_rounds(self, run_id: int, reason: str, *, failed_since: int | None = None) -> int:
        """Mark rounds of ``run_id`` still 'running' as aborted (server stopped or crashed). With
        ``failed_since`` (a round id from ``unfinished_from``, read before the run was stopped at the
        SuperLink), rounds from that id on that have failed meanwhile are aborted too: the stop ended
        their nodes' tasks before the run was recorded as stopped."""

        def op(s: Session) -> int:
            rounds = list(s.scalars(select(Round).where(Round.run_id == run_id, Round.status == RoundStatus.RUNNING)))
            if failed_since is not None:
                rounds += s.scalars(select(Round).where(
                    Round.run_id == run_id, Round.status == RoundStatus.FAILED, Round.id >= failed_since))
            for rnd in rounds:
                rnd.error = reason if rnd.status == RoundStatus.RUNNING else _cut_short(reason, rnd.error)
                rnd.status = RoundStatus.ABORTED
                rnd.finished_at = utcnow()
            return len(rounds)

        return self._write(op)

    def unfinished_from(self, run_id: int) -> int:
        """The id from which rounds of ``run_id`` are unfinished now: its first running round's, else one
        past its last round's (round ids only grow)."""

        def op(s: Session) -> int:
            running = s.scalar(select(func.min(Round.id)).where(Round.run_id == run_id,
                                                                Round.status == RoundStatus.RUNNING))
            last = s.scalar(select(func.max(Round.id)).where(Round.run_id == run_id))
            return int(running) if running is not None else int(last or 0) + 1

        return self._read(op)

    def add_failure(self, round_id: int, node_id: int, *, stage: str, reason: str) -> None:
        self._write(
            lambda s: s.add(
                RoundFailure(
                    round_id=round_id, node_id=node_id, stage=stage, reason=reason[:4000], created_at=utcnow()
                )
            )
        )

    def list_rounds(self, run_ref: int) -> list[Round]:
        return list(self.get_run(run_ref).rounds)
