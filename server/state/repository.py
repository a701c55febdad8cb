"""The repository: every read and write of QuorumFL state goes through here, one transaction each.

Returned ORM objects are detached (``expire_on_commit=False``); relationships that callers need are
loaded eagerly by the method that returns them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, selectinload, sessionmaker

from quorumfl.errors import ConfigError, NotFoundError, RunStoppedError, StateError
from quorumfl.server.state.orm import (
    Decryption,
    KeyCeremony,
    Metric,
    ModelHead,
    ModelVersion,
    Node,
    Round,
    RoundFailure,
    Run,
    SelectionRecord,
    SelectorState,
)

__all__ = ["INTERRUPTED", "CeremonyStatus", "Repository", "RoundStatus", "RunStatus", "read", "utcnow", "write"]

# Why a round that was running when its server stopped is recorded as aborted.
INTERRUPTED = "interrupted: the server stopped during this round; redone after resume"


class RunStatus(StrEnum):
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    STOPPED = "stopped"


class RoundStatus(StrEnum):
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    ABORTED = "aborted"


class CeremonyStatus(StrEnum):
    REQUESTED = "requested"
    RUNNING = "running"
    COMPLETE = "complete"
    FAILED = "failed"


def utcnow() -> datetime:
    return datetime.now(UTC)


def write(sessions: sessionmaker[Session], fn: Any) -> Any:
    """Run ``fn(session)`` in one transaction; database errors become StateError."""
    try:
        with sessions() as session, session.begin():
            return fn(session)
    except SQLAlchemyError as exc:
        raise StateError(f"state database write failed: {exc.__class__.__name__}: {exc}") from exc


def read(sessions: sessionmaker[Session], fn: Any) -> Any:
    try:
        with sessions() as session:
            return fn(session)
    except SQLAlchemyError as exc:
        raise StateError(f"state database read failed: {exc.__class__.__name__}: {exc}") from exc


class Repository:
    """Typed access to runs, rounds, nodes, metrics and model versions."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self._sessions = sessions

    def _session(self) -> Session:
        return self._sessions()

    @property
    def sessions(self) -> sessionmaker[Session]:
        return self._sessions

    def _write(self, fn: Any) -> Any:
        return write(self._sessions, fn)

    def _read(self, fn: Any) -> Any:
        return read(self._sessions, fn)

    # ---- runs -------------------------------------------------------------------------------
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

        return self._write(op)  # type: ignore[no-any-return]

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

        return self._write(op)  # type: ignore[no-any-return]

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
        return run  # type: ignore[no-any-return]

    def list_runs(self) -> list[Run]:
        return self._read(  # type: ignore[no-any-return]
            lambda s: list(
                s.scalars(select(Run).options(selectinload(Run.rounds)).order_by(Run.id))
            )
        )

    # ---- rounds -----------------------------------------------------------------------------
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

        return self._write(op)  # type: ignore[no-any-return]

    def finish_round(
        self,
        round_id: int,
        status: RoundStatus,
        *,
        participants: Iterable[int],
        timings: Mapping[str, float],
        error: str | None = None,
    ) -> None:
        def op(s: Session) -> None:
            rnd = s.get(Round, round_id)
            if rnd is None:
                raise NotFoundError(f"round {round_id} does not exist")
            rnd.status = status
            rnd.participants = list(participants)
            rnd.timings = {k: round(float(v), 4) for k, v in timings.items()}
            rnd.error = error
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

    def abort_running_rounds(self, run_id: int, reason: str) -> int:
        """Mark rounds of ``run_id`` still 'running' as aborted (server stopped or crashed)."""

        def op(s: Session) -> int:
            rounds = list(s.scalars(select(Round).where(Round.run_id == run_id, Round.status == RoundStatus.RUNNING)))
            for rnd in rounds:
                rnd.status = RoundStatus.ABORTED
                rnd.error = reason
                rnd.finished_at = utcnow()
            return len(rounds)

        return self._write(op)  # type: ignore[no-any-return]

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

    # ---- key ceremonies and decryptions (threshold CKKS) ------------------------------------------
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

        return self._write(op)  # type: ignore[no-any-return]

    def ceremony_requested(self, run_id: int) -> bool:
        return self._read(lambda s: s.scalar(select(KeyCeremony.id).where(  # type: ignore[no-any-return]
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

        return self._write(op)  # type: ignore[no-any-return]

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
        return self._read(lambda s: list(s.scalars(  # type: ignore[no-any-return]
            select(KeyCeremony).where(KeyCeremony.run_id == run.id).order_by(KeyCeremony.id))))

    def add_decryption(self, round_id: int, *, key_id: str, contributors: Iterable[int], decryptors: Iterable[int]) -> int:
        def op(s: Session) -> int:
            row = Decryption(round_id=round_id, key_id=key_id, contributors=list(contributors),
                             decryptors=list(decryptors), status="requested", created_at=utcnow())
            s.add(row)
            s.flush()
            return row.id

        return self._write(op)  # type: ignore[no-any-return]

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

    # ---- nodes ------------------------------------------------------------------------------
    def touch_node(self, node_id: int, *, department: str | None = None) -> Node:
        """Register ``node_id`` or update its last-seen time (and department when reported)."""

        def op(s: Session) -> Node:
            now = utcnow()
            node = s.get(Node, node_id)
            if node is None:
                node = Node(node_id=node_id, department=department, enabled=True, first_seen=now, last_seen=now)
                s.add(node)
            else:
                node.last_seen = now
                if department:
                    node.department = department
            s.flush()
            return node

        return self._write(op)  # type: ignore[no-any-return]

    def record_registered(self, node_id: int, department: str) -> bool:
        """A node key registered at the SuperLink under ``department``: listed from now on (not yet
        seen) if it was not known; True when it was new."""

        def op(s: Session) -> bool:
            node = s.get(Node, node_id)
            if node is None:
                s.add(Node(node_id=node_id, department=department, enabled=True, first_seen=utcnow(), last_seen=None))
                return True
            if not node.department:
                node.department = department
            return False

        return self._write(op)  # type: ignore[no-any-return]

    def list_nodes(self) -> list[Node]:
        return self._read(lambda s: list(s.scalars(select(Node).order_by(Node.department, Node.node_id))))  # type: ignore[no-any-return]

    def find_nodes(self, ref: str) -> list[Node]:
        """Nodes matching a Flower node id or a department name."""

        def op(s: Session) -> list[Node]:
            if ref.isdigit():
                node = s.get(Node, int(ref)) if int(ref) < 2**64 else None
                if node is not None:
                    return [node]
            return list(s.scalars(select(Node).where(Node.department == ref)))

        nodes = self._read(op)
        if not nodes:
            raise NotFoundError(
                f"no node with id or department '{ref}'; 'quorumfl nodes list' shows the known nodes"
            )
        return nodes  # type: ignore[no-any-return]

    def set_enabled(self, ref: str, enabled: bool) -> list[Node]:
        ids = [n.node_id for n in self.find_nodes(ref)]

        def op(s: Session) -> list[Node]:
            nodes = [s.get(Node, i) for i in ids]
            for node in nodes:
                assert node is not None
                node.enabled = enabled
            return [n for n in nodes if n is not None]

        return self._write(op)  # type: ignore[no-any-return]

    def disabled_node_ids(self) -> set[int]:
        return self._read(  # type: ignore[no-any-return]
            lambda s: set(s.scalars(select(Node.node_id).where(Node.enabled.is_(False))))
        )

    # ---- metrics ----------------------------------------------------------------------------
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

        return self._read(op)  # type: ignore[no-any-return]

    # ---- model versions ---------------------------------------------------------------------
    def add_model_version(
        self,
        *,
        run_id: int | None,
        round_number: int,
        parent_id: int | None,
        architecture: str,
        path: str,
        sha256: str,
        size_bytes: int,
        metrics: Mapping[str, float],
        tags: Iterable[str] = (),
        make_head: bool = True,
    ) -> ModelVersion:
        def op(s: Session) -> ModelVersion:
            now = utcnow()
            version = ModelVersion(
                run_id=run_id,
                round=round_number,
                parent_id=parent_id,
                architecture=architecture,
                path=path,
                sha256=sha256,
                size_bytes=size_bytes,
                metrics=dict(metrics),
                tags=list(tags),
                created_at=now,
            )
            s.add(version)
            s.flush()
            if make_head:
                self._set_head(s, architecture, version.id)
            return version

        return self._write(op)  # type: ignore[no-any-return]

    @staticmethod
    def _set_head(s: Session, architecture: str, version_id: int) -> None:
        head = s.get(ModelHead, architecture)
        if head is None:
            s.add(ModelHead(architecture=architecture, version_id=version_id, updated_at=utcnow()))
        else:
            head.version_id = version_id
            head.updated_at = utcnow()

    def get_model_version(self, version_id: int) -> ModelVersion:
        version = self._read(lambda s: s.get(ModelVersion, version_id))
        if version is None:
            raise NotFoundError(
                f"model version {version_id} does not exist; 'quorumfl models list' shows the versions"
            )
        return version  # type: ignore[no-any-return]

    def list_model_versions(self, *, run_id: int | None = None) -> list[ModelVersion]:
        def op(s: Session) -> list[ModelVersion]:
            q = select(ModelVersion)
            if run_id is not None:
                q = q.where(ModelVersion.run_id == run_id)
            return list(s.scalars(q.order_by(ModelVersion.id)))

        return self._read(op)  # type: ignore[no-any-return]

    def heads(self) -> dict[str, int]:
        return self._read(  # type: ignore[no-any-return]
            lambda s: {h.architecture: h.version_id for h in s.scalars(select(ModelHead))}
        )

    def head_version(self, architecture: str) -> ModelVersion | None:
        def op(s: Session) -> ModelVersion | None:
            head = s.get(ModelHead, architecture)
            return None if head is None else s.get(ModelVersion, head.version_id)

        return self._read(op)  # type: ignore[no-any-return]

    def rollback(self, version_id: int) -> ModelVersion:
        """Make ``version_id`` the head of its architecture: the next round starts from it."""
        version = self.get_model_version(version_id)
        self._write(lambda s: self._set_head(s, version.architecture, version.id))
        return version

    def add_tag(self, version_id: int, tag: str) -> None:
        """Add ``tag`` to a model version's tags (idempotent)."""

        def op(s: Session) -> None:
            version = s.get(ModelVersion, version_id)
            if version is None:
                raise NotFoundError(f"model version {version_id} does not exist")
            if tag not in version.tags:
                version.tags = [*version.tags, tag]

        self._write(op)

    # ---- client selection -------------------------------------------------------------------
    def selector_state(self, key: str) -> SelectorState | None:
        """The selector state kept under ``key``, or None if nothing was learned under it yet."""
        return self._read(lambda s: s.get(SelectorState, key))  # type: ignore[no-any-return]

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
        return self._read(lambda s: list(s.scalars(select(SelectorState).order_by(SelectorState.key))))  # type: ignore[no-any-return]

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
        return self._read(lambda s: list(s.scalars(  # type: ignore[no-any-return]
            select(SelectionRecord).where(SelectionRecord.run_id == run.id).order_by(SelectionRecord.round))))
