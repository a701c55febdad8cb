"""What a model is trained to minimise and how it is scored: classification or regression.

An ``Objective`` gives the training loss (summed over a batch, so workers and micro-batches add up),
the metrics of a batch as sums that add across batches and departments, and which metric is the
task's primary one (its name, and whether higher is better). The training engine, DP-SGD, the node's
evaluation, the server's evaluation and the reports all ask the objective instead of assuming
cross-entropy and accuracy.

Regression targets are stored scaled to [0, 1] by the schema's declared range (``Regression.scale``
is that range's width), so training sees well-conditioned values; ``mae`` and ``rmse`` are reported
back in the target's own unit.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from quorumfl.core.metric_names import (
    CLASSIFICATION_PRIMARY,
    PRIMARY_METRICS,
    REGRESSION_PRIMARY,
    primary_among,
)

if TYPE_CHECKING:  # torch loads only where a model runs: the data layer and the ClientApp import this without it
    import torch

__all__ = ["CLASSIFICATION", "PRIMARY_METRICS", "Classification", "Objective", "Regression", "primary_among"]


class Objective(ABC):
    """A task's loss and metrics; frozen and picklable (it travels to DDP workers)."""

    name: str
    primary: str  # the metric that counts for this task
    higher_is_better: bool

    @abstractmethod
    def loss(self, outputs: torch.Tensor, targets: torch.Tensor, *, reduction: str = "sum") -> torch.Tensor:
        """The training loss of a batch (``reduction`` ``sum`` or ``mean``)."""

    @abstractmethod
    def sums(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
        """Additive statistics of a batch (summed over its examples)."""

    @abstractmethod
    def finish(self, sums: Mapping[str, float], count: int) -> dict[str, float]:
        """The metrics (``loss`` and the task's own, the primary included) from ``sums`` over ``count`` examples."""

    def measure(self, predict: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, y: torch.Tensor, *,
                batch_size: int = 512) -> dict[str, float]:
        """The metrics of ``predict`` (a model, or an exported artifact's runner) over ``(x, y)`` in
        batches: the batches' sums added, then ``finish``."""
        sums: dict[str, float] = {}
        for start in range(0, len(y), batch_size):
            for name, value in self.sums(predict(x[start : start + batch_size]), y[start : start + batch_size]).items():
                sums[name] = sums.get(name, 0.0) + value
        return self.finish(sums, len(y))

    def score(self, value: float) -> float:
        """The primary metric turned so that higher is better (for selection rewards and comparisons)."""
        return value if self.higher_is_better else -value

    @property
    def unit(self) -> float:
        """The primary metric's unit: a secure sum carries ``value / unit``, which a reasonable model
        keeps near [0, 1] (accuracy as it is; MAE as a share of the target's declared range)."""
        return 1.0


@dataclass(frozen=True)
class Classification(Objective):
    """Cross-entropy over class logits; metrics ``accuracy`` (primary) and ``loss``."""

    name: str = "classification"
    primary: str = CLASSIFICATION_PRIMARY
    higher_is_better: bool = True

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor, *, reduction: str = "sum") -> torch.Tensor:
        from torch.nn.functional import cross_entropy

        return cross_entropy(outputs, targets, reduction=reduction)

    def sums(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
        return {"loss": float(self.loss(outputs, targets)), "correct": float((outputs.argmax(dim=1) == targets).sum())}

    def finish(self, sums: Mapping[str, float], count: int) -> dict[str, float]:
        if count == 0:
            return {"loss": math.nan, "accuracy": math.nan}
        return {"loss": sums["loss"] / count, "accuracy": sums["correct"] / count}


@dataclass(frozen=True)
class Regression(Objective):
    """Squared error on a target scaled to [0, 1] (the model's single output); metrics ``mae``
    (primary, lower is better) and ``rmse`` in the target's unit (× ``scale``), ``loss`` (scaled MSE)."""

    scale: float = 1.0
    name: str = "regression"
    primary: str = REGRESSION_PRIMARY
    higher_is_better: bool = False

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor, *, reduction: str = "sum") -> torch.Tensor:
        from torch.nn.functional import mse_loss

        return mse_loss(outputs.reshape(targets.shape), targets, reduction=reduction)

    def sums(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
        error = outputs.reshape(targets.shape).double() - targets.double()
        return {"loss": float((error**2).sum()), "abs": float(error.abs().sum())}

    @property
    def unit(self) -> float:
        return self.scale

    def finish(self, sums: Mapping[str, float], count: int) -> dict[str, float]:
        if count == 0:
            return {"loss": math.nan, "mae": math.nan, "rmse": math.nan}
        mse = sums["loss"] / count
        return {"loss": mse, "mae": sums["abs"] / count * self.scale, "rmse": math.sqrt(mse) * self.scale}


CLASSIFICATION = Classification()
