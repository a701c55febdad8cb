"""Federated QAT's building blocks (``quorumfl.training.qat``) against references computed here: the
affine INT8 parameters a range must give, the symmetric per-channel scales of the weights themselves,
asinh encoding round trips, and the refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quorumfl.core.models import QAT_PREFIX, build_model
from quorumfl.core.tasks import CLASSIFICATION
from quorumfl.errors import ConfigError, EdgeError
from quorumfl.training import qat

QUANTIZE = "quantized_decomposed.quantize_per_tensor.default"
DEQUANTIZE_CHANNEL = "quantized_decomposed.dequantize_per_channel.default"


def _affine(low: float, high: float) -> tuple[float, int]:
    """torch's per-tensor affine INT8 parameters for an observed (min, max): the range widened to hold
    0, 255 steps, the zero point where 0 lands."""
    low, high = min(low, 0.0), max(high, 0.0)
    scale = max((high - low) / 255.0, float(torch.finfo(torch.float32).eps))
    return scale, int(np.clip(-128 - round(low / scale), -128, 127))


def _activation_params(graph: torch.fx.GraphModule) -> list[tuple[float, int]]:
    return [(float(n.args[1]), int(n.args[2])) for n in graph.graph.nodes
            if n.op == "call_function" and str(n.target) == QUANTIZE]


def test_a_federations_ranges_are_the_int8_graphs_activation_parameters_and_weights_are_measured_afresh() -> None:
    """``calibrated``: every activation quantiser of the INT8 graph takes its scale and zero point from
    the given ranges (the input's from its own), and each weight's per-channel scale is its own
    largest magnitude over 63, measured on the weights handed in (not on ranges seen in training)."""
    model = build_model("cnn", (1, 8, 8), 10, seed=4)
    example = torch.rand(4, 1, 8, 8)
    names = list(qat.activation_ranges(qat.prepare(model, example)))
    ranges = {name: (-0.5 - 0.25 * i, 1.5 + i) for i, name in enumerate(names)}
    graph = qat.calibrated(model, example, ranges)

    params = _activation_params(graph)
    expected = [_affine(*r) for r in ranges.values()]
    assert params and params[0] == pytest.approx(expected[0])  # the input's quantiser: the first observer
    for scale, zero in params:
        assert any(scale == pytest.approx(s, rel=1e-6) and zero == z for s, z in expected)

    weights = [p.detach().numpy() for n, p in model.named_parameters() if p.dim() >= 2]
    scales = [getattr(graph, str(n.args[1].target)).numpy() for n in graph.graph.nodes
              if n.op == "call_function" and str(n.target) == DEQUANTIZE_CHANNEL]
    assert len(scales) == len(weights)
    for w, s in zip(weights, scales, strict=True):
        np.testing.assert_allclose(s, np.abs(w.reshape(len(w), -1)).max(axis=1) / qat.WEIGHT_QMAX, rtol=1e-6)


def test_ranges_read_from_a_fine_tuned_graph_and_written_into_a_fresh_one_give_the_same_activation_parameters() -> None:
    """A department's observers after fine-tuning, read out, encoded as they travel and decoded, then
    written into the server's fresh graph: the converted graph quantises activations exactly as the
    department's own conversion does."""
    torch.manual_seed(0)
    model = build_model("mlp", (1, 8, 8), 10, seed=1)
    x, y = torch.rand(96, 1, 8, 8), torch.randint(0, 10, (96,))
    from quorumfl.core.tasks.objective import CLASSIFICATION

    prepared = qat.prepare(model, x[:4])
    qat.fine_tune(prepared, x, y, CLASSIFICATION, epochs=2, batch_size=16, learning_rate=0.05, momentum=0.9, seed=0)
    travelled = qat.decode_ranges(qat.encode_ranges(qat.activation_ranges(prepared)))
    own = _activation_params(qat.convert(prepared))
    qat.load_trained(prepared, model)
    fresh = _activation_params(qat.calibrated(model, x[:4], travelled))
    assert len(own) == len(fresh)
    for (s1, z1), (s2, z2) in zip(own, fresh, strict=True):
        assert s2 == pytest.approx(s1, rel=1e-5) and abs(z1 - z2) <= 1  # float32 asinh round trip


@settings(max_examples=60, deadline=None)
@given(st.floats(-4e6, 4e6, allow_nan=False), st.floats(0, 4e6, allow_nan=False))
def test_ranges_travel_within_one_and_come_back(low: float, width: float) -> None:
    high = min(low + width, 4e6)
    [(key, value)] = qat.encode_ranges({"activation_post_process_0": (low, high)}).items()
    assert key == QAT_PREFIX + "activation_post_process_0" and value.dtype == np.float32
    assert np.all(np.abs(value) <= 1.0)
    back_low, back_high = qat.decode_ranges({key: value})["activation_post_process_0"]
    for got, want in ((back_low, low), (back_high, high)):
        assert abs(got - want) <= 2e-6 * max(1.0, abs(want)) * 16  # float32's step in asinh space, ×16


def test_what_does_not_fit_is_refused() -> None:
    with pytest.raises(EdgeError, match="beyond the ±4.4e6"):
        qat.encode_ranges({"activation_post_process_0": (0.0, 1e7)})
    with pytest.raises(ConfigError, match="expected 2"):
        qat.decode_ranges({QAT_PREFIX + "activation_post_process_0": np.zeros(3, dtype=np.float32)})
    model = build_model("mlp", (1, 8, 8), 10)
    prepared = qat.prepare(model, torch.rand(2, 1, 8, 8))
    names = list(qat.activation_ranges(prepared))
    with pytest.raises(EdgeError, match="do not fit"):
        qat.set_activation_ranges(prepared, {n: (0.0, 1.0) for n in names[1:]}, freeze=True)
    with pytest.raises(EdgeError, match="not a finite interval"):
        qat.set_activation_ranges(prepared, {n: (1.0, 0.0) for n in names}, freeze=True)
    with pytest.raises(ConfigError, match="table lookup"):
        qat.range_template(torch.nn.Sequential(torch.nn.Embedding(10, 4)), (3,))


@pytest.mark.slow
def test_a_version_from_federated_qat_is_promoted_with_its_ranges_and_the_artifact_matches_its_reference(
    tmp_path: Path,
) -> None:
    """``models promote --edge`` of a version that carries federated QAT ranges: no fine-tuning on the
    server; the ONNX artifact predicts what the reference INT8 graph built from the version's weights
    and ranges predicts (≥ 99 % argmax agreement on the held-out set), close to the fp32 model; and
    --sparsity, which would fine-tune on the server, is refused for it."""
    from quorumfl.core.data.datasets import holdout_split
    from quorumfl.core.models import model_to_arrays
    from quorumfl.core.tasks.objective import CLASSIFICATION
    from quorumfl.edge.export import ArtifactFormat
    from quorumfl.edge.manifest import Channel
    from quorumfl.edge.promotion import promote_to_edge
    from quorumfl.edge.qat import QatSettings
    from quorumfl.edge.registry import Registry
    from quorumfl.edge.runtime import load_model
    from quorumfl.server.model_store import ModelStore
    from quorumfl.server.state.database import connect
    from quorumfl.server.state.repository import Repository

    from .conftest import train_digits_mlp

    model, fp32_acc = train_digits_mlp(epochs=6)
    pool, test = holdout_split("digits", seed=0)
    prepared = qat.prepare(model, torch.from_numpy(pool.x[:4]))  # a department's observers over its own data
    qat.fine_tune(prepared, torch.from_numpy(pool.x), torch.from_numpy(pool.y), CLASSIFICATION, epochs=0,
                  batch_size=64, learning_rate=0.01, momentum=0.9, seed=0)
    ranges = qat.activation_ranges(prepared)

    repo = Repository(connect(f"sqlite:///{tmp_path / 'state.db'}", migrate=True))
    run = repo.create_run(flower_run_id=None, config={"dataset": "digits", "seed": 0, "model": "mlp", "qat-rounds": 1},
                          strategy="fedavg", num_rounds=2)
    stored = ModelStore(tmp_path / "models").save({**model_to_arrays(model), **qat.encode_ranges(ranges)}, "run1-round2")
    version = repo.add_model_version(run_id=run.id, round_number=2, parent_id=None, architecture="mlp:1x8x8:10",
                                     path=str(stored.path), sha256=stored.sha256, size_bytes=stored.size_bytes,
                                     metrics={})
    with pytest.raises(ConfigError, match="drop --sparsity"):
        promote_to_edge(repo, version.id, home=tmp_path, channel=Channel.STABLE, settings=QatSettings(sparsity=0.5),
                        formats=(ArtifactFormat.ONNX,))
    rows, calibration, _ = promote_to_edge(repo, version.id, home=tmp_path, channel=Channel.STABLE,
                                           formats=(ArtifactFormat.ONNX,))
    assert "federated QAT" in calibration.source

    reference = qat.calibrated(model, torch.from_numpy(pool.x[:2]), qat.decode_ranges(qat.encode_ranges(ranges)))
    with torch.no_grad():
        expected = reference(torch.from_numpy(test.x)).argmax(1).numpy()
    runner = load_model(Registry.payload(rows[0]), ArtifactFormat.ONNX, (1, 8, 8), input_dtype="float32")
    got = np.asarray(runner(test.x)).argmax(1)
    assert float((got == expected).mean()) >= 0.99
    assert float((got == test.y).mean()) >= fp32_acc - 0.03


def _fine_tuned_int8(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.fx.GraphModule:
    prepared = qat.prepare(model, x[:4])
    qat.fine_tune(prepared, x, y, CLASSIFICATION, epochs=1, batch_size=16, learning_rate=0.05, momentum=0.9, seed=2)
    return qat.convert(prepared)


def test_a_graph_without_dropout_or_batch_norm_converts_to_the_int8_graph_of_torchaos_full_pass(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The conv-bn patterns and the train/eval rewrites that ``prepare``, ``fine_tune`` and ``convert``
    skip for such a graph (every model the tasks build) change nothing: the INT8 graph's code and its
    outputs equal those of torchao's full pass, forced here by making every graph look as if it held
    both ops."""
    torch.manual_seed(5)
    x, y = torch.rand(48, 1, 8, 8), torch.randint(0, 10, (48,))
    model = build_model("cnn", (1, 8, 8), 10, seed=5)
    probe = qat.prepare(model, x[:4])
    assert not qat._has_op(probe, "batch_norm", "dropout")
    skipped = _fine_tuned_int8(model, x, y)
    monkeypatch.setattr(qat, "_has_op", lambda _graph, *_names: True)
    full = _fine_tuned_int8(model, x, y)
    assert skipped.code == full.code
    with torch.no_grad():
        assert torch.equal(skipped(x), full(x))


def _training_flags(graph: torch.fx.GraphModule) -> dict[str, bool]:
    """The ``training`` argument of each dropout and batch-norm call in an exported graph."""
    return {str(n.target): bool(n.args[2] if "dropout" in str(n.target) else n.args[5]) for n in graph.graph.nodes
            if n.op == "call_function" and ("dropout" in str(n.target) or "batch_norm" in str(n.target))}


@pytest.mark.slow  # torchao's full pass with conv-bn patterns: ~20 s
def test_dropout_and_batch_norm_still_switch_between_training_and_eval() -> None:
    """A graph that holds them takes torchao's rewrites: both ops train in ``fine_tune``'s mode and not
    in eval, batch norm is folded into the INT8 graph's convolution, and that graph is deterministic."""
    torch.manual_seed(6)
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Dropout(0.5), torch.nn.Linear(4 * 6 * 6, 10))
    x = torch.rand(48, 1, 8, 8)
    prepared = qat.prepare(model, x[:4])
    qat._set_mode(prepared, train=True)
    assert _training_flags(prepared) == {"aten.batch_norm.default": True, "aten.dropout.default": True}
    with torch.no_grad():
        assert not torch.equal(prepared(x), prepared(x))  # dropout drops at random
    qat._set_mode(prepared, train=False)
    assert _training_flags(prepared) == {"aten.batch_norm.default": False, "aten.dropout.default": False}
    graph = qat.convert(prepared)
    assert _training_flags(graph) == {"aten.dropout.default": False}
    with torch.no_grad():
        assert torch.equal(graph(x), graph(x))
