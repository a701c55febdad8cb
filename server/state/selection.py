"""State records, one aggregate: Client selection: the selector's learned state by key, and each round's choices.

Part of ``Repository`` (``repository.py``); every method is one transaction (``access.write``/``read``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from quorumfl.errors import ConfigError, NotFoundError
from quorumfl.server.state.access import (
    utcnow,
)
from quorumfl.server.state.orm import (
    SelectionRecord,
    SelectorState,
)
from quorumfl.server.state.runs import RunRecords

__all__ = ["SelectionRecords"]


class SelectionRecords(RunRecords):
    def selector_state(self, key: str) -> SelectorState | None:
        """The selector state kept under ``key``, or None if nothing was learned under it yet."""
        return self._read(lambda s: s.get(SelectorState, key))

    def save_selector_state(self, key: str, *, kind: str, rounds: int, state: Mapping[str, Any]) -> None:
        """Replace the state kept under ``key`` (one transaction: the old row stays if this fails)."""
        if len(key) > 128:
            raise ConfigError(f"selection-key {key[:40]!r}… is {len(key)} characters; use at most 128")

        def op(s: Session) -> None:
            row = s.get(SelectorState, key)
            if row is None:
                s.add(SelectorState(key=key, kind=kind, rounds=rounds, state=dict(state), updated_at=utcnow()))
                return
            if row.kind != kind:
                raise ConfigError(f"selection-key {key!r} holds a '{row.kind}' selector's state, this run uses "
                                  f"'{kind}'; choose another selection-key")
            row.rounds, row.state, row.updated_at = rounds, dict(state), utcnow()

        self._write(op)

    def selector_states(self) -> list[SelectorState]:
        return self._read(lambda s: list(s.scalars(select(SelectorState).order_by(SelectorState.key))))

    def delete_selector_state(self, key: str) -> None:
        def op(s: Session) -> None:
            row = s.get(SelectorState, key)
            if row is None:
                raise NotFoundError(f"no selector state is kept under {key!r}; 'quorumfl selection list' shows the keys")
            s.delete(row)

        self._write(op)

    def add_selection(self, run_id: int, round_number: int, *, policy: str, choices: Iterable[tuple[int, int]],
                      outcomes: Mapping[int, str], reward: float, details: Mapping[str, float]) -> None:
        self._write(lambda s: s.add(SelectionRecord(
            run_id=run_id, round=round_number, policy=policy, choices=[[int(n), int(e)] for n, e in choices],
            outcomes={str(n): o for n, o in outcomes.items()}, reward=float(reward), details=dict(details),
            created_at=utcnow(),
        )))

    def selections(self, run_ref: int) -> list[SelectionRecord]:
        """A run's selection records in round order (``run_ref``: QuorumFL or Flower run id)."""
        run = self.get_run(run_ref)
        return self._read(lambda s: list(s.scalars(
            select(SelectionRecord).where(SelectionRecord.run_id == run.id).order_by(SelectionRecord.round))))
