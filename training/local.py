"""Local training (one process, via the engine) and evaluation on one department's data.

FedProx (Li et al., 2020) adds ``mu/2 · ||w − w_global||²`` to the local loss; with ``mu = 0`` this is
plain FedAvg local SGD. Ditto (Li et al., 2021) trains a personal model with the same term pulling it
towards the received global model instead of its own starting point (``anchor``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from quorumfl.core.data.datasets import Dataset
from quorumfl.training.engine import EngineSettings, TrainJob, proximal_term, train_model

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
    """SGD with momentum over ``epochs`` passes in this process (the engine with default settings);
    returns the mean loss of the last epoch.

    The proximal term pulls towards ``anchor`` (one tensor per parameter) when given, else towards
    the model's own parameters at the start.
    """
    job = TrainJob(epochs=epochs, batch_size=batch_size, learning_rate=learning_rate, momentum=momentum,
                   proximal_mu=proximal_mu, seed=seed)
    result = train_model(model, data, job, EngineSettings(device="cpu"), anchor=anchor).loop
    return TrainResult(loss=result.loss, num_examples=result.num_examples, steps=result.steps)


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
