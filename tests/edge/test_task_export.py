"""Edge export of every task's models. A table model (regression: MAE in dollars) exports as INT8
and keeps its metric; a text model (a hashed n-gram embedding bag, which no INT8 kernel runs) is
refused INT8 in one line naming the layer and offering dynamic quantisation or fp32, both of which
then export and are measured against the torch model. A model of departments' own data calibrates
on a department's partition of the run's schema, never on a built-in dataset."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from quorumfl.core.data import import_partition, propose_schema, read_partition
from quorumfl.core.models import model_to_arrays
from quorumfl.core.tasks import ModelSpec
from quorumfl.core.tasks.modules import find_statistics
from quorumfl.edge.export import ArtifactFormat, Precision
from quorumfl.edge.manifest import Channel, Manifest
from quorumfl.edge.promotion import calibration_for, promote_to_edge, registry_root
from quorumfl.edge.registry import Registry
from quorumfl.edge.runtime import load_model
from quorumfl.errors import EdgeError
from quorumfl.server.model_store import ModelStore
from quorumfl.server.state.database import connect
from quorumfl.server.state.repository import Repository
from tests.core.city_data import property_rows, request_rows, write_csv, write_jsonl


def _trained_version(tmp_path: Path, task: str, model_name: str, schema: dict[str, Any], part: Path,
                     *, epochs: int, lr: float) -> tuple[Repository, int, torch.nn.Module]:
    """A model trained by a plain torch loop on the partition's train split, stored as a model
    version of a run whose config carries the schema (as ``runs start --schema`` stores it)."""
    spec = ModelSpec(task, model_name, json.dumps(schema, sort_keys=True))
    data, objective = read_partition(part).train, spec.objective()
    model = spec.build(seed=0)
    x, y = torch.from_numpy(data.x), torch.from_numpy(data.y)
    stats = find_statistics(model)
    if stats is not None:
        stats.set_statistics(x)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    generator = torch.Generator().manual_seed(0)
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=generator)
        for i in range(0, len(x), 32):
            index = order[i : i + 32]
            optimizer.zero_grad()
            objective.loss(model(x[index]), y[index], reduction="mean").backward()
            optimizer.step()
    model.eval()
    repo = Repository(connect(f"sqlite:///{tmp_path / 'state.db'}", migrate=True))
    run = repo.create_run(flower_run_id=5, config={"task": task, "model": model_name, "task-schema": json.dumps(schema)},
                          strategy="fedavg", num_rounds=1)
    stored = ModelStore(tmp_path / "models").save(model_to_arrays(model), "r1")
    version = repo.add_model_version(run_id=run.id, round_number=1, parent_id=None, architecture=spec.architecture(),
                                     path=str(stored.path), sha256=stored.sha256, size_bytes=stored.size_bytes,
                                     metrics={})
    return repo, int(version.id), model


def _manifests(rows: list[Any]) -> dict[str, Manifest]:
    return {row.format: Manifest.from_bytes(row.manifest.encode()) for row in rows}


def test_a_table_model_exports_as_int8_and_keeps_its_mae(tmp_path: Path) -> None:
    source = write_csv(tmp_path / "sales.csv", property_rows(600, seed=4))
    schema = propose_schema(source, "tabular", {"label": "sale_price", "ignore": "parcel,band"})
    import_partition(source, tmp_path / "part", department="assessor", schema=schema)
    repo, version, model = _trained_version(tmp_path, "tabular", "mlp", schema, tmp_path / "part", epochs=40, lr=0.05)
    rows, calibration, _ = promote_to_edge(repo, version, home=tmp_path, channel=Channel.STABLE,
                                           partition=tmp_path / "part")
    manifests = _manifests(rows)
    onnx = manifests["onnx"]
    assert (onnx.metric, onnx.precision, onnx.input_dtype, onnx.num_classes) == ("mae", "int8", "float32", 1)
    assert onnx.fp32_metric is not None and onnx.edge_metric is not None
    # a trained model (not the constant one: the targets' spread is far above its error), and INT8 keeps it
    spread = float(np.mean(np.abs(calibration.y_eval - calibration.y_eval.mean()))) * calibration.objective.unit
    assert onnx.fp32_metric < 0.5 * spread
    # INT8 outputs are 256 levels of the output's range: the MAE may grow, by under 1 % of the target's range
    assert abs(onnx.edge_metric - onnx.fp32_metric) <= 0.01 * calibration.objective.unit
    # the published artifacts' predictions against the torch model's, in dollars
    with torch.no_grad():
        reference = model(torch.from_numpy(calibration.x_eval)).numpy()[:, 0] * calibration.objective.unit
    for row in rows:
        runner = load_model(Registry.payload(row), row.format, onnx.input_shape, input_dtype="float32")
        got = runner(calibration.x_eval[:16])[:, 0] * calibration.objective.unit
        assert np.abs(got - reference[:16]).max() < 0.15 * spread, row.format


def _text_version(tmp_path: Path) -> tuple[Repository, int, torch.nn.Module, Path]:
    source = write_jsonl(tmp_path / "requests.jsonl", request_rows(400, seed=2))
    schema = propose_schema(source, "text", {"text": "request", "label": "office"})
    import_partition(source, tmp_path / "part", department="front-desk", schema=schema)
    repo, version, model = _trained_version(tmp_path, "text", "fasttext", schema, tmp_path / "part", epochs=8, lr=0.5)
    return repo, version, model, tmp_path / "part"


def test_a_text_model_is_refused_int8_naming_the_layer_and_exports_dynamic_or_fp32(tmp_path: Path) -> None:
    repo, version, model, part = _text_version(tmp_path)
    with pytest.raises(EdgeError, match=r"cannot be exported as INT8: its layer 'embedding' is an EmbeddingBag .* "
                                        r"--precision dynamic .* --precision fp32"):
        promote_to_edge(repo, version, home=tmp_path, channel=Channel.STABLE, partition=part)
    with pytest.raises(EdgeError, match="dynamic is exported as ONNX only"):
        promote_to_edge(repo, version, home=tmp_path, channel=Channel.STABLE, partition=part,
                        precision=Precision.DYNAMIC, formats=(ArtifactFormat.ONNX, ArtifactFormat.PTE))
    assert not registry_root(tmp_path).exists()  # nothing published by a refusal

    fp32_rows, calibration, _ = promote_to_edge(repo, version, home=tmp_path, channel=Channel.STABLE, partition=part,
                                                precision=Precision.FP32)
    dynamic_rows, _, _ = promote_to_edge(repo, version, home=tmp_path, channel=Channel.CANARY, partition=part,
                                         precision=Precision.DYNAMIC)
    fp32, dynamic = _manifests(fp32_rows), _manifests(dynamic_rows)
    assert set(fp32) == {"onnx", "pte"} and set(dynamic) == {"onnx"}
    assert fp32["onnx"].input_dtype == "int64" and dynamic["onnx"].precision == "dynamic"
    with torch.no_grad():
        logits = model(torch.from_numpy(calibration.x_eval)).numpy()
    onnx = load_model(Registry.payload(fp32_rows[0]), "onnx", fp32["onnx"].input_shape, input_dtype="int64")
    np.testing.assert_allclose(onnx(calibration.x_eval), logits, atol=1e-4)  # fp32: the same function
    pte_row = next(r for r in fp32_rows if r.format == "pte")
    pte = load_model(Registry.payload(pte_row), "pte", fp32["pte"].input_shape, input_dtype="int64")
    np.testing.assert_allclose(pte(calibration.x_eval[:4]), logits[:4], atol=1e-4)
    # dynamic: INT8 weights, a quarter of the size, the accuracy of the fp32 model within 3 points
    assert fp32["onnx"].fp32_metric is not None and fp32["onnx"].fp32_metric > 0.8  # the model learned the topics
    assert dynamic["onnx"].edge_metric is not None
    assert abs(dynamic["onnx"].edge_metric - fp32["onnx"].fp32_metric) <= 0.03
    assert dynamic["onnx"].size <= 0.35 * fp32["onnx"].size
    # the runtime takes token ids only
    runner = load_model(Registry.payload(dynamic_rows[0]), "onnx", dynamic["onnx"].input_shape, input_dtype="int64")
    with pytest.raises(EdgeError, match="takes int64 token ids"):
        runner(calibration.x_eval.astype(np.float32))
    with pytest.raises(EdgeError, match="negative token ids"):
        runner(-calibration.x_eval[:2])


def _folder_run(tmp_path: Path) -> tuple[Repository, int, dict[str, object], Path]:
    """A run on departments' own image folders (the run config carries the schema inline) and a
    department's partition imported under that schema."""
    from quorumfl.core.models import build_model
    from tests.core.city_data import write_digit_folder

    write_digit_folder(tmp_path / "sample", range(200))
    schema = propose_schema(tmp_path / "sample", "image", {})
    write_digit_folder(tmp_path / "tax-office", range(200, 400))
    import_partition(tmp_path / "tax-office", tmp_path / "part", department="tax-office", schema=schema)
    repo = Repository(connect(f"sqlite:///{tmp_path / 'state.db'}", migrate=True))
    run = repo.create_run(flower_run_id=5, config={"task": "image", "model": "mlp", "task-schema": json.dumps(schema)},
                          strategy="fedavg", num_rounds=1)
    stored = ModelStore(tmp_path / "models").save(model_to_arrays(build_model("mlp", (1, 8, 8), 10)), "r1")
    version = repo.add_model_version(run_id=run.id, round_number=1, parent_id=None, architecture="mlp:1x8x8:10",
                                     path=str(stored.path), sha256=stored.sha256, size_bytes=stored.size_bytes,
                                     metrics={})
    return repo, version.id, schema, tmp_path / "part"


def test_a_model_of_departments_own_images_calibrates_on_a_partition_of_its_schema(tmp_path: Path) -> None:
    """The server holds none of the departments' images: without a partition the export is refused
    (it must not calibrate on the built-in digits), a partition of another schema is refused naming
    the difference, and a partition of the run's schema is what QAT fine-tunes and measures on."""
    from quorumfl.errors import DataError
    from tests.core.city_data import write_digit_folder

    repo, version, schema, part = _folder_run(tmp_path)
    with pytest.raises(EdgeError, match="departments' own data .* pass --partition"):
        promote_to_edge(repo, version, home=tmp_path, channel=Channel("stable"))
    write_digit_folder(tmp_path / "other", range(60))
    other_schema = {**propose_schema(tmp_path / "other", "image", {}), "classes": [str(c) for c in range(11)]}
    (tmp_path / "other" / "10").mkdir()
    import_partition(tmp_path / "other", tmp_path / "other-part", department="other", schema=other_schema)
    with pytest.raises(DataError, match="does not fit the run's schema"):
        promote_to_edge(repo, version, home=tmp_path, channel=Channel("stable"), partition=tmp_path / "other-part")
    assert not registry_root(tmp_path).exists()

    # what QAT then runs on (the QAT and export themselves: tests/edge/test_qat.py)
    calibration = calibration_for(dict(repo.get_run(repo.get_model_version(version).run_id).config), partition=part)
    mine = read_partition(part)
    np.testing.assert_array_equal(calibration.x_train, mine.train.x)
    np.testing.assert_array_equal(calibration.y_eval, mine.test.y)
    assert "tax-office" in calibration.source


def test_the_cli_exports_a_text_model_and_a_device_predicts_with_it(tmp_path: Path) -> None:
    """As an admin and a device would: INT8 is refused in one line (exit 10) naming the fix, the
    dynamic export is published with its measured metric, a device syncs it and predicts a
    department's test split, reporting the same accuracy as the model on those examples."""
    from quorumfl.edge.service import start_server
    from quorumfl.edge.signing import public_key_path
    from quorumfl.server.state.artifacts import ArtifactRecords
    from tests.server.test_cli import quorumfl

    repo, version, model, part = _text_version(tmp_path)
    db, home = f"sqlite:///{tmp_path / 'state.db'}", str(tmp_path / "home")
    refused = quorumfl("--home", home, "models", "promote", str(version), "--edge", "--partition", str(part), db=db)
    assert refused.returncode == 10
    assert len(refused.stderr.strip().splitlines()) == 1 and "--precision dynamic" in refused.stderr
    done = quorumfl("--home", home, "models", "promote", str(version), "--edge", "--precision", "dynamic",
                    "--partition", str(part), db=db)
    assert done.returncode == 0, done.stderr
    assert "accuracy: fp32 model" in done.stdout and "dynamic artifact (onnxruntime)" in done.stdout
    listed = json.loads(quorumfl("--home", home, "edge", "artifacts", "list", "--format", "json", db=db).stdout)
    assert [(r["format"], r["precision"], r["metric"]) for r in listed] == [("onnx", "dynamic", "accuracy")]

    server = start_server(ArtifactRecords(repo.sessions))
    try:
        key = str(public_key_path(tmp_path / "home" / "edge" / "signing-key.pem"))
        synced = quorumfl("edge", "sync", "--server", f"127.0.0.1:{server.port}", "--dir", str(tmp_path / "device"),
                          "--public-key", key)
        assert synced.returncode == 0, synced.stderr
    finally:
        server.stop()
    shown = quorumfl("edge", "predict", "--dir", str(tmp_path / "device"), "--input", str(part), "--samples", "40",
                     "--format", "json")
    assert shown.returncode == 0, shown.stderr
    view = json.loads(shown.stdout)
    test = read_partition(part).test
    with torch.no_grad():
        expected = model(torch.from_numpy(test.x[:40])).argmax(1).numpy()
    assert view["labels"] == test.y[:40].tolist() and view["precision"] == "dynamic"
    assert np.mean(np.asarray(view["predicted"]) == expected) >= 0.95  # INT8 weights: nearly the same choices
    assert view["accuracy"] == pytest.approx(float(np.mean(np.asarray(view["predicted"]) == test.y[:40])))
    no_input = quorumfl("edge", "predict", "--dir", str(tmp_path / "device"))
    assert no_input.returncode != 0 and "--input" in no_input.stderr


def test_weights_of_inputs_a_table_model_never_reads_are_zeroed_and_no_output_changes(tmp_path: Path) -> None:
    """A category slot below its floor is read as 0 by ``Standardize`` whatever the row holds, so the
    first layer's column for it is dead weight: zeroing it must change no output, even for rows that
    set that slot, and the INT8 artifact then holds those zeros (its download shrinks by them)."""
    from quorumfl.edge.delta import encode
    from quorumfl.edge.export import onnx_bytes
    from quorumfl.edge.qat import QatSettings, quantize_aware, zero_unread_inputs

    source = write_csv(tmp_path / "sales.csv", property_rows(400, seed=5))
    schema = propose_schema(source, "tabular", {"label": "sale_price", "ignore": "parcel,band"})
    import_partition(source, tmp_path / "part", department="assessor", schema=schema)
    data = read_partition(tmp_path / "part").train
    spec = ModelSpec("tabular", "mlp", json.dumps(schema, sort_keys=True))
    model = spec.build(seed=0)
    untouched = spec.build(seed=0)
    assert zero_unread_inputs(untouched) == 0  # statistics not set yet: every input is read
    stats = find_statistics(model)
    assert stats is not None
    stats.set_statistics(torch.from_numpy(data.x))
    stats.floor[:3] = 2.0  # three more slots that no federation could hold often enough (a mean is at most 1)
    unread = ~stats.kept()
    assert int(unread.sum()) >= 3
    first = model[1]
    assert isinstance(first, torch.nn.Linear) and bool((first.weight[:, unread] != 0).all())
    zeroed = copy.deepcopy(model)
    model.eval()
    zeroed.eval()
    assert zero_unread_inputs(zeroed) == int(unread.sum()) * first.out_features
    assert zero_unread_inputs(zeroed) == 0  # idempotent
    assert bool((zeroed[1].weight[:, unread] == 0).all()) and bool((zeroed[1].weight[:, ~unread] == first.weight[:, ~unread]).all())
    rows = torch.from_numpy(np.random.default_rng(0).uniform(-1, 1, (64, data.x.shape[1])).astype(np.float32))
    with torch.no_grad():
        assert torch.equal(model(rows), zeroed(rows))  # exactly: those columns only ever met zeros
    # the INT8 path zeroes them itself, before QAT: the converted graph's first weight has those zero columns
    quantized = quantize_aware(model, data.x, data.y, data.input_shape, objective=spec.objective(),
                               settings=QatSettings(epochs=1, batch_size=32, seed=0))
    weights = [b for b in quantized.module.buffers() if b.dim() == 2 and b.shape[1] == data.x.shape[1]]
    assert len(weights) == 1 and bool((weights[0][:, unread] == 0).all())
    # and the fp32 download with the zeros is smaller than without
    example = torch.from_numpy(data.x[:2])
    assert len(encode(onnx_bytes(zeroed, example), b"")) < len(encode(onnx_bytes(model, example), b""))


def test_a_standardize_layer_that_does_not_match_its_linear_layer_is_refused() -> None:
    from quorumfl.core.tasks.modules import Standardize
    from quorumfl.edge.qat import zero_unread_inputs

    model = torch.nn.Sequential(Standardize(5, torch.zeros(5)), torch.nn.Linear(4, 2))
    with pytest.raises(EdgeError, match="5 features feeds a Linear layer of 4 inputs"):
        zero_unread_inputs(model)
