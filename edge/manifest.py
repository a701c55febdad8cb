"""The signed description of an edge artifact, and the checks an edge device runs before using one.

A manifest names the artifact's version (a positive integer the registry assigns in promotion
order), channel, format, size, SHA-256, the model version it was made from, how to feed it (input
shape and dtype: float32 features or images, int64 token ids), its precision (``int8``, ``dynamic``,
``fp32``), the share of weights pruned to zero (``sparsity``, schema 3) and the task's primary
metric of the fp32 model and of the artifact itself. Its canonical bytes (sorted-key compact JSON)
are what the Ed25519 signature covers, so the channel and version cannot be changed without breaking
the signature. ``check_payload`` and ``check_newer`` fail
closed: anything unexpected raises ``ArtifactError``. Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

from quorumfl.edge.export import ArtifactFormat, parse_option
from quorumfl.errors import ArtifactError

__all__ = ["Channel", "Manifest", "check_newer", "check_payload"]

SCHEMA = 3  # 3: sparsity; 2: precision, input_dtype and the task's metric (1: accuracies of INT8 image models only)
# An unpruned artifact is still written as schema 2 (no sparsity field), so devices that read schema
# 2 keep installing everything that is not pruned; only a pruned one needs a client that reads 3.
INPUT_DTYPES = ("float32", "int64")
PRECISIONS = ("int8", "dynamic", "fp32")
_SCHEMA_1 = {"version", "channel", "format", "size", "sha256", "parent_model_version", "architecture", "dataset",
             "input_shape", "num_classes", "created_at", "fp32_accuracy", "int8_accuracy", "schema"}


class Channel(StrEnum):
    STABLE = "stable"
    CANARY = "canary"


def parse_channel(value: str) -> Channel:
    return parse_option(Channel, value, "--channel")


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
    num_classes: int  # the model's output width (1 for a regression)
    created_at: str
    input_dtype: str = "float32"
    precision: str = "int8"
    metric: str = "accuracy"  # the task's primary metric, measured on the calibration's evaluation split
    fp32_metric: float | None = None  # of the model as trained (torch)
    edge_metric: float | None = None  # of this artifact's ONNX form in onnxruntime
    sparsity: float = 0.0  # fraction of weights pruned to zero before QAT (``edge.qat``)

    @property
    def file_name(self) -> str:
        return f"v{self.version}.{self.format.value}"

    def to_bytes(self) -> bytes:
        body: dict[str, Any] = asdict(self)
        body["channel"] = self.channel.value
        body["format"] = self.format.value
        body["input_shape"] = list(self.input_shape)
        body["schema"] = SCHEMA if self.sparsity else 2
        if not self.sparsity:
            del body["sparsity"]
        return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> Manifest:
        """Parse a manifest, refusing anything that is not exactly the expected fields and types."""
        try:
            body = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ArtifactError(f"artifact manifest is not JSON ({exc})") from None
        if not isinstance(body, dict) or body.get("schema") not in (1, 2, SCHEMA):
            raise ArtifactError(f"artifact manifest has an unknown schema (expected {SCHEMA}); update the edge client")
        if body["schema"] == 2:  # not pruned: no sparsity field
            if "sparsity" in body:
                raise ArtifactError("artifact manifest of schema 2 has a sparsity field (schema 3's); it is refused")
            body = {**body, "sparsity": 0.0}
        elif body["schema"] == SCHEMA:
            sparsity = body.get("sparsity")
            if isinstance(sparsity, bool) or not isinstance(sparsity, int | float) or not 0 < sparsity < 1:
                raise ArtifactError(f"artifact manifest has an invalid sparsity {sparsity!r}")
        if body["schema"] == 1:  # published before tasks: INT8 image models, float32 input, accuracy
            if set(body) != _SCHEMA_1:
                raise ArtifactError(f"artifact manifest fields {sorted(set(body) ^ _SCHEMA_1)} are unexpected or missing")
            body = {**{k: v for k, v in body.items() if k not in ("fp32_accuracy", "int8_accuracy")},
                    "input_dtype": "float32", "precision": "int8", "metric": "accuracy",
                    "fp32_metric": body["fp32_accuracy"], "edge_metric": body["int8_accuracy"], "sparsity": 0.0}
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
        for key in ("fp32_metric", "edge_metric"):
            if body[key] is not None and (isinstance(body[key], bool) or not isinstance(body[key], int | float)):
                raise ArtifactError(f"artifact manifest has a non-numeric {key}")
        if not all(isinstance(body[k], str) for k in ("architecture", "dataset", "created_at", "metric")):
            raise ArtifactError("artifact manifest has a non-text architecture/dataset/created_at/metric")
        if body["input_dtype"] not in INPUT_DTYPES or body["precision"] not in PRECISIONS:
            raise ArtifactError(f"artifact manifest has an unknown input_dtype {body['input_dtype']!r} or precision "
                                f"{body['precision']!r}; update the edge client")
        try:
            return cls(
                version=body["version"], channel=Channel(body["channel"]), format=ArtifactFormat(body["format"]),
                size=body["size"], sha256=sha, parent_model_version=body["parent_model_version"],
                architecture=body["architecture"], dataset=body["dataset"], input_shape=tuple(shape), num_classes=body["num_classes"],
                created_at=body["created_at"], input_dtype=body["input_dtype"], precision=body["precision"],
                metric=body["metric"], fp32_metric=body["fp32_metric"], edge_metric=body["edge_metric"],
                sparsity=float(body["sparsity"]),
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
