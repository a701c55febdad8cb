"""The run listing (``quorumfl runs list``) read with SQLAlchemy Core alone.

A listing is the command an admin or a script runs most, and importing SQLAlchemy's ORM with the
state's mapped classes is about half of such a command's start. This reads the three tables it needs
in four queries, whatever the number of runs, through Core: the tables are reflected from the
database, so the schema stays declared once (``orm.py`` and its migrations) and their types (JSON,
time stamps) are read as the ORM reads them; ids stored two's-complement are read back unsigned.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Engine, MetaData, Table, distinct, func, select
from sqlalchemy.exc import SQLAlchemyError

from quorumfl.errors import StateError
from quorumfl.server.state.types import unsigned

__all__ = ["MetricRow", "RunFacts", "RunRow", "list_run_facts"]

COMPLETED = "completed"  # access.RoundStatus.COMPLETED (its module imports the ORM)


@dataclass(frozen=True)
class RunRow:
    """A ``runs`` row, as a listing shows it."""

    id: int
    flower_run_id: int | None
    status: str
    config: dict[str, Any]
    strategy: str
    num_rounds: int
    error: str | None
    started_at: datetime | None
    finished_at: datetime | None

    @classmethod
    def of(cls, run: Any) -> RunRow:
        """The row of a run read otherwise (the ORM's ``Run``)."""
        return cls(run.id, run.flower_run_id, run.status, dict(run.config), run.strategy, run.num_rounds, run.error,
                   run.started_at, run.finished_at)


@dataclass(frozen=True)
class MetricRow:
    """A run-level metric: its round, name and value."""

    round: int
    name: str
    value: float


@dataclass(frozen=True)
class RunFacts:
    """What a listing shows of one run: its row, how many distinct rounds completed, the names of
    every metric it recorded (run-level or a node's) and its run-level metrics in (round, id) order."""

    run: RunRow
    rounds_completed: int
    metric_names: frozenset[str]
    run_metrics: list[MetricRow]


def list_run_facts(engine: Engine) -> list[RunFacts]:
    """Every run with its facts, oldest first."""
    try:
        with engine.connect() as conn:
            meta = MetaData()
            runs, rounds, metrics = (Table(name, meta, autoload_with=conn) for name in ("runs", "rounds", "metrics"))
            rows = conn.execute(select(runs).order_by(runs.c.id)).all()
            completed: dict[int, int] = {run_id: count for run_id, count in conn.execute(
                select(rounds.c.run_id, func.count(distinct(rounds.c.number)))
                .where(rounds.c.status == COMPLETED).group_by(rounds.c.run_id))}
            names: dict[int, set[str]] = {}
            for run_id, name in conn.execute(select(metrics.c.run_id, metrics.c.name).distinct()):
                names.setdefault(run_id, set()).add(name)
            values: dict[int, list[MetricRow]] = {}
            for run_id, number, name, value in conn.execute(
                    select(metrics.c.run_id, metrics.c.round, metrics.c.name, metrics.c.value)
                    .where(metrics.c.node_id.is_(None)).order_by(metrics.c.round, metrics.c.id)):
                values.setdefault(run_id, []).append(MetricRow(number, name, float(value)))
    except SQLAlchemyError as exc:
        raise StateError(f"state database read failed: {exc.__class__.__name__}: {exc}") from exc
    return [RunFacts(_run(r), completed.get(r.id, 0), frozenset(names.get(r.id, ())), values.get(r.id, []))
            for r in rows]


def _run(row: Any) -> RunRow:
    return RunRow(row.id, unsigned(row.flower_run_id), row.status, dict(row.config), row.strategy, row.num_rounds,
                  row.error, row.started_at, row.finished_at)
