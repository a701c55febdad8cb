"""Local training and evaluation on one department's data (single process, CPU or one GPU).

FedProx (Li et al., 2020) adds ``mu/2 · ||w − w_global||²`` to the local loss; with ``mu = 0`` this is
plain FedAvg local SGD. Ditto (Li et al., 2021) trains a personal model with the same term pulling it
towards the received global model instead of its own starting point (``anchor``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from quorumfl.aggregation.errors import ConfigError

from .data.datasets import Dataset

__all__ = ["EvalResult", "TrainResult", "evaluate", "proximal_term", "train"]


@dataclass(frozen=True)
class TrainResult:
    loss: float
    num_examples: int
    steps: int


@dataclass(frozen=True)
class EvalResult:
    loss: float
    accuracy: float
    num_examples: int


def proximal_term(model: nn.Module, global_params: list[torch.Tensor], mu: float) -> torch.Tensor:
    """``mu/2 · Σ ||w − w_g||²`` over the trainable parameters (FedProx)."""
    total = torch.zeros((), dtype=torch.float32)
    for w, wg in zip(model.parameters(), global_params, strict=True):
        total = total + (w - wg).pow(2).sum()
    return 0.5 * mu * total


def train(
    model: nn.Module,
    data: Dataset,
    *,
    epochs: int,
    batch_size: int,
    learning_rate: float,
    proximal_mu: float = 0.0,
    seed: int = 0,
    momentum: float = 0.9,
    anchor: list[torch.Tensor] | None = None,
) -> TrainResult:
    """SGD with momentum over ``epochs`` passes; returns the mean loss of the last epoch.

    The proximal term pulls towards ``anchor`` (one tensor per parameter) when given, else towards
    the model's own parameters at the start.
    """
    if epochs < 1 or batch_size < 1 or not learning_rate > 0 or proximal_mu < 0:
        raise ConfigError(
            f"invalid training settings: epochs={epochs}, batch_size={batch_size}, "
            f"learning_rate={learning_rate}, proximal_mu={proximal_mu}"
        )
    generator = torch.Generator().manual_seed(seed)
    x = torch.from_numpy(data.x)
    y = torch.from_numpy(data.y)
    global_params = [p.detach().clone() for p in model.parameters()] if anchor is None else list(anchor)
    if len(global_params) != len(list(model.parameters())):
        raise ConfigError(f"anchor has {len(global_params)} tensors, the model {len(list(model.parameters()))} parameters")
    optimizer = torch.optim.SGD(model.parameters(), lr=learning_rate, momentum=momentum)
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    steps = 0
    epoch_loss = math.nan
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=generator)
        total, seen = 0.0, 0
        for start in range(0, len(y), batch_size):
            batch = order[start : start + batch_size]
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x[batch]), y[batch])
            if proximal_mu > 0:
                loss = loss + proximal_term(model, global_params, proximal_mu)
            loss.backward()
            optimizer.step()
            total += float(loss.detach()) * len(batch)
            seen += len(batch)
            steps += 1
        epoch_loss = total / max(seen, 1)
    return TrainResult(loss=epoch_loss, num_examples=len(y), steps=steps)


@torch.no_grad()
def evaluate(model: nn.Module, data: Dataset, *, batch_size: int = 512) -> EvalResult:
    """Mean cross-entropy and accuracy on ``data``."""
    model.eval()
    if len(data) == 0:
        return EvalResult(loss=math.nan, accuracy=math.nan, num_examples=0)
    x = torch.from_numpy(data.x)
    y = torch.from_numpy(data.y)
    loss_sum, correct = 0.0, 0
    for start in range(0, len(y), batch_size):
        logits = model(x[start : start + batch_size])
        target = y[start : start + batch_size]
        loss_sum += float(nn.functional.cross_entropy(logits, target, reduction="sum"))
        correct += int((logits.argmax(dim=1) == target).sum())
    return EvalResult(loss=loss_sum / len(y), accuracy=correct / len(y), num_examples=len(y))
