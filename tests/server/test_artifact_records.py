"""The edge artifact rows on SQLite and PostgreSQL: versions, latest per channel and format, all-or-none adds."""

from __future__ import annotations

import pytest

from quorumfl.errors import NotFoundError, StateError
from quorumfl.server.state.artifacts import ArtifactRecords, NewArtifact
from quorumfl.server.state.database import connect
from quorumfl.server.state.repository import Repository


def _item(fmt: str, tag: str) -> NewArtifact:
    return NewArtifact(format=fmt, size_bytes=10, sha256=tag * 64, signature="ab" * 64, manifest="{}", path=f"/x/{tag}.{fmt}")


def test_artifact_records(db_url: str) -> None:
    repo = Repository(connect(db_url, migrate=True))
    version = repo.add_model_version(run_id=None, round_number=1, parent_id=None, architecture="mlp:1x8x8:10",
                                     path="/m.npz", sha256="0" * 64, size_bytes=1, metrics={})
    records = ArtifactRecords(repo.sessions)
    assert records.next_version() == 1 and records.latest("stable", "onnx") is None
    for number, channel in [(1, "stable"), (2, "canary"), (3, "stable"), (10, "stable")]:
        records.add(version=number, channel=channel, model_version_id=version.id,
                    items=[_item("onnx", "a"), _item("pte", "b")])
    assert records.next_version() == 11
    latest = records.latest("stable", "onnx")
    assert latest is not None and latest.version == 10  # numeric order: 10 after 3
    canary = records.latest("canary", "pte")
    assert canary is not None and canary.version == 2
    assert [(r.version, r.format) for r in records.list(channel="stable")][:2] == [(1, "onnx"), (1, "pte")]
    assert records.get(3, "pte").channel == "stable"
    with pytest.raises(NotFoundError, match="artifacts list"):
        records.get(4, "onnx")
    # a promotion that collides with an existing (version, format) stores nothing
    with pytest.raises(StateError):
        records.add(version=11, channel="stable", model_version_id=version.id,
                    items=[_item("onnx", "c"), _item("onnx", "d")])
    assert records.next_version() == 11
