"""Quantisation-aware fine-tuning and INT8 conversion of a federation model, for edge devices.

The model is captured with ``torch.export`` (batch dimension dynamic), prepared for QAT by torchao's
pt2e flow with ExecuTorch's XNNPACK quantizer (symmetric INT8 per-channel weights in 7 bits of range,
``WEIGHT_QMAX``; per-tensor activations), fine-tuned on local data with fake quantisation in the loop, then converted to a graph
of real INT8 quantise/dequantise ops that the ONNX and ExecuTorch exporters lower to INT8 kernels.
Nothing here is written by hand that torchao provides; the pt2e steps themselves live in
``quorumfl.training.qat`` (shared with the departments' federated QAT rounds), and this module
checks the server-side inputs and wires them together. With ``sparsity`` (``QatSettings``), each Linear/Conv weight first loses that
fraction of its smallest-magnitude entries (torch's ``prune.l1_unstructured``), and the zeros are
kept through fine-tuning, so the INT8 weights hold the same zeros and the artifact compresses
(``quorumfl.edge.delta``: downloads are zlib streams). Whatever the sparsity, ``zero_unread_inputs``
first zeroes the weights of inputs the model never reads (a table model's category slots that its
``Standardize`` layer reads as 0: most of a one-hot table's first layer), which changes no output
and leaves each output channel's INT8 scale to the weights that count. The loss is the task's objective (cross-entropy for classes, squared error for a
regression target), so a table model fine-tunes as it was trained. No I/O.

A model whose arithmetic is mostly a lookup (``nn.Embedding``/``nn.EmbeddingBag``: the text task's
hashed n-gram bag) has no INT8 kernel in XNNPACK or onnxruntime: pt2e would store its table in INT8
and dequantise all of it on every call. ``int8_obstacle`` names such a layer, so the export refuses
INT8 for it and offers dynamic quantisation (INT8 weights, ``quorumfl.edge.export``) or fp32.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray
from torch import nn

from quorumfl.core.tasks.modules import Standardize
from quorumfl.core.tasks.objective import CLASSIFICATION, Objective
from quorumfl.errors import ConfigError, EdgeError
from quorumfl.training import qat
from quorumfl.training.qat import MAX_BATCH, WEIGHT_QMAX, int8_obstacle

__all__ = ["MAX_BATCH", "MAX_SPARSITY", "WEIGHT_QMAX", "QatSettings", "QuantizedModel", "accuracy", "evaluate",
           "int8_obstacle", "prune_by_magnitude", "quantize_aware", "weight_sparsity", "zero_unread_inputs"]


@dataclass(frozen=True)
class QatSettings:
    """How to fine-tune with fake quantisation before conversion."""

    epochs: int = 2
    batch_size: int = 32
    learning_rate: float = 0.005
    momentum: float = 0.9
    seed: int = 0
    sparsity: float = 0.0  # fraction of each Linear/Conv weight pruned by magnitude before QAT (0: none)

    def __post_init__(self) -> None:
        problems = []
        if not 0 <= self.sparsity <= MAX_SPARSITY:
            problems.append(f"sparsity={self.sparsity} must be in [0, {MAX_SPARSITY}] (the fraction of weights zeroed)")
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


MAX_SPARSITY = 0.95
_PRUNED: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv1d, nn.Conv2d)


def prune_by_magnitude(model: nn.Module, sparsity: float) -> None:
    """Zero the ``sparsity`` fraction of smallest-magnitude weights of every Linear/Conv layer, each
    layer on its own (torch's ``l1_unstructured``, made permanent). Biases are kept."""
    from torch.nn.utils import prune

    if sparsity <= 0:
        return
    for module in model.modules():
        if isinstance(module, _PRUNED):
            prune.l1_unstructured(module, "weight", amount=sparsity)  # type: ignore[no-untyped-call]
            prune.remove(module, "weight")  # type: ignore[no-untyped-call]


def zero_unread_inputs(model: nn.Module) -> int:
    """Zero, in place, the weights of inputs ``model`` never reads; return how many were zeroed.

    A ``Standardize`` layer outputs 0 for every feature below its floor (a category slot too rare
    in the federation, ``Standardize.kept``), whatever the input, so the ``Linear`` right after it
    (in an ``nn.Sequential``) multiplies those columns by 0 on every call: zeroing them changes no
    output. Training never moves them either (their gradient is 0), so they keep their random
    initial values. Zeroed, they cost an INT8 download almost nothing (zlib), and no longer widen
    their rows' per-channel INT8 scales. A model whose statistics are not yet set reads everything."""
    zeroed = 0
    for container in model.modules():
        if not isinstance(container, nn.Sequential):
            continue
        layers = list(container)
        for first, second in zip(layers, layers[1:], strict=False):
            if isinstance(first, Standardize) and isinstance(second, nn.Linear):
                unread = ~first.kept()
                if unread.shape != (second.in_features,):
                    raise EdgeError(f"a Standardize layer of {unread.numel()} features feeds a Linear layer of "
                                    f"{second.in_features} inputs; the model is inconsistent")
                with torch.no_grad():
                    zeroed += int((second.weight[:, unread] != 0).sum())
                    second.weight[:, unread] = 0.0
    return zeroed


def weight_sparsity(parameters: Iterable[torch.Tensor]) -> float:
    """Fraction of exact zeros among the weight matrices and kernels (tensors of 2 or more dims)."""
    zeros = total = 0
    for tensor in parameters:
        if tensor.dim() >= 2:
            zeros += int((tensor == 0).sum())
            total += tensor.numel()
    return zeros / total if total else 0.0


@dataclass(frozen=True)
class QuantizedModel:
    """An INT8 graph (``torch.fx.GraphModule`` from ``convert_pt2e``) and an example input batch."""

    module: torch.fx.GraphModule
    example: torch.Tensor

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out: torch.Tensor = self.module(x)
        return out


def _check_data(model_shape: tuple[int, ...], x: NDArray[Any], y: NDArray[Any]) -> None:
    if x.ndim != len(model_shape) + 1 or len(x) == 0:
        raise EdgeError(f"QAT data must be a non-empty (N, {', '.join(map(str, model_shape))}) array, got shape {x.shape}")
    if tuple(x.shape[1:]) != model_shape:
        raise EdgeError(f"QAT data has samples of shape {tuple(x.shape[1:])}, the model takes {model_shape}; "
                        "use the dataset the model was trained on")
    if y.shape != (len(x),):
        raise EdgeError(f"QAT labels have shape {y.shape}, expected ({len(x)},)")
    if x.dtype.kind == "f" and not np.isfinite(x).all():
        raise EdgeError("QAT data contains NaN or Inf values")


def _tensor(a: NDArray[Any]) -> torch.Tensor:
    """Float inputs/targets as float32, integer ones (token ids, class indices) as int64."""
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64 if a.dtype.kind in "iu" else np.float32))


def quantize_aware(
    model: nn.Module,
    x: NDArray[Any],
    y: NDArray[Any],
    input_shape: tuple[int, ...],
    *,
    objective: Objective = CLASSIFICATION,
    settings: QatSettings | None = None,
) -> QuantizedModel:
    """Fine-tune ``model`` (left unchanged) with fake quantisation on ``(x, y)`` under the task's
    objective, then convert to INT8."""
    settings = settings or QatSettings()
    _check_data(tuple(input_shape), x, y)
    obstacle = int8_obstacle(model)
    if obstacle:
        raise EdgeError(f"the model cannot be quantised to INT8: {obstacle}; export it with dynamic quantisation "
                        "(--precision dynamic: INT8 weights, onnxruntime) or as fp32 (--precision fp32)")
    features, labels = _tensor(x), _tensor(y)
    example = features[: min(len(features), settings.batch_size)].clone()
    source = _copy_eval(model)
    zero_unread_inputs(source)
    prune_by_magnitude(source, settings.sparsity)
    prepared = qat.prepare(source, example)
    # Pruned weights stay zero through fine-tuning: re-zeroed after every step (an exact zero
    # quantises to INT8 zero, so the converted graph keeps the sparsity).
    qat.fine_tune(prepared, features, labels, objective, epochs=settings.epochs, batch_size=settings.batch_size,
                  learning_rate=settings.learning_rate, momentum=settings.momentum, seed=settings.seed,
                  keep_zeros=settings.sparsity > 0)
    converted = qat.convert(prepared)
    return QuantizedModel(converted, example[:2].clone() if len(example) > 1 else torch.cat([example, example]))


def _copy_eval(model: nn.Module) -> nn.Module:
    import copy

    clone = copy.deepcopy(model).cpu()
    clone.eval()
    return clone


def evaluate(predict: Callable[[torch.Tensor], torch.Tensor], x: NDArray[Any], y: NDArray[Any],
             objective: Objective = CLASSIFICATION, *, batch_size: int = 512) -> dict[str, float]:
    """The objective's metrics (its primary one included) of a callable mapping an input batch to
    outputs: a torch module, an INT8 graph, or an edge runtime wrapped to take tensors."""
    if len(x) == 0:
        raise EdgeError("measuring a model needs at least one sample")
    with torch.no_grad():
        return objective.measure(lambda batch: predict(batch).float(), _tensor(x), _tensor(y), batch_size=batch_size)


def accuracy(predict: Callable[[torch.Tensor], torch.Tensor], x: NDArray[Any], y: NDArray[Any], *,
             batch_size: int = 512) -> float:
    """Top-1 accuracy of a callable mapping a batch to class logits."""
    return evaluate(predict, x, y, CLASSIFICATION, batch_size=batch_size)["accuracy"]
