"""State records, one aggregate: Model versions: their lineage (parent, architecture), the head of each architecture, rollback and tags.

Part of ``Repository`` (``repository.py``); every method is one transaction (``access.write``/``read``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from sqlalchemy import select
from sqlalchemy.orm import Session

from quorumfl.errors import NotFoundError
from quorumfl.server.state.access import (
    StateAccess,
    utcnow,
)
from quorumfl.server.state.orm import (
    ModelHead,
    ModelVersion,
)

__all__ = ["ModelRecords"]


class ModelRecords(StateAccess):
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

        return self._write(op)

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
        return version

    def list_model_versions(self, *, run_id: int | None = None) -> list[ModelVersion]:
        def op(s: Session) -> list[ModelVersion]:
            q = select(ModelVersion)
            if run_id is not None:
                q = q.where(ModelVersion.run_id == run_id)
            return list(s.scalars(q.order_by(ModelVersion.id)))

        return self._read(op)

    def heads(self) -> dict[str, int]:
        return self._read(
            lambda s: {h.architecture: h.version_id for h in s.scalars(select(ModelHead))}
        )

    def head_version(self, architecture: str) -> ModelVersion | None:
        def op(s: Session) -> ModelVersion | None:
            head = s.get(ModelHead, architecture)
            return None if head is None else s.get(ModelVersion, head.version_id)

        return self._read(op)

    def rollback(self, version_id: int) -> ModelVersion:
        """Make ``version_id`` the head of its architecture: the next round starts from it."""
        version = self.get_model_version(version_id)
        self._write(lambda s: self._set_head(s, version.architecture, version.id))
        return version

    def restore_heads(self, heads: Mapping[str, int]) -> None:
        """Make the heads what ``heads`` (an earlier ``heads()``) says, in one transaction: each
        architecture's head back to its version then, and no head for one that had none."""

        def op(s: Session) -> None:
            for head in list(s.scalars(select(ModelHead))):
                if head.architecture not in heads:
                    s.delete(head)
            for architecture, version_id in heads.items():
                self._set_head(s, architecture, version_id)

        self._write(op)

    def add_tag(self, version_id: int, tag: str) -> None:
        """Add ``tag`` to a model version's tags (idempotent)."""

        def op(s: Session) -> None:
            version = s.get(ModelVersion, version_id)
            if version is None:
                raise NotFoundError(f"model version {version_id} does not exist")
            if tag not in version.tags:
                version.tags = [*version.tags, tag]

        self._write(op)
