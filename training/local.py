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
    """The task's metrics (``loss`` and its own, the primary among them) on ``num_examples`` examples."""

    metrics: dict[str, float]
    primary: str
    num_examples: int

    @property
    def loss(self) -> float:
        return self.metrics["loss"]

    @property
    def value(self) -> float:
        """The primary metric (accuracy, or MAE for regression)."""
        return self.metrics[self.primary]

    @property
    def accuracy(self) -> float:
        """Classification tasks' accuracy (NaN for a task that does not classify)."""
        return self.metrics.get("accuracy", math.nan)


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
    optimizer: str = "sgd",
) -> TrainResult:
    """SGD with momentum (or Adam) over ``epochs`` passes in this process (the engine with default settings);
    returns the mean loss of the last epoch.

    The proximal term pulls towards ``anchor`` (one tensor per parameter) when given, else towards
    the model's own parameters at the start.
    """
    job = TrainJob(epochs=epochs, batch_size=batch_size, learning_rate=learning_rate, momentum=momentum,
                   proximal_mu=proximal_mu, seed=seed, optimizer=optimizer)
    result = train_model(model, data, job, EngineSettings(device="cpu"), anchor=anchor).loop
    return TrainResult(loss=result.loss, num_examples=result.num_examples, steps=result.steps)


@torch.no_grad()
def evaluate(model: nn.Module, data: Dataset, *, batch_size: int = 512) -> EvalResult:
    """The task's metrics on ``data`` (mean loss; accuracy, or MAE and RMSE for regression)."""
    model.eval()
    objective = data.objective
    metrics = objective.measure(model, torch.from_numpy(data.x), torch.from_numpy(data.y), batch_size=batch_size)
    return EvalResult(metrics, objective.primary, len(data.y))
