"""``quorumfl models promote VERSION --edge``: build the version's model, refuse a precision it
cannot take, choose the QAT data, then publish through the registry.

The model: a run of a built-in image dataset names it by its architecture key; a run on departments'
own data (any ``task-schema``: image folders, tables, texts, a plug-in task) is built by its task
from the run's schema, so the export knows its input (float32 values, or int64 token ids), its
output width and its objective (loss and primary metric: accuracy, or MAE for a regression).

Precision: ``int8`` (QAT, static INT8) unless the model has a layer no INT8 kernel runs (the text
task's embedding bag): that is refused here, before any work, offering ``dynamic`` (INT8 weights,
ONNX) and ``fp32``.

QAT data: by default the server's held-out set of the version's run (recomputed from the run's
dataset and seed, as the server evaluates), split in two halves with a fixed seed: one fine-tunes,
the other measures the fp32 model and the artifact. With a department's partition folder (a node's
own data), QAT uses its training split and the whole held-out set measures. A run on departments'
own data has no server-side data at all: it needs a department's partition imported under the
run's schema, whose train split fine-tunes and whose test split measures.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from quorumfl.core.data.datasets import holdout_split
from quorumfl.core.data.store import read_partition
from quorumfl.core.tasks import ModelSpec, check_schema_fits, read_schema
from quorumfl.edge.export import ArtifactFormat, Precision
from quorumfl.edge.manifest import Channel
from quorumfl.edge.qat import QatSettings, int8_obstacle
from quorumfl.edge.registry import Calibration, EdgeSource, Registry, parse_architecture
from quorumfl.edge.signing import create_signing_key
from quorumfl.errors import DataError, EdgeError
from quorumfl.server.model_store import ModelStore
from quorumfl.server.state.artifacts import ArtifactRecords
from quorumfl.server.state.orm import EdgeArtifact, ModelVersion
from quorumfl.server.state.repository import Repository
from quorumfl.training.qat import decode_ranges

__all__ = ["calibration_for", "default_key_path", "edge_source", "promote_to_edge", "registry_root"]


def default_key_path(home: Path) -> Path:
    return home / "edge" / "signing-key.pem"


def registry_root(home: Path) -> Path:
    return home / "edge" / "artifacts"


def _own_data_calibration(schema_text: str, partition: Path | None) -> Calibration:
    """QAT data of a run on departments' own data: a partition of the run's schema, or a refusal."""
    if partition is None:
        raise EdgeError("the model was trained on departments' own data (the run's task-schema), which the server "
                        "does not hold: pass --partition with a department's partition imported under that schema")
    part = read_partition(partition)
    check_schema_fits(part.resolved_schema(), read_schema(schema_text, key="the run's task-schema"),
                      where=f"partition {partition}")
    if len(part.test) == 0:
        raise DataError(f"partition {partition} has an empty test split, on which the export is measured; "
                        "import it again with a test fraction above 0")
    return Calibration(part.train.x, part.train.y, part.test.x, part.test.y, part.dataset,
                       f"partition of {part.department} ({len(part.train)} samples for QAT, {len(part.test)} to measure)",
                       part.train.objective)


def edge_source(version: ModelVersion, config: dict[str, object]) -> EdgeSource:
    """The version's model with its stored weights (checked against their SHA-256), built by the run's
    task from its schema, or from the architecture key of a built-in image dataset's run."""
    from quorumfl.core.models import arrays_to_model, build_model, split_control

    schema_text = str(config.get("task-schema") or "").strip()
    if schema_text:
        schema = read_schema(schema_text, key="the run's task-schema")
        spec = ModelSpec(str(config.get("task", "image")), str(config.get("model", "")), json.dumps(schema, sort_keys=True))
        task = spec.resolve()
        model, shape, outputs = spec.build(seed=0), task.input_shape(schema), task.outputs(schema)
    elif str(config.get("task", "image")) != "image":
        raise EdgeError(f"model version {version.id} is of the '{config.get('task')}' task but its run has no "
                        "task-schema to build the model from; promote a version of a run started with --schema")
    else:
        name, shape, outputs = parse_architecture(version.architecture)
        model = build_model(name, shape, outputs)
    arrays = ModelStore.load(version.path, version.sha256)
    arrays_to_model(model, split_control(arrays)[0])  # not SCAFFOLD's c, nor a federated QAT's ranges
    model.eval()
    return EdgeSource(model, tuple(shape), outputs, decode_ranges(arrays) or None)


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
    formats: tuple[ArtifactFormat, ...] | None = None,
    precision: Precision = Precision.INT8,
) -> tuple[list[EdgeArtifact], Calibration, bool]:
    """Publish ``version_id`` as signed artifacts; returns (rows, calibration, key_created). Formats
    default to ONNX and ExecuTorch, ONNX alone for ``dynamic``."""
    version = repo.get_model_version(version_id)
    config = dict(repo.get_run(version.run_id).config) if version.run_id is not None else {}
    source = edge_source(version, config)
    obstacle = int8_obstacle(source.model) if precision is Precision.INT8 else None
    if obstacle:
        raise EdgeError(f"model version {version_id} ({config.get('task', 'image')} task, model "
                        f"'{config.get('model', '')}') cannot be exported as INT8: {obstacle}; pass --precision dynamic "
                        "(INT8 weights, float activations; ONNX for onnxruntime) or --precision fp32")
    if formats is None:
        formats = (ArtifactFormat.ONNX,) if precision is Precision.DYNAMIC else (ArtifactFormat.ONNX, ArtifactFormat.PTE)
    if precision is Precision.DYNAMIC and ArtifactFormat.PTE in formats:
        raise EdgeError("--precision dynamic is exported as ONNX only (onnxruntime runs it); drop the pte format, or "
                        "use --precision fp32 or int8 for an ExecuTorch program")
    calibration = calibration_for(config, partition=partition)
    if source.ranges is not None and precision is Precision.INT8:
        calibration = replace(calibration, source=f"the departments' own, through the activation ranges of the "
                                                  f"federated QAT rounds; measured on {len(calibration.y_eval)} samples "
                                                  f"of {calibration.dataset}")
    key = key_path or default_key_path(home)
    created = False
    if key_path is None and not key.exists():
        create_signing_key(key)
        created = True
    registry = Registry(registry_root(home), ArtifactRecords(repo.sessions))
    rows = registry.promote(version, source, calibration, channel=channel, key_path=key, settings=settings,
                            formats=formats, precision=precision)
    repo.add_tag(version_id, "promoted")
    return rows, calibration, created
