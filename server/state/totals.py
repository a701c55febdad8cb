"""State records, read-only: totals over every run for the live metrics endpoint
(``server.metrics_endpoint``), computed in SQL where SQL can (counts and sums), so that a scrape
costs a few queries rather than loading every run.

Part of ``Repository`` (``repository.py``); every method is one transaction (``access.read``)."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from quorumfl.server.state.access import StateAccess, utcnow
from quorumfl.server.state.orm import Metric, Node, Round, RoundFailure, Run

__all__ = ["TotalRecords"]


class TotalRecords(StateAccess):
    def run_counts(self) -> dict[str, int]:
        """Runs by status."""
        return self._read(lambda s: {str(k): int(v) for k, v in s.execute(
            select(Run.status, func.count()).group_by(Run.status))})

    def round_counts(self) -> dict[str, int]:
        """Round attempts by status."""
        return self._read(lambda s: {str(k): int(v) for k, v in s.execute(
            select(Round.status, func.count()).group_by(Round.status))})

    def stage_totals(self) -> dict[str, float]:
        """Seconds per stage summed over every completed round (timings are JSON, summed here)."""

        def op(s: Session) -> dict[str, float]:
            totals: dict[str, float] = {}
            for timings in s.scalars(select(Round.timings).where(Round.status == "completed")):
                for stage, seconds in (timings or {}).items():
                    totals[stage] = totals.get(stage, 0.0) + float(seconds)
            return totals

        return self._read(op)

    def last_run(self) -> Run | None:
        """The most recently created run (without its rounds)."""
        return self._read(lambda s: s.scalars(select(Run).order_by(Run.id.desc()).limit(1)).first())

    def last_round(self) -> Round | None:
        """The most recently started round of any run."""
        return self._read(lambda s: s.scalars(select(Round).order_by(Round.started_at.desc(), Round.id.desc())
                                              .limit(1)).first())

    def round_failure_count(self, round_id: int) -> int:
        """How many nodes failed in a round (any stage)."""
        return self._read(lambda s: int(s.scalar(select(func.count()).select_from(RoundFailure)
                                                 .where(RoundFailure.round_id == round_id)) or 0))

    def metric_sums(self, names: tuple[str, ...]) -> dict[str, float]:
        """Each named metric summed over every run, round and node."""
        return self._read(lambda s: {str(k): float(v) for k, v in s.execute(
            select(Metric.name, func.sum(Metric.value)).where(Metric.name.in_(names)).group_by(Metric.name))})

    def latest_node_metric(self, name: str) -> dict[str, float]:
        """Per department (or node id): the metric's value in the latest run and round that reported it."""

        def op(s: Session) -> dict[str, float]:
            rows = s.execute(select(Metric.node_id, Node.department, Metric.value)
                             .join(Node, Node.node_id == Metric.node_id, isouter=True)
                             .where(Metric.name == name, Metric.node_id.is_not(None))
                             .order_by(Metric.run_id, Metric.round, Metric.id))
            return {department or str(node): float(value) for node, department, value in rows}

        return self._read(op)

    def node_counts(self, *, recent_s: float = 300.0) -> dict[str, int]:
        """Known nodes, those enabled for selection, and those the server saw connected within the last
        ``recent_s`` seconds (a round's selection records every connected node as seen)."""

        def op(s: Session) -> dict[str, int]:
            known = s.scalar(select(func.count()).select_from(Node)) or 0
            enabled = s.scalar(select(func.count()).select_from(Node).where(Node.enabled.is_(True))) or 0
            since = utcnow() - timedelta(seconds=recent_s)
            seen = s.scalar(select(func.count()).select_from(Node).where(Node.last_seen >= since)) or 0
            return {"known": int(known), "enabled": int(enabled), "seen_5m": int(seen)}

        return self._read(op)
