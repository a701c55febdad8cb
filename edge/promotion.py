"""``quorumfl models promote VERSION --edge``: choose the QAT data, then publish through the registry.

QAT data: by default the server's held-out set of the version's run (recomputed from the run's
dataset and seed, as the server evaluates), split in two halves with a fixed seed: one fine-tunes,
the other measures fp32 and INT8 accuracy. With a department's partition folder (a node's own
data), QAT uses its training split and the whole held-out set measures. A run on departments' own
images (a ``task-schema`` of dataset ``folder``) has no server-side data at all: it needs a
department's partition imported under the run's schema, whose train split fine-tunes and whose test
split measures.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from quorumfl.core.data.datasets import holdout_split
from quorumfl.core.data.store import read_partition
from quorumfl.core.tasks import check_schema_fits, read_schema
from quorumfl.edge.export import ArtifactFormat
from quorumfl.edge.manifest import Channel
from quorumfl.edge.qat import QatSettings
from quorumfl.edge.registry import Calibration, Registry
from quorumfl.edge.signing import create_signing_key
from quorumfl.errors import DataError, EdgeError
from quorumfl.server.state.artifacts import ArtifactRecords
from quorumfl.server.state.orm import EdgeArtifact
from quorumfl.server.state.repository import Repository

__all__ = ["calibration_for", "default_key_path", "promote_to_edge", "registry_root"]


def default_key_path(home: Path) -> Path:
    return home / "edge" / "signing-key.pem"


def registry_root(home: Path) -> Path:
    return home / "edge" / "artifacts"


def _own_data_calibration(schema_text: str, partition: Path | None) -> Calibration:
    """QAT data of a run on departments' own images: a partition of the run's schema, or a refusal."""
    if partition is None:
        raise EdgeError("the model was trained on departments' own images (the run's task-schema), which the server "
                        "does not hold: pass --partition with a department's partition imported under that schema")
    part = read_partition(partition)
    check_schema_fits(part.resolved_schema(), read_schema(schema_text, key="the run's task-schema"),
                      where=f"partition {partition}")
    return Calibration(part.train.x, part.train.y, part.test.x, part.test.y, part.dataset,
                       f"partition of {part.department} ({len(part.train)} samples for QAT, {len(part.test)} to measure)")


def calibration_for(config: dict[str, object], *, partition: Path | None = None, seed: int = 0) -> Calibration:
    if str(config.get("task-schema") or "").strip():
        return _own_data_calibration(str(config["task-schema"]), partition)
    dataset = str(config.get("dataset", "digits"))
    data_dir = Path(str(config["data-dir"])).expanduser() if config.get("data-dir") else None
    _, held_out = holdout_split(dataset, seed=int(str(config.get("seed", 0))), data_dir=data_dir)
    if partition is not None:
        part = read_partition(partition)
        if part.dataset != dataset:
            raise DataError(f"partition {partition} holds {part.dataset}, the model was trained on {dataset}")
        return Calibration(part.train.x, part.train.y, held_out.x, held_out.y, dataset,
                           f"partition of {part.department} ({len(part.train)} samples)")
    order = np.random.default_rng(seed).permutation(len(held_out))
    half = len(order) // 2
    if half == 0:
        raise DataError(f"the held-out set of {dataset} is too small to calibrate on")
    tune, measure = np.sort(order[:half]), np.sort(order[half:])
    return Calibration(held_out.x[tune], held_out.y[tune], held_out.x[measure], held_out.y[measure], dataset,
                       f"server held-out set of {dataset} ({half} samples for QAT, {len(measure)} to measure)")


def promote_to_edge(
    repo: Repository,
    version_id: int,
    *,
    home: Path,
    channel: Channel,
    partition: Path | None = None,
    key_path: Path | None = None,
    settings: QatSettings | None = None,
    formats: tuple[ArtifactFormat, ...] = (ArtifactFormat.ONNX, ArtifactFormat.PTE),
) -> tuple[list[EdgeArtifact], Calibration, bool]:
    """Publish ``version_id`` as signed INT8 artifacts; returns (rows, calibration, key_created)."""
    version = repo.get_model_version(version_id)
    config = dict(repo.get_run(version.run_id).config) if version.run_id is not None else {}
    if str(config.get("task", "image")) != "image":
        raise EdgeError(f"model version {version_id} is of the '{config.get('task')}' task: edge export (QAT, INT8, "
                        "ONNX/.pte, calibration on the server's held-out set) takes the image task's models only; the "
                        "tabular and text models stay in the model store ('quorumfl models export')")
    calibration = calibration_for(config, partition=partition)
    key = key_path or default_key_path(home)
    created = False
    if key_path is None and not key.exists():
        create_signing_key(key)
        created = True
    registry = Registry(registry_root(home), ArtifactRecords(repo.sessions))
    rows = registry.promote(version, calibration, channel=channel, key_path=key, settings=settings, formats=formats)
    repo.add_tag(version_id, "promoted")
    return rows, calibration, created
