"""The edge sync service as a black box in an attacker's hands: what it offers a device over real gRPC.

A device holds v2. The server (compromised, stale, or someone in between without TLS) then offers:
its older, validly signed v1 (a replayed old artifact: a downgrade), a manifest with one field
changed under the original signature, another format's validly signed manifest, and the right
manifest with a download that carries bytes beyond the signed size or stops short of it. Each is
refused or ignored, and the device keeps v2, which still verifies and loads.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from quorumfl.edge import sync_pb2
from quorumfl.edge.export import ArtifactFormat
from quorumfl.edge.manifest import Channel
from quorumfl.edge.service import SyncService, start_server
from quorumfl.edge.sync import installed, load_current, sync
from quorumfl.errors import ArtifactError
from quorumfl.server.state.artifacts import ArtifactRecords
from quorumfl.server.state.orm import EdgeArtifact

from .conftest import Published, publish

ONNX = ArtifactFormat.ONNX


class Offering(SyncService):
    """Answers GetManifest with ``row`` (a real, signed row of the registry) and ``edit`` applied to
    its manifest bytes; downloads as the honest service does, then ``tail`` appended or ``cut`` bytes
    dropped from the end."""

    row: EdgeArtifact | None = None
    edit: Any = None
    tail = b""
    cut = 0

    def GetManifest(self, request: Any, context: Any) -> Any:  # noqa: N802
        reply = super().GetManifest(request, context)
        if self.row is not None:
            manifest = self.row.manifest.encode()
            reply = sync_pb2.ManifestReply(available=True, newer=True, signature=bytes.fromhex(self.row.signature),
                                           manifest=self.edit(manifest) if self.edit else manifest,
                                           key_chain=list(reply.key_chain), deltas=False)
        return reply

    def Download(self, request: Any, context: Any) -> Iterator[Any]:  # noqa: N802
        chunks = list(super().Download(request, context))
        if self.cut and chunks:
            chunks[-1] = sync_pb2.Chunk(offset=chunks[-1].offset, data=chunks[-1].data[: -self.cut])
        if self.tail and chunks:
            end = chunks[-1].offset + len(chunks[-1].data)
            chunks.append(sync_pb2.Chunk(offset=end, data=self.tail))
        yield from chunks


@pytest.fixture
def holding_v2(published: Published, tmp_path: Path) -> tuple[Path, ArtifactRecords, EdgeArtifact, EdgeArtifact]:
    """A device that installed v1 and then v2 from an honest server: (its folder, records, v1, v2)."""
    records = ArtifactRecords(published.repo.sessions)
    device = tmp_path / "device"
    first = records.latest("stable", "onnx")
    assert first is not None
    for _ in range(2):
        honest = start_server(records)
        try:
            sync(f"127.0.0.1:{honest.port}", device, channel=Channel.STABLE, fmt=ONNX, public_key=published.public_key)
        finally:
            honest.stop()
        if _ == 0:
            publish(published.repo, published.home, published.version_id)
    second = records.latest("stable", "onnx")
    assert second is not None and second.version > first.version
    state = installed(device)
    assert state.current is not None and state.current.manifest.version == second.version
    return device, records, first, second


def _offer(published: Published, records: ArtifactRecords, device: Path, **lie: Any) -> Any:
    service = Offering(records, chunk_bytes=1024)
    for name, value in lie.items():
        setattr(service, name, value)
    server = start_server(records, service=service)
    try:
        return sync(f"127.0.0.1:{server.port}", device, channel=Channel.STABLE, fmt=ONNX,
                    public_key=published.public_key, timeout=30)
    finally:
        server.stop()


def _keeps(device: Path, published: Published, version: int) -> None:
    state = installed(device)
    assert state.current is not None and state.current.manifest.version == version
    load_current(device, public_key=published.public_key)  # still verifies and loads


def test_a_replayed_older_signed_artifact_is_not_installed(
        published: Published, holding_v2: tuple[Path, ArtifactRecords, EdgeArtifact, EdgeArtifact]) -> None:
    device, records, first, second = holding_v2
    result = _offer(published, records, device, row=first)
    assert result.status == "up-to-date"
    _keeps(device, published, second.version)


def test_a_manifest_edited_under_its_signature_or_of_another_format_is_refused(
        published: Published, holding_v2: tuple[Path, ArtifactRecords, EdgeArtifact, EdgeArtifact]) -> None:
    device, records, first, second = holding_v2
    bumped = second.manifest.replace(f'"version":{second.version}', f'"version":{second.version + 7}')
    assert bumped != second.manifest, "the manifest's version field was found"
    with pytest.raises(ArtifactError, match="signature"):
        _offer(published, records, device, row=second, edit=lambda _raw: bumped.encode())
    other = records.latest("stable", "pte")
    if other is not None:  # another format's validly signed manifest for a device that syncs ONNX
        with pytest.raises(ArtifactError, match="for stable/onnx"):
            _offer(published, records, device, row=other)
    _keeps(device, published, second.version)


def test_a_download_longer_or_shorter_than_the_signed_size_is_refused(
        published: Published, holding_v2: tuple[Path, ArtifactRecords, EdgeArtifact, EdgeArtifact]) -> None:
    device, records, _first, second = holding_v2
    publish(published.repo, published.home, published.version_id)  # v3 on offer
    third = records.latest("stable", "onnx")
    assert third is not None
    with pytest.raises(ArtifactError):
        _offer(published, records, device, tail=b"\0" * 4096)
    with pytest.raises(ArtifactError):
        _offer(published, records, device, cut=17)
    _keeps(device, published, second.version)
