"""The state layer's transactions and status values, shared by the records of every aggregate.

``write``/``read`` run one function in one transaction (typed by what the function returns); a
database error becomes ``StateError``. Returned ORM objects are detached (``expire_on_commit=False``);
relationships that callers need are loaded eagerly by the method that returns them.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from enum import StrEnum
from typing import TypeVar

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from quorumfl.errors import StateError

__all__ = ["INTERRUPTED", "CeremonyStatus", "RoundStatus", "RunStatus", "StateAccess", "read", "utcnow", "write"]

T = TypeVar("T")

# Why a round that was running when its server stopped is recorded as aborted.
INTERRUPTED = "interrupted: the server stopped during this round; redone after resume"
# Why a round of a run an admin stopped ('quorumfl runs stop') is recorded as aborted.
STOPPED_BY_ADMIN = "run stopped by the admin"


class RunStatus(StrEnum):
    RUNNING = "running"
    COMPLETED = "completed"  # every planned round completed
    PARTIAL = "partial"  # the run ended, but some rounds failed (none completed: failed)
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


def write(sessions: sessionmaker[Session], fn: Callable[[Session], T]) -> T:
    """Run ``fn(session)`` in one transaction; database errors become StateError."""
    try:
        with sessions() as session, session.begin():
            return fn(session)
    except SQLAlchemyError as exc:
        raise StateError(f"state database write failed: {exc.__class__.__name__}: {exc}") from exc


def read(sessions: sessionmaker[Session], fn: Callable[[Session], T]) -> T:
    try:
        with sessions() as session:
            return fn(session)
    except SQLAlchemyError as exc:
        raise StateError(f"state database read failed: {exc.__class__.__name__}: {exc}") from exc


class StateAccess:
    """Holds the session factory; each aggregate's records subclass it."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self._sessions = sessions

    def _session(self) -> Session:
        return self._sessions()

    @property
    def sessions(self) -> sessionmaker[Session]:
        return self._sessions

    @property
    def engine(self) -> Engine:
        """The engine the sessions are bound to (for Core reads: ``listing.py``)."""
        bind = self._sessions.kw["bind"]
        assert isinstance(bind, Engine)
        return bind

    def _write(self, fn: Callable[[Session], T]) -> T:
        return write(self._sessions, fn)

    def _read(self, fn: Callable[[Session], T]) -> T:
        return read(self._sessions, fn)
