"""Manifests, signatures and version order: what an edge device checks before it installs anything."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from quorumfl.edge.export import ArtifactFormat
from quorumfl.edge.manifest import Channel, Manifest, check_newer, check_payload
from quorumfl.edge.signing import (
    create_signing_key,
    load_private_key,
    load_public_key,
    public_key_path,
    sign,
    verify,
)
from quorumfl.errors import ArtifactError, ConfigError

PAYLOAD = bytes(range(256)) * 40


def manifest(version: int = 3, *, payload: bytes = PAYLOAD, channel: Channel = Channel.STABLE,
             fmt: ArtifactFormat = ArtifactFormat.ONNX) -> Manifest:
    return Manifest(version=version, channel=channel, format=fmt, size=len(payload),
                    sha256=hashlib.sha256(payload).hexdigest(), parent_model_version=7, architecture="mlp:1x8x8:10",
                    dataset="digits", input_shape=(1, 8, 8), num_classes=10, created_at="2026-11-30T10:00:00+00:00",
                    fp32_metric=0.98, edge_metric=0.975)


@pytest.fixture
def keys(tmp_path: Path) -> tuple[Path, Path]:
    private = tmp_path / "k" / "signing-key.pem"
    create_signing_key(private)
    return private, public_key_path(private)


def test_manifest_round_trips_through_its_signed_bytes() -> None:
    m = manifest()
    assert Manifest.from_bytes(m.to_bytes()) == m
    assert m.to_bytes() == Manifest.from_bytes(m.to_bytes()).to_bytes()  # canonical


def test_signature_verifies_and_any_flipped_byte_is_refused(keys: tuple[Path, Path]) -> None:
    private, public = keys
    body = manifest().to_bytes()
    signature = sign(load_private_key(private), body)
    verify(load_public_key(public), body, signature)
    for i in range(0, len(signature)):
        flipped = bytearray(signature)
        flipped[i] ^= 0x01
        with pytest.raises(ArtifactError, match="signature"):
            verify(load_public_key(public), body, bytes(flipped))
    for i in range(0, len(body), 7):
        flipped = bytearray(body)
        flipped[i] ^= 0x01
        with pytest.raises(ArtifactError):
            verify(load_public_key(public), bytes(flipped), signature)


def test_another_key_is_refused(keys: tuple[Path, Path], tmp_path: Path) -> None:
    private, _ = keys
    other = tmp_path / "other" / "signing-key.pem"
    create_signing_key(other)
    body = manifest().to_bytes()
    with pytest.raises(ArtifactError, match="signature"):
        verify(load_public_key(public_key_path(other)), body, sign(load_private_key(private), body))


def test_flipped_payload_byte_or_wrong_size_is_refused() -> None:
    m = manifest()
    check_payload(m, PAYLOAD)
    for i in (0, len(PAYLOAD) // 2, len(PAYLOAD) - 1):
        flipped = bytearray(PAYLOAD)
        flipped[i] ^= 0x80
        with pytest.raises(ArtifactError, match="SHA-256"):
            check_payload(m, bytes(flipped))
    with pytest.raises(ArtifactError, match="bytes"):
        check_payload(m, PAYLOAD[:-1])


@given(st.integers(1, 10**9), st.integers(1, 10**9))
def test_versions_order_as_integers(installed: int, offered: int) -> None:
    assert check_newer(manifest(offered), manifest(installed), channel=Channel.STABLE,
                       fmt=ArtifactFormat.ONNX) is (offered > installed)


def test_version_order_is_numeric_not_textual() -> None:
    assert check_newer(manifest(10), manifest(9), channel=Channel.STABLE, fmt=ArtifactFormat.ONNX)
    assert not check_newer(manifest(9), manifest(10), channel=Channel.STABLE, fmt=ArtifactFormat.ONNX)
    assert check_newer(manifest(1), None, channel=Channel.STABLE, fmt=ArtifactFormat.ONNX)


def test_other_channel_or_format_is_refused() -> None:
    with pytest.raises(ArtifactError, match="canary"):
        check_newer(manifest(channel=Channel.CANARY), None, channel=Channel.STABLE, fmt=ArtifactFormat.ONNX)
    with pytest.raises(ArtifactError, match="pte"):
        check_newer(manifest(fmt=ArtifactFormat.PTE), None, channel=Channel.STABLE, fmt=ArtifactFormat.ONNX)


@pytest.mark.parametrize("edit", [
    lambda b: b.replace(b'"version":3', b'"version":"3"'),
    lambda b: b.replace(b'"schema":2', b'"schema":1'),
    lambda b: b.replace(b'"schema":2', b'"schema":3'),
    lambda b: b.replace(b'"precision":"int8"', b'"precision":"int4"'),
    lambda b: b.replace(b'"input_dtype":"float32"', b'"input_dtype":"float16"'),
    lambda b: b.replace(b'"metric":"accuracy"', b'"metric":1'),
    lambda b: b.replace(b'"edge_metric":0.975', b'"edge_metric":true'),
    lambda b: b.replace(b'"channel":"stable"', b'"channel":"beta"'),
    lambda b: b.replace(b'"input_shape":[1,8,8]', b'"input_shape":[1,-8,8]'),
    lambda b: b.replace(b',"size":10240', b''),
    lambda b: b[:-1],
])
def test_malformed_manifests_are_refused(edit: object) -> None:
    raw = manifest().to_bytes()
    changed = edit(raw)  # type: ignore[operator]
    assert changed != raw
    with pytest.raises(ArtifactError):
        Manifest.from_bytes(changed)


def test_key_files(keys: tuple[Path, Path], tmp_path: Path) -> None:
    private, public = keys
    assert private.stat().st_mode & 0o777 == 0o600
    with pytest.raises(ConfigError, match="already exists"):
        create_signing_key(private)
    with pytest.raises(ConfigError, match="keys init"):
        load_private_key(tmp_path / "missing.pem")
    with pytest.raises(ConfigError, match="not an Ed25519"):
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ec

        other = ec.generate_private_key(ec.SECP256R1()).public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        (tmp_path / "ec.pem").write_bytes(other)
        load_public_key(tmp_path / "ec.pem")


def test_a_pruned_artifact_says_so_in_schema_3_and_an_unpruned_one_stays_schema_2() -> None:
    import dataclasses
    import json

    plain = manifest()
    assert json.loads(plain.to_bytes())["schema"] == 2 and "sparsity" not in json.loads(plain.to_bytes())
    pruned = dataclasses.replace(plain, sparsity=0.5)
    body = json.loads(pruned.to_bytes())
    assert (body["schema"], body["sparsity"]) == (3, 0.5)
    assert Manifest.from_bytes(pruned.to_bytes()) == pruned and Manifest.from_bytes(plain.to_bytes()) == plain
    for bad in (0, 1.0, True, "0.5", None):
        with pytest.raises(ArtifactError, match="sparsity"):
            Manifest.from_bytes(json.dumps({**body, "sparsity": bad}).encode())
    with pytest.raises(ArtifactError, match="schema 2 has a sparsity"):
        Manifest.from_bytes(json.dumps({**body, "schema": 2}).encode())


def test_a_manifest_signed_before_tasks_still_reads_as_int8_accuracy() -> None:
    """Artifacts published with schema 1 (INT8 image models) stay installable after the upgrade; a
    schema-1 body with a field of schema 2 is refused."""
    import json

    body = json.loads(manifest().to_bytes())
    old = {k: v for k, v in body.items() if k not in ("input_dtype", "precision", "metric", "fp32_metric", "edge_metric")}
    old.update(schema=1, fp32_accuracy=0.98, int8_accuracy=0.975)
    parsed = Manifest.from_bytes(json.dumps(old).encode())
    assert (parsed.precision, parsed.input_dtype, parsed.metric, parsed.edge_metric) == ("int8", "float32", "accuracy", 0.975)
    assert parsed.fp32_metric == 0.98 and parsed.input_shape == (1, 8, 8)
    with pytest.raises(ArtifactError, match="unexpected or missing"):
        Manifest.from_bytes(json.dumps({**old, "precision": "int8"}).encode())
