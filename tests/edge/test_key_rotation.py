"""Rotation of the edge signing key over real gRPC on 127.0.0.1: devices given the old key move to
the new one through the served chain; a forged chain, a retired (stolen) key and a chain of another
federation are refused with the installed model kept; an interrupted rotation is finished."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from quorumfl.edge import sync_pb2
from quorumfl.edge.export import ArtifactFormat
from quorumfl.edge.keychain import Endorsement, endorse, raw_public_key
from quorumfl.edge.manifest import Channel
from quorumfl.edge.promotion import default_key_path
from quorumfl.edge.rotation import chain_path, load_chain, rotate_signing_key
from quorumfl.edge.service import SyncServer, SyncService, start_server
from quorumfl.edge.signing import load_private_key, load_public_key, public_key_path
from quorumfl.edge.sync import TRUST, accepted_keys, installed, load_current, sync
from quorumfl.errors import ArtifactError, ConfigError
from quorumfl.server.state.artifacts import ArtifactRecords
from quorumfl.server.state.database import connect
from quorumfl.server.state.repository import Repository

from .conftest import Published, publish, store_version, train_digits_mlp

WHEN = "2026-12-04T10:00:00+00:00"


@pytest.fixture(scope="module")
def trained() -> Any:
    """One digits model for the module (each test publishes it into a registry of its own)."""
    return train_digits_mlp(epochs=3)[0]


@pytest.fixture
def home(tmp_path: Path, trained: Any) -> Iterator[Published]:
    """A fresh registry with one published ONNX artifact, signed by key 0 (this module rotates it)."""
    root = tmp_path / "server"
    repo = Repository(connect(f"sqlite:///{root / 'state.db'}", migrate=True))
    version_id = store_version(repo, root, trained)
    rows = publish(repo, root, version_id)
    yield Published(root, repo, version_id, rows)


def _serve(published: Published, service: SyncService | None = None) -> SyncServer:
    key = default_key_path(published.home)
    return start_server(ArtifactRecords(published.repo.sessions), service=service, key_chain=lambda: load_chain(key))


def _sync(srv: SyncServer, device: Path, public_key: Path) -> Any:
    return sync(f"127.0.0.1:{srv.port}", device, channel=Channel.STABLE, fmt=ArtifactFormat.ONNX, public_key=public_key,
                timeout=10)


def _copy_public(published: Published, to: Path) -> Path:
    """What a device is given at provisioning: the public key file as it is now."""
    to.write_bytes(published.public_key.read_bytes())
    return to


def _rotate(published: Published) -> Any:
    return rotate_signing_key(default_key_path(published.home), ArtifactRecords(published.repo.sessions),
                              created_at=WHEN)


def _installed_sha(device: Path) -> str:
    state = installed(device)
    assert state.current is not None
    return state.current.manifest.sha256


@pytest.mark.slow  # promotions and device syncs (~15-20 s): the default suite stays under its 8 minutes
def test_devices_follow_two_rotations_and_new_devices_start_at_the_newest_key(home: Published, tmp_path: Path) -> None:
    key0 = _copy_public(home, tmp_path / "key0.pub.pem")
    old, fresh = tmp_path / "old-device", tmp_path / "new-device"
    srv = _serve(home)
    try:
        assert _sync(srv, old, key0).status == "updated"
        assert not (old / TRUST).exists()  # nothing rotated yet: nothing recorded
        first, second = _rotate(home), _rotate(home)
        assert (first.sequence, second.sequence, first.resigned, second.resigned) == (1, 2, 1, 1)
        assert not first.finished_interrupted and not second.finished_interrupted
        rows = publish(home.repo, home.home, home.version_id)  # v2, signed by key 2
        result = _sync(srv, old, key0)
        assert (result.status, result.version) == ("updated", rows[0].version)
        assert [e.sequence for e in accepted_keys(old, raw_public_key(load_public_key(key0)))] == [1, 2]
        key2 = _copy_public(home, tmp_path / "key2.pub.pem")
        assert _sync(srv, fresh, key2).status == "updated"  # provisioned after the rotations
        assert _installed_sha(fresh) == _installed_sha(old) == rows[0].sha256
    finally:
        srv.stop()
    load_current(old, public_key=key0)  # the installed manifest is signed by a key key 0 endorsed
    state = installed(old)
    assert state.previous is not None  # v1 (signed by key 0 when installed) stays available for rollback
    # the server keeps no private key but the newest, and its public file is the newest's
    assert raw_public_key(load_private_key(default_key_path(home.home)).public_key()) == load_chain(
        default_key_path(home.home))[-1].public_key
    assert not default_key_path(home.home).with_name("signing-key.next.pem").exists()


class Replaying(SyncService):
    """A server that answers with a manifest and chain of its choosing."""

    reply: Any = None

    def GetManifest(self, request: Any, context: Any) -> Any:  # noqa: N802
        return self.reply


def _forged_reply(published: Published, signer: Ed25519PrivateKey, chain: list[Any], *, version_bump: int = 1) -> Any:
    """A manifest for a newer version with the latest row's payload, signed by ``signer``."""
    row = ArtifactRecords(published.repo.sessions).latest("stable", "onnx")
    assert row is not None
    body = json.loads(row.manifest)
    body["version"] = row.version + version_bump
    raw = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    return sync_pb2.ManifestReply(available=True, newer=True, manifest=raw, signature=signer.sign(raw),
                                  key_chain=[sync_pb2.KeyEndorsement(statement=e.statement, signature=e.signature)
                                             for e in chain])


def test_a_forged_chain_and_a_retired_key_are_refused_and_the_model_kept(home: Published, tmp_path: Path) -> None:
    key0 = _copy_public(home, tmp_path / "key0.pub.pem")
    device = tmp_path / "device"
    stolen = load_private_key(default_key_path(home.home))  # key 0, copied by an attacker before the rotation
    srv = _serve(home)
    try:
        _sync(srv, device, key0)
        _rotate(home)
        publish(home.repo, home.home, home.version_id)
        assert _sync(srv, device, key0).status == "updated"  # the device moves to key 1
    finally:
        srv.stop()
    kept = _installed_sha(device)
    trust = (device / TRUST).read_bytes()

    attacker = Ed25519PrivateKey.generate()
    real = load_chain(default_key_path(home.home))
    claim = json.loads(endorse(attacker, attacker.public_key(), sequence=2, created_at=WHEN).statement)
    claim["previous"] = real[-1].public_key.hex()  # names the device's key 1, signed by the attacker's
    statement = json.dumps(claim, sort_keys=True, separators=(",", ":")).encode()
    cases = {
        # the attacker's key presented as key 2, endorsed "by key 1" with the attacker's signature
        "not signed by key 1": _forged_reply(home, attacker, [*real, Endorsement.parse(statement,
                                                                                       attacker.sign(statement))]),
        # the attacker's own key, endorsed by itself
        "does not contain": _forged_reply(home, attacker, [endorse(attacker, attacker.public_key(), sequence=1,
                                                                   created_at=WHEN)]),
        # key 0, stolen, signs a manifest for a device that has moved to key 1 (with or without the real chain)
        "retired": _forged_reply(home, stolen, load_chain(default_key_path(home.home))),
        "retired ": _forged_reply(home, stolen, []),
        # key 0, stolen, endorses the attacker's key as a second key 1: the chain forks at 1
        "does not contain ": _forged_reply(home, attacker, [endorse(stolen, attacker.public_key(), sequence=1,
                                                                   created_at=WHEN)]),
    }
    for match, reply in cases.items():
        service = Replaying(ArtifactRecords(home.repo.sessions))
        service.reply = reply
        srv = _serve(home, service)
        try:
            with pytest.raises(ArtifactError, match=match.strip()):
                _sync(srv, device, key0)
        finally:
            srv.stop()
        assert _installed_sha(device) == kept and (device / TRUST).read_bytes() == trust


def test_a_device_folder_of_another_key_and_an_edited_record_are_refused(home: Published, tmp_path: Path) -> None:
    key0 = _copy_public(home, tmp_path / "key0.pub.pem")
    device = tmp_path / "device"
    srv = _serve(home)
    try:
        _sync(srv, device, key0)
        _rotate(home)
        _sync(srv, device, key0)
        other = Ed25519PrivateKey.generate().public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        (tmp_path / "other.pub.pem").write_bytes(other)
        with pytest.raises(ConfigError, match="another --public-key"):
            _sync(srv, device, tmp_path / "other.pub.pem")
        body = json.loads((device / TRUST).read_text())
        attacker = Ed25519PrivateKey.generate()
        forged = endorse(attacker, attacker.public_key(), sequence=1, created_at=WHEN)
        body["endorsements"] = [{"statement": forged.statement.decode(), "signature": forged.signature.hex()}]
        (device / TRUST).write_text(json.dumps(body))
        with pytest.raises(ArtifactError, match="does not continue"):
            _sync(srv, device, key0)
    finally:
        srv.stop()


def test_an_interrupted_rotation_is_finished_by_the_next_call(home: Published, tmp_path: Path) -> None:
    key = default_key_path(home.home)
    records = ArtifactRecords(home.repo.sessions)
    # Interrupted after the chain named the new key, before the key file was replaced.
    old = load_private_key(key)
    new = Ed25519PrivateKey.generate()
    pending = key.with_name("signing-key.next.pem")
    pending.write_bytes(new.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    entry = endorse(old, new.public_key(), sequence=1, created_at=WHEN)
    chain_path(key).write_text(json.dumps({"endorsements": [{"statement": entry.statement.decode(),
                                                             "signature": entry.signature.hex()}]}))
    done = rotate_signing_key(key, records, created_at=WHEN)
    assert done.finished_interrupted and done.sequence == 1 and done.resigned == len(records.list())
    assert raw_public_key(load_private_key(key).public_key()) == raw_public_key(new.public_key())
    assert load_public_key(public_key_path(key)).public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw) == raw_public_key(new.public_key())
    assert not pending.exists()
    for row in records.list():
        new.public_key().verify(bytes.fromhex(row.signature), row.manifest.encode())
    # Interrupted before the chain named it: that key is discarded, the next call rotates afresh.
    pending.write_bytes(b"half a key")
    again = rotate_signing_key(key, records, created_at=WHEN)
    assert not again.finished_interrupted and again.sequence == 2 and not pending.exists()
    assert os.stat(key).st_mode & 0o777 == 0o600


@pytest.mark.slow  # promotions and device syncs (~15-20 s): the default suite stays under its 8 minutes
def test_rotate_from_the_cli(home: Published, tmp_path: Path) -> None:
    cli = [str(Path(sys.executable).with_name("quorumfl")), "--home", str(home.home), "--db",
           f"sqlite:///{home.home / 'state.db'}", "edge", "keys", "rotate"]
    before = hashlib.sha256(default_key_path(home.home).read_bytes()).hexdigest()
    out = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "signing key 1" in out.stdout and "1 manifest(s) signed again" in out.stdout
    assert hashlib.sha256(default_key_path(home.home).read_bytes()).hexdigest() != before
    missing = subprocess.run([*cli, "--key", str(tmp_path / "none.pem")], capture_output=True, text=True, timeout=120)
    assert missing.returncode == 3 and "none.pem does not exist" in missing.stderr, (missing.returncode, missing.stderr)
