"""QAT round trip on digits: fp32 -> QAT (pt2e, per-channel INT8) -> ONNX in onnxruntime and ExecuTorch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quorumfl.core.data.datasets import holdout_split
from quorumfl.edge.export import ArtifactFormat, onnx_bytes, pte_bytes
from quorumfl.edge.qat import WEIGHT_QMAX, QatSettings, accuracy, quantize_aware
from quorumfl.edge.runtime import load_model
from quorumfl.errors import ConfigError, EdgeError

from .conftest import train_digits_mlp


def _model_and_halves() -> tuple[torch.nn.Module, np.ndarray, np.ndarray, np.ndarray, np.ndarray, float]:
    """A trained fp32 model, the server's held-out split halved into QAT (x, y) and measure (x, y)
    sets, and the model's accuracy on the latter."""
    model, _ = train_digits_mlp()
    _, held_out = holdout_split("digits", seed=0)
    order = np.random.default_rng(0).permutation(len(held_out))
    tune, measure = np.sort(order[: len(order) // 2]), np.sort(order[len(order) // 2 :])
    x_eval, y_eval = held_out.x[measure], held_out.y[measure]
    return model, held_out.x[tune], held_out.y[tune], x_eval, y_eval, accuracy(model, x_eval, y_eval)


def test_qat_round_trip_keeps_accuracy_within_one_point() -> None:
    # Prepare: a trained fp32 model and the server's held-out split, halved into QAT and measure sets
    model, x_tune, y_tune, x_eval, y_eval, fp32 = _model_and_halves()

    # Execute
    quantized = quantize_aware(model, x_tune, y_tune, (1, 8, 8), settings=QatSettings(epochs=2))
    exported = onnx_bytes(quantized.module, quantized.example)
    onnx_model = load_model(exported, ArtifactFormat.ONNX, (1, 8, 8))
    int8_logits = onnx_model(x_eval)
    pte_model = load_model(pte_bytes(quantized.module, quantized.example), ArtifactFormat.PTE, (1, 8, 8))

    # Assert: within one point of fp32, and the three INT8 executions agree with each other
    int8 = float(np.mean(int8_logits.argmax(1) == y_eval))
    assert int8 >= fp32 - 0.01, (fp32, int8)
    reference = quantized(torch.from_numpy(x_eval)).numpy()
    assert np.mean(reference.argmax(1) == int8_logits.argmax(1)) >= 0.99
    pte_logits = pte_model(x_eval[:32])
    assert np.mean(pte_logits.argmax(1) == int8_logits[:32].argmax(1)) >= 0.95
    # the ONNX graph runs on INT8 weights: every weight initializer of a Gemm is int8
    import onnx

    proto = onnx.load_from_string(exported)
    int8_weights = [i for i in proto.graph.initializer if i.data_type == onnx.TensorProto.INT8 and len(i.dims) == 2]
    assert len(int8_weights) == 3  # the three Linear layers' weights
    # in 7 bits of range, so onnxruntime's INT8 GEMM on an AVX2-only CPU cannot saturate (qat.WEIGHT_QMAX)
    from onnx import numpy_helper

    peaks = [int(np.abs(numpy_helper.to_array(i).astype(np.int32)).max()) for i in int8_weights]
    assert max(peaks) == WEIGHT_QMAX, peaks
    scales = [i for i in proto.graph.initializer if i.data_type == onnx.TensorProto.FLOAT and len(i.dims) == 1]
    assert {tuple(s.dims) for s in scales} >= {(128,), (64,), (10,)}  # per-channel scales


def test_onnx_artifact_takes_any_batch_size() -> None:
    model, _ = train_digits_mlp(epochs=1)
    x = holdout_split("digits", seed=0)[1].x
    quantized = quantize_aware(model, x[:64], np.zeros(64, dtype=np.int64), (1, 8, 8), settings=QatSettings(epochs=0))
    runner = load_model(onnx_bytes(quantized.module, quantized.example), ArtifactFormat.ONNX, (1, 8, 8))
    for n in (1, 3, 64, 300):
        assert runner(x[:n]).shape == (n, 10)


def test_bad_inputs_are_refused_with_the_fix() -> None:
    model, _ = train_digits_mlp(epochs=1)
    x = np.zeros((8, 1, 8, 8), np.float32)
    with pytest.raises(EdgeError, match="shape"):
        quantize_aware(model, np.zeros((8, 1, 28, 28), np.float32), np.zeros(8, np.int64), (1, 8, 8))
    with pytest.raises(EdgeError, match="labels"):
        quantize_aware(model, x, np.zeros(7, np.int64), (1, 8, 8))
    bad = x.copy()
    bad[0, 0, 0, 0] = np.nan
    with pytest.raises(EdgeError, match="NaN"):
        quantize_aware(model, bad, np.zeros(8, np.int64), (1, 8, 8))
    with pytest.raises(ConfigError, match="batch_size=0.*learning_rate=-1"):
        QatSettings(batch_size=0, learning_rate=-1)


def test_a_pruned_int8_artifact_keeps_its_zeros_matches_its_graph_and_downloads_smaller() -> None:
    import zlib

    from quorumfl.edge.qat import weight_sparsity

    model, x_tune, y_tune, x_eval, y_eval, fp32 = _model_and_halves()
    files, accuracies = {}, {}
    for sparsity in (0.0, 0.6):
        quantized = quantize_aware(model, x_tune, y_tune, (1, 8, 8), settings=QatSettings(epochs=2, sparsity=sparsity))
        # every weight matrix of the INT8 graph holds the pruned share of exact zeros, kept through QAT
        # (plus the few small weights that round to zero in INT8 anyway)
        layers = [b for b in quantized.module.buffers() if b.dim() >= 2]
        assert layers and all(sparsity - 0.001 <= weight_sparsity([b]) < sparsity + 0.05 for b in layers), \
            [weight_sparsity([b]) for b in layers]
        files[sparsity] = onnx_bytes(quantized.module, quantized.example)
        logits = load_model(files[sparsity], ArtifactFormat.ONNX, (1, 8, 8))(x_eval)
        reference = quantized(torch.from_numpy(x_eval)).numpy()  # the INT8 graph in torch
        assert np.mean(reference.argmax(1) == logits.argmax(1)) >= 0.99
        accuracies[sparsity] = float(np.mean(logits.argmax(1) == y_eval))
    assert accuracies[0.6] >= fp32 - 0.02, (fp32, accuracies)
    assert len(zlib.compress(files[0.6], 9)) < 0.75 * len(zlib.compress(files[0.0], 9))
    with pytest.raises(ConfigError, match="sparsity"):
        QatSettings(sparsity=0.99)
