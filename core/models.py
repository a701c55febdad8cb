"""Model registry by name: small MLPs and a CNN for image classification.

A model is identified by ``(name, input_shape, num_classes)``; the server and every node build the
same architecture from these, so only parameter arrays travel.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray
from torch import nn

from quorumfl.errors import ConfigError, ModelError

__all__ = [
    "CONTROL_PREFIX", "MODELS", "QAT_PREFIX", "architecture_key", "arrays_to_model", "build_model", "model_to_arrays", "seeded",
    "split_control",
]

Builder = Callable[[tuple[int, ...], int], nn.Module]


def _mlp(hidden: tuple[int, ...], activation: Callable[[], nn.Module] = nn.ReLU) -> Builder:
    def build(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
        layers: list[nn.Module] = [nn.Flatten()]
        width = math.prod(input_shape)
        for h in hidden:
            layers += [nn.Linear(width, h), activation()]
            width = h
        layers.append(nn.Linear(width, num_classes))
        return nn.Sequential(*layers)

    return build


def _cnn_of(c1: int, c2: int, hidden: int) -> Builder:
    def build(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
        channels, height, width = input_shape
        pooled = (height // 4) * (width // 4)
        if pooled == 0:
            raise ModelError(f"cnn needs inputs of at least 4x4 pixels, got {height}x{width}")
        return nn.Sequential(
            nn.Conv2d(channels, c1, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(c2 * pooled, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    return build


_cnn = _cnn_of(16, 32, 64)


MODELS: dict[str, Builder] = {
    "mlp": _mlp((128, 64)),
    # The same MLP with tanh: bounded activations keep per-example gradients small, so DP-SGD's
    # clipping discards less of them (Papernot et al., "Tempered Sigmoid Activations for Deep
    # Learning with Differential Privacy", AAAI 2021). The model to pick with dp = "local".
    "mlp-tanh": _mlp((128, 64), nn.Tanh),
    # About 1.1M parameters on 8x8 inputs; used by the round-overhead benchmark.
    "mlp-wide": _mlp((1024, 1024)),
    "cnn": _cnn,
    # Four times the channels: enough arithmetic per sample that INT8 kernels beat fp32 on a CPU
    # (for the small cnn, quantise/dequantise overhead dominates); the edge benchmark's model.
    "cnn-wide": _cnn_of(64, 128, 256),
}


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, *, seed: int = 0) -> nn.Module:
    """Build model ``name`` with deterministic initial weights for ``seed``."""
    try:
        builder = MODELS[name]
    except KeyError:
        raise ConfigError(f"model: unknown model '{name}'; choose one of {sorted(MODELS)}") from None
    if len(input_shape) != 3:
        raise ModelError(f"input_shape must be (channels, height, width), got {input_shape}")
    return seeded(lambda: builder(tuple(input_shape), num_classes), seed)


def seeded(build: Callable[[], nn.Module], seed: int) -> nn.Module:
    """``build()`` with torch's CPU generator (the one weight initialisation draws from) seeded,
    restoring the caller's state afterwards. Only that generator: ``torch.manual_seed`` would also
    reseed every accelerator's generator (never restored), and on a machine without one it queues
    their lazy seeding with a formatted stack trace each, ~13 ms per call in a fresh ClientApp task."""
    generator = torch.default_generator
    state = generator.get_state()
    try:
        generator.manual_seed(seed)
        return build()
    finally:
        generator.set_state(state)


def architecture_key(name: str, input_shape: tuple[int, ...], num_classes: int) -> str:
    """A string that two models share exactly when their parameter arrays are interchangeable."""
    return f"{name}:{'x'.join(str(d) for d in input_shape)}:{num_classes}"


def model_to_arrays(model: nn.Module) -> dict[str, NDArray[Any]]:
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}


CONTROL_PREFIX = "control:"  # SCAFFOLD's control variates travel with a model's arrays under these names
QAT_PREFIX = "qat-range:"  # a federated QAT round's activation ranges (quorumfl.training.qat) travel under these


def split_control(arrays: Mapping[str, NDArray[Any]]) -> tuple[dict[str, NDArray[Any]], dict[str, NDArray[Any]]]:
    """(the model's own arrays, SCAFFOLD's control variates by parameter name) of a server model; a
    federated QAT round's activation ranges (``QAT_PREFIX``) are in neither."""
    model = {k: v for k, v in arrays.items() if not k.startswith((CONTROL_PREFIX, QAT_PREFIX))}
    control = {k[len(CONTROL_PREFIX):]: v for k, v in arrays.items() if k.startswith(CONTROL_PREFIX)}
    return model, control


def arrays_to_model(model: nn.Module, arrays: dict[str, NDArray[np.generic]]) -> None:
    """Load named arrays into ``model``; names and shapes must match exactly."""
    state = model.state_dict()
    if set(arrays) != set(state):
        raise ModelError(
            f"parameter names do not match the model (missing {sorted(set(state) - set(arrays))}, "
            f"unexpected {sorted(set(arrays) - set(state))})"
        )
    for key, value in arrays.items():
        if tuple(value.shape) != tuple(state[key].shape):
            raise ModelError(f"'{key}' has shape {tuple(value.shape)}, the model expects {tuple(state[key].shape)}")
    model.load_state_dict({k: torch.from_numpy(np.array(v, copy=True)) for k, v in arrays.items()})
