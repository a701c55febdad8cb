"""The edge artifact registry: promote a model version to edge artifacts, sign them, store them.

Promotion takes the model version's weights (loaded and checked against its SHA-256 by the caller),
measures the task's primary metric of the fp32 model, brings it to the asked precision (``int8``:
QAT on calibration data and INT8 conversion, or, for a version from federated QAT rounds, INT8
conversion with the departments' activation ranges; ``dynamic``: onnxruntime's INT8 weights;
``fp32``), exports ONNX and ExecuTorch, measures the ONNX artifact's metric in onnxruntime on the same
data, and publishes each format under the next artifact version: the file (as the zlib stream a device
downloads, ``STORED_SUFFIX``) is written atomically to ``HOME/edge/artifacts`` and its row (with the signed manifest) is added to the
state DB, all formats in one transaction. Files are written before the rows, so a crash leaves at
worst an unreferenced file, never a row without its file; file names carry the content hash, so
two promotions racing for one version number cannot overwrite each other's file.
"""

from __future__ import annotations

import copy
import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray
from torch import nn

from quorumfl.core.files import atomic_write
from quorumfl.core.tasks import CLASSIFICATION, Objective
from quorumfl.edge.delta import decode, encode
from quorumfl.edge.export import ArtifactFormat, Precision, export_artifact, export_form
from quorumfl.edge.manifest import Channel, Manifest, check_payload
from quorumfl.edge.qat import QatSettings, evaluate, quantize_aware, zero_unread_inputs
from quorumfl.edge.runtime import load_model
from quorumfl.edge.signing import load_private_key, sign
from quorumfl.errors import ArtifactError, ConfigError, ModelError
from quorumfl.server.state.artifacts import ArtifactRecords, NewArtifact
from quorumfl.server.state.orm import EdgeArtifact, ModelVersion
from quorumfl.training.qat import Ranges, calibrated

__all__ = ["Calibration", "EdgeSource", "Registry", "input_dtype", "parse_architecture"]

log = logging.getLogger(__name__)

# Artifact files are kept as the zlib stream of a whole download (``edge.delta.encode`` against
# nothing): a pruned INT8 model's zeros take no disk, and the manifest's size and SHA-256 stay those of
# the artifact itself. A file without the suffix (promoted before) is read as it is.
STORED_SUFFIX = ".zlib"


@dataclass(frozen=True)
class Calibration:
    """Data for QAT (``train``) and for measuring the artifact (``evaluate``)."""

    x_train: NDArray[Any]
    y_train: NDArray[Any]
    x_eval: NDArray[Any]
    y_eval: NDArray[Any]
    dataset: str
    source: str  # where the QAT data came from, for the operator
    objective: Objective = CLASSIFICATION  # the task's loss (for QAT) and primary metric


@dataclass(frozen=True)
class EdgeSource:
    """A model version's model with its weights loaded, in eval mode, and what it takes and gives."""

    model: nn.Module
    input_shape: tuple[int, ...]
    outputs: int  # class count, or 1 for a regression
    ranges: Ranges | None = None  # activation ranges of a federated QAT (run config qat-rounds), if the version has them


def input_dtype(x: NDArray[Any]) -> str:
    """What an artifact takes, as the task's reader encodes it: int64 token ids or float32 values."""
    return "int64" if x.dtype.kind in "iu" else "float32"


def parse_architecture(key: str) -> tuple[str, tuple[int, ...], int]:
    """Inverse of ``quorumfl.core.models.architecture_key``: ``name:CxHxW:classes``, also as the head of a
    strategy's lineage (``…|scaffold``, ``…|ifca-K:cluster-k``)."""
    try:
        name, shape, classes = key.split("|", 1)[0].rsplit(":", 2)
        return name, tuple(int(d) for d in shape.split("x")), int(classes)
    except ValueError:
        raise ModelError(f"architecture '{key}' is not of the form NAME:CxHxW:CLASSES") from None


def _two(x: NDArray[Any]) -> torch.Tensor:
    """Two examples (the exporters need two to keep the batch dimension dynamic)."""
    return torch.from_numpy(np.ascontiguousarray(np.concatenate([x[:1]] * 2) if len(x) < 2 else x[:2]))


class Registry:
    """Artifact files under ``root`` and their rows in the state DB."""

    def __init__(self, root: Path, records: ArtifactRecords) -> None:
        self.root = root
        self.records = records

    def promote(
        self,
        version: ModelVersion,
        source: EdgeSource,
        calibration: Calibration,
        *,
        channel: Channel,
        key_path: Path,
        settings: QatSettings | None = None,
        formats: Sequence[ArtifactFormat] = (ArtifactFormat.ONNX, ArtifactFormat.PTE),
        precision: Precision = Precision.INT8,
    ) -> list[EdgeArtifact]:
        key = load_private_key(key_path)  # before any work: a missing key fails fast
        if settings is not None and settings.sparsity > 0 and precision is not Precision.INT8:
            raise ConfigError(f"--sparsity prunes before quantisation-aware training, which only --precision int8 runs "
                              f"(got {precision.value}); drop --sparsity or use int8")
        model, input_shape, objective = copy.deepcopy(source.model), source.input_shape, calibration.objective
        zero_unread_inputs(model)  # changes no output; every format's zlib download shrinks by them
        dtype = input_dtype(calibration.x_train)
        metric = objective.primary
        fp32 = evaluate(model, calibration.x_eval, calibration.y_eval, objective)[metric]
        graph: nn.Module
        if precision is Precision.INT8 and source.ranges is not None:  # calibrated by the departments' QAT rounds
            if settings is not None and settings.sparsity > 0:
                raise ConfigError(f"model version {version.id} comes from federated QAT rounds, whose activation ranges "
                                  "calibrate it as it is; --sparsity would prune and fine-tune it on the server "
                                  "instead: drop --sparsity, or promote a version from before the QAT rounds")
            example = _two(calibration.x_train)
            graph = calibrated(model, example, source.ranges)
        elif precision is Precision.INT8:
            quantized = quantize_aware(model, calibration.x_train, calibration.y_train, input_shape,
                                       objective=objective, settings=settings)
            graph, example = quantized.module, quantized.example
        else:
            graph = export_form(model)
            example = _two(calibration.x_train)
        payloads = {fmt: export_artifact(graph, example, fmt, precision) for fmt in formats}
        edge = None
        if ArtifactFormat.ONNX in payloads:
            runner = load_model(payloads[ArtifactFormat.ONNX], ArtifactFormat.ONNX, input_shape, input_dtype=dtype)
            edge = evaluate(lambda t: torch.from_numpy(runner(t.numpy())), calibration.x_eval, calibration.y_eval,
                            objective)[metric]
        number = self.records.next_version()
        created = datetime.now(UTC).isoformat(timespec="seconds")
        self.root.mkdir(parents=True, exist_ok=True)
        items = []
        for fmt, payload in payloads.items():
            manifest = Manifest(
                version=number, channel=channel, format=fmt, size=len(payload),
                sha256=hashlib.sha256(payload).hexdigest(), parent_model_version=version.id,
                architecture=version.architecture, dataset=calibration.dataset, input_shape=input_shape,
                num_classes=source.outputs, created_at=created, input_dtype=dtype, precision=precision.value,
                metric=metric, fp32_metric=round(fp32, 6), edge_metric=None if edge is None else round(edge, 6),
                sparsity=settings.sparsity if settings is not None and precision is Precision.INT8 else 0.0,
            )
            # the hash in the name: a concurrent promotion that drew the same version number (its
            # row is then refused by the unique constraint) can never overwrite this file
            path = self.root / f"v{number}-{manifest.sha256[:16]}.{fmt.value}{STORED_SUFFIX}"
            atomic_write(path, encode(payload, b""))  # at rest as the zlib stream a device downloads
            body = manifest.to_bytes()
            items.append(NewArtifact(format=fmt.value, size_bytes=len(payload), sha256=manifest.sha256,
                                     signature=sign(key, body).hex(), manifest=body.decode(), path=str(path)))
        rows = self.records.add(version=number, channel=channel.value, model_version_id=version.id, items=items)
        log.info("model version %s promoted to edge artifact v%s (%s, %s): %s fp32 %.4f, artifact %s",
                 version.id, number, channel.value, precision.value, metric, fp32, edge)
        return rows

    @staticmethod
    def payload(row: EdgeArtifact) -> bytes:
        """The artifact's bytes, refused unless they still match the signed manifest."""
        return Registry.checked_payload(row)[0]

    @staticmethod
    def checked_payload(row: EdgeArtifact) -> tuple[bytes, Manifest]:
        """``payload`` and the signed manifest its bytes were checked against."""
        try:
            data = Path(row.path).read_bytes()
        except OSError as exc:
            raise ArtifactError(f"artifact file {row.path} is unreadable ({exc.strerror or exc})") from exc
        manifest = Manifest.from_bytes(row.manifest.encode())
        if row.path.endswith(STORED_SUFFIX):  # inflated to at most the signed size, then checked as a plain file
            try:
                data = decode(data, b"", manifest.size)
            except ArtifactError:
                raise ArtifactError(f"artifact file {row.path} is damaged: its zlib stream does not inflate to the "
                                    f"{manifest.size} bytes its manifest signs") from None
        check_payload(manifest, data)
        return data, manifest
