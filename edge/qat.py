"""Quantisation-aware fine-tuning and INT8 conversion of a federation model, for edge devices.

The model is captured with ``torch.export`` (batch dimension dynamic), prepared for QAT by torchao's
pt2e flow with ExecuTorch's XNNPACK quantizer (symmetric INT8, per-channel weights, per-tensor
activations), fine-tuned on local data with fake quantisation in the loop, then converted to a graph
of real INT8 quantise/dequantise ops that the ONNX and ExecuTorch exporters lower to INT8 kernels.
Nothing here is written by hand that torchao provides; this module only wires the steps together and
checks its inputs. No I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from numpy.typing import NDArray
from torch import nn

from quorumfl.errors import ConfigError, EdgeError

__all__ = ["QatSettings", "QuantizedModel", "accuracy", "quantize_aware"]

# Largest batch the exported graph accepts; torch.export needs a bound for the symbolic dimension.
MAX_BATCH = 4096


@dataclass(frozen=True)
class QatSettings:
    """How to fine-tune with fake quantisation before conversion."""

    epochs: int = 2
    batch_size: int = 32
    learning_rate: float = 0.005
    momentum: float = 0.9
    seed: int = 0

    def __post_init__(self) -> None:
        problems = []
        if self.epochs < 0:
            problems.append(f"epochs={self.epochs} must be >= 0 (0 = calibrate only, no fine-tuning)")
        if self.batch_size < 1:
            problems.append(f"batch_size={self.batch_size} must be >= 1")
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            problems.append(f"learning_rate={self.learning_rate} must be a positive number")
        if not 0 <= self.momentum < 1:
            problems.append(f"momentum={self.momentum} must be in [0, 1)")
        if problems:
            raise ConfigError("QAT settings: " + "; ".join(problems))


@dataclass(frozen=True)
class QuantizedModel:
    """An INT8 graph (``torch.fx.GraphModule`` from ``convert_pt2e``) and an example input batch."""

    module: torch.fx.GraphModule
    example: torch.Tensor

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out: torch.Tensor = self.module(x)
        return out


def _check_data(model_shape: tuple[int, ...], x: NDArray[np.float32], y: NDArray[np.int64]) -> None:
    if x.ndim != 4 or len(x) == 0:
        raise EdgeError(f"QAT data must be a non-empty (N, C, H, W) array, got shape {x.shape}")
    if tuple(x.shape[1:]) != model_shape:
        raise EdgeError(f"QAT data has samples of shape {tuple(x.shape[1:])}, the model takes {model_shape}; "
                        "use the dataset the model was trained on")
    if y.shape != (len(x),):
        raise EdgeError(f"QAT labels have shape {y.shape}, expected ({len(x)},)")
    if not np.isfinite(x).all():
        raise EdgeError("QAT data contains NaN or Inf values")


def _batches(n: int, batch_size: int, generator: torch.Generator) -> list[torch.Tensor]:
    order = torch.randperm(n, generator=generator)
    return [order[i : i + batch_size] for i in range(0, n, batch_size)]


def quantize_aware(
    model: nn.Module,
    x: NDArray[np.float32],
    y: NDArray[np.int64],
    input_shape: tuple[int, ...],
    *,
    settings: QatSettings | None = None,
) -> QuantizedModel:
    """Fine-tune ``model`` (left unchanged) with fake quantisation on ``(x, y)``, then convert to INT8."""
    from quorumfl.edge.export import quiet

    with quiet():  # importing torchao warns about CUDA kernels a CPU wheel does not have
        from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
            XNNPACKQuantizer,
            get_symmetric_quantization_config,
        )
        from torchao.quantization.pt2e import (
            move_exported_model_to_eval,
            move_exported_model_to_train,
        )
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_qat_pt2e

    settings = settings or QatSettings()
    _check_data(tuple(input_shape), x, y)
    features = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    labels = torch.from_numpy(np.ascontiguousarray(y, dtype=np.int64))
    example = features[: min(len(features), settings.batch_size)].clone()
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    try:
        with quiet():  # torch.export's notes on deprecated internals, not ours
            captured = torch.export.export(
                _copy_eval(model), (example,), dynamic_shapes=({0: batch},)
            ).module()
            quantizer = XNNPACKQuantizer().set_global(
                get_symmetric_quantization_config(is_per_channel=True, is_qat=True)
            )
            prepared = prepare_qat_pt2e(captured, quantizer)
    except Exception as exc:  # torch.export / torchao raise many types; name the step
        raise EdgeError(f"cannot prepare the model for quantisation-aware training: {exc}") from exc

    generator = torch.Generator().manual_seed(settings.seed)
    optimizer = torch.optim.SGD(prepared.parameters(), lr=settings.learning_rate, momentum=settings.momentum)
    move_exported_model_to_train(prepared)
    for _ in range(settings.epochs):
        for index in _batches(len(features), settings.batch_size, generator):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(prepared(features[index]), labels[index])
            if not torch.isfinite(loss):
                raise EdgeError("QAT loss became NaN/Inf; lower the QAT learning rate")
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
    if settings.epochs == 0:  # calibration only: let the observers see the data once
        with torch.no_grad():
            for index in _batches(len(features), settings.batch_size, generator):
                prepared(features[index])
    move_exported_model_to_eval(prepared)
    try:
        converted = convert_pt2e(prepared)
    except Exception as exc:
        raise EdgeError(f"cannot convert the QAT model to INT8: {exc}") from exc
    move_exported_model_to_eval(converted)
    return QuantizedModel(converted, example[:2].clone() if len(example) > 1 else torch.cat([example, example]))


def _copy_eval(model: nn.Module) -> nn.Module:
    import copy

    clone = copy.deepcopy(model).cpu()
    clone.eval()
    return clone


def accuracy(predict: object, x: NDArray[np.float32], y: NDArray[np.int64], *, batch_size: int = 512) -> float:
    """Top-1 accuracy of a callable mapping a float batch to logits (torch module or INT8 graph)."""
    if len(x) == 0:
        raise EdgeError("accuracy needs at least one sample")
    correct = 0
    with torch.no_grad():
        for start in range(0, len(x), batch_size):
            batch = torch.from_numpy(np.ascontiguousarray(x[start : start + batch_size], dtype=np.float32))
            logits = predict(batch)  # type: ignore[operator]
            correct += int((logits.argmax(1).numpy() == y[start : start + batch_size]).sum())
    return correct / len(x)
