"""State records, one aggregate: Metrics per run and round, global or per node.

Part of ``Repository`` (``repository.py``); every method is one transaction (``access.write``/``read``)."""

from __future__ import annotations

from collections.abc import Mapping

from sqlalchemy import select
from sqlalchemy.orm import Session

from quorumfl.server.state.access import (
    StateAccess,
)
from quorumfl.server.state.orm import (
    Metric,
)

__all__ = ["MetricRecords"]


class MetricRecords(StateAccess):
    def add_metrics(
        self, run_id: int, round_number: int, values: Mapping[str, float], *, node_id: int | None = None
    ) -> None:
        self._write(
            lambda s: s.add_all(
                Metric(run_id=run_id, round=round_number, node_id=node_id, name=k, value=float(v))
                for k, v in values.items()
            )
        )

    def metrics(self, run_id: int, *, name: str | None = None) -> list[Metric]:
        def op(s: Session) -> list[Metric]:
            q = select(Metric).where(Metric.run_id == run_id)
            if name is not None:
                q = q.where(Metric.name == name)
            return list(s.scalars(q.order_by(Metric.round, Metric.id)))

        return self._read(op)
