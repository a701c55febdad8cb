"""The edge artifact registry: promote a model version to INT8 artifacts, sign them, store them.

Promotion loads the model version (checked against its SHA-256), fine-tunes it with QAT on
calibration data, converts it to INT8, exports ONNX and ExecuTorch, measures the ONNX artifact's
accuracy in onnxruntime, and publishes each format under the next artifact version: the file is
written atomically to ``HOME/edge/artifacts`` and its row (with the signed manifest) is added to the
state DB, all formats in one transaction. Files are written before the rows, so a crash leaves at
worst an unreferenced file, never a row without its file; file names carry the content hash, so
two promotions racing for one version number cannot overwrite each other's file.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from quorumfl.core.files import atomic_write
from quorumfl.edge.export import ArtifactFormat, export_artifact
from quorumfl.edge.manifest import Channel, Manifest, check_payload
from quorumfl.edge.qat import QatSettings, accuracy, quantize_aware
from quorumfl.edge.runtime import load_model
from quorumfl.edge.signing import load_private_key, sign
from quorumfl.errors import ArtifactError, ModelError
from quorumfl.server.model_store import ModelStore
from quorumfl.server.state.artifacts import ArtifactRecords, NewArtifact
from quorumfl.server.state.orm import EdgeArtifact, ModelVersion

__all__ = ["Calibration", "Registry", "parse_architecture"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Calibration:
    """Data for QAT (``train``) and for measuring the artifact (``evaluate``)."""

    x_train: NDArray[np.float32]
    y_train: NDArray[np.int64]
    x_eval: NDArray[np.float32]
    y_eval: NDArray[np.int64]
    dataset: str
    source: str  # where the QAT data came from, for the operator


def parse_architecture(key: str) -> tuple[str, tuple[int, ...], int]:
    """Inverse of ``quorumfl.core.models.architecture_key``: ``name:CxHxW:classes``, also as the head of a
    strategy's lineage (``…|scaffold``, ``…|ifca-K:cluster-k``)."""
    try:
        name, shape, classes = key.split("|", 1)[0].rsplit(":", 2)
        return name, tuple(int(d) for d in shape.split("x")), int(classes)
    except ValueError:
        raise ModelError(f"architecture '{key}' is not of the form NAME:CxHxW:CLASSES") from None


class Registry:
    """Artifact files under ``root`` and their rows in the state DB."""

    def __init__(self, root: Path, records: ArtifactRecords) -> None:
        self.root = root
        self.records = records

    def promote(
        self,
        version: ModelVersion,
        calibration: Calibration,
        *,
        channel: Channel,
        key_path: Path,
        settings: QatSettings | None = None,
        formats: Sequence[ArtifactFormat] = (ArtifactFormat.ONNX, ArtifactFormat.PTE),
    ) -> list[EdgeArtifact]:
        from quorumfl.core.models import arrays_to_model, build_model, split_control

        key = load_private_key(key_path)  # before any work: a missing key fails fast
        name, input_shape, num_classes = parse_architecture(version.architecture)
        model = build_model(name, input_shape, num_classes)
        arrays_to_model(model, split_control(ModelStore.load(version.path, version.sha256))[0])  # not SCAFFOLD's c
        model.eval()
        fp32 = accuracy(model, calibration.x_eval, calibration.y_eval)
        quantized = quantize_aware(model, calibration.x_train, calibration.y_train, input_shape, settings=settings)
        payloads = {fmt: export_artifact(quantized, fmt) for fmt in formats}
        int8 = None
        if ArtifactFormat.ONNX in payloads:
            runner = load_model(payloads[ArtifactFormat.ONNX], ArtifactFormat.ONNX, input_shape)
            int8 = float(np.mean(runner(calibration.x_eval).argmax(1) == calibration.y_eval))
        number = self.records.next_version()
        created = datetime.now(UTC).isoformat(timespec="seconds")
        self.root.mkdir(parents=True, exist_ok=True)
        items = []
        for fmt, payload in payloads.items():
            manifest = Manifest(
                version=number, channel=channel, format=fmt, size=len(payload),
                sha256=hashlib.sha256(payload).hexdigest(), parent_model_version=version.id,
                architecture=version.architecture, dataset=calibration.dataset, input_shape=input_shape, num_classes=num_classes,
                created_at=created, fp32_accuracy=round(fp32, 6), int8_accuracy=None if int8 is None else round(int8, 6),
            )
            # the hash in the name: a concurrent promotion that drew the same version number (its
            # row is then refused by the unique constraint) can never overwrite this file
            path = self.root / f"v{number}-{manifest.sha256[:16]}.{fmt.value}"
            atomic_write(path, payload)
            body = manifest.to_bytes()
            items.append(NewArtifact(format=fmt.value, size_bytes=len(payload), sha256=manifest.sha256,
                                     signature=sign(key, body).hex(), manifest=body.decode(), path=str(path)))
        rows = self.records.add(version=number, channel=channel.value, model_version_id=version.id, items=items)
        log.info("model version %s promoted to edge artifact v%s (%s): fp32 %.4f, int8 %s",
                 version.id, number, channel.value, fp32, int8)
        return rows

    @staticmethod
    def payload(row: EdgeArtifact) -> bytes:
        """The artifact's bytes, refused unless they still match the signed manifest."""
        try:
            data = Path(row.path).read_bytes()
        except OSError as exc:
            raise ArtifactError(f"artifact file {row.path} is unreadable ({exc.strerror or exc})") from exc
        check_payload(Manifest.from_bytes(row.manifest.encode()), data)
        return data
