"""State records, one aggregate: the trials of hyper-parameter searches (``quorumfl tune``).

Part of ``Repository`` (``repository.py``); every method is one transaction (``access.write``/``read``)."""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from quorumfl.errors import NotFoundError
from quorumfl.server.state.access import StateAccess, utcnow
from quorumfl.server.state.orm import SearchTrial

__all__ = ["TrialRecords", "TrialState"]


class TrialState(StrEnum):
    RUNNING = "running"
    COMPLETE = "complete"
    PRUNED = "pruned"  # stopped by the pruner after a round
    FAILED = "failed"


class TrialRecords(StateAccess):
    def start_trial(self, study: str, params: Mapping[str, Any], space: Mapping[str, Any]) -> SearchTrial:
        """The study's next trial (number = trials so far), running."""

        def op(s: Session) -> SearchTrial:
            number = s.scalar(select(func.count()).select_from(SearchTrial).where(SearchTrial.study == study)) or 0
            trial = SearchTrial(study=study, number=number, state=TrialState.RUNNING, params=dict(params),
                                space=dict(space), figures={}, notes={}, created_at=utcnow())
            s.add(trial)
            s.flush()
            return trial

        return self._write(op)

    def update_trial(self, trial_id: int, *, run_id: int | None = None, metric: str | None = None,
                     higher_is_better: bool | None = None, figures: Mapping[str, float] | None = None) -> None:
        """Record what a running trial has shown so far."""

        def op(s: Session) -> None:
            trial = self._trial(s, trial_id)
            if run_id is not None:
                trial.run_id = run_id
            if metric is not None:
                trial.metric = metric
            if higher_is_better is not None:
                trial.higher_is_better = higher_is_better
            if figures is not None:
                trial.figures = dict(figures)

        self._write(op)

    def finish_trial(self, trial_id: int, state: TrialState, value: float | None = None) -> None:
        def op(s: Session) -> None:
            trial = self._trial(s, trial_id)
            trial.state, trial.value, trial.finished_at = state, value, utcnow()

        self._write(op)

    def note_trial(self, trial_id: int, notes: Mapping[str, Any]) -> None:
        """Keep what the sampler and pruner noted on the trial (JSON values)."""

        def op(s: Session) -> None:
            self._trial(s, trial_id).notes = dict(notes)

        self._write(op)

    def trials(self, study: str) -> list[SearchTrial]:
        """The study's trials in order (none: an unknown study)."""
        return self._read(lambda s: list(s.scalars(
            select(SearchTrial).where(SearchTrial.study == study).order_by(SearchTrial.number))))

    def studies(self) -> list[tuple[str, int]]:
        """Every study with its number of trials, by name."""
        rows = self._read(lambda s: list(s.execute(
            select(SearchTrial.study, func.count()).group_by(SearchTrial.study).order_by(SearchTrial.study))))
        return [(str(name), int(count)) for name, count in rows]

    @staticmethod
    def _trial(s: Session, trial_id: int) -> SearchTrial:
        trial = s.get(SearchTrial, trial_id)
        if trial is None:
            raise NotFoundError(f"search trial {trial_id} not found")
        return trial
