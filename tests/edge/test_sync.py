"""Model sync over real gRPC on 127.0.0.1: install, refuse tampering (old model kept), resume a cut
download from its offset, roll back, TLS."""

from __future__ import annotations

import datetime as dt
import hashlib
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from sqlalchemy import update

from quorumfl.edge.delta import encode
from quorumfl.edge.export import ArtifactFormat
from quorumfl.edge.manifest import Channel
from quorumfl.edge.registry import Registry
from quorumfl.edge.service import SyncServer, SyncService, start_server
from quorumfl.edge.sync import installed, load_current, rollback, sync
from quorumfl.errors import ArtifactError, ConfigError
from quorumfl.server.state.artifacts import ArtifactRecords
from quorumfl.server.state.orm import EdgeArtifact

from .conftest import Published, publish

ONNX = ArtifactFormat.ONNX


@pytest.fixture
def server(published: Published) -> Iterator[SyncServer]:
    srv = start_server(ArtifactRecords(published.repo.sessions), chunk_bytes=1024)
    yield srv
    srv.stop()


def _sync(srv: SyncServer, published: Published, directory: Path, **kw: Any) -> Any:
    return sync(f"127.0.0.1:{srv.port}", directory, channel=Channel.STABLE, fmt=kw.pop("fmt", ONNX),
                public_key=published.public_key, **kw)


def _latest(published: Published, fmt: str = "onnx") -> EdgeArtifact:
    row = ArtifactRecords(published.repo.sessions).latest("stable", fmt)
    assert row is not None
    return row


def test_two_devices_install_and_run_the_artifact(server: SyncServer, published: Published, tmp_path: Path,
                                                  digits_eval: tuple[np.ndarray, np.ndarray]) -> None:
    row = _latest(published)
    wire = len(encode(Registry.payload(row), b""))  # the whole file as one zlib stream
    assert wire < row.size_bytes
    for device in ("a", "b"):
        result = _sync(server, published, tmp_path / device)
        assert (result.status, result.version, result.downloaded_bytes) == ("updated", row.version, wire)
        assert hashlib.sha256((tmp_path / device / f"v{row.version}.onnx").read_bytes()).hexdigest() == row.sha256
        assert _sync(server, published, tmp_path / device).status == "up-to-date"
    manifest, model = load_current(tmp_path / "a", public_key=published.public_key)
    x, y = digits_eval
    assert float(np.mean(model(x).argmax(1) == y)) == pytest.approx(manifest.edge_metric, abs=0.06)


def test_pte_artifact_installs_and_runs(server: SyncServer, published: Published, tmp_path: Path) -> None:
    result = _sync(server, published, tmp_path / "pte", fmt=ArtifactFormat.PTE)
    assert result.status == "updated"
    _, model = load_current(tmp_path / "pte")
    assert model(np.zeros((2, 1, 8, 8), np.float32)).shape == (2, 10)
    with pytest.raises(ConfigError, match="another --dir"):
        _sync(server, published, tmp_path / "pte")  # that folder holds a pte model


class Flipping(SyncService):
    """A man in the middle: flips one bit of one chunk (of the artifact or of its delta)."""

    chunk = 3

    def Download(self, request: Any, context: Any) -> Iterator[Any]:  # noqa: N802
        for i, chunk in enumerate(super().Download(request, context)):
            if i == self.chunk:
                data = bytearray(chunk.data)
                data[5] ^= 0x01
                chunk.data = bytes(data)
            yield chunk


class Cutting(SyncService):
    """Breaks the first download off after a few chunks, like a dropped link."""

    cut_after = 5

    def Download(self, request: Any, context: Any) -> Iterator[Any]:  # noqa: N802
        for i, chunk in enumerate(super().Download(request, context)):
            if i == self.cut_after and len(self.downloads) == 1:
                context.abort(grpc.StatusCode.UNAVAILABLE, "link dropped")
            yield chunk


def _install_old(published: Published, directory: Path) -> str:
    """Install the current artifact with a normal server; return its file's hash."""
    srv = start_server(ArtifactRecords(published.repo.sessions))
    try:
        _sync(srv, published, directory)
    finally:
        srv.stop()
    state = installed(directory)
    assert state.current is not None
    return state.current.manifest.sha256


def _held_and_newer(published: Published, device: Path) -> tuple[Any, list[EdgeArtifact]]:
    """Install the current artifact on ``device``, then publish a newer one: (what the device holds, the new rows)."""
    _install_old(published, device)
    held = installed(device).current
    assert held is not None
    return held, publish(published.repo, published.home, published.version_id)


def test_flipped_byte_in_transit_is_refused_and_not_kept(published: Published, tmp_path: Path) -> None:
    records = ArtifactRecords(published.repo.sessions)
    # the whole file as a zlib stream (servers that offer deltas), and as plain bytes (older servers)
    for service, refusal in ((Flipping(records, chunk_bytes=1024), "stream is damaged|does not rebuild|SHA-256"),
                             (OlderFlipping(records, chunk_bytes=1024), "SHA-256")):
        device = tmp_path / type(service).__name__
        srv = start_server(records, service=service)
        try:
            with pytest.raises(ArtifactError, match=refusal):
                _sync(srv, published, device)
        finally:
            srv.stop()
        assert installed(device).current is None  # nothing installed from a bad download
        assert not [p for p in (device / ".partial").iterdir() if not p.name.endswith(".delta-refused")]


def test_tampered_download_keeps_the_installed_model(published: Published, tmp_path: Path) -> None:
    device = tmp_path / "dev"
    before = _install_old(published, device)
    rows = publish(published.repo, published.home, published.version_id)  # a newer artifact appears
    records = ArtifactRecords(published.repo.sessions)
    for chunk in (0, 1):  # a delta of a few chunks: a flipped bit in its zlib stream, or in what it inflates to
        flipping = Flipping(records, chunk_bytes=256)
        flipping.chunk = chunk
        srv = start_server(records, service=flipping)
        try:
            with pytest.raises(ArtifactError, match="SHA-256|stream is damaged|does not rebuild"):
                _sync(srv, published, device)
        finally:
            srv.stop()
        assert list(flipping.deltas) == [0 if chunk else installed(device).current.manifest.version]  # type: ignore[union-attr]
        state = installed(device)
        assert state.current is not None and state.current.manifest.sha256 == before
        assert state.current.manifest.version < rows[0].version
        load_current(device, public_key=published.public_key)  # still verifies and loads


def test_a_newer_version_travels_as_a_delta_and_a_refused_delta_is_fetched_whole(published: Published,
                                                                                  tmp_path: Path) -> None:
    device = tmp_path / "dev"
    _install_old(published, device)
    held = installed(device).current
    assert held is not None
    rows = publish(published.repo, published.home, published.version_id)  # retrained by QAT: other weights
    records = ArtifactRecords(published.repo.sessions)
    # A delta: only its bytes travel, and the rebuilt file is the artifact itself
    clean = SyncService(records, chunk_bytes=256)
    srv = start_server(records, service=clean)
    try:
        result = _sync(srv, published, device)
    finally:
        srv.stop()
    assert (result.status, result.version, result.delta_from) == ("updated", rows[0].version, held.manifest.version)
    assert 0 < result.downloaded_bytes < rows[0].size_bytes
    assert list(clean.deltas) == [held.manifest.version]
    assert hashlib.sha256((device / f"v{rows[0].version}.onnx").read_bytes()).hexdigest() == rows[0].sha256
    assert not list((device / ".partial").iterdir())

    # A tampered delta is refused (the installed model kept); the next sync fetches the version whole
    newer = publish(published.repo, published.home, published.version_id)
    flipping = Flipping(records, chunk_bytes=256)
    flipping.chunk = 0
    srv = start_server(records, service=flipping)
    try:
        with pytest.raises(ArtifactError):
            _sync(srv, published, device)
    finally:
        srv.stop()
    assert installed(device).current.manifest.version == rows[0].version  # type: ignore[union-attr]
    srv = start_server(records, service=(whole := SyncService(records, chunk_bytes=4096)))
    try:
        result = _sync(srv, published, device)
    finally:
        srv.stop()
    assert (result.version, result.delta_from, result.downloaded_bytes) == (
        newer[0].version, None, len(encode(Registry.payload(newer[0]), b"")))
    assert list(whole.deltas) == [0]


class Baseless(SyncService):
    """A server that no longer has the version the device holds (or cannot read it)."""

    def Download(self, request: Any, context: Any) -> Iterator[Any]:  # noqa: N802
        if request.base_version:
            context.abort(grpc.StatusCode.NOT_FOUND, f"edge artifact v{request.base_version} does not exist")
        yield from super().Download(request, context)


class Older(SyncService):
    """A server from before deltas: its manifest reply does not offer them."""

    def GetManifest(self, request: Any, context: Any) -> Any:  # noqa: N802
        reply = super().GetManifest(request, context)
        reply.deltas = False
        return reply


class OlderFlipping(Older, Flipping):
    """An older server's plain download, one bit flipped on the way."""


def test_without_a_delta_the_whole_artifact_is_downloaded(published: Published, tmp_path: Path) -> None:
    records = ArtifactRecords(published.repo.sessions)
    for service in (Baseless(records), Older(records)):
        device = tmp_path / type(service).__name__
        _install_old(published, device)
        rows = publish(published.repo, published.home, published.version_id)
        srv = start_server(records, service=service)
        try:
            result = _sync(srv, published, device)
        finally:
            srv.stop()
        whole = len(encode(Registry.payload(rows[0]), b"")) if isinstance(service, Baseless) else rows[0].size_bytes
        assert (result.status, result.delta_from, result.downloaded_bytes) == ("updated", None, whole)
        assert hashlib.sha256((device / f"v{rows[0].version}.onnx").read_bytes()).hexdigest() == rows[0].sha256


def test_flipped_signature_byte_is_refused_and_old_model_kept(published: Published, tmp_path: Path) -> None:
    device = tmp_path / "dev"
    before = _install_old(published, device)
    rows = publish(published.repo, published.home, published.version_id)
    onnx_row = next(r for r in rows if r.format == "onnx")
    signature = bytearray(bytes.fromhex(onnx_row.signature))
    signature[10] ^= 0x01
    with published.repo.sessions.begin() as s:
        s.execute(update(EdgeArtifact).where(EdgeArtifact.id == onnx_row.id).values(signature=signature.hex()))
    srv = start_server(ArtifactRecords(published.repo.sessions))
    try:
        with pytest.raises(ArtifactError, match="signature"):
            _sync(srv, published, device)
    finally:
        srv.stop()
        with published.repo.sessions.begin() as s:
            s.execute(update(EdgeArtifact).where(EdgeArtifact.id == onnx_row.id).values(signature=onnx_row.signature))
    state = installed(device)
    assert state.current is not None and state.current.manifest.sha256 == before


def test_damaged_file_on_the_server_is_not_served(published: Published, tmp_path: Path) -> None:
    device = tmp_path / "dev"
    before = _install_old(published, device)
    rows = publish(published.repo, published.home, published.version_id)
    onnx_row = next(r for r in rows if r.format == "onnx")
    path = Path(onnx_row.path)
    backup = tmp_path / "backup"
    shutil.copy(path, backup)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    srv = start_server(ArtifactRecords(published.repo.sessions))
    try:
        with pytest.raises(ArtifactError, match="DATA_LOSS"):
            _sync(srv, published, device)
    finally:
        srv.stop()
        shutil.copy(backup, path)
    assert installed(device).current is not None and installed(device).current.manifest.sha256 == before  # type: ignore[union-attr]


def test_cut_download_resumes_from_its_offset(published: Published, tmp_path: Path) -> None:
    # Prepare: a server that drops the link after 5 chunks of 1 KiB
    device = tmp_path / "dev"
    row = _latest(published)
    records = ArtifactRecords(published.repo.sessions)
    cutting = Cutting(records, chunk_bytes=1024)
    srv = start_server(records, service=cutting)
    try:
        # Execute: the first sync breaks off; the second resumes
        with pytest.raises(ArtifactError, match="broke off at byte"):
            _sync(srv, published, device)
        partial = device / ".partial" / f"v{row.version}.onnx.z.part"  # the file as one zlib stream
        cut_at = partial.stat().st_size
        assert installed(device).current is None
        result = _sync(srv, published, device)
    finally:
        srv.stop()
    # Assert: the second request started at the bytes already on disk, and only the rest travelled
    wire = len(encode(Registry.payload(row), b""))
    assert 0 < cut_at < wire
    assert list(cutting.downloads) == [(row.version, "onnx", 0), (row.version, "onnx", cut_at)]
    assert (result.status, result.resumed_from, result.downloaded_bytes) == ("updated", cut_at, wire - cut_at)
    assert hashlib.sha256((device / f"v{row.version}.onnx").read_bytes()).hexdigest() == row.sha256
    assert not (device / ".partial" / f"v{row.version}.onnx.part").exists()


def test_update_keeps_previous_for_rollback(published: Published, tmp_path: Path) -> None:
    device = tmp_path / "dev"
    first = _install_old(published, device)
    publish(published.repo, published.home, published.version_id)
    srv = start_server(ArtifactRecords(published.repo.sessions))
    try:
        result = _sync(srv, published, device)
    finally:
        srv.stop()
    assert result.status == "updated" and result.previous is not None
    state = installed(device)
    assert state.previous is not None and state.previous.manifest.sha256 == first
    assert sorted(p.name for p in device.glob("v*.onnx")) == sorted(
        [state.current.manifest.file_name, state.previous.manifest.file_name])  # type: ignore[union-attr]
    back = rollback(device)
    assert back.current is not None and back.current.manifest.sha256 == first
    load_current(device, public_key=published.public_key)


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "quorumfl-edge-test")])
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=1))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def test_tls(published: Published, tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    srv = start_server(ArtifactRecords(published.repo.sessions), tls_cert=cert, tls_key=key)
    try:
        assert _sync(srv, published, tmp_path / "tls", ca_cert=cert, timeout=10).status == "updated"
        with pytest.raises(ArtifactError, match="manifest request"):
            _sync(srv, published, tmp_path / "plain", timeout=3)  # a plaintext client cannot talk to it
    finally:
        srv.stop()


def test_committed_stubs_match_the_proto(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    root = Path(__file__).resolve().parents[2] / "edge"
    out = tmp_path / "gen"
    out.mkdir()
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", str(root / "proto"), f"--python_out={out}",
                    f"--pyi_out={out}", f"--grpc_python_out={out}", "quorumfl/edge/sync.proto"], check=True)
    for name in ("sync_pb2.py", "sync_pb2.pyi", "sync_pb2_grpc.py"):
        assert (out / "quorumfl" / "edge" / name).read_text() == (root / name).read_text(), \
            f"{name} is stale: run edge/proto/generate.sh"


def test_a_cut_delta_download_resumes_from_its_offset(published: Published, tmp_path: Path) -> None:
    device = tmp_path / "dev"
    held, rows = _held_and_newer(published, device)
    records = ArtifactRecords(published.repo.sessions)
    cutting = Cutting(records, chunk_bytes=8)  # the same model promoted again: a delta of tens of bytes
    srv = start_server(records, service=cutting)
    try:
        with pytest.raises(ArtifactError, match="broke off at byte 40 of its delta"):
            _sync(srv, published, device)
        assert (device / ".partial" / f"v{rows[0].version}.onnx.from-v{held.manifest.version}.part").stat().st_size == 40
        result = _sync(srv, published, device)
    finally:
        srv.stop()
    assert list(cutting.downloads) == [(rows[0].version, "onnx", 0), (rows[0].version, "onnx", 40)]
    assert list(cutting.deltas) == [held.manifest.version, held.manifest.version]
    assert (result.status, result.resumed_from, result.delta_from) == ("updated", 40, held.manifest.version)
    assert hashlib.sha256((device / f"v{rows[0].version}.onnx").read_bytes()).hexdigest() == rows[0].sha256


class EndsBroken(SyncService):
    """Streams the whole of the first download, then breaks the link before the stream's end."""

    def Download(self, request: Any, context: Any) -> Iterator[Any]:  # noqa: N802
        yield from super().Download(request, context)
        if len(self.downloads) == 1:
            context.abort(grpc.StatusCode.UNAVAILABLE, "link dropped at the end")


def test_a_delta_complete_on_disk_is_rebuilt_by_the_next_sync(published: Published, tmp_path: Path) -> None:
    device = tmp_path / "dev"
    held, rows = _held_and_newer(published, device)
    records = ArtifactRecords(published.repo.sessions)
    service = EndsBroken(records, chunk_bytes=16)
    srv = start_server(records, service=service)
    try:
        with pytest.raises(ArtifactError, match="broke off at byte"):
            _sync(srv, published, device)
        on_disk = (device / ".partial" / f"v{rows[0].version}.onnx.from-v{held.manifest.version}.part").stat().st_size
        result = _sync(srv, published, device)  # the server answers OUT_OF_RANGE: nothing is left to fetch
    finally:
        srv.stop()
    assert on_disk > 0 and list(service.downloads) == [(rows[0].version, "onnx", 0)]  # the second was refused
    assert (result.status, result.downloaded_bytes, result.delta_from) == ("updated", 0, held.manifest.version)
    assert hashlib.sha256((device / f"v{rows[0].version}.onnx").read_bytes()).hexdigest() == rows[0].sha256


def test_sparsity_is_refused_for_a_precision_without_qat(published: Published) -> None:
    from quorumfl.edge.export import Precision
    from quorumfl.edge.promotion import promote_to_edge
    from quorumfl.edge.qat import QatSettings

    before = len(ArtifactRecords(published.repo.sessions).list())
    with pytest.raises(ConfigError, match="--sparsity prunes before quantisation-aware training"):
        promote_to_edge(published.repo, published.version_id, home=published.home, channel=Channel.STABLE,
                        settings=QatSettings(sparsity=0.5), precision=Precision.DYNAMIC)
    assert len(ArtifactRecords(published.repo.sessions).list()) == before  # nothing published


def test_a_pruned_artifact_is_published_with_its_sparsity_and_installs(published: Published, tmp_path: Path) -> None:
    import json

    from quorumfl.edge.promotion import promote_to_edge
    from quorumfl.edge.qat import QatSettings

    rows, _, _ = promote_to_edge(published.repo, published.version_id, home=published.home, channel=Channel.STABLE,
                                 settings=QatSettings(epochs=1, sparsity=0.5), formats=(ONNX,))
    body = json.loads(rows[0].manifest)
    assert (body["schema"], body["sparsity"]) == (3, 0.5)
    srv = start_server(ArtifactRecords(published.repo.sessions))
    try:
        result = _sync(srv, published, tmp_path / "dev")
    finally:
        srv.stop()
    assert (result.status, result.version) == ("updated", rows[0].version)
    manifest, _ = load_current(tmp_path / "dev", public_key=published.public_key)
    assert manifest.sparsity == 0.5


def test_each_stream_is_encoded_once_for_a_fleet_and_a_damaged_file_is_still_refused(published: Published,
                                                                                     tmp_path: Path) -> None:
    """Three devices holding v1 sync to v2 through one service: its delta is encoded once (the next
    two are served from the cache, byte for byte what encoding again gives), and a fourth device's
    whole download once. Then the server's v2 file is damaged: the cached stream is not served, the
    request is refused with DATA_LOSS and the device keeps its model."""
    devices = [tmp_path / f"dev{i}" for i in range(3)]
    late = tmp_path / "late"  # holds v1 too; syncs once the server's v2 file is damaged
    for device in [*devices, late]:
        _install_old(published, device)
    held = installed(devices[0]).current
    assert held is not None
    base = (devices[0] / f"v{held.manifest.version}.onnx").read_bytes()
    rows = publish(published.repo, published.home, published.version_id)
    row = next(r for r in rows if r.format == "onnx")
    records = ArtifactRecords(published.repo.sessions)
    service = SyncService(records, chunk_bytes=1024)
    srv = start_server(records, service=service)
    try:
        results = [_sync(srv, published, device) for device in devices]
        assert service.encoded == 1
        expected = encode(Registry.payload(row), base)
        assert [(r.delta_from, r.downloaded_bytes) for r in results] == [(held.manifest.version, len(expected))] * 3
        for device in devices:
            assert hashlib.sha256((device / f"v{row.version}.onnx").read_bytes()).hexdigest() == row.sha256
        fresh = _sync(srv, published, tmp_path / "fresh")  # holds nothing: the whole file, one more stream
        assert (fresh.delta_from, service.encoded) == (None, 2)

        path = Path(row.path)
        original = path.read_bytes()
        damaged = bytearray(original)
        damaged[len(damaged) // 3] ^= 0x01
        path.write_bytes(bytes(damaged))
        try:
            with pytest.raises(ArtifactError, match="DATA_LOSS"):
                _sync(srv, published, late)
        finally:
            path.write_bytes(original)
        assert installed(late).current.manifest.version == held.manifest.version  # type: ignore[union-attr]
    finally:
        srv.stop()
