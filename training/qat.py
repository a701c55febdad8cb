"""Quantisation-aware training steps shared by the department nodes (federated QAT rounds) and the edge export.

torchao's pt2e flow does the work: ``torch.export`` captures the model (batch dimension dynamic),
``prepare_qat_pt2e`` with ExecuTorch's XNNPACK quantizer (symmetric INT8 per-channel weights in 7 bits
of range, ``WEIGHT_QMAX``; per-tensor affine activations) inserts fake-quantise modules whose
observers track each tensor's range, and ``convert_pt2e`` turns the ranges into INT8 quantise and
dequantise ops. This module wires those steps and adds the one thing torchao has no API for: the
activation observers' ranges as plain numbers, read from a prepared graph and written into one, so
that departments can fine-tune with fake quantisation on their own data and the federation can combine
what their observers saw (``qat-rounds``, docs/how-to/edge-devices.md).

torchao rewrites conv-bn, dropout and batch-norm patterns by exporting each pattern graph anew on every
call (30 ``torch.export`` calls, ~7 s of a ~10 s promotion of a digits MLP). None of the tasks' models
holds batch norm or dropout, so for a graph without them ``prepare`` leaves the XNNPACK quantizer's
conv-bn patterns out and ``fine_tune``/``convert`` skip the train/eval rewrites (``_set_mode``),
which could match nothing; the INT8 graph is the same (tests/edge/test_federated_qat.py), and a graph
with either op takes torchao's full path.

What travels in a federated QAT round, beside the model's own arrays, is one array per activation
observer under ``QAT_PREFIX`` (``encode_ranges``): its (min, max) as asinh(v)/16. The federation's
weighted mean of these arrays (plain, masked or CKKS, like any array) is then a weighted mean of the
departments' ranges in asinh space: the arithmetic mean near zero, close to the geometric mean for
ranges beyond 1, so one department's outlier cannot stretch everyone's quantisation step. Divided by
16, a range of up to ±4.4·10^6 stays within ±1, inside any secure sum's clip of at least 1, and the
first QAT round's update (from zero) is never cut. Weights need nothing sent: their per-channel ranges
are measured again on the federation's averaged weights (``calibrated``).
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray
from torch import nn

from quorumfl.core.models import QAT_PREFIX
from quorumfl.core.tasks.objective import Objective
from quorumfl.errors import ConfigError, EdgeError

__all__ = ["MAX_BATCH", "RANGE_DIVISOR", "WEIGHT_QMAX", "Ranges", "activation_ranges", "calibrated", "convert", "decode_ranges",
           "encode_ranges", "fine_tune", "int8_obstacle", "load_trained", "prepare", "quiet", "range_template",
           "set_activation_ranges"]

# Weights take 7 bits of their INT8 range (onnxruntime's "reduce_range"). On x86 CPUs without VNNI
# (AVX2 only: many edge devices) onnxruntime's INT8 GEMM multiplies with VPMADDUBSW, which adds two
# uint8 × int8 products into an int16 with saturation; with full-range weights that sum can clip.
# Seen on an AVX2-only AMD EPYC: one prediction of a table model off by 48,000 dollars (36 % of the
# target's spread) while the same graph without onnxruntime's fusions was right. 255 · 63 · 2 < 2^15.
WEIGHT_QMAX = 63

# Largest batch the exported graph accepts; torch.export needs a bound for the symbolic dimension.
MAX_BATCH = 4096

# Layers that run as table lookups: no INT8 kernel exists for them in XNNPACK or onnxruntime.
_LOOKUPS: tuple[type[nn.Module], ...] = (nn.Embedding, nn.EmbeddingBag)

# Ops whose train and eval forms differ in an exported graph: torchao rewrites them between the two
# modes with pattern graphs it exports anew on every call (~0.2 s each).
_MODE_OPS = ("dropout", "batch_norm")

RANGE_DIVISOR = 16.0  # asinh(v)/16: |v| ≤ 4.4e6 maps into [−1, 1] (module docstring)
_OBSERVER = "activation_post_process_"

Ranges = dict[str, tuple[float, float]]


# Libraries whose warnings during export are about their own internals (CUDA kernels not built into
# a CPU wheel, torchvision ops not registered, deprecated pytree hooks), not about the model.
_NOISY = ("torchao", "torch.onnx", "torch.utils._pytree", "torch.export", "torch._export", "onnxscript")


@contextmanager
def quiet() -> Iterator[None]:
    """Silence library warnings and log notes about their internals while capturing or exporting."""
    loggers = [logging.getLogger(name) for name in _NOISY]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def int8_obstacle(model: nn.Module) -> str | None:
    """The first layer of ``model`` that no INT8 kernel runs, described for the operator, or None."""
    for name, module in model.named_modules():
        if isinstance(module, _LOOKUPS):
            return f"its layer '{name}' is an {type(module).__name__} (a table lookup, which no INT8 kernel runs)"
    return None


def range_template(model: nn.Module, input_shape: tuple[int, ...]) -> dict[str, NDArray[np.float32]]:
    """The QAT range arrays the server adds to its model before the first federated QAT round: one
    per activation observer, all zero (unset), under ``QAT_PREFIX``. Refuses a model without INT8
    kernels for every layer."""
    obstacle = int8_obstacle(model)
    if obstacle:
        raise ConfigError(f"qat-rounds needs a model that INT8 runs, but {obstacle}; set qat-rounds = 0")
    prepared = prepare(model, torch.zeros((2, *input_shape), dtype=torch.float32))
    return encode_ranges({name: (0.0, 0.0) for name in _observers(prepared)[0]})


def prepare(model: nn.Module, example: torch.Tensor) -> torch.fx.GraphModule:
    """``model`` (left unchanged; a CPU copy in eval mode is captured) prepared for QAT: fake
    quantisation on every weight and activation. ``example``: a batch of at least two inputs."""
    import copy

    with quiet():  # importing torchao warns about CUDA kernels a CPU wheel does not have
        from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
            XNNPACKQuantizer,
            get_symmetric_quantization_config,
        )
        from torchao.quantization.pt2e.quantize_pt2e import prepare_qat_pt2e
    source = copy.deepcopy(model).cpu()
    source.eval()
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    try:
        with quiet():  # torch.export's notes on deprecated internals, not ours
            captured = torch.export.export(source, (example,), dynamic_shapes=({0: batch},)).module()
            quantizer = XNNPACKQuantizer().set_global(
                get_symmetric_quantization_config(is_per_channel=True, is_qat=True, weight_qmin=-WEIGHT_QMAX,
                                                  weight_qmax=WEIGHT_QMAX)
            )
            if not _has_op(captured, "batch_norm"):  # conv-bn patterns cannot match: skip exporting them
                quantizer.SUPPORTED_PATTERNS = [p for p in quantizer.SUPPORTED_PATTERNS if "_bn" not in p.name]
            prepared: torch.fx.GraphModule = prepare_qat_pt2e(captured, quantizer)
    except Exception as exc:  # torch.export / torchao raise many types; name the step
        raise EdgeError(f"cannot prepare the model for quantisation-aware training: {exc}") from exc
    return prepared


def _has_op(graph: torch.fx.GraphModule, *names: str) -> bool:
    """Whether ``graph`` calls an op whose name contains one of ``names`` (``batch_norm``, ``dropout``)."""
    return any(node.op == "call_function" and any(name in str(node.target) for name in names)
               for node in graph.graph.nodes)


def _set_mode(graph: torch.fx.GraphModule, *, train: bool) -> None:
    """torchao's ``move_exported_model_to_train`` (or ``..._to_eval``), for a graph with dropout or
    batch norm (the ops they rewrite); any other graph runs the same in both modes and is left as it is."""
    if _has_op(graph, *_MODE_OPS):
        from torchao.quantization.pt2e import (
            move_exported_model_to_eval,
            move_exported_model_to_train,
        )

        (move_exported_model_to_train if train else move_exported_model_to_eval)(graph)


def _observers(prepared: torch.fx.GraphModule) -> tuple[dict[str, Any], dict[str, Any]]:
    """(activation fake-quantisers, weight fake-quantisers) by module name, in graph order: a
    weight's observes a ``get_attr`` of a parameter, an activation's anything else."""
    activations: dict[str, Any] = {}
    weights: dict[str, Any] = {}
    for node in prepared.graph.nodes:
        if node.op == "call_module" and str(node.target).startswith(_OBSERVER):
            source = node.args[0]
            kind = weights if getattr(source, "op", None) == "get_attr" else activations
            kind[str(node.target)] = getattr(prepared, str(node.target))
    return activations, weights


def activation_ranges(prepared: torch.fx.GraphModule) -> Ranges:
    """Each activation observer's (min, max) as it stands; (0, 0) for one that saw nothing."""
    out: Ranges = {}
    for name, module in _observers(prepared)[0].items():
        observer = module.activation_post_process
        low, high = float(observer.min_val), float(observer.max_val)
        out[name] = (low, high) if math.isfinite(low) and math.isfinite(high) else (0.0, 0.0)
    return out


def set_activation_ranges(prepared: torch.fx.GraphModule, ranges: Mapping[str, tuple[float, float]], *,
                          freeze: bool) -> None:
    """Write ``ranges`` into the activation observers (a moving average then continues from them);
    ``freeze``: they stop observing, so the ranges stay as given. Every observer must be named."""
    activations = _observers(prepared)[0]
    if set(ranges) != set(activations):
        missing, extra = sorted(set(activations) - set(ranges)), sorted(set(ranges) - set(activations))
        raise EdgeError(f"activation ranges do not fit the model's observers (missing {missing[:3]}, unknown "
                        f"{extra[:3]}); they come from another architecture or library version")
    for name, module in activations.items():
        low, high = ranges[name]
        if not (math.isfinite(low) and math.isfinite(high) and low <= high):
            raise EdgeError(f"activation range of {name} is ({low}, {high}): not a finite interval")
        observer = module.activation_post_process
        observer.min_val.copy_(torch.tensor(low, dtype=observer.min_val.dtype))
        observer.max_val.copy_(torch.tensor(high, dtype=observer.max_val.dtype))
        if freeze:
            module.disable_observer()


def encode_ranges(ranges: Mapping[str, tuple[float, float]]) -> dict[str, NDArray[np.float32]]:
    """Ranges as the arrays that travel with the model: ``QAT_PREFIX + name`` → [asinh(min), asinh(max)]/16."""
    out = {}
    for name, (low, high) in ranges.items():
        encoded = np.arcsinh(np.array([low, high], dtype=np.float64)) / RANGE_DIVISOR
        if not np.all(np.abs(encoded) <= 1.0):
            raise EdgeError(f"activation {name} reaches ({low:.4g}, {high:.4g}), beyond the ±4.4e6 a federated QAT "
                            "range carries; scale the task's inputs or target")
        out[QAT_PREFIX + name] = encoded.astype(np.float32)
    return out


def decode_ranges(arrays: Mapping[str, NDArray[np.generic]]) -> Ranges:
    """The ranges among ``arrays`` (those under ``QAT_PREFIX``), back from asinh space."""
    out: Ranges = {}
    for key, value in arrays.items():
        if key.startswith(QAT_PREFIX):
            pair = np.sinh(np.asarray(value, dtype=np.float64).reshape(-1) * RANGE_DIVISOR)
            if pair.shape != (2,):
                raise ConfigError(f"QAT range array {key} has {pair.size} values, expected 2 (min, max)")
            out[key[len(QAT_PREFIX):]] = (float(pair[0]), float(pair[1]))
    return out


def fine_tune(prepared: torch.fx.GraphModule, features: torch.Tensor, labels: torch.Tensor, objective: Objective, *,
              epochs: int, batch_size: int, learning_rate: float, momentum: float, seed: int,
              keep_zeros: bool = False, optimizer: str = "sgd") -> float:
    """SGD (or Adam: ``optimizer``) with fake quantisation in the loop under the task's objective; the
    mean loss of the last epoch. ``keep_zeros``: weights that are exactly zero (pruned) are re-zeroed after every step.
    With ``epochs`` = 0 the observers see the data once (calibration only)."""
    generator = torch.Generator().manual_seed(seed)
    opt = (torch.optim.Adam(prepared.parameters(), lr=learning_rate) if optimizer == "adam"
           else torch.optim.SGD(prepared.parameters(), lr=learning_rate, momentum=momentum))
    masks = [(p, p != 0) for p in prepared.parameters() if p.dim() >= 2] if keep_zeros else []
    _set_mode(prepared, train=True)
    losses: list[float] = []
    for _ in range(epochs):
        losses = []
        order = torch.randperm(len(features), generator=generator)
        for start in range(0, len(features), batch_size):
            index = order[start: start + batch_size]
            opt.zero_grad()
            loss = objective.loss(prepared(features[index]), labels[index], reduction="mean")
            if not torch.isfinite(loss):
                raise EdgeError("QAT loss became NaN/Inf; lower the QAT learning rate")
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            losses.append(float(loss.detach()))
            with torch.no_grad():
                for parameter, keep in masks:
                    parameter.mul_(keep)
    if epochs == 0:
        with torch.no_grad():
            order = torch.randperm(len(features), generator=generator)
            for start in range(0, len(features), batch_size):
                prepared(features[order[start: start + batch_size]])
    _set_mode(prepared, train=False)
    return float(np.mean(losses)) if losses else math.nan


def load_trained(prepared: torch.fx.GraphModule, model: nn.Module) -> None:
    """Copy the prepared graph's trained parameters and buffers back into ``model`` (same names:
    ``torch.export`` keeps each one's qualified name)."""
    state = prepared.state_dict()
    own = model.state_dict()
    missing = [name for name in own if name not in state]
    if missing:
        raise EdgeError(f"the QAT graph lost the model's arrays {missing[:3]}")
    model.load_state_dict({name: state[name].detach().clone() for name in own})


def convert(prepared: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The INT8 graph of a prepared model, in eval mode."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e

    _set_mode(prepared, train=False)
    try:
        converted: torch.fx.GraphModule = convert_pt2e(prepared)
    except Exception as exc:
        raise EdgeError(f"cannot convert the QAT model to INT8: {exc}") from exc
    _set_mode(converted, train=False)
    return converted


def calibrated(model: nn.Module, example: torch.Tensor, ranges: Mapping[str, tuple[float, float]]) -> torch.fx.GraphModule:
    """The INT8 graph of ``model``'s weights with activation ranges from a federated QAT: the weight
    observers measure the weights as they are (one pass over ``example``, whose activations are not
    observed: the ranges stay as given)."""
    prepared = prepare(model, example)
    set_activation_ranges(prepared, ranges, freeze=True)
    for module in _observers(prepared)[1].values():
        module.activation_post_process.reset_min_max_vals()
        module.enable_observer()
    with torch.no_grad():
        prepared(example)
    return convert(prepared)
