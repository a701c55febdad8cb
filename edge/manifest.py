"""The signed description of an edge artifact, and the checks an edge device runs before using one.

A manifest names the artifact's version (a positive integer the registry assigns in promotion
order), channel, format, size, SHA-256, the model version it was made from and how to feed it. Its
canonical bytes (sorted-key compact JSON) are what the Ed25519 signature covers, so the channel and
version cannot be changed without breaking the signature. ``check_payload`` and ``check_newer`` fail
closed: anything unexpected raises ``ArtifactError``. Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

from quorumfl.edge.export import ArtifactFormat
from quorumfl.errors import ArtifactError, ConfigError

__all__ = ["Channel", "Manifest", "check_newer", "check_payload"]

SCHEMA = 1


class Channel(StrEnum):
    STABLE = "stable"
    CANARY = "canary"


def parse_channel(value: str) -> Channel:
    try:
        return Channel(value)
    except ValueError:
        raise ConfigError(f"--channel must be one of {[c.value for c in Channel]}, got {value!r}") from None


@dataclass(frozen=True)
class Manifest:
    version: int
    channel: Channel
    format: ArtifactFormat
    size: int
    sha256: str
    parent_model_version: int
    architecture: str
    dataset: str
    input_shape: tuple[int, ...]
    num_classes: int
    created_at: str
    fp32_accuracy: float | None = None
    int8_accuracy: float | None = None

    @property
    def file_name(self) -> str:
        return f"v{self.version}.{self.format.value}"

    def to_bytes(self) -> bytes:
        body: dict[str, Any] = asdict(self)
        body["channel"] = self.channel.value
        body["format"] = self.format.value
        body["input_shape"] = list(self.input_shape)
        body["schema"] = SCHEMA
        return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> Manifest:
        """Parse a manifest, refusing anything that is not exactly the expected fields and types."""
        try:
            body = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ArtifactError(f"artifact manifest is not JSON ({exc})") from None
        if not isinstance(body, dict) or body.get("schema") != SCHEMA:
            raise ArtifactError(f"artifact manifest has an unknown schema (expected {SCHEMA}); update the edge client")
        expected = {f for f in cls.__dataclass_fields__} | {"schema"}
        if set(body) != expected:
            raise ArtifactError(f"artifact manifest fields {sorted(set(body) ^ expected)} are unexpected or missing")
        ints = ("version", "size", "parent_model_version", "num_classes")
        if not all(type(body[k]) is int for k in ints) or body["version"] < 1 or body["size"] < 1:
            raise ArtifactError("artifact manifest has a non-integer or non-positive version/size/parent/classes")
        shape = body["input_shape"]
        if not (isinstance(shape, list) and shape and all(type(d) is int and d > 0 for d in shape)):
            raise ArtifactError(f"artifact manifest has an invalid input_shape {shape!r}")
        sha = body["sha256"]
        if not (isinstance(sha, str) and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)):
            raise ArtifactError("artifact manifest has an invalid sha256")
        for key in ("fp32_accuracy", "int8_accuracy"):
            if body[key] is not None and not isinstance(body[key], int | float):
                raise ArtifactError(f"artifact manifest has a non-numeric {key}")
        if not all(isinstance(body[k], str) for k in ("architecture", "dataset", "created_at")):
            raise ArtifactError("artifact manifest has a non-text architecture/dataset/created_at")
        try:
            return cls(
                version=body["version"], channel=Channel(body["channel"]), format=ArtifactFormat(body["format"]),
                size=body["size"], sha256=sha, parent_model_version=body["parent_model_version"],
                architecture=body["architecture"], dataset=body["dataset"], input_shape=tuple(shape), num_classes=body["num_classes"],
                created_at=body["created_at"], fp32_accuracy=body["fp32_accuracy"],
                int8_accuracy=body["int8_accuracy"],
            )
        except ValueError as exc:
            raise ArtifactError(f"artifact manifest has an unknown channel or format ({exc})") from None


def check_payload(manifest: Manifest, payload: bytes) -> None:
    """Raise unless ``payload`` has the manifest's exact size and SHA-256."""
    if len(payload) != manifest.size:
        raise ArtifactError(f"artifact v{manifest.version} has {len(payload)} bytes, its manifest says "
                            f"{manifest.size}; it is refused")
    actual = hashlib.sha256(payload).hexdigest()
    if actual != manifest.sha256:
        raise ArtifactError(f"artifact v{manifest.version} does not match its SHA-256 (expected "
                            f"{manifest.sha256[:12]}…, found {actual[:12]}…); it is refused")


def check_newer(candidate: Manifest, installed: Manifest | None, *, channel: Channel, fmt: ArtifactFormat) -> bool:
    """True when ``candidate`` should replace ``installed``; raise if it is for another channel/format.

    Versions compare as integers. An offered version older than the installed one is a downgrade a
    compromised or stale server could push; it is never installed (``quorumfl edge rollback`` is the
    device-side way back).
    """
    if candidate.channel is not channel or candidate.format is not fmt:
        raise ArtifactError(f"server offered a {candidate.channel}/{candidate.format} artifact for "
                            f"{channel}/{fmt}; it is refused")
    return installed is None or candidate.version > installed.version
