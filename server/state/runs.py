"""State records, one aggregate: Runs: create, finish, resume, look up (by QuorumFL or Flower run id), list (a
listing of every run's facts reads them with Core alone: ``listing.py``).

Part of ``Repository`` (``repository.py``); every method is one transaction (``access.write``/``read``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from quorumfl.errors import ConfigError, NotFoundError
from quorumfl.server.state.access import (
    RoundStatus,
    RunStatus,
    StateAccess,
    utcnow,
)
from quorumfl.server.state.orm import (
    Round,
    Run,
)

__all__ = ["RunRecords"]


class RunRecords(StateAccess):
    def create_run(
        self, *, flower_run_id: int | None, config: Mapping[str, Any], strategy: str, num_rounds: int
    ) -> Run:
        def op(s: Session) -> Run:
            now = utcnow()
            run = Run(
                flower_run_id=flower_run_id,
                status=RunStatus.RUNNING,
                config=dict(config),
                strategy=strategy,
                num_rounds=num_rounds,
                created_at=now,
                started_at=now,
            )
            s.add(run)
            s.flush()
            return run

        return self._write(op)

    def finish_run(self, run_id: int, status: RunStatus, *, error: str | None = None) -> None:
        """Record the run's final status; a run already stopped by the admin stays stopped."""

        def op(s: Session) -> None:
            run = s.get(Run, run_id)
            if run is None:
                raise NotFoundError(f"run {run_id} does not exist")
            if run.status == RunStatus.STOPPED:
                return
            run.status = status
            run.error = error
            run.finished_at = utcnow()

        self._write(op)

    def resume_run(self, run_id: int, *, flower_run_id: int | None, reason: str) -> Run:
        """Take up an interrupted run (status running or failed) as Flower run ``flower_run_id``: its
        unfinished rounds are recorded as aborted with ``reason`` and it is running again."""

        def op(s: Session) -> Run:
            run = s.scalar(select(Run).where(Run.id == run_id).options(selectinload(Run.rounds)))
            if run is None:
                raise NotFoundError(f"run {run_id} does not exist; 'quorumfl runs list' shows the runs")
            if run.status not in (RunStatus.RUNNING, RunStatus.FAILED):
                raise ConfigError(f"run {run_id} is {run.status}; only an interrupted (running or failed) run "
                                  "can be resumed")
            for rnd in run.rounds:
                if rnd.status == RoundStatus.RUNNING:
                    rnd.status = RoundStatus.ABORTED
                    rnd.error = reason
                    rnd.finished_at = utcnow()
            run.flower_run_id = flower_run_id
            run.status = RunStatus.RUNNING
            run.error = None
            run.finished_at = None
            s.flush()
            return run

        return self._write(op)

    def run_status(self, run_id: int) -> RunStatus:
        status = self._read(lambda s: s.scalar(select(Run.status).where(Run.id == run_id)))
        if status is None:
            raise NotFoundError(f"run {run_id} does not exist")
        return RunStatus(status)

    def get_run(self, ref: int) -> Run:
        """A run by QuorumFL id, or else by Flower run id."""

        def op(s: Session) -> Run | None:
            opts = selectinload(Run.rounds).selectinload(Round.failures)
            run = s.scalar(select(Run).where(Run.id == ref).options(opts)) if ref < 2**31 else None
            if run is None and 0 <= ref < 2**64:
                run = s.scalar(select(Run).where(Run.flower_run_id == ref).options(opts))
            return run

        run = self._read(op)
        if run is None:
            raise NotFoundError(f"run {ref} does not exist; 'quorumfl runs list' shows the runs")
        return run

    def list_runs(self) -> list[Run]:
        return self._read(
            lambda s: list(
                s.scalars(select(Run).options(selectinload(Run.rounds)).order_by(Run.id))
            )
        )
