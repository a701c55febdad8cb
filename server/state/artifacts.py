"""Rows of the edge artifact registry: add a promotion's artifacts, list them, find the latest per
channel and format. One transaction per call, like the main repository."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from quorumfl.errors import NotFoundError
from quorumfl.server.state.orm import EdgeArtifact
from quorumfl.server.state.repository import read, utcnow, write

__all__ = ["ArtifactRecords", "NewArtifact"]


@dataclass(frozen=True)
class NewArtifact:
    format: str
    size_bytes: int
    sha256: str
    signature: str
    manifest: str
    path: str


class ArtifactRecords:
    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self._sessions = sessions

    def next_version(self) -> int:
        latest = read(self._sessions, lambda s: s.scalar(select(func.max(EdgeArtifact.version))))
        return int(latest or 0) + 1

    def add(self, *, version: int, channel: str, model_version_id: int, items: Sequence[NewArtifact]) -> list[EdgeArtifact]:
        """Store every format of one promotion together (all or none)."""

        def op(s: Session) -> list[EdgeArtifact]:
            now = utcnow()
            rows = [
                EdgeArtifact(version=version, channel=channel, format=item.format, size_bytes=item.size_bytes,
                             sha256=item.sha256, signature=item.signature, manifest=item.manifest,
                             model_version_id=model_version_id, path=item.path, created_at=now)
                for item in items
            ]
            s.add_all(rows)
            s.flush()
            return rows

        return write(self._sessions, op)

    def resign(self, sign: Callable[[bytes], str]) -> int:
        """Replace every artifact's signature with ``sign(manifest bytes)`` (hex), all in one
        transaction: what a rotation of the signing key does. Returns how many rows changed."""

        def op(s: Session) -> int:
            changed = 0
            for row in s.scalars(select(EdgeArtifact)):
                signature = sign(row.manifest.encode())
                if signature != row.signature:
                    row.signature = signature
                    changed += 1
            return changed

        return write(self._sessions, op)

    def list(self, *, channel: str | None = None) -> list[EdgeArtifact]:
        def op(s: Session) -> list[EdgeArtifact]:
            q = select(EdgeArtifact)
            if channel is not None:
                q = q.where(EdgeArtifact.channel == channel)
            return list(s.scalars(q.order_by(EdgeArtifact.version, EdgeArtifact.format)))

        return read(self._sessions, op)

    def latest(self, channel: str, fmt: str) -> EdgeArtifact | None:
        def op(s: Session) -> EdgeArtifact | None:
            q = (select(EdgeArtifact).where(EdgeArtifact.channel == channel, EdgeArtifact.format == fmt)
                 .order_by(EdgeArtifact.version.desc()).limit(1))
            return s.scalars(q).first()

        return read(self._sessions, op)

    def get(self, version: int, fmt: str) -> EdgeArtifact:
        def op(s: Session) -> EdgeArtifact | None:
            q = select(EdgeArtifact).where(EdgeArtifact.version == version, EdgeArtifact.format == fmt)
            return s.scalars(q).first()

        row = read(self._sessions, op)
        if row is None:
            raise NotFoundError(f"edge artifact v{version} ({fmt}) does not exist; 'quorumfl edge artifacts list' shows them")
        return row
