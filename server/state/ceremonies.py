"""State records, one aggregate: Threshold CKKS: key ceremonies (requested, running, complete, failed) and each round's decryption.

Part of ``Repository`` (``repository.py``); every method is one transaction (``access.write``/``read``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from quorumfl.errors import ConfigError, NotFoundError
from quorumfl.server.state.access import (
    CeremonyStatus,
    RunStatus,
    utcnow,
)
from quorumfl.server.state.orm import (
    Decryption,
    KeyCeremony,
    Round,
)
from quorumfl.server.state.runs import RunRecords

__all__ = ["KeyRecords"]


class KeyRecords(RunRecords):
    def request_ceremony(self, run_ref: int) -> KeyCeremony:
        """Ask the server of a running run for a fresh key ceremony before its next round."""
        run = self.get_run(run_ref)
        if run.status != RunStatus.RUNNING:
            raise ConfigError(f"run {run.id} is {run.status}; a key ceremony can only be requested for a running run")
        if run.config.get("secure-aggregation") != "ckks":
            raise ConfigError(f"run {run.id} does not use secure-aggregation = \"ckks\"; it has no keys to renew")

        def op(s: Session) -> KeyCeremony:
            pending = s.scalar(select(KeyCeremony).where(
                KeyCeremony.run_id == run.id, KeyCeremony.status == CeremonyStatus.REQUESTED))
            if pending is not None:
                return pending
            ceremony = KeyCeremony(run_id=run.id, status=CeremonyStatus.REQUESTED, members=[], holders=[],
                                   requested_at=utcnow())
            s.add(ceremony)
            s.flush()
            return ceremony

        return self._write(op)

    def ceremony_requested(self, run_id: int) -> bool:
        return self._read(lambda s: s.scalar(select(KeyCeremony.id).where(
            KeyCeremony.run_id == run_id, KeyCeremony.status == CeremonyStatus.REQUESTED)) is not None)

    def start_ceremony(self, run_id: int, *, members: Iterable[int], threshold: int, params: Mapping[str, Any]) -> int:
        """A ceremony begins: an admin's pending request becomes it, or a new row is made."""

        def op(s: Session) -> int:
            ceremony = s.scalar(select(KeyCeremony).where(
                KeyCeremony.run_id == run_id, KeyCeremony.status == CeremonyStatus.REQUESTED))
            if ceremony is None:
                ceremony = KeyCeremony(run_id=run_id, requested_at=utcnow(), holders=[])
                s.add(ceremony)
            ceremony.status = CeremonyStatus.RUNNING
            ceremony.members = list(members)
            ceremony.threshold = threshold
            ceremony.params = dict(params)
            s.flush()
            return ceremony.id

        return self._write(op)

    def finish_ceremony(self, ceremony_id: int, *, key_id: str | None, holders: Iterable[int],
                        error: str | None = None) -> None:
        def op(s: Session) -> None:
            ceremony = s.get(KeyCeremony, ceremony_id)
            if ceremony is None:
                raise NotFoundError(f"key ceremony {ceremony_id} does not exist")
            ceremony.status = CeremonyStatus.FAILED if error else CeremonyStatus.COMPLETE
            ceremony.key_id = key_id
            ceremony.holders = list(holders)
            ceremony.error = error
            ceremony.finished_at = utcnow()

        self._write(op)

    def ceremonies(self, run_ref: int) -> list[KeyCeremony]:
        run = self.get_run(run_ref)
        return self._read(lambda s: list(s.scalars(
            select(KeyCeremony).where(KeyCeremony.run_id == run.id).order_by(KeyCeremony.id))))

    def add_decryption(self, round_id: int, *, key_id: str, contributors: Iterable[int], decryptors: Iterable[int]) -> int:
        def op(s: Session) -> int:
            row = Decryption(round_id=round_id, key_id=key_id, contributors=list(contributors),
                             decryptors=list(decryptors), status="requested", created_at=utcnow())
            s.add(row)
            s.flush()
            return row.id

        return self._write(op)

    def finish_decryption(self, decryption_id: int, *, error: str | None = None) -> None:
        def op(s: Session) -> None:
            row = s.get(Decryption, decryption_id)
            if row is None:
                raise NotFoundError(f"decryption {decryption_id} does not exist")
            row.status = "failed" if error else "complete"
            row.error = error
            row.finished_at = utcnow()

        self._write(op)

    def decryptions(self, run_ref: int) -> list[tuple[int, Decryption]]:
        """(round number, decryption) pairs of a run, oldest first."""
        run = self.get_run(run_ref)
        rows = self._read(lambda s: list(s.execute(
            select(Round.number, Decryption).join(Decryption, Decryption.round_id == Round.id)
            .where(Round.run_id == run.id).order_by(Decryption.id))))
        return [(int(number), row) for number, row in rows]
